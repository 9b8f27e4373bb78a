//! A `.lsm` model opened for sparse execution: resident weights read into owned memory (mapped
//! for `mmap` mode), the streamed FFN section left on storage, plus what calibration wrote
//! (thresholds, statistics, predictors).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::select::{AllNeurons, NeuronScorer};
use crate::Result;
use crate::forward::Model;
use crate::model::lsm::{ChunkLayout, LsmFile, PredictorKind};
use crate::model::{Residency, TensorBytes};
use crate::predict::{self, PredictScratch, Predictor};

/// A model ready for the sparse pipelines. Shared by every session and pipeline on it.
#[derive(Debug)]
pub struct SparseModel {
    /// Resident weights, tokenizer and template. Its FFN weights are views of a memory map of the
    /// streamed section and are touched only by `mmap` mode and by recall measurement.
    pub model: Arc<Model>,
    pub layout: ChunkLayout,
    /// The whole file as `residency` holds it: its streamed range is the file's only when
    /// [`Residency::Mapped`] (what `mmap` mode reads); zeros otherwise.
    pub file: TensorBytes,
    pub residency: Residency,
    pub path: PathBuf,
    /// Per layer: activations with a smaller magnitude count as inactive.
    pub thresholds: Vec<f32>,
    /// Per chunk: the calibrated share of tokens on which any neuron of the chunk is active.
    pub chunk_frequency: Vec<f32>,
    /// Per chunk (by [`ChunkId`](crate::model::lsm::ChunkId)): the CRC-32 its streamed bytes must
    /// match, from the header.
    pub chunk_crc32: Vec<u32>,
    /// The calibration's target sparsity (0 when uncalibrated).
    pub sparsity: f32,
    calibration: Option<crate::model::lsm::CalibrationData>,
}

impl SparseModel {
    /// Opens `path` for a streaming mode: everything but the streamed section read into owned
    /// memory ([`Residency::OwnedExceptStreamed`]). With `require_calibration`, a file that was
    /// never calibrated is refused with a message naming `leanstream calibrate`.
    pub fn open(path: &Path, require_calibration: bool) -> Result<Arc<SparseModel>> {
        Self::open_with(path, require_calibration, Residency::OwnedExceptStreamed)
    }

    /// Opens `path` for `mode`: mapped for `mmap` mode (which reads the FFN through the map),
    /// otherwise as [`SparseModel::open`].
    pub fn open_for_mode(
        path: &Path,
        mode: super::Mode,
        require_calibration: bool,
    ) -> Result<Arc<SparseModel>> {
        let residency = match mode {
            super::Mode::Mmap => Residency::Mapped,
            _ => Residency::OwnedExceptStreamed,
        };
        Self::open_with(path, require_calibration, residency)
    }

    /// [`SparseModel::open`] with the file held as `residency` says.
    pub fn open_with(
        path: &Path,
        require_calibration: bool,
        residency: Residency,
    ) -> Result<Arc<SparseModel>> {
        let f = LsmFile::open_with(path, residency)?;
        let tokenizer = f.tokenizer()?;
        let model = Arc::new(Model {
            path: path.to_path_buf(),
            weights: f.weights(path, tokenizer.clone())?,
            tokenizer,
            chat_template: f.header.chat_template.clone(),
            planned: None,
            piece_bytes: crate::plan::PIECE_BYTES,
        });
        Self::with_model(model, &f, require_calibration, residency, f.data.clone())
    }

    /// The sparse side of `model`, a `.lsm` loaded under a plan that streams some FFN layers by
    /// neuron ([`Model::load_within_placed`]): its header and calibration are read again from a
    /// map of the file (clean page-cache pages), its weights are the model's, not loaded twice.
    pub fn over(model: Arc<Model>) -> Result<Arc<SparseModel>> {
        let f = LsmFile::open_with(&model.path, Residency::Mapped)?;
        let none = TensorBytes::from_vec(Vec::new());
        Self::with_model(model, &f, true, Residency::OwnedExceptStreamed, none)
    }

    fn with_model(
        model: Arc<Model>,
        f: &LsmFile,
        require_calibration: bool,
        residency: Residency,
        file: TensorBytes,
    ) -> Result<Arc<SparseModel>> {
        let path = model.path.clone();
        let path = path.as_path();
        let layout = ChunkLayout::from_header(path, &f.header)?;
        let calibration = match f.calibration(path) {
            Ok(c) => Some(c),
            Err(e) if require_calibration => return Err(e),
            Err(_) => None,
        };
        let (thresholds, chunk_frequency, sparsity) = match &calibration {
            Some(c) => (
                c.thresholds().to_vec(),
                chunk_frequency(&layout, &c.frequencies()?),
                c.meta.target_sparsity,
            ),
            None => (
                vec![0.0; layout.n_layers],
                vec![1.0; layout.total_chunks()],
                0.0,
            ),
        };
        Ok(Arc::new(SparseModel {
            model,
            layout,
            file,
            residency,
            path: path.to_path_buf(),
            thresholds,
            chunk_frequency,
            chunk_crc32: f.header.ffn.chunk_crc32.concat(),
            sparsity,
            calibration,
        }))
    }

    /// A scorer for the selection: the calibrated predictor of `kind`, or every neuron when the
    /// model is uncalibrated or `kind` is `None` (sparsity off).
    pub fn scorer(&self, kind: Option<PredictorKind>) -> Result<Box<dyn NeuronScorer>> {
        match (kind, &self.calibration) {
            (Some(kind), Some(c)) => {
                let predictor = predict::load(c, kind)?;
                Ok(Box::new(PredictorScorer {
                    scratch: predictor.scratch(),
                    cutoffs: c.predictor_meta(kind)?.cutoffs.clone(),
                    predictor,
                }))
            }
            _ => Ok(Box::new(AllNeurons)),
        }
    }
}

/// A calibrated predictor with its per-layer cut-offs.
#[derive(Debug)]
struct PredictorScorer {
    predictor: Box<dyn Predictor>,
    scratch: PredictScratch,
    cutoffs: Vec<f32>,
}

impl NeuronScorer for PredictorScorer {
    fn score(&mut self, l: usize, xn: &[f32], out: &mut [f32]) {
        self.predictor.score(l, xn, &mut self.scratch, out);
    }
    fn cutoff(&self, l: usize) -> f32 {
        self.cutoffs[l]
    }
    fn bytes(&self) -> usize {
        self.predictor.bytes()
    }
    fn name(&self) -> &'static str {
        self.predictor.kind().name()
    }
}

/// Per chunk, the largest activation frequency of its neurons.
fn chunk_frequency(layout: &ChunkLayout, per_layer: &[Vec<f32>]) -> Vec<f32> {
    let mut out = Vec::with_capacity(layout.total_chunks());
    for f in per_layer {
        for c in 0..layout.chunks_per_layer {
            out.push(f[layout.neurons(c)].iter().fold(0.0f32, |a, &b| a.max(b)));
        }
    }
    out
}
