//! The vector `e^x` of [`expf`](super::super::expf) on AVX2, eight lanes at a time, and the SiLU
//! and GeGLU gates and softmax exponentials built on it. Each lane computes exactly what
//! `expf::exp` (and `expf::silu_mul`, `expf::gelu_mul`) give for its value; a partial last group
//! goes through a zero-padded copy, so a value's result does not depend on where it sits.

use std::arch::x86_64::*;

use super::super::expf::{GELU_CUBIC, HI, LN2_HI, LN2_LO, LO, LOG2_E, P, SQRT_2_OVER_PI};
use super::{hsum, ld_ps, st_ps};

/// `e^x` per lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    let inside = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(LO));
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(P[0]);
    for &c in &P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let e = _mm256_fmadd_ps(
        p,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_and_ps(inside, _mm256_mul_ps(e, _mm256_castsi256_ps(two_n)))
}

/// `-x` per lane (a sign flip, exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn neg(x: __m256) -> __m256 {
    _mm256_xor_ps(x, _mm256_set1_ps(-0.0))
}

/// `g / (1 + e^-g) · u` per lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn silu8(g: __m256, u: __m256) -> __m256 {
    let e = exp8(neg(g));
    _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
}

/// `g / (1 + e^(-2k)) · u`, `k = √(2/π) (g + 0.044715 g³)`, per lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn gelu8(g: __m256, u: __m256) -> __m256 {
    let cubic = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_CUBIC), g), g),
        g,
    );
    let k = _mm256_mul_ps(_mm256_set1_ps(SQRT_2_OVER_PI), _mm256_add_ps(g, cubic));
    let e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0), k));
    _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
}

/// A gate kernel: `gate[i] = lanes(gate[i], up[i])`, eight at a time.
macro_rules! gate_kernel {
    ($(#[$doc:meta])* $name:ident = $lanes:ident) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $name(gate: &mut [f32], up: &[f32]) {
            assert_eq!(gate.len(), up.len(), "gate and up lengths");
            let whole = gate.len() / 8 * 8;
            for at in (0..whole).step_by(8) {
                let v = $lanes(ld_ps(gate, at), ld_ps(up, at));
                st_ps(gate, at, v);
            }
            let n = gate.len() - whole;
            if n > 0 {
                let (mut g, mut u) = ([0f32; 8], [0f32; 8]);
                g[..n].copy_from_slice(&gate[whole..]);
                u[..n].copy_from_slice(&up[whole..]);
                let v = $lanes(ld_ps(&g, 0), ld_ps(&u, 0));
                st_ps(&mut g, 0, v);
                gate[whole..].copy_from_slice(&g[..n]);
            }
        }
    };
}

gate_kernel! {
    /// SwiGLU's elementwise step.
    silu_mul = silu8
}

gate_kernel! {
    /// GeGLU's elementwise step (GELU's tanh form).
    gelu_mul = gelu8
}

/// `x[i] = e^(x[i] - shift)`; returns the sum of the results (eight partial sums, then the
/// padded tail's values in order).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    let s = _mm256_set1_ps(shift);
    let mut sum = _mm256_setzero_ps();
    let whole = x.len() / 8 * 8;
    for at in (0..whole).step_by(8) {
        let e = exp8(_mm256_sub_ps(ld_ps(x, at), s));
        sum = _mm256_add_ps(sum, e);
        st_ps(x, at, e);
    }
    let mut total = hsum(sum);
    let n = x.len() - whole;
    if n > 0 {
        let mut t = [0f32; 8];
        t[..n].copy_from_slice(&x[whole..]);
        let v = exp8(_mm256_sub_ps(ld_ps(&t, 0), s));
        st_ps(&mut t, 0, v);
        x[whole..].copy_from_slice(&t[..n]);
        total += t[..n].iter().sum::<f32>();
    }
    total
}
