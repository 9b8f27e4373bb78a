//! Portable kernels for the k-quant super-block types, on their common decoded form
//! ([`crate::quant::kquant`]): per super-block, the integer quants `q` and the float scale and
//! min of each 16-value group, `w = scale · q - min`.
//!
//! - Exact: `Σ_g scale_g · Σ q·x - min_g · Σ x` per group.
//! - Fast: a super-block lines up with eight 32-value activation blocks, each covering two groups;
//!   `Σ_g d8 · (scale_g · Σ q·q8 - min_g · Σ q8)` with the sums over the group in integers.
//!
//! Each public function passes its type as a constant to an `#[inline]` generic body, so the
//! compiler specialises the decoding per type.

use super::Q8Block;
use crate::quant::kquant::{GROUP, QK_K, groups, quants};
use crate::quant::{DType, QK};

#[inline]
fn dot<const BB: usize>(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let (xs, _) = x.as_chunks::<QK_K>();
    let mut q = [0i8; QK_K];
    let mut total = 0f32;
    for (b, xb) in blocks.iter().zip(xs) {
        let g = groups(dtype, b);
        quants(dtype, b, &mut q);
        for (k, (qg, xg)) in q
            .chunks_exact(GROUP)
            .zip(xb.chunks_exact(GROUP))
            .enumerate()
        {
            let mut sq = [0f32; 8];
            let mut sx = [0f32; 8];
            for (j, (qv, xv)) in qg.iter().zip(xg).enumerate() {
                sq[j % 8] += f32::from(*qv) * xv;
                sx[j % 8] += xv;
            }
            total += g.scale[k] * sq.iter().sum::<f32>() - g.min[k] * sx.iter().sum::<f32>();
        }
    }
    total
}

#[inline]
fn dot_q8<const BB: usize>(dtype: DType, row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let mut q = [0i8; QK_K];
    let mut total = 0f32;
    for (b, ab) in blocks.iter().zip(acts.chunks_exact(QK_K / QK)) {
        let g = groups(dtype, b);
        quants(dtype, b, &mut q);
        for (s, a) in ab.iter().enumerate() {
            let mut sub = 0f32;
            for h in 0..2 {
                let k = 2 * s + h;
                let (qg, aq) = (&q[k * GROUP..][..GROUP], &a.q[h * GROUP..][..GROUP]);
                let isum: i32 = qg
                    .iter()
                    .zip(aq)
                    .map(|(w, v)| i32::from(*w) * i32::from(*v))
                    .sum();
                let qsum: i32 = aq.iter().map(|&v| i32::from(v)).sum();
                sub += g.scale[k] * isum as f32 - g.min[k] * qsum as f32;
            }
            total += a.d * sub;
        }
    }
    total
}

#[inline]
fn axpy<const BB: usize>(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    let (blocks, _) = row.as_chunks::<BB>();
    let (outs, _) = out.as_chunks_mut::<QK_K>();
    let mut q = [0i8; QK_K];
    for (b, ob) in blocks.iter().zip(outs) {
        let g = groups(dtype, b);
        quants(dtype, b, &mut q);
        for (j, (o, qv)) in ob.iter_mut().zip(q).enumerate() {
            *o += a * (g.scale[j / GROUP] * f32::from(qv) - g.min[j / GROUP]);
        }
    }
}

macro_rules! kernels {
    ($($dtype:ident, $bytes:literal: $dot:ident, $q8:ident, $axpy:ident;)*) => {$(
        pub(super) fn $dot(row: &[u8], x: &[f32]) -> f32 {
            dot::<$bytes>(DType::$dtype, row, x)
        }
        pub(super) fn $q8(row: &[u8], acts: &[Q8Block]) -> f32 {
            dot_q8::<$bytes>(DType::$dtype, row, acts)
        }
        pub(super) fn $axpy(row: &[u8], a: f32, out: &mut [f32]) {
            axpy::<$bytes>(DType::$dtype, row, a, out)
        }
    )*};
}

kernels! {
    Q2K, 84: dot_q2_k, q2_k_q8, axpy_q2_k;
    Q3K, 110: dot_q3_k, q3_k_q8, axpy_q3_k;
    Q4K, 144: dot_q4_k, q4_k_q8, axpy_q4_k;
    Q5K, 176: dot_q5_k, q5_k_q8, axpy_q5_k;
    Q6K, 210: dot_q6_k, q6_k_q8, axpy_q6_k;
}
