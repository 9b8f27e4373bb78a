//! Per-layer work on recorded FFN inputs: recomputing `h`, thresholds and neuron statistics,
//! training the predictors, and measuring them.

use std::time::Instant;

use nalgebra::DMatrix;

use crate::backend::cpu::{Kernels, Precision, QuantizedActs};
use crate::model::{Down, FfnActivation, LayerWeights};
use crate::predict::Predictor;
use crate::sparsity::{RecallCounter, cutoff_for_recall};

/// Tokens per mat-mat call.
const BATCH: usize = 32;

/// `h = act(gate·x) * (up·x)` and `|up·x|` of every token of `xs` (`(tokens, d_model)`), each
/// `(tokens, n_ff)` token-major, in exact precision.
pub(crate) fn activations(
    layer: &LayerWeights,
    activation: FfnActivation,
    xs: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (n_ff, d) = (layer.ffn.gate.rows, layer.ffn.gate.cols);
    let n = xs.len() / d;
    let (mut h, mut u) = (vec![0f32; n * n_ff], vec![0f32; n * n_ff]);
    let k = Kernels::best();
    let mut acts = QuantizedActs::new(0);
    for s in (0..n).step_by(BATCH) {
        let m = BATCH.min(n - s);
        let x = k.prepare(&xs[s * d..(s + m) * d], Precision::Exact, &mut acts);
        k.matmats(
            x,
            m,
            [
                (&layer.ffn.gate, &mut h[s * n_ff..(s + m) * n_ff]),
                (&layer.ffn.up, &mut u[s * n_ff..(s + m) * n_ff]),
            ],
        );
    }
    for (h, u) in h.iter_mut().zip(u.iter_mut()) {
        *h = activation.apply(*h) * *u;
        *u = u.abs();
    }
    (h, u)
}

/// The `|h|` value below which a `sparsity` fraction of `h` lies (0 for an empty `h`).
pub(crate) fn threshold(h: &[f32], sparsity: f32) -> f32 {
    if h.is_empty() || sparsity <= 0.0 {
        return 0.0;
    }
    let mut a: Vec<f32> = h.iter().map(|v| v.abs()).collect();
    let k = ((sparsity.min(1.0) as f64 * a.len() as f64) as usize).min(a.len() - 1);
    *a.select_nth_unstable_by(k, f32::total_cmp).1
}

/// Per-neuron statistics of one layer over the calibration tokens.
#[derive(Debug)]
pub(crate) struct NeuronStats {
    /// Fraction of tokens on which the neuron is active ([`crate::sparsity::is_active`]).
    pub freq: Vec<f32>,
    pub mean_abs_h: Vec<f32>,
    pub mean_abs_u: Vec<f32>,
}

pub(crate) fn neuron_stats(h: &[f32], abs_u: &[f32], n_ff: usize, thr: f32) -> NeuronStats {
    let n = (h.len() / n_ff).max(1) as f32;
    let mut s = NeuronStats {
        freq: vec![0.0; n_ff],
        mean_abs_h: vec![0.0; n_ff],
        mean_abs_u: vec![0.0; n_ff],
    };
    for (hr, ur) in h.chunks_exact(n_ff).zip(abs_u.chunks_exact(n_ff)) {
        for i in 0..n_ff {
            s.freq[i] += f32::from(u8::from(crate::sparsity::is_active(hr[i], thr)));
            s.mean_abs_h[i] += hr[i].abs();
            s.mean_abs_u[i] += ur[i];
        }
    }
    for v in [&mut s.freq, &mut s.mean_abs_h, &mut s.mean_abs_u] {
        v.iter_mut().for_each(|x| *x /= n);
    }
    s
}

/// The `(tokens, n_ff)` 0/1 activity matrix of `h` at `thr`.
pub(crate) fn active_matrix(h: &[f32], n_ff: usize, thr: f32) -> DMatrix<f32> {
    let n = h.len() / n_ff;
    DMatrix::from_fn(n, n_ff, |t, i| {
        f32::from(u8::from(crate::sparsity::is_active(h[t * n_ff + i], thr)))
    })
}

/// Recorded tokens of one layer: inputs `xs` (`(tokens, d_model)`) and activations `h`
/// (`(tokens, n_ff)`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recorded<'a> {
    pub xs: &'a [f32],
    pub h: &'a [f32],
    pub d_model: usize,
    pub n_ff: usize,
}

impl Recorded<'_> {
    fn tokens(&self) -> impl Iterator<Item = (&[f32], &[f32])> {
        self.xs
            .chunks_exact(self.d_model)
            .zip(self.h.chunks_exact(self.n_ff))
    }
}

/// Score cut-off of predictor `p` on layer `l` reaching `recall` of the neurons active
/// ([`crate::sparsity::is_active`] at `thr`) in the recorded tokens.
pub(crate) fn cutoff(p: &dyn Predictor, l: usize, r: Recorded<'_>, thr: f32, recall: f32) -> f32 {
    let mut scratch = p.scratch();
    let mut scores = vec![0f32; r.n_ff];
    let mut active = Vec::new();
    for (x, hr) in r.tokens() {
        p.score(l, x, &mut scratch, &mut scores);
        active.extend(
            scores
                .iter()
                .zip(hr)
                .filter(|(_, h)| crate::sparsity::is_active(**h, thr))
                .map(|(s, _)| *s),
        );
    }
    cutoff_for_recall(&mut active, recall)
}

/// Recall and fetch fraction of predictor `p` on layer `l` at `cutoff`, and the time its scoring
/// took in total. `selected` becomes the `(tokens, n_ff)` mask of the neurons whose score is
/// `>= cutoff` (what [`RecallCounter`] counts as fetched).
pub(crate) fn measure(
    p: &dyn Predictor,
    l: usize,
    r: Recorded<'_>,
    thr: f32,
    cutoff: f32,
    counter: &mut RecallCounter,
    selected: &mut Vec<bool>,
) -> std::time::Duration {
    let mut scratch = p.scratch();
    let mut scores = vec![0f32; r.n_ff];
    let mut spent = std::time::Duration::ZERO;
    selected.clear();
    for (x, hr) in r.tokens() {
        let t0 = Instant::now();
        p.score(l, x, &mut scratch, &mut scores);
        spent += t0.elapsed();
        counter.add(&scores, cutoff, |i| crate::sparsity::is_active(hr[i], thr));
        selected.extend(scores.iter().map(|&s| s >= cutoff));
    }
    spent
}

/// Per neuron: the share of the tokens of a `(tokens, n_ff)` mask in which it is set.
pub(crate) fn selection_probabilities(selected: &[bool], n_ff: usize) -> Vec<f32> {
    let mut count = vec![0u32; n_ff];
    for row in selected.chunks_exact(n_ff) {
        for (c, &s) in count.iter_mut().zip(row) {
            *c += u32::from(s);
        }
    }
    let n = (selected.len() / n_ff).max(1) as f32;
    count.iter().map(|&c| c as f32 / n).collect()
}

/// The quality-cost proxy of running layer `layer` sparsely: the relative RMS error, pooled over
/// the tokens of `h` (`(tokens, n_ff)`), of the FFN output `Σ_i ĥ_i·down_i` against the dense
/// `Σ_i h_i·down_i`, where `ĥ_i = h_i` when the neuron is active at `thr` and set in `selected`
/// (the predictor picked it), else 0. Neuron granularity: the pipeline computes whole chunks, so
/// it may compute (and keep) a few active neurons the predictor did not pick.
pub(crate) fn output_error(layer: &LayerWeights, h: &[f32], thr: f32, selected: &[bool]) -> f64 {
    let n_ff = layer.ffn.gate.rows;
    let d = layer.ffn.gate.cols;
    let k = Kernels::best();
    let parts = crate::backend::cpu::compute_threads().max(1);
    let mut partials = vec![0f32; parts * d];
    let mut acts = QuantizedActs::new(0);
    let (mut out, mut missing) = (vec![0f32; d], vec![0f32; n_ff]);
    let (mut err2, mut norm2) = (0f64, 0f64);
    let mut down = |h: &[f32], out: &mut [f32]| match &layer.ffn.down {
        Down::Rows(m) => k.matvec(m, h, out, Precision::Exact, &mut acts),
        Down::Neurons(m) => crate::backend::cpu::down_neurons(k, m, h, &mut partials, out),
    };
    for (hr, sr) in h.chunks_exact(n_ff).zip(selected.chunks_exact(n_ff)) {
        down(hr, &mut out);
        norm2 += out
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>();
        for ((m, &v), &s) in missing.iter_mut().zip(hr).zip(sr) {
            *m = if s && crate::sparsity::is_active(v, thr) {
                0.0
            } else {
                v
            };
        }
        down(&missing, &mut out);
        err2 += out
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>();
    }
    if norm2 > 0.0 {
        (err2 / norm2).sqrt()
    } else {
        0.0
    }
}
