//! NEON kernels for the 32-value block types q8_0, q4_0, q4_1, q5_0, q5_1.
//!
//! Each type only says how to read a block: its scale `d` and offset `m` (value = `d·q + m`;
//! `m = 0` for the types without one) and its 32 quants as one [`Span`] (`span_*`). Three
//! bodies are shared by every type:
//!
//! - exact dot: `d · Σ q·x (+ m · Σ x)` per block, in f32 lanes.
//! - fast dot: `d · d8 · Σ q·q8 (+ m · s8)` per block, the byte products summed in integers by
//!   [`dot16`] or [`sdot16`] (the `neon+dotprod` table: `*_sdot`).
//! - axpy: `out += a · (d·q + m)`, see [`axpy16`].
//!
//! A Q4 block's byte `j` holds value `j` in its low and `j + 16` in its high nibble, so the two
//! halves of a span are the bytes masked and shifted. Q5 adds bit `j` of the u32 `qh` as bit 4
//! of value `j`: each byte of `qh` is copied to eight lanes and tested against the lane's bit.

use std::arch::aarch64::*;

use super::simd::{
    Span, axpy16, dot16, f16_at, hsum, ld_16, ld_32, ld_q, q16_dot_x, sdot16, signed, sum16,
};
use crate::backend::cpu::Q8Block;
use crate::quant::QK;

/// Low and high nibbles of the 16 bytes at `b[at..]`: values 0..16 and 16..32.
#[target_feature(enable = "neon")]
#[inline]
fn nibbles(b: &[u8], at: usize) -> [uint8x16_t; 2] {
    let raw = ld_16(b, at);
    [vandq_u8(raw, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(raw)]
}

/// `0x10` in lane `j` where bit `j` of the four bytes `b[at..at + 4]` (`qh`) is set.
#[target_feature(enable = "neon")]
#[inline]
fn fifth_bits(b: &[u8], at: usize) -> [uint8x16_t; 2] {
    // Byte k of this u64 is 1 << k: lane j tests bit j % 8 of its copy of qh byte j / 8.
    let lane_bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
    let spread = |lo: u8, hi: u8| vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
    let high = [spread(b[at], b[at + 1]), spread(b[at + 2], b[at + 3])];
    high.map(|h| vandq_u8(vtstq_u8(h, lane_bit), vdupq_n_u8(0x10)))
}

/// The five-bit quants (0..=31) of a Q5 block whose `qh` is at `b[at..]`, nibbles after.
#[target_feature(enable = "neon")]
#[inline]
fn q5(b: &[u8], at: usize) -> [uint8x16_t; 2] {
    let low = nibbles(b, at + 4);
    let high = fifth_bits(b, at);
    [vorrq_u8(low[0], high[0]), vorrq_u8(low[1], high[1])]
}

#[target_feature(enable = "neon")]
#[inline]
fn span_q8_0(b: &[u8]) -> Span {
    signed(ld_32(b, 2), 0)
}

#[target_feature(enable = "neon")]
#[inline]
fn span_q4_0(b: &[u8]) -> Span {
    signed(nibbles(b, 2), 8)
}

#[target_feature(enable = "neon")]
#[inline]
fn span_q4_1(b: &[u8]) -> Span {
    signed(nibbles(b, 4), 0)
}

#[target_feature(enable = "neon")]
#[inline]
fn span_q5_0(b: &[u8]) -> Span {
    signed(q5(b, 2), 16)
}

#[target_feature(enable = "neon")]
#[inline]
fn span_q5_1(b: &[u8]) -> Span {
    signed(q5(b, 4), 0)
}

/// `(d, m)` of a block: the f16 scale at 0 and, with `MIN`, the f16 offset at 2.
#[inline]
fn scales<const MIN: bool>(b: &[u8]) -> (f32, f32) {
    (f16_at(b, 0), if MIN { f16_at(b, 2) } else { 0.0 })
}

#[target_feature(enable = "neon")]
#[inline]
fn dot<const BB: usize, const MIN: bool>(
    row: &[u8],
    x: &[f32],
    span: impl Fn(&[u8]) -> Span,
) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let (xs, _) = x.as_chunks::<QK>();
    let mut acc = vdupq_n_f32(0.0);
    let mut macc = vdupq_n_f32(0.0);
    for (b, xb) in blocks.iter().zip(xs) {
        let [lo, hi] = span(b);
        let s = vaddq_f32(q16_dot_x(lo, xb, 0), q16_dot_x(hi, xb, 16));
        let (d, m) = scales::<MIN>(b);
        acc = vfmaq_f32(acc, s, vdupq_n_f32(d));
        if MIN {
            let sx = vaddq_f32(sum16(xb, 0), sum16(xb, 16));
            macc = vfmaq_f32(macc, sx, vdupq_n_f32(m));
        }
    }
    hsum(acc) + hsum(macc)
}

#[target_feature(enable = "neon")]
#[inline]
fn dot_q8<const BB: usize, const MIN: bool>(
    row: &[u8],
    acts: &[Q8Block],
    span: impl Fn(&[u8]) -> Span,
    idot: impl Fn(int8x16_t, int8x16_t) -> int32x4_t,
) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let mut acc = vdupq_n_f32(0.0);
    let mut ms = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let ([w0, w1], [a0, a1]) = (span(b), ld_q(&a.q));
        let p = vaddq_s32(idot(w0, a0), idot(w1, a1));
        let (d, m) = scales::<MIN>(b);
        acc = vfmaq_f32(acc, vcvtq_f32_s32(p), vdupq_n_f32(d * a.d));
        if MIN {
            ms += m * a.s;
        }
    }
    hsum(acc) + ms
}

#[target_feature(enable = "neon")]
#[inline]
fn axpy<const BB: usize, const MIN: bool>(
    row: &[u8],
    a: f32,
    out: &mut [f32],
    span: impl Fn(&[u8]) -> Span,
) {
    let (blocks, _) = row.as_chunks::<BB>();
    let (outs, _) = out.as_chunks_mut::<QK>();
    for (b, o) in blocks.iter().zip(outs) {
        let [lo, hi] = span(b);
        let (d, m) = scales::<MIN>(b);
        axpy16::<MIN>(lo, d, m, a, o, 0);
        axpy16::<MIN>(hi, d, m, a, o, 16);
    }
}

macro_rules! kernels {
    ($($bytes:literal, $min:literal, $span:ident: $dot:ident, $q8:ident, $sdot:ident, $axpy:ident;)*) => {$(
        #[target_feature(enable = "neon")]
        pub(super) fn $dot(row: &[u8], x: &[f32]) -> f32 {
            dot::<$bytes, $min>(row, x, |b| $span(b))
        }
        #[target_feature(enable = "neon")]
        pub(super) fn $q8(row: &[u8], acts: &[Q8Block]) -> f32 {
            dot_q8::<$bytes, $min>(row, acts, |b| $span(b), |w, a| dot16(w, a))
        }
        #[target_feature(enable = "neon,dotprod")]
        pub(super) fn $sdot(row: &[u8], acts: &[Q8Block]) -> f32 {
            dot_q8::<$bytes, $min>(row, acts, |b| $span(b), |w, a| sdot16(w, a))
        }
        #[target_feature(enable = "neon")]
        pub(super) fn $axpy(row: &[u8], a: f32, out: &mut [f32]) {
            axpy::<$bytes, $min>(row, a, out, |b| $span(b))
        }
    )*};
}

kernels! {
    34, false, span_q8_0: dot_q8_0, q8_0_q8, q8_0_q8_sdot, axpy_q8_0;
    18, false, span_q4_0: dot_q4_0, q4_0_q8, q4_0_q8_sdot, axpy_q4_0;
    20, true, span_q4_1: dot_q4_1, q4_1_q8, q4_1_q8_sdot, axpy_q4_1;
    22, false, span_q5_0: dot_q5_0, q5_0_q8, q5_0_q8_sdot, axpy_q5_0;
    24, true, span_q5_1: dot_q5_1, q5_1_q8, q5_1_q8_sdot, axpy_q5_1;
}
