//! The vector `e^x` of [`expf`](super::super::expf) on NEON, four lanes at a time, and the SiLU
//! and GeGLU gates and softmax exponentials built on it. Each lane computes exactly what
//! `expf::exp` (and `expf::silu_mul`, `expf::gelu_mul`) give for its value; a partial last group
//! goes through a zero-padded copy, so a value's result does not depend on where it sits.

use std::arch::aarch64::*;

use super::super::expf::{GELU_CUBIC, HI, LN2_HI, LN2_LO, LO, LOG2_E, P, SQRT_2_OVER_PI};
use super::simd::{ld_f32, st_f32};

/// `e^x` per lane.
#[target_feature(enable = "neon")]
#[inline]
fn exp4(x: float32x4_t) -> float32x4_t {
    let inside = vcgeq_f32(x, vdupq_n_f32(LO));
    let x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(LO)), vdupq_n_f32(HI));
    let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(LOG2_E)));
    let r = vfmsq_f32(x, n, vdupq_n_f32(LN2_HI));
    let r = vfmsq_f32(r, n, vdupq_n_f32(LN2_LO));
    let mut p = vdupq_n_f32(P[0]);
    for &c in &P[1..] {
        p = vfmaq_f32(vdupq_n_f32(c), p, r);
    }
    let e = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0)), p, vmulq_f32(r, r));
    let two_n = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
    let y = vmulq_f32(e, vreinterpretq_f32_s32(two_n));
    vreinterpretq_f32_u32(vandq_u32(inside, vreinterpretq_u32_f32(y)))
}

/// `g / (1 + e^-g) · u` per lane.
#[target_feature(enable = "neon")]
#[inline]
fn silu4(g: float32x4_t, u: float32x4_t) -> float32x4_t {
    let e = exp4(vnegq_f32(g));
    vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0), e)), u)
}

/// `g / (1 + e^(-2k)) · u`, `k = √(2/π) (g + 0.044715 g³)`, per lane.
#[target_feature(enable = "neon")]
#[inline]
fn gelu4(g: float32x4_t, u: float32x4_t) -> float32x4_t {
    let cubic = vmulq_f32(vmulq_f32(vmulq_f32(vdupq_n_f32(GELU_CUBIC), g), g), g);
    let k = vmulq_f32(vdupq_n_f32(SQRT_2_OVER_PI), vaddq_f32(g, cubic));
    let e = exp4(vmulq_f32(vdupq_n_f32(-2.0), k));
    vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0), e)), u)
}

/// A gate kernel: `gate[i] = lanes(gate[i], up[i])`, four at a time.
macro_rules! gate_kernel {
    ($(#[$doc:meta])* $name:ident = $lanes:ident) => {
        $(#[$doc])*
        #[target_feature(enable = "neon")]
        pub(super) fn $name(gate: &mut [f32], up: &[f32]) {
            assert_eq!(gate.len(), up.len(), "gate and up lengths");
            let whole = gate.len() / 4 * 4;
            for at in (0..whole).step_by(4) {
                let v = $lanes(ld_f32(gate, at), ld_f32(up, at));
                st_f32(gate, at, v);
            }
            let n = gate.len() - whole;
            if n > 0 {
                let (mut g, mut u) = ([0f32; 4], [0f32; 4]);
                g[..n].copy_from_slice(&gate[whole..]);
                u[..n].copy_from_slice(&up[whole..]);
                let v = $lanes(ld_f32(&g, 0), ld_f32(&u, 0));
                st_f32(&mut g, 0, v);
                gate[whole..].copy_from_slice(&g[..n]);
            }
        }
    };
}

gate_kernel! {
    /// SwiGLU's elementwise step.
    silu_mul = silu4
}

gate_kernel! {
    /// GeGLU's elementwise step (GELU's tanh form).
    gelu_mul = gelu4
}

/// `x[i] = e^(x[i] - shift)`; returns the sum of the results (four partial sums, then the
/// padded tail's values in order).
#[target_feature(enable = "neon")]
pub(super) fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    let s = vdupq_n_f32(shift);
    let mut sum = vdupq_n_f32(0.0);
    let whole = x.len() / 4 * 4;
    for at in (0..whole).step_by(4) {
        let e = exp4(vsubq_f32(ld_f32(x, at), s));
        sum = vaddq_f32(sum, e);
        st_f32(x, at, e);
    }
    let mut total = vaddvq_f32(sum);
    let n = x.len() - whole;
    if n > 0 {
        let mut t = [0f32; 4];
        t[..n].copy_from_slice(&x[whole..]);
        let v = exp4(vsubq_f32(ld_f32(&t, 0), s));
        st_f32(&mut t, 0, v);
        x[whole..].copy_from_slice(&t[..n]);
        total += t[..n].iter().sum::<f32>();
    }
    total
}
