//! The internal model description and the importers that fill it.
//!
//! Every source format (GGUF, Hugging Face safetensors, the LeanStream `.lsm` file) is read into
//! one [`ImportedModel`]: a validated [`ModelConfig`], tensors under canonical (GGUF-style) names,
//! the tokenizer and the chat template. [`Weights`] is then built from it with every shape checked
//! once, so the forward passes never see a malformed model.

mod bytes;
mod config;
pub mod gguf;
pub mod lsm;
pub mod safetensors;
mod summary;
mod weights;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use bytes::{OwnedBytes, TensorBytes, map_file, map_range, read_file, read_ranges};
pub use config::{
    Architecture, FfnActivation, LayerAttention, ModelConfig, RopeStyle, SlidingWindow,
};
pub use summary::{ModelSummary, summarize};
pub use weights::{Down, FfnWeights, LayerWeights, QRows, TiledMatrix, Weights};

use crate::quant::DType;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// How a loaded model file's bytes are held. Owned by default: a file the process owns a copy of
/// cannot fault it when truncated, nor change under it (the why is in [`TensorBytes`]'s module).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Residency {
    /// Every byte read into memory the process owns (dense mode, tools).
    #[default]
    Owned,
    /// Owned, except a `.lsm` file's streamed FFN section, which the streaming modes read only
    /// with the I/O workers (`O_DIRECT`, into the neuron cache): it is never resident. Its weight
    /// views map the section (for recall measurement only). Other formats are read whole.
    OwnedExceptStreamed,
    /// The whole file memory-mapped: `mmap` mode only, the llama.cpp-like baseline, which maps
    /// the file by definition. Not protected: truncating the file while loaded is a `SIGBUS`.
    Mapped,
}

/// One stored tensor: element type, shape and bytes.
#[derive(Clone, Debug)]
pub struct TensorRef {
    /// Element type of the stored bytes.
    pub dtype: DType,
    /// Shape, outermost first: a matrix is `[rows, cols]` with `cols` contiguous (GGUF's `ne`
    /// reversed). A vector is `[n]`.
    pub shape: Vec<usize>,
    /// The stored bytes (exactly `rows * dtype.row_bytes(cols)`).
    pub data: TensorBytes,
}

/// A model read from any source format, before its weights are arranged for compute.
#[derive(Debug)]
pub struct ImportedModel {
    /// Where it came from (a file, or a directory for safetensors).
    pub path: PathBuf,
    pub config: ModelConfig,
    /// Tensors by canonical name: `token_embd.weight`, `output_norm.weight`, `output.weight`
    /// (absent when tied), `blk.{i}.attn_norm.weight`, `blk.{i}.attn_{q,k,v,output}.weight`,
    /// optional `blk.{i}.attn_{q,k,v}.bias`, `blk.{i}.ffn_norm.weight`,
    /// `blk.{i}.ffn_{gate,up,down}.weight`; with [`ModelConfig::qk_norm`]
    /// `blk.{i}.attn_{q,k}_norm.weight`, with [`ModelConfig::post_norms`]
    /// `blk.{i}.post_attention_norm.weight` and `blk.{i}.post_ffw_norm.weight`.
    pub tensors: BTreeMap<String, TensorRef>,
    pub tokenizer: Tokenizer,
    /// Jinja chat template from the model's metadata, if it has one.
    pub chat_template: Option<String>,
}

/// Which importer a path needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Gguf,
    Lsm,
    SafetensorsDir,
}

impl SourceKind {
    /// Decides by what is at `path`: a directory is safetensors; a file by its magic bytes.
    pub fn detect(path: &Path) -> Result<SourceKind> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Ok(SourceKind::SafetensorsDir);
        }
        let mut magic = [0u8; 8];
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let n = std::io::Read::read(&mut f, &mut magic).map_err(|e| Error::io(path, e))?;
        if n >= 4 && &magic[..4] == b"GGUF" {
            Ok(SourceKind::Gguf)
        } else if n == 8 && magic == lsm::MAGIC {
            Ok(SourceKind::Lsm)
        } else {
            Err(Error::invalid_file(
                path,
                "not a GGUF or .lsm file (unknown magic bytes) and not a safetensors directory",
            ))
        }
    }
}

/// Imports a GGUF file or a safetensors directory (the sources `leanstream convert` accepts).
pub fn load_imported(path: &Path) -> Result<ImportedModel> {
    match SourceKind::detect(path)? {
        SourceKind::Gguf => gguf::import(path),
        SourceKind::SafetensorsDir => safetensors::import(path),
        SourceKind::Lsm => Err(Error::invalid_file(
            path,
            "this is already a .lsm file; convert takes a GGUF file or a safetensors directory",
        )),
    }
}

/// [`load`] over a memory map of the file instead of a copy (GGUF and `.lsm` only): for a
/// caller that reads the layout and then copies just the ranges it keeps
/// ([`crate::forward::Model::load_within`]). Every view's offset is its file offset.
pub fn load_mapped(path: &Path) -> Result<(Weights, Tokenizer, Option<String>)> {
    match SourceKind::detect(path)? {
        SourceKind::Lsm => {
            let f = lsm::LsmFile::open_with(path, Residency::Mapped)?;
            let tokenizer = f.tokenizer()?;
            let weights = f.weights(path, tokenizer.clone())?;
            Ok((weights, tokenizer, f.header.chat_template.clone()))
        }
        SourceKind::Gguf => {
            let f = gguf::GgufFile::parse(path, map_file(path)?)?;
            let m = gguf::GgufModel::from_file(&f)?.into_imported()?;
            let w = Weights::from_imported(&m)?;
            Ok((w, m.tokenizer, m.chat_template))
        }
        SourceKind::SafetensorsDir => Err(Error::invalid_file(
            path,
            "a memory budget needs a single-file model: convert it with `leanstream convert` \
             first",
        )),
    }
}

/// [`load`], with the matrices [`Weights::tile_plan`] picks for `tiles` stored as tiles
/// ([`crate::quant::tiles`]): rewritten in the file image as it is read, so the load takes no
/// more memory than [`load`]. A safetensors directory loads as rows.
pub fn load_tiled(
    path: &Path,
    tiles: &dyn Fn(crate::quant::DType) -> bool,
) -> Result<(Weights, Tokenizer, Option<String>)> {
    if SourceKind::detect(path)? == SourceKind::SafetensorsDir {
        return load(path);
    }
    let (mapped, tokenizer, chat_template) = load_mapped(path)?;
    let plan = mapped.tile_plan(tiles);
    let image = bytes::read_file_edited(path, |image| {
        for t in &plan {
            crate::quant::tiles::tile_matrix_in_place(t.dtype, t.rows, &mut image[t.bytes.clone()]);
        }
    })?;
    let weights = mapped.rebased_onto(&image)?.tiled(&plan);
    Ok((weights, tokenizer, chat_template))
}

/// Opens any supported model source and builds its compute-ready weights.
pub fn load(path: &Path) -> Result<(Weights, Tokenizer, Option<String>)> {
    if SourceKind::detect(path)? == SourceKind::Lsm {
        return lsm::load(path);
    }
    let m = load_imported(path)?;
    let w = Weights::from_imported(&m)?;
    Ok((w, m.tokenizer, m.chat_template))
}
