//! The NEON building blocks the kernels share: bounds-checked loads and stores, conversions to
//! f32, and the three products over 16 values (float `Σ q·x`, integer `Σ q·a`, axpy).
//!
//! A decoded run of 32 quants is a [`Span`]: two vectors of 16 signed bytes in element order,
//! values 0..16 then 16..32. Every quantised type decodes to spans (one per 32-value block, eight
//! per k-quant super-block), and every k-quant scale group is exactly one of the two vectors.

use std::arch::aarch64::*;

use crate::quant::QK;

/// 32 signed quants in element order: `[values 0..16, values 16..32]`.
pub(super) type Span = [int8x16_t; 2];

// ---- bounds-checked loads and stores -------------------------------------------------------

/// Four f32 at `x[at..]`.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn ld_f32(x: &[f32], at: usize) -> float32x4_t {
    assert!(at + 4 <= x.len());
    // SAFETY: x[at..at + 4] is in bounds (checked above); ld1 has no alignment requirement
    // beyond the element's, which a &[f32] meets.
    unsafe { vld1q_f32(x.as_ptr().add(at)) }
}

/// Stores four f32 at `out[at..]`.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn st_f32(out: &mut [f32], at: usize, v: float32x4_t) {
    assert!(at + 4 <= out.len());
    // SAFETY: out[at..at + 4] is in bounds (checked above) and exclusively borrowed.
    unsafe { vst1q_f32(out.as_mut_ptr().add(at), v) }
}

/// 16 bytes at `b[at..]`.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn ld_16(b: &[u8], at: usize) -> uint8x16_t {
    assert!(at + 16 <= b.len());
    // SAFETY: b[at..at + 16] is in bounds (checked above); byte loads need no alignment.
    unsafe { vld1q_u8(b.as_ptr().add(at)) }
}

/// 8 bytes at `b[at..]`.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn ld_8(b: &[u8], at: usize) -> uint8x8_t {
    assert!(at + 8 <= b.len());
    // SAFETY: b[at..at + 8] is in bounds (checked above); byte loads need no alignment.
    unsafe { vld1_u8(b.as_ptr().add(at)) }
}

/// 32 bytes at `b[at..]`, as two vectors.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn ld_32(b: &[u8], at: usize) -> [uint8x16_t; 2] {
    [ld_16(b, at), ld_16(b, at + 16)]
}

/// The 32 activation quants of a block, as a [`Span`].
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn ld_q(q: &[i8; QK]) -> Span {
    // SAFETY: q is exactly 32 bytes, so both 16-byte loads are in bounds; no alignment needed.
    unsafe { [vld1q_s8(q.as_ptr()), vld1q_s8(q.as_ptr().add(16))] }
}

/// Stores a [`Span`] as 32 quants.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn st_q(q: &mut [i8; QK], v: Span) {
    // SAFETY: q is exactly 32 bytes and exclusively borrowed, so both stores are in bounds.
    unsafe {
        vst1q_s8(q.as_mut_ptr(), v[0]);
        vst1q_s8(q.as_mut_ptr().add(16), v[1]);
    }
}

// ---- conversions -----------------------------------------------------------------------------

/// The f16 scale at `b[at..at + 2]`, as the scalar kernels read it.
#[inline]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Four little-endian u16 from 8 bytes at `b[at..]`.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn ld_u16x4(b: &[u8], at: usize) -> uint16x4_t {
    vreinterpret_u16_u8(ld_8(b, at))
}

/// Four f16 bit patterns as f32, exactly (the same values as `half`'s conversion).
///
/// The f16 magnitude shifted left by 13 puts its exponent and mantissa in the f32 fields, with
/// the exponent bias still 15 instead of 127; multiplying by 2^112 rebiases it. That product is
/// exact for normal numbers, and also for subnormal ones: their bits read as an f32 subnormal of
/// the same mantissa, which the multiply turns into the right normal f32. Infinities and NaNs
/// (exponent 31) get the f32 all-ones exponent instead; the sign bit is put back last.
/// (`vcvt_f32_f16` does this in one instruction, but is only stable from Rust 1.94, above the
/// workspace's minimum version.)
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn f16x4_ps(h: uint16x4_t) -> float32x4_t {
    let v = vmovl_u16(h);
    let sign = vshlq_n_u32::<16>(vandq_u32(v, vdupq_n_u32(0x8000)));
    let mag = vshlq_n_u32::<13>(vandq_u32(v, vdupq_n_u32(0x7fff)));
    let two_112 = vdupq_n_f32(f32::from_bits((112 + 127) << 23));
    let finite = vreinterpretq_u32_f32(vmulq_f32(vreinterpretq_f32_u32(mag), two_112));
    let exp = vandq_u32(v, vdupq_n_u32(0x7c00));
    let special = vceqq_u32(exp, vdupq_n_u32(0x7c00));
    let inf_nan = vorrq_u32(mag, vdupq_n_u32(0x7f80_0000));
    vreinterpretq_f32_u32(vorrq_u32(vbslq_u32(special, inf_nan, finite), sign))
}

/// Four bf16 bit patterns as f32: a bf16 is the top half of an f32.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn bf16x4_ps(h: uint16x4_t) -> float32x4_t {
    vreinterpretq_f32_u32(vshll_n_u16::<16>(h))
}

/// 16 signed bytes as four vectors of f32 (values 0-3, 4-7, 8-11, 12-15).
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn i8x16_ps(q: int8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_s8(vget_low_s8(q));
    let hi = vmovl_high_s8(q);
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// Bits `n..` (`n < 8`) of every byte, masked to `mask`. NEON shifts each byte lane on its own
/// (a negative left shift is a logical right shift for unsigned lanes).
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn bits(v: [uint8x16_t; 2], n: usize, mask: u8) -> [uint8x16_t; 2] {
    let by = vdupq_n_s8(-(n as i8));
    let m = vdupq_n_u8(mask);
    v.map(|v| vandq_u8(vshlq_u8(v, by), m))
}

/// `v` as signed bytes, minus `offset`.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn signed(v: [uint8x16_t; 2], offset: i8) -> Span {
    let o = vdupq_n_s8(offset);
    v.map(|v| vsubq_s8(vreinterpretq_s8_u8(v), o))
}

// ---- products over 16 values -----------------------------------------------------------------

/// Sum of the four lanes.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn hsum(v: float32x4_t) -> f32 {
    vaddvq_f32(v)
}

/// `Σ q[j] · x[at + j]` over 16 values, as four partial sums.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn q16_dot_x(q: int8x16_t, x: &[f32], at: usize) -> float32x4_t {
    let [q0, q1, q2, q3] = i8x16_ps(q);
    let s01 = vfmaq_f32(vmulq_f32(q0, ld_f32(x, at)), q1, ld_f32(x, at + 4));
    let s23 = vfmaq_f32(vmulq_f32(q2, ld_f32(x, at + 8)), q3, ld_f32(x, at + 12));
    vaddq_f32(s01, s23)
}

/// `Σ x[at + j]` over 16 values, as four partial sums.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn sum16(x: &[f32], at: usize) -> float32x4_t {
    vaddq_f32(
        vaddq_f32(ld_f32(x, at), ld_f32(x, at + 4)),
        vaddq_f32(ld_f32(x, at + 8), ld_f32(x, at + 12)),
    )
}

/// `Σ a·b` of 16 signed byte pairs with plain NEON: lane `i` holds the products of bytes
/// `4i..4i + 4`, the lanes [`sdot16`] fills, so both give the same i32s. Each product fits an
/// i16 (|a·b| ≤ 128²); the pairwise adds widen to i32 before anything could overflow.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn dot16(a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    let hi = vpaddlq_s16(vmull_high_s8(a, b));
    vpaddq_s32(lo, hi)
}

/// [`dot16`] in one `sdot` instruction (Armv8.2 dot product). The intrinsic `vdotq_s32` is not
/// stable Rust yet, so this is one line of inline assembly.
#[target_feature(enable = "neon,dotprod")]
#[inline]
pub(super) fn sdot16(a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = vdupq_n_s32(0);
    // SAFETY: `sdot` only reads and writes the three vector registers named; the dotprod feature
    // of this function means it only runs on a CPU that has the instruction.
    unsafe {
        std::arch::asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// `out[at..at + 16] += a · w` with `w = scale · q + offset`, rounded as the dequantiser rounds
/// it (multiply, then add: k-quants pass `offset = -min`, and `x + (-m)` is `x - m` bit for bit),
/// then one fused multiply-add into `out`. With `OFFSET == false` the offset is skipped.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn axpy16<const OFFSET: bool>(
    q: int8x16_t,
    scale: f32,
    offset: f32,
    a: f32,
    out: &mut [f32],
    at: usize,
) {
    let (sv, ov, av) = (vdupq_n_f32(scale), vdupq_n_f32(offset), vdupq_n_f32(a));
    for (k, f) in i8x16_ps(q).into_iter().enumerate() {
        let mut w = vmulq_f32(f, sv);
        if OFFSET {
            w = vaddq_f32(w, ov);
        }
        let o = at + 4 * k;
        st_f32(out, o, vfmaq_f32(ld_f32(out, o), w, av));
    }
}
