//! Activation predictors: cheap scores that say which FFN neurons of a layer will be active for a
//! token, before the layer's gate and up rows are read.
//!
//! A neuron `i` of layer `l` is *active* for a token when `|h_i| > thresholds[l]`, where `h` is the
//! FFN's intermediate activation (`act(gate·xn) * up·xn`) and the thresholds come from calibration
//! (see [`crate::calibrate`]). A predictor scores every neuron from the layer's normalised FFN input
//! `xn`; the pipeline fetches neurons whose score reaches the per-layer cut-off stored with the
//! predictor ([`crate::model::lsm::PredictorMeta::cutoffs`]), which calibration sets to reach a
//! target recall (default 0.95) of active neurons.
//!
//! Two predictors:
//! - [`LowRank`]: a truncated SVD of the gate matrix (the baseline DESIGN.md §5 names);
//! - [`Hashing`]: learned sign-bit hashing with per-neuron weights over the bits, in stages (after
//!   the LeanStream paper's stacked learnable hashing).
//!
//! Scores are in STORED neuron order (the file's order, after any reordering).

mod cutoff;
mod hashing;
mod lowrank;

use serde::{Deserialize, Serialize};

pub use cutoff::{RecallCounter, cutoff_for_recall};
pub use hashing::{Hashing, HashingParams};
pub(crate) use lowrank::gate_svd;
pub use lowrank::{LowRank, LowRankParams};

/// Which predictor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PredictorKind {
    /// Truncated SVD of the gate matrix.
    LowRank,
    /// Stacked learned sign-bit hashing.
    Hashing,
}

impl PredictorKind {
    /// Every kind, in report order.
    pub const ALL: [PredictorKind; 2] = [PredictorKind::LowRank, PredictorKind::Hashing];

    /// Short lowercase name (`lowrank`, `hashing`), as in tensor names and reports.
    pub fn name(self) -> &'static str {
        match self {
            PredictorKind::LowRank => "lowrank",
            PredictorKind::Hashing => "hashing",
        }
    }
}

impl std::fmt::Display for PredictorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-call scratch of a predictor, sized once by [`Predictor::scratch`]; scoring never allocates.
#[derive(Clone, Debug, Default)]
pub struct PredictScratch {
    /// f32 working space (projections of `xn`).
    pub(crate) f: Vec<f32>,
    /// i8 working space (hash bits as ±1).
    pub(crate) b: Vec<i8>,
}

impl PredictScratch {
    /// Scratch with room for `f` floats and `b` bits.
    pub fn new(f: usize, b: usize) -> PredictScratch {
        PredictScratch {
            f: vec![0.0; f],
            b: vec![0; b],
        }
    }
}

/// A neuron-activation predictor for every layer of one model.
pub trait Predictor: Send + Sync + std::fmt::Debug {
    /// Which predictor this is.
    fn kind(&self) -> PredictorKind;

    /// Scores every neuron of layer `l` (stored order) from the layer's normalised FFN input `xn`
    /// (`d_model` values); higher means more likely `|h| > threshold`. Writes `n_ff` scores into
    /// `out`. Allocation-free with a `scratch` from [`Predictor::scratch`].
    ///
    /// Panics if `l` is not a layer, `xn.len() != d_model` or `out.len() != n_ff`.
    fn score(&self, l: usize, xn: &[f32], scratch: &mut PredictScratch, out: &mut [f32]);

    /// Scratch big enough for [`Predictor::score`] on any layer.
    fn scratch(&self) -> PredictScratch;

    /// Bytes of its tables in memory, all layers.
    fn bytes(&self) -> usize;
}
