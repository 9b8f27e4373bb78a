//! Kernels for the block types without hand-written SIMD (Q5_0, Q5_1 and the k-quants): each block is
//! decoded to f32 on the stack with [`crate::quant::decode_block`] — the dequantiser the
//! reference uses — then multiplied in eight lanes. The weights stay quantised in memory; only
//! one block (at most 256 values) is ever decoded at a time.
//!
//! The bodies are `#[inline(always)]` generics so the AVX2 table can compile the same code with
//! its target features (the lane loops then vectorise to 256-bit registers) and give bit-identical
//! results. There is no integer ([`super::Precision::Fast`]) path for these types: they are exact
//! in either precision.

use crate::quant::{DType, decode_block};

/// Most values of one block.
const MAX_BLOCK: usize = 256;

/// `Σ dequant(row)[j] · x[j]` block by block.
#[inline(always)]
pub(super) fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let (len, bytes) = (dtype.block_len(), dtype.block_bytes());
    let mut buf = [0f32; MAX_BLOCK];
    let mut acc = [0f32; 8];
    for (b, xb) in row.chunks_exact(bytes).zip(x.chunks_exact(len)) {
        let w = &mut buf[..len];
        decode_block(dtype, b, w);
        for (wc, xc) in w.chunks_exact(8).zip(xb.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += wc[l] * xc[l];
            }
        }
    }
    acc.iter().sum()
}

/// `out += a · dequant(row)` block by block.
#[inline(always)]
pub(super) fn axpy(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    let (len, bytes) = (dtype.block_len(), dtype.block_bytes());
    let mut buf = [0f32; MAX_BLOCK];
    for (b, ob) in row.chunks_exact(bytes).zip(out.chunks_exact_mut(len)) {
        let w = &mut buf[..len];
        decode_block(dtype, b, w);
        for (o, v) in ob.iter_mut().zip(w.iter()) {
            *o += a * v;
        }
    }
}
