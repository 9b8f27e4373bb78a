//! Activation quantisation to 8-bit blocks on NEON, bit-identical to
//! `scalar::quantize_block`: `d = amax / 127`, `q = round_ties_even(x · (1/d))`, `s = d · Σq`.
//!
//! The facts that make it identical: `vmaxnmq_f32` ignores NaN as `f32::max` does;
//! `vcvtnq_s32_f32` rounds to nearest with ties to even (NaN to 0); and the saturating narrows
//! i32 → i16 → i8 clamp as Rust's `as i8` does.

use std::arch::aarch64::*;

use super::simd::{ld_f32, st_q};
use crate::backend::cpu::{Q8Block, scalar};
use crate::quant::QK;

#[target_feature(enable = "neon")]
pub(super) fn quantize(x: &[f32], out: &mut [Q8Block]) {
    let (xs, tail) = x.as_chunks::<QK>();
    for (xb, o) in xs.iter().zip(out.iter_mut()) {
        let v: [float32x4_t; 8] = std::array::from_fn(|k| ld_f32(xb, 4 * k));
        let amax = v
            .iter()
            .fold(vdupq_n_f32(0.0), |m, v| vmaxnmq_f32(m, vabsq_f32(*v)));
        let d = vmaxnmvq_f32(amax) / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = v.map(|v| vcvtnq_s32_f32(vmulq_n_f32(v, id)));
        let q16: [int16x8_t; 4] =
            std::array::from_fn(|k| vcombine_s16(vqmovn_s32(q[2 * k]), vqmovn_s32(q[2 * k + 1])));
        let q8: [int8x16_t; 2] = std::array::from_fn(|k| {
            vcombine_s8(vqmovn_s16(q16[2 * k]), vqmovn_s16(q16[2 * k + 1]))
        });
        let sum = i32::from(vaddlvq_s8(q8[0])) + i32::from(vaddlvq_s8(q8[1]));
        st_q(&mut o.q, q8);
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
