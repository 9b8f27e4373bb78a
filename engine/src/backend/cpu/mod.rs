//! CPU kernels: dot products over quantised rows, mat-vecs split over the compute team (`team`: the
//! persistent threads every parallel region of a forward pass runs on), and the small dense f32
//! helpers of the forward pass.
//!
//! # Dispatch
//! Every quantised kernel exists in a portable scalar version (`scalar`, the fallback on every
//! machine) and in SIMD versions: x86_64 AVX2 (`avx2`, used when the CPU has AVX2, FMA and F16C;
//! `avx2+fma+f16c+avx512vnni+bw` where it also has those) and aarch64 NEON (`neon`: the `neon`
//! table, and `neon+dotprod` where the CPU has the Armv8.2 dot-product instructions, which only
//! changes the integer kernels). The choice is made once,
//! on first use, and cached as a table of function pointers ([`Kernels`]). Nothing is compiled
//! with `target-cpu=native`; the SIMD functions carry `#[target_feature]`.
//!
//! Each table also holds the elementwise kernels that take an exponential per value (the SiLU
//! and GeGLU gates, softmax): the SIMD tables evaluate `e^x` as a polynomial in vector lanes
//! (`expf`, within 2 ulp), the scalar table calls `f32::exp`.
//!
//! Every table covers every [`DType`]. The k-quant super-blocks go through their one decoded
//! form (per 16 values a float scale and min, per value an i8 quant: `scalar_kquant`,
//! `avx2/kquant.rs`, `neon/kquant.rs`). The NEON kernels are tested under QEMU
//! (`scripts/test-aarch64`); their speed on real hardware is not measured yet.
//!
//! # Eight rows at a time
//! In the fast path, the AVX2 tables run every quantised type through eight-row kernels: the
//! 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in `avx2/rows.rs`, the k-quants (Q2_K to
//! Q6_K) in `avx2/kquant_rows.rs`. Eight rows share the activation loads and the per-block
//! bookkeeping (scale conversion, the fold into the running sum) that dominates a one-row kernel,
//! and in a batch each group of rows is decoded once for up to four tokens (a k-quant
//! super-block's scales and mins once for up to sixteen). Each row's result is the scalar
//! kernel's, bit for bit. On CPUs with AVX-512 VNNI, VL and BW a second table does the byte
//! products in one instruction (`vpdpbusd`) and decodes Q5 blocks with byte masks. The rows of the
//! next group are prefetched while a group is computed: eight rows read side by side are eight
//! streams, which the hardware prefetcher follows poorly. The exact path has an eight-row kernel
//! for Q4_1 (f32 sums, the same bits for a row whatever shares its call, but not the one-row
//! kernel's). Its k-quant kernels take one row at a time for up to four tokens (`dot_tokens`):
//! a super-block's scales and a span's widened quants are shared by the tokens, the rows are read
//! one after the other (which the hardware prefetcher follows on its own), and each token's sum
//! is the one-row kernel's, bit for bit. An eight-row exact k-quant kernel was tried: it made
//! prefill ~10 % faster still, but one-token decode ~7 % slower on Gemma 3 (its transposes and
//! register spills cost more than the shared bookkeeping saves for a single token).
//!
//! # Precision
//! [`Precision::Exact`] multiplies f32 activations with dequantised weights (within ~1e-3 of an f32
//! reference over a whole model). [`Precision::Fast`] first quantises the activations to 8-bit
//! blocks ([`QuantizedActs`]) and takes integer dot products, as llama.cpp does; its error is
//! around 1e-2 relative per dot product. Every quantised type has an integer path: a k-quant
//! super-block lines up with eight activation blocks of 32, each product split in two for the
//! 16-value groups (a group's min multiplies the integer sum of its activation bytes). `docs/bench/precision.md` says when each is appropriate.
//!
//! # Allocation
//! No kernel allocates. [`QuantizedActs`] is sized once; the mat-vecs write into caller buffers.

mod attend;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod dense;
mod expf;
mod matvec;
#[cfg(all(target_arch = "aarch64", target_endian = "little"))]
mod neon;
mod partial;
mod scalar;
mod scalar_kquant;
mod team;
#[cfg(test)]
mod tests;

use std::sync::OnceLock;

use crate::model::{FfnActivation, QRows};
use crate::quant::tiles::TILE_ROWS;
use crate::quant::{DType, QK};

pub use attend::{attend, attend_spans};
pub use dense::{add_inplace, rmsnorm, rmsnorm_inplace, rope, silu_mul, softmax_inplace};
pub use matvec::Disjoint;
pub use partial::{down_neurons, partial_sums};
pub use team::{for_each_chunk, set_threads as set_compute_threads, threads as compute_threads};

/// Activation precision of quantised dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// f32 activations × dequantised weights: within ~1e-3 of an f32 reference over a model.
    #[default]
    Exact,
    /// Activations quantised to 8-bit blocks (scale `d`, block sum `s`, as llama.cpp's Q8_1) with
    /// integer dot products. Applies to every quantised type; float rows are always exact.
    Fast,
}

/// One block of 32 activations quantised to i8: value `j` ≈ `d * q[j]`, `sum = Σ q` (exact) and
/// `s = d * sum`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct Q8Block {
    pub d: f32,
    pub s: f32,
    pub sum: i32,
    pub q: [i8; QK],
}

impl Q8Block {
    const ZERO: Q8Block = Q8Block {
        d: 0.0,
        s: 0.0,
        sum: 0,
        q: [0; QK],
    };
}

/// Scratch for [`Precision::Fast`]: the activations quantised once per mat-vec, plus a copy of the
/// f32 activations for float rows. Size it once with the longest activation vector it will see;
/// [`QuantizedActs::quantize`] allocates only if given a longer one.
#[derive(Clone, Debug)]
pub struct QuantizedActs {
    x: Vec<f32>,
    blocks: Vec<Q8Block>,
}

impl QuantizedActs {
    /// Scratch for activation vectors of up to `max_len` values.
    pub fn new(max_len: usize) -> Self {
        QuantizedActs {
            x: Vec::with_capacity(max_len),
            blocks: Vec::with_capacity(max_len.div_ceil(QK)),
        }
    }

    /// Quantises `x` into 32-value blocks (a partial last block is padded with zeros), with the
    /// best kernel of this machine. Replaces the previous contents.
    pub fn quantize(&mut self, x: &[f32]) {
        self.quantize_with(Kernels::best(), x);
    }

    /// [`QuantizedActs::quantize`] with an explicit kernel table.
    pub fn quantize_with(&mut self, k: &Kernels, x: &[f32]) {
        self.x.clear();
        self.x.extend_from_slice(x);
        self.blocks.clear();
        self.blocks.resize(x.len().div_ceil(QK), Q8Block::ZERO);
        (k.quantize)(x, &mut self.blocks);
    }

    /// Heap bytes [`QuantizedActs::new`]`(max_len)` allocates.
    pub fn bytes_for(max_len: usize) -> u64 {
        (max_len * std::mem::size_of::<f32>()
            + max_len.div_ceil(QK) * std::mem::size_of::<Q8Block>()) as u64
    }

    /// Heap bytes held now (the capacities of both buffers).
    pub fn bytes(&self) -> u64 {
        (self.x.capacity() * std::mem::size_of::<f32>()
            + self.blocks.capacity() * std::mem::size_of::<Q8Block>()) as u64
    }

    /// Number of activations held.
    pub fn len(&self) -> usize {
        self.x.len()
    }

    /// True when nothing has been quantised yet (or an empty vector was).
    pub fn is_empty(&self) -> bool {
        self.x.is_empty()
    }

    /// The original f32 activations.
    pub fn values(&self) -> &[f32] {
        &self.x
    }

    /// The quantised blocks.
    pub fn blocks(&self) -> &[Q8Block] {
        &self.blocks
    }
}

/// Activations made ready for dot products in one precision by [`Kernels::prepare`]: the f32
/// values, plus their 8-bit blocks for [`Precision::Fast`].
#[derive(Clone, Copy, Debug)]
pub struct Prepared<'a> {
    x: &'a [f32],
    blocks: Option<&'a [Q8Block]>,
}

impl<'a> Prepared<'a> {
    /// Tokens `range` of a batch prepared as one token-major vector of `n_tokens` tokens.
    ///
    /// Panics unless `range` lies in `0..n_tokens` and the length is `n_tokens` whole blocks.
    pub fn tokens(self, range: std::ops::Range<usize>, n_tokens: usize) -> Prepared<'a> {
        assert!(
            range.start <= range.end && range.end <= n_tokens,
            "tokens {range:?} of {n_tokens}"
        );
        let cols = self.x.len() / n_tokens;
        assert_eq!(cols * n_tokens, self.x.len(), "batch of {n_tokens} tokens");
        Prepared {
            x: &self.x[range.start * cols..range.end * cols],
            blocks: self.blocks.map(|b| {
                assert!(cols.is_multiple_of(QK), "{cols} values per token");
                &b[range.start * cols / QK..range.end * cols / QK]
            }),
        }
    }

    /// Token `t` of a batch prepared as one token-major vector of `n_tokens` tokens.
    ///
    /// Panics if `t` is not below `n_tokens` or the length is not `n_tokens` whole blocks.
    pub fn token(self, t: usize, n_tokens: usize) -> Prepared<'a> {
        assert!(t < n_tokens, "token {t} of {n_tokens}");
        let cols = self.x.len() / n_tokens;
        assert_eq!(cols * n_tokens, self.x.len(), "batch of {n_tokens} tokens");
        Prepared {
            x: &self.x[t * cols..(t + 1) * cols],
            blocks: self.blocks.map(|b| {
                assert!(cols.is_multiple_of(QK), "{cols} values per token");
                &b[t * cols / QK..(t + 1) * cols / QK]
            }),
        }
    }

    /// Number of activations.
    pub fn len(&self) -> usize {
        self.x.len()
    }

    /// True for an empty activation vector.
    pub fn is_empty(&self) -> bool {
        self.x.is_empty()
    }
}

/// `Σ w·x` over one row of `x.len()` values; the row slice has exactly the row's bytes.
pub(crate) type DotFn = fn(&[u8], &[f32]) -> f32;
/// `Σ w·x` over one quantised row against quantised activations (one block per row block).
pub(crate) type DotQ8Fn = fn(&[u8], &[Q8Block]) -> f32;
/// [`DotQ8Fn`] of eight rows of one type and length at once, for several tokens: `out[t][r]` is
/// row `r` against `acts[t]`, bit for bit what the scalar integer kernel gives for that pair,
/// whatever the other rows and tokens are.
pub(crate) type DotQ8x8Fn = fn([&[u8]; 8], &[&[Q8Block]], &mut [[f32; 8]]);
/// [`DotQ8x8Fn`] of the eight rows of one tile ([`crate::quant::tiles`]): the same bits as the
/// eight-row kernel on the rows the tile was made from.
pub(crate) type DotQ8TileFn = fn(&[u8], &[&[Q8Block]], &mut [[f32; 8]]);
/// [`DotFn`] of eight rows of one type and length at once, for several tokens: `out[t][r]` is row
/// `r` against `xs[t]`, the same bits whatever the other rows and tokens are (not the one-row
/// kernel's: the sums are grouped per block, then across blocks).
pub(crate) type DotX8Fn = fn([&[u8]; 8], &[&[f32]], &mut [[f32; 8]]);
/// [`DotFn`] of one row for several tokens (at most [`TOKEN_GROUP`]): `out[t]` is the row against
/// `xs[t]`, the bits of the table's `dot` for that pair. For kernels whose per-row work is worth
/// sharing between tokens (a k-quant super-block's scales, a span's widened quants) but whose
/// rows are best read one after the other.
pub(crate) type DotTokensFn = fn(&[u8], &[&[f32]], &mut [f32]);
/// An eight-row kernel against activations of type `A`, one per token.
type RowGroupFn<A> = fn([&[u8]; 8], &[A], &mut [[f32; 8]]);
/// `out += a * w` over one row of `out.len()` values.
pub(crate) type AxpyFn = fn(&[u8], f32, &mut [f32]);
/// Quantises `x` into `out` (`out.len() == x.len().div_ceil(32)`).
pub(crate) type QuantizeFn = fn(&[f32], &mut [Q8Block]);

/// The elementwise kernels that take an exponential per value: the gated FFN's activation step
/// and softmax's exponentials (see `expf` for the vector `e^x` the SIMD tables use).
#[derive(Debug)]
pub(crate) struct Transcendentals {
    /// `gate[i] = silu(gate[i]) * up[i]`; the slices have one length.
    pub silu_mul: fn(&mut [f32], &[f32]),
    /// `gate[i] = gelu_tanh(gate[i]) * up[i]`; the slices have one length.
    pub gelu_mul: fn(&mut [f32], &[f32]),
    /// `x[i] = e^(x[i] - shift)`, returning the sum of the results.
    pub exp_shifted: fn(&mut [f32], f32) -> f32,
}

/// A table of kernels for one instruction set. Obtain one with [`Kernels::best`] (what the free
/// functions of this module use) or [`Kernels::scalar`] (to compare or benchmark).
///
/// Invariant: a table is only ever handed out on a CPU that supports its instruction set.
#[derive(Debug)]
pub struct Kernels {
    name: &'static str,
    /// Indexed by [`dtype_index`].
    dot: [DotFn; DType::ALL.len()],
    /// Indexed by [`dtype_index`]: the integer dot product against 8-bit activation blocks;
    /// `None` for the float types, which take the exact `dot` in either precision.
    dot_q8: [Option<DotQ8Fn>; DType::ALL.len()],
    /// Indexed by [`dtype_index`]: the integer kernel over eight rows at once, where the table
    /// has one (used in place of `dot_q8` for every group of rows; see [`Kernels::dot_rows_q8_each`]).
    dot_q8_x8: [Option<DotQ8x8Fn>; DType::ALL.len()],
    /// Indexed by [`dtype_index`]: the integer kernel over one tile, where the table has one. A
    /// model is loaded with its matrices as tiles only for types whose kernel is here
    /// ([`Kernels::reads_tiles`]); any table computes a tiled matrix, the others by untiling.
    dot_q8_tile: [Option<DotQ8TileFn>; DType::ALL.len()],
    /// Indexed by [`dtype_index`]: the exact kernel over eight rows at once, where the table has
    /// one (used in place of `dot` for every group of rows, alone or in a batch).
    dot_x8: [Option<DotX8Fn>; DType::ALL.len()],
    /// Indexed by [`dtype_index`]: the exact one-row kernel for several tokens, where the table
    /// has one and no `dot_x8` (used in place of `dot` for every row, alone or in a batch).
    dot_tokens: [Option<DotTokensFn>; DType::ALL.len()],
    /// Indexed by [`dtype_index`].
    axpy: [AxpyFn; DType::ALL.len()],
    quantize: QuantizeFn,
    math: Transcendentals,
}

/// Asks the CPU to start loading `bytes` into its caches (a hint: nothing is read, nothing can
/// fault). A no-op where no portable prefetch instruction is available.
#[inline]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch reads nothing and cannot fault; SSE is part of x86_64.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// `outs[t][k]` = the `k`-th of `rows` against `acts[t]`: eight rows per `dot8` call where there
/// is one (the last group padded with copies of its last row; each group of rows read once for
/// all tokens), else `dot` per row and token. Both give the same bits for a pair.
fn by_rows<'r, A: Copy>(
    rows: impl Iterator<Item = &'r [u8]>,
    acts: &[A],
    outs: &mut [&mut [f32]],
    dot8: Option<RowGroupFn<A>>,
    dot: fn(&[u8], A) -> f32,
) {
    assert_eq!(acts.len(), outs.len(), "one output per token");
    let n = outs.first().map_or(0, |o| o.len());
    assert!(outs.iter().all(|o| o.len() == n), "outputs of one length");
    let Some(dot8) = dot8 else {
        for (k, row) in rows.take(n).enumerate() {
            for (out, &a) in outs.iter_mut().zip(acts) {
                out[k] = dot(row, a);
            }
        }
        return;
    };
    // Each group's rows are gathered (and their bytes prefetched) one group ahead: eight rows
    // read side by side are eight streams, which the hardware prefetcher follows far worse than
    // one row read from start to end (SmolLM2 decodes at about half speed without).
    let mut rows = rows.peekable();
    let mut take = |len: usize| -> [&[u8]; 8] {
        let mut group: [&[u8]; 8] = [&[]; 8];
        for g in 0..8 {
            group[g] = match rows.next_if(|_| g < len) {
                Some(row) => {
                    prefetch(row);
                    row
                }
                None => group[g - 1],
            };
        }
        group
    };
    let mut results = [[0f32; 8]; TOKEN_GROUP];
    let mut next = (n > 0).then(|| take(n.min(8)));
    for start in (0..n).step_by(8) {
        let len = (n - start).min(8);
        let group = next.take().expect("a group per eight outputs");
        if start + 8 < n {
            next = Some(take((n - start - 8).min(8)));
        }
        for (a, o) in acts.chunks(TOKEN_GROUP).zip(outs.chunks_mut(TOKEN_GROUP)) {
            let res = &mut results[..a.len()];
            dot8(group, a, res);
            for (out, r) in o.iter_mut().zip(res.iter()) {
                out[start..start + len].copy_from_slice(&r[..len]);
            }
        }
    }
}

/// A `dot_q8_x8` column for tables without eight-row kernels.
const NO_ROW_GROUPS: [Option<DotQ8x8Fn>; DType::ALL.len()] = [None; DType::ALL.len()];

/// A `dot_q8_tile` column for tables without tile kernels.
const NO_TILES: [Option<DotQ8TileFn>; DType::ALL.len()] = [None; DType::ALL.len()];

/// A `dot_q8_tile` column from the tile kernels of the types that tile, in the order
/// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.
const fn tile_column(
    [q8_0, q4_0, q4_1, q5_0, q5_1]: [DotQ8TileFn; 5],
) -> [Option<DotQ8TileFn>; DType::ALL.len()] {
    let mut column = NO_TILES;
    column[dtype_index(DType::Q8_0)] = Some(q8_0);
    column[dtype_index(DType::Q4_0)] = Some(q4_0);
    column[dtype_index(DType::Q4_1)] = Some(q4_1);
    column[dtype_index(DType::Q5_0)] = Some(q5_0);
    column[dtype_index(DType::Q5_1)] = Some(q5_1);
    column
}

/// A `dot_x8` column for tables without eight-row exact kernels.
const NO_EXACT_ROW_GROUPS: [Option<DotX8Fn>; DType::ALL.len()] = [None; DType::ALL.len()];

/// A `dot_tokens` column for tables without multi-token one-row kernels.
const NO_TOKEN_KERNELS: [Option<DotTokensFn>; DType::ALL.len()] = [None; DType::ALL.len()];

/// One group's activations: quantised blocks (the integer kernels) or f32 vectors, per token.
enum Acts<'a> {
    Fast([&'a [Q8Block]; TOKEN_GROUP]),
    Exact([&'a [f32]; TOKEN_GROUP]),
}

/// Most tokens [`Kernels::rows_dot_each`] takes at once.
pub const TOKEN_GROUP: usize = 16;

/// Where `dtype`'s kernels sit in a table: its position in [`DType::ALL`], which is its
/// declaration order (a test checks the two agree).
#[inline]
const fn dtype_index(dtype: DType) -> usize {
    dtype as usize
}

/// The bytes of a row of `n` values of `dtype`, checked. Panics on a broken caller invariant.
#[inline]
fn row_prefix(dtype: DType, row: &[u8], n: usize) -> &[u8] {
    let need = dtype
        .row_bytes(n)
        .unwrap_or_else(|| panic!("{n} values are not a whole number of {dtype} blocks"));
    assert!(
        row.len() >= need,
        "{dtype} row has {} bytes, {n} values need {need}",
        row.len()
    );
    &row[..need]
}

impl Kernels {
    /// The fastest table this CPU supports, detected once and cached.
    pub fn best() -> &'static Kernels {
        static BEST: OnceLock<&'static Kernels> = OnceLock::new();
        BEST.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if let Some(k) = avx2::detect() {
                return k;
            }
            #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
            if let Some(k) = neon::detect() {
                return k;
            }
            &scalar::KERNELS
        })
    }

    /// Every table this CPU supports, scalar first and [`Kernels::best`] last (what the kernel
    /// tests run).
    #[cfg(test)]
    pub(crate) fn supported() -> Vec<&'static Kernels> {
        let mut tables = vec![Kernels::scalar()];
        #[cfg(target_arch = "x86_64")]
        tables.extend(avx2::supported());
        #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
        tables.extend(neon::supported());
        tables
    }

    /// The portable scalar table (always available).
    pub fn scalar() -> &'static Kernels {
        &scalar::KERNELS
    }

    /// Instruction set name, e.g. `"avx2+fma+f16c"`, `"neon+dotprod"` or `"scalar"`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The gated FFN's elementwise step, `gate[i] = act(gate[i]) * up[i]`: on the SIMD tables
    /// through the vector `e^x` (within 2 ulp of it; see `expf`), on the scalar table
    /// [`FfnActivation::gate_inplace`] itself.
    ///
    /// Panics unless both slices have the same length.
    pub fn gate(&self, activation: FfnActivation, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len(), "gate and up lengths");
        match activation {
            FfnActivation::Silu => (self.math.silu_mul)(gate, up),
            FfnActivation::GeluTanh => (self.math.gelu_mul)(gate, up),
            FfnActivation::Relu => activation.gate_inplace(gate, up),
        }
    }

    /// Softmax in place, shifted by the maximum for stability; an empty slice is left alone. On
    /// the scalar table, [`softmax_inplace`]'s numbers.
    pub fn softmax(&self, x: &mut [f32]) {
        if x.is_empty() {
            return;
        }
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let inv = 1.0 / (self.math.exp_shifted)(x, max);
        x.iter_mut().for_each(|v| *v *= inv);
    }

    /// The integer kernel of `dtype` ([`Precision::Fast`]), or `None` for the float types.
    #[inline]
    fn integer_dot(&self, dtype: DType) -> Option<DotQ8Fn> {
        self.dot_q8[dtype_index(dtype)]
    }

    /// Exact `Σ dequant(row)·x`; `x.len()` is the number of values in the row.
    ///
    /// Panics if `x.len()` is not a whole number of blocks or `row` is too short.
    #[inline]
    pub fn dot(&self, dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        (self.dot[dtype_index(dtype)])(row_prefix(dtype, row, x.len()), x)
    }

    /// Fast `Σ dequant(row)·x` against quantised activations (`x.len()` values). Float rows use
    /// the exact product with the f32 activations kept in `x`.
    ///
    /// Panics if `x.len()` is not a whole number of blocks or `row` is too short.
    #[inline]
    pub fn dot_q8(&self, dtype: DType, row: &[u8], x: &QuantizedActs) -> f32 {
        match self.integer_dot(dtype) {
            Some(dot) => dot(row_prefix(dtype, row, x.len()), &x.blocks),
            None => self.dot(dtype, row, &x.x),
        }
    }

    /// `out += a * dequant(row)`; `out.len()` is the number of values in the row.
    ///
    /// Panics if `out.len()` is not a whole number of blocks or `row` is too short.
    #[inline]
    pub fn axpy(&self, dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
        (self.axpy[dtype_index(dtype)])(row_prefix(dtype, row, out.len()), a, out)
    }

    /// Prepares `x` for dot products in `precision`; for [`Precision::Fast`] it is quantised into
    /// `scratch` (which then has to stay borrowed as long as the result).
    pub fn prepare<'a>(
        &self,
        x: &'a [f32],
        precision: Precision,
        scratch: &'a mut QuantizedActs,
    ) -> Prepared<'a> {
        match precision {
            Precision::Exact => Prepared { x, blocks: None },
            Precision::Fast => {
                scratch.quantize_with(self, x);
                Prepared {
                    x,
                    blocks: Some(scratch.blocks()),
                }
            }
        }
    }

    /// `out[k] = dot(m.row(first + k), x)` in the precision `x` was prepared for (float rows are
    /// always exact).
    ///
    /// Panics unless `x.len() == m.cols` and `first + out.len() <= m.rows`, or if the rows start
    /// inside a tile.
    #[inline]
    pub fn rows_dot(&self, m: &QRows, first: usize, x: Prepared<'_>, out: &mut [f32]) {
        self.rows_dot_each(m, first, x, &mut [out]);
    }

    /// [`Kernels::rows_dot`] for each token of a batch: `outs[t]` gets rows `first..` against
    /// token `t` of `x`, which was prepared for `outs.len()` tokens (at most [`TOKEN_GROUP`]).
    /// In the fast path each group of rows is read once for every token; the results are those
    /// of [`Kernels::rows_dot`] on each token alone, bit for bit.
    ///
    /// Panics unless every output has the same length, `first` plus it is at most `m.rows`,
    /// and `x` holds `outs.len()` vectors of `m.cols` values.
    pub fn rows_dot_each(&self, m: &QRows, first: usize, x: Prepared<'_>, outs: &mut [&mut [f32]]) {
        let n = outs.len();
        assert!(n <= TOKEN_GROUP, "{n} tokens in one group");
        assert_eq!(x.len(), n * m.cols, "activations vs matrix columns");
        let len = outs.first().map_or(0, |o| o.len());
        let acts = match x.blocks {
            Some(_) if self.integer_dot(m.dtype).is_some() => {
                let mut acts: [&[Q8Block]; TOKEN_GROUP] = [&[]; TOKEN_GROUP];
                for (t, a) in acts.iter_mut().enumerate().take(n) {
                    *a = x.token(t, n).blocks.expect("prepared for the fast path");
                }
                Acts::Fast(acts)
            }
            _ => {
                let mut xs: [&[f32]; TOKEN_GROUP] = [&[]; TOKEN_GROUP];
                for (t, xt) in xs.iter_mut().enumerate().take(n) {
                    *xt = x.token(t, n).x;
                }
                Acts::Exact(xs)
            }
        };
        // Tiled rows first, a tile at a time; then the rows stored as rows.
        let tiled_end = m.tiled_rows().clamp(first, first + len);
        let tile_bytes = TILE_ROWS * m.row_bytes();
        for (g, tile) in m
            .tiles(first..tiled_end)
            .chunks_exact(tile_bytes)
            .enumerate()
        {
            let k = g * TILE_ROWS;
            self.tile_dot_each(m, tile, &acts, n, |t, r| {
                outs[t][k..k + TILE_ROWS].copy_from_slice(r)
            });
        }
        let off = tiled_end - first;
        let mut rest: [&mut [f32]; TOKEN_GROUP] = Default::default();
        for (r, o) in rest.iter_mut().zip(outs.iter_mut()) {
            *r = &mut o[off..];
        }
        let rows = m.rows_in(tiled_end..first + len);
        match &acts {
            Acts::Fast(a) => self.dot_rows_q8_each(m.dtype, rows, &a[..n], &mut rest[..n]),
            Acts::Exact(xs) => self.dot_rows_each(m.dtype, rows, &xs[..n], &mut rest[..n]),
        }
    }

    /// Whether this table reads `dtype`'s rows as tiles without untiling them (what a load for
    /// this CPU stores as tiles).
    pub fn reads_tiles(&self, dtype: DType) -> bool {
        self.dot_q8_tile[dtype_index(dtype)].is_some()
    }

    /// The eight rows of `tile` (one of `m`'s) against the first `n` tokens of `acts`:
    /// `put(t, r)` with token `t`'s eight results. Through the tile kernel where the table has one and the
    /// activations are quantised; otherwise the rows are untiled into a per-thread buffer and
    /// computed as rows (the same bits either way: the tile kernel gives the row kernel's).
    fn tile_dot_each(
        &self,
        m: &QRows,
        tile: &[u8],
        acts: &Acts<'_>,
        n: usize,
        mut put: impl FnMut(usize, &[f32]),
    ) {
        let mut res = [[0f32; TILE_ROWS]; TOKEN_GROUP];
        if let (Acts::Fast(a), Some(dot)) = (acts, self.dot_q8_tile[dtype_index(m.dtype)]) {
            dot(tile, &a[..n], &mut res[..n]);
            for (t, r) in res[..n].iter().enumerate() {
                put(t, r);
            }
            return;
        }
        thread_local! {
            static ROWS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        ROWS.with_borrow_mut(|buf| {
            buf.resize(tile.len(), 0);
            crate::quant::tiles::untile(m.dtype, tile, buf);
            let mut outs: [&mut [f32]; TOKEN_GROUP] = Default::default();
            for (o, r) in outs.iter_mut().zip(&mut res) {
                *o = r;
            }
            let rows = buf.chunks_exact(m.row_bytes());
            match acts {
                Acts::Fast(a) => self.dot_rows_q8_each(m.dtype, rows, &a[..n], &mut outs[..n]),
                Acts::Exact(xs) => self.dot_rows_each(m.dtype, rows, &xs[..n], &mut outs[..n]),
            }
            for (t, r) in outs[..n].iter().enumerate() {
                put(t, r);
            }
        });
    }

    /// `outs[t][k]` = the integer dot product of the `k`-th of `rows` (each exactly one row's bytes
    /// of `dtype`, which has an integer kernel) with `acts[t]`.
    pub(crate) fn dot_rows_q8_each<'r>(
        &self,
        dtype: DType,
        rows: impl Iterator<Item = &'r [u8]>,
        acts: &[&[Q8Block]],
        outs: &mut [&mut [f32]],
    ) {
        let i = dtype_index(dtype);
        let dot = self.dot_q8[i].expect("an integer kernel");
        by_rows(rows, acts, outs, self.dot_q8_x8[i], dot);
    }

    /// The exact `outs[t][k] = dot(k-th of rows, xs[t])` for several tokens.
    pub(crate) fn dot_rows_each<'r>(
        &self,
        dtype: DType,
        rows: impl Iterator<Item = &'r [u8]>,
        xs: &[&[f32]],
        outs: &mut [&mut [f32]],
    ) {
        let i = dtype_index(dtype);
        if let Some(dot) = self.dot_tokens[i] {
            assert_eq!(xs.len(), outs.len(), "one output per token");
            assert!(xs.len() <= TOKEN_GROUP, "{} tokens in one call", xs.len());
            let n = outs.first().map_or(0, |o| o.len());
            let mut res = [0f32; TOKEN_GROUP];
            for (k, row) in rows.take(n).enumerate() {
                dot(row, xs, &mut res[..xs.len()]);
                for (out, r) in outs.iter_mut().zip(res) {
                    out[k] = r;
                }
            }
            return;
        }
        let dot8 = self.dot_x8[i].map(|f| f as RowGroupFn<&[f32]>);
        by_rows(rows, xs, outs, dot8, self.dot[i]);
    }

    /// Several mat-vecs over the same prepared input in one parallel region of the compute team:
    /// `out_j = m_j · x` for every job `(m_j, out_j)`. Work is handed out in [`FUSED_ROWS`]-row
    /// ranges. Results are the same as [`Kernels::rows_dot`] over each whole matrix.
    ///
    /// Panics unless every `out_j.len() == m_j.rows` and `x.len() == m_j.cols`.
    pub fn matvecs<const N: usize>(&self, x: Prepared<'_>, jobs: [(&QRows, &mut [f32]); N]) {
        matvec::fused_matvecs(self, x, 1, jobs.map(|(m, out)| (m, vec![out])));
    }

    /// [`Kernels::matvecs`] for a batch: `x` holds `n_tokens` token-major activation vectors
    /// (prepared together; each a whole number of blocks) and every `out_j` `n_tokens`
    /// token-major outputs of `m_j.rows`. Each weight row is read once and dotted with every
    /// token; each result is the same as [`Kernels::matvecs`] on that token alone.
    ///
    /// Panics unless the lengths are `n_tokens` times those of a single mat-vec.
    pub fn matmats<const N: usize>(
        &self,
        x: Prepared<'_>,
        n_tokens: usize,
        jobs: [(&QRows, &mut [f32]); N],
    ) {
        let jobs = jobs.map(|(m, out)| {
            assert_eq!(out.len(), n_tokens * m.rows, "output length vs matrix rows");
            (m, out.chunks_exact_mut(m.rows.max(1)).collect())
        });
        matvec::fused_matvecs(self, x, n_tokens, jobs);
    }

    /// [`Kernels::matmats`] of one matrix whose per-token outputs are separate slices (`outs[t]`
    /// of `m.rows` values gets token `t`'s result): a batch of several conversations writes each
    /// one's logits in place.
    ///
    /// Panics unless there is one output per token, each of `m.rows` values.
    pub fn matmat_each(&self, x: Prepared<'_>, m: &QRows, outs: Vec<&mut [f32]>) {
        let n_tokens = outs.len();
        matvec::fused_matvecs(self, x, n_tokens, [(m, outs)]);
    }

    /// [`Kernels::matmat_each`] of any number of matrices in one parallel pass (`jobs[j].1[t]`
    /// gets token `t`'s result of matrix `jobs[j].0`): the pieces of a layer's matrices that one
    /// unit of the weight stream holds.
    ///
    /// Panics unless every job has one output per token, each of its matrix's rows.
    pub fn matmat_jobs(
        &self,
        x: Prepared<'_>,
        n_tokens: usize,
        jobs: Vec<(&QRows, Vec<&mut [f32]>)>,
    ) {
        if !jobs.is_empty() {
            matvec::fused_matvecs(self, x, n_tokens, jobs);
        }
    }

    /// [`matvec`] with this table.
    pub fn matvec(
        &self,
        m: &QRows,
        x: &[f32],
        out: &mut [f32],
        precision: Precision,
        scratch: &mut QuantizedActs,
    ) {
        matvec::matvec(self, m, x, out, precision, scratch);
    }

    /// [`matvec_rows`] with this table.
    pub fn matvec_rows(
        &self,
        m: &QRows,
        rows: &[u32],
        x: &[f32],
        out: &mut [f32],
        precision: Precision,
        scratch: &mut QuantizedActs,
    ) {
        matvec::matvec_rows(self, m, rows, x, out, precision, scratch);
    }
}

/// Exact dot product of a stored row with f32 activations: `Σ dequant(row)[j] * x[j]`, where
/// `x.len()` is the number of values in the row. Accurate to ~1e-6 relative to `Σ|w·x|`.
///
/// Panics if `x.len()` is not a whole number of `dtype` blocks or `row` holds fewer bytes.
#[inline]
pub fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    Kernels::best().dot(dtype, row, x)
}

/// Fast dot product against activations quantised with [`QuantizedActs::quantize`], for
/// quantised rows (integer products, ~1e-2 relative error); F32/F16/BF16 rows fall back to
/// [`dot`] with the original activations.
///
/// Panics if `x.len()` is not a whole number of `dtype` blocks or `row` holds fewer bytes.
#[inline]
pub fn dot_q8(dtype: DType, row: &[u8], x: &QuantizedActs) -> f32 {
    Kernels::best().dot_q8(dtype, row, x)
}

/// `out += a * dequant(row)`, for down columns stored neuron-major. Every dtype is supported.
///
/// Panics if `out.len()` is not a whole number of `dtype` blocks or `row` holds fewer bytes.
#[inline]
pub fn axpy(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    Kernels::best().axpy(dtype, row, a, out)
}

/// `out[i] = dot(m.row(i), x)` for every row, split over the compute team in contiguous row ranges
/// (at least [`MIN_ROWS_PER_TASK`] rows each, so small matrices stay on the calling thread).
/// With [`Precision::Fast`] and a quantised `m`, `x` is first quantised into `scratch` (which must
/// have room for `x.len()` values to avoid an allocation).
///
/// Panics unless `x.len() == m.cols` and `out.len() == m.rows`.
pub fn matvec(
    m: &QRows,
    x: &[f32],
    out: &mut [f32],
    precision: Precision,
    scratch: &mut QuantizedActs,
) {
    Kernels::best().matvec(m, x, out, precision, scratch);
}

/// Gathered mat-vec over the listed rows: `out[k] = dot(m.row(rows[k]), x)`; otherwise as
/// [`matvec`].
///
/// Panics unless `x.len() == m.cols`, `out.len() == rows.len()` and every row index is `< m.rows`.
pub fn matvec_rows(
    m: &QRows,
    rows: &[u32],
    x: &[f32],
    out: &mut [f32],
    precision: Precision,
    scratch: &mut QuantizedActs,
) {
    Kernels::best().matvec_rows(m, rows, x, out, precision, scratch);
}

pub use matvec::{FUSED_ROWS, MIN_ROWS_PER_TASK};

/// Name of the kernel set in use on this machine, e.g. `"avx2+fma+f16c"` or `"scalar"`.
pub fn kernel_name() -> &'static str {
    Kernels::best().name()
}
