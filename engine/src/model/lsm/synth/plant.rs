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

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
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
    let mut held: Vec<(f32, bool)> = Vec::with_capacity(n * tokens.div_ceil(2));
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
                held.push((score, active));
            }
        }
    }
    let cutoff = crate::sparsity::cutoff_for_recall(&mut active_scores, target_recall);
    // A non-finite cut-off cannot be stored in the JSON header; 0 fetches every neuron as well.
    let cutoff = if cutoff.is_finite() { cutoff } else { 0.0 };
    let mut recall = crate::sparsity::RecallCounter::default();
    let scores: Vec<f32> = held.iter().map(|h| h.0).collect();
    recall.add(&scores, cutoff, |k| held[k].1);
    LayerSim {
        mean_abs_h: sum_h
            .iter()
            .map(|s| (s / tokens.max(1) as f64) as f32)
            .collect(),
        cutoff,
        recall,
        sparsity: inactive as f64 / (n * tokens).max(1) as f64,
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
}
