//! Portable kernels: the fallback on every CPU, and the baseline the SIMD kernels are tested
//! against. Sums run in eight independent lanes (per block for quantised rows), which keeps the
//! rounding error low and lets the compiler vectorise with the baseline instruction set.

use half::{bf16, f16};

use super::scalar_kquant as k;
use super::{Kernels, Q8Block};
use crate::model::FfnActivation;
use crate::quant::QK;
use crate::quant::kquant::q5;

/// In [`DType::ALL`](crate::quant::DType::ALL) order.
pub(super) static KERNELS: Kernels = Kernels {
    name: "scalar",
    dot: [
        dot_f32,
        dot_f16,
        dot_bf16,
        dot_q8_0,
        dot_q4_0,
        dot_q4_1,
        dot_q5_0,
        dot_q5_1,
        k::dot_q2_k,
        k::dot_q3_k,
        k::dot_q4_k,
        k::dot_q5_k,
        k::dot_q6_k,
    ],
    dot_q8: [
        None,
        None,
        None,
        Some(q8_0_q8),
        Some(q4_0_q8),
        Some(q4_1_q8),
        Some(q5_0_q8),
        Some(q5_1_q8),
        Some(k::q2_k_q8),
        Some(k::q3_k_q8),
        Some(k::q4_k_q8),
        Some(k::q5_k_q8),
        Some(k::q6_k_q8),
    ],
    dot_q8_x8: super::NO_ROW_GROUPS,
    dot_q8_tile: super::NO_TILES,
    dot_x8: super::NO_EXACT_ROW_GROUPS,
    dot_tokens: super::NO_TOKEN_KERNELS,
    axpy: [
        axpy_f32,
        axpy_f16,
        axpy_bf16,
        axpy_q8_0,
        axpy_q4_0,
        axpy_q4_1,
        axpy_q5_0,
        axpy_q5_1,
        k::axpy_q2_k,
        k::axpy_q3_k,
        k::axpy_q4_k,
        k::axpy_q5_k,
        k::axpy_q6_k,
    ],
    quantize,
    math: super::Transcendentals {
        silu_mul: super::silu_mul,
        gelu_mul,
        exp_shifted,
    },
};

/// GeGLU's elementwise step, one `f32::exp` per value.
fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    FfnActivation::GeluTanh.gate_inplace(gate, up);
}

/// `x[i] = e^(x[i] - shift)` with `f32::exp`, summed in order.
fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - shift).exp();
        sum += *v;
    }
    sum
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline]
fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline]
fn bf16_at(b: &[u8], at: usize) -> f32 {
    bf16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `Σ w(j)·x[j]` in eight lanes, for float rows.
#[inline]
fn lanes_dot(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let (chunks, tail) = x.as_chunks::<8>();
    for (c, xs) in chunks.iter().enumerate() {
        for (l, (a, xv)) in acc.iter_mut().zip(xs).enumerate() {
            *a += w(c * 8 + l) * xv;
        }
    }
    let base = chunks.len() * 8;
    for (j, xv) in tail.iter().enumerate() {
        acc[j] += w(base + j) * xv;
    }
    acc.iter().sum()
}

fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    lanes_dot(x, |j| f32_at(row, 4 * j))
}

fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    lanes_dot(x, |j| f16_at(row, 2 * j))
}

fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    lanes_dot(x, |j| bf16_at(row, 2 * j))
}

/// Sum over blocks of `scale(b) · Σ q(b, j)·x[j] + offset(b) · Σ x[j]`.
#[inline]
fn blocks_dot<const BB: usize>(
    row: &[u8],
    x: &[f32],
    scales: impl Fn(&[u8; BB]) -> (f32, f32),
    q: impl Fn(&[u8; BB], usize) -> f32,
) -> f32 {
    let (blocks, _) = row.as_chunks::<BB>();
    let (xs, _) = x.as_chunks::<QK>();
    let mut total = 0f32;
    for (b, xb) in blocks.iter().zip(xs) {
        let (d, m) = scales(b);
        let mut sq = [0f32; 8];
        let mut sx = [0f32; 8];
        for (j, xv) in xb.iter().enumerate() {
            sq[j % 8] += q(b, j) * xv;
            sx[j % 8] += xv;
        }
        total += d * sq.iter().sum::<f32>();
        if m != 0.0 {
            total += m * sx.iter().sum::<f32>();
        }
    }
    total
}

#[inline]
fn nibble(b: &[u8], first: usize, j: usize) -> u8 {
    if j < 16 {
        b[first + j] & 0x0f
    } else {
        b[first + j - 16] >> 4
    }
}

fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
    blocks_dot::<34>(
        row,
        x,
        |b| (f16_at(b, 0), 0.0),
        |b, j| f32::from(b[2 + j] as i8),
    )
}

fn dot_q4_0(row: &[u8], x: &[f32]) -> f32 {
    blocks_dot::<18>(
        row,
        x,
        |b| (f16_at(b, 0), 0.0),
        |b, j| f32::from(nibble(b, 2, j)) - 8.0,
    )
}

fn dot_q4_1(row: &[u8], x: &[f32]) -> f32 {
    blocks_dot::<20>(
        row,
        x,
        |b| (f16_at(b, 0), f16_at(b, 2)),
        |b, j| f32::from(nibble(b, 4, j)),
    )
}

fn dot_q5_0(row: &[u8], x: &[f32]) -> f32 {
    blocks_dot::<22>(
        row,
        x,
        |b| (f16_at(b, 0), 0.0),
        |b, j| f32::from(q5(b, 2, j)) - 16.0,
    )
}

fn dot_q5_1(row: &[u8], x: &[f32]) -> f32 {
    blocks_dot::<24>(
        row,
        x,
        |b| (f16_at(b, 0), f16_at(b, 2)),
        |b, j| f32::from(q5(b, 4, j)),
    )
}

fn q8_0_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<34>();
    let mut total = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let isum: i32 = (0..QK)
            .map(|j| i32::from(b[2 + j] as i8) * i32::from(a.q[j]))
            .sum();
        total += f16_at(b, 0) * a.d * isum as f32;
    }
    total
}

fn q4_0_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<18>();
    let mut total = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let isum: i32 = (0..QK)
            .map(|j| (i32::from(nibble(b, 2, j)) - 8) * i32::from(a.q[j]))
            .sum();
        total += f16_at(b, 0) * a.d * isum as f32;
    }
    total
}

fn q4_1_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<20>();
    let mut total = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let isum: i32 = (0..QK)
            .map(|j| i32::from(nibble(b, 4, j)) * i32::from(a.q[j]))
            .sum();
        total += f16_at(b, 0) * a.d * isum as f32 + f16_at(b, 2) * a.s;
    }
    total
}

fn q5_0_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<22>();
    let mut total = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let isum: i32 = (0..QK)
            .map(|j| (i32::from(q5(b, 2, j)) - 16) * i32::from(a.q[j]))
            .sum();
        total += f16_at(b, 0) * a.d * isum as f32;
    }
    total
}

fn q5_1_q8(row: &[u8], acts: &[Q8Block]) -> f32 {
    let (blocks, _) = row.as_chunks::<24>();
    let mut total = 0f32;
    for (b, a) in blocks.iter().zip(acts) {
        let isum: i32 = (0..QK)
            .map(|j| i32::from(q5(b, 4, j)) * i32::from(a.q[j]))
            .sum();
        total += f16_at(b, 0) * a.d * isum as f32 + f16_at(b, 2) * a.s;
    }
    total
}

fn axpy_f32(row: &[u8], a: f32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o += a * f32_at(row, 4 * j);
    }
}

fn axpy_f16(row: &[u8], a: f32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o += a * f16_at(row, 2 * j);
    }
}

fn axpy_bf16(row: &[u8], a: f32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o += a * bf16_at(row, 2 * j);
    }
}

/// `out += a · (d·q + m)` block by block.
#[inline]
fn blocks_axpy<const BB: usize>(
    row: &[u8],
    a: f32,
    out: &mut [f32],
    scales: impl Fn(&[u8; BB]) -> (f32, f32),
    q: impl Fn(&[u8; BB], usize) -> f32,
) {
    let (blocks, _) = row.as_chunks::<BB>();
    let (outs, _) = out.as_chunks_mut::<QK>();
    for (b, ob) in blocks.iter().zip(outs) {
        let (d, m) = scales(b);
        for (j, o) in ob.iter_mut().enumerate() {
            *o += a * (d * q(b, j) + m);
        }
    }
}

fn axpy_q8_0(row: &[u8], a: f32, out: &mut [f32]) {
    blocks_axpy::<34>(
        row,
        a,
        out,
        |b| (f16_at(b, 0), 0.0),
        |b, j| f32::from(b[2 + j] as i8),
    );
}

fn axpy_q4_0(row: &[u8], a: f32, out: &mut [f32]) {
    blocks_axpy::<18>(
        row,
        a,
        out,
        |b| (f16_at(b, 0), 0.0),
        |b, j| f32::from(nibble(b, 2, j)) - 8.0,
    );
}

fn axpy_q4_1(row: &[u8], a: f32, out: &mut [f32]) {
    blocks_axpy::<20>(
        row,
        a,
        out,
        |b| (f16_at(b, 0), f16_at(b, 2)),
        |b, j| f32::from(nibble(b, 4, j)),
    );
}

fn axpy_q5_0(row: &[u8], a: f32, out: &mut [f32]) {
    blocks_axpy::<22>(
        row,
        a,
        out,
        |b| (f16_at(b, 0), 0.0),
        |b, j| f32::from(q5(b, 2, j)) - 16.0,
    );
}

fn axpy_q5_1(row: &[u8], a: f32, out: &mut [f32]) {
    blocks_axpy::<24>(
        row,
        a,
        out,
        |b| (f16_at(b, 0), f16_at(b, 2)),
        |b, j| f32::from(q5(b, 4, j)),
    );
}

/// Quantises one block (`x.len() <= 32`, the rest taken as zeros): `d = amax / 127`,
/// `q = round_ties_even(x / d)`, `sum = Σq`, `s = d · sum`. The AVX2 kernel computes the same
/// bits.
pub(super) fn quantize_block(x: &[f32], out: &mut Q8Block) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    out.q = [0; QK];
    for (q, v) in out.q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
        sum += i32::from(*q);
    }
    out.d = d;
    out.s = d * sum as f32;
    out.sum = sum;
}

fn quantize(x: &[f32], out: &mut [Q8Block]) {
    for (xb, o) in x.chunks(QK).zip(out) {
        quantize_block(xb, o);
    }
}
