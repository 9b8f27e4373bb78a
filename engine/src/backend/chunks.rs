//! The sparse FFN over neuron chunks: each chunk adds its neurons' share of the output, so chunks
//! can be computed as they arrive; the streaming pipeline sums them in fixed blocks ([`Unit`])
//! so that the result does not depend on the order. A stage runs through [`ChunkCompute`], which
//! the CPU ([`CpuChunks`]) and, with feature `cuda`, the GPU (`cuda::CudaChunks`) implement; the
//! pipelines above choose which.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::cpu::{self, Disjoint, Kernels, QuantizedActs};
use crate::model::FfnActivation;
use crate::model::lsm::ChunkLayout;

/// What one layer's chunk computations share.
#[derive(Clone, Copy, Debug)]
pub struct ChunkMath<'a> {
    pub layout: &'a ChunkLayout,
    pub kernels: &'static Kernels,
    pub activation: FfnActivation,
    /// Neurons whose |activation| is below this are treated as inactive (TEAL-style threshold;
    /// 0 keeps every neuron).
    pub threshold: f32,
    /// The input quantised to 8-bit blocks for [`crate::backend::cpu::Precision::Fast`] gate and
    /// up dots; `None` for exact f32 dots. Down columns always take f32 activations.
    pub fast: Option<&'a QuantizedActs>,
}

impl ChunkMath<'_> {
    /// Computes chunk `c` of a layer from its stored bytes: for its `j`-th neuron, the activation
    /// `act(gate·x) * (up·x)` goes to `h[j]` (0 when below the threshold) and its product with the
    /// neuron's down column is added to `acc`. Returns how many neurons were active.
    ///
    /// `x` and `acc` hold `d_model` values; `h` holds one value per neuron of the chunk; `bytes`
    /// is the chunk as stored.
    pub fn chunk(
        &self,
        c: usize,
        bytes: &[u8],
        x: &[f32],
        h: &mut [f32],
        acc: &mut [f32],
    ) -> usize {
        let l = self.layout;
        let k = self.kernels;
        let mut active = 0;
        for (j, h) in h.iter_mut().enumerate().take(l.neurons(c).len()) {
            let bundle = &bytes[j * l.bundle_bytes..(j + 1) * l.bundle_bytes];
            let (gate, up) = (&bundle[..l.up_at], &bundle[l.up_at..l.down_at]);
            let (g, u) = match self.fast {
                Some(q) => (k.dot_q8(l.gate_dtype, gate, q), k.dot_q8(l.up_dtype, up, q)),
                None => (k.dot(l.gate_dtype, gate, x), k.dot(l.up_dtype, up, x)),
            };
            let a = self.activation.apply(g) * u;
            if crate::sparsity::is_active(a, self.threshold) {
                k.axpy(l.down_dtype, &bundle[l.down_at..], a, acc);
                *h = a;
                active += 1;
            } else {
                *h = 0.0;
            }
        }
        active
    }

    /// Computes every chunk in `chunks` (no chunk twice), whose stored bytes `bytes_of(c)` gives,
    /// over the compute team, adding their sum to `out` and writing the activations of their
    /// neurons into the layer's `h` (`n_ff` values). `partials` is scratch of `n_parts * d_model`
    /// values: the listed chunks are split in order into at most `n_parts` groups, one partial
    /// sum each ([`cpu::partial_sums`]). Returns the number of active neurons.
    pub fn chunks<'b>(
        &self,
        chunks: &[usize],
        bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync),
        x: &[f32],
        h: &mut [f32],
        partials: &mut [f32],
        out: &mut [f32],
    ) -> usize {
        let d = self.layout.d_model;
        if chunks.len() <= 2 {
            return chunks
                .iter()
                .map(|&c| self.chunk(c, bytes_of(c), x, &mut h[self.layout.neurons(c)], out))
                .sum();
        }
        let active = AtomicUsize::new(0);
        let hs = Disjoint::new(h);
        let sums = cpu::partial_sums(chunks.len(), d, partials, |i, acc| {
            let c = chunks[i];
            // SAFETY: every chunk appears once in `chunks` (a documented precondition) and chunks
            // own disjoint neuron ranges, so this range of `h` is written by one unit alone.
            let hc = unsafe { hs.range(self.layout.neurons(c)) };
            active.fetch_add(self.chunk(c, bytes_of(c), x, hc, acc), Ordering::Relaxed);
        });
        for part in sums.chunks_exact(d) {
            cpu::add_inplace(out, part);
        }
        active.into_inner()
    }
}

/// The fixed blocks a layer's chunks are summed in by the streaming pipeline (see its `blocks`
/// module): a stage computes at most this many units per row.
pub const BLOCKS: usize = 32;

/// One row's share of a stage: `chunks` of one layer (ascending, all within one block of
/// neurons) computed for the input `x` in list order into `out`, which the caller has zeroed; the
/// neurons' activations go to `h`, which covers the neurons from `h_start` on (the block's).
/// Because a unit's sum starts from zero and runs in a fixed order, its result does not depend on
/// when its chunks arrived or on what else the stage computes.
#[derive(Debug)]
pub struct Unit<'a> {
    /// The layer's math, with this row's quantised input in `fast`.
    pub math: ChunkMath<'a>,
    pub chunks: &'a [usize],
    pub x: &'a [f32],
    pub h: &'a mut [f32],
    pub h_start: usize,
    pub out: &'a mut [f32],
}

impl Unit<'_> {
    /// Computes the unit on the calling thread; returns its active neurons.
    pub fn run<'b>(&mut self, bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync)) -> usize {
        let mut active = 0;
        for &c in self.chunks {
            let r = self.math.layout.neurons(c);
            let h = &mut self.h[r.start - self.h_start..r.end - self.h_start];
            active += self.math.chunk(c, bytes_of(c), self.x, h, self.out);
        }
        active
    }
}

/// Where a stage of chunk computations runs: the CPU compute pool ([`CpuChunks`]) or, with
/// feature `cuda`, the GPU (`backend::cuda::CudaChunks`). The streaming pipeline hands each
/// stage's units to one of these.
pub trait ChunkCompute: Send + std::fmt::Debug {
    /// Computes every unit of a stage of layer `l` (see [`Unit`]), whose chunks' stored bytes
    /// `bytes_of(c)` gives (Ready cache slots). Returns the number of active neurons.
    fn compute<'b>(
        &mut self,
        l: usize,
        units: &mut [Unit<'_>],
        bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync),
    ) -> crate::Result<usize>;
}

/// Chunk computations on the CPU compute team, one unit per chunk of work.
#[derive(Debug, Default)]
pub struct CpuChunks;

impl ChunkCompute for CpuChunks {
    fn compute<'b>(
        &mut self,
        _l: usize,
        units: &mut [Unit<'_>],
        bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync),
    ) -> crate::Result<usize> {
        let active = AtomicUsize::new(0);
        let shared = Disjoint::new(units);
        cpu::for_each_chunk(shared.len(), 1, |r| {
            // SAFETY: `for_each_chunk` hands out each unit once.
            for u in unsafe { shared.range(r) } {
                active.fetch_add(u.run(bytes_of), Ordering::Relaxed);
            }
        });
        Ok(active.into_inner())
    }
}
