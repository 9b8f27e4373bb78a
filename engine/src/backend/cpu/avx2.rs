//! x86_64 kernels for CPUs with AVX2, FMA and F16C (Haswell and later, Zen).
//!
//! Every kernel is a safe `#[target_feature]` function; the table [`KERNELS`] holds plain-fn
//! wrappers around them and is only handed out by [`detect`] after the features were found, which
//! is what makes the wrappers' `unsafe` calls sound. Memory access goes through the small load and
//! store helpers at the top, each of which checks its bounds.
//!
//! Fast-path facts (from llama.cpp's public design, not its code): `_mm256_maddubs_epi16` multiplies
//! unsigned by signed bytes and adds pairs into i16; with |values| ≤ 128 × 127 the pair sums fit
//! without saturation, and `_mm256_madd_epi16` against ones widens them to i32. Signed × signed
//! products use the sign trick `maddubs(|a|, sign(b, a))`.

mod kquant;
mod kquant_rows;
mod math;
mod rows;

use std::arch::x86_64::*;

use super::{Kernels, Q8Block, scalar};
use crate::quant::QK;
use kquant::{
    axpy_q2_k, axpy_q3_k, axpy_q4_k, axpy_q5_k, axpy_q6_k, dot_q2_k, dot_q2_k_tokens, dot_q3_k,
    dot_q3_k_tokens, dot_q4_k, dot_q4_k_tokens, dot_q5_k, dot_q5_k_tokens, dot_q6_k,
    dot_q6_k_tokens, q2_k_q8, q3_k_q8, q4_k_q8, q5_k_q8, q6_k_q8,
};
use kquant_rows::{
    q2_k_q8_x8, q2_k_q8_x8_vnni, q3_k_q8_x8, q3_k_q8_x8_vnni, q4_k_q8_x8, q4_k_q8_x8_vnni,
    q5_k_q8_x8, q5_k_q8_x8_vnni, q6_k_q8_x8, q6_k_q8_x8_vnni,
};
use math::{exp_shifted, gelu_mul, silu_mul};
use rows::{
    dot_q4_1_x8, q4_0_q8_x8, q4_0_q8_x8_vnni, q4_1_q8_x8, q4_1_q8_x8_vnni, q5_0_q8_x8,
    q5_0_q8_x8_vnni, q5_1_q8_x8, q5_1_q8_x8_vnni, q8_0_q8_x8, q8_0_q8_x8_vnni,
};

/// The best table of this module for this CPU: the VNNI one where the CPU has AVX-512 VNNI, VL
/// and BW, else the AVX2 one if it has AVX2, FMA and F16C.
pub(super) fn detect() -> Option<&'static Kernels> {
    supported().pop()
}

/// Every table of this module this CPU supports, best last.
pub(super) fn supported() -> Vec<&'static Kernels> {
    let mut tables = Vec::new();
    if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        tables.push(&KERNELS);
        if is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw")
        {
            tables.push(&VNNI);
        }
    }
    tables
}

static KERNELS: Kernels = AVX2;

/// [`AVX2`] with the eight-row integer kernels on VNNI's one-instruction byte products; only the
/// eight-row integer kernels differ (each gives the same bits as the AVX2 one).
static VNNI: Kernels = Kernels {
    name: "avx2+fma+f16c+avx512vnni+bw",
    dot_q8_x8: [
        None,
        None,
        None,
        Some(vnni_table::q8_0_q8_x8_vnni),
        Some(vnni_table::q4_0_q8_x8_vnni),
        Some(vnni_table::q4_1_q8_x8_vnni),
        Some(vnni_table::q5_0_q8_x8_vnni),
        Some(vnni_table::q5_1_q8_x8_vnni),
        Some(vnni_table::q2_k_q8_x8_vnni),
        Some(vnni_table::q3_k_q8_x8_vnni),
        Some(vnni_table::q4_k_q8_x8_vnni),
        Some(vnni_table::q5_k_q8_x8_vnni),
        Some(vnni_table::q6_k_q8_x8_vnni),
    ],
    dot_q8_tile: super::tile_column([
        vnni_table::q8_0_q8_tile_vnni,
        vnni_table::q4_0_q8_tile_vnni,
        vnni_table::q4_1_q8_tile_vnni,
        vnni_table::q5_0_q8_tile_vnni,
        vnni_table::q5_1_q8_tile_vnni,
    ]),
    ..AVX2
};

const AVX2: Kernels = Kernels {
    name: "avx2+fma+f16c",
    dot: [
        table::dot_f32,
        table::dot_f16,
        table::dot_bf16,
        table::dot_q8_0,
        table::dot_q4_0,
        table::dot_q4_1,
        table::dot_q5_0,
        table::dot_q5_1,
        table::dot_q2_k,
        table::dot_q3_k,
        table::dot_q4_k,
        table::dot_q5_k,
        table::dot_q6_k,
    ],
    dot_q8: [
        None,
        None,
        None,
        Some(table::q8_0_q8),
        Some(table::q4_0_q8),
        Some(table::q4_1_q8),
        Some(table::q5_0_q8),
        Some(table::q5_1_q8),
        Some(table::q2_k_q8),
        Some(table::q3_k_q8),
        Some(table::q4_k_q8),
        Some(table::q5_k_q8),
        Some(table::q6_k_q8),
    ],
    axpy: [
        table::axpy_f32,
        table::axpy_f16,
        table::axpy_bf16,
        table::axpy_q8_0,
        table::axpy_q4_0,
        table::axpy_q4_1,
        table::axpy_q5_0,
        table::axpy_q5_1,
        table::axpy_q2_k,
        table::axpy_q3_k,
        table::axpy_q4_k,
        table::axpy_q5_k,
        table::axpy_q6_k,
    ],
    dot_q8_x8: [
        None,
        None,
        None,
        Some(table::q8_0_q8_x8),
        Some(table::q4_0_q8_x8),
        Some(table::q4_1_q8_x8),
        Some(table::q5_0_q8_x8),
        Some(table::q5_1_q8_x8),
        Some(table::q2_k_q8_x8),
        Some(table::q3_k_q8_x8),
        Some(table::q4_k_q8_x8),
        Some(table::q5_k_q8_x8),
        Some(table::q6_k_q8_x8),
    ],
    dot_q8_tile: super::tile_column([
        table::q8_0_q8_tile,
        table::q4_0_q8_tile,
        table::q4_1_q8_tile,
        table::q5_0_q8_tile,
        table::q5_1_q8_tile,
    ]),
    dot_x8: [
        None,
        None,
        None,
        None,
        None,
        Some(table::dot_q4_1_x8),
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    ],
    dot_tokens: [
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        Some(table::dot_q2_k_tokens),
        Some(table::dot_q3_k_tokens),
        Some(table::dot_q4_k_tokens),
        Some(table::dot_q5_k_tokens),
        Some(table::dot_q6_k_tokens),
    ],
    quantize: table::quantize,
    math: super::Transcendentals {
        silu_mul: table::silu_mul,
        gelu_mul: table::gelu_mul,
        exp_shifted: table::exp_shifted,
    },
};

/// Two plain-fn wrappers of each eight-row kernel over a [`rows::Source`]: one for eight rows,
/// one for a tile. `$why` says why the CPU has the kernel's features.
macro_rules! sources {
    ($why:literal; $($kernel:ident, $tile:ident;)*) => {$(
        pub(super) fn $kernel(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            // SAFETY: these wrappers are private to this module and only reachable through the
            // table their features were detected for (`$why`).
            unsafe { super::$kernel(super::rows::Source::Rows(rows), acts, out) }
        }

        pub(super) fn $tile(tile: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            // SAFETY: as above.
            unsafe { super::$kernel(super::rows::Source::Tile(tile), acts, out) }
        }
    )*};
}

/// Plain-fn wrappers for the table.
mod table {
    use super::Q8Block;
    use super::rows::Rows8;

    macro_rules! wrap {
        ($(fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?;)*) => {$(
            pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: these wrappers are private to this module and only reachable through
                // `KERNELS`, which `detect` hands out after finding avx2, fma and f16c.
                unsafe { super::$name($($arg),*) }
            }
        )*};
    }

    wrap! {
        fn dot_f32(row: &[u8], x: &[f32]) -> f32;
        fn dot_f16(row: &[u8], x: &[f32]) -> f32;
        fn dot_bf16(row: &[u8], x: &[f32]) -> f32;
        fn dot_q8_0(row: &[u8], x: &[f32]) -> f32;
        fn dot_q4_0(row: &[u8], x: &[f32]) -> f32;
        fn dot_q4_1(row: &[u8], x: &[f32]) -> f32;
        fn dot_q5_0(row: &[u8], x: &[f32]) -> f32;
        fn dot_q5_1(row: &[u8], x: &[f32]) -> f32;
        fn dot_q2_k(row: &[u8], x: &[f32]) -> f32;
        fn dot_q3_k(row: &[u8], x: &[f32]) -> f32;
        fn dot_q4_k(row: &[u8], x: &[f32]) -> f32;
        fn dot_q5_k(row: &[u8], x: &[f32]) -> f32;
        fn dot_q6_k(row: &[u8], x: &[f32]) -> f32;
        fn q8_0_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q4_0_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q4_1_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q5_0_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q5_1_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q2_k_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q3_k_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q4_k_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q5_k_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn q6_k_q8(row: &[u8], acts: &[Q8Block]) -> f32;
        fn axpy_f32(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_f16(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_bf16(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q8_0(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q4_0(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q4_1(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q5_0(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q5_1(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q2_k(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q3_k(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q4_k(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q5_k(row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q6_k(row: &[u8], a: f32, out: &mut [f32]);
        fn q2_k_q8_x8(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q3_k_q8_x8(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q4_k_q8_x8(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q5_k_q8_x8(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q6_k_q8_x8(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn dot_q4_1_x8(rows: Rows8<'_>, xs: &[&[f32]], out: &mut [[f32; 8]]);
        fn dot_q2_k_tokens(row: &[u8], xs: &[&[f32]], out: &mut [f32]);
        fn dot_q3_k_tokens(row: &[u8], xs: &[&[f32]], out: &mut [f32]);
        fn dot_q4_k_tokens(row: &[u8], xs: &[&[f32]], out: &mut [f32]);
        fn dot_q5_k_tokens(row: &[u8], xs: &[&[f32]], out: &mut [f32]);
        fn dot_q6_k_tokens(row: &[u8], xs: &[&[f32]], out: &mut [f32]);
        fn quantize(x: &[f32], out: &mut [Q8Block]);
        fn silu_mul(gate: &mut [f32], up: &[f32]);
        fn gelu_mul(gate: &mut [f32], up: &[f32]);
        fn exp_shifted(x: &mut [f32], shift: f32) -> f32;
    }

    sources! {
        "`KERNELS`, which `detect` hands out after finding avx2, fma and f16c";
        q8_0_q8_x8, q8_0_q8_tile;
        q4_0_q8_x8, q4_0_q8_tile;
        q4_1_q8_x8, q4_1_q8_tile;
        q5_0_q8_x8, q5_0_q8_tile;
        q5_1_q8_x8, q5_1_q8_tile;
    }
}

/// Plain-fn wrappers of the VNNI kernels, for [`VNNI`].
mod vnni_table {
    use super::Q8Block;
    use super::rows::Rows8;

    macro_rules! wrap_vnni {
        ($($name:ident($acts:ident: $ty:ty);)*) => {$(
            pub(super) fn $name(rows: Rows8<'_>, $acts: $ty, out: &mut [[f32; 8]]) {
                // SAFETY: these wrappers are private to this module and only reachable through
                // `VNNI`, which `supported` hands out after finding avx2, fma, f16c, avx512vnni,
                // avx512vl and avx512bw.
                unsafe { super::$name(rows, $acts, out) }
            }
        )*};
    }

    sources! {
        "`VNNI`, which `supported` hands out after finding avx2, fma, f16c, avx512vnni, \
         avx512vl and avx512bw";
        q8_0_q8_x8_vnni, q8_0_q8_tile_vnni;
        q4_0_q8_x8_vnni, q4_0_q8_tile_vnni;
        q4_1_q8_x8_vnni, q4_1_q8_tile_vnni;
        q5_0_q8_x8_vnni, q5_0_q8_tile_vnni;
        q5_1_q8_x8_vnni, q5_1_q8_tile_vnni;
    }

    wrap_vnni! {
        q2_k_q8_x8_vnni(acts: &[&[Q8Block]]);
        q3_k_q8_x8_vnni(acts: &[&[Q8Block]]);
        q4_k_q8_x8_vnni(acts: &[&[Q8Block]]);
        q5_k_q8_x8_vnni(acts: &[&[Q8Block]]);
        q6_k_q8_x8_vnni(acts: &[&[Q8Block]]);
    }
}

// ---- bounds-checked loads and stores -------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ld_ps(x: &[f32], at: usize) -> __m256 {
    assert!(at + 8 <= x.len());
    // SAFETY: x[at..at + 8] is in bounds (checked above); loadu has no alignment requirement.
    unsafe { _mm256_loadu_ps(x.as_ptr().add(at)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn st_ps(out: &mut [f32], at: usize, v: __m256) {
    assert!(at + 8 <= out.len());
    // SAFETY: out[at..at + 8] is in bounds (checked above) and exclusively borrowed.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at), v) }
}

/// 16 bytes at `b[at..]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ld_16(b: &[u8], at: usize) -> __m128i {
    assert!(at + 16 <= b.len());
    // SAFETY: b[at..at + 16] is in bounds (checked above); loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) }
}

/// 8 bytes at `b[at..]` in the low half.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ld_8(b: &[u8], at: usize) -> __m128i {
    assert!(at + 8 <= b.len());
    // SAFETY: b[at..at + 8] is in bounds (checked above); loadl reads exactly 8 unaligned bytes.
    unsafe { _mm_loadl_epi64(b.as_ptr().add(at).cast()) }
}

/// 32 bytes at `b[at..]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ld_32(b: &[u8], at: usize) -> __m256i {
    assert!(at + 32 <= b.len());
    // SAFETY: b[at..at + 32] is in bounds (checked above); loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().add(at).cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ld_q(q: &[i8; QK]) -> __m256i {
    // SAFETY: q is exactly 32 bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn st_q(q: &mut [i8; QK], v: __m256i) {
    // SAFETY: q is exactly 32 bytes, exclusively borrowed; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), v) }
}

// ---- small helpers ---------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

/// The 32 nibbles of a Q4 block (`16` bytes at `b[at..]`) as bytes 0..=15: element `j` in byte
/// `j` (low nibbles first, then high nibbles).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibbles(b: &[u8], at: usize) -> __m256i {
    let raw = ld_16(b, at);
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
    _mm256_set_m128i(hi, lo)
}

/// Byte `j` of the result is 0xff where bit `j` of `bits` is set, else 0: the byte shuffle gives
/// byte `j` a copy of byte `j / 8` of `bits`, and the compare tests its bit `j % 8`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn bits_to_bytes(bits: u32) -> __m256i {
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask)
}

/// The 32 five-bit quants (0..=31) of a Q5 block whose `qh` is at `b[at..at + 4]`, nibbles after.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q5_bytes(b: &[u8], at: usize) -> __m256i {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let high = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    _mm256_or_si256(nibbles(b, at + 4), high)
}

/// Eight i8 values (low half of `v`) as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn i8x8_ps(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

// ---- exact dot products ----------------------------------------------------------------------

/// `Σ w·x` for float rows, 16 values per step in two accumulators; `w(bytes, at)` loads 8 values
/// from a 16-value chunk.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_float<const CB: usize>(
    row: &[u8],
    x: &[f32],
    w: impl Fn(&[u8; CB], usize) -> __m256,
    tail: impl Fn(&[u8], usize) -> f32,
) -> f32 {
    let (rc, rt) = row.as_chunks::<CB>();
    let (xc, xt) = x.as_chunks::<16>();
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    for (r, xs) in rc.iter().zip(xc) {
        a0 = _mm256_fmadd_ps(w(r, 0), ld_ps(xs, 0), a0);
        a1 = _mm256_fmadd_ps(w(r, 1), ld_ps(xs, 8), a1);
    }
    let mut s = hsum(_mm256_add_ps(a0, a1));
    for (j, xv) in xt.iter().enumerate() {
        s += tail(rt, j) * xv;
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<64>(
        row,
        x,
        |r, h| _mm256_castsi256_ps(ld_32(r, 32 * h)),
        |t, j| f32::from_le_bytes([t[4 * j], t[4 * j + 1], t[4 * j + 2], t[4 * j + 3]]),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<32>(
        row,
        x,
        |r, h| _mm256_cvtph_ps(ld_16(r, 16 * h)),
        |t, j| f16_at(t, 2 * j),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn bf16x8_ps(v: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<32>(
        row,
        x,
        |r, h| bf16x8_ps(ld_16(r, 16 * h)),
        |t, j| f32::from_bits(u32::from(u16::from_le_bytes([t[2 * j], t[2 * j + 1]])) << 16),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, _) = row.as_chunks::<34>();
    let (xs, _) = x.as_chunks::<QK>();
    let mut total = _mm256_setzero_ps();
    for (b, xb) in blocks.iter().zip(xs) {
        let s01 = _mm256_fmadd_ps(
            i8x8_ps(ld_8(b, 2)),
            ld_ps(xb, 0),
            _mm256_mul_ps(i8x8_ps(ld_8(b, 10)), ld_ps(xb, 8)),
        );
        let s23 = _mm256_fmadd_ps(
            i8x8_ps(ld_8(b, 18)),
            ld_ps(xb, 16),
            _mm256_mul_ps(i8x8_ps(ld_8(b, 26)), ld_ps(xb, 24)),
        );
        total = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), _mm256_add_ps(s01, s23), total);
    }
    hsum(total)
}

/// Σq·x of one Q4 block with `q` the 32 values as bytes (see [`nibbles`]), taken as signed.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q_dot_x(q: __m256i, xb: &[f32; QK]) -> __m256 {
    let (s01, s23) = w_dot_x_halves(&widen(q), xb);
    _mm256_add_ps(s01, s23)
}

/// The 32 signed bytes of `q` as f32: elements 0-7, 8-15, 16-23 and 24-31.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn widen(q: __m256i) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(q);
    let hi = _mm256_extracti128_si256::<1>(q);
    [
        i8x8_ps(lo),
        i8x8_ps(_mm_unpackhi_epi64(lo, lo)),
        i8x8_ps(hi),
        i8x8_ps(_mm_unpackhi_epi64(hi, hi)),
    ]
}

/// Partial sums of `w·x` over elements 0..16 and 16..32 of a block (the k-quants scale each
/// half), with `w` from [`widen`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn w_dot_x_halves(w: &[__m256; 4], x: &[f32; QK]) -> (__m256, __m256) {
    let lo = _mm256_fmadd_ps(w[0], ld_ps(x, 0), _mm256_mul_ps(w[1], ld_ps(x, 8)));
    let hi = _mm256_fmadd_ps(w[2], ld_ps(x, 16), _mm256_mul_ps(w[3], ld_ps(x, 24)));
    (lo, hi)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_0(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, _) = row.as_chunks::<18>();
    let (xs, _) = x.as_chunks::<QK>();
    let eight = _mm256_set1_epi8(8);
    let mut total = _mm256_setzero_ps();
    for (b, xb) in blocks.iter().zip(xs) {
        let q = _mm256_sub_epi8(nibbles(b, 2), eight);
        total = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), q_dot_x(q, xb), total);
    }
    hsum(total)
}

/// The 32 values of the Q4_1 block at `b[at..]` as f32, elements 0-7, 8-15, 16-23 and 24-31.
/// The nibbles are widened straight from memory: byte `j` (`j < 16`) of the quants holds element
/// `j` in its low and element `j + 16` in its high nibble, so eight bytes zero-extended to i32
/// give eight elements by a mask and eight more by a shift, with no shuffles.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4_1_ps(b: &[u8], at: usize) -> [__m256; 4] {
    let v0 = _mm256_cvtepu8_epi32(ld_8(b, at + 4));
    let v1 = _mm256_cvtepu8_epi32(ld_8(b, at + 12));
    let mask = _mm256_set1_epi32(0x0f);
    [
        _mm256_cvtepi32_ps(_mm256_and_si256(v0, mask)),
        _mm256_cvtepi32_ps(_mm256_and_si256(v1, mask)),
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v0)),
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v1)),
    ]
}

/// Q4_1: `d·Σq·x + m·Σx` per block.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_1(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, _) = row.as_chunks::<20>();
    let (xs, _) = x.as_chunks::<QK>();
    let mut tq = _mm256_setzero_ps();
    let mut tx = _mm256_setzero_ps();
    for (b, xb) in blocks.iter().zip(xs) {
        let [q0, q1, q2, q3] = q4_1_ps(b, 0);
        let (x0, x1, x2, x3) = (ld_ps(xb, 0), ld_ps(xb, 8), ld_ps(xb, 16), ld_ps(xb, 24));
        let s01 = _mm256_fmadd_ps(q0, x0, _mm256_mul_ps(q1, x1));
        let s23 = _mm256_fmadd_ps(q2, x2, _mm256_mul_ps(q3, x3));
        let sx = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
        tq = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), _mm256_add_ps(s01, s23), tq);
        tx = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 2)), sx, tx);
    }
    hsum(_mm256_add_ps(tq, tx))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_0(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, _) = row.as_chunks::<22>();
    let (xs, _) = x.as_chunks::<QK>();
    let sixteen = _mm256_set1_epi8(16);
    let mut total = _mm256_setzero_ps();
    for (b, xb) in blocks.iter().zip(xs) {
        let q = _mm256_sub_epi8(q5_bytes(b, 2), sixteen);
        total = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), q_dot_x(q, xb), total);
    }
    hsum(total)
}

/// Q5_1: `d·Σq·x + m·Σx` per block.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_1(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, _) = row.as_chunks::<24>();
    let (xs, _) = x.as_chunks::<QK>();
    let mut tq = _mm256_setzero_ps();
    let mut tx = _mm256_setzero_ps();
    for (b, xb) in blocks.iter().zip(xs) {
        let sx = _mm256_add_ps(
            _mm256_add_ps(ld_ps(xb, 0), ld_ps(xb, 8)),
            _mm256_add_ps(ld_ps(xb, 16), ld_ps(xb, 24)),
        );
        tq = _mm256_fmadd_ps(
            _mm256_set1_ps(f16_at(b, 0)),
            q_dot_x(q5_bytes(b, 4), xb),
            tq,
        );
        tx = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 2)), sx, tx);
    }
    hsum(_mm256_add_ps(tq, tx))
}

// ---- fast (8-bit activation) dot products -----------------------------------------------------

/// Eight i32 partial sums of `Σ u·s` for 32 unsigned bytes `u` (≤ 128) and signed bytes `s`, as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_sum_us(u: __m256i, s: __m256i) -> __m256 {
    let p16 = _mm256_maddubs_epi16(u, s);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
}

/// Same for two signed byte vectors (the sign trick).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_sum_ss(a: __m256i, b: __m256i) -> __m256 {
    mul_sum_us(_mm256_abs_epi8(a), _mm256_sign_epi8(b, a))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<34>();
    let mut acc = _mm256_setzero_ps();
    for (b, a) in blocks.iter().zip(acts) {
        let p = mul_sum_ss(ld_32(b, 2), ld_q(&a.q));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * a.d), p, acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<18>();
    let eight = _mm256_set1_epi8(8);
    let mut acc = _mm256_setzero_ps();
    for (b, a) in blocks.iter().zip(acts) {
        let w = _mm256_sub_epi8(nibbles(b, 2), eight);
        let p = mul_sum_ss(w, ld_q(&a.q));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * a.d), p, acc);
    }
    hsum(acc)
}

/// Q4_1 × Q8: `d4·d8·Σ q4·q8 + m4·s8` per block.
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<20>();
    let mut acc = _mm256_setzero_ps();
    let mut ms = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let p = mul_sum_us(nibbles(b, 4), ld_q(&a.q));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * a.d), p, acc);
        ms += f16_at(b, 2) * a.s;
    }
    hsum(acc) + ms
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<22>();
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = _mm256_setzero_ps();
    for (b, a) in blocks.iter().zip(acts) {
        let w = _mm256_sub_epi8(q5_bytes(b, 2), sixteen);
        let p = mul_sum_ss(w, ld_q(&a.q));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * a.d), p, acc);
    }
    hsum(acc)
}

/// Q5_1 × Q8: `d5·d8·Σ q5·q8 + m5·s8` per block.
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_1_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<24>();
    let mut acc = _mm256_setzero_ps();
    let mut ms = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let p = mul_sum_us(q5_bytes(b, 4), ld_q(&a.q));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * a.d), p, acc);
        ms += f16_at(b, 2) * a.s;
    }
    hsum(acc) + ms
}

// ---- axpy --------------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn axpy_float<const CB: usize>(
    row: &[u8],
    a: f32,
    out: &mut [f32],
    w: impl Fn(&[u8; CB]) -> __m256,
    tail: impl Fn(&[u8], usize) -> f32,
) {
    let av = _mm256_set1_ps(a);
    let (rc, rt) = row.as_chunks::<CB>();
    let (oc, ot) = out.as_chunks_mut::<8>();
    for (r, o) in rc.iter().zip(oc) {
        let v = _mm256_fmadd_ps(w(r), av, ld_ps(o, 0));
        st_ps(o, 0, v);
    }
    for (j, o) in ot.iter_mut().enumerate() {
        *o += a * tail(rt, j);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_f32(row: &[u8], a: f32, out: &mut [f32]) {
    axpy_float::<32>(
        row,
        a,
        out,
        |r| _mm256_castsi256_ps(ld_32(r, 0)),
        |t, j| f32::from_le_bytes([t[4 * j], t[4 * j + 1], t[4 * j + 2], t[4 * j + 3]]),
    );
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_f16(row: &[u8], a: f32, out: &mut [f32]) {
    axpy_float::<16>(
        row,
        a,
        out,
        |r| _mm256_cvtph_ps(ld_16(r, 0)),
        |t, j| f16_at(t, 2 * j),
    );
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_bf16(row: &[u8], a: f32, out: &mut [f32]) {
    axpy_float::<16>(
        row,
        a,
        out,
        |r| bf16x8_ps(ld_16(r, 0)),
        |t, j| f32::from_bits(u32::from(u16::from_le_bytes([t[2 * j], t[2 * j + 1]])) << 16),
    );
}

/// `out[0..32] += a · (d·q + m)` for 32 signed byte values `q`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn axpy_block(q: __m256i, d: f32, m: f32, a: f32, out: &mut [f32; QK]) {
    let (dv, mv, av) = (_mm256_set1_ps(d), _mm256_set1_ps(m), _mm256_set1_ps(a));
    let lo = _mm256_castsi256_si128(q);
    let hi = _mm256_extracti128_si256::<1>(q);
    let parts = [
        lo,
        _mm_unpackhi_epi64(lo, lo),
        hi,
        _mm_unpackhi_epi64(hi, hi),
    ];
    for (k, part) in parts.into_iter().enumerate() {
        let w = _mm256_fmadd_ps(i8x8_ps(part), dv, mv);
        let v = _mm256_fmadd_ps(w, av, ld_ps(out, 8 * k));
        st_ps(out, 8 * k, v);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_q8_0(row: &[u8], a: f32, out: &mut [f32]) {
    let (blocks, _) = row.as_chunks::<34>();
    let (outs, _) = out.as_chunks_mut::<QK>();
    for (b, o) in blocks.iter().zip(outs) {
        axpy_block(ld_32(b, 2), f16_at(b, 0), 0.0, a, o);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_q4_0(row: &[u8], a: f32, out: &mut [f32]) {
    let (blocks, _) = row.as_chunks::<18>();
    let (outs, _) = out.as_chunks_mut::<QK>();
    let eight = _mm256_set1_epi8(8);
    for (b, o) in blocks.iter().zip(outs) {
        let q = _mm256_sub_epi8(nibbles(b, 2), eight);
        axpy_block(q, f16_at(b, 0), 0.0, a, o);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_q4_1(row: &[u8], a: f32, out: &mut [f32]) {
    let (blocks, _) = row.as_chunks::<20>();
    let (outs, _) = out.as_chunks_mut::<QK>();
    for (b, o) in blocks.iter().zip(outs) {
        axpy_block(nibbles(b, 4), f16_at(b, 0), f16_at(b, 2), a, o);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_q5_0(row: &[u8], a: f32, out: &mut [f32]) {
    let (blocks, _) = row.as_chunks::<22>();
    let (outs, _) = out.as_chunks_mut::<QK>();
    let sixteen = _mm256_set1_epi8(16);
    for (b, o) in blocks.iter().zip(outs) {
        let q = _mm256_sub_epi8(q5_bytes(b, 2), sixteen);
        axpy_block(q, f16_at(b, 0), 0.0, a, o);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_q5_1(row: &[u8], a: f32, out: &mut [f32]) {
    let (blocks, _) = row.as_chunks::<24>();
    let (outs, _) = out.as_chunks_mut::<QK>();
    for (b, o) in blocks.iter().zip(outs) {
        axpy_block(q5_bytes(b, 4), f16_at(b, 0), f16_at(b, 2), a, o);
    }
}

// ---- activation quantisation -------------------------------------------------------------------

/// Bit-identical to `scalar::quantize_block` for whole blocks (same `d`, `1/d`, ties-to-even).
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize(x: &[f32], out: &mut [Q8Block]) {
    let (xs, tail) = x.as_chunks::<QK>();
    let sign = _mm256_set1_ps(-0.0);
    for (xb, o) in xs.iter().zip(out.iter_mut()) {
        let v = [ld_ps(xb, 0), ld_ps(xb, 8), ld_ps(xb, 16), ld_ps(xb, 24)];
        let mut abs = v;
        for a in &mut abs {
            *a = _mm256_andnot_ps(sign, *a);
        }
        let amax = hmax(_mm256_max_ps(
            _mm256_max_ps(abs[0], abs[1]),
            _mm256_max_ps(abs[2], abs[3]),
        ));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let mut q = [_mm256_setzero_si256(); 4];
        for (q, v) in q.iter_mut().zip(v) {
            *q = _mm256_cvtps_epi32(_mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(_mm256_mul_ps(v, id)));
        }
        let sum = hsum_i32(_mm256_add_epi32(
            _mm256_add_epi32(q[0], q[1]),
            _mm256_add_epi32(q[2], q[3]),
        ));
        // The packs work within 128-bit lanes: the bytes come out in groups of four values as
        // 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23, 28-31; the permute restores the order.
        let p16a = _mm256_packs_epi32(q[0], q[1]);
        let p16b = _mm256_packs_epi32(q[2], q[3]);
        let p8 = _mm256_packs_epi16(p16a, p16b);
        let ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        st_q(&mut o.q, ordered);
        o.d = d;
        o.s = d * sum as f32;
        o.sum = sum;
    }
    if !tail.is_empty()
        && let Some(o) = out.get_mut(xs.len())
    {
        scalar::quantize_block(tail, o);
    }
}
