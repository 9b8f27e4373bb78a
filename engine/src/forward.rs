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
//!
//! Sessions of one model whose prompts start with the same tokens can share the KV blocks of
//! that prefix ([`Session::share_prefix`], [`Session::adopt_prefix`]): the blocks are paid once,
//! by the holder of the [`KvPrefix`](crate::kv::KvPrefix), and a session copies a shared block
//! before writing into it (counted by [`Session::kv_growth_bytes`], made by
//! [`Session::grow_kv`]). The accounting rule is stated at the top of `kv/cache.rs`.

mod decode;
mod footprint;
mod gpu;
mod layer;
mod pass;
mod planned;
mod scratch;
mod share;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::cpu::{self, Kernels, Precision};
use crate::backend::select::Backend;
use crate::kv::{KvCache, KvType};
use crate::model::{LayerWeights, ModelConfig, Weights};
use crate::quant::DType;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
pub use decode::Decode;
pub use footprint::{ModelBytes, load_bytes_estimate};
pub use gpu::{GpuModel, GpuSession};
use layer::never;
use pass::{Pass, Row, Seat};
use planned::HeadSpan;
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
    /// The largest piece the forward pass computes a layer in ([`crate::plan::pieces`]);
    /// [`crate::plan::PIECE_BYTES`] unless loaded with another size.
    pub piece_bytes: usize,
}

impl Model {
    /// Loads a GGUF file, a safetensors directory or a `.lsm` file.
    pub fn load(path: &Path) -> Result<Arc<Model>> {
        Model::load_in_pieces(path, crate::plan::PIECE_BYTES)
    }

    /// [`Model::load`] in the layout that is fastest for sessions of `precision` on `backend`:
    /// on the CPU in [`Precision::Fast`], the matrices whose eight-row kernels read tiles
    /// ([`Kernels::reads_tiles`]) stored as tiles ([`crate::quant::tiles`]); otherwise as rows
    /// (the GPU uploads rows). On the CPU either layout computes the same bits in either
    /// precision; an exact session on tiles untiles each group of eight rows as it reads it,
    /// which is slower.
    pub fn load_for(path: &Path, precision: Precision, backend: Backend) -> Result<Arc<Model>> {
        let k = Kernels::best();
        let tiles = DType::ALL.iter().any(|&d| k.reads_tiles(d));
        if backend != Backend::Cpu || precision == Precision::Exact || !tiles {
            return Model::load(path);
        }
        let loaded = crate::model::load_tiled(path, &|d| k.reads_tiles(d))?;
        Ok(Model::whole(path, loaded, crate::plan::PIECE_BYTES))
    }

    /// [`Model::load`], the layers computed in pieces of at most `piece_bytes` (what a planned
    /// model of the same size of piece computes, bit for bit).
    pub fn load_in_pieces(path: &Path, piece_bytes: usize) -> Result<Arc<Model>> {
        Ok(Model::whole(path, crate::model::load(path)?, piece_bytes))
    }

    /// A model read whole (no plan) from `path`: its weights, tokenizer and chat template.
    fn whole(
        path: &Path,
        (weights, tokenizer, chat_template): (Weights, Tokenizer, Option<String>),
        piece_bytes: usize,
    ) -> Arc<Model> {
        Arc::new(Model {
            path: path.to_path_buf(),
            weights,
            tokenizer,
            chat_template,
            planned: None,
            piece_bytes,
        })
    }
}

/// The FFN down projection always runs with f32 activations. Its input (the gated activation) is
/// heavy-tailed, and 8-bit blocks lose too much there: on SmolLM2 and the held-out text, quantising
/// every projection raised perplexity by 0.72 % over the exact path, keeping this one exact by
/// 0.13 %, for ~7 % of the fast path's decode speed.
const DOWN_PRECISION: Precision = Precision::Exact;

/// Most tokens one pass of [`Session::forward_batch`] runs together; longer prompts go in chunks.
/// Each weight row is read once per pass and dotted with every token's activations, so prefill
/// streams the weights once per 64 tokens instead of once per token. 64 makes a 64-token prompt
/// one pass, as llama.cpp's single ubatch runs it (at 32 the weights were read twice). Each
/// session's scratch holds this many rows (`forward::scratch`): 33 KiB a row on SmolLM2-135M,
/// 46 KiB on Gemma-3-270M, 256 KiB on Llama-2-7B shapes, so 64 rows cost 1.0 / 1.4 / 8.0 MiB a
/// session more than 32 did. At most the bits of the streaming pipeline's row set
/// (`pipeline::streaming` asserts it).
pub const MAX_BATCH: usize = 64;

/// Computes the FFN of one layer, in place of the dense FFN (see [`Session::forward_with`] and
/// [`forward_each_with`]): for one token, or for the rows of a batch at once.
pub trait FfnExecutor {
    /// Called before layer `l`'s attention with the residual stream `x` (`d_model` values): the
    /// earliest view of the layer's input, for speculation about this and later layers.
    fn begin_layer(&mut self, _l: usize, _x: &[f32]) {}

    /// Whether this executor computes layer `l`'s FFN; the forward pass computes the others
    /// dense, from the model's own weights (a plan streams only some layers by neuron).
    fn covers(&self, _l: usize) -> bool {
        true
    }

    /// Writes the FFN output of layer `l` for the normalised input `xn` into `out` (both
    /// `d_model` values); the caller adds it to the residual stream.
    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()>;

    /// Writes the FFN outputs of layer `l` for every row of a batch: `xn` and `out` hold one
    /// `d_model`-value row per token, in the same order. Each row's output must be what
    /// [`FfnExecutor::ffn`] would give it; an executor overrides this to share work between the
    /// rows (a streaming pipeline reads a chunk that several rows need once). By default, one row
    /// after the other.
    fn ffn_rows(
        &mut self,
        l: usize,
        layer: &LayerWeights,
        xn: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let d = layer.ffn_norm.len(); // one norm weight per model dimension
        for (xn, out) in xn.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            self.ffn(l, layer, xn, out)?;
        }
        Ok(())
    }
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

/// Groups the neuron-major down projection is split into (one partial sum each): one per compute
/// thread.
fn down_parts() -> usize {
    cpu::compute_threads().max(1)
}

/// Heap bytes [`Session::new`]`(model, max_context, _, kv)` allocates (its scratch and the empty
/// block table of its KV cache; no KV block), so a caller can reserve them first. Equal to that
/// session's [`Session::bytes`].
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

    /// Every heap byte the session pays for now: its scratch and the KV blocks it holds alone
    /// (from the allocations' capacities). The shared model is not counted, nor are KV blocks
    /// shared through a [`KvPrefix`](crate::kv::KvPrefix): its holder pays for them
    /// ([`KvCache::bytes`]).
    pub fn bytes(&self) -> u64 {
        self.s.bytes() + self.kv.bytes()
    }

    /// Bytes that must be allocated so that `tokens` more tokens fit after
    /// [`Session::position`]: whole KV blocks, and a copy of each shared block (see
    /// [`Session::adopt_prefix`]) those tokens would be written into; 0 if they already fit in
    /// blocks the session holds alone. Tokens beyond `max_context` are not counted (the caller
    /// checks the limit).
    pub fn kv_growth_bytes(&self, tokens: usize) -> u64 {
        self.kv.growth_bytes(self.next_writes(tokens))
    }

    /// Allocates what [`Session::kv_growth_bytes`]`(tokens)` counts: the blocks, and the copies
    /// of shared ones, so that running `tokens` more allocates nothing. Errors, allocating
    /// nothing, if `tokens` more do not fit in `max_context`; or if the allocator refuses a block.
    pub fn grow_kv(&mut self, tokens: usize) -> Result<()> {
        self.kv.make_writable(self.next_writes(tokens))
    }

    /// The positions the next `tokens` tokens are written at.
    fn next_writes(&self, tokens: usize) -> std::ops::Range<usize> {
        self.pos..self.pos.saturating_add(tokens)
    }

    /// Forgets the conversation and frees every KV block it holds alone, letting go of shared
    /// ones ([`Session::bytes`] drops back to [`session_open_bytes`]).
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
    /// no allocation, unless a block is still shared: the first write copies it);
    /// [`Session::release_kv`] frees them.
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
        let last = tokens.chunks(MAX_BATCH).count() - 1;
        for (b, batch) in tokens.chunks(MAX_BATCH).enumerate() {
            let mut pass = self.pass(batch.len());
            pass.embed(batch)?;
            pass.layers(None, &never)?;
            if b == last {
                pass.head(&[batch.len() - 1])?;
            }
            drop(pass); // it borrows the session
            self.pos += batch.len();
        }
        Ok(&mut self.s.logits)
    }

    /// Runs one token like [`Session::forward`], with each layer's FFN computed by `exec` instead
    /// of the dense FFN: the sparse and streaming pipelines plug in here. Attention, the KV cache
    /// and the output head are the same as the dense path's.
    pub fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        self.check_tokens(&[token])?;
        self.grow_kv(1)?;
        let mut pass = self.pass(1);
        pass.embed(&[token])?;
        pass.layers(Some(exec), &never)?;
        pass.head(&[0])?;
        drop(pass); // it borrows the session
        self.pos += 1;
        Ok(&mut self.s.logits)
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
            let mut pass = self.pass(batch.len());
            pass.embed(batch)?;
            pass.layers(Some(exec), &never)?;
            for t in 0..batch.len() {
                pass.head(&[t])?;
                logits(b * MAX_BATCH + t, pass.seats[0].logits)?;
            }
            drop(pass); // it borrows the session
            self.pos += batch.len();
        }
        Ok(())
    }

    /// Runs `tokens` (at most [`MAX_BATCH`]) at the next positions in one pass, each layer's FFN
    /// computed by `exec` when given, and writes the logits of every one of them into `out`
    /// (`tokens.len()` rows of [`Session::logits`]' width, in order): a verification pass of
    /// speculative decoding. Each row is the same bits as [`Session::forward_batch`] of the
    /// tokens up to it (or [`Session::forward_with`] through `exec`); every streamed piece is
    /// read once for all of them.
    ///
    /// Errors, before any work, as [`Session::forward_batch`] does, or if `tokens` holds more
    /// than [`MAX_BATCH`].
    pub fn forward_rows(
        &mut self,
        tokens: &[u32],
        exec: Option<&mut dyn FfnExecutor>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.check_tokens(tokens)?;
        if tokens.len() > MAX_BATCH {
            return Err(Error::InvalidArgument {
                arg: "tokens",
                reason: format!("{} tokens in one pass (at most {MAX_BATCH})", tokens.len()),
            });
        }
        self.grow_kv(tokens.len())?;
        let n = tokens.len();
        out.clear();
        out.resize(n * self.s.logits.len(), 0.0);
        let rows: Vec<usize> = (0..n).collect();
        let mut pass = self.pass(n);
        pass.seats[0].logits = out;
        pass.embed(tokens)?;
        pass.layers(exec, &never)?;
        pass.head(&rows)?;
        drop(pass); // it borrows the session
        self.pos += n;
        Ok(())
    }

    /// The size of the shortlist a draft can choose from without reading anything (the
    /// output head's resident leading rows), when this session's model has one: see
    /// [`crate::plan::Plan::shortlist_rows`].
    pub fn shortlist(&self) -> Option<usize> {
        self.model.plan().and_then(|p| p.shortlist_rows())
    }

    /// Runs `token`, then up to `n - 1` more tokens the model drafts itself, one position at a
    /// time: each the argmax of the logits over the [`Session::shortlist`] rows of the
    /// position before (the body and those rows are resident, so drafting reads nothing).
    /// The streamed rest of the head is then read once and applied to all `n` positions:
    /// `out` gets every position's full logits (`n` rows, as [`Session::forward_rows`] gives
    /// them, bit for bit) and `fed` the tokens run (`token` first, then the drafts).
    ///
    /// Errors, before any work, as [`Session::forward_rows`] does for `n` tokens, or if the
    /// model has no shortlist.
    pub fn forward_shortlist(
        &mut self,
        token: u32,
        n: usize,
        fed: &mut Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let kept = self.shortlist().ok_or_else(|| Error::InvalidArgument {
            arg: "shortlist",
            reason: "the model's plan keeps no shortlist of head rows beside a resident body"
                .into(),
        })?;
        let n = n.clamp(1, MAX_BATCH);
        if n > self.max_context - self.pos {
            return Err(Error::InvalidArgument {
                arg: "prompt",
                reason: format!(
                    "the context is full ({} tokens free)",
                    self.max_context - self.pos
                ),
            });
        }
        self.check_tokens(&[token])?;
        self.grow_kv(n)?;
        let (width, d) = (self.s.logits.len(), self.model.weights.config.d_model);
        out.clear();
        out.resize(n * width, 0.0);
        fed.clear();
        fed.push(token);
        let mut hidden = vec![0.0f32; n * d];
        for i in 0..n {
            let mut pass = self.pass(1);
            let row = &mut out[i * width..(i + 1) * width];
            pass.seats[0].logits = row;
            pass.embed(&fed[i..=i])?;
            pass.layers(None, &never)?;
            pass.head_span(&[0], HeadSpan::Resident)?;
            hidden[i * d..(i + 1) * d].copy_from_slice(&pass.work.x[..d]);
            drop(pass); // it borrows the session
            self.pos += 1;
            if i + 1 < n {
                let shortlist = &out[i * width..i * width + kept];
                fed.push(crate::sample::argmax(shortlist));
            }
        }
        let mut pass = self.pass(n);
        pass.work.x[..n * d].copy_from_slice(&hidden);
        pass.seats[0].logits = out;
        let rows: Vec<usize> = (0..n).collect();
        pass.head_span(&rows, HeadSpan::Streamed)
    }

    /// Forgets every token after the first `position` ones (the rejected positions of a
    /// verification pass): the next pass writes over their keys and values. Errors if
    /// `position` is past the tokens held.
    pub fn rewind(&mut self, position: usize) -> Result<()> {
        if position > self.pos {
            return Err(Error::InvalidArgument {
                arg: "position",
                reason: format!("{position} is past the {} tokens held", self.pos),
            });
        }
        self.pos = position;
        Ok(())
    }

    /// The logits of the last token run (what the last forward pass returned); mutable, for a
    /// sampler that masks them in place.
    pub fn logits(&mut self) -> &mut [f32] {
        &mut self.s.logits
    }

    /// The precision of the session's mat-vecs.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// A pass over this session's next `n` positions, in its own workspace.
    fn pass(&mut self, n: usize) -> Pass<'_> {
        let pos = self.pos;
        let Scratch {
            work,
            scores,
            logits,
        } = &mut self.s;
        Pass {
            model: &self.model,
            kernels: self.kernels,
            precision: self.precision,
            work,
            seats: vec![Seat {
                kv: &mut self.kv,
                scores,
                logits,
            }],
            rows: (pos..pos + n).map(|pos| Row { seat: 0, pos }).collect(),
            pieces: None,
        }
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
}

/// Runs `pieces[i]` at the next positions of `sessions[i]`, for every session at once: one pass
/// over the weights for all their tokens (each weight row dotted with every token's
/// activations, the output head included), attention over each session's own KV cache. A piece
/// is one token (a decode step) or a run of prompt tokens; each session's logits
/// ([`Session::logits`]) are then those of its piece's last token, the same bit for bit as
/// [`Session::forward_batch`] of the piece on it alone.
///
/// What a scheduler runs to advance several conversations of one model at once: their decode
/// steps and pieces of their prompts in the same pass. The first session's workspace holds the
/// batch.
///
/// Errors, before any work, unless there is one non-empty piece per session, at most
/// [`MAX_BATCH`] tokens in all, all sessions share one model (the same `Arc`) and precision, and
/// each piece fits in its session's context; a session whose KV cache cannot grow errors with
/// nothing run.
pub fn forward_each(sessions: &mut [&mut Session], pieces: &[&[u32]]) -> Result<()> {
    forward_each_unless(sessions, pieces, None, &never).map(|_| ())
}

/// Runs `pieces[i]` at the next positions of `sessions[i]` like [`forward_each`], with each
/// layer's FFN computed by `exec` for all the pass's rows at once ([`FfnExecutor::ffn_rows`]):
/// what a scheduler runs to advance several conversations of one sparse model together. A
/// streaming pipeline then reads the union of the chunks the rows need once and applies each
/// chunk to every row that needs it. Each row's output is the same bits as
/// [`Session::forward_with`] computes for it (the pipeline sums chunks in a fixed order).
///
/// Errors as [`forward_each`] does; an FFN error (a chunk that could not be read) fails the
/// whole pass, with no session advanced.
pub fn forward_each_with(
    sessions: &mut [&mut Session],
    pieces: &[&[u32]],
    exec: &mut (dyn FfnExecutor + Send),
) -> Result<()> {
    forward_each_unless(sessions, pieces, Some(exec), &never).map(|_| ())
}

/// [`forward_each`], or [`forward_each_with`] when `exec` is given, that asks `stop` before each
/// layer and gives the pass up at the first `true`: what lets a scheduler serve an urgent
/// request within a layer's time instead of a whole pass's. `Ok(true)` when the pass ran;
/// `Ok(false)` when it stopped, with no session advanced: the keys and values it wrote lie at
/// positions the sessions have not reached, and running the same pieces again writes them anew
/// and gives the same bits as an uninterrupted pass. (A sparse pipeline counts the stopped pass
/// as a token in its statistics, and keeps what it read for it in its cache.)
///
/// Errors as [`forward_each`] and [`forward_each_with`] do.
pub fn forward_each_unless(
    sessions: &mut [&mut Session],
    pieces: &[&[u32]],
    exec: Option<&mut (dyn FfnExecutor + Send)>,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<bool> {
    let mut rows: Vec<Option<&mut Vec<f32>>> = sessions.iter().map(|_| None).collect();
    forward_each_rows(sessions, pieces, &mut rows, exec, stop)
}

/// [`forward_each_unless`], where a session with `rows[i]` given gets the logits of every
/// token of its piece there ([`Session::forward_rows`]: a verification pass of speculative
/// decoding) instead of its last token's in [`Session::logits`]. Verification passes of
/// several sessions thus run in one pass over the weights, beside decode steps and prompt
/// pieces.
///
/// Errors as [`forward_each_unless`] does, or unless there is one entry of `rows` per session.
pub fn forward_each_rows(
    sessions: &mut [&mut Session],
    pieces: &[&[u32]],
    rows_out: &mut [Option<&mut Vec<f32>>],
    exec: Option<&mut (dyn FfnExecutor + Send)>,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<bool> {
    let invalid = |reason: String| Error::InvalidArgument {
        arg: "sessions",
        reason,
    };
    let Some(first) = sessions.first() else {
        return Err(invalid("no session to run".into()));
    };
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    if pieces.len() != sessions.len() || rows_out.len() != sessions.len() || total > MAX_BATCH {
        return Err(invalid(format!(
            "{} pieces of {total} tokens for {} sessions (at most {MAX_BATCH} tokens)",
            pieces.len(),
            sessions.len()
        )));
    }
    let (model, precision, kernels) = (Arc::clone(&first.model), first.precision, first.kernels);
    if sessions
        .iter()
        .any(|s| !Arc::ptr_eq(&s.model, &model) || s.precision != precision)
    {
        return Err(invalid(
            "a batch of sessions must share one model and precision".into(),
        ));
    }
    for (s, piece) in sessions.iter().zip(pieces) {
        s.check_tokens(piece)?;
    }
    for (s, piece) in sessions.iter_mut().zip(pieces) {
        s.grow_kv(piece.len())?;
    }
    let mut work = None;
    let mut seats = Vec::with_capacity(sessions.len());
    let mut rows = Vec::with_capacity(total);
    let mut head_rows = Vec::with_capacity(total);
    for (i, ((s, piece), out)) in sessions
        .iter_mut()
        .zip(pieces)
        .zip(rows_out.iter_mut())
        .enumerate()
    {
        let Scratch {
            work: w,
            scores,
            logits,
        } = &mut s.s;
        work.get_or_insert(w);
        let first = rows.len();
        rows.extend((s.pos..s.pos + piece.len()).map(|pos| Row { seat: i, pos }));
        let logits: &mut [f32] = match out {
            Some(out) => {
                let width = logits.len();
                out.clear();
                out.resize(piece.len() * width, 0.0);
                head_rows.extend(first..rows.len());
                out
            }
            None => {
                head_rows.push(rows.len() - 1);
                logits
            }
        };
        seats.push(Seat {
            kv: &mut s.kv,
            scores,
            logits,
        });
    }
    let mut pass = Pass {
        model: &model,
        kernels,
        precision,
        work: work.expect("at least one session"),
        seats,
        rows,
        pieces: None,
    };
    let tokens = pieces.concat();
    pass.embed(&tokens)?;
    let ran = match exec {
        Some(exec) => pass.layers(Some(exec), stop)?,
        None => pass.layers(None, stop)?,
    };
    if ran {
        pass.head(&head_rows)?;
    }
    drop(pass); // it borrows the sessions
    if ran {
        for (s, piece) in sessions.iter_mut().zip(pieces) {
            s.pos += piece.len();
        }
    }
    Ok(ran)
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
