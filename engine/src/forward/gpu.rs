//! The forward pass on a GPU ([`Device`]): [`GpuModel`] holds the weights in device memory,
//! [`GpuSession`] one conversation's KV cache and scratch there. The layers are the engine's one
//! forward pass ([`super::layer::layers`]); this file implements its steps with the kernels of
//! `cuda-kernels/`. One token at a time; the host sees the logits at the end of a token, and,
//! with a sparse executor ([`GpuSession::forward_with`]), each layer's residual and FFN input
//! and output (so the streaming pipeline's selection, I/O and cache run as on the CPU while the
//! kernels run here).
//!
//! The dense FFN uses the same gathered kernels as the sparse one, over every chunk of a layer:
//! the model's gate, up and down rows are packed into neuron bundles (the `.lsm` chunk layout)
//! when uploaded, so one kernel pair serves dense and sparse and is tested once.
//!
//! A model loaded under a memory plan ([`Model::load_within`]) keeps what the plan keeps in
//! device memory and reads the rest as the CPU does, through the weight stream, each streamed
//! piece (a range of a layer's rows, of the head's rows) computed with the matrix-vector kernel
//! (the FFN as gate and up rows, the activation, then the down rows). Where the device maps host
//! memory (Jetson: the stream's slots registered with the driver once) the kernels read the
//! pieces in place, and the pass waits for them before a slot goes back to the stream; on a
//! discrete GPU each piece is copied into the session's staging buffer first.
//!
//! Any [`Device`] runs it: the CUDA backend on a GPU, and the kernels built for the host in the
//! test command (`cuda-kernels/host/tests/forward.rs` compares this pass with the CPU's on every
//! architecture).

use std::sync::Arc;

use super::layer::{self, Block, LayerSteps};
use super::pass::never;
use super::planned::{HeadSpan, PieceView};
use super::{Decode, FfnExecutor, Model, check_tokens};
use crate::backend::device::{Addr, Buffer, Device, Gathered, HostMapping};
use crate::backend::ops::AttentionShape;
use crate::model::lsm::ChunkLayout;
use crate::model::{Down, FfnActivation, FfnWeights, ModelConfig, QRows};
use crate::plan::Part;
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
struct DeviceRows {
    at: Addr,
    dtype: DType,
    rows: usize,
    cols: usize,
}

impl DeviceRows {
    /// Queues `y = W x (+ bias)`.
    ///
    /// # Safety
    /// `x` holds `cols` values, `y` (and `bias`, unless null) `rows`, of the same device, and
    /// the rows stay where they are until the device has run the kernel.
    unsafe fn apply(&self, dev: &dyn Device, x: Addr, bias: Addr, y: Addr) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { dev.matvec(self.at, self.dtype, self.rows, self.cols, x, bias, y) }
    }
}

/// A quantised matrix uploaded to device memory.
#[derive(Debug)]
struct DeviceMatrix {
    bytes: Buffer<u8>,
    rows: DeviceRows,
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

    /// Queues `y = W x (+ bias)`.
    ///
    /// # Safety
    /// As [`DeviceRows::apply`]; the rows are this matrix's own bytes.
    unsafe fn apply(&self, dev: &dyn Device, x: Addr, bias: Addr, y: Addr) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.rows.apply(dev, x, bias, y) }
    }
}

/// A layer's attention projections in device memory.
#[derive(Debug)]
struct Projections {
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
}

/// One layer's FFN as neuron chunks in device memory, with the pointer list of all of them.
#[derive(Debug)]
struct DeviceFfn {
    _chunks: Buffer<u8>,
    ptrs: Buffer<u64>,
    index: Buffer<u32>,
}

#[derive(Debug)]
struct DeviceLayer {
    attn_norm: Buffer<f32>,
    /// `None` when the plan streams the layer: its pieces come through the weight stream.
    projections: Option<Projections>,
    bq: Option<Buffer<f32>>,
    bk: Option<Buffer<f32>>,
    bv: Option<Buffer<f32>>,
    q_norm: Option<Buffer<f32>>,
    k_norm: Option<Buffer<f32>>,
    post_attn_norm: Option<Buffer<f32>>,
    ffn_norm: Buffer<f32>,
    post_ffn_norm: Option<Buffer<f32>>,
    /// `None` when the FFN is streamed: by the sparse pipeline's cache, or by the weight
    /// stream when the plan streams the layer.
    ffn: Option<DeviceFfn>,
}

/// A model's weights in device memory (the token embeddings stay on the host: one row per token
/// is looked up there and copied over).
pub struct GpuModel {
    dev: Arc<dyn Device>,
    /// The weight stream's slots, mapped for the kernels to read in place (empty where the
    /// device cannot, or nothing streams). Dropped before `host`, which owns the slots.
    slots: Vec<Box<dyn HostMapping>>,
    host: Arc<Model>,
    layers: Vec<DeviceLayer>,
    output_norm: Buffer<f32>,
    /// The head's resident rows (from row 0: all of them unless the plan streams the head).
    output: Option<DeviceMatrix>,
    /// Bytes of the largest unit the weight stream reads (0 without one): what a session's
    /// staging buffer holds.
    staging_bytes: usize,
    /// The distinct RoPE frequency tables, and which one each layer uses.
    rope_freqs: Vec<Buffer<f32>>,
    rope_of_layer: Vec<usize>,
    ffn_layout: ChunkLayout,
    device_bytes: usize,
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
    /// `dev`. Without the FFN only [`GpuSession::forward_with`] runs: the streaming pipeline
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
            if !resident && matches!(lw.ffn.down, Down::Neurons(_)) {
                return Err(Error::unsupported(
                    &model.path,
                    "a plan that streams a .lsm layer's neuron bundles runs on the CPU \
                     (--backend cpu), or give the GPU the whole layer",
                ));
            }
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
    fn streams(&self) -> bool {
        self.host.plan().is_some_and(|p| p.streams())
    }

    /// Bytes of device memory the weights take.
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }
}

/// One conversation on a GPU: its KV cache and scratch in device memory.
pub struct GpuSession {
    model: Arc<GpuModel>,
    max_context: usize,
    pos: usize,
    key_cache: Buffer<f32>,   // (n_layers, max_context, kv_dim)
    value_cache: Buffer<f32>, // (n_layers, max_context, kv_dim)
    x: Buffer<f32>,           // (d_model) residual stream
    xn: Buffer<f32>,          // (d_model)
    q: Buffer<f32>,           // (q_dim)
    att: Buffer<f32>,         // (q_dim)
    proj: Buffer<f32>,        // (d_model)
    h: Buffer<f32>,           // (n_ff)
    up: Buffer<f32>,          // (n_ff) a streamed FFN's up rows
    staging: Buffer<u8>,      // (staging_bytes) streamed pieces
    logits: Buffer<f32>,      // (vocab)
    best: Buffer<u32>,        // (1)
    host_x: Vec<f32>,         // (d_model) embedding out, residual back (streaming)
    host_xn: Vec<f32>,        // (d_model) FFN input back (streaming)
    host_out: Vec<f32>,       // (d_model) FFN output out (streaming)
    host_logits: Vec<f32>,    // (vocab)
}

impl std::fmt::Debug for GpuSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSession")
            .field("model", &self.model)
            .field("pos", &self.pos)
            .field("max_context", &self.max_context)
            .finish_non_exhaustive()
    }
}

impl GpuSession {
    /// A session with room for `max_context` tokens.
    pub fn new(model: Arc<GpuModel>, max_context: usize) -> Result<GpuSession> {
        let c = model.host.weights.config.clone();
        if max_context == 0 || max_context > c.context_length {
            return Err(Error::InvalidArgument {
                arg: "max_context",
                reason: format!("{max_context} is outside 1..={}", c.context_length),
            });
        }
        let d: &dyn Device = &*model.dev;
        let kv = c.n_layers * max_context * c.kv_dim();
        Ok(GpuSession {
            key_cache: Buffer::zeros(d, "key cache", kv)?,
            value_cache: Buffer::zeros(d, "value cache", kv)?,
            x: Buffer::zeros(d, "x", c.d_model)?,
            xn: Buffer::zeros(d, "xn", c.d_model)?,
            q: Buffer::zeros(d, "q", c.q_dim())?,
            att: Buffer::zeros(d, "att", c.q_dim())?,
            proj: Buffer::zeros(d, "proj", c.d_model)?,
            h: Buffer::zeros(d, "h", c.n_ff)?,
            up: Buffer::zeros(d, "up", if model.streams() { c.n_ff } else { 0 })?,
            staging: Buffer::zeros(d, "staging", model.staging_bytes)?,
            logits: Buffer::zeros(d, "logits", c.vocab_size)?,
            best: Buffer::zeros(d, "argmax", 1)?,
            host_x: vec![0.0; c.d_model],
            host_xn: vec![0.0; c.d_model],
            host_out: vec![0.0; c.d_model],
            host_logits: vec![0.0; c.vocab_size],
            max_context,
            pos: 0,
            model,
        })
    }

    /// The model this session decodes.
    pub fn model(&self) -> &Arc<GpuModel> {
        &self.model
    }

    /// Bytes of device memory this session holds itself (KV cache and scratch; the model's
    /// weights are [`GpuModel::device_bytes`]).
    pub fn own_device_bytes(&self) -> usize {
        [
            &self.key_cache,
            &self.value_cache,
            &self.x,
            &self.xn,
            &self.q,
            &self.att,
            &self.proj,
            &self.h,
            &self.up,
            &self.logits,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum::<usize>()
            + self.best.bytes()
            + self.staging.bytes()
    }

    /// Bytes this session holds on the host (its staging buffers, from their capacities).
    pub fn host_bytes(&self) -> usize {
        [
            &self.host_x,
            &self.host_xn,
            &self.host_out,
            &self.host_logits,
        ]
        .iter()
        .map(|v| v.capacity() * std::mem::size_of::<f32>())
        .sum()
    }

    /// Tokens in the KV cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Room of the KV cache, in tokens.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Forgets the conversation (the KV cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    fn config(&self) -> &ModelConfig {
        &self.model.host.weights.config
    }

    /// Runs `token` at the next position with the dense FFN on the device and returns the logits.
    pub fn forward(&mut self, token: u32) -> Result<&mut [f32]> {
        self.run(token, None)?;
        self.finish_logits()
    }

    /// Runs `tokens` one after the other; returns the logits of the last one.
    pub fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        check_tokens(self.config(), self.max_context - self.pos, tokens)?;
        for &t in tokens {
            self.run(t, None)?;
        }
        self.finish_logits()
    }

    /// Runs `token` with the FFN of the layers `exec` covers computed by it on the host-visible
    /// input (the streaming pipeline): the rest stays on the device.
    pub fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        self.run(token, Some(exec))?;
        self.finish_logits()
    }

    /// Runs `token` and returns the index of its largest logit, computed on the device (only
    /// one number comes back).
    pub fn forward_greedy(&mut self, token: u32) -> Result<u32> {
        self.run(token, None)?;
        let dev = &*self.model.dev;
        let n = self.config().vocab_size;
        // SAFETY: `logits` holds vocab values, `best` one.
        unsafe { dev.argmax(self.logits.addr(), n, self.best.addr())? };
        Ok(self.best.to_vec(dev, 1)?[0])
    }

    fn finish_logits(&mut self) -> Result<&mut [f32]> {
        self.logits.read(&*self.model.dev, &mut self.host_logits)?;
        Ok(&mut self.host_logits)
    }

    /// Queues one token's forward pass up to the logits (and waits for it where `exec` needs
    /// the layers' inputs on the host).
    fn run(&mut self, token: u32, exec: Option<&mut dyn FfnExecutor>) -> Result<()> {
        check_tokens(self.config(), self.max_context - self.pos, &[token])?;
        let model = Arc::clone(&self.model);
        let (dev, c) = (&*model.dev, &model.host.weights.config);
        model.host.embed_row(token as usize, &mut self.host_x)?;
        if c.embedding_scale != 1.0 {
            self.host_x.iter_mut().for_each(|v| *v *= c.embedding_scale);
        }
        self.x.write(dev, &self.host_x)?;
        layer::layers(self, c, exec, &never)?;
        // SAFETY: every buffer below is this session's or the model's, sized at their creation
        // for this configuration; `x`, `xn` hold d_model values, `logits` vocab, and each head
        // piece's rows are rows of the head.
        unsafe {
            let (xn, logits) = (self.xn.addr(), &self.logits);
            let norm = model.output_norm.addr();
            dev.rmsnorm(xn, self.x.addr(), norm, c.d_model, 1, c.rms_eps)?;
            if let Some(o) = &model.output {
                o.apply(dev, xn, Addr::NULL, logits.addr())?;
            }
            model
                .host
                .for_each_head_piece(HeadSpan::Streamed, &mut |piece| {
                    let staged = self.stage(dev, &[&piece.m])?;
                    staged[0].apply(
                        dev,
                        xn,
                        Addr::NULL,
                        logits.span(piece.rows.start, piece.rows.len()),
                    )?;
                    self.release(dev)
                })?;
        }
        self.pos += 1;
        Ok(())
    }

    /// Where the kernels read `matrices` (views of a weight-stream slot): in place where the
    /// slot is mapped, else copied into the staging buffer, each from a 16-byte boundary, once
    /// the kernels queued before have run.
    fn stage(&self, dev: &dyn Device, matrices: &[&QRows]) -> Result<Vec<DeviceRows>> {
        let mut at = 0;
        let mut staged = Vec::with_capacity(matrices.len());
        for m in matrices {
            let bytes = m.backing().as_slice();
            if m.is_grouped()
                || m.tiled_rows() > 0
                || bytes.is_empty()
                || bytes.len() != m.stored_bytes()
            {
                return Err(Error::Cuda(format!(
                    "a streamed {:?} piece of {} rows is not rows back to back",
                    m.dtype, m.rows
                )));
            }
            let addr = match self.in_place(bytes) {
                Some(a) => a,
                None => {
                    self.staging.write_at(dev, at, bytes)?;
                    let a = self.staging.at(at);
                    at = (at + bytes.len()).next_multiple_of(16);
                    a
                }
            };
            staged.push(DeviceRows {
                at: addr,
                dtype: m.dtype,
                rows: m.rows,
                cols: m.cols,
            });
        }
        Ok(staged)
    }

    /// The device address of `bytes` where one mapped slot holds all of them.
    fn in_place(&self, bytes: &[u8]) -> Option<Addr> {
        let last = bytes.last()?;
        self.model.slots.iter().find_map(|s| {
            let first = s.device_addr(bytes.as_ptr())?;
            s.device_addr(last).map(|_| first)
        })
    }

    /// Before a slot goes back to the weight stream (to be read into again): waits for the
    /// kernels that read it in place. Nothing to wait for when pieces are staged: each copy
    /// waited for the kernels queued before it.
    fn release(&self, dev: &dyn Device) -> Result<()> {
        if self.model.slots.is_empty() {
            Ok(())
        } else {
            dev.sync()
        }
    }

    /// Calls `f` for each of layer `l`'s pieces of `parts` in compute order, its matrices
    /// staged (a streamed layer: read by the weight stream, then copied to the device).
    fn each_streamed(
        &self,
        l: usize,
        parts: &[Part],
        f: &mut dyn FnMut(&PieceView, &[DeviceRows]) -> Result<()>,
    ) -> Result<()> {
        let dev = &*self.model.dev;
        let mut failed = None;
        self.model.host.layer_pieces(l).each(parts, &mut |views| {
            for v in views {
                if failed.is_some() {
                    return;
                }
                let matrices: Vec<&QRows> = v.m.iter().collect();
                if let Err(e) = self.stage(dev, &matrices).and_then(|w| f(v, &w)) {
                    failed = Some(e);
                }
            }
            // The unit's lease ends when the next unit is asked for, after this returns.
            if let Err(e) = self.release(dev) {
                failed.get_or_insert(e);
            }
        })?;
        failed.map_or(Ok(()), Err)
    }

    /// Where position `pos` of layer `l` starts in the KV caches.
    fn kv_at(&self, l: usize, pos: usize) -> usize {
        (l * self.max_context + pos) * self.config().kv_dim()
    }
}

impl GpuSession {
    /// The FFN of a layer the weight stream brings: each piece's gate and up rows and the
    /// activation into `h`, then the down rows' outputs into `proj` (the CPU's order).
    fn streamed_ffn(&mut self, l: usize, activation: FfnActivation) -> Result<()> {
        let dev = &*self.model.dev;
        let (xn, h, up) = (self.xn.addr(), &self.h, &self.up);
        self.each_streamed(l, &[Part::GateUp, Part::Neurons], &mut |v, w| {
            let r = v.rows.clone();
            if v.part != Part::GateUp {
                return Err(Error::Cuda(format!(
                    "layer {l}: {:?} pieces stream on the CPU only",
                    v.part
                )));
            }
            // SAFETY: see the LayerSteps impl; neurons `r` of `h` and `up` are the piece's.
            unsafe {
                let (h, up) = (h.span(r.start, r.len()), up.span(r.start, r.len()));
                w[0].apply(dev, xn, Addr::NULL, h)?;
                w[1].apply(dev, xn, Addr::NULL, up)?;
                dev.gate(activation, h, up, r.len())
            }
        })?;
        let proj = &self.proj;
        self.each_streamed(l, &[Part::Down], &mut |v, w| {
            // SAFETY: see the LayerSteps impl; the piece's rows are outputs `rows` of W_down,
            // each over all n_ff activations.
            unsafe {
                w[0].apply(
                    dev,
                    h.addr(),
                    Addr::NULL,
                    proj.span(v.rows.start, v.rows.len()),
                )
            }
        })
    }
}

/// The optional vector's address, or null.
fn or_null(b: &Option<Buffer<f32>>) -> Addr {
    b.as_ref().map_or(Addr::NULL, Buffer::addr)
}

/// The layer steps for the token at `self.pos`. Safety of every launch below: the buffers are
/// this session's and its model's, sized at their creation for this configuration (`x`, `xn`,
/// `proj` d_model values; `q`, `att` q_dim; the caches `n_layers × max_context × kv_dim`, and
/// `pos < max_context` by `check_tokens`), and they live as long as the session, which waits for
/// the device before it hands anything back.
impl LayerSteps for GpuSession {
    fn begin_layer(&mut self, l: usize, exec: Option<&mut dyn FfnExecutor>) -> Result<()> {
        if let Some(e) = exec {
            self.x.read(&*self.model.dev, &mut self.host_x)?;
            e.begin_layer(l, &self.host_x);
        }
        Ok(())
    }

    fn norm_input(&mut self, l: usize, block: Block) -> Result<()> {
        let (dev, layer) = (&*self.model.dev, &self.model.layers[l]);
        let c = &self.model.host.weights.config;
        let w = match block {
            Block::Attention => &layer.attn_norm,
            Block::Ffn => &layer.ffn_norm,
        };
        let (xn, x) = (self.xn.addr(), self.x.addr());
        // SAFETY: see the impl.
        unsafe { dev.rmsnorm(xn, x, w.addr(), c.d_model, 1, c.rms_eps) }
    }

    fn qkv(&mut self, l: usize) -> Result<()> {
        let (dev, layer) = (&*self.model.dev, &self.model.layers[l]);
        let at = self.kv_at(l, self.pos);
        let (k_slot, v_slot) = (self.key_cache.at(at), self.value_cache.at(at));
        let xn = self.xn.addr();
        // K and V go straight to the caches at this position.
        let Some(p) = &layer.projections else {
            return self.each_streamed(l, &[Part::Q, Part::K, Part::V], &mut |v, w| {
                let (r, n) = (v.rows.start, v.rows.len());
                let (y, bias) = match v.part {
                    Part::Q => (self.q.span(r, n), &layer.bq),
                    Part::K => (self.key_cache.span(at + r, n), &layer.bk),
                    _ => (self.value_cache.span(at + r, n), &layer.bv),
                };
                let bias = bias.as_ref().map_or(Addr::NULL, |b| b.span(r, n));
                // SAFETY: see the impl; the piece's rows `r..` of the projection write its
                // outputs `r..` (of a bias too).
                unsafe { w[0].apply(dev, xn, bias, y) }
            });
        };
        for (m, b, y) in [
            (&p.wq, &layer.bq, self.q.addr()),
            (&p.wk, &layer.bk, k_slot),
            (&p.wv, &layer.bv, v_slot),
        ] {
            // SAFETY: see the impl.
            unsafe { m.apply(dev, xn, or_null(b), y)? };
        }
        Ok(())
    }

    fn position(&mut self, l: usize) -> Result<()> {
        let (model, c) = (&*self.model, self.config());
        let (dev, layer) = (&*model.dev, &model.layers[l]);
        let (hd, eps) = (c.head_dim, c.rms_eps);
        let k_slot = self.key_cache.at(self.kv_at(l, self.pos));
        let freqs = model.rope_freqs[model.rope_of_layer[l]].addr();
        for (x, heads, norm) in [
            (self.q.addr(), c.n_heads, &layer.q_norm),
            (k_slot, c.n_kv_heads, &layer.k_norm),
        ] {
            // SAFETY: see the impl; a QK-norm weight holds head_dim values.
            unsafe {
                if let Some(w) = norm {
                    dev.rmsnorm(x, x, w.addr(), hd, heads, eps)?;
                }
                dev.rope(x, heads, hd, self.pos, freqs, c.rope_style)?;
            }
        }
        Ok(())
    }

    fn attend(&mut self, l: usize, window: Option<usize>) -> Result<()> {
        let c = self.config();
        let n_pos = self.pos + 1;
        let shape = AttentionShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            first: window.map_or(0, |w| n_pos.saturating_sub(w)),
            n_pos,
        };
        let (kv_dim, base) = (c.kv_dim(), self.kv_at(l, 0));
        let (keys, values) = (self.key_cache.at(base), self.value_cache.at(base));
        let (q, att) = (self.q.addr(), self.att.addr());
        // SAFETY: see the impl.
        unsafe {
            self.model
                .dev
                .attention(q, keys, values, att, shape, kv_dim)
        }
    }

    fn project_out(&mut self, l: usize) -> Result<()> {
        let (dev, att) = (&*self.model.dev, self.att.addr());
        let Some(p) = &self.model.layers[l].projections else {
            return self.each_streamed(l, &[Part::O], &mut |v, w| {
                let y = self.proj.span(v.rows.start, v.rows.len());
                // SAFETY: see the impl; the piece's rows are rows of W_o.
                unsafe { w[0].apply(dev, att, Addr::NULL, y) }
            });
        };
        // SAFETY: see the impl.
        unsafe { p.wo.apply(dev, att, Addr::NULL, self.proj.addr()) }
    }

    fn ffn(
        &mut self,
        l: usize,
        activation: FfnActivation,
        exec: Option<&mut dyn FfnExecutor>,
    ) -> Result<()> {
        let model = Arc::clone(&self.model);
        let dev = &*model.dev;
        if let Some(e) = exec {
            self.xn.read(dev, &mut self.host_xn)?;
            let layer = &model.host.weights.layers[l];
            e.ffn(l, layer, &self.host_xn, &mut self.host_out)?;
            return self.proj.write(dev, &self.host_out);
        }
        if model.layers[l].projections.is_none() {
            return self.streamed_ffn(l, activation);
        }
        let ffn = model.layers[l].ffn.as_ref().ok_or_else(|| {
            Error::Cuda(
                "the model was uploaded without its FFN (streamed): decode it with \
                 forward_with and a streaming pipeline"
                    .into(),
            )
        })?;
        self.proj.clear(dev)?;
        let chunks = Gathered {
            ptrs: ffn.ptrs.addr(),
            index: ffn.index.addr(),
            n: model.ffn_layout.chunks_per_layer,
        };
        let (xn, h, proj) = (self.xn.addr(), self.h.addr(), self.proj.addr());
        // SAFETY: see the impl; every chunk of the layer is in `ffn`, laid out as
        // `ffn_layout`, and `h` holds n_ff values.
        unsafe {
            let layout = &model.ffn_layout;
            dev.ffn_gathered(layout, chunks, activation, 0.0, xn, h, proj, Addr::NULL)
        }
    }

    fn add_residual(&mut self, l: usize, block: Block) -> Result<()> {
        let (dev, layer) = (&*self.model.dev, &self.model.layers[l]);
        let c = &self.model.host.weights.config;
        let norm = match block {
            Block::Attention => &layer.post_attn_norm,
            Block::Ffn => &layer.post_ffn_norm,
        };
        let (x, proj) = (self.x.addr(), self.proj.addr());
        // SAFETY: see the impl.
        unsafe {
            if let Some(w) = norm {
                dev.rmsnorm(proj, proj, w.addr(), c.d_model, 1, c.rms_eps)?;
            }
            dev.add(x, proj, c.d_model)
        }
    }
}

impl Decode for GpuSession {
    fn forward(&mut self, token: u32) -> Result<&mut [f32]> {
        GpuSession::forward(self, token)
    }
    fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        GpuSession::forward_batch(self, tokens)
    }
    fn position(&self) -> usize {
        self.pos
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
    fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        GpuSession::forward_with(self, token, exec)
    }
    fn rewind(&mut self, position: usize) -> Result<()> {
        if position > self.pos {
            return Err(Error::InvalidArgument {
                arg: "position",
                reason: format!("{position} is past the {} tokens held", self.pos),
            });
        }
        self.pos = position;
        Ok(())
    }
    fn reset(&mut self) {
        GpuSession::reset(self)
    }
    /// Host staging buffers plus this session's device memory: the device KV cache is f32 and
    /// reserved whole at open (on Jetson device memory is the same DRAM), so it never grows.
    fn bytes(&self) -> u64 {
        (self.host_bytes() + self.own_device_bytes()) as u64
    }
    /// Always 0: the device KV cache holds `max_context` tokens from the start.
    fn kv_growth_bytes(&self, _tokens: usize) -> u64 {
        0
    }
    fn grow_kv(&mut self, tokens: usize) -> Result<()> {
        if self.pos.saturating_add(tokens) > self.max_context {
            return Err(Error::InvalidArgument {
                arg: "tokens",
                reason: format!(
                    "{tokens} more tokens do not fit in the context ({} of {} free)",
                    self.max_context - self.pos,
                    self.max_context
                ),
            });
        }
        Ok(())
    }
    /// Forgets the conversation; the device KV cache stays reserved (it is one allocation).
    fn release_kv(&mut self) {
        GpuSession::reset(self)
    }
    fn device_bytes(&self) -> Option<u64> {
        Some((self.model.device_bytes() + self.own_device_bytes()) as u64)
    }
}

/// Sessions move to the daemon's engine thread.
const _: () = {
    const fn send<T: Send>() {}
    send::<GpuSession>();
};
