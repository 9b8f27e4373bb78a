//! The planted activation statistics of a synthetic model: a seeded RNG, the normal distribution
//! helpers, and the per-layer simulation that sets cut-offs and per-neuron statistics.
//!
//! The model (see the parent module for how the weights realise it): for a token, neuron `i`'s
//! gate pre-activation is
//!
//! ```text
//! g_i = tau + sigma * (beta_i + z_lr + eta * z_noise),   z_lr, z_noise ~ N(0, 1)
//! ```
//!
//! where `z_lr` is the part the planted low-rank subspace carries (what the predictor sees) and
//! `z_noise` the part it cannot see (planted noise plus Q4 rounding). The up projection is `±1`
//! with a small spread, so `|h_i| = |silu(g_i) * u_i|` is above the threshold `silu(tau)` about
//! when `g_i > tau`, that is with probability `Phi(beta_i / sqrt(1 + eta²))`. The `beta_i` are
//! drawn `N(mu, kappa²)` (a probit-normal frequency distribution: `kappa` sets how hot/cold the
//! neurons are) with `mu` chosen so that the mean activity is `1 - sparsity`.

/// splitmix64: small, fast, well mixed; every row of every tensor gets its own stream so that
/// the output does not depend on the number of threads.
#[derive(Clone, Debug)]
pub(super) struct Rng(u64);

impl Rng {
    /// A stream for `(seed, tag, a, b)`: e.g. (model seed, tensor kind, layer, row).
    pub fn new(seed: u64, tag: u64, a: u64, b: u64) -> Rng {
        let mut r = Rng(seed ^ 0x5851_f42d_4c95_7f2d);
        for v in [tag, a, b] {
            r.0 ^= v.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            r.next_u64();
        }
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1)`.
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Uniform with mean 0 and variance 1 (cheap; sums of many are normal enough).
    pub fn flat(&mut self) -> f32 {
        const SQRT3: f32 = 1.732_050_8;
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        (2.0 * u - 1.0) * SQRT3
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// `erfc(x)` with fractional error below 1.2e-7 (Numerical Recipes' Chebyshev fit).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// Standard normal CDF.
pub(super) fn phi(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

/// Inverse of [`phi`] for `p` in `(0, 1)` (Acklam's rational approximation, relative error
/// ~1e-9).
pub(super) fn phi_inv(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

pub(super) fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Where `silu` has its minimum, and the minimum.
const SILU_ARGMIN: f64 = -1.278_464_542_761_074;
const SILU_MIN: f64 = -0.278_464_542_761_074;

/// The `x` in `[lo, hi]` where the monotone `f` crosses `v` (bisection).
fn crossing(f: impl Fn(f64) -> f64, v: f64, mut lo: f64, mut hi: f64) -> f64 {
    let rising = f(hi) > f(lo);
    for _ in 0..80 {
        let mid = 0.5 * (lo + hi);
        if (f(mid) < v) == rising {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// `P(|silu(bias + sigma·Z)| >= v)` for `Z ~ N(0, 1)`.
pub(super) fn p_abs_silu_at_least(bias: f64, sigma: f64, v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p_above = |x: f64| 1.0 - phi((x - bias) / sigma);
    // silu rises from its minimum on: silu(x) >= v > 0 above one point.
    let x_pos = crossing(silu, v, 0.0, v + 40.0);
    let mut p = p_above(x_pos);
    if v <= -SILU_MIN {
        // silu(x) <= -v on an interval around the minimum.
        let x1 = crossing(silu, -v, -100.0, SILU_ARGMIN);
        let x2 = crossing(silu, -v, SILU_ARGMIN, 0.0);
        p += p_above(x1) - p_above(x2);
    }
    p.clamp(0.0, 1.0)
}

/// `P(X <= b, Y <= b)` for standard normals `X`, `Y` of correlation `rho` in `[0, 1)`:
/// `∫_{-∞}^{b} φ(x) Φ((b - rho·x) / sqrt(1 - rho²)) dx` by Simpson's rule.
pub(super) fn bivariate_normal_orthant(b: f64, rho: f64) -> f64 {
    if rho <= 0.0 {
        return phi(b) * phi(b);
    }
    let s = (1.0 - rho * rho).max(1e-12).sqrt();
    let lo = (-9.0f64).min(b - 1.0);
    if b <= lo {
        return 0.0;
    }
    let n = 400;
    let step = (b - lo) / n as f64;
    let f = |x: f64| {
        (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt() * phi((b - rho * x) / s)
    };
    let mut sum = f(lo) + f(b);
    for k in 1..n {
        sum += f(lo + k as f64 * step) * if k % 2 == 1 { 4.0 } else { 2.0 };
    }
    (sum * step / 3.0).clamp(0.0, 1.0)
}

/// The planted distribution's constants, shared by every layer.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plant {
    /// Gate pre-activation at the threshold.
    pub tau: f64,
    /// Scale of the token-varying part of the gate.
    pub sigma: f64,
    /// Mean of `beta`.
    pub mu: f64,
    /// Spread of `beta` (hot/cold skew).
    pub kappa: f64,
    /// Unpredictable part of the gate relative to the predictable one (planted noise and Q4
    /// rounding together).
    pub eta: f64,
}

impl Plant {
    /// Constants for a target `sparsity` (share of inactive neuron-tokens), skew `kappa` and
    /// total unpredictable noise `eta`.
    pub fn new(sparsity: f64, kappa: f64, eta: f64) -> Plant {
        let spread = (1.0 + eta * eta + kappa * kappa).sqrt();
        Plant {
            tau: 2.0,
            sigma: 1.0,
            mu: phi_inv(1.0 - sparsity) * spread,
            kappa,
            eta,
        }
    }

    /// The `|h|` threshold: `silu(tau)` (the up projection is ±1).
    pub fn threshold(&self) -> f32 {
        silu(self.tau) as f32
    }

    /// Per neuron, in descending order (stored order: hot neurons first, so they share chunks):
    /// `beta_i`.
    pub fn betas(&self, rng: &mut Rng, n: usize) -> Vec<f64> {
        let mut b: Vec<f64> = (0..n)
            .map(|_| self.mu + self.kappa * rng.normal())
            .collect();
        b.sort_by(|x, y| y.total_cmp(x));
        b
    }

    /// The planted probability that a neuron with `beta` is active on a token.
    pub fn frequency(&self, beta: f64) -> f64 {
        phi(beta / (1.0 + self.eta * self.eta).sqrt())
    }

    /// Expected share of a token's active neurons that are active on the next token when the
    /// token-varying part of every gate (predictable and not) has correlation `rho` from one
    /// token to the next: `E[P(both)] / E[p]` over `beta ~ N(mu, kappa²)` (256 quantiles). At
    /// `rho = 0` this is [`Self::carry_over`] of the planted frequencies.
    pub fn carry_over_at(&self, rho: f64) -> f64 {
        let k = 256;
        let (mut both, mut one) = (0.0, 0.0);
        for j in 0..k {
            let beta = self.mu + self.kappa * phi_inv((j as f64 + 0.5) / k as f64);
            let b = beta / (1.0 + self.eta * self.eta).sqrt();
            both += bivariate_normal_orthant(b, rho);
            one += phi(b);
        }
        if one > 0.0 { both / one } else { 0.0 }
    }

    /// The correlation `rho` at which [`Self::carry_over_at`] is `target` (bisection over
    /// `[0, max_rho]`), or `None` when `target` lies outside what `[0, max_rho]` gives.
    pub fn rho_for_carry_over(&self, target: f64, max_rho: f64) -> Option<f64> {
        let (lo_c, hi_c) = (self.carry_over_at(0.0), self.carry_over_at(max_rho));
        if !(lo_c..=hi_c).contains(&target) {
            return None;
        }
        let (mut lo, mut hi) = (0.0, max_rho);
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if self.carry_over_at(mid) < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(0.5 * (lo + hi))
    }

    /// Expected share of a token's active neurons that are active on the next, independent token
    /// (`E[p²] / E[p]` over the neurons): the carry-over the cache can exploit.
    pub fn carry_over(freqs: &[f32]) -> f64 {
        let (s1, s2) = freqs.iter().fold((0.0f64, 0.0f64), |(a, b), &p| {
            (a + f64::from(p), b + f64::from(p) * f64::from(p))
        });
        if s1 > 0.0 { s2 / s1 } else { 0.0 }
    }
}

/// One layer's simulated statistics.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct LayerSim {
    /// Per neuron: mean `|h|` over the simulated tokens.
    pub mean_abs_h: Vec<f32>,
    /// Score cut-off reaching the target recall on the first half of the tokens.
    pub cutoff: f32,
    /// Recall and fetch fraction of that cut-off on the second half.
    pub recall: crate::sparsity::RecallCounter,
    /// Share of neuron-tokens below the threshold.
    pub sparsity: f64,
    /// Per neuron: the probability that the predictor selects it at `cutoff` (its score is
    /// `>= cutoff`), exact under the planted model ([`p_abs_silu_at_least`]).
    pub selection: Vec<f32>,
    /// The simulated quality cost: on the second half of the tokens, the relative RMS error of the
    /// FFN output with the neurons under the threshold or under the cut-off left out, taking the
    /// down columns as independent and of equal norm (`sqrt(Σ missed h² / Σ h²)`).
    pub output_error: f64,
}

/// Simulates `tokens` tokens of one layer from the planted distribution: `bias[i]` is neuron
/// `i`'s gate bias (`tau + sigma * beta_i`, as stored), `mean_abs_u[i]` its `|up·x|`. The score is
/// what the low-rank predictor computes, `|silu(g̃)| * mean|u|` with `g̃` the gate without the
/// unpredictable part. Half the tokens set the cut-off for `target_recall`, the other half
/// measure it.
pub(super) fn simulate_layer(
    plant: &Plant,
    bias: &[f64],
    mean_abs_u: &[f32],
    tokens: usize,
    target_recall: f32,
    rng: &mut Rng,
) -> LayerSim {
    let n = bias.len();
    let thr = f64::from(plant.threshold());
    let mut sum_h = vec![0f64; n];
    let mut active_scores = Vec::new();
    let mut held: Vec<(f32, bool, f64)> = Vec::with_capacity(n * tokens.div_ceil(2));
    let mut inactive = 0usize;
    for t in 0..tokens {
        for i in 0..n {
            let predicted = bias[i] + plant.sigma * rng.normal();
            let g = predicted + plant.sigma * plant.eta * rng.normal();
            let u = f64::from(mean_abs_u[i]) * (1.0 + 0.05 * rng.normal());
            let h = (silu(g) * u).abs();
            sum_h[i] += h;
            let active = crate::sparsity::is_active(h as f32, thr as f32);
            inactive += usize::from(!active);
            let score = (silu(predicted).abs() * f64::from(mean_abs_u[i])) as f32;
            if t % 2 == 0 {
                if active {
                    active_scores.push(score);
                }
            } else {
                held.push((score, active, h));
            }
        }
    }
    let cutoff = crate::sparsity::cutoff_for_recall(&mut active_scores, target_recall);
    // A non-finite cut-off cannot be stored in the JSON header; 0 fetches every neuron as well.
    let cutoff = if cutoff.is_finite() { cutoff } else { 0.0 };
    let mut recall = crate::sparsity::RecallCounter::default();
    let scores: Vec<f32> = held.iter().map(|h| h.0).collect();
    recall.add(&scores, cutoff, |k| held[k].1);
    let (mut all2, mut missed2) = (0f64, 0f64);
    for &(score, active, h) in &held {
        all2 += h * h;
        if !(active && score >= cutoff) {
            missed2 += h * h;
        }
    }
    let selection = bias
        .iter()
        .zip(mean_abs_u)
        .map(|(&b, &u)| {
            let v = f64::from(cutoff) / f64::from(u).max(1e-30);
            p_abs_silu_at_least(b, plant.sigma, v) as f32
        })
        .collect();
    LayerSim {
        mean_abs_h: sum_h
            .iter()
            .map(|s| (s / tokens.max(1) as f64) as f32)
            .collect(),
        cutoff,
        recall,
        sparsity: inactive as f64 / (n * tokens).max(1) as f64,
        selection,
        output_error: if all2 > 0.0 {
            (missed2 / all2).sqrt()
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_helpers_agree() {
        for p in [1e-6, 0.01, 0.2, 0.5, 0.6, 0.9, 0.999] {
            assert!((phi(phi_inv(p)) - p).abs() < 1e-6 * p.max(1e-2), "{p}");
        }
        assert!((phi(1.0) - 0.841_344_746).abs() < 1e-6);
        let mut r = Rng::new(1, 2, 3, 4);
        let xs: Vec<f64> = (0..20000).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| x * x).sum::<f64>() / xs.len() as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        let fs: Vec<f32> = (0..20000).map(|_| r.flat()).collect();
        let var = fs.iter().map(|x| x * x).sum::<f32>() / fs.len() as f32;
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }

    #[test]
    fn planted_frequencies_average_to_the_target_activity() {
        for (s, kappa) in [(0.4, 1.5), (0.8, 1.0), (0.9, 2.0)] {
            let plant = Plant::new(s, kappa, 0.3);
            let mut r = Rng::new(7, 0, 0, 0);
            let betas = plant.betas(&mut r, 20000);
            assert!(betas.windows(2).all(|w| w[0] >= w[1]), "hot first");
            let mean = betas.iter().map(|&b| plant.frequency(b)).sum::<f64>() / 20000.0;
            assert!((mean - (1.0 - s)).abs() < 0.02, "{s}: {mean}");
            // The simulation agrees: realised sparsity near the target, recall near 0.95.
            let bias: Vec<f64> = betas.iter().map(|b| plant.tau + plant.sigma * b).collect();
            let sim = simulate_layer(&plant, &bias, &vec![1.0; 20000], 8, 0.95, &mut r);
            assert!((sim.sparsity - s).abs() < 0.03, "{s}: {}", sim.sparsity);
            assert!(
                (sim.recall.recall() - 0.95).abs() < 0.02,
                "{:?}",
                sim.recall
            );
            assert!(sim.recall.fetch_fraction() < 1.0);
        }
    }

    #[test]
    fn selection_probabilities_match_a_monte_carlo_of_the_planted_model() {
        // The closed form against sampling, on both branches of |silu| (a cut-off under silu's
        // minimum also selects neurons driven far negative).
        let mut r = Rng::new(3, 1, 4, 1);
        for (bias, v) in [
            (2.0, 1.7),
            (-1.0, 0.5),
            (-1.3, 0.2),
            (0.5, 0.05),
            (3.0, 0.0),
        ] {
            let n = 40000;
            let hits = (0..n)
                .filter(|_| silu(bias + r.normal()).abs() >= v)
                .count();
            let (mc, p) = (hits as f64 / n as f64, p_abs_silu_at_least(bias, 1.0, v));
            assert!((mc - p).abs() < 0.01, "bias {bias} v {v}: {mc} vs {p}");
        }

        // A layer: per-neuron selection at the simulated cut-off.
        let plant = Plant::new(0.8, 1.5, 0.6);
        let n = 2000;
        let betas = plant.betas(&mut r, n);
        let bias: Vec<f64> = betas.iter().map(|b| plant.tau + plant.sigma * b).collect();
        let mean_abs_u: Vec<f32> = (0..n).map(|i| 0.9 + 0.05 * (i % 5) as f32).collect();
        let sim = simulate_layer(&plant, &bias, &mean_abs_u, 32, 0.95, &mut r);
        assert!(sim.selection.iter().all(|q| (0.0..=1.0).contains(q)));
        let tokens = 4000;
        for i in (0..n).step_by(61) {
            let hits = (0..tokens)
                .filter(|_| {
                    let predicted = bias[i] + plant.sigma * r.normal();
                    let score = (silu(predicted).abs() * f64::from(mean_abs_u[i])) as f32;
                    score >= sim.cutoff
                })
                .count();
            let (mc, q) = (hits as f64 / tokens as f64, f64::from(sim.selection[i]));
            let sd = (q * (1.0 - q) / tokens as f64).sqrt();
            assert!((mc - q).abs() < 4.5 * sd + 2e-3, "neuron {i}: {mc} vs {q}");
        }
        // Their mean is the fetch fraction the simulation measured (16 tokens: sampling noise).
        let mean = sim.selection.iter().map(|&q| f64::from(q)).sum::<f64>() / n as f64;
        let fetch = sim.recall.fetch_fraction();
        assert!((mean - fetch).abs() < 0.01, "{mean} vs {fetch}");
        assert!(
            sim.output_error > 0.0 && sim.output_error < 0.5,
            "{}",
            sim.output_error
        );
    }

    #[test]
    fn carry_over_grows_with_the_token_correlation() {
        let plant = Plant::new(0.8, 1.5, 0.6);
        // At rho = 0 the closed form is E[p²]/E[p] of the planted frequencies.
        let freqs: Vec<f32> = (0..256)
            .map(|j| {
                let beta = plant.mu + plant.kappa * phi_inv((j as f64 + 0.5) / 256.0);
                plant.frequency(beta) as f32
            })
            .collect();
        assert!((plant.carry_over_at(0.0) - Plant::carry_over(&freqs)).abs() < 1e-4);
        let c: Vec<f64> = [0.0, 0.3, 0.6, 0.9, 0.999]
            .iter()
            .map(|&r| plant.carry_over_at(r))
            .collect();
        assert!(c.windows(2).all(|w| w[0] < w[1]), "{c:?}");
        assert!(c[4] > 0.97, "{c:?}");
        // Sampled pairs of correlated normals agree with the orthant probability.
        let mut r = Rng::new(8, 8, 8, 8);
        let (b, rho, n) = (0.4, 0.7, 100_000);
        let hits = (0..n)
            .filter(|_| {
                let x = r.normal();
                let y = rho * x + (1.0 - rho * rho).sqrt() * r.normal();
                x <= b && y <= b
            })
            .count();
        let p = bivariate_normal_orthant(b, rho);
        assert!((hits as f64 / n as f64 - p).abs() < 0.005, "{p}");
        let rho = plant.rho_for_carry_over(0.8, 0.95).unwrap();
        assert!((plant.carry_over_at(rho) - 0.8).abs() < 1e-6);
        assert!(plant.rho_for_carry_over(0.3, 0.95).is_none());
    }
}
