//! AVX2 kernels for the k-quant super-blocks.
//!
//! Each type only says how to decode one 32-value span of a super-block into 32 signed bytes (its
//! integer quants, in element order: `span_*`); the scales and mins come from the scalar decoder
//! ([`groups`], sixteen floats per 256 values, cheap next to the products). The three kernels are
//! then shared by every type:
//!
//! - exact dot: the span's bytes widened to f32 once for every token of the call and multiplied
//!   with each token's `x` in two halves (the two 16-value groups), each half scaled by its
//!   group's scale; types with mins dequantise the span once instead (`scale · q - min`).
//! - fast dot: `maddubs`/`madd` over the span against one 32-value activation block gives eight
//!   i32 sums, lanes 0-3 from the first group and 4-7 from the second, so one vector of
//!   `[scale_0 × 4, scale_1 × 4]` scales both groups at once; the mins use the same sums of the
//!   activation bytes against ones.
//! - axpy: `w = scale · q - min` rounded as the scalar dequantiser rounds it, then `out += a · w`.
//!
//! The span decoders rely on one fact: shifting 16-bit lanes right by `n < 8` and masking each
//! byte to its low bits gives every byte's own bits `n..`, because what the shift pulls in from
//! the neighbouring byte lands in the bits the mask clears.

use std::arch::x86_64::*;

use super::{
    Q8Block, hsum, ld_32, ld_ps, ld_q, mul_sum_ss, mul_sum_us, st_ps, w_dot_x_halves, widen,
};
use crate::quant::kquant::QK_K;
use crate::quant::kquant::groups;
use crate::quant::{DType, QK};

/// Bits `n..` of every byte of `v`, masked to `mask`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn bits(v: __m256i, n: usize, mask: i8) -> __m256i {
    let shifted = _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(mask))
}

/// `q2_k`: two bits per value, four values per byte of the 32-byte half `s / 4`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn span_q2_k(b: &[u8], s: usize) -> __m256i {
    bits(ld_32(b, 16 + 32 * (s / 4)), 2 * (s % 4), 3)
}

/// `q3_k`: two low bits as `q2_k` (at 32), minus 4 where bit `s` of `hmask` is clear.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn span_q3_k(b: &[u8], s: usize) -> __m256i {
    _mm256_sub_epi8(span_q3_k_biased(b, s), _mm256_set1_epi8(Q3_K_BIAS as i8))
}

/// What [`span_q3_k_biased`] adds to each quant.
pub(super) const Q3_K_BIAS: i32 = 4;

/// [`span_q3_k`] plus [`Q3_K_BIAS`]: unsigned bytes 0..=7 (the two low bits, bit 2 where bit `s`
/// of `hmask` is set).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn span_q3_k_biased(b: &[u8], s: usize) -> __m256i {
    let low = bits(ld_32(b, 32 + 32 * (s / 4)), 2 * (s % 4), 3);
    let high = bits(ld_32(b, 0), s, 1);
    _mm256_or_si256(low, _mm256_slli_epi16::<2>(high))
}

/// `q4_k`: span `s` is the low (even `s`) or high nibbles of the 32 bytes at `16 + 32 (s / 2)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn span_q4_k(b: &[u8], s: usize) -> __m256i {
    bits(ld_32(b, 16 + 32 * (s / 2)), 4 * (s % 2), 0x0f)
}

/// `q5_k`: nibbles as `q4_k` (at 48), bit 4 from bit `s` of `qh` (at 16).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn span_q5_k(b: &[u8], s: usize) -> __m256i {
    let low = bits(ld_32(b, 48 + 32 * (s / 2)), 4 * (s % 2), 0x0f);
    let high = bits(ld_32(b, 16), s, 1);
    _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
}

/// `q6_k`: in half `h = s / 4`, span `t = s % 4` takes nibble `t / 2` of the 32 `ql` bytes at
/// `64h + 32 (t % 2)` and bits `2t..2t+2` of the 32 `qh` bytes at `128 + 32h`, minus 32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn span_q6_k(b: &[u8], s: usize) -> __m256i {
    _mm256_sub_epi8(span_q6_k_biased(b, s), _mm256_set1_epi8(Q6_K_BIAS as i8))
}

/// What [`span_q6_k_biased`] adds to each quant.
pub(super) const Q6_K_BIAS: i32 = 32;

/// [`span_q6_k`] plus [`Q6_K_BIAS`]: the stored unsigned six-bit values, 0..=63.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn span_q6_k_biased(b: &[u8], s: usize) -> __m256i {
    let (h, t) = (s / 4, s % 4);
    let low = bits(ld_32(b, 64 * h + 32 * (t % 2)), 4 * (t / 2), 0x0f);
    let high = bits(ld_32(b, 128 + 32 * h), 2 * t, 3);
    _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
}

/// Whether `dtype` has sub-block mins (the others skip that half of the work).
pub(super) const fn has_min(dtype: DType) -> bool {
    matches!(dtype, DType::Q2K | DType::Q4K | DType::Q5K)
}

/// A vector of four `lo` then four `hi`: one scale per 16-value group of a span's i32 sums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn pair(lo: f32, hi: f32) -> __m256 {
    _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo))
}

/// Most tokens [`dot_tokens`] takes in one pass over a row: their running sums stay in registers
/// next to the span being decoded.
const TOKENS: usize = 4;

/// The exact dot product of one row with each of `N` (at most [`TOKENS`]) tokens'
/// activations: each super-block's scales are decoded once, and each span is widened once for
/// all of them. For the types with mins the span is also dequantised once (`scale · q - min`
/// per 16-value group), so that per token its two halves' products are added to the token's
/// running vector in one add: taking the mins off per token instead (`min · Σx` per group) made
/// four dependent multiply-adds per span, and one token's sum one long chain of them. The other
/// types scale the halves per token, two multiply-adds (cheaper than dequantising for one
/// token). Each token has its own running vector, summed at the end, so a token's result is
/// the same bits whatever the other tokens are. `N` is a constant and there
/// is one running vector per token so that they all stay in registers (spilled running sums
/// once halved this kernel's speed: their stores could alias, in the low 12 address bits, the
/// activation loads of a projection whose rows are 8 KiB apart).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_tokens<const BB: usize, const N: usize>(
    dtype: DType,
    row: &[u8],
    xs: [&[f32]; N],
    span: impl Fn(&[u8], usize) -> __m256i,
) -> [f32; N] {
    let (blocks, _) = row.as_chunks::<BB>();
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, b) in blocks.iter().enumerate() {
        let g = groups(dtype, b);
        for s in 0..QK_K / QK {
            // Elements 0..16 of the span belong to group 2s, 16..32 to group 2s + 1.
            let (scale_lo, scale_hi) = (g.scale[2 * s], g.scale[2 * s + 1]);
            let mut w = widen(span(b, s));
            if has_min(dtype) {
                // Dequantised once for every token: `scale · q - min`.
                for (k, w) in w.iter_mut().enumerate() {
                    let group = 2 * s + k / 2;
                    let scale = _mm256_set1_ps(g.scale[group]);
                    *w = _mm256_fmsub_ps(scale, *w, _mm256_set1_ps(g.min[group]));
                }
            }
            for t in 0..N {
                let x32: &[f32; QK] = xs[t][QK_K * i + QK * s..][..QK].try_into().expect("a span");
                let (lo, hi) = w_dot_x_halves(&w, x32);
                if has_min(dtype) {
                    acc[t] = _mm256_add_ps(acc[t], _mm256_add_ps(lo, hi));
                } else {
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(scale_lo), lo, acc[t]);
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(scale_hi), hi, acc[t]);
                }
            }
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum(acc[t]);
    }
    out
}

/// [`dot_tokens`] for any number of tokens, [`TOKENS`] at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_all<const BB: usize>(
    dtype: DType,
    row: &[u8],
    xs: &[&[f32]],
    out: &mut [f32],
    span: impl Fn(&[u8], usize) -> __m256i + Copy,
) {
    assert_eq!(xs.len(), out.len(), "one output per token");
    for (xs, out) in xs.chunks(TOKENS).zip(out.chunks_mut(TOKENS)) {
        match *xs {
            [a] => out.copy_from_slice(&dot_tokens::<BB, 1>(dtype, row, [a], span)),
            [a, b] => out.copy_from_slice(&dot_tokens::<BB, 2>(dtype, row, [a, b], span)),
            [a, b, c] => out.copy_from_slice(&dot_tokens::<BB, 3>(dtype, row, [a, b, c], span)),
            [a, b, c, d] => {
                out.copy_from_slice(&dot_tokens::<BB, 4>(dtype, row, [a, b, c, d], span))
            }
            _ => unreachable!("chunks of one to {TOKENS} tokens"),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_q8<const BB: usize>(
    dtype: DType,
    row: &[u8],
    acts: &[Q8Block],
    span: impl Fn(&[u8], usize) -> __m256i,
) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let ones = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    let mut macc = _mm256_setzero_ps();
    for (b, ab) in blocks.iter().zip(acts.chunks_exact(QK_K / QK)) {
        let g = groups(dtype, b);
        for (s, a) in ab.iter().enumerate() {
            let aq = ld_q(&a.q);
            let p = mul_sum_ss(span(b, s), aq);
            let sc = pair(g.scale[2 * s] * a.d, g.scale[2 * s + 1] * a.d);
            acc = _mm256_fmadd_ps(sc, p, acc);
            if has_min(dtype) {
                let qs = mul_sum_us(ones, aq);
                let mn = pair(g.min[2 * s] * a.d, g.min[2 * s + 1] * a.d);
                macc = _mm256_fmadd_ps(mn, qs, macc);
            }
        }
    }
    hsum(acc) - hsum(macc)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn axpy<const BB: usize>(
    dtype: DType,
    row: &[u8],
    a: f32,
    out: &mut [f32],
    span: impl Fn(&[u8], usize) -> __m256i,
) {
    let (blocks, _) = row.as_chunks::<BB>();
    let (outs, _) = out.as_chunks_mut::<QK_K>();
    let av = _mm256_set1_ps(a);
    for (b, ob) in blocks.iter().zip(outs) {
        let g = groups(dtype, b);
        let (spans, _) = ob.as_chunks_mut::<QK>();
        for (s, o) in spans.iter_mut().enumerate() {
            for (k, q) in widen(span(b, s)).into_iter().enumerate() {
                let grp = 2 * s + k / 2;
                // Multiply, then subtract: the same two roundings as the dequantiser.
                let w = _mm256_sub_ps(
                    _mm256_mul_ps(q, _mm256_set1_ps(g.scale[grp])),
                    _mm256_set1_ps(g.min[grp]),
                );
                let v = _mm256_fmadd_ps(w, av, ld_ps(o, 8 * k));
                st_ps(o, 8 * k, v);
            }
        }
    }
}

macro_rules! kernels {
    ($($dtype:ident, $bytes:literal, $span:ident: $dot:ident, $dot8:ident, $q8:ident, $axpy:ident;)*) => {$(
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $dot(row: &[u8], x: &[f32]) -> f32 {
            dot_tokens::<$bytes, 1>(DType::$dtype, row, [x], |b, s| $span(b, s))[0]
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $dot8(row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
            dot_all::<$bytes>(DType::$dtype, row, xs, out, |b, s| $span(b, s))
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $q8(row: &[u8], acts: &[Q8Block]) -> f32 {
            dot_q8::<$bytes>(DType::$dtype, row, acts, |b, s| $span(b, s))
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $axpy(row: &[u8], a: f32, out: &mut [f32]) {
            axpy::<$bytes>(DType::$dtype, row, a, out, |b, s| $span(b, s))
        }
    )*};
}

kernels! {
    Q2K, 84, span_q2_k: dot_q2_k, dot_q2_k_tokens, q2_k_q8, axpy_q2_k;
    Q3K, 110, span_q3_k: dot_q3_k, dot_q3_k_tokens, q3_k_q8, axpy_q3_k;
    Q4K, 144, span_q4_k: dot_q4_k, dot_q4_k_tokens, q4_k_q8, axpy_q4_k;
    Q5K, 176, span_q5_k: dot_q5_k, dot_q5_k_tokens, q5_k_q8, axpy_q5_k;
    Q6K, 210, span_q6_k: dot_q6_k, dot_q6_k_tokens, q6_k_q8, axpy_q6_k;
}
