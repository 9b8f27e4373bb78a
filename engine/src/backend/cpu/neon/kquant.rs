//! NEON kernels for the k-quant super-blocks (q2_k, q3_k, q4_k, q5_k, q6_k).
//!
//! As in the AVX2 kernels, each type only says how to decode the 32-value span `s` (0..8) of a
//! super-block into a [`Span`] of signed quants (`span_*`); the scales and mins come from the
//! scalar decoder ([`groups`], sixteen floats per 256 values, cheap next to the products). A
//! span's two 16-byte vectors are exactly its two scale groups, so the shared bodies scale each
//! vector's result by one group's factor:
//!
//! - exact dot: `Σ_g scale_g · Σ q·x - min_g · Σ x`, in f32 lanes.
//! - fast dot: per group `scale_g · d8 · Σ q·q8` with the byte products summed in integers by
//!   [`dot16`] or [`sdot16`] (`*_sdot`), minus `min_g · d8 · Σ q8`.
//! - axpy: `w = scale · q - min` rounded as the scalar dequantiser rounds it, `out += a · w`.
//!
//! The span decoders read 32 bytes at the span's offset and take bits `n..` of each byte
//! ([`bits`]); the layouts are in [`crate::quant::kquant`].

use std::arch::aarch64::*;

use super::simd::{Span, axpy16, bits, dot16, hsum, ld_32, ld_q, q16_dot_x, sdot16, signed, sum16};
use crate::backend::cpu::Q8Block;
use crate::quant::kquant::{QK_K, groups};
use crate::quant::{DType, QK};

/// `a | b << n` on both vectors.
#[target_feature(enable = "neon")]
#[inline]
fn or_shifted<const N: i32>(a: [uint8x16_t; 2], b: [uint8x16_t; 2]) -> [uint8x16_t; 2] {
    [
        vorrq_u8(a[0], vshlq_n_u8::<N>(b[0])),
        vorrq_u8(a[1], vshlq_n_u8::<N>(b[1])),
    ]
}

/// `q2_k`: two bits per value, four values per byte of the 32-byte half `s / 4`.
#[target_feature(enable = "neon")]
#[inline]
fn span_q2_k(b: &[u8], s: usize) -> Span {
    signed(bits(ld_32(b, 16 + 32 * (s / 4)), 2 * (s % 4), 3), 0)
}

/// `q3_k`: two low bits as `q2_k` (at 32), minus 4 where bit `s` of `hmask` is clear.
#[target_feature(enable = "neon")]
#[inline]
fn span_q3_k(b: &[u8], s: usize) -> Span {
    let low = bits(ld_32(b, 32 + 32 * (s / 4)), 2 * (s % 4), 3);
    let high = bits(ld_32(b, 0), s, 1);
    signed(or_shifted::<2>(low, high), 4)
}

/// `q4_k`: span `s` is the low (even `s`) or high nibbles of the 32 bytes at `16 + 32 (s / 2)`.
#[target_feature(enable = "neon")]
#[inline]
fn span_q4_k(b: &[u8], s: usize) -> Span {
    signed(bits(ld_32(b, 16 + 32 * (s / 2)), 4 * (s % 2), 0x0f), 0)
}

/// `q5_k`: nibbles as `q4_k` (at 48), bit 4 from bit `s` of `qh` (at 16).
#[target_feature(enable = "neon")]
#[inline]
fn span_q5_k(b: &[u8], s: usize) -> Span {
    let low = bits(ld_32(b, 48 + 32 * (s / 2)), 4 * (s % 2), 0x0f);
    let high = bits(ld_32(b, 16), s, 1);
    signed(or_shifted::<4>(low, high), 0)
}

/// `q6_k`: in half `h = s / 4`, span `t = s % 4` takes nibble `t / 2` of the 32 `ql` bytes at
/// `64h + 32 (t % 2)` and bits `2t..2t+2` of the 32 `qh` bytes at `128 + 32h`, minus 32.
#[target_feature(enable = "neon")]
#[inline]
fn span_q6_k(b: &[u8], s: usize) -> Span {
    let (h, t) = (s / 4, s % 4);
    let low = bits(ld_32(b, 64 * h + 32 * (t % 2)), 4 * (t / 2), 0x0f);
    let high = bits(ld_32(b, 128 + 32 * h), 2 * t, 3);
    signed(or_shifted::<4>(low, high), 32)
}

/// Whether `dtype` has sub-block mins (the others skip that half of the work).
const fn has_min(dtype: DType) -> bool {
    matches!(dtype, DType::Q2K | DType::Q4K | DType::Q5K)
}

#[target_feature(enable = "neon")]
#[inline]
fn dot<const BB: usize>(
    dtype: DType,
    row: &[u8],
    x: &[f32],
    span: impl Fn(&[u8], usize) -> Span,
) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let (xs, _) = x.as_chunks::<QK_K>();
    let mut acc = vdupq_n_f32(0.0);
    let mut macc = vdupq_n_f32(0.0);
    for (b, xb) in blocks.iter().zip(xs) {
        let g = groups(dtype, b);
        let (spans, _) = xb.as_chunks::<QK>();
        for (s, x32) in spans.iter().enumerate() {
            for (h, q) in span(b, s).into_iter().enumerate() {
                let k = 2 * s + h;
                acc = vfmaq_f32(acc, q16_dot_x(q, x32, 16 * h), vdupq_n_f32(g.scale[k]));
                if has_min(dtype) {
                    macc = vfmaq_f32(macc, sum16(x32, 16 * h), vdupq_n_f32(g.min[k]));
                }
            }
        }
    }
    hsum(acc) - hsum(macc)
}

#[target_feature(enable = "neon")]
#[inline]
fn dot_q8<const BB: usize>(
    dtype: DType,
    row: &[u8],
    acts: &[Q8Block],
    span: impl Fn(&[u8], usize) -> Span,
    idot: impl Fn(int8x16_t, int8x16_t) -> int32x4_t,
) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let mut acc = vdupq_n_f32(0.0);
    let mut ms = 0f32;
    for (b, ab) in blocks.iter().zip(acts.chunks_exact(QK_K / QK)) {
        let g = groups(dtype, b);
        for (s, a) in ab.iter().enumerate() {
            let (w, aq) = (span(b, s), ld_q(&a.q));
            for h in 0..2 {
                let k = 2 * s + h;
                let p = vcvtq_f32_s32(idot(w[h], aq[h]));
                acc = vfmaq_f32(acc, p, vdupq_n_f32(g.scale[k] * a.d));
                if has_min(dtype) {
                    ms += g.min[k] * a.d * f32::from(vaddlvq_s8(aq[h]));
                }
            }
        }
    }
    hsum(acc) - ms
}

#[target_feature(enable = "neon")]
#[inline]
fn axpy<const BB: usize>(
    dtype: DType,
    row: &[u8],
    a: f32,
    out: &mut [f32],
    span: impl Fn(&[u8], usize) -> Span,
) {
    let (blocks, _) = row.as_chunks::<BB>();
    let (outs, _) = out.as_chunks_mut::<QK_K>();
    for (b, ob) in blocks.iter().zip(outs) {
        let g = groups(dtype, b);
        let (spans, _) = ob.as_chunks_mut::<QK>();
        for (s, o) in spans.iter_mut().enumerate() {
            for (h, q) in span(b, s).into_iter().enumerate() {
                let k = 2 * s + h;
                if has_min(dtype) {
                    axpy16::<true>(q, g.scale[k], -g.min[k], a, o, 16 * h);
                } else {
                    axpy16::<false>(q, g.scale[k], 0.0, a, o, 16 * h);
                }
            }
        }
    }
}

macro_rules! kernels {
    ($($dtype:ident, $bytes:literal, $span:ident: $dot:ident, $q8:ident, $sdot:ident, $axpy:ident;)*) => {$(
        #[target_feature(enable = "neon")]
        pub(super) fn $dot(row: &[u8], x: &[f32]) -> f32 {
            dot::<$bytes>(DType::$dtype, row, x, |b, s| $span(b, s))
        }
        #[target_feature(enable = "neon")]
        pub(super) fn $q8(row: &[u8], acts: &[Q8Block]) -> f32 {
            dot_q8::<$bytes>(DType::$dtype, row, acts, |b, s| $span(b, s), |w, a| dot16(w, a))
        }
        #[target_feature(enable = "neon,dotprod")]
        pub(super) fn $sdot(row: &[u8], acts: &[Q8Block]) -> f32 {
            dot_q8::<$bytes>(DType::$dtype, row, acts, |b, s| $span(b, s), |w, a| sdot16(w, a))
        }
        #[target_feature(enable = "neon")]
        pub(super) fn $axpy(row: &[u8], a: f32, out: &mut [f32]) {
            axpy::<$bytes>(DType::$dtype, row, a, out, |b, s| $span(b, s))
        }
    )*};
}

kernels! {
    Q2K, 84, span_q2_k: dot_q2_k, q2_k_q8, q2_k_q8_sdot, axpy_q2_k;
    Q3K, 110, span_q3_k: dot_q3_k, q3_k_q8, q3_k_q8_sdot, axpy_q3_k;
    Q4K, 144, span_q4_k: dot_q4_k, q4_k_q8, q4_k_q8_sdot, axpy_q4_k;
    Q5K, 176, span_q5_k: dot_q5_k, q5_k_q8, q5_k_q8_sdot, axpy_q5_k;
    Q6K, 210, span_q6_k: dot_q6_k, q6_k_q8, q6_k_q8_sdot, axpy_q6_k;
}
