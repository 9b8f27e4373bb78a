//! A model's weights in a GPU's memory ([`GpuModel`]): what a memory plan keeps, uploaded; the
//! weight stream's slots mapped where the device reads host memory in place.

use std::sync::Arc;

use crate::backend::device::{Addr, Buffer, Device, HostMapping};
use crate::forward::Model;
use crate::forward::planned::HeadSpan;
use crate::model::lsm::ChunkLayout;
use crate::model::{Down, FfnWeights, QRows};
use crate::quant::DType;
use crate::{Error, Result};

/// Neurons per chunk of the resident dense FFN (one block of the down kernel's grid per chunk).
const RESIDENT_CHUNK_NEURONS: usize = 64;

/// Most matrices staged from one unit of the weight stream: its pieces times their matrices
/// (a unit holds a few pieces; a gate-and-up piece has two matrices). Sizes the staging
/// buffer's alignment padding; more is refused, not overrun.
const STAGED_PER_UNIT: usize = 64;

/// Rows of a quantised matrix back to back in device memory, where the matrix-vector kernel
/// reads them.
#[derive(Clone, Copy, Debug)]
pub(super) struct DeviceRows {
    pub(super) at: Addr,
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl DeviceRows {
    /// Queues `y = W x (+ bias)`.
    ///
    /// # Safety
    /// `x` holds `cols` values, `y` (and `bias`, unless null) `rows`, of the same device, and
    /// the rows stay where they are until the device has run the kernel.
    pub(super) unsafe fn apply(
        &self,
        dev: &dyn Device,
        x: Addr,
        bias: Addr,
        y: Addr,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { dev.matvec(self.at, self.dtype, self.rows, self.cols, x, bias, y) }
    }
}

/// A quantised matrix uploaded to device memory.
#[derive(Debug)]
pub(super) struct DeviceMatrix {
    pub(super) bytes: Buffer<u8>,
    pub(super) rows: DeviceRows,
}

impl DeviceMatrix {
    fn new(dev: &dyn Device, what: &str, m: &QRows) -> Result<DeviceMatrix> {
        if m.tiled_rows() > 0 {
            return Err(Error::Cuda(format!(
                "{what}: stored as tiles for the CPU's kernels; load the model for the GPU \
                 (Model::load_for with Backend::Cuda)"
            )));
        }
        let mut packed = Vec::with_capacity(m.stored_bytes());
        for r in 0..m.rows {
            packed.extend_from_slice(m.row(r));
        }
        let bytes = Buffer::upload(dev, what, &packed)?;
        Ok(DeviceMatrix {
            rows: DeviceRows {
                at: bytes.addr(),
                dtype: m.dtype,
                rows: m.rows,
                cols: m.cols,
            },
            bytes,
        })
    }
}

/// A layer's attention projections in device memory.
#[derive(Debug)]
pub(super) struct Projections {
    pub(super) wq: DeviceMatrix,
    pub(super) wk: DeviceMatrix,
    pub(super) wv: DeviceMatrix,
    pub(super) wo: DeviceMatrix,
}

/// One layer's FFN as neuron chunks in device memory, with the pointer list of all of them.
#[derive(Debug)]
pub(super) struct DeviceFfn {
    pub(super) _chunks: Buffer<u8>,
    pub(super) ptrs: Buffer<u64>,
    pub(super) index: Buffer<u32>,
}

#[derive(Debug)]
pub(super) struct DeviceLayer {
    pub(super) attn_norm: Buffer<f32>,
    /// `None` when the plan streams the layer: its pieces come through the weight stream.
    pub(super) projections: Option<Projections>,
    pub(super) bq: Option<Buffer<f32>>,
    pub(super) bk: Option<Buffer<f32>>,
    pub(super) bv: Option<Buffer<f32>>,
    pub(super) q_norm: Option<Buffer<f32>>,
    pub(super) k_norm: Option<Buffer<f32>>,
    pub(super) post_attn_norm: Option<Buffer<f32>>,
    pub(super) ffn_norm: Buffer<f32>,
    pub(super) post_ffn_norm: Option<Buffer<f32>>,
    /// `None` when the FFN is streamed: by the sparse pipeline's cache, or by the weight
    /// stream when the plan streams the layer.
    pub(super) ffn: Option<DeviceFfn>,
}

/// A model's weights in device memory (the token embeddings stay on the host: one row per token
/// is looked up there and copied over).
pub struct GpuModel {
    pub(super) dev: Arc<dyn Device>,
    /// The weight stream's slots, mapped for the kernels to read in place (empty where the
    /// device cannot, or nothing streams). Dropped before `host`, which owns the slots.
    pub(super) slots: Vec<Box<dyn HostMapping>>,
    pub(super) host: Arc<Model>,
    pub(super) layers: Vec<DeviceLayer>,
    pub(super) output_norm: Buffer<f32>,
    /// The head's resident rows (from row 0: all of them unless the plan streams the head).
    pub(super) output: Option<DeviceMatrix>,
    /// Bytes of the largest unit the weight stream reads (0 without one): what a session's
    /// staging buffer holds.
    pub(super) staging_bytes: usize,
    /// The distinct RoPE frequency tables, and which one each layer uses.
    pub(super) rope_freqs: Vec<Buffer<f32>>,
    pub(super) rope_of_layer: Vec<usize>,
    pub(super) ffn_layout: ChunkLayout,
    pub(super) device_bytes: usize,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("model", &self.host.path)
            .field("device", &self.dev.name())
            .field("device_bytes", &self.device_bytes)
            .finish_non_exhaustive()
    }
}

/// Packs a layer's FFN into neuron bundles of `layout` (gate row | up row | down column).
/// A down projection stored as rows (GGUF, safetensors) is transposed into f32 columns.
fn pack_ffn(layer: &FfnWeights, layout: &ChunkLayout) -> Vec<u8> {
    let mut out = vec![0u8; layout.chunks_per_layer * layout.chunk_bytes];
    let columns: Option<Vec<f32>> = match &layer.down {
        Down::Neurons(_) => None,
        Down::Rows(m) => {
            let mut rows = vec![0f32; m.rows * m.cols];
            for (r, row) in rows.chunks_exact_mut(m.cols).enumerate() {
                m.dequantize_row(r, row);
            }
            Some(rows)
        }
    };
    for n in 0..layout.n_ff {
        let at = (n / layout.chunk_neurons) * layout.chunk_bytes
            + (n % layout.chunk_neurons) * layout.bundle_bytes;
        let bundle = &mut out[at..at + layout.bundle_bytes];
        bundle[..layout.up_at].copy_from_slice(layer.gate.row(n));
        bundle[layout.up_at..layout.down_at].copy_from_slice(layer.up.row(n));
        let down = &mut bundle[layout.down_at..];
        match (&layer.down, &columns) {
            (Down::Neurons(m), _) => down.copy_from_slice(m.row(n)),
            (Down::Rows(_), Some(rows)) => {
                for (j, b) in down.chunks_exact_mut(4).enumerate() {
                    b.copy_from_slice(&rows[j * layout.n_ff + n].to_le_bytes());
                }
            }
            (Down::Rows(_), None) => unreachable!("columns are made for row-stored down"),
        }
    }
    out
}

/// Uploads a layer's FFN as neuron chunks, with the pointer list of all of them.
fn upload_ffn(dev: &dyn Device, ffn: &FfnWeights, layout: &ChunkLayout) -> Result<DeviceFfn> {
    let chunks = Buffer::upload(dev, "FFN chunks", &pack_ffn(ffn, layout))?;
    let ptrs: Vec<u64> = (0..layout.chunks_per_layer)
        .map(|i| chunks.at(i * layout.chunk_bytes).0)
        .collect();
    let index: Vec<u32> = (0..layout.chunks_per_layer as u32).collect();
    Ok(DeviceFfn {
        ptrs: Buffer::upload(dev, "chunk pointers", &ptrs)?,
        index: Buffer::upload(dev, "chunk index", &index)?,
        _chunks: chunks,
    })
}

/// The FFN's down type as the chunks store it: f32 columns for a down projection stored as rows.
fn down_dtype(ffn: &FfnWeights) -> DType {
    match &ffn.down {
        Down::Neurons(m) => m.dtype,
        Down::Rows(_) => DType::F32,
    }
}

fn optional(dev: &dyn Device, what: &str, v: &Option<Vec<f32>>) -> Result<Option<Buffer<f32>>> {
    v.as_ref().map(|b| Buffer::upload(dev, what, b)).transpose()
}

impl GpuModel {
    /// Uploads `model`'s weights, with `with_ffn` every FFN neuron too (dense decoding), to
    /// `dev`. Without the FFN only [`super::GpuSession::forward_with`] runs: the streaming pipeline
    /// brings the FFN.
    ///
    /// Under a memory plan only what the plan keeps is uploaded; each session stages the
    /// streamed pieces as they arrive.
    pub fn new(dev: Arc<dyn Device>, model: Arc<Model>, with_ffn: bool) -> Result<GpuModel> {
        let d: &dyn Device = &*dev;
        let w = &model.weights;
        let c = &w.config;
        let first = &w.layers[0].ffn;
        let ffn_layout = ChunkLayout::one_layer(
            c.n_ff,
            c.d_model,
            RESIDENT_CHUNK_NEURONS,
            [first.gate.dtype, first.up.dtype, down_dtype(first)],
        )
        .ok_or_else(|| Error::Cuda("the FFN row types do not fit d_model".into()))?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for (l, lw) in w.layers.iter().enumerate() {
            let types = [lw.ffn.gate.dtype, lw.ffn.up.dtype, down_dtype(&lw.ffn)];
            let want = [
                ffn_layout.gate_dtype,
                ffn_layout.up_dtype,
                ffn_layout.down_dtype,
            ];
            if types != want {
                return Err(Error::Cuda(format!(
                    "layer {l}: FFN types {types:?} differ from layer 0's"
                )));
            }
            let resident = model.layer_resident(l);
            let ffn = if with_ffn && resident {
                Some(upload_ffn(d, &lw.ffn, &ffn_layout)?)
            } else {
                None
            };
            let projections = if resident {
                Some(Projections {
                    wq: DeviceMatrix::new(d, "wq", &lw.wq)?,
                    wk: DeviceMatrix::new(d, "wk", &lw.wk)?,
                    wv: DeviceMatrix::new(d, "wv", &lw.wv)?,
                    wo: DeviceMatrix::new(d, "wo", &lw.wo)?,
                })
            } else {
                None
            };
            layers.push(DeviceLayer {
                attn_norm: Buffer::upload(d, "attn_norm", &lw.attn_norm)?,
                projections,
                bq: optional(d, "bq", &lw.bq)?,
                bk: optional(d, "bk", &lw.bk)?,
                bv: optional(d, "bv", &lw.bv)?,
                q_norm: optional(d, "q_norm", &lw.q_norm)?,
                k_norm: optional(d, "k_norm", &lw.k_norm)?,
                post_attn_norm: optional(d, "post_attn_norm", &lw.post_attn_norm)?,
                ffn_norm: Buffer::upload(d, "ffn_norm", &lw.ffn_norm)?,
                post_ffn_norm: optional(d, "post_ffn_norm", &lw.post_ffn_norm)?,
                ffn,
            });
        }
        let (tables, rope_of_layer) = c.rope_tables();
        let rope_freqs = tables
            .iter()
            .map(|t| Buffer::upload(d, "RoPE frequencies", t))
            .collect::<Result<Vec<_>>>()?;
        let mut output = None;
        model.for_each_head_piece(HeadSpan::Resident, &mut |piece| {
            output = Some(DeviceMatrix::new(d, "output", &piece.m)?);
            Ok(())
        })?;
        let mut slots = Vec::new();
        if let Some(p) = &model.planned {
            for &(at, len) in p.stream.slot_memory() {
                // SAFETY: a slot is one allocation of the stream, which the model owns and this
                // value outlives (`slots` is dropped before `host`); each is mapped once.
                match unsafe { d.map_host(at as *mut u8, len)? } {
                    Some(m) => slots.push(m),
                    None => break,
                }
            }
        }
        let staging_bytes = match &model.planned {
            Some(p) if slots.is_empty() => {
                let largest = p.stream.units().iter().map(|u| u.bytes()).max();
                // Room for each staged matrix to start on 16 bytes.
                largest.map_or(0, |b| b as usize + 16 * STAGED_PER_UNIT)
            }
            _ => 0,
        };
        let output_norm = Buffer::upload(d, "output_norm", &w.output_norm)?;
        let vectors = |l: &DeviceLayer| {
            [&l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm]
                .into_iter()
                .chain([&l.post_attn_norm, &l.post_ffn_norm])
                .flatten()
                .chain([&l.attn_norm, &l.ffn_norm])
                .map(Buffer::bytes)
                .sum::<usize>()
        };
        let per_layer: usize = layers
            .iter()
            .map(|l| {
                l.projections.as_ref().map_or(0, |p| {
                    [&p.wq, &p.wk, &p.wv, &p.wo]
                        .iter()
                        .map(|m| m.bytes.bytes())
                        .sum::<usize>()
                }) + vectors(l)
                    + l.ffn
                        .as_ref()
                        .map_or(0, |f| f._chunks.bytes() + f.ptrs.bytes() + f.index.bytes())
            })
            .sum();
        let device_bytes = per_layer
            + output.as_ref().map_or(0, |o| o.bytes.bytes())
            + output_norm.bytes()
            + rope_freqs.iter().map(Buffer::bytes).sum::<usize>();
        Ok(GpuModel {
            dev,
            slots,
            host: model,
            layers,
            output_norm,
            output,
            staging_bytes,
            rope_freqs,
            rope_of_layer,
            ffn_layout,
            device_bytes,
        })
    }

    /// The host model (tokenizer, configuration, embeddings).
    pub fn model(&self) -> &Arc<Model> {
        &self.host
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    /// Whether a memory plan streams some of the weights.
    pub(super) fn streams(&self) -> bool {
        self.host.plan().is_some_and(|p| p.streams())
    }

    /// Bytes of device memory the weights take.
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }
}
