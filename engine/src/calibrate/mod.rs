//! `leanstream calibrate`: thresholds, neuron statistics and predictors for sparse FFN execution,
//! written into the `.lsm` file.
//!
//! 1. The engine's forward pass (exact precision, [`Windows`]) runs over the calibration text in
//!    windows of at most [`CalibrateOptions::window`] tokens, recording every layer's normalised
//!    FFN input `xn` ([`Collector`]).
//! 2. Per layer, `h = act(gate·xn) * (up·xn)` is recomputed for every recorded token. The layer's
//!    threshold is the `sparsity` quantile of `|h|` (TEAL, arXiv 2408.14690: one magnitude cut
//!    per layer on the down projection's input); a neuron is *active* when `h != 0` and
//!    `|h| >= threshold` ([`crate::sparsity::is_active`], the pipeline's rule too). ReLU models
//!    are exactly sparse and get threshold 0. Per-neuron activation frequency, mean `|h|` and
//!    mean `|up·xn|` are recorded.
//! 3. Both predictors ([`crate::predict`]) are trained on the recorded tokens, and each layer's
//!    score cut-off is set to reach [`CalibrateOptions::target_recall`] of the active neurons.
//! 4. On held-out text (never the calibration text) the same dense pass measures perplexity of the
//!    dense model and of the thresholded one ([`perplexity`]), and each predictor's recall,
//!    fetch fraction and scoring time at its cut-offs; per neuron, the probability `q_i` that the
//!    predictor selects it (tensor `select.{l}`, mean = the layer's fetch fraction); per layer, a
//!    quality cost of running it sparsely (tensor `quality_cost`). The cost is a proxy, not a
//!    held-out NLL change (that would need one perplexity pass per layer): the relative RMS error
//!    of the layer's FFN output with the thresholds and the predictor applied at neuron
//!    granularity, against the dense FFN output, over the recorded held-out tokens.
//! 5. Optionally neurons are reordered by activation frequency ([`reorder`]), and everything is
//!    written into a new file ([`crate::model::lsm::write_calibrated`]).

mod activity;
mod ffn;
mod layer;
pub mod reorder;
mod windows;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nalgebra::DMatrix;

pub use activity::{ActivityOptions, ActivityReport, LayerActivity, measure_activity};
pub use ffn::{Collector, DenseFfn, Thresholded};
pub use windows::Windows;

use crate::forward::Model;
use crate::model::FfnActivation;
use crate::model::lsm::{
    CalTensor, Calibration, LsmFile, PredictorKind, PredictorMeta, write_calibrated,
};
use crate::predict::{Hashing, HashingParams, LowRank, LowRankParams, Predictor};
use crate::sparsity::RecallCounter;
use crate::{Error, Result};

/// The default calibration text (`data/text/calibration.txt`, written for the project).
pub const CALIBRATION_TEXT: &str = include_str!("../../../data/text/calibration.txt");
/// The held-out evaluation text (`data/text/heldout-eval.txt`), disjoint from the above.
pub const HELDOUT_TEXT: &str = include_str!("../../../data/text/heldout-eval.txt");
/// [`Calibration::text_source`] of the built-in text.
pub const BUILTIN_TEXT_SOURCE: &str = "builtin:data/text/calibration.txt";

/// Calibration settings.
#[derive(Clone, Debug)]
pub struct CalibrateOptions {
    /// Target fraction of FFN activations below threshold, per layer, in `[0, 1)`. Default 0.4:
    /// on SmolLM2 the highest level whose thresholded held-out perplexity stays within 2 % of
    /// dense (+1.6 %; 0.5 costs +2.3 %), from `scripts/frontier` (`docs/bench/sparse.md`,
    /// "The frontier").
    pub sparsity: f32,
    /// Most calibration tokens used. Default 4096.
    pub max_tokens: usize,
    /// Tokens per window (each from an empty context). Default 256.
    pub window: usize,
    /// Most held-out tokens used for the quality and predictor measurements. Default 1024.
    pub eval_tokens: usize,
    /// Reorder neurons by activation frequency. Default off.
    pub reorder: bool,
    /// Recall of active neurons the predictors' cut-offs are set for. Default 0.95.
    pub target_recall: f32,
    pub lowrank: LowRankParams,
    pub hashing: HashingParams,
    /// Recorded as [`Calibration::text_source`].
    pub text_source: String,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            sparsity: 0.4,
            max_tokens: 4096,
            window: 256,
            eval_tokens: 1024,
            reorder: false,
            target_recall: 0.95,
            lowrank: LowRankParams::default(),
            hashing: HashingParams::default(),
            text_source: BUILTIN_TEXT_SOURCE.into(),
        }
    }
}

/// What [`calibrate`] is doing, for progress reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Running the dense model over the calibration text (windows).
    Collect,
    /// Thresholds, statistics and predictors (layers).
    Train,
    /// Held-out measurements (windows).
    Evaluate,
    /// Writing the file.
    Write,
}

/// Effect of reordering on the chunks a token's active neurons span.
#[derive(Clone, Debug, PartialEq)]
pub struct ReorderReport {
    pub chunks_per_layer: usize,
    /// Mean over held-out token-layers of chunks holding an active neuron, before and after.
    pub chunks_touched_before: f64,
    pub chunks_touched_after: f64,
}

/// Perplexity of a text under the dense or thresholded model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    /// Predicted tokens.
    pub tokens: usize,
    /// Mean negative log-likelihood, nats.
    pub nll: f64,
    /// Fraction of FFN activations zeroed by the thresholds (0 for dense).
    pub sparsity: f64,
}

impl Perplexity {
    /// `exp(nll)`.
    pub fn ppl(&self) -> f64 {
        self.nll.exp()
    }
}

/// What a calibration measured and wrote.
#[derive(Clone, Debug)]
pub struct CalibrateReport {
    pub calibration_tokens: usize,
    pub thresholds: Vec<f32>,
    pub dense: Perplexity,
    pub thresholded: Perplexity,
    pub predictors: Vec<PredictorMeta>,
    /// Per predictor, per layer: the quality cost written as `quality_cost` (relative RMS error
    /// of the FFN output run sparsely, on held-out tokens; [`Calibration::QUALITY_COST_FFN_ERROR`]).
    pub quality_cost: Vec<(PredictorKind, Vec<f32>)>,
    pub reorder: Option<ReorderReport>,
    pub file_bytes: u64,
}

/// Teacher-forced perplexity of `ids` in windows of `window` tokens (each from an empty context,
/// its first token not predicted), exact precision, with `thresholds` applied to `h` when given.
/// The sparse pipeline's quality oracle uses the same definition.
pub fn perplexity(
    model: &Arc<Model>,
    ids: &[u32],
    window: usize,
    thresholds: Option<&[f32]>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Perplexity> {
    let mut windows = Windows::new(model, window)?;
    let mut exec = Thresholded::new(&model.weights.config, thresholds.map(<[f32]>::to_vec));
    windows
        .run(ids, &mut exec, progress)
        .map(|(nll, tokens)| Perplexity {
            tokens,
            nll,
            sparsity: exec.zeroed as f64 / exec.seen.max(1) as f64,
        })
}

fn check(opts: &CalibrateOptions) -> Result<()> {
    let bad = |arg: &'static str, reason: String| Err(Error::InvalidArgument { arg, reason });
    if !(0.0..1.0).contains(&opts.sparsity) {
        return bad("sparsity", format!("{} is outside [0, 1)", opts.sparsity));
    }
    if !(opts.target_recall > 0.0 && opts.target_recall <= 1.0) {
        return bad(
            "target_recall",
            format!("{} is outside (0, 1]", opts.target_recall),
        );
    }
    if opts.max_tokens < 2 || opts.eval_tokens < 2 {
        return bad(
            "tokens",
            "at least 2 calibration and 2 held-out tokens".into(),
        );
    }
    Ok(())
}

/// Calibrates the `.lsm` file `src` on `text`, measures on `eval_text`, and writes the result to
/// `dst` (which may be `src`). `progress(stage, done, total)` is called as work completes.
pub fn calibrate(
    src: &Path,
    dst: &Path,
    text: &str,
    eval_text: &str,
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(Stage, usize, usize),
) -> Result<CalibrateReport> {
    check(opts)?;
    let file = LsmFile::open(src)?;
    file.verify_streamed(src)?;
    let tok = file.tokenizer()?;
    let model = Arc::new(Model {
        path: src.to_path_buf(),
        weights: file.weights(src, tok.clone())?,
        tokenizer: tok.clone(),
        chat_template: None,
        planned: None,
        piece_bytes: crate::plan::PIECE_BYTES,
    });
    let w = &model.weights;
    let c = &w.config;
    let (d, n_ff) = (c.d_model, c.n_ff);
    let window = opts.window.clamp(2, c.context_length);
    let mut ids = tok.encode(text)?;
    ids.truncate(opts.max_tokens);
    let mut eval_ids = tok.encode(eval_text)?;
    eval_ids.truncate(opts.eval_tokens);

    let mut windows = Windows::new(&model, window)?;
    let mut calib = Collector::new(c, ids.len());
    windows.run(&ids, &mut calib, &mut |i, n| progress(Stage::Collect, i, n))?;
    let mut held = Collector::new(c, eval_ids.len());
    let (dense_nll, dense_n) = windows.run(&eval_ids, &mut held, &mut |_, _| {})?;

    let mut lowrank = LowRank::new(opts.lowrank.rank, d, n_ff, c.activation);
    let mut hashing = Hashing::new(opts.hashing, d, n_ff);
    let mut thresholds = Vec::with_capacity(c.n_layers);
    let mut tensors = Vec::new();
    let mut freqs = Vec::with_capacity(c.n_layers);
    let kinds = PredictorKind::ALL;
    let mut cutoffs = vec![Vec::with_capacity(c.n_layers); kinds.len()];
    let mut counters = vec![RecallCounter::default(); kinds.len()];
    let mut spent = vec![Duration::ZERO; kinds.len()];
    let (mut touched_before, mut touched_after) = (0u64, 0u64);
    let mut selected = Vec::new();
    let mut quality = vec![Vec::with_capacity(c.n_layers); kinds.len()];
    let k = file.header.ffn.chunk_neurons;
    for (l, lw) in w.layers.iter().enumerate() {
        let xs = calib.layer_f32(l);
        let (h, abs_u) = layer::activations(lw, c.activation, &xs);
        let thr = match c.activation {
            FfnActivation::Relu => 0.0,
            FfnActivation::Silu | FfnActivation::GeluTanh => layer::threshold(&h, opts.sparsity),
        };
        thresholds.push(thr);
        let stats = layer::neuron_stats(&h, &abs_u, n_ff, thr);
        let x = DMatrix::from_row_slice(xs.len() / d, d, &xs);
        let svd = crate::predict::gate_svd(&lw.ffn.gate, &x);
        lowrank.push_layer(&svd, &stats.mean_abs_u);
        hashing.push_layer(
            &svd,
            &x,
            &layer::active_matrix(&h, n_ff, thr),
            opts.hashing.ridge,
        );
        let rec = layer::Recorded {
            xs: &xs,
            h: &h,
            d_model: d,
            n_ff,
        };
        let predictors: [&dyn Predictor; 2] = [&lowrank, &hashing];
        for (j, p) in predictors.iter().enumerate() {
            cutoffs[j].push(layer::cutoff(*p, l, rec, thr, opts.target_recall));
        }

        // Held-out measurements of this layer.
        let xs_eval = held.layer_f32(l);
        let (h_eval, _) = layer::activations(lw, c.activation, &xs_eval);
        let rec = layer::Recorded {
            xs: &xs_eval,
            h: &h_eval,
            d_model: d,
            n_ff,
        };
        for (j, p) in predictors.iter().enumerate() {
            spent[j] += layer::measure(
                *p,
                l,
                rec,
                thr,
                cutoffs[j][l],
                &mut counters[j],
                &mut selected,
            );
            // q_i in the order of the neurons here; a reordering permutes the tensor with them.
            let q = layer::selection_probabilities(&selected, n_ff);
            tensors.push(
                CalTensor::f32(kinds[j].selection_tensor(l), Some(l), vec![n_ff], &q)
                    .neuron_major(),
            );
            quality[j].push(layer::output_error(lw, &h_eval, thr, &selected) as f32);
        }
        let order = reorder::by_frequency(std::slice::from_ref(&stats.freq));
        touched_before += reorder::chunks_touched(&h_eval, n_ff, thr, k, None);
        touched_after += reorder::chunks_touched(&h_eval, n_ff, thr, k, Some(&order[0]));

        let name = |s: &str| format!("{s}.{l}");
        tensors.push(CalTensor::f32(name("freq"), Some(l), vec![n_ff], &stats.freq).neuron_major());
        tensors.push(
            CalTensor::f32(name("mean_abs_h"), Some(l), vec![n_ff], &stats.mean_abs_h)
                .neuron_major(),
        );
        freqs.push(stats.freq);
        progress(Stage::Train, l + 1, c.n_layers);
    }

    progress(Stage::Evaluate, 0, 1);
    let thresholded = perplexity(&model, &eval_ids, window, Some(&thresholds), &mut |i, n| {
        progress(Stage::Evaluate, i, n)
    })?;
    let dense = Perplexity {
        tokens: dense_n,
        nll: dense_nll,
        sparsity: 0.0,
    };
    let token_layers = (held.tokens() * c.n_layers).max(1) as f64;
    let predictors: Vec<PredictorMeta> = kinds
        .iter()
        .enumerate()
        .map(|(j, &kind)| PredictorMeta {
            kind: Some(kind),
            rank: if kind == PredictorKind::LowRank {
                lowrank.rank()
            } else {
                0
            },
            bits: if kind == PredictorKind::Hashing {
                hashing.shape().0
            } else {
                0
            },
            stages: if kind == PredictorKind::Hashing {
                hashing.shape().1
            } else {
                0
            },
            bytes: [lowrank.bytes(), hashing.bytes()][j],
            target_recall: opts.target_recall,
            cutoffs: cutoffs[j].clone(),
            heldout_recall: counters[j].recall() as f32,
            heldout_fetch_fraction: counters[j].fetch_fraction() as f32,
            heldout_us_per_layer: (spent[j].as_secs_f64() * 1e6 / token_layers) as f32,
        })
        .collect();
    tensors.extend(lowrank.tensors());
    tensors.extend(hashing.tensors());
    for (kind, q) in kinds.iter().zip(&quality) {
        tensors.push(CalTensor::f32(
            kind.quality_cost_tensor(),
            None,
            vec![c.n_layers],
            q,
        ));
    }
    let reorder_perm = opts.reorder.then(|| reorder::by_frequency(&freqs));
    let reorder_report = opts.reorder.then(|| ReorderReport {
        chunks_per_layer: n_ff.div_ceil(k),
        chunks_touched_before: touched_before as f64 / token_layers,
        chunks_touched_after: touched_after as f64 / token_layers,
    });

    progress(Stage::Write, 0, 1);
    let calibration = Calibration {
        target_sparsity: opts.sparsity,
        tokens: calib.tokens(),
        text_source: opts.text_source.clone(),
        thresholds: thresholds.clone(),
        section: None,
        tensors: Vec::new(),
        predictors: predictors.clone(),
        heldout_ppl_dense: dense.ppl() as f32,
        heldout_ppl_thresholded: thresholded.ppl() as f32,
        quality_cost_source: Calibration::QUALITY_COST_FFN_ERROR.into(),
    };
    let file_bytes = write_calibrated(&file, dst, calibration, tensors, reorder_perm.as_deref())?;
    progress(Stage::Write, 1, 1);
    Ok(CalibrateReport {
        calibration_tokens: calib.tokens(),
        thresholds,
        dense,
        thresholded,
        predictors,
        quality_cost: kinds.iter().copied().zip(quality).collect(),
        reorder: reorder_report,
        file_bytes,
    })
}
