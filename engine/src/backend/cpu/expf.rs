//! `e^x` as the SIMD tables compute it, eight (AVX2) or four (NEON) lanes at a time, and the
//! activations and softmax built on it.
//!
//! A call of `f32::exp` per value was the largest elementwise cost of a forward pass: SiLU and
//! GeGLU take one exponential per FFN neuron and token, softmax one per cached position and head.
//! The vector kernels (`avx2/math.rs`, `neon/math.rs`) evaluate the same steps as [`exp`] below,
//! lane by lane and with the same fused multiply-adds, so every lane gives exactly what [`exp`]
//! gives for its value, whatever its neighbours (the tests check this bit for bit); the scalar
//! table keeps `f32::exp`.
//!
//! The method is the classic one (Cody and Waite's range reduction, a degree-7 polynomial):
//! `x = n ln 2 + r` with `n` the nearest integer to `x / ln 2` and `|r| ≤ ln 2 / 2`, `ln 2`
//! split in two so that `n ln 2` is exact; `e^r ≈ 1 + r + r² P(r)`; `2^n` built in the exponent
//! bits. Arguments are first clamped to [`LO`, `HI`], where `2^n` is a normal f32. Error: within
//! 2 ulp of `e^x` on that range (tested against f64), far inside the exact path's 1e-3 contract.
//! Below `LO` the result is 0 (`f32::exp` gives denormals down to about -103.9: values no later
//! sum can see); above `HI` it is `e^HI`, so SiLU and GeGLU stay finite and reach 0 for very
//! negative gates.

/// Arguments below this give 0; the others are clamped to `LO..=HI`.
pub(super) const LO: f32 = -87.0;
/// See [`LO`]; `e^HI` is about 1.65e38, below `f32::MAX`.
pub(super) const HI: f32 = 88.0;
pub(super) const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = LN2_HI + LN2_LO`; `LN2_HI` has few enough mantissa bits that `n · LN2_HI` is exact.
pub(super) const LN2_HI: f32 = 0.693_359_4;
pub(super) const LN2_LO: f32 = -2.121_944_4e-4;
/// `P(r)`, highest power first (the Cephes `expf` coefficients).
pub(super) const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
/// √(2/π), GeGLU's tanh-form constant.
pub(super) const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term's coefficient of GeGLU's tanh form.
pub(super) const GELU_CUBIC: f32 = 0.044_715;

/// `e^x` for one value, the steps each vector lane takes (what the tests compare the lanes with).
#[cfg(test)]
pub(super) fn exp(x: f32) -> f32 {
    if x < LO {
        return 0.0;
    }
    let x = x.min(HI);
    let n = (x * LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let p = P[1..].iter().fold(P[0], |p, &c| p.mul_add(r, c));
    let e = p.mul_add(r * r, r + 1.0);
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// SiLU gate times up, `g / (1 + e^-g) · u`, as each lane computes it.
#[cfg(test)]
pub(super) fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

/// GeGLU (tanh form) gate times up, `g / (1 + e^(-2k)) · u` with `k = √(2/π) (g + 0.044715 g³)`,
/// as each lane computes it (the form `FfnActivation::GeluTanh` documents).
#[cfg(test)]
pub(super) fn gelu_mul(g: f32, u: f32) -> f32 {
    let k = SQRT_2_OVER_PI * (g + GELU_CUBIC * g * g * g);
    g / (1.0 + exp(-2.0 * k)) * u
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::tests::Rng;
    use crate::backend::cpu::{Kernels, softmax_inplace};
    use crate::model::FfnActivation;

    /// Ulps between `got` and the f64 value `want`, measured in f32 ulps at `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let ulp = f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
        ((f64::from(got) - want) / ulp).abs()
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64_on_its_range() {
        let steps = 2_000_000;
        let mut worst = 0f64;
        for i in 0..=steps {
            let x = LO + (HI - LO) * i as f32 / steps as f32;
            let e = ulps(exp(x), f64::from(x).exp());
            assert!(
                e <= 2.0,
                "exp({x}) = {} is {e} ulp from {}",
                exp(x),
                f64::from(x).exp()
            );
            worst = worst.max(e);
        }
        // The reduction and the polynomial are what they claim: most arguments land within 1 ulp.
        assert!(
            worst > 0.0,
            "a polynomial this short is not exact everywhere"
        );
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(LO - 0.5), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(1000.0), exp(HI));
        assert!(exp(HI).is_finite());
    }

    /// Within 2 ulp of the f64 function, plus what the f32 rounding of the exponential's argument
    /// is worth after `e^x` (a relative error `ε` in `x` is `|x| ε` in `e^x`; the same holds for
    /// `f32::exp`).
    #[test]
    fn the_gates_are_within_their_bound_of_f64() {
        let k = |g: f64| (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044_715 * g * g * g);
        let eps = f64::from(f32::EPSILON);
        for g in Rng(1).vec(100_000, 30.0) {
            let g64 = f64::from(g);
            let silu = (g64 / (1.0 + (-g64).exp()), -g64);
            let gelu = (g64 / (1.0 + (-2.0 * k(g64)).exp()), -2.0 * k(g64));
            for (name, got, (want, arg)) in [
                ("silu", silu_mul(g, 1.0), silu),
                ("gelu", gelu_mul(g, 1.0), gelu),
            ] {
                let bound = (4.0 + 2.0 * arg.abs()) * eps * want.abs() + 1e-30;
                assert!(
                    (f64::from(got) - want).abs() <= bound,
                    "{name}({g}) = {got}, f64 {want}"
                );
            }
        }
        // Very negative gates: `e^HI` in the denominator leaves a value no sum can see.
        assert!(silu_mul(-200.0, 1.0).abs() < 1e-35);
        assert!(gelu_mul(-100.0, 1.0).abs() < 1e-35);
        assert_eq!(gelu_mul(100.0, 1.0), 100.0);
    }

    /// Every SIMD table's lanes give exactly the one-value steps above, at every length (so at
    /// every position of a partial last group); the scalar table gives `f32::exp`'s numbers.
    #[test]
    fn every_table_gives_the_lane_reference_bit_for_bit() {
        for k in Kernels::supported() {
            let simd = k.name() != "scalar";
            for n in 0..41 {
                let g = Rng(n as u64 + 7).vec(n, 40.0);
                let u = Rng(n as u64 + 99).vec(n, 2.0);
                for act in [FfnActivation::Silu, FfnActivation::GeluTanh] {
                    let mut got = g.clone();
                    k.gate(act, &mut got, &u);
                    let mut want = g.clone();
                    if simd {
                        let lane = if act == FfnActivation::Silu {
                            silu_mul
                        } else {
                            gelu_mul
                        };
                        want.iter_mut().zip(&u).for_each(|(g, &u)| *g = lane(*g, u));
                    } else {
                        act.gate_inplace(&mut want, &u);
                    }
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{} {act:?} over {n} values",
                        k.name()
                    );
                }
                let mut got = g.clone();
                let sum = (k.math.exp_shifted)(&mut got, 3.0);
                for (j, (&e, &x)) in got.iter().zip(&g).enumerate() {
                    let want = if simd { exp(x - 3.0) } else { (x - 3.0).exp() };
                    assert_eq!(e.to_bits(), want.to_bits(), "{} e^x[{j}] of {n}", k.name());
                }
                let plain: f32 = got.iter().sum();
                assert!(
                    (sum - plain).abs() <= 1e-6 * plain,
                    "{}: sum {sum} vs {plain}",
                    k.name()
                );
            }
        }
    }

    #[test]
    fn softmax_of_every_table_matches_f64() {
        for k in Kernels::supported() {
            for n in [1, 3, 8, 9, 64, 1001] {
                let x = Rng(n as u64).vec(n, 20.0);
                let mut s = x.clone();
                k.softmax(&mut s);
                let max = x.iter().fold(f64::MIN, |m, v| m.max(f64::from(*v)));
                let z: f64 = x.iter().map(|v| (f64::from(*v) - max).exp()).sum();
                for (j, (&got, &v)) in s.iter().zip(&x).enumerate() {
                    let want = (f64::from(v) - max).exp() / z;
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-6,
                        "{} softmax[{j}] of {n}",
                        k.name()
                    );
                }
            }
            let mut big = [1000.0f32, 0.0, -1000.0];
            k.softmax(&mut big);
            assert_eq!(big, [1.0, 0.0, 0.0], "{}", k.name());
            let mut empty: [f32; 0] = [];
            k.softmax(&mut empty);
        }
        // The scalar table's softmax is the plain one's, bit for bit.
        let x = Rng(5).vec(77, 10.0);
        let (mut a, mut b) = (x.clone(), x);
        Kernels::scalar().softmax(&mut a);
        softmax_inplace(&mut b);
        assert_eq!(a, b);
    }
}
