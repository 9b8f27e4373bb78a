//! A session's scratch buffers: sized once at open for [`MAX_BATCH`] tokens, never reallocated,
//! and able to say what they hold.

use std::mem::size_of;

use super::MAX_BATCH;
use crate::backend::cpu::QuantizedActs;
use crate::model::ModelConfig;

/// Per-session scratch: the batch workspace and the conversation's own attention scores and
/// logits (apart, so that a pass of several sessions can run in one session's workspace and
/// write every session's own buffers).
#[derive(Debug)]
pub(super) struct Scratch {
    pub work: Work,
    pub scores: Vec<f32>, // (n_heads, max_context) attention weights
    pub logits: Vec<f32>, // (vocab) of the last token of a batch
}

/// The workspace of a forward pass, sized once for [`MAX_BATCH`] tokens. Per-token buffers are
/// token-major: token `t` of a batch owns `[t * len..(t + 1) * len]`.
#[derive(Debug)]
pub(super) struct Work {
    pub x: Vec<f32>,               // (MAX_BATCH, d_model) residual stream
    pub xn: Vec<f32>,              // (MAX_BATCH, d_model) normalised input of a sub-block
    pub q: Vec<f32>,               // (MAX_BATCH, q_dim)
    pub k: Vec<f32>,               // (MAX_BATCH, kv_dim)
    pub v: Vec<f32>,               // (MAX_BATCH, kv_dim)
    pub att: Vec<f32>,             // (MAX_BATCH, q_dim) attention output, all heads
    pub proj: Vec<f32>, // (MAX_BATCH, d_model) output of a projection before the residual add
    pub gate: Vec<f32>, // (MAX_BATCH, n_ff)
    pub up: Vec<f32>,   // (MAX_BATCH, n_ff)
    pub partials: Vec<f32>, // (n_parts, d_model) per-task sums of neuron-major down columns
    pub acts: QuantizedActs, // (MAX_BATCH, longest input) activations quantised for Fast
    pub rope_freqs: Vec<Vec<f32>>, // (tables, head_dim / 2) RoPE frequencies
    pub rope_of_layer: Vec<usize>, // (n_layers) the table each layer rotates with
    pub rope: Vec<(f32, f32)>, // (tables, MAX_BATCH, head_dim / 2) (sin, cos) per token
}

/// The length of every scratch buffer, in elements: the one place their sizes are decided, so
/// the bytes a session will allocate are known before it is opened.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    d_model: usize,  // x, xn, proj per token
    q_dim: usize,    // q, att per token
    kv_dim: usize,   // k, v per token
    n_ff: usize,     // gate, up per token
    scores: usize,   // n_heads * max_context
    partials: usize, // n_parts * d_model
    vocab: usize,    // logits
    acts: usize,     // longest activation vector of a batch
    half: usize,     // head_dim / 2: a RoPE table, and rope per token of it
    tables: usize,   // distinct RoPE tables (1, or 2 with sliding-window layers)
    n_layers: usize, // rope_of_layer
}

impl Shape {
    /// Scratch for `c` with `max_context` positions and `n_parts` down-projection tasks.
    pub fn new(c: &ModelConfig, max_context: usize, n_parts: usize) -> Shape {
        Shape {
            d_model: c.d_model,
            q_dim: c.q_dim(),
            kv_dim: c.kv_dim(),
            n_ff: c.n_ff,
            scores: c.n_heads * max_context,
            partials: n_parts * c.d_model,
            vocab: c.vocab_size,
            acts: MAX_BATCH * c.d_model.max(c.n_ff).max(c.q_dim()),
            half: c.head_dim / 2,
            tables: c.rope_tables().0.len(),
            n_layers: c.n_layers,
        }
    }

    /// Heap bytes [`Scratch::new`] allocates for this shape.
    pub fn bytes(&self) -> u64 {
        let b = MAX_BATCH;
        let floats = 3 * b * self.d_model
            + 2 * b * self.q_dim
            + 2 * b * self.kv_dim
            + 2 * b * self.n_ff
            + self.scores
            + self.partials
            + self.vocab
            + self.tables * self.half;
        (floats * size_of::<f32>()
            + self.tables * b * self.half * size_of::<(f32, f32)>()
            + self.tables * size_of::<Vec<f32>>()
            + self.n_layers * size_of::<usize>()) as u64
            + QuantizedActs::bytes_for(self.acts)
    }
}

impl Scratch {
    /// Allocates the buffers of `shape`, the shape of `c`, with `c`'s RoPE tables.
    pub fn new(shape: &Shape, c: &ModelConfig) -> Scratch {
        let b = MAX_BATCH;
        let (mut rope_freqs, rope_of_layer) = c.rope_tables();
        rope_freqs.shrink_to_fit(); // what `Shape::bytes` counts: one slot per table

        let work = Work {
            x: vec![0.0; b * shape.d_model],
            xn: vec![0.0; b * shape.d_model],
            q: vec![0.0; b * shape.q_dim],
            k: vec![0.0; b * shape.kv_dim],
            v: vec![0.0; b * shape.kv_dim],
            att: vec![0.0; b * shape.q_dim],
            proj: vec![0.0; b * shape.d_model],
            gate: vec![0.0; b * shape.n_ff],
            up: vec![0.0; b * shape.n_ff],
            partials: vec![0.0; shape.partials],
            acts: QuantizedActs::new(shape.acts),
            rope: vec![(0.0, 1.0); shape.tables * b * shape.half],
            rope_freqs,
            rope_of_layer,
        };
        Scratch {
            work,
            scores: vec![0.0; shape.scores],
            logits: vec![0.0; shape.vocab],
        }
    }

    /// Heap bytes held now, from the buffers' capacities.
    pub fn bytes(&self) -> u64 {
        self.work.bytes()
            + ((self.scores.capacity() + self.logits.capacity()) * size_of::<f32>()) as u64
    }
}

impl Work {
    /// Heap bytes held now, from the buffers' capacities.
    pub fn bytes(&self) -> u64 {
        let floats = [
            &self.x,
            &self.xn,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.proj,
            &self.gate,
            &self.up,
            &self.partials,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>()
            + self.rope_freqs.iter().map(Vec::capacity).sum::<usize>();
        (floats * size_of::<f32>()
            + self.rope.capacity() * size_of::<(f32, f32)>()
            + self.rope_freqs.capacity() * size_of::<Vec<f32>>()
            + self.rope_of_layer.capacity() * size_of::<usize>()) as u64
            + self.acts.bytes()
    }

    /// Where in `rope` the `(sin, cos)` pairs of token `t` of the batch for layer `l` are.
    pub fn rope_range(&self, l: usize, t: usize) -> std::ops::Range<usize> {
        let half = self.rope_freqs[0].len();
        let at = (self.rope_of_layer[l] * MAX_BATCH + t) * half;
        at..at + half
    }

    /// Fills every RoPE table's `(sin, cos)` pairs of token `t` of the batch at position `pos`.
    pub fn set_rope(&mut self, t: usize, pos: usize) {
        let half = self.rope_freqs[0].len();
        for (j, freqs) in self.rope_freqs.iter().enumerate() {
            let at = (j * MAX_BATCH + t) * half;
            for (sc, f) in self.rope[at..at + half].iter_mut().zip(freqs) {
                *sc = (pos as f32 * f).sin_cos();
            }
        }
    }
}
