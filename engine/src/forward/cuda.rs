//! The forward pass on the GPU: [`CudaModel`] holds the resident weights in device memory,
//! [`CudaSession`] one conversation's KV cache and scratch there. One token at a time; the
//! host sees the logits at the end of a token, and, in [`CudaSession::forward_with`], each
//! layer's FFN input and output (so the streaming pipeline's selection, I/O and cache run as on
//! the CPU while the kernels run here).
//!
//! The dense FFN uses the same gathered kernels as the sparse one, over every chunk of a layer:
//! the model's gate, up and down rows are packed into neuron bundles (the `.lsm` chunk layout)
//! when uploaded, so one kernel pair serves dense and sparse and is tested once.
//!
//! The kernels and device memory are [`crate::backend::cuda`]'s; the pass that strings them
//! together is here, beside the CPU's, because it runs the loaded [`Model`].

use std::sync::Arc;

use cust::memory::{CopyDestination, DeviceBuffer, DevicePointer};

use super::{Decode, FfnExecutor, Model, check_tokens};
use crate::backend::cuda::{
    CudaBackend, GatheredChunks, cuda, download, download_into, upload, zeros,
};
use crate::model::lsm::ChunkLayout;
use crate::model::{Down, FfnActivation, ModelConfig, QRows};
use crate::quant::DType;
use crate::{Error, Result};

/// Neurons per chunk of the resident dense FFN (one block of the down kernel's grid per chunk).
const RESIDENT_CHUNK_NEURONS: usize = 64;

/// A quantised matrix in device memory, rows back to back.
struct DeviceMatrix {
    bytes: DeviceBuffer<u8>,
    dtype: DType,
    rows: usize,
    cols: usize,
}

impl DeviceMatrix {
    fn new(what: &str, m: &QRows) -> Result<DeviceMatrix> {
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
        Ok(DeviceMatrix {
            bytes: upload(what, &packed)?,
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
        })
    }
}

/// One layer's FFN as neuron chunks in device memory, with the pointer list of all of them.
struct DeviceFfn {
    _chunks: DeviceBuffer<u8>,
    ptrs: DeviceBuffer<u64>,
    index: DeviceBuffer<u32>,
}

struct DeviceLayer {
    attn_norm: DeviceBuffer<f32>,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
    bq: Option<DeviceBuffer<f32>>,
    bk: Option<DeviceBuffer<f32>>,
    bv: Option<DeviceBuffer<f32>>,
    ffn_norm: DeviceBuffer<f32>,
    /// `None` when the FFN is streamed (the pipeline's cache holds it instead).
    ffn: Option<DeviceFfn>,
}

/// A model's weights in device memory (the token embeddings stay on the host: one row per token
/// is looked up there and copied over).
pub struct CudaModel {
    gpu: Arc<CudaBackend>,
    host: Arc<Model>,
    layers: Vec<DeviceLayer>,
    output_norm: DeviceBuffer<f32>,
    output: DeviceMatrix,
    ffn_layout: ChunkLayout,
    device_bytes: usize,
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModel")
            .field("model", &self.host.path)
            .field("device", &self.gpu.device())
            .field("device_bytes", &self.device_bytes)
            .finish_non_exhaustive()
    }
}

/// Packs a layer's FFN into neuron bundles of `layout` (gate row | up row | down column).
/// A down projection stored as rows (GGUF, safetensors) is transposed into f32 columns.
fn pack_ffn(layer: &crate::model::FfnWeights, layout: &ChunkLayout) -> Vec<u8> {
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
fn upload_ffn(ffn: &crate::model::FfnWeights, layout: &ChunkLayout) -> Result<DeviceFfn> {
    let chunks = upload("FFN chunks", &pack_ffn(ffn, layout))?;
    let base = chunks.as_device_ptr();
    let ptrs: Vec<u64> = (0..layout.chunks_per_layer)
        .map(|i| base.wrapping_add(i * layout.chunk_bytes).as_raw())
        .collect();
    let index: Vec<u32> = (0..layout.chunks_per_layer as u32).collect();
    Ok(DeviceFfn {
        _chunks: chunks,
        ptrs: upload("chunk pointers", &ptrs)?,
        index: upload("chunk index", &index)?,
    })
}

fn optional(what: &str, v: &Option<Vec<f32>>) -> Result<Option<DeviceBuffer<f32>>> {
    v.as_ref().map(|b| upload(what, b)).transpose()
}

impl CudaModel {
    /// Uploads `model`'s resident weights, and with `with_ffn` every FFN neuron too (dense
    /// decoding), to the device behind `gpu`. Without the FFN only
    /// [`CudaSession::forward_with`] runs: the streaming pipeline brings the FFN.
    pub fn new(gpu: Arc<CudaBackend>, model: Arc<Model>, with_ffn: bool) -> Result<CudaModel> {
        if model.plan().is_some_and(|p| p.streams()) {
            return Err(Error::InvalidArgument {
                arg: "backend",
                reason: "the CUDA backend uploads every weight; a memory plan that streams \
                         weights from storage runs on the CPU (--backend cpu)"
                    .into(),
            });
        }
        let c = &model.weights.config;
        let missing: Vec<&str> = [
            (c.qk_norm, "QK-norm"),
            (c.post_norms, "post-norms"),
            (c.sliding_window.is_some(), "sliding-window attention"),
            (c.rope_freq_factors.is_some(), "RoPE frequency scaling"),
            (c.embedding_scale != 1.0, "scaled embeddings"),
            (c.activation == FfnActivation::GeluTanh, "GeGLU"),
        ]
        .into_iter()
        .filter_map(|(has, name)| has.then_some(name))
        .collect();
        if !missing.is_empty() {
            return Err(Error::unsupported(
                &model.path,
                format!(
                    "the CUDA backend does not run {} yet ({} model); use --backend cpu",
                    missing.join(", "),
                    c.architecture.name()
                ),
            ));
        }
        let w = &model.weights;
        gpu.bind()?;
        let c = &w.config;
        let first = &w.layers[0].ffn;
        let down_dtype = match &first.down {
            Down::Neurons(m) => m.dtype,
            Down::Rows(_) => DType::F32,
        };
        let ffn_layout = ChunkLayout::one_layer(
            c.n_ff,
            c.d_model,
            RESIDENT_CHUNK_NEURONS,
            [first.gate.dtype, first.up.dtype, down_dtype],
        )
        .ok_or_else(|| Error::Cuda("the FFN row types do not fit d_model".into()))?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for (l, lw) in w.layers.iter().enumerate() {
            let down = match &lw.ffn.down {
                Down::Neurons(m) => m.dtype,
                Down::Rows(_) => DType::F32,
            };
            let types = [lw.ffn.gate.dtype, lw.ffn.up.dtype, down];
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
            let ffn = if with_ffn {
                Some(upload_ffn(&lw.ffn, &ffn_layout)?)
            } else {
                None
            };
            layers.push(DeviceLayer {
                attn_norm: upload("attn_norm", &lw.attn_norm)?,
                wq: DeviceMatrix::new("wq", &lw.wq)?,
                wk: DeviceMatrix::new("wk", &lw.wk)?,
                wv: DeviceMatrix::new("wv", &lw.wv)?,
                wo: DeviceMatrix::new("wo", &lw.wo)?,
                bq: optional("bq", &lw.bq)?,
                bk: optional("bk", &lw.bk)?,
                bv: optional("bv", &lw.bv)?,
                ffn_norm: upload("ffn_norm", &lw.ffn_norm)?,
                ffn,
            });
        }
        let output = DeviceMatrix::new("output", &w.output)?;
        let output_norm = upload("output_norm", &w.output_norm)?;
        let matrices: usize = w
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo]
                    .iter()
                    .map(|m| m.stored_bytes())
                    .sum::<usize>()
                    + 3 * c.d_model * 4
            })
            .sum();
        let ffn_bytes = if with_ffn {
            w.layers.len() * ffn_layout.chunks_per_layer * ffn_layout.chunk_bytes
        } else {
            0
        };
        let device_bytes = matrices + ffn_bytes + w.output.stored_bytes();
        Ok(CudaModel {
            gpu,
            host: model,
            layers,
            output_norm,
            output,
            ffn_layout,
            device_bytes,
        })
    }

    /// The host model (tokenizer, configuration, embeddings).
    pub fn model(&self) -> &Arc<Model> {
        &self.host
    }

    /// The backend the weights live on.
    pub fn gpu(&self) -> &Arc<CudaBackend> {
        &self.gpu
    }

    /// Bytes of device memory the weights take.
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }
}

/// One conversation on the GPU: its KV cache and scratch in device memory.
pub struct CudaSession {
    model: Arc<CudaModel>,
    max_context: usize,
    pos: usize,
    key_cache: DeviceBuffer<f32>,   // (n_layers, max_context, kv_dim)
    value_cache: DeviceBuffer<f32>, // (n_layers, max_context, kv_dim)
    x: DeviceBuffer<f32>,           // (d_model) residual stream
    xn: DeviceBuffer<f32>,          // (d_model)
    q: DeviceBuffer<f32>,           // (q_dim)
    att: DeviceBuffer<f32>,         // (q_dim)
    proj: DeviceBuffer<f32>,        // (d_model)
    h: DeviceBuffer<f32>,           // (n_ff)
    logits: DeviceBuffer<f32>,      // (vocab)
    best: DeviceBuffer<u32>,        // (1)
    host_x: Vec<f32>,               // (d_model) embedding out, residual back (streaming)
    host_xn: Vec<f32>,              // (d_model) FFN input back (streaming)
    host_out: Vec<f32>,             // (d_model) FFN output out (streaming)
    host_logits: Vec<f32>,          // (vocab)
}

impl std::fmt::Debug for CudaSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaSession")
            .field("model", &self.model)
            .field("pos", &self.pos)
            .field("max_context", &self.max_context)
            .finish_non_exhaustive()
    }
}

impl CudaSession {
    /// A session with room for `max_context` tokens.
    pub fn new(model: Arc<CudaModel>, max_context: usize) -> Result<CudaSession> {
        model.gpu.bind()?;
        let c = model.host.weights.config.clone();
        if max_context == 0 || max_context > c.context_length {
            return Err(Error::InvalidArgument {
                arg: "max_context",
                reason: format!("{max_context} is outside 1..={}", c.context_length),
            });
        }
        let kv = c.n_layers * max_context * c.kv_dim();
        Ok(CudaSession {
            key_cache: zeros("key cache", kv)?,
            value_cache: zeros("value cache", kv)?,
            x: zeros("x", c.d_model)?,
            xn: zeros("xn", c.d_model)?,
            q: zeros("q", c.q_dim())?,
            att: zeros("att", c.q_dim())?,
            proj: zeros("proj", c.d_model)?,
            h: zeros("h", c.n_ff)?,
            logits: zeros("logits", c.vocab_size)?,
            best: zeros("argmax", 1)?,
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
    pub fn model(&self) -> &Arc<CudaModel> {
        &self.model
    }

    /// Bytes of device memory this session holds itself (KV cache and scratch; the model's
    /// weights are [`CudaModel::device_bytes`]).
    pub fn own_device_bytes(&self) -> usize {
        let c = &self.model.host.weights.config;
        4 * (2 * c.n_layers * self.max_context * c.kv_dim()
            + 3 * c.d_model
            + 2 * c.q_dim()
            + c.n_ff
            + c.vocab_size)
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

    /// Runs `token` with each layer's FFN computed by `exec` on the host-visible input (the
    /// streaming pipeline): attention, norms and the output head stay on the device.
    pub fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        self.run(token, Some(exec))?;
        self.finish_logits()
    }

    /// Runs `token` and returns the index of its largest logit, computed on the device (only
    /// one number comes back).
    pub fn forward_greedy(&mut self, token: u32) -> Result<u32> {
        self.run(token, None)?;
        let gpu = &self.model.gpu;
        let n = self.config().vocab_size;
        gpu.argmax_on(self.logits.as_device_ptr(), n, self.best.as_device_ptr())?;
        gpu.sync()?;
        Ok(download(&self.best, 1)?[0])
    }

    fn finish_logits(&mut self) -> Result<&mut [f32]> {
        self.model.gpu.sync()?;
        self.logits
            .copy_to(&mut self.host_logits[..])
            .map_err(cuda("copying the logits"))?;
        Ok(&mut self.host_logits)
    }

    /// Queues one token's forward pass up to the logits (and waits for it where `exec` needs
    /// the FFN input on the host).
    fn run(&mut self, token: u32, mut exec: Option<&mut dyn FfnExecutor>) -> Result<()> {
        check_tokens(self.config(), self.max_context - self.pos, &[token])?;
        let model = Arc::clone(&self.model);
        let (gpu, w) = (&model.gpu, &model.host.weights);
        gpu.bind()?;
        let c = &w.config;
        let (d, hd, kv_dim, q_dim) = (c.d_model, c.head_dim, c.kv_dim(), c.q_dim());
        let pos = self.pos;
        // The copy below is synchronous on the legacy stream, which does not wait for this
        // non-blocking stream: wait for the previous token's kernels (a batch queues tokens back
        // to back) so it cannot overwrite `x` under them.
        gpu.sync()?;
        w.token_embd
            .dequantize_row(token as usize, &mut self.host_x);
        self.x
            .copy_from(&self.host_x[..])
            .map_err(cuda("copying the embedding"))?;
        let p = |b: &DeviceBuffer<f32>| b.as_device_ptr();
        let bias = |b: &Option<DeviceBuffer<f32>>| b.as_ref().map_or(DevicePointer::null(), p);
        for (l, layer) in model.layers.iter().enumerate() {
            if let Some(e) = exec.as_deref_mut() {
                gpu.sync()?;
                download_into(&self.x, &mut self.host_x)?;
                e.begin_layer(l, &self.host_x);
            }
            // Attention: norm, projections (K and V straight into the cache), RoPE, attend.
            gpu.rmsnorm_on(
                p(&self.xn),
                p(&self.x),
                p(&layer.attn_norm),
                d,
                1,
                c.rms_eps,
            )?;
            let at = (l * self.max_context + pos) * kv_dim;
            let (k_slot, v_slot) = (
                p(&self.key_cache).wrapping_add(at),
                p(&self.value_cache).wrapping_add(at),
            );
            for (m, b, y) in [
                (&layer.wq, &layer.bq, p(&self.q)),
                (&layer.wk, &layer.bk, k_slot),
                (&layer.wv, &layer.bv, v_slot),
            ] {
                let x = p(&self.xn);
                gpu.matvec_on(
                    m.bytes.as_device_ptr(),
                    m.dtype,
                    m.rows,
                    m.cols,
                    x,
                    bias(b),
                    y,
                )?;
            }
            gpu.rope_on(p(&self.q), c.n_heads, hd, pos, c.rope_base, c.rope_style)?;
            gpu.rope_on(k_slot, c.n_kv_heads, hd, pos, c.rope_base, c.rope_style)?;
            let base = l * self.max_context * kv_dim;
            gpu.attention_on(
                p(&self.q),
                p(&self.key_cache).wrapping_add(base),
                p(&self.value_cache).wrapping_add(base),
                p(&self.att),
                pos + 1,
                [c.n_heads, c.n_kv_heads, hd],
                kv_dim,
            )?;
            let wo = &layer.wo;
            let none = DevicePointer::null();
            gpu.matvec_on(
                wo.bytes.as_device_ptr(),
                wo.dtype,
                d,
                q_dim,
                p(&self.att),
                none,
                p(&self.proj),
            )?;
            gpu.binary_on("add_inplace", p(&self.x), p(&self.proj), d)?;

            // FFN: norm, then the FFN output into `proj`, added to the residual.
            gpu.rmsnorm_on(p(&self.xn), p(&self.x), p(&layer.ffn_norm), d, 1, c.rms_eps)?;
            match exec.as_deref_mut() {
                Some(e) => {
                    gpu.sync()?;
                    download_into(&self.xn, &mut self.host_xn)?;
                    e.ffn(l, &w.layers[l], &self.host_xn, &mut self.host_out)?;
                    self.proj
                        .copy_from(&self.host_out[..])
                        .map_err(cuda("copying the FFN output"))?;
                }
                None => {
                    let ffn = layer.ffn.as_ref().ok_or_else(|| {
                        Error::Cuda(
                            "the model was uploaded without its FFN (streamed): \
                             decode it with forward_with and a streaming pipeline"
                                .into(),
                        )
                    })?;
                    // SAFETY: `proj` is this session's buffer; the memset is queued on the
                    // stream that runs every kernel reading it.
                    unsafe { self.proj.set_32_async(0, gpu.stream()) }
                        .map_err(cuda("clearing the FFN output"))?;
                    let chunks = GatheredChunks {
                        ptrs: ffn.ptrs.as_device_ptr(),
                        index: ffn.index.as_device_ptr(),
                        n: model.ffn_layout.chunks_per_layer,
                    };
                    gpu.ffn_gathered(
                        &model.ffn_layout,
                        chunks,
                        c.activation,
                        0.0,
                        p(&self.xn),
                        p(&self.h),
                        p(&self.proj),
                        DevicePointer::null(),
                    )?;
                }
            }
            gpu.binary_on("add_inplace", p(&self.x), p(&self.proj), d)?;
        }
        // Output head.
        gpu.rmsnorm_on(
            p(&self.xn),
            p(&self.x),
            p(&model.output_norm),
            d,
            1,
            c.rms_eps,
        )?;
        let o = &model.output;
        let none = DevicePointer::null();
        gpu.matvec_on(
            o.bytes.as_device_ptr(),
            o.dtype,
            o.rows,
            o.cols,
            p(&self.xn),
            none,
            p(&self.logits),
        )?;
        self.pos += 1;
        Ok(())
    }
}

impl Decode for CudaSession {
    fn forward(&mut self, token: u32) -> Result<&mut [f32]> {
        CudaSession::forward(self, token)
    }
    fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        CudaSession::forward_batch(self, tokens)
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
        CudaSession::forward_with(self, token, exec)
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
        CudaSession::reset(self)
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
        CudaSession::reset(self)
    }
    fn device_bytes(&self) -> Option<u64> {
        Some((self.model.device_bytes() + self.own_device_bytes()) as u64)
    }
}

/// Sessions move to the daemon's engine thread.
const _: () = {
    const fn send<T: Send>() {}
    send::<CudaSession>();
};
