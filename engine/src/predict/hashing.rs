//! The hashing predictor: learned sign-bit hashes of `xn` with per-neuron weights over the bits,
//! in additive stages.
//!
//! Stage `s` of layer `l` hashes the layer input into `b` bits,
//! `bit_k = sign(p_k · xn − o_k)`, where the projections `p_k` are the input directions
//! `s·b .. (s+1)·b` of the gate's data-aware SVD (the directions that move the gate
//! pre-activations most on calibration inputs, as in the low-rank predictor) and each offset `o_k` is the median of `p_k · xn` over the calibration tokens, so that
//! every bit splits the calibration data in half (a balanced, maximum-entropy hash). Each neuron
//! then has `b + 1` learned weights over the bits (the last one a bias), fitted in closed form by
//! ridge regression of its activity indicator ([`crate::sparsity::is_active`]) on the ±1 bits; stage `s + 1`
//! is fitted on what stages `0..=s` left unexplained. The score of a neuron is the sum over stages
//! of `scale_i · Σ_k w_ik · bit_k`, with the weights stored as i8 and one f32 scale per neuron
//! and stage.
//!
//! Relation to the LeanStream paper (arXiv 2609.03079): its controller maps the hidden state through
//! stacked learnable hash functions to neuron scores, cheap in memory and time next to an MLP
//! predictor. This is that idea in its simplest closed-form version: the hash functions are
//! learned from the data (projections from the gate's data-aware SVD, offsets from the calibration
//! distribution), the per-neuron weights are learned by regression, and stages are stacked
//! additively (boosting-style) rather than trained end to end by gradient descent. Scoring costs
//! `stages · b · d` multiply-adds for the hashes plus `stages · n_ff · (b + 1)` i8 additions, and
//! the tables are i8 instead of the low-rank predictor's f16.

use nalgebra::DMatrix;

use super::lowrank::GateSvd;
use super::{PredictScratch, Predictor};
use crate::backend::cpu::Kernels;
use crate::model::lsm::{CalDType, CalTensor, CalibrationData, PredictorKind, PredictorMeta};
use crate::quant::DType;
use crate::{Error, Result};

/// Training settings of [`Hashing`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HashingParams {
    /// Sign bits per stage. Default 32.
    pub bits: usize,
    /// Additive stages. Default 2.
    pub stages: usize,
    /// Ridge penalty, relative to the number of calibration tokens. Default 1e-3.
    pub ridge: f32,
}

impl Default for HashingParams {
    fn default() -> Self {
        HashingParams {
            bits: 32,
            stages: 2,
            ridge: 1e-3,
        }
    }
}

#[derive(Debug)]
struct Stage {
    proj: Vec<u8>,    // (bits, d_model) f16, hash directions
    offset: Vec<f32>, // (bits)
    w: Vec<i8>,       // (n_ff, bits + 1), last column the bias
    scale: Vec<f32>,  // (n_ff)
}

/// Stacked sign-bit hashing predictor for every layer.
#[derive(Debug)]
pub struct Hashing {
    bits: usize,
    stages: usize,
    d_model: usize,
    n_ff: usize,
    layers: Vec<Vec<Stage>>,
}

fn median(mut v: Vec<f32>) -> f32 {
    if v.is_empty() {
        return 0.0;
    }
    let mid = v.len() / 2;
    *v.select_nth_unstable_by(mid, f32::total_cmp).1
}

impl Hashing {
    /// An empty predictor to which [`Hashing::push_layer`] adds layers in order. `bits · stages`
    /// is capped at `d_model`.
    pub fn new(p: HashingParams, d_model: usize, n_ff: usize) -> Hashing {
        let bits = p.bits.clamp(1, d_model);
        Hashing {
            bits,
            stages: p.stages.clamp(1, d_model / bits),
            d_model,
            n_ff,
            layers: Vec::new(),
        }
    }

    /// Fits the next layer. `xs` holds the calibration inputs (`n_tokens × d_model`, token-major)
    /// and `active` the targets (`n_tokens × n_ff`, 1 where the neuron was active, else 0).
    pub(crate) fn push_layer(
        &mut self,
        svd: &GateSvd,
        xs: &DMatrix<f32>,
        active: &DMatrix<f32>,
        ridge: f32,
    ) {
        let (b, d, n) = (self.bits, self.d_model, xs.nrows());
        let mut residual = active.clone();
        let mut stages = Vec::with_capacity(self.stages);
        for s in 0..self.stages {
            let dirs = &svd.directions[s * b * d..(s + 1) * b * d];
            let p = DMatrix::<f32>::from_row_slice(b, d, dirs);
            let z = xs * p.transpose(); // (n, b)
            let offset: Vec<f32> = (0..b)
                .map(|k| median(z.column(k).iter().copied().collect()))
                .collect();
            let f = DMatrix::<f32>::from_fn(n, b + 1, |t, k| {
                if k == b || z[(t, k)] >= offset[k] {
                    1.0
                } else {
                    -1.0
                }
            });
            let ft = f.transpose();
            let mut a = (&ft * &f).map(f64::from);
            for k in 0..=b {
                a[(k, k)] += f64::from(ridge) * n as f64;
            }
            let rhs = (&ft * &residual).map(f64::from); // (b + 1, n_ff)
            let w = match a.cholesky() {
                Some(ch) => ch.solve(&rhs),
                None => DMatrix::zeros(b + 1, self.n_ff), // unreachable with ridge > 0
            };
            let mut wq = vec![0i8; self.n_ff * (b + 1)];
            let mut scale = vec![0f32; self.n_ff];
            let mut deq = DMatrix::<f32>::zeros(b + 1, self.n_ff);
            for i in 0..self.n_ff {
                let col = w.column(i);
                let max = col.iter().fold(0f64, |m, v| m.max(v.abs()));
                let sc = if max > 0.0 { max / 127.0 } else { 1.0 };
                scale[i] = sc as f32;
                for k in 0..=b {
                    let q = (col[k] / sc).round().clamp(-127.0, 127.0) as i8;
                    wq[i * (b + 1) + k] = q;
                    deq[(k, i)] = f32::from(q) * sc as f32;
                }
            }
            residual -= &f * deq;
            stages.push(Stage {
                proj: dirs
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect(),
                offset,
                w: wq,
                scale,
            });
        }
        self.layers.push(stages);
    }

    /// Its tables as calibration tensors (`hashing.{l}.{s}.proj`, `.offset`, `.w`, `.scale`).
    pub fn tensors(&self) -> Vec<CalTensor> {
        let (b, d, n) = (self.bits, self.d_model, self.n_ff);
        let mut out = Vec::new();
        for (l, stages) in self.layers.iter().enumerate() {
            for (s, st) in stages.iter().enumerate() {
                let name = |x: &str| format!("hashing.{l}.{s}.{x}");
                let proj: Vec<f32> = st
                    .proj
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
                out.push(CalTensor::f16(name("proj"), Some(l), vec![b, d], &proj));
                out.push(CalTensor::f32(name("offset"), Some(l), vec![b], &st.offset));
                out.push(CalTensor::i8(name("w"), Some(l), vec![n, b + 1], &st.w).neuron_major());
                out.push(CalTensor::f32(name("scale"), Some(l), vec![n], &st.scale).neuron_major());
            }
        }
        out
    }

    /// Loads the tables written by [`Hashing::tensors`].
    pub fn load(cal: &CalibrationData, meta: &PredictorMeta) -> Result<Hashing> {
        let c = &cal.config;
        let (b, d, n) = (meta.bits, c.d_model, c.n_ff);
        if b == 0 || meta.stages == 0 || b.saturating_mul(meta.stages) > d {
            return Err(Error::invalid_file(
                &cal.path,
                format!(
                    "hashing predictor with {} stages of {b} bits does not fit d_model {d}",
                    meta.stages
                ),
            ));
        }
        let mut p = Hashing::new(
            HashingParams {
                bits: b,
                stages: meta.stages,
                ridge: 0.0,
            },
            d,
            n,
        );
        for l in 0..c.n_layers {
            let mut stages = Vec::with_capacity(meta.stages);
            for s in 0..meta.stages {
                let name = |x: &str| format!("hashing.{l}.{s}.{x}");
                stages.push(Stage {
                    proj: cal
                        .tensor(&name("proj"), CalDType::F16, &[b, d])?
                        .data
                        .as_slice()
                        .to_vec(),
                    offset: cal.tensor(&name("offset"), CalDType::F32, &[b])?.to_f32(),
                    w: cal
                        .tensor(&name("w"), CalDType::I8, &[n, b + 1])?
                        .data
                        .as_slice()
                        .iter()
                        .map(|&x| x as i8)
                        .collect(),
                    scale: cal.tensor(&name("scale"), CalDType::F32, &[n])?.to_f32(),
                });
            }
            p.layers.push(stages);
        }
        Ok(p)
    }

    /// Bits per stage and number of stages.
    pub fn shape(&self) -> (usize, usize) {
        (self.bits, self.stages)
    }
}

impl Predictor for Hashing {
    fn kind(&self) -> PredictorKind {
        PredictorKind::Hashing
    }

    fn score(&self, l: usize, xn: &[f32], scratch: &mut PredictScratch, out: &mut [f32]) {
        assert_eq!(xn.len(), self.d_model, "xn length");
        assert_eq!(out.len(), self.n_ff, "score length");
        let k = Kernels::best();
        let (b, rb) = (self.bits, 2 * self.d_model);
        out.fill(0.0);
        for st in &self.layers[l] {
            let bits = &mut scratch.b[..b + 1];
            for (j, bit) in bits[..b].iter_mut().enumerate() {
                let z = k.dot(DType::F16, &st.proj[j * rb..(j + 1) * rb], xn);
                *bit = if z >= st.offset[j] { 1 } else { -1 };
            }
            bits[b] = 1;
            let bits = &*bits;
            for ((o, w), &sc) in out.iter_mut().zip(st.w.chunks_exact(b + 1)).zip(&st.scale) {
                let acc: i32 = w
                    .iter()
                    .zip(bits)
                    .map(|(&w, &x)| i32::from(w) * i32::from(x))
                    .sum();
                *o += sc * acc as f32;
            }
        }
    }

    fn scratch(&self) -> PredictScratch {
        PredictScratch::new(0, self.bits + 1)
    }

    fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|s| s.proj.len() + 4 * s.offset.len() + s.w.len() + 4 * s.scale.len())
            .sum()
    }
}
