//! The low-rank predictor: a truncated SVD of each layer's gate matrix.
//!
//! With `W_gate = U S Vᵀ` (`n_ff × d`), the rank-`r` approximation of the gate pre-activation is
//! `g̃ = (U_r S_r) (V_rᵀ xn)`: `r·d + n_ff·r` multiply-adds instead of `n_ff·d`. The score of
//! neuron `i` is `|act(g̃_i)| · mean|u_i|`, the predicted `|h_i|` with the up projection replaced
//! by its calibrated mean magnitude (the up row is not approximated, which halves the tables; a
//! neuron's `|u|` varies far less across tokens than `act(g)` does).
//!
//! Tables are stored as f16: `V_rᵀ` (`r × d`), `U_r S_r` (`n_ff × r`), and `mean|u|` as f32.
//! The SVD comes from the symmetric eigendecomposition of `W_gateᵀ W_gate` (`d × d`, nalgebra),
//! which is much cheaper than a full SVD of the `n_ff × d` matrix and gives the same `V` and `S²`.

use nalgebra::{DMatrix, SymmetricEigen};

use super::{PredictScratch, Predictor, PredictorKind};
use crate::backend::cpu::Kernels;
use crate::model::lsm::{CalDType, CalTensor, CalibrationData, PredictorMeta};
use crate::model::{FfnActivation, QRows};
use crate::quant::DType;
use crate::{Error, Result};

/// Training settings of [`LowRank`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowRankParams {
    /// Rank of the gate factorisation. Default 48 (see the calibrate module docs for the
    /// measurement behind it).
    pub rank: usize,
}

impl Default for LowRankParams {
    fn default() -> Self {
        LowRankParams { rank: 48 }
    }
}

/// The right singular vectors of one gate matrix, largest singular value first.
#[derive(Debug)]
pub(crate) struct GateSvd {
    /// `d × d`, row `j` is the `j`-th right singular vector.
    pub directions: Vec<f32>,
    /// The dequantised gate matrix, `n_ff × d` row-major.
    pub gate: DMatrix<f32>,
}

/// SVD of a gate matrix via the eigendecomposition of `Wᵀ W`.
pub(crate) fn gate_svd(gate: &QRows) -> GateSvd {
    let (n, d) = (gate.rows, gate.cols);
    let mut row = vec![0f32; d];
    let mut w = DMatrix::<f32>::zeros(n, d);
    for i in 0..n {
        gate.dequantize_row(i, &mut row);
        for (j, &v) in row.iter().enumerate() {
            w[(i, j)] = v;
        }
    }
    let gram = w.transpose() * &w;
    let eig = SymmetricEigen::new(gram.map(f64::from));
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
    let mut directions = Vec::with_capacity(d * d);
    for &j in &order {
        directions.extend(eig.eigenvectors.column(j).iter().map(|&v| v as f32));
    }
    GateSvd {
        directions,
        gate: w,
    }
}

#[derive(Debug)]
struct Layer {
    v: Vec<u8>,           // (rank, d_model) f16, rows are right singular vectors
    us: Vec<u8>,          // (n_ff, rank) f16, U_r S_r
    mean_abs_u: Vec<f32>, // (n_ff)
}

/// Truncated-SVD gate predictor for every layer.
#[derive(Debug)]
pub struct LowRank {
    rank: usize,
    d_model: usize,
    n_ff: usize,
    activation: FfnActivation,
    layers: Vec<Layer>,
}

fn f16_bytes(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(|x| half::f16::from_f32(x).to_le_bytes())
        .collect()
}

impl LowRank {
    /// An empty predictor to which [`LowRank::push_layer`] adds layers in order.
    pub fn new(rank: usize, d_model: usize, n_ff: usize, activation: FfnActivation) -> LowRank {
        LowRank {
            rank: rank.clamp(1, d_model),
            d_model,
            n_ff,
            activation,
            layers: Vec::new(),
        }
    }

    /// Fits the next layer from its gate SVD and the calibrated per-neuron `mean|u|`.
    pub(crate) fn push_layer(&mut self, svd: &GateSvd, mean_abs_u: &[f32]) {
        let (r, d) = (self.rank, self.d_model);
        let v_r = DMatrix::<f32>::from_row_slice(r, d, &svd.directions[..r * d]);
        let us = &svd.gate * v_r.transpose(); // (n_ff, r)
        self.layers.push(Layer {
            v: f16_bytes(svd.directions[..r * d].iter().copied()),
            us: f16_bytes(
                (0..self.n_ff)
                    .flat_map(|i| (0..r).map(move |j| (i, j)))
                    .map(|(i, j)| us[(i, j)]),
            ),
            mean_abs_u: mean_abs_u.to_vec(),
        });
    }

    /// Its tables as calibration tensors (`lowrank.{l}.v`, `.us`, `.mean_abs_u`).
    pub fn tensors(&self) -> Vec<CalTensor> {
        let (r, d, n) = (self.rank, self.d_model, self.n_ff);
        let mut out = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let name = |s: &str| format!("lowrank.{l}.{s}");
            let f16 = |b: &[u8]| -> Vec<f32> {
                b.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect()
            };
            out.push(CalTensor::f16(
                name("v"),
                Some(l),
                vec![r, d],
                &f16(&layer.v),
            ));
            out.push(
                CalTensor::f16(name("us"), Some(l), vec![n, r], &f16(&layer.us)).neuron_major(),
            );
            out.push(
                CalTensor::f32(name("mean_abs_u"), Some(l), vec![n], &layer.mean_abs_u)
                    .neuron_major(),
            );
        }
        out
    }

    /// Loads the tables written by [`LowRank::tensors`].
    pub fn load(cal: &CalibrationData, meta: &PredictorMeta) -> Result<LowRank> {
        let c = &cal.config;
        let (r, d, n) = (meta.rank, c.d_model, c.n_ff);
        if r == 0 || r > d {
            return Err(Error::invalid_file(
                &cal.path,
                format!("low-rank predictor rank {r} is outside 1..={d}"),
            ));
        }
        let mut p = LowRank::new(r, d, n, c.activation);
        for l in 0..c.n_layers {
            let name = |s: &str| format!("lowrank.{l}.{s}");
            p.layers.push(Layer {
                v: cal
                    .tensor(&name("v"), CalDType::F16, &[r, d])?
                    .data
                    .as_slice()
                    .to_vec(),
                us: cal
                    .tensor(&name("us"), CalDType::F16, &[n, r])?
                    .data
                    .as_slice()
                    .to_vec(),
                mean_abs_u: cal
                    .tensor(&name("mean_abs_u"), CalDType::F32, &[n])?
                    .to_f32(),
            });
        }
        Ok(p)
    }

    /// Rank of the factorisation.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl Predictor for LowRank {
    fn kind(&self) -> PredictorKind {
        PredictorKind::LowRank
    }

    fn score(&self, l: usize, xn: &[f32], scratch: &mut PredictScratch, out: &mut [f32]) {
        let layer = &self.layers[l];
        assert_eq!(xn.len(), self.d_model, "xn length");
        assert_eq!(out.len(), self.n_ff, "score length");
        let k = Kernels::best();
        let (vb, ub) = (2 * self.d_model, 2 * self.rank);
        let t = &mut scratch.f[..self.rank];
        for (j, tj) in t.iter_mut().enumerate() {
            *tj = k.dot(DType::F16, &layer.v[j * vb..(j + 1) * vb], xn);
        }
        for (i, o) in out.iter_mut().enumerate() {
            let g = k.dot(DType::F16, &layer.us[i * ub..(i + 1) * ub], t);
            *o = self.activation.apply(g).abs() * layer.mean_abs_u[i];
        }
    }

    fn scratch(&self) -> PredictScratch {
        PredictScratch::new(self.rank, 0)
    }

    fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.v.len() + l.us.len() + 4 * l.mean_abs_u.len())
            .sum()
    }
}
