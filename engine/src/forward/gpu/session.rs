//! One conversation on a GPU ([`GpuSession`]): its KV cache and scratch in device memory, and
//! the steps of the one forward pass ([`LayerSteps`]) as kernel launches.

use std::sync::Arc;

use super::model::{DeviceRows, GpuModel};
use crate::backend::device::{Addr, Buffer, Device, Gathered};
use crate::backend::ops::AttentionShape;
use crate::forward::layer::{self, Block, LayerSteps, never};
use crate::forward::planned::{HeadSpan, PieceView};
use crate::forward::{Decode, FfnExecutor, check_tokens};
use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, ModelConfig, QRows};
use crate::plan::Part;
use crate::{Error, Result};

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
    chunk_ptrs: Buffer<u64>,  // (n_ff) a streamed .lsm piece's chunk addresses
    chunk_index: Buffer<u32>, // (n_ff) and their indices
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
        // Room for a streamed FFN's up rows and a .lsm piece's chunk list.
        let streamed_ff = if model.streams() { c.n_ff } else { 0 };
        Ok(GpuSession {
            key_cache: Buffer::zeros(d, "key cache", kv)?,
            value_cache: Buffer::zeros(d, "value cache", kv)?,
            x: Buffer::zeros(d, "x", c.d_model)?,
            xn: Buffer::zeros(d, "xn", c.d_model)?,
            q: Buffer::zeros(d, "q", c.q_dim())?,
            att: Buffer::zeros(d, "att", c.q_dim())?,
            proj: Buffer::zeros(d, "proj", c.d_model)?,
            h: Buffer::zeros(d, "h", c.n_ff)?,
            up: Buffer::zeros(d, "up", streamed_ff)?,
            staging: Buffer::zeros(d, "staging", model.staging_bytes)?,
            chunk_ptrs: Buffer::zeros(d, "chunk pointers", streamed_ff)?,
            chunk_index: Buffer::zeros(d, "chunk indices", streamed_ff)?,
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
            + self.chunk_ptrs.bytes()
            + self.chunk_index.bytes()
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
                o.rows.apply(dev, xn, Addr::NULL, logits.addr())?;
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
                // A `.lsm` piece's bundles are staged whole by its callback.
                let matrices: Vec<&QRows> = match v.part {
                    Part::Neurons => Vec::new(),
                    _ => v.m.iter().collect(),
                };
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
    /// activation into `h`, then the down rows' outputs into `proj` (the CPU's order); or, for a
    /// `.lsm` layer, each piece's neuron bundles through the gathered kernels, their down sums
    /// added into `proj`.
    fn streamed_ffn(&mut self, l: usize, activation: FfnActivation) -> Result<()> {
        let dev = &*self.model.dev;
        let (xn, h, up) = (self.xn.addr(), &self.h, &self.up);
        self.proj.clear(dev)?;
        self.each_streamed(l, &[Part::GateUp, Part::Neurons], &mut |v, w| {
            let r = v.rows.clone();
            if v.part == Part::Neurons {
                return self.neuron_piece(dev, v, activation);
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

impl GpuSession {
    /// A piece of a `.lsm` layer's neuron bundles (gate row, up row, down column per neuron,
    /// chunk after chunk, as the file stores them): the gathered FFN kernels over its chunks,
    /// their activations into `h` and down sums added to `proj`.
    fn neuron_piece(&self, dev: &dyn Device, v: &PieceView, act: FfnActivation) -> Result<()> {
        let c = self.config();
        let [g, u, down] = [&v.m[0], &v.m[1], &v.m[2]];
        let cn = g.group_rows();
        let refuse = |why: &str| {
            Error::Cuda(format!(
                "neuron piece {:?} of {cn}-neuron chunks: {why}",
                v.rows
            ))
        };
        let layout = ChunkLayout::one_layer(c.n_ff, c.d_model, cn, [g.dtype, u.dtype, down.dtype])
            .ok_or_else(|| refuse("no chunk layout for these types"))?;
        let base = g.row(0).as_ptr();
        let off = |row: &[u8]| row.as_ptr() as usize - base as usize;
        let laid_out = off(u.row(0)) == layout.up_at
            && off(down.row(0)) == layout.down_at
            && (g.rows < 2 || off(g.row(1)) == layout.bundle_bytes)
            && (g.rows <= cn || off(g.row(cn)) == layout.chunk_bytes)
            && v.rows.start.is_multiple_of(cn)
            && (v.rows.end.is_multiple_of(cn) || v.rows.end == c.n_ff);
        if !laid_out {
            return Err(refuse("not whole chunks laid out as the .lsm stores them"));
        }
        let last = down.row(down.rows - 1);
        // SAFETY: the three matrices view one slot (or the file image) holding the piece's
        // bundles back to back from its first gate row to its last down column.
        let region = unsafe { std::slice::from_raw_parts(base, off(last) + last.len()) };
        let at = match self.in_place(region) {
            Some(a) => a,
            None => {
                self.staging.write_at(dev, 0, region)?;
                self.staging.addr()
            }
        };
        let (first, n) = (v.rows.start / cn, v.rows.len().div_ceil(cn));
        let ptrs: Vec<u64> = (0..n)
            .map(|j| at.offset::<u8>(j * layout.chunk_bytes).0)
            .collect();
        let index: Vec<u32> = (first..first + n).map(|c| c as u32).collect();
        self.chunk_ptrs.write(dev, &ptrs)?;
        self.chunk_index.write(dev, &index)?;
        let chunks = Gathered {
            ptrs: self.chunk_ptrs.addr(),
            index: self.chunk_index.addr(),
            n,
        };
        let (xn, h, proj) = (self.xn.addr(), self.h.addr(), self.proj.addr());
        // SAFETY: see the LayerSteps impl; the listed chunks are the piece's, laid out as
        // `layout` (checked above), in place or staged, and `h` holds n_ff values.
        unsafe { dev.ffn_gathered(&layout, chunks, act, 0.0, xn, h, proj, Addr::NULL) }
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
            unsafe { m.rows.apply(dev, xn, or_null(b), y)? };
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
        unsafe { p.wo.rows.apply(dev, att, Addr::NULL, self.proj.addr()) }
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
