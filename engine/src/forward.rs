//! The engine's dense forward pass on the CPU: weights stay quantised, dot products go through the
//! SIMD kernels of [`crate::backend::cpu`], and every buffer is allocated once per session.
//!
//! [`Model`] is immutable and shared (`Arc`) by all sessions; a [`Session`] owns its KV cache and
//! scratch buffers (llama.cpp's model/context split).
//!
//! # Memory
//! A session allocates its scratch at open ([`session_open_bytes`] says how much, before it is
//! opened) and its KV cache in blocks of [`crate::kv::KV_BLOCK_TOKENS`] tokens as the conversation grows
//! (none at open). [`Session::bytes`] reports what it holds, from the allocations themselves;
//! [`Session::kv_growth_bytes`] and [`Session::grow_kv`] let a scheduler reserve a block before
//! it is allocated; a forward pass grows by itself when nobody did.

mod planned;
mod scratch;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::cpu::{self, Disjoint, Kernels, Precision};
use crate::kv::{KvCache, KvType};
use crate::model::{Down, LayerWeights, ModelConfig, Weights};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
pub use planned::Planned;
use scratch::{Scratch, Shape};

/// A loaded model: weights, tokenizer and chat template. Shared by sessions.
#[derive(Debug)]
pub struct Model {
    pub path: PathBuf,
    /// Every weight, as views of the loaded file image. Under a memory plan the streamed ones
    /// view pages that were never read: the forward pass reaches layers, head and embeddings
    /// through `planned` ([`Model::load_within`]).
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    /// The plan and weight stream of a model loaded under a budget.
    pub planned: Option<Planned>,
}

impl Model {
    /// Loads a GGUF file, a safetensors directory or a `.lsm` file.
    pub fn load(path: &Path) -> Result<Arc<Model>> {
        let (weights, tokenizer, chat_template) = crate::model::load(path)?;
        Ok(Arc::new(Model {
            path: path.to_path_buf(),
            weights,
            tokenizer,
            chat_template,
            planned: None,
        }))
    }
}

/// The FFN down projection always runs with f32 activations. Its input (the gated activation) is
/// heavy-tailed, and 8-bit blocks lose too much there: on SmolLM2 and the held-out text, quantising
/// every projection raised perplexity by 0.72 % over the exact path, keeping this one exact by
/// 0.13 %, for ~7 % of the fast path's decode speed.
const DOWN_PRECISION: Precision = Precision::Exact;

/// Most tokens one pass of [`Session::forward_batch`] runs together; longer prompts go in chunks.
/// Each weight row is read once per pass and dotted with every token's activations, so prefill
/// streams the weights once per 32 tokens instead of once per token.
pub const MAX_BATCH: usize = 32;

/// Computes the FFN of one layer for one token, in place of the dense FFN (see
/// [`Session::forward_with`]).
pub trait FfnExecutor {
    /// Called before layer `l`'s attention with the residual stream `x` (`d_model` values): the
    /// earliest view of the layer's input, for speculation about this and later layers.
    fn begin_layer(&mut self, _l: usize, _x: &[f32]) {}

    /// Writes the FFN output of layer `l` for the normalised input `xn` into `out` (both
    /// `d_model` values); the caller adds it to the residual stream.
    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()>;
}

/// One conversation's state: its KV cache and position.
#[derive(Debug)]
pub struct Session {
    model: Arc<Model>,
    precision: Precision,
    max_context: usize,
    pos: usize,
    kv: KvCache, // (blocks of KV_BLOCK_TOKENS) × (n_layers, 2, tokens, kv_dim)
    s: Scratch,
    kernels: &'static Kernels,
}

/// KV bytes of a session of `max_context` tokens once its cache is fully grown, in the default
/// [`KvType`]: an upper bound of what its KV blocks can reach. What a session holds now is
/// [`Session::bytes`]; what it allocates at open, [`session_open_bytes`].
pub fn kv_cache_bytes(w: &Weights, max_context: usize) -> usize {
    let per_token = KvType::default().bytes_per_token(w.config.n_layers, w.config.kv_dim());
    max_context * per_token as usize
}

/// Tasks the neuron-major down projection is split into (one partial sum each): one per compute
/// thread of the pool the caller runs in.
fn down_parts() -> usize {
    rayon::current_num_threads().max(1)
}

/// Heap bytes [`Session::new`]`(model, max_context, _, kv)` allocates (its scratch and the empty
/// block table of its KV cache; no KV block), so a caller can reserve them first. Equal to that
/// session's [`Session::bytes`] when called from the same thread pool.
pub fn session_open_bytes(model: &Model, max_context: usize, kv: KvType) -> u64 {
    let _ = kv; // A new session holds no KV block, whatever its type.
    Shape::new(&model.weights.config, max_context, down_parts()).bytes()
        + KvCache::open_bytes(max_context)
}

impl Session {
    /// Creates a session with room for `max_context` tokens (at most the model's context length)
    /// whose keys and values are stored as `kv`. It holds its scratch and no KV block: the first
    /// forward pass (or [`Session::grow_kv`]) allocates one.
    ///
    /// Errors if `max_context` is out of range or `kv` cannot store this model's KV rows.
    pub fn new(
        model: Arc<Model>,
        max_context: usize,
        precision: Precision,
        kv: KvType,
    ) -> Result<Session> {
        let c = &model.weights.config;
        if max_context == 0 || max_context > c.context_length {
            return Err(Error::InvalidArgument {
                arg: "max_context",
                reason: format!("{max_context} is outside 1..={}", c.context_length),
            });
        }
        let kv = KvCache::new(kv, c.n_layers, c.kv_dim(), max_context)?;
        let shape = Shape::new(c, max_context, down_parts());
        let s = Scratch::new(&shape, c);
        Ok(Session {
            precision,
            max_context,
            pos: 0,
            kv,
            s,
            kernels: Kernels::best(),
            model,
        })
    }

    /// Element type of the KV cache.
    pub fn kv_type(&self) -> KvType {
        self.kv.kv_type()
    }

    /// Every heap byte the session holds now: its scratch and its KV blocks (from the
    /// allocations' capacities). The shared model is not counted.
    pub fn bytes(&self) -> u64 {
        self.s.bytes() + self.kv.bytes()
    }

    /// Bytes that must be allocated so that `tokens` more tokens fit after
    /// [`Session::position`]: whole KV blocks, 0 if they already fit. Tokens beyond
    /// `max_context` are not counted (the caller checks the limit).
    pub fn kv_growth_bytes(&self, tokens: usize) -> u64 {
        self.kv.growth_bytes(self.pos.saturating_add(tokens))
    }

    /// Allocates what [`Session::kv_growth_bytes`]`(tokens)` counts. Errors, allocating
    /// nothing, if `tokens` more do not fit in `max_context`; or if the allocator refuses a block.
    pub fn grow_kv(&mut self, tokens: usize) -> Result<()> {
        self.kv.grow(self.pos.saturating_add(tokens))
    }

    /// Forgets the conversation and frees every KV block ([`Session::bytes`] drops back to
    /// [`session_open_bytes`]).
    pub fn release_kv(&mut self) {
        self.kv.release();
        self.pos = 0;
    }

    /// The model this session runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens in the KV cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Capacity of the KV cache in tokens.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Forgets the conversation. The KV blocks are kept for the next one (its first tokens need
    /// no allocation); [`Session::release_kv`] frees them.
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Runs `token` at the next position and returns the logits over the vocabulary.
    pub fn forward(&mut self, token: u32) -> Result<&mut [f32]> {
        self.forward_batch(&[token])
    }

    /// Runs `tokens` at the next positions, as if by [`Session::forward`] one after the other, and
    /// returns the logits of the last one. The results are the same as token by token (the same
    /// kernels see the same numbers); the weights are streamed once per [`MAX_BATCH`] tokens and
    /// the output head runs only for the last token.
    ///
    /// Errors, before any work, if `tokens` is empty, holds an id outside the vocabulary or does
    /// not fit in the context. Grows the KV cache first if it has no room for them.
    pub fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.check_tokens(tokens)?;
        self.grow_kv(tokens.len())?;
        let model = Arc::clone(&self.model);
        for batch in tokens.chunks(MAX_BATCH) {
            self.embed(batch)?;
            for l in 0..model.weights.layers.len() {
                let layer = model.layer(l)?;
                self.attention(l, &layer, batch.len());
                self.ffn(&layer, batch.len());
            }
            self.pos += batch.len();
        }
        self.head((tokens.len() - 1) % MAX_BATCH)
    }

    /// Runs one token like [`Session::forward`], with each layer's FFN computed by `exec` instead
    /// of the dense FFN: the sparse and streaming pipelines plug in here. Attention, the KV cache
    /// and the output head are the same as the dense path's.
    pub fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        self.check_tokens(&[token])?;
        self.grow_kv(1)?;
        self.embed(&[token])?;
        self.layers_with(1, exec)?;
        self.pos += 1;
        self.head(0)
    }

    /// Runs `tokens` at the next positions like [`Session::forward_batch`] (attention batched per
    /// [`MAX_BATCH`] tokens), with each layer's FFN computed by `exec` one token at a time, and
    /// hands the logits of every token, in order, to `logits(i, …)`. Calibration observes and
    /// changes the FFN through it. For a batch, `exec.begin_layer` is called for each of its
    /// tokens before the layer's attention.
    pub fn forward_batch_with(
        &mut self,
        tokens: &[u32],
        exec: &mut dyn FfnExecutor,
        logits: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        self.check_tokens(tokens)?;
        self.grow_kv(tokens.len())?;
        for (b, batch) in tokens.chunks(MAX_BATCH).enumerate() {
            self.embed(batch)?;
            self.layers_with(batch.len(), exec)?;
            self.pos += batch.len();
            for t in 0..batch.len() {
                logits(b * MAX_BATCH + t, self.head(t)?)?;
            }
        }
        Ok(())
    }

    /// Every layer for the `n` tokens of a batch (already embedded), the FFN by `exec`.
    fn layers_with(&mut self, n: usize, exec: &mut dyn FfnExecutor) -> Result<()> {
        let model = Arc::clone(&self.model);
        let d = model.weights.config.d_model;
        let eps = model.weights.config.rms_eps;
        for l in 0..model.weights.layers.len() {
            let layer = model.layer(l)?;
            for x in self.s.x[..n * d].chunks_exact(d) {
                exec.begin_layer(l, x);
            }
            self.attention(l, &layer, n);
            let s = &mut self.s;
            for t in 0..n {
                let (x, xn, out) = (
                    &mut s.x[t * d..(t + 1) * d],
                    &mut s.xn[t * d..(t + 1) * d],
                    &mut s.proj[t * d..(t + 1) * d],
                );
                cpu::rmsnorm(xn, x, &layer.ffn_norm, eps);
                exec.ffn(l, &layer, xn, out)?;
                norm_rows(&layer.post_ffn_norm, out, d, eps);
                cpu::add_inplace(x, out);
            }
        }
        Ok(())
    }

    /// Errors, before any work, if `tokens` is empty, holds an id outside the vocabulary or does
    /// not fit in the context.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        check_tokens(
            &self.model.weights.config,
            self.max_context - self.pos,
            tokens,
        )
    }

    /// Writes the embeddings of `batch` (at most [`MAX_BATCH`] tokens, at positions from
    /// `self.pos`) into the residual stream and their RoPE angles into the table.
    fn embed(&mut self, batch: &[u32]) -> Result<()> {
        let model = &self.model;
        let c = &model.weights.config;
        let d = c.d_model;
        for (t, &token) in batch.iter().enumerate() {
            let x = &mut self.s.x[t * d..(t + 1) * d];
            model.embed_row(token as usize, x)?;
            if c.embedding_scale != 1.0 {
                x.iter_mut().for_each(|v| *v *= c.embedding_scale);
            }
            self.s.set_rope(t, self.pos + t);
        }
        Ok(())
    }

    /// The output head over token `last` of the batch just run: final norm, then logits.
    fn head(&mut self, last: usize) -> Result<&mut [f32]> {
        let model = &self.model;
        let w = &model.weights;
        let c = &w.config;
        let s = &mut self.s;
        let d = c.d_model;
        cpu::rmsnorm(
            &mut s.xn[..d],
            &s.x[last * d..(last + 1) * d],
            &w.output_norm,
            c.rms_eps,
        );
        let x = self
            .kernels
            .prepare(&s.xn[..d], self.precision, &mut s.acts);
        let (k, logits) = (self.kernels, &mut s.logits);
        model.for_each_head_piece(&mut |piece| {
            k.matvecs(x, [(&piece.m, &mut logits[piece.rows.clone()])]);
            Ok(())
        })?;
        Ok(&mut self.s.logits)
    }

    /// The attention block for the `n` tokens of a batch, at positions `self.pos..self.pos + n`.
    fn attention(&mut self, l: usize, layer: &LayerWeights, n: usize) {
        let c = &self.model.weights.config;
        let (d, hd, kv_dim, q_dim) = (c.d_model, c.head_dim, c.kv_dim(), c.q_dim());
        let (pos0, p) = (self.pos, self.precision);
        let (k, s) = (self.kernels, &mut self.s);
        for (xn, x) in s.xn.chunks_exact_mut(d).zip(s.x.chunks_exact(d)).take(n) {
            cpu::rmsnorm(xn, x, &layer.attn_norm, c.rms_eps);
        }
        let x = k.prepare(&s.xn[..n * d], p, &mut s.acts);
        k.matmats(
            x,
            n,
            [
                (&layer.wq, &mut s.q[..n * q_dim]),
                (&layer.wk, &mut s.k[..n * kv_dim]),
                (&layer.wv, &mut s.v[..n * kv_dim]),
            ],
        );
        for t in 0..n {
            let rope = s.rope_range(l, t);
            let (q, kk, v) = (
                &mut s.q[t * q_dim..(t + 1) * q_dim],
                &mut s.k[t * kv_dim..(t + 1) * kv_dim],
                &mut s.v[t * kv_dim..(t + 1) * kv_dim],
            );
            finish_qkv(c, layer, &s.rope[rope], q, kk, v);

            // KV cache write at this token's position, in the cache's type.
            self.kv.write(l, pos0 + t, kk, v);
        }
        let kv = &self.kv;

        // Causal attention, one query head per task (all tokens of the batch in order, token `t`
        // seeing positions `0..=pos0 + t`); GQA maps `group` query heads to a KV head.
        let group = c.n_heads / c.n_kv_heads;
        let window = c.layer_attention(l).window;
        let q = &s.q;
        let max_context = self.max_context;
        let att = Disjoint::new(&mut s.att);
        let all_scores = Disjoint::new(&mut s.scores);
        cpu::for_each_chunk(c.n_heads, 1, |heads| {
            for h in heads {
                for t in 0..n {
                    let pos = pos0 + t;
                    let o = t * q_dim + h * hd;
                    // SAFETY: each head is handed out once; head `h` alone uses its score row and
                    // its `hd` outputs of every token.
                    let (out, scores) = unsafe {
                        (
                            att.range(o..o + hd),
                            all_scores.range(h * max_context..h * max_context + pos + 1),
                        )
                    };
                    let kv_off = (h / group) * hd;
                    let spans = kv.spans(l, pos + 1);
                    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    cpu::attend_spans(k, &q[o..o + hd], spans, kv_dim, kv_off, first, scores, out);
                }
            }
        });

        let x = k.prepare(&s.att[..n * q_dim], p, &mut s.acts);
        k.matmats(x, n, [(&layer.wo, &mut s.proj[..n * d])]);
        norm_rows(&layer.post_attn_norm, &mut s.proj[..n * d], d, c.rms_eps);
        cpu::add_inplace(&mut s.x[..n * d], &s.proj[..n * d]);
    }

    /// The FFN block for the `n` tokens of a batch.
    fn ffn(&mut self, layer: &LayerWeights, n: usize) {
        let c = &self.model.weights.config;
        let (d, n_ff, p) = (c.d_model, c.n_ff, self.precision);
        let (k, s) = (self.kernels, &mut self.s);
        for (xn, x) in s.xn.chunks_exact_mut(d).zip(s.x.chunks_exact(d)).take(n) {
            cpu::rmsnorm(xn, x, &layer.ffn_norm, c.rms_eps);
        }
        let x = k.prepare(&s.xn[..n * d], p, &mut s.acts);
        // Gate and up rows of the same neurons in one task (for every token of the batch), the
        // activation applied in place.
        let (gate, up) = (Disjoint::new(&mut s.gate), Disjoint::new(&mut s.up));
        let activation = c.activation;
        let chunk = n_ff
            .div_ceil(4 * rayon::current_num_threads())
            .max(cpu::FUSED_ROWS);
        cpu::for_each_chunk(n_ff, chunk, |r| {
            for t in 0..n {
                let o = t * n_ff;
                // SAFETY: each neuron range is handed out once, so these sub-slices of distinct
                // tasks do not overlap.
                let (g, u) = unsafe {
                    (
                        gate.range(o + r.start..o + r.end),
                        up.range(o + r.start..o + r.end),
                    )
                };
                let xt = x.token(t, n);
                k.rows_dot(&layer.ffn.gate, r.start, xt, g);
                k.rows_dot(&layer.ffn.up, r.start, xt, u);
                activation.gate_inplace(g, u);
            }
        });
        match &layer.ffn.down {
            Down::Rows(m) => {
                let x = k.prepare(&s.gate[..n * n_ff], DOWN_PRECISION, &mut s.acts);
                k.matmats(x, n, [(m, &mut s.proj[..n * d])]);
            }
            Down::Neurons(m) => {
                for t in 0..n {
                    let act = &s.gate[t * n_ff..(t + 1) * n_ff];
                    let proj = &mut s.proj[t * d..(t + 1) * d];
                    cpu::down_neurons(k, m, act, &mut s.partials, proj);
                }
            }
        }
        norm_rows(&layer.post_ffn_norm, &mut s.proj[..n * d], d, c.rms_eps);
        cpu::add_inplace(&mut s.x[..n * d], &s.proj[..n * d]);
    }
}

/// The steps of one token between its Q/K/V projections and attention, shared by every CPU
/// forward pass: the biases (Qwen2), the per-head RMSNorm of Q and K (Qwen3, Gemma 3), and RoPE
/// with the layer's `(sin, cos)` table.
pub(crate) fn finish_qkv(
    c: &ModelConfig,
    layer: &LayerWeights,
    rope: &[(f32, f32)],
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
) {
    for (buf, bias) in [
        (&mut *q, &layer.bq),
        (&mut *k, &layer.bk),
        (&mut *v, &layer.bv),
    ] {
        if let Some(b) = bias {
            cpu::add_inplace(buf, b);
        }
    }
    for (buf, norm) in [(&mut *q, &layer.q_norm), (&mut *k, &layer.k_norm)] {
        norm_rows(norm, buf, c.head_dim, c.rms_eps);
    }
    cpu::rope(q, c.head_dim, rope, c.rope_style);
    cpu::rope(k, c.head_dim, rope, c.rope_style);
}

/// RMSNorm in place of every `width`-value row of `x` with `norm`, when the model has it (the
/// post-norms of Gemma 3 on a sub-block's output, its QK-norm per head); nothing otherwise.
pub(crate) fn norm_rows(norm: &Option<Vec<f32>>, x: &mut [f32], width: usize, eps: f32) {
    if let Some(w) = norm {
        for row in x.chunks_exact_mut(width) {
            cpu::rmsnorm_inplace(row, w, eps);
        }
    }
}

/// Errors if `tokens` is empty, holds an id outside the vocabulary or is longer than the `room`
/// left in a context: what every forward pass checks before any work.
pub fn check_tokens(c: &ModelConfig, room: usize, tokens: &[u32]) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::InvalidArgument {
            arg: "tokens",
            reason: "is empty".into(),
        });
    }
    if tokens.len() > room {
        return Err(Error::InvalidArgument {
            arg: "prompt",
            reason: format!("the context is full ({room} tokens free)"),
        });
    }
    if let Some(&token) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::InvalidArgument {
            arg: "token",
            reason: format!("id {token} is outside the vocabulary ({})", c.vocab_size),
        });
    }
    Ok(())
}
