//! TEMPORARY scalar stand-in with the kernel API (replaced by the SIMD kernels on merge).
use crate::model::QRows;
use crate::quant::{DType, dequantize_row};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Exact,
    Fast,
}
#[derive(Debug)]
pub struct QuantizedActs {
    x: Vec<f32>,
}
impl QuantizedActs {
    pub fn new(max_len: usize) -> Self {
        QuantizedActs {
            x: Vec::with_capacity(max_len),
        }
    }
    pub fn quantize(&mut self, x: &[f32]) {
        self.x.clear();
        self.x.extend_from_slice(x);
    }
}
pub fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let mut w = vec![0f32; x.len()];
    dequantize_row(dtype, row, &mut w);
    w.iter().zip(x).map(|(a, b)| a * b).sum()
}
pub fn axpy(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    let mut w = vec![0f32; out.len()];
    dequantize_row(dtype, row, &mut w);
    out.iter_mut().zip(&w).for_each(|(o, w)| *o += a * w);
}
pub fn matvec(m: &QRows, x: &[f32], out: &mut [f32], _p: Precision, _s: &mut QuantizedActs) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot(m.dtype, m.row(i), x);
    }
}
pub fn matvec_rows(
    m: &QRows,
    rows: &[u32],
    x: &[f32],
    out: &mut [f32],
    _p: Precision,
    _s: &mut QuantizedActs,
) {
    for (o, &r) in out.iter_mut().zip(rows) {
        *o = dot(m.dtype, m.row(r as usize), x);
    }
}
pub fn kernel_name() -> &'static str {
    "scalar-temp"
}
pub fn rmsnorm(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (ms + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * s * w;
    }
}
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}
