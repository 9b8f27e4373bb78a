//! Sums that do not depend on when chunks arrive. An FFN output is a sum over neurons, and the
//! streaming pipeline computes chunks as their reads complete; float addition is not associative,
//! so summing in arrival order would make the output depend on I/O timing, and through the
//! sparsity threshold (a neuron near it is in or out) that grows to visibly different logits
//! from run to run: 0.4–0.7 on SmolLM2 after a 20-token prompt, measured.
//!
//! Instead a layer's chunks are grouped into [`BLOCKS`] fixed blocks of consecutive chunks:
//! enough for reads to overlap compute, few enough that the partial sums stay small
//! (`rows × BLOCKS × d_model` values). A block is computed once all of its needed chunks are
//! in, each row's share from zero in chunk order into its own partial sum (a [`Unit`]); the
//! layer's output is the partials added in block order. A row's output is then the same bits
//! whatever the timing of the reads and whatever other rows share its pass, while reads still
//! overlap compute block by block.

use std::ops::Range;

use super::Rows;
use crate::Result;
use crate::backend::chunks::{BLOCKS, ChunkCompute, ChunkMath, Unit};
use crate::backend::cpu::{self, QuantizedActs};
use crate::model::lsm::ChunkLayout;

/// The block bookkeeping of one layer of a pass, and its partial sums.
#[derive(Debug)]
pub(super) struct Blocks {
    chunks_per_layer: usize,
    chunks_per_block: usize,
    neurons_per_block: usize,
    n_blocks: usize,
    d: usize,
    n_ff: usize,
    /// Rows in the current pass.
    rows: usize,
    /// (n_blocks) needed chunks of the block not yet Ready and pinned.
    waiting: Vec<u32>,
    /// (n_blocks) the block has needed chunks and is not computed yet.
    pending: Vec<bool>,
    /// (n_blocks) the rows with a needed chunk in the block.
    used: Vec<Rows>,
    /// The blocks the last [`Blocks::compute_complete`] computed.
    computed: Vec<usize>,
    /// (rows, n_blocks, d) each row's partial sum per block.
    partials: Vec<f32>,
    /// (rows, n_ff) each row's neuron activations.
    h: Vec<f32>,
    /// Scratch: the chunk lists of a stage's units, and each unit's (row, block, list range).
    lists: Vec<usize>,
    spans: Vec<(usize, usize, Range<usize>)>,
}

impl Blocks {
    pub fn new(layout: &ChunkLayout) -> Blocks {
        let n_blocks = BLOCKS.min(layout.chunks_per_layer);
        let chunks_per_block = layout.chunks_per_layer.div_ceil(n_blocks);
        Blocks {
            chunks_per_layer: layout.chunks_per_layer,
            chunks_per_block,
            neurons_per_block: chunks_per_block * layout.chunk_neurons,
            n_blocks: layout.chunks_per_layer.div_ceil(chunks_per_block),
            d: layout.d_model,
            n_ff: layout.n_ff,
            rows: 0,
            waiting: Vec::new(),
            pending: Vec::new(),
            used: Vec::new(),
            computed: Vec::new(),
            partials: Vec::new(),
            h: Vec::new(),
            lists: Vec::new(),
            spans: Vec::new(),
        }
    }

    /// The chunks of block `b`.
    pub fn chunks(&self, b: usize) -> Range<usize> {
        block_chunks(self.chunks_per_block, self.chunks_per_layer, b)
    }

    /// Starts a layer of a pass of `rows` rows, where `rows_of[c]` are the rows that need chunk
    /// `c`.
    pub fn begin(&mut self, rows: usize, rows_of: &[Rows]) {
        self.rows = rows;
        self.waiting.clear();
        self.waiting.resize(self.n_blocks, 0);
        self.used.clear();
        self.used.resize(self.n_blocks, 0);
        for (c, &r) in rows_of.iter().enumerate() {
            let b = c / self.chunks_per_block;
            self.waiting[b] += u32::from(r != 0);
            self.used[b] |= r;
        }
        self.pending.clear();
        self.pending.extend(self.waiting.iter().map(|&w| w > 0));
        self.partials.resize(rows * self.n_blocks * self.d, 0.0);
        self.h.resize(rows * self.n_ff, 0.0);
    }

    /// The block chunk `c` is in.
    pub fn block_of(&self, c: usize) -> usize {
        c / self.chunks_per_block
    }

    /// Needed chunk `c` is Ready and pinned.
    pub fn arrived(&mut self, c: usize) {
        self.waiting[c / self.chunks_per_block] -= 1;
    }

    /// Computes every block whose needed chunks are all in and that is not computed yet, for
    /// each row that needs chunks there (as [`Unit`]s: `math` with row `t`'s `acts[t]` when
    /// `fast`, its input `xn[t]`). Returns the active neurons; [`Blocks::computed`] lists the
    /// blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn compute_complete<'b>(
        &mut self,
        l: usize,
        rows_of: &[Rows],
        math: &ChunkMath<'_>,
        acts: Option<&[QuantizedActs]>,
        xn: &[f32],
        compute: &mut dyn ChunkCompute,
        bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync),
    ) -> Result<usize> {
        self.computed.clear();
        for b in 0..self.n_blocks {
            if self.pending[b] && self.waiting[b] == 0 {
                self.pending[b] = false;
                self.computed.push(b);
            }
        }
        if self.computed.is_empty() {
            return Ok(0);
        }
        let (d, nb, rows, per_neurons) = (self.d, self.n_blocks, self.rows, self.neurons_per_block);
        let (per_block, per_layer) = (self.chunks_per_block, self.chunks_per_layer);
        // The units in (row, block) order, the order of their slices in `partials` and `h`.
        self.lists.clear();
        self.spans.clear();
        for t in 0..rows {
            for &b in self
                .computed
                .iter()
                .filter(|&&b| self.used[b] & (1 << t) != 0)
            {
                let start = self.lists.len();
                let mine =
                    block_chunks(per_block, per_layer, b).filter(|&c| rows_of[c] & (1 << t) != 0);
                self.lists.extend(mine);
                self.spans.push((t, b, start..self.lists.len()));
            }
        }
        // Walk every (row, block) slice of the partials and activations once, handing the
        // units theirs.
        let hs = self.h[..rows * self.n_ff]
            .chunks_exact_mut(self.n_ff)
            .flat_map(|row| row.chunks_mut(per_neurons));
        let slots = self.partials[..rows * nb * d].chunks_exact_mut(d).zip(hs);
        let mut spans = self.spans.iter().peekable();
        let mut units = Vec::with_capacity(self.spans.len());
        for (k, (out, h)) in slots.enumerate() {
            let Some((t, b, list)) = spans.next_if(|(t, b, _)| t * nb + b == k) else {
                continue;
            };
            out.fill(0.0);
            units.push(Unit {
                math: ChunkMath {
                    fast: acts.map(|a| &a[*t]),
                    ..*math
                },
                chunks: &self.lists[list.clone()],
                x: &xn[t * d..(t + 1) * d],
                h,
                h_start: b * per_neurons,
                out,
            });
        }
        compute.compute(l, &mut units, bytes_of)
    }

    /// The blocks the last [`Blocks::compute_complete`] computed.
    pub fn computed(&self) -> &[usize] {
        &self.computed
    }

    /// Whether row `t` had an active neuron in chunk `c` (computed for it).
    pub fn any_active(&self, layout: &ChunkLayout, t: usize, c: usize) -> bool {
        let r = layout.neurons(c);
        let row = &self.h[t * self.n_ff..(t + 1) * self.n_ff];
        row[r].iter().any(|&a| a != 0.0)
    }

    /// Writes the layer's output of every row into `out` (`rows × d_model`, zeroed): its partial
    /// sums added in block order.
    pub fn finish(&self, out: &mut [f32]) {
        let (d, nb) = (self.d, self.n_blocks);
        for (t, out) in out.chunks_exact_mut(d).enumerate().take(self.rows) {
            for b in (0..nb).filter(|&b| self.used[b] & (1 << t) != 0) {
                let o = (t * nb + b) * d;
                cpu::add_inplace(out, &self.partials[o..o + d]);
            }
        }
    }
}

/// The chunks of block `b`, for blocks of `per_block` chunks in a layer of `per_layer`.
fn block_chunks(per_block: usize, per_layer: usize, b: usize) -> Range<usize> {
    b * per_block..((b + 1) * per_block).min(per_layer)
}
