//! Where each FFN neuron chunk of a `.lsm` file lives, and how a chunk's bytes split into gate
//! rows, up rows and down columns.

use std::ops::Range;
use std::path::Path;

use super::Header;
use crate::quant::DType;
use crate::{Error, Result};

/// One chunk of one layer across the whole model, numbered `0..total_chunks` as
/// `layer * chunks_per_layer + chunk` ([`ChunkLayout::id`]); the neuron cache keys its slots by it.
pub type ChunkId = u32;

/// Geometry of the streamed FFN section, from the file header.
#[derive(Clone, Debug)]
pub struct ChunkLayout {
    pub n_layers: usize,
    pub n_ff: usize,
    pub d_model: usize,
    /// Neurons per chunk (the last chunk of a layer may hold fewer).
    pub chunk_neurons: usize,
    pub chunks_per_layer: usize,
    /// Bytes of one chunk on disk, padding included (a multiple of 4 KiB).
    pub chunk_bytes: usize,
    /// Bytes of one neuron bundle: gate row | up row | down column.
    pub bundle_bytes: usize,
    /// Offset of the up row inside a bundle.
    pub up_at: usize,
    /// Offset of the down column inside a bundle.
    pub down_at: usize,
    pub gate_dtype: DType,
    pub up_dtype: DType,
    pub down_dtype: DType,
    /// Absolute file offset of each layer's first chunk.
    layer_offsets: Vec<u64>,
}

impl ChunkLayout {
    /// Reads the layout from a validated header.
    pub fn from_header(path: &Path, h: &Header) -> Result<ChunkLayout> {
        let c = &h.config;
        let f = &h.ffn;
        let (up_at, down_at) = f
            .bundle_offsets(c.d_model)
            .ok_or_else(|| Error::invalid_file(path, "FFN row types do not fit d_model"))?;
        Ok(ChunkLayout {
            n_layers: c.n_layers,
            n_ff: c.n_ff,
            d_model: c.d_model,
            chunk_neurons: f.chunk_neurons,
            chunks_per_layer: f.chunks_per_layer(c.n_ff),
            chunk_bytes: f.chunk_bytes,
            bundle_bytes: f.bundle_bytes,
            up_at,
            down_at,
            gate_dtype: f.gate_dtype,
            up_dtype: f.up_dtype,
            down_dtype: f.down_dtype,
            layer_offsets: f
                .layer_offsets
                .iter()
                .map(|o| h.streamed.offset + o)
                .collect(),
        })
    }

    /// The geometry of one layer of `n_ff` neurons stored as the `.lsm` writer would, at offset 0:
    /// bundles of gate row | up row | down column, `chunk_neurons` to a chunk, chunks padded to
    /// 4 KiB. For kernels and tests that work on chunk bytes in memory. `None` if a row type does
    /// not fit `d_model` or a size is zero.
    pub fn one_layer(
        n_ff: usize,
        d_model: usize,
        chunk_neurons: usize,
        [gate_dtype, up_dtype, down_dtype]: [DType; 3],
    ) -> Option<ChunkLayout> {
        if n_ff == 0 || chunk_neurons == 0 {
            return None;
        }
        let up_at = gate_dtype.row_bytes(d_model)?;
        let down_at = up_at + up_dtype.row_bytes(d_model)?;
        let bundle_bytes = down_at + down_dtype.row_bytes(d_model)?;
        Some(ChunkLayout {
            n_layers: 1,
            n_ff,
            d_model,
            chunk_neurons,
            chunks_per_layer: n_ff.div_ceil(chunk_neurons),
            chunk_bytes: (chunk_neurons * bundle_bytes).next_multiple_of(4096),
            bundle_bytes,
            up_at,
            down_at,
            gate_dtype,
            up_dtype,
            down_dtype,
            layer_offsets: vec![0],
        })
    }

    /// Chunks in the whole model.
    pub fn total_chunks(&self) -> usize {
        self.n_layers * self.chunks_per_layer
    }

    /// The fewest neuron-cache slots a streaming pipeline can run with: one layer's chunks, so
    /// that every chunk a layer selects can be cached at once (the minimum working set). The one
    /// owner of this rule: the pipeline builds its cache with it and reports it.
    pub fn floor_slots(&self) -> usize {
        self.chunks_per_layer.min(self.total_chunks())
    }

    /// [`ChunkLayout::floor_slots`] in bytes: the smallest neuron cache of a streaming mode, known
    /// from the file header before loading (so a caller can reserve it up front).
    pub fn floor_bytes(&self) -> usize {
        self.floor_slots() * self.chunk_bytes
    }

    /// Bytes of the streamed FFN section (all chunks, padding included).
    pub fn streamed_bytes(&self) -> usize {
        self.total_chunks() * self.chunk_bytes
    }

    /// The id of chunk `c` of layer `l`.
    pub fn id(&self, l: usize, c: usize) -> ChunkId {
        (l * self.chunks_per_layer + c) as ChunkId
    }

    /// The layer a chunk belongs to.
    pub fn layer_of(&self, id: ChunkId) -> usize {
        id as usize / self.chunks_per_layer
    }

    /// A chunk's index inside its layer.
    pub fn chunk_of(&self, id: ChunkId) -> usize {
        id as usize % self.chunks_per_layer
    }

    /// Absolute file offset of a chunk (4 KiB-aligned).
    pub fn file_offset(&self, id: ChunkId) -> u64 {
        self.layer_offsets[self.layer_of(id)] + (self.chunk_of(id) * self.chunk_bytes) as u64
    }

    /// The (stored-order) neurons of chunk `c` of a layer.
    pub fn neurons(&self, c: usize) -> Range<usize> {
        let start = c * self.chunk_neurons;
        start..(start + self.chunk_neurons).min(self.n_ff)
    }
}
