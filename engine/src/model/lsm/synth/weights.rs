//! The weights of a synthetic model: the resident tensors row by row, and each FFN neuron's
//! bundle (gate row | up row | down column) with what the calibration section needs from it.
//! See the parent module for the construction.

use rayon::prelude::*;

use super::SynthOptions;
use super::plant::{Plant, Rng};
use crate::model::ModelConfig;
use crate::quant::{DType, dequantize_row, quantize_row};

/// Share of the token embedding's energy along the common direction `ĉ` is `COS_THETA²`.
pub(super) const COS_THETA: f64 = 0.6;
pub(super) const SIN_THETA: f64 = 0.8;
/// RMS of one attention output relative to the residual stream.
pub(super) const ATTN_OUT: f64 = 0.03;
/// RMS of one FFN output relative to the residual stream.
pub(super) const FFN_OUT: f64 = 0.02;
/// Spread of `|up·x|` around 1.
pub(super) const UP_SPREAD: f64 = 0.05;

/// RNG stream tags.
pub(super) const TAG_DIR: u64 = 1;
pub(super) const TAG_ROWS: u64 = 2;
pub(super) const TAG_BETA: u64 = 3;
pub(super) const TAG_BASIS: u64 = 4;
pub(super) const TAG_NEURON: u64 = 5;
pub(super) const TAG_SIM: u64 = 6;

/// The per-model random directions.
pub(super) struct Basis {
    /// `ĉ`, unit length.
    pub c: Vec<f32>,
}

pub(super) fn unit(mut v: Vec<f32>) -> Vec<f32> {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-30);
    v.iter_mut().for_each(|x| *x /= n);
    v
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Removes `v`'s component along the unit vector `c`.
fn orthogonalise(v: &mut [f32], c: &[f32]) {
    let p = dot(v, c);
    v.iter_mut().zip(c).for_each(|(x, y)| *x -= p * y);
}

/// Seeded noise of unit RMS with no component along `c`, scaled to length `len`.
fn noise_dir(rng: &mut Rng, c: &[f32], len: f32, out: &mut [f32]) {
    out.iter_mut().for_each(|x| *x = rng.flat());
    orthogonalise(out, c);
    let n = out.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-30);
    out.iter_mut().for_each(|x| *x *= len / n);
}

/// A resident tensor: what its rows are.
pub(super) enum RowKind {
    /// `cos θ·√d·ĉ + sin θ·noise`.
    Embedding,
    /// Noise of RMS `scale`, orthogonal to `ĉ`.
    Output(f32),
    /// Noise of RMS `scale`.
    Noise(f32),
    /// All ones (norm weights, f32).
    Ones,
}

/// Every resident tensor of a model: `(name, type, shape, rows)`. Matrices are stored as
/// `matrix_dtype`, norm vectors as f32 ones.
pub(super) fn resident_tensors(
    c: &ModelConfig,
    matrix_dtype: DType,
) -> Vec<(String, DType, Vec<usize>, RowKind)> {
    let (d, q, kv, wd) = (c.d_model, c.q_dim(), c.kv_dim(), matrix_dtype);
    let scale = 1.0 / (d as f32).sqrt();
    let wo = (ATTN_OUT / (q as f64).sqrt()) as f32;
    let mut out: Vec<(String, DType, Vec<usize>, RowKind)> = vec![
        (
            "token_embd.weight".into(),
            wd,
            vec![c.vocab_size, d],
            RowKind::Embedding,
        ),
        (
            "output_norm.weight".into(),
            DType::F32,
            vec![d],
            RowKind::Ones,
        ),
        (
            "output.weight".into(),
            wd,
            vec![c.vocab_size, d],
            RowKind::Output(scale),
        ),
    ];
    for l in 0..c.n_layers {
        let n = |s: &str| format!("blk.{l}.{s}");
        out.extend([
            (n("attn_norm.weight"), DType::F32, vec![d], RowKind::Ones),
            (n("attn_q.weight"), wd, vec![q, d], RowKind::Noise(scale)),
            (n("attn_k.weight"), wd, vec![kv, d], RowKind::Noise(scale)),
            (n("attn_v.weight"), wd, vec![kv, d], RowKind::Noise(scale)),
            (n("attn_output.weight"), wd, vec![d, q], RowKind::Noise(wo)),
            (n("ffn_norm.weight"), DType::F32, vec![d], RowKind::Ones),
        ]);
    }
    out
}

/// Generates a whole resident tensor, rows in parallel.
pub(super) fn resident_tensor(
    seed: u64,
    id: u64,
    kind: &RowKind,
    dtype: DType,
    rows: usize,
    cols: usize,
    basis: &Basis,
) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).expect("shape checked: whole blocks");
    let mut out = vec![0u8; rows * rb];
    let sqrt_d = (cols as f32).sqrt();
    out.par_chunks_mut(rb).enumerate().for_each_init(
        || (vec![0f32; cols], Vec::with_capacity(rb)),
        |(row, bytes), (r, dst)| {
            let mut rng = Rng::new(seed, TAG_ROWS, id, r as u64);
            match kind {
                RowKind::Embedding => {
                    for (x, c) in row.iter_mut().zip(&basis.c) {
                        *x = COS_THETA as f32 * sqrt_d * c + SIN_THETA as f32 * rng.flat();
                    }
                }
                RowKind::Output(scale) => {
                    row.iter_mut().for_each(|x| *x = scale * rng.flat());
                    orthogonalise(row, &basis.c);
                }
                RowKind::Noise(scale) => row.iter_mut().for_each(|x| *x = scale * rng.flat()),
                RowKind::Ones => row.fill(1.0),
            }
            bytes.clear();
            quantize_row(dtype, row, bytes);
            dst.copy_from_slice(bytes);
        },
    );
    out
}

/// What generating one neuron leaves besides its bundle.
#[derive(Clone, Debug, Default)]
pub(super) struct NeuronOut {
    /// Projections of the stored gate row on the layer's planted directions (`rank` values).
    pub us: Vec<f32>,
    /// Stored gate row · (the constant part of the layer input): the neuron's actual bias.
    pub bias: f64,
    /// Stored up row · (the constant part of the layer input), absolute.
    pub mean_abs_u: f32,
    /// Squared norm of the gate row's rounding error outside `ĉ`.
    pub round_err2: f64,
}

/// One layer's fixed parts.
pub(super) struct LayerPlan<'a> {
    pub opts: &'a SynthOptions,
    pub basis: &'a Basis,
    pub layer: usize,
    /// `(rank, d)`: row 0 is `ĉ`, the rest random orthonormal directions.
    pub directions: Vec<f32>,
    /// Per stored neuron: planted `tau + sigma * beta`.
    pub bias: Vec<f64>,
    pub plant: Plant,
    /// RMS of a down column's values.
    pub down_scale: f32,
}

impl LayerPlan<'_> {
    /// Writes neuron `i`'s bundle (gate row | up row | down column) into `dst`.
    pub fn neuron(
        &self,
        i: usize,
        dst: &mut [u8],
        row: &mut [f32],
        bytes: &mut Vec<u8>,
    ) -> NeuronOut {
        let o = self.opts;
        let d = o.shape.d_model;
        let (r, sqrt_d) = (o.rank, (d as f64).sqrt());
        let c = &self.basis.c;
        let mut rng = Rng::new(o.seed, TAG_NEURON, self.layer as u64, i as u64);
        let sigma = self.plant.sigma;

        // Gate: bias along ĉ, planted token-varying part in the other directions, noise.
        noise_dir(
            &mut rng,
            c,
            (o.noise as f64 * sigma / SIN_THETA) as f32,
            row,
        );
        let along_c = (self.bias[i] / (COS_THETA * sqrt_d)) as f32;
        row.iter_mut().zip(c).for_each(|(x, c)| *x += along_c * c);
        let mut w: Vec<f32> = (0..r - 1).map(|_| rng.flat()).collect();
        let wn = w.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-30);
        w.iter_mut()
            .for_each(|x| *x *= (sigma / SIN_THETA) as f32 / wn);
        for (j, wj) in w.iter().enumerate() {
            let v = &self.directions[(j + 1) * d..(j + 2) * d];
            row.iter_mut().zip(v).for_each(|(x, v)| *x += wj * v);
        }
        let source = row.to_vec();
        bytes.clear();
        quantize_row(o.weight_dtype, row, bytes);
        let g_len = bytes.len();
        dequantize_row(o.weight_dtype, bytes, row);
        let us: Vec<f32> = (0..r)
            .map(|j| dot(&self.directions[j * d..(j + 1) * d], row))
            .collect();
        let bias = f64::from(dot(row, c)) * COS_THETA * sqrt_d;
        let mut err: Vec<f32> = row.iter().zip(&source).map(|(a, b)| a - b).collect();
        orthogonalise(&mut err, c);
        let round_err2 = f64::from(dot(&err, &err));

        // Up: ±1 along ĉ, small spread elsewhere.
        noise_dir(&mut rng, c, (UP_SPREAD / SIN_THETA) as f32, row);
        let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        let along_c = (sign / (COS_THETA * sqrt_d)) as f32;
        row.iter_mut().zip(c).for_each(|(x, c)| *x += along_c * c);
        quantize_row(o.weight_dtype, row, bytes);
        let u_len = bytes.len() - g_len;
        dequantize_row(o.weight_dtype, &bytes[g_len..], row);
        let mean_abs_u = (f64::from(dot(row, c)) * COS_THETA * sqrt_d).abs() as f32;

        // Down: small noise on a grid both block layouts store exactly.
        down_column(o.down_dtype, self.down_scale, i, &mut rng, row);
        quantize_row(o.down_dtype, row, bytes);
        debug_assert_eq!(
            bytes.len() - g_len - u_len,
            o.down_dtype.row_bytes(d).unwrap_or(0)
        );
        dst[..bytes.len()].copy_from_slice(bytes);
        NeuronOut {
            us,
            bias,
            mean_abs_u,
            round_err2,
        }
    }
}

/// For a down type whose blocks [`down_column`] fills exactly: the code of the block's extreme
/// value (negative, the one the quantiser's scale comes from: `d = max / -extreme`, or for Q8_0
/// `d = amax / 127`) and the largest code magnitude of every other value.
fn exact_codes(dtype: DType) -> Option<(f32, f32)> {
    match dtype {
        DType::Q8_0 => Some((127.0, 126.0)),
        DType::Q5_0 => Some((16.0, 15.0)),
        DType::Q4_0 => Some((8.0, 7.0)),
        _ => None,
    }
}

/// The step of a layer's down values: the power of two that puts their RMS `rms` between a
/// quarter and a half of the extreme code, never below f16's smallest subnormal (2⁻²⁴), so that
/// it is a block scale f16 holds exactly.
pub(super) fn down_step(rms: f32, extreme: f32) -> f32 {
    let e = (f64::from(rms) / f64::from(extreme / 2.0)).log2().ceil();
    2f32.powi(e.clamp(-24.0, 15.0) as i32)
}

/// Neuron `i`'s down column (`row`, one value per residual dimension `j`): seeded values of RMS
/// about `rms`.
///
/// For q8_0, q5_0 and q4_0 the values lie on a grid that the column's blocks (32 along `j`) and
/// the transposed down matrix's blocks (32 along the neuron axis, what a GGUF `ffn_down` row
/// holds) both store exactly, so that `leanstream export-gguf` is lossless: a power-of-two step
/// `s` ([`down_step`]); on the `j ≡ i (mod 32)` diagonal the extreme value `-extreme·s`, so that
/// every aligned block of 32 along either axis holds exactly one and has scale `s`; every other
/// value an integer multiple of `s` of magnitude at most `limit` ([`exact_codes`]). Their spread
/// is set so that the column's mean square, diagonal included, is `rms²`. Other types get
/// uniform noise of RMS `rms` (f16 and f32 transpose exactly anyway).
fn down_column(dtype: DType, rms: f32, i: usize, rng: &mut Rng, row: &mut [f32]) {
    let Some((extreme, limit)) = exact_codes(dtype) else {
        row.iter_mut().for_each(|x| *x = rms * rng.flat());
        return;
    };
    let s = down_step(rms, extreme);
    let t = rms / s;
    let spread = ((t * t - extreme * extreme / 32.0) * 32.0 / 31.0)
        .max(0.0)
        .sqrt();
    for (j, x) in row.iter_mut().enumerate() {
        let code = (spread * rng.flat()).round().clamp(-limit, limit);
        *x = s * if j % 32 == i % 32 { -extreme } else { code };
    }
}

/// `rank` orthonormal directions of length `d`, the first being `c`.
pub(super) fn directions(seed: u64, layer: usize, rank: usize, c: &[f32]) -> Vec<f32> {
    let d = c.len();
    let mut out: Vec<f32> = c.to_vec();
    let mut rng = Rng::new(seed, TAG_BASIS, layer as u64, 0);
    for _ in 1..rank {
        let mut v: Vec<f32> = (0..d).map(|_| rng.flat()).collect();
        for _ in 0..2 {
            for prev in out.chunks_exact(d) {
                orthogonalise(&mut v, prev);
            }
        }
        out.extend(unit(v));
    }
    out
}
