//! Calibration results inside a `.lsm` file (written by `leanstream calibrate`).
//!
//! The header's optional `calibration` field ([`Calibration`]) holds the small things as JSON:
//! target sparsity, per-layer activation thresholds, what each predictor is and how well it did.
//! Everything per neuron (activation frequencies, mean |h|, predictor tables) lives in its own
//! 4 KiB-aligned `calibration` section after the streamed section, as binary tensors listed in a
//! directory ([`CalTensorEntry`]) with one CRC-32 over the section. A file without calibration is
//! still a valid version-1 file; so is a version-1 reader's view of a calibrated file (the field is
//! optional and every sub-field has a default).
//!
//! Per-neuron tensors are in STORED neuron order (the order of the streamed section).
//!
//! What a memory planner needs to choose, per FFN layer, between streaming it sparsely and
//! densely (files written before these tensors existed still load; only these accessors fail):
//!
//! - `select.{l}` (f32 per neuron, neuron-major): `q_i`, the probability that the default
//!   predictor ([`PredictorKind::DEFAULT`]) selects neuron `i` of layer `l` at its stored cut-off
//!   (the share of held-out tokens whose score is `>=` the cut-off). Its mean over a layer's
//!   neurons is that layer's fetch fraction. Other predictors: `select.{kind}.{l}`.
//! - `quality_cost` (f32 per layer): what running layer `l` sparsely costs in quality, as
//!   [`Calibration::quality_cost_source`] says (`leanstream calibrate`: the relative RMS error of
//!   the layer's FFN output, thresholds and the default predictor applied, against dense, on
//!   held-out tokens). Other predictors: `quality_cost.{kind}`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{LsmFile, Section};
use crate::model::{ModelConfig, TensorBytes};
use crate::{Error, Result};

/// Element type of a calibration tensor (little-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CalDType {
    F32,
    F16,
    I8,
}

impl CalDType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            CalDType::F32 => 4,
            CalDType::F16 => 2,
            CalDType::I8 => 1,
        }
    }
}

/// Where a tensor lives in the calibration section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CalTensorEntry {
    pub name: String,
    pub dtype: CalDType,
    /// Outermost first; row-major.
    pub shape: Vec<usize>,
    /// The layer it belongs to, if any.
    #[serde(default)]
    pub layer: Option<usize>,
    /// Rows are neurons of `layer` (`shape[0] == n_ff`), in stored order: a neuron reordering
    /// permutes them.
    #[serde(default)]
    pub neuron_major: bool,
    /// Offset from the start of the calibration section (64-byte aligned).
    pub offset: u64,
    pub len: u64,
}

/// Which predictor a file stores tables for: the tag in [`PredictorMeta::kind`] and in tensor
/// names (`lowrank.{l}.v`, ...). What the tables mean is `crate::predict`'s business.
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
    /// The predictor the daemon and `bench` use unless told otherwise, and whose selection
    /// probabilities and quality cost carry the plain names (`select.{l}`, `quality_cost`).
    pub const DEFAULT: PredictorKind = PredictorKind::LowRank;

    /// The name of its selection-probability tensor of layer `l` (`select.{l}` for
    /// [`Self::DEFAULT`], `select.{kind}.{l}` otherwise).
    pub fn selection_tensor(self, l: usize) -> String {
        if self == PredictorKind::DEFAULT {
            format!("select.{l}")
        } else {
            format!("select.{self}.{l}")
        }
    }

    /// The name of its per-layer quality-cost tensor (`quality_cost` for [`Self::DEFAULT`],
    /// `quality_cost.{kind}` otherwise).
    pub fn quality_cost_tensor(self) -> String {
        if self == PredictorKind::DEFAULT {
            "quality_cost".into()
        } else {
            format!("quality_cost.{self}")
        }
    }

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

/// What one predictor is and how well it did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PredictorMeta {
    pub kind: Option<PredictorKind>,
    /// Low-rank: rank of the gate factorisation.
    pub rank: usize,
    /// Hashing: sign bits per stage.
    pub bits: usize,
    /// Hashing: number of stages.
    pub stages: usize,
    /// Bytes of its tables in memory, all layers.
    pub bytes: usize,
    /// Recall the cut-offs were set for, on the calibration text.
    pub target_recall: f32,
    /// Per layer: fetch neurons whose score is `>=` this.
    pub cutoffs: Vec<f32>,
    /// Measured on held-out text at `cutoffs`: fraction of active neurons fetched.
    pub heldout_recall: f32,
    /// Measured on held-out text at `cutoffs`: fraction of all neurons fetched.
    pub heldout_fetch_fraction: f32,
    /// Measured on held-out text: mean microseconds of one `score` call (one token, one layer).
    pub heldout_us_per_layer: f32,
}

/// The `calibration` field of the header.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Calibration {
    /// Fraction of FFN activations below threshold on the calibration text, per layer.
    pub target_sparsity: f32,
    /// Calibration tokens the model ran.
    pub tokens: usize,
    /// Where the calibration text came from (file name, or `builtin:data/text/calibration.txt`).
    pub text_source: String,
    /// Per layer: neuron `i` is active for a token when `h_i != 0` and `|h_i| >= thresholds[l]`
    /// ([`crate::sparsity::is_active`]), where `h = act(gate·xn) * (up·xn)`. Zero for ReLU
    /// models (exact sparsity).
    pub thresholds: Vec<f32>,
    /// The binary section holding the tensors.
    pub section: Option<Section>,
    pub tensors: Vec<CalTensorEntry>,
    pub predictors: Vec<PredictorMeta>,
    /// Perplexity of the dense model on held-out text, and with `thresholds` applied to `h`.
    pub heldout_ppl_dense: f32,
    pub heldout_ppl_thresholded: f32,
    /// What the `quality_cost` tensors hold and how they were obtained (empty in files written
    /// before they existed).
    pub quality_cost_source: String,
}

impl Calibration {
    /// [`Calibration::quality_cost_source`] of `leanstream calibrate`.
    pub const QUALITY_COST_FFN_ERROR: &str = "heldout: relative RMS error of the layer's FFN \
         output, activations under the threshold zeroed and neurons under the predictor's cut-off \
         skipped (neuron granularity), against the dense FFN output";
}

/// A tensor to write into the calibration section.
#[derive(Clone, Debug, PartialEq)]
pub struct CalTensor {
    pub name: String,
    pub dtype: CalDType,
    pub shape: Vec<usize>,
    pub layer: Option<usize>,
    pub neuron_major: bool,
    pub bytes: Vec<u8>,
}

impl CalTensor {
    /// An f32 tensor.
    pub fn f32(name: String, layer: Option<usize>, shape: Vec<usize>, v: &[f32]) -> CalTensor {
        CalTensor::new(
            name,
            CalDType::F32,
            layer,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()),
        )
    }

    /// An f16 tensor (values rounded to nearest).
    pub fn f16(name: String, layer: Option<usize>, shape: Vec<usize>, v: &[f32]) -> CalTensor {
        let it = v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes());
        CalTensor::new(name, CalDType::F16, layer, shape, it)
    }

    /// An i8 tensor.
    pub fn i8(name: String, layer: Option<usize>, shape: Vec<usize>, v: &[i8]) -> CalTensor {
        CalTensor::new(name, CalDType::I8, layer, shape, v.iter().map(|&x| x as u8))
    }

    fn new(
        name: String,
        dtype: CalDType,
        layer: Option<usize>,
        shape: Vec<usize>,
        bytes: impl Iterator<Item = u8>,
    ) -> CalTensor {
        let bytes: Vec<u8> = bytes.collect();
        assert_eq!(
            bytes.len(),
            shape.iter().product::<usize>() * dtype.size(),
            "tensor `{name}`: bytes vs shape"
        );
        CalTensor {
            name,
            dtype,
            shape,
            layer,
            neuron_major: false,
            bytes,
        }
    }

    /// Marks the rows as the neurons of `layer` (see [`CalTensorEntry::neuron_major`]).
    pub fn neuron_major(mut self) -> CalTensor {
        self.neuron_major = true;
        self
    }

    /// Reorders the rows: new row `k` is old row `perm[k]`.
    ///
    /// Panics unless `perm` has one entry per row (an internal invariant of the caller).
    pub fn permute_rows(&mut self, perm: &[u32]) {
        let rows = self.shape.first().copied().unwrap_or(0);
        assert_eq!(
            perm.len(),
            rows,
            "tensor `{}`: permutation length",
            self.name
        );
        let rb = self.bytes.len() / rows.max(1);
        let mut out = Vec::with_capacity(self.bytes.len());
        for &p in perm {
            out.extend_from_slice(&self.bytes[p as usize * rb..(p as usize + 1) * rb]);
        }
        self.bytes = out;
    }
}

/// A tensor's view inside an opened file.
#[derive(Clone, Debug)]
pub struct CalTensorView {
    pub dtype: CalDType,
    pub shape: Vec<usize>,
    pub data: TensorBytes,
}

impl CalTensorView {
    /// Values of an f32 tensor.
    pub fn to_f32(&self) -> Vec<f32> {
        let b = self.data.as_slice();
        match self.dtype {
            CalDType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            CalDType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            CalDType::I8 => b.iter().map(|&x| f32::from(x as i8)).collect(),
        }
    }
}

/// Calibration read back from a file: the header part plus the tensors, checked.
#[derive(Debug)]
pub struct CalibrationData {
    pub path: std::path::PathBuf,
    pub config: ModelConfig,
    pub meta: Calibration,
    tensors: BTreeMap<String, CalTensorView>,
}

impl CalibrationData {
    /// Per layer: the `|h|` threshold above which a neuron is active.
    pub fn thresholds(&self) -> &[f32] {
        &self.meta.thresholds
    }

    /// Per layer, per stored neuron: fraction of calibration tokens on which it was active.
    pub fn frequencies(&self) -> Result<Vec<Vec<f32>>> {
        self.per_layer("freq")
    }

    /// Per layer, per stored neuron: mean `|h|` over the calibration tokens.
    pub fn mean_abs_h(&self) -> Result<Vec<Vec<f32>>> {
        self.per_layer("mean_abs_h")
    }

    /// Per stored neuron of layer `l`: the probability `q_i` that the default predictor selects
    /// it at its stored cut-off (share of held-out tokens; see the module documentation).
    pub fn selection(&self, l: usize) -> Result<Vec<f32>> {
        self.selection_for(PredictorKind::DEFAULT, l)
    }

    /// [`Self::selection`] of every layer.
    pub fn selection_probabilities(&self) -> Result<Vec<Vec<f32>>> {
        (0..self.config.n_layers)
            .map(|l| self.selection(l))
            .collect()
    }

    /// [`Self::selection`] for predictor `kind`.
    pub fn selection_for(&self, kind: PredictorKind, l: usize) -> Result<Vec<f32>> {
        let c = &self.config;
        if l >= c.n_layers {
            return Err(Error::InvalidArgument {
                arg: "layer",
                reason: format!("{l} is outside 0..{}", c.n_layers),
            });
        }
        let name = kind.selection_tensor(l);
        self.newer(&name)?;
        Ok(self.tensor(&name, CalDType::F32, &[c.n_ff])?.to_f32())
    }

    /// Per layer: the measured quality cost of running it sparsely with the default predictor,
    /// as [`Calibration::quality_cost_source`] says.
    pub fn quality_cost(&self) -> Result<Vec<f32>> {
        self.quality_cost_for(PredictorKind::DEFAULT)
    }

    /// [`Self::quality_cost`] for predictor `kind`.
    pub fn quality_cost_for(&self, kind: PredictorKind) -> Result<Vec<f32>> {
        let name = kind.quality_cost_tensor();
        self.newer(&name)?;
        Ok(self
            .tensor(&name, CalDType::F32, &[self.config.n_layers])?
            .to_f32())
    }

    /// An error naming the file and the fix when tensor `name` is absent: either the predictor
    /// was not calibrated, or the file predates the tensor.
    fn newer(&self, name: &str) -> Result<()> {
        if self.tensors.contains_key(name) {
            return Ok(());
        }
        let p = self.path.display();
        let why = if self.tensors.keys().any(|k| k.starts_with("select.")) {
            "this predictor has no selection statistics in it".to_string()
        } else {
            "it predates per-neuron selection probabilities and per-layer quality costs".into()
        };
        Err(Error::invalid_file(
            &self.path,
            format!(
                "calibration tensor `{name}` is missing: {why}; re-run `leanstream calibrate {p}` \
                 (or `leanstream synth`) to add it"
            ),
        ))
    }

    fn per_layer(&self, what: &str) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        (0..c.n_layers)
            .map(|l| {
                let t = self.tensor(&format!("{what}.{l}"), CalDType::F32, &[c.n_ff])?;
                Ok(t.to_f32())
            })
            .collect()
    }

    /// The metadata of predictor `kind`, or an error naming the file if it was not calibrated.
    pub fn predictor_meta(&self, kind: PredictorKind) -> Result<&PredictorMeta> {
        self.meta
            .predictors
            .iter()
            .find(|p| p.kind == Some(kind))
            .ok_or_else(|| {
                Error::invalid_file(
                    &self.path,
                    format!("no `{kind}` predictor in the calibration data"),
                )
            })
    }

    /// The tensor `name`, checked to have `dtype` and `shape`.
    pub fn tensor(&self, name: &str, dtype: CalDType, shape: &[usize]) -> Result<&CalTensorView> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::invalid_file(
                &self.path,
                format!("calibration tensor `{name}` is missing"),
            )
        })?;
        if t.dtype != dtype || t.shape != shape {
            return Err(Error::invalid_file(
                &self.path,
                format!(
                    "calibration tensor `{name}` is {:?} {:?}, expected {dtype:?} {shape:?}",
                    t.dtype, t.shape
                ),
            ));
        }
        Ok(t)
    }
}

impl LsmFile {
    /// Reads and checks the calibration data (section checksum, every tensor's bounds and size).
    /// A file without calibration gives an error that says how to add it.
    pub fn calibration(&self, path: &Path) -> Result<CalibrationData> {
        let bad = |reason: String| Error::invalid_file(path, reason);
        let c = &self.header.config;
        let Some(meta) = self.header.calibration.clone() else {
            return Err(bad(format!(
                "the model has no calibration data (thresholds, neuron statistics, predictors): \
                 run `leanstream calibrate {}`",
                path.display()
            )));
        };
        let Some(section) = &meta.section else {
            return Err(bad("calibration data lists no calibration section".into()));
        };
        if section
            .offset
            .checked_add(section.len)
            .is_none_or(|end| end > self.data.len() as u64)
        {
            return Err(bad(format!(
                "calibration section ({} bytes at {}) runs past the end of the file ({} bytes): truncated?",
                section.len,
                section.offset,
                self.data.len()
            )));
        }
        let bytes = self
            .data
            .slice(section.offset as usize, section.len as usize)
            .ok_or_else(|| bad("calibration section out of range".into()))?;
        if crc32fast::hash(bytes.as_slice()) != section.crc32 {
            return Err(bad(
                "calibration section checksum mismatch: the file is corrupted".into(),
            ));
        }
        if meta.thresholds.len() != c.n_layers {
            return Err(bad(format!(
                "calibration has {} layer thresholds, the model has {} layers",
                meta.thresholds.len(),
                c.n_layers
            )));
        }
        if let Some(t) = meta.thresholds.iter().find(|t| !t.is_finite() || **t < 0.0) {
            return Err(bad(format!(
                "calibration threshold {t} is not a non-negative number"
            )));
        }
        let mut tensors = BTreeMap::new();
        for e in &meta.tensors {
            let want = e
                .shape
                .iter()
                .try_fold(e.dtype.size(), |a, &d| a.checked_mul(d));
            let data = e
                .offset
                .checked_add(e.len)
                .filter(|&end| end <= section.len && want == Some(e.len as usize))
                .and_then(|_| bytes.slice(e.offset as usize, e.len as usize))
                .ok_or_else(|| {
                    bad(format!(
                        "calibration tensor `{}` does not fit its shape or the section",
                        e.name
                    ))
                })?;
            tensors.insert(
                e.name.clone(),
                CalTensorView {
                    dtype: e.dtype,
                    shape: e.shape.clone(),
                    data,
                },
            );
        }
        for p in &meta.predictors {
            if p.cutoffs.len() != c.n_layers {
                return Err(bad(format!(
                    "predictor {:?} has {} cut-offs for {} layers",
                    p.kind,
                    p.cutoffs.len(),
                    c.n_layers
                )));
            }
        }
        Ok(CalibrationData {
            path: path.to_path_buf(),
            config: c.clone(),
            meta,
            tensors,
        })
    }
}
