//! Token correlation (`leanstream synth --token-correlation RHO`): attention planted so that the
//! token-varying part of every layer's FFN input follows an AR(1) process from one position to
//! the next, instead of being independent per token.
//!
//! Without it, a token's residual stream is its embedding `cos θ·√d·ĉ + sin θ·n_t` (plus small
//! outputs), and `n_t` is independent from token to token, so consecutive tokens' active neuron
//! sets are independent given the neurons' frequencies. With it, the component of the residual
//! stream orthogonal to `ĉ` — all of it, so the part of each gate the predictor sees *and* the
//! part it cannot (planted noise, Q4 rounding) — becomes `z_t = c·Σ_{Δ≥0} ρ^Δ·n_{t−Δ}` with
//! `c = √(1 − ρ²)`: unit variance per direction as before (the per-token statistics, thresholds,
//! frequencies, predictor cut-offs and recall of the calibration section are unchanged), and
//! correlation `ρ` between consecutive positions. `ρ` is chosen so that the planted model's
//! expected carry-over `E[P(active on t and t−1)] / E[P(active)]` is `RHO`
//! ([`Plant::rho_for_carry_over`]).
//!
//! How attention does it. The space orthogonal to `ĉ` gets an orthonormal basis (Gram–Schmidt
//! over every layer's planted directions first, layer by layer, then seeded random directions).
//! Layer `j` transforms the next `m` basis directions, where `m` is what its value heads hold, so
//! that each direction is transformed exactly once, by the first layers, and every layer's planted
//! directions are transformed no later than the layer itself reads them. Two kinds of heads
//! read the same values (the projections on those directions; with GQA they share a KV head,
//! otherwise KV heads go in pairs):
//!
//! - a **self** head whose scores peak at its own position by [`SELF_MARGIN`] (equal cosine
//!   amplitudes on every RoPE pair of frequency ≥ [`SELF_MIN_FREQ`]), written back with gain `−1`:
//!   it removes the direction's current content;
//! - an **exponential** head whose scores fall linearly with the distance `Δ`,
//!   `−B·sin(ω_L·Δ) ≈ −λ·Δ` on the lowest RoPE pair that stays monotone over the context, so its
//!   weights are `∝ ρ_k^Δ`, written back with gain `1/‖a‖` (unit variance).
//!
//! Queries and keys do not depend on the token: they are constant **biases** (`attn_q.bias`,
//! `attn_k.bias`; the Q and K matrices are zero), so the scores are exactly these functions of
//! `Δ` whatever the tokens and the layer's norm (the gains and `λ` are solved on the realised
//! softmax weights, [`Kernels`]). Layers with nothing left to transform have zero attention.
//!
//! Limits, measured by `calibrate::measure_activity` (see `leanstream synth`'s report):
//!
//! - **Warm-up.** Attention weights are normalised over the positions a token sees, so the first
//!   positions of a context put all the weight on few tokens: the transformed directions' variance
//!   is `(1 + ρ^{t+1}) / (1 − ρ^{t+1})` at position `t` (`(1 + ρ)/(1 − ρ)` at the first, 1 after
//!   about `3/(1 − ρ)` positions). The layer's RMS norm divides it out of the common direction, so
//!   the first positions of every context have far fewer active neurons than the rest (7B shape,
//!   carry-over target 0.8 at sparsity 0.8: 1 % active at position 0, 9 % at 3, 17 % at 8, the
//!   planted 20 % from about 12; the tiny shape recovers by position 3). No choice of constant
//!   gains avoids it: at position 0 every head returns the token's own value, so the output there
//!   is the sum of the kernel, whose square is the process's `1 + 2·Σ_k r_k`.
//! - **Early layers.** A layer transforms at most `m` directions (7B: 2048 of 4095; the tiny shape
//!   64 of 127; SmolLM2's shape 192 of 575), so the first layer(s) see the unpredictable part of
//!   their gates only partly correlated: their carry-over is lower than the target.
//! - **Precision.** With an f16 or q8_0 KV cache the keys are rounded, which perturbs the
//!   heads' weights a little: the measured carry-over moves by at most 0.005 (tiny and SmolLM2
//!   shapes, against an f32 cache).

use nalgebra::DMatrix;
use rayon::prelude::*;

use super::SynthOptions;
use super::plant::{Plant, Rng};
use super::weights::directions;
use crate::model::ModelConfig;
use crate::quant::{DType, quantize_row};
use crate::{Error, Result};

/// RNG stream tag of the random directions that complete the basis.
const TAG_FILL: u64 = 0x6361_7272_7946_696c;
/// Score margin, in nats, by which the self head prefers the query's own position to any other.
pub(super) const SELF_MARGIN: f64 = 16.0;
/// RoPE pairs of at least this frequency (radians per position) carry the self head.
pub(super) const SELF_MIN_FREQ: f64 = 0.05;
/// The highest latent correlation planted (the warm-up grows as `1/(1 − ρ)`).
pub(super) const MAX_RHO: f64 = 0.95;
/// A candidate direction whose norm falls under this share of its own after projection on the
/// basis so far is already (almost) in it and is dropped.
const DEPENDENT: f32 = 1e-2;
/// Candidates orthogonalised together by [`orthonormal_basis`].
const GS_BLOCK: usize = 64;

/// The realised attention weights of the two head kinds at the last position of a full context
/// (stationary), `a[Δ]` for `Δ = 0..context`.
#[derive(Clone, Debug)]
pub(super) struct Kernels {
    pub self_weights: Vec<f64>,
    pub exp_weights: Vec<f64>,
}

/// Lag-1 correlation of a moving average with weights `a`: `Σ a_Δ·a_{Δ+1} / Σ a_Δ²`.
pub(super) fn lag1(a: &[f64]) -> f64 {
    let s2: f64 = a.iter().map(|x| x * x).sum();
    let s1: f64 = a.windows(2).map(|w| w[0] * w[1]).sum();
    if s2 > 0.0 { s1 / s2 } else { 0.0 }
}

/// Softmax of `scores`.
fn softmax(scores: &[f64]) -> Vec<f64> {
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

/// The constant query and key of one head's RoPE pairs, and how the heads map onto them.
#[derive(Clone, Debug)]
pub(super) struct Heads {
    head_dim: usize,
    /// The layer's RoPE frequencies, one per pair.
    freqs: Vec<f64>,
    /// Pairs of the self head, and its amplitude per pair (score units).
    self_pairs: Vec<usize>,
    self_amp: f64,
    /// The exponential head's pair and amplitude `B` (score `−B·sin(ω_L·Δ)`).
    exp_pair: usize,
    exp_amp: f64,
}

impl Heads {
    /// The self head's pairs and amplitude for `c`, and the exponential head's pair (its amplitude
    /// is set by [`Heads::with_decay`]).
    fn new(c: &ModelConfig) -> Result<Heads> {
        let bad = |reason: String| Error::InvalidArgument {
            arg: "token_correlation",
            reason,
        };
        let (tables, _) = c.rope_tables();
        let freqs: Vec<f64> = tables[0].iter().map(|&f| f64::from(f)).collect();
        let self_pairs: Vec<usize> = (0..freqs.len())
            .filter(|&p| freqs[p] >= SELF_MIN_FREQ)
            .collect();
        let gap1: f64 = self_pairs.iter().map(|&p| 1.0 - freqs[p].cos()).sum();
        let last = (c.context_length.max(2) - 1) as f64;
        let exp_pair = (0..freqs.len())
            .filter(|&p| freqs[p] * last <= std::f64::consts::FRAC_PI_2)
            .max_by(|&a, &b| freqs[a].total_cmp(&freqs[b]))
            .ok_or_else(|| bad("no RoPE pair turns slowly enough over the context".into()))?;
        if self_pairs.is_empty() || self_pairs.contains(&exp_pair) || gap1 <= 0.0 {
            return Err(bad(format!(
                "head_dim {} has too few RoPE pairs for the two planted heads",
                c.head_dim
            )));
        }
        Ok(Heads {
            head_dim: c.head_dim,
            freqs,
            self_pairs,
            self_amp: SELF_MARGIN / gap1,
            exp_pair,
            exp_amp: 0.0,
        })
    }

    /// The exponential head with score slope `lambda` per position.
    fn with_decay(mut self, lambda: f64) -> Heads {
        self.exp_amp = lambda / self.freqs[self.exp_pair];
        self
    }

    /// The self head's score at distance `d` (relative to its own position's).
    fn self_score(&self, d: f64) -> f64 {
        self.self_pairs
            .iter()
            .map(|&p| self.self_amp * ((self.freqs[p] * d).cos() - 1.0))
            .sum()
    }

    /// The exponential head's score at distance `d`.
    fn exp_score(&self, d: f64) -> f64 {
        -self.exp_amp * (self.freqs[self.exp_pair] * d).sin()
    }

    /// Realised weights over a context of `n` positions.
    fn kernels(&self, n: usize) -> Kernels {
        let ds = (0..n).map(|d| d as f64);
        Kernels {
            self_weights: softmax(&ds.clone().map(|d| self.self_score(d)).collect::<Vec<_>>()),
            exp_weights: softmax(&ds.map(|d| self.exp_score(d)).collect::<Vec<_>>()),
        }
    }

    /// The key of a KV head (`head_dim` values): the components that, with [`Self::query`],
    /// give the scores (`q·k/√head_dim`, RoPE applied to both) of the self head, the
    /// exponential head, or both when they share it (GQA).
    fn key(&self, self_head: bool, exp_head: bool) -> Vec<f32> {
        let mut k = vec![0f32; self.head_dim];
        let sq = (self.head_dim as f64).sqrt();
        if self_head {
            for &p in &self.self_pairs {
                k[2 * p] = (self.self_amp * sq).sqrt() as f32;
            }
        }
        if exp_head {
            k[2 * self.exp_pair] = (self.exp_amp * sq).sqrt() as f32;
        }
        k
    }

    /// The query of the self head (`exp == false`) or of the exponential head. After RoPE at
    /// positions `t` and `s`, pair `p` of `(a, b)·(c, 0)` gives `c·(a·cos ωΔ − b·sin ωΔ)`.
    fn query(&self, exp: bool) -> Vec<f32> {
        let mut q = vec![0f32; self.head_dim];
        let sq = (self.head_dim as f64).sqrt();
        if exp {
            q[2 * self.exp_pair + 1] = (self.exp_amp * sq).sqrt() as f32;
        } else {
            for &p in &self.self_pairs {
                q[2 * p] = (self.self_amp * sq).sqrt() as f32;
            }
        }
        q
    }
}

/// What a head does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Idle,
    Own,
    Exp,
}

/// The planted attention of a model with token correlation.
#[derive(Debug)]
pub(super) struct Carry {
    /// Latent lag-1 correlation `ρ` of the token-varying residual stream.
    pub rho: f64,
    /// The planted model's expected carry-over at `ρ` (the target).
    pub planned_carry_over: f64,
    /// Directions transformed per layer.
    pub per_layer: usize,
    /// How many layers transform something.
    pub active_layers: usize,
    pub heads: Heads,
    /// Output gains of the self and exponential heads (residual units per unit of `xn`).
    pub gains: (f64, f64),
    config: ModelConfig,
    /// Orthonormal directions orthogonal to `ĉ`, `(n, d)`, in the order layers transform them.
    basis: Vec<f32>,
    /// Per query head: its role; per KV head: which slot of a layer's block its values hold.
    q_roles: Vec<Role>,
    kv_slot: Vec<Option<usize>>,
    kv_roles: Vec<(bool, bool)>,
}

impl Carry {
    /// The plan for `opts.token_correlation` (a carry-over target; 0: none).
    pub fn new(
        opts: &SynthOptions,
        config: &ModelConfig,
        plant: &Plant,
        c: &[f32],
    ) -> Result<Option<Carry>> {
        let target = f64::from(opts.token_correlation);
        if target == 0.0 {
            return Ok(None);
        }
        let bad = |reason: String| Error::InvalidArgument {
            arg: "token_correlation",
            reason,
        };
        let rho = plant.rho_for_carry_over(target, MAX_RHO).ok_or_else(|| {
            bad(format!(
                "carry-over {target} is outside what this plant can reach: {:.3} (independent \
                     tokens; use 0) to {:.3} (latent correlation {MAX_RHO})",
                plant.carry_over_at(0.0),
                plant.carry_over_at(MAX_RHO)
            ))
        })?;
        let heads = Heads::new(config)?;
        // The decay whose realised weights have lag-1 correlation rho.
        let n = config.context_length;
        let (mut lo, mut hi) = (1e-4f64, 20.0f64);
        for _ in 0..60 {
            let mid = (lo * hi).sqrt();
            if lag1(&heads.clone().with_decay(mid).kernels(n).exp_weights) > rho {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let heads = heads.with_decay((lo * hi).sqrt());
        let kernels = heads.kernels(n);
        let a0 = kernels.self_weights[0];
        let norm = kernels
            .exp_weights
            .iter()
            .map(|x| x * x)
            .sum::<f64>()
            .sqrt();
        let gains = (-1.0 / a0, 1.0 / norm);

        // Head layout.
        let (nh, nkv, hd) = (config.n_heads, config.n_kv_heads, config.head_dim);
        let group = nh / nkv;
        let mut q_roles = vec![Role::Idle; nh];
        let mut kv_slot = vec![None; nkv];
        let mut kv_roles = vec![(false, false); nkv];
        if group >= 2 {
            for j in 0..nkv {
                q_roles[j * group] = Role::Own;
                q_roles[j * group + 1] = Role::Exp;
                kv_slot[j] = Some(j);
                kv_roles[j] = (true, true);
            }
        } else {
            for j in 0..nkv / 2 {
                q_roles[2 * j] = Role::Own;
                q_roles[2 * j + 1] = Role::Exp;
                kv_slot[2 * j] = Some(j);
                kv_slot[2 * j + 1] = Some(j);
                kv_roles[2 * j] = (true, false);
                kv_roles[2 * j + 1] = (false, true);
            }
        }
        let per_layer = kv_slot.iter().flatten().max().map_or(0, |m| m + 1) * hd;
        let r = opts.rank;
        if per_layer < r - 1 {
            return Err(bad(format!(
                "a layer's attention can transform {per_layer} directions, fewer than the {} \
                 planted ones (lower --rank)",
                r - 1
            )));
        }
        let d = config.d_model;
        let want = (d - 1).min(per_layer * config.n_layers);
        let candidates = (0..config.n_layers)
            .flat_map(|l| {
                let dirs = directions(opts.seed, l, r, c);
                (1..r)
                    .map(|j| dirs[j * d..(j + 1) * d].to_vec())
                    .collect::<Vec<_>>()
            })
            .chain((0u64..).map(|k| {
                let mut rng = Rng::new(opts.seed, TAG_FILL, k, 0);
                (0..d).map(|_| rng.flat()).collect::<Vec<f32>>()
            }));
        let basis = orthonormal_basis(c, candidates, want);
        let active_layers = basis.len().div_ceil(d * per_layer);
        Ok(Some(Carry {
            rho,
            planned_carry_over: plant.carry_over_at(rho),
            per_layer,
            active_layers,
            heads,
            gains,
            config: config.clone(),
            basis,
            q_roles,
            kv_slot,
            kv_roles,
        }))
    }

    /// The extra resident tensors (`(name, length)`, f32 vectors): every layer's Q and K biases.
    pub fn bias_tensors(&self) -> Vec<(String, usize)> {
        let c = &self.config;
        (0..c.n_layers)
            .flat_map(|l| {
                [
                    (format!("blk.{l}.attn_q.bias"), c.q_dim()),
                    (format!("blk.{l}.attn_k.bias"), c.kv_dim()),
                ]
            })
            .collect()
    }

    /// Basis direction `i` of the block layer `l` transforms, if any.
    fn direction(&self, l: usize, i: usize) -> Option<&[f32]> {
        let d = self.config.d_model;
        let b = l * self.per_layer + i;
        self.basis.get(b * d..(b + 1) * d)
    }

    /// The bytes of resident tensor `name` (`rows × cols` of `dtype`) when this plan sets it:
    /// the attention weights and biases. `None` for every other tensor.
    pub fn tensor(&self, name: &str, dtype: DType, rows: usize, cols: usize) -> Option<Vec<u8>> {
        let rest = name.strip_prefix("blk.")?;
        let (l, what) = rest.split_once('.')?;
        let l: usize = l.parse().ok()?;
        let hd = self.config.head_dim;
        let f32s = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        match what {
            "attn_q.bias" => Some(f32s(
                self.q_roles
                    .iter()
                    .flat_map(|r| match r {
                        Role::Idle => vec![0.0; hd],
                        Role::Own => self.heads.query(false),
                        Role::Exp => self.heads.query(true),
                    })
                    .collect(),
            )),
            "attn_k.bias" => Some(f32s(
                self.kv_roles
                    .iter()
                    .flat_map(|&(s, e)| self.heads.key(s, e))
                    .collect(),
            )),
            "attn_q.weight" | "attn_k.weight" => Some(matrix(dtype, rows, cols, |_, _| {})),
            "attn_v.weight" => Some(matrix(dtype, rows, cols, |row, out| {
                let (j, i) = (row / hd, row % hd);
                if let Some(dir) = self.kv_slot[j].and_then(|s| self.direction(l, s * hd + i)) {
                    out.copy_from_slice(dir);
                }
            })),
            "attn_output.weight" => {
                let group = self.config.n_heads / self.config.n_kv_heads;
                // Per column (query head h, value i): the direction it writes and its gain.
                let cols_dir: Vec<Option<(&[f32], f32)>> = (0..self.config.q_dim())
                    .map(|col| {
                        let (h, i) = (col / hd, col % hd);
                        let gain = match self.q_roles[h] {
                            Role::Idle => return None,
                            Role::Own => self.gains.0,
                            Role::Exp => self.gains.1,
                        };
                        let slot = self.kv_slot[h / group]?;
                        Some((self.direction(l, slot * hd + i)?, gain as f32))
                    })
                    .collect();
                Some(matrix(dtype, rows, cols, |r, out| {
                    for (o, cd) in out.iter_mut().zip(&cols_dir) {
                        if let Some((dir, gain)) = cd {
                            *o = gain * dir[r];
                        }
                    }
                }))
            }
            _ => None,
        }
    }
}

/// A `rows × cols` matrix of `dtype`, row `r` filled by `fill(r, row)` (zeros unless it writes).
fn matrix(
    dtype: DType,
    rows: usize,
    cols: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).expect("shape checked: whole blocks");
    let mut out = vec![0u8; rows * rb];
    out.par_chunks_mut(rb).enumerate().for_each_init(
        || (vec![0f32; cols], Vec::with_capacity(rb)),
        |(row, bytes), (r, dst)| {
            row.fill(0.0);
            fill(r, row);
            bytes.clear();
            quantize_row(dtype, row, bytes);
            dst.copy_from_slice(bytes);
        },
    );
    out
}

/// Up to `max` orthonormal directions orthogonal to the unit vector `c`, from `candidates` in
/// order (block classical Gram–Schmidt, twice: blocks of [`GS_BLOCK`] candidates against the basis
/// so far as matrix products, then one by one within the block; a candidate already in the span
/// is dropped), flat `(n, d)`. Single-threaded products (`matrixmultiply`), so the result depends
/// on the seed only. About 2·d³ operations: ~20 s for d = 4096 on two busy cores.
fn orthonormal_basis(
    c: &[f32],
    mut candidates: impl Iterator<Item = Vec<f32>>,
    max: usize,
) -> Vec<f32> {
    let d = c.len();
    let cap = max + 1;
    // Column 0 is `c`; columns 1..k the basis so far.
    let mut q = DMatrix::<f32>::zeros(d, cap);
    q.column_mut(0).copy_from_slice(c);
    let mut k = 1;
    while k < cap {
        let block: Vec<Vec<f32>> = candidates.by_ref().take(GS_BLOCK).collect();
        if block.is_empty() {
            break;
        }
        let mut m = DMatrix::from_fn(d, block.len(), |i, j| block[j][i]);
        let norms: Vec<f32> = m.column_iter().map(|v| v.norm()).collect();
        for _ in 0..2 {
            let basis = q.columns(0, k);
            let coef = basis.transpose() * &m;
            m -= basis * coef;
        }
        let k0 = k;
        for (j, &n0) in norms.iter().enumerate() {
            if k >= cap {
                break;
            }
            let mut v = m.column(j).clone_owned();
            for _ in 0..2 {
                let own = q.columns(k0, k - k0);
                let coef = own.transpose() * &v;
                v -= own * coef;
            }
            let n = v.norm();
            if n > DEPENDENT * n0 {
                q.column_mut(k).copy_from(&(v / n));
                k += 1;
            }
        }
    }
    q.columns(1, k - 1).iter().copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lsm::synth::SynthShape;

    #[test]
    fn the_heads_realise_a_self_kernel_and_an_exponential_one() {
        for shape in SynthShape::ALL {
            let c = shape.config();
            let heads = Heads::new(&c).unwrap().with_decay(0.2);
            let k = heads.kernels(c.context_length);
            assert!(
                k.self_weights[0] > 1.0 - 1e-4,
                "{}: {}",
                shape.name,
                k.self_weights[0]
            );
            // Near the query the exponential head's weights fall by e^-0.2 per position.
            let r = k.exp_weights[6] / k.exp_weights[5];
            assert!((r - (-0.2f64).exp()).abs() < 1e-3, "{}: {r}", shape.name);
            assert!((lag1(&k.exp_weights) - (-0.2f64).exp()).abs() < 1e-3);
            // Scores through the planted query and key (RoPE at two positions) are the kernel's.
            let (q_s, q_e, key) = (heads.query(false), heads.query(true), heads.key(true, true));
            let score = |q: &[f32], t: usize, s: usize| {
                let rot = |v: &[f32], pos: usize| {
                    let mut v = v.to_vec();
                    for (p, f) in heads.freqs.iter().enumerate() {
                        let (sn, cs) = (pos as f64 * f).sin_cos();
                        let (a, b) = (f64::from(v[2 * p]), f64::from(v[2 * p + 1]));
                        v[2 * p] = (a * cs - b * sn) as f32;
                        v[2 * p + 1] = (a * sn + b * cs) as f32;
                    }
                    v
                };
                let (q, k) = (rot(q, t), rot(&key, s));
                q.iter().zip(&k).map(|(a, b)| f64::from(a * b)).sum::<f64>()
                    / (heads.head_dim as f64).sqrt()
            };
            for (t, s) in [(10, 10), (10, 3), (200, 100)] {
                let d = (t - s) as f64;
                let (self0, exp0) = (score(&q_s, t, t), score(&q_e, t, t));
                assert!((score(&q_s, t, s) - self0 - heads.self_score(d)).abs() < 1e-2);
                assert!((score(&q_e, t, s) - exp0 - heads.exp_score(d)).abs() < 1e-2);
            }
        }
    }

    #[test]
    fn the_basis_is_orthonormal_orthogonal_to_c_and_keeps_the_candidates_order() {
        let d = 64;
        let mut rng = Rng::new(1, 2, 3, 4);
        let c = super::super::weights::unit((0..d).map(|_| rng.flat()).collect());
        let cands: Vec<Vec<f32>> = (0..80)
            .map(|_| (0..d).map(|_| rng.flat()).collect())
            .collect();
        let b = orthonormal_basis(&c, cands.clone().into_iter(), 63);
        assert_eq!(b.len(), 63 * d);
        for i in 0..63 {
            let bi = &b[i * d..(i + 1) * d];
            let dc: f32 = bi.iter().zip(&c).map(|(x, y)| x * y).sum();
            assert!(dc.abs() < 1e-4);
            for j in 0..=i {
                let bj = &b[j * d..(j + 1) * d];
                let dd: f32 = bi.iter().zip(bj).map(|(x, y)| x * y).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((dd - want).abs() < 1e-4, "{i} {j} {dd}");
            }
        }
        // The first candidate's direction (less its c part) is the first basis vector.
        let mut v = cands[0].clone();
        let p: f32 = v.iter().zip(&c).map(|(x, y)| x * y).sum();
        v.iter_mut().zip(&c).for_each(|(x, y)| *x -= p * y);
        let v = super::super::weights::unit(v);
        let cos: f32 = v.iter().zip(&b[..d]).map(|(x, y)| x * y).sum();
        assert!(cos > 0.9999);
    }
}
