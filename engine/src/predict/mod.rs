//! Activation predictors: cheap scores that say which FFN neurons of a layer will be active for a
//! token, before the layer's gate and up rows are read.
//!
//! A neuron `i` of layer `l` is *active* for a token when `h_i != 0` and `|h_i| >= thresholds[l]`
//! ([`crate::sparsity::is_active`]), where `h` is the FFN's intermediate activation
//! (`act(gate·xn) * up·xn`) and the thresholds come from calibration (see [`crate::calibrate`]). A predictor scores every neuron from the layer's normalised FFN input
//! `xn`; the pipeline fetches neurons whose score reaches the per-layer cut-off stored with the
//! predictor ([`crate::model::lsm::PredictorMeta::cutoffs`]), which calibration sets to reach a
//! target recall (default 0.95) of active neurons.
//!
//! Two predictors:
//! - [`LowRank`]: a truncated SVD of the gate matrix (the simple baseline);
//! - [`Hashing`]: learned sign-bit hashing with per-neuron weights over the bits, in stages (after
//!   the LeanStream paper's stacked learnable hashing).
//!
//! Scores are in STORED neuron order (the file's order, after any reordering).
//!
//! Dependencies point one way: a predictor reads its tables from the [`CalibrationData`] the file
//! format hands it ([`load`]); the format stores only tensors, metadata and the kind tag
//! ([`PredictorKind`]) and imports nothing from here.

mod hashing;
mod lowrank;

pub use hashing::{Hashing, HashingParams};
pub(crate) use lowrank::gate_svd;
pub use lowrank::{LowRank, LowRankParams};

use crate::Result;
use crate::model::lsm::{CalibrationData, PredictorKind};

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

/// Builds predictor `kind` from the tables stored in `cal`. Errors, naming the file, if the file
/// has no predictor of that kind or its tables are missing or have the wrong type or shape.
pub fn load(cal: &CalibrationData, kind: PredictorKind) -> Result<Box<dyn Predictor>> {
    let meta = cal.predictor_meta(kind)?;
    Ok(match kind {
        PredictorKind::LowRank => Box::new(LowRank::load(cal, meta)?),
        PredictorKind::Hashing => Box::new(Hashing::load(cal, meta)?),
    })
}
