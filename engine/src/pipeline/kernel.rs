//! The sparse FFN over neuron chunks: each chunk adds its neurons' share of the output, so chunks
//! can be computed in any order, as they arrive.

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
    /// over the compute pool, adding their sum to `out` and writing the activations of their
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

/// Where a stage of chunk computations runs: the CPU compute pool ([`CpuChunks`]) or, with
/// feature `cuda`, the GPU (`backend::cuda::CudaChunks`). The streaming pipeline hands each
/// stage's arrived chunks to one of these.
pub trait ChunkCompute: Send + std::fmt::Debug {
    /// As [`ChunkMath::chunks`]: computes the listed chunks of layer `l` (no chunk twice),
    /// whose stored bytes `bytes_of(c)` gives (a Ready cache slot), adding their sum to `out`
    /// and writing their neurons' activations into `h` (`n_ff` values). Returns the number of
    /// active neurons.
    #[allow(clippy::too_many_arguments)]
    fn compute<'b>(
        &mut self,
        math: &ChunkMath<'_>,
        l: usize,
        chunks: &[usize],
        bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync),
        x: &[f32],
        h: &mut [f32],
        out: &mut [f32],
    ) -> crate::Result<usize>;
}

/// Chunk computations on the CPU compute pool, with one partial sum per task.
#[derive(Debug)]
pub struct CpuChunks {
    partials: Vec<f32>, // (n_parts, d_model)
}

impl CpuChunks {
    /// Scratch for `d_model`-wide outputs, one partial sum per compute thread.
    pub fn new(d_model: usize) -> CpuChunks {
        CpuChunks {
            partials: vec![0.0; rayon::current_num_threads().max(1) * d_model],
        }
    }
}

impl ChunkCompute for CpuChunks {
    fn compute<'b>(
        &mut self,
        math: &ChunkMath<'_>,
        _l: usize,
        chunks: &[usize],
        bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync),
        x: &[f32],
        h: &mut [f32],
        out: &mut [f32],
    ) -> crate::Result<usize> {
        Ok(math.chunks(chunks, bytes_of, x, h, &mut self.partials, out))
    }
}
