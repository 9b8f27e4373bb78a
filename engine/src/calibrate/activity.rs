//! What a calibrated model's FFN neurons do from one token to the next, measured with the
//! engine's dense forward pass (exact precision, an f32 KV cache unless told otherwise) over a
//! text in one window: per
//! layer, the share of a token's active neurons (`|h| >= threshold`,
//! [`crate::sparsity::is_active`] at the file's thresholds) also active on the previous token
//! (the carry-over a neuron cache can exploit), the same figure for independent tokens with the
//! measured frequencies (`E[f²] / E[f]`), sparsity, and the recall and fetch fraction of a
//! predictor at its stored cut-offs. `leanstream synth` reports it for the file it wrote.

use std::path::Path;

use std::sync::Arc;

use super::{Collector, layer};
use crate::backend::cpu::Precision;
use crate::forward::{Model, Session};
use crate::kv::KvType;
use crate::model::lsm::synth::MeasuredActivity;
use crate::model::lsm::{LsmFile, PredictorKind};
use crate::sparsity::RecallCounter;
use crate::{Error, Result};

/// What to measure.
#[derive(Clone, Debug)]
pub struct ActivityOptions {
    /// Most tokens of the text run (also capped by the context length). Default 256.
    pub max_tokens: usize,
    /// Leading positions left out of every figure (a context's first positions may behave
    /// differently, e.g. the warm-up of a synthetic model's token correlation). Default 0.
    pub skip: usize,
    /// The predictor measured at its stored cut-offs (none: recall and fetch fraction are 0).
    /// Default [`PredictorKind::DEFAULT`].
    pub predictor: Option<PredictorKind>,
    /// The KV cache's type. Default f32 (the reference numbers); the daemon's default is f16.
    pub kv: KvType,
}

impl Default for ActivityOptions {
    fn default() -> Self {
        ActivityOptions {
            max_tokens: 256,
            skip: 0,
            predictor: Some(PredictorKind::DEFAULT),
            kv: KvType::F32,
        }
    }
}

/// One layer's figures (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerActivity {
    pub carry_over: f64,
    pub independent_carry_over: f64,
    pub sparsity: f64,
    pub recall: f64,
    pub fetch_fraction: f64,
}

/// Per layer and pooled over the layers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ActivityReport {
    /// Tokens run, and how many leading ones the figures leave out.
    pub tokens: usize,
    pub skipped: usize,
    pub layers: Vec<LayerActivity>,
    /// Pooled: `Σ |A_t ∩ A_{t−1}| / Σ |A_{t−1}|` over layers and token pairs.
    pub carry_over: f64,
    /// Mean over layers of their `E[f²] / E[f]`.
    pub independent_carry_over: f64,
    pub sparsity: f64,
    pub recall: f64,
    pub fetch_fraction: f64,
    /// Per position (all of them, skipped ones included): the share of neurons active, mean over
    /// the layers.
    pub active_by_position: Vec<f64>,
}

impl ActivityReport {
    /// The figures `leanstream synth` reports ([`crate::model::lsm::synth::SynthReport::measured`]).
    pub fn to_synth(&self) -> MeasuredActivity {
        MeasuredActivity {
            tokens: self.tokens,
            skipped: self.skipped,
            carry_over_by_layer: self.layers.iter().map(|l| l.carry_over).collect(),
            carry_over: self.carry_over,
            independent_carry_over: self.independent_carry_over,
            sparsity: self.sparsity,
            recall: self.recall,
            fetch_fraction: self.fetch_fraction,
        }
    }
}

/// Runs the calibrated `.lsm` file `path` over `text` and measures its neurons' activity.
pub fn measure_activity(path: &Path, text: &str, opts: &ActivityOptions) -> Result<ActivityReport> {
    let cal = LsmFile::open(path)?.calibration(path)?;
    let model = Model::load(path)?;
    let tok = &model.tokenizer;
    let w = &model.weights;
    let c = &w.config;
    let (d, n_ff) = (c.d_model, c.n_ff);
    let mut ids = tok.encode(text)?;
    ids.truncate(opts.max_tokens.min(c.context_length));
    if ids.len() < opts.skip + 2 {
        return Err(Error::InvalidArgument {
            arg: "text",
            reason: format!(
                "{} tokens; at least {} are needed to skip {} and compare two",
                ids.len(),
                opts.skip + 2,
                opts.skip
            ),
        });
    }
    let predictor = opts
        .predictor
        .map(|kind| {
            let p = crate::predict::load(&cal, kind)?;
            Ok::<_, Error>((p, cal.predictor_meta(kind)?.cutoffs.clone()))
        })
        .transpose()?;

    let mut session = Session::new(Arc::clone(&model), ids.len(), Precision::Exact, opts.kv)?;
    let mut rec = Collector::new(c, ids.len());
    session.forward_batch_with(&ids, &mut rec, &mut |_, _| Ok(()))?;
    let n = rec.tokens();
    let skip = opts.skip;
    let mut report = ActivityReport {
        tokens: n,
        skipped: skip,
        active_by_position: vec![0.0; n],
        ..ActivityReport::default()
    };
    let (mut both, mut before, mut inactive) = (0u64, 0u64, 0u64);
    let mut pooled = RecallCounter::default();
    for (l, lw) in w.layers.iter().enumerate() {
        let xs = rec.layer_f32(l);
        let (h, _) = layer::activations(lw, c.activation, &xs);
        let thr = cal.thresholds()[l];
        let active: Vec<bool> = h
            .iter()
            .map(|&v| crate::sparsity::is_active(v, thr))
            .collect();
        let rows: Vec<&[bool]> = active.chunks_exact(n_ff).collect();
        for (t, row) in rows.iter().enumerate() {
            report.active_by_position[t] +=
                row.iter().filter(|&&a| a).count() as f64 / (n_ff * c.n_layers) as f64;
        }
        let (mut lb, mut lp, mut li) = (0u64, 0u64, 0u64);
        let mut freq = vec![0u32; n_ff];
        for t in skip..n {
            let row = rows[t];
            li += row.iter().filter(|&&a| !a).count() as u64;
            for (f, &a) in freq.iter_mut().zip(row) {
                *f += u32::from(a);
            }
            if t > skip {
                let prev = rows[t - 1];
                lp += prev.iter().filter(|&&a| a).count() as u64;
                lb += prev.iter().zip(row).filter(|&(&a, &b)| a && b).count() as u64;
            }
        }
        let m = (n - skip) as f64;
        let (s1, s2) = freq.iter().fold((0f64, 0f64), |(a, b), &f| {
            let f = f64::from(f) / m;
            (a + f, b + f * f)
        });
        let mut counter = RecallCounter::default();
        if let Some((p, cutoffs)) = &predictor {
            let recorded = layer::Recorded {
                xs: &xs[skip * d..],
                h: &h[skip * n_ff..],
                d_model: d,
                n_ff,
            };
            let mut selected = Vec::new();
            layer::measure(
                p.as_ref(),
                l,
                recorded,
                thr,
                cutoffs[l],
                &mut counter,
                &mut selected,
            );
        }
        report.layers.push(LayerActivity {
            carry_over: lb as f64 / lp.max(1) as f64,
            independent_carry_over: if s1 > 0.0 { s2 / s1 } else { 0.0 },
            sparsity: li as f64 / (m * n_ff as f64),
            recall: counter.recall(),
            fetch_fraction: counter.fetch_fraction(),
        });
        (both, before, inactive) = (both + lb, before + lp, inactive + li);
        pooled.active += counter.active;
        pooled.hit += counter.hit;
        pooled.fetched += counter.fetched;
        pooled.total += counter.total;
    }
    let layers = c.n_layers.max(1) as f64;
    report.carry_over = both as f64 / before.max(1) as f64;
    report.independent_carry_over = report
        .layers
        .iter()
        .map(|l| l.independent_carry_over)
        .sum::<f64>()
        / layers;
    report.sparsity = inactive as f64 / ((n - skip) * n_ff * c.n_layers).max(1) as f64;
    report.recall = pooled.recall();
    report.fetch_fraction = pooled.fetch_fraction();
    Ok(report)
}
