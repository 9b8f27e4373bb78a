//! NEON kernels for float rows (f32, f16, bf16): 16 values per step, the tail (fewer than 16
//! values, rows of any length) in scalar code.
//!
//! f16 is widened with [`f16x4_ps`] (exact, integer operations and one multiply), bf16 by a
//! 16-bit left shift.

use std::arch::aarch64::*;

use super::simd::{bf16x4_ps, f16_at, f16x4_ps, hsum, ld_16, ld_f32, ld_u16x4, st_f32};

fn f32_tail(t: &[u8], j: usize) -> f32 {
    f32::from_le_bytes([t[4 * j], t[4 * j + 1], t[4 * j + 2], t[4 * j + 3]])
}

fn bf16_tail(t: &[u8], j: usize) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([t[2 * j], t[2 * j + 1]])) << 16)
}

/// `Σ w·x` over 16-value chunks of `CB` bytes in four accumulators; `w(chunk, k)` gives values
/// `4k..4k + 4` of a chunk, `tail(bytes, j)` value `j` of the bytes after the last chunk.
#[target_feature(enable = "neon")]
#[inline]
fn dot_float<const CB: usize>(
    row: &[u8],
    x: &[f32],
    w: impl Fn(&[u8; CB], usize) -> float32x4_t,
    tail: impl Fn(&[u8], usize) -> f32,
) -> f32 {
    let (rc, rt) = row.as_chunks::<CB>();
    let (xc, xt) = x.as_chunks::<16>();
    let mut acc = [vdupq_n_f32(0.0); 4];
    for (r, xs) in rc.iter().zip(xc) {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = vfmaq_f32(*a, w(r, k), ld_f32(xs, 4 * k));
        }
    }
    let mut s = hsum(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    ));
    for (j, xv) in xt.iter().enumerate() {
        s += tail(rt, j) * xv;
    }
    s
}

#[target_feature(enable = "neon")]
pub(super) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<64>(
        row,
        x,
        |r, k| vreinterpretq_f32_u8(ld_16(r, 16 * k)),
        f32_tail,
    )
}

#[target_feature(enable = "neon")]
pub(super) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<32>(
        row,
        x,
        |r, k| f16x4_ps(ld_u16x4(r, 8 * k)),
        |t, j| f16_at(t, 2 * j),
    )
}

#[target_feature(enable = "neon")]
pub(super) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<32>(row, x, |r, k| bf16x4_ps(ld_u16x4(r, 8 * k)), bf16_tail)
}

/// `out += a · w` over 16-value chunks of `CB` bytes (`w` and `tail` as in [`dot_float`]), one
/// fused multiply-add per value.
#[target_feature(enable = "neon")]
#[inline]
fn axpy_float<const CB: usize>(
    row: &[u8],
    a: f32,
    out: &mut [f32],
    w: impl Fn(&[u8; CB], usize) -> float32x4_t,
    tail: impl Fn(&[u8], usize) -> f32,
) {
    let av = vdupq_n_f32(a);
    let (rc, rt) = row.as_chunks::<CB>();
    let (oc, ot) = out.as_chunks_mut::<16>();
    for (r, o) in rc.iter().zip(oc) {
        for k in 0..4 {
            let v = vfmaq_f32(ld_f32(o, 4 * k), w(r, k), av);
            st_f32(o, 4 * k, v);
        }
    }
    for (j, o) in ot.iter_mut().enumerate() {
        *o += a * tail(rt, j);
    }
}

#[target_feature(enable = "neon")]
pub(super) fn axpy_f32(row: &[u8], a: f32, out: &mut [f32]) {
    axpy_float::<64>(
        row,
        a,
        out,
        |r, k| vreinterpretq_f32_u8(ld_16(r, 16 * k)),
        f32_tail,
    );
}

#[target_feature(enable = "neon")]
pub(super) fn axpy_f16(row: &[u8], a: f32, out: &mut [f32]) {
    axpy_float::<32>(
        row,
        a,
        out,
        |r, k| f16x4_ps(ld_u16x4(r, 8 * k)),
        |t, j| f16_at(t, 2 * j),
    );
}

#[target_feature(enable = "neon")]
pub(super) fn axpy_bf16(row: &[u8], a: f32, out: &mut [f32]) {
    axpy_float::<32>(row, a, out, |r, k| bf16x4_ps(ld_u16x4(r, 8 * k)), bf16_tail);
}
