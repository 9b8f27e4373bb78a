//! Tensor element types and their block layouts (the GGML layouts, so GGUF data is used as is).
//!
//! A quantised row of `n` values is `n / block_len` blocks stored back to back:
//! - `Q8_0`: 34 bytes = f16 scale `d`, 32 × i8 `q`; value = `d * q`.
//! - `Q4_0`: 18 bytes = f16 `d`, 16 bytes of nibbles; value = `d * (q - 8)`.
//! - `Q4_1`: 20 bytes = f16 `d`, f16 `m`, 16 bytes of nibbles; value = `d * q + m`.
//!
//! For Q4 blocks, byte `j` holds element `j` in its low nibble and element `j + 16` in its high one.
//!
//! The 5-bit type Q5_0 and the 256-value k-quants Q4K and Q6K (what llama.cpp's `Q4_K_M`
//! files mix in) are in [`kquant`].

pub mod kquant;
pub mod tiles;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    #[serde(rename = "q2_k")]
    Q2K,
    #[serde(rename = "q3_k")]
    Q3K,
    #[serde(rename = "q4_k")]
    Q4K,
    #[serde(rename = "q5_k")]
    Q5K,
    #[serde(rename = "q6_k")]
    Q6K,
}

impl DType {
    /// Every supported type, plain floats first, in declaration order. The position is the
    /// type's index in the CPU kernel tables and its code in the CUDA kernels
    /// (`cuda-kernels/src/common.cuh`), so new types go at the end.
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];

    /// Whether values are stored one by one (f32, f16, bf16) rather than in blocks.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::Bf16)
    }
}

/// Elements per quantisation block.
pub const QK: usize = 32;

impl DType {
    /// Number of values per block (1 for plain float types).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::Bf16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => QK,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => kquant::QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q4K => 144,
            DType::Q6K => 210,
            DType::Q5_1 => 24,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q5K => 176,
        }
    }

    /// Bytes taken by a row of `n` values, or `None` when `n` is not a whole number of blocks.
    pub const fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        Some(n / self.block_len() * self.block_bytes())
    }

    /// Byte offsets of the f16 scale fields inside one block (for tests and fuzzers that fill
    /// blocks with random quants but finite scales).
    pub const fn f16_fields(self) -> &'static [usize] {
        match self {
            DType::F32 | DType::F16 | DType::Bf16 => &[],
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => &[0],
            DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
            DType::Q2K => &[80, 82],
            DType::Q3K => &[108],
            DType::Q6K => &[208],
        }
    }

    /// Lower-case name as used in file metadata and messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q4K => "q4_k",
            DType::Q6K => "q6_k",
            DType::Q5_1 => "q5_1",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q5K => "q5_k",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantises one row (`out.len()` values) from its stored bytes. Scalar and obviously correct:
/// this is what the reference forward pass and the kernel tests compare against.
///
/// Panics if `row` is shorter than `dtype.row_bytes(out.len())` (a broken internal invariant: rows
/// are sliced by the loader, which checked every size).
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    let n = out.len();
    let need = dtype
        .row_bytes(n)
        .expect("row length is a whole number of blocks");
    assert!(
        row.len() >= need,
        "row has {} bytes, needs {need}",
        row.len()
    );
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Bf16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = d * f32::from(b[2 + j] as i8);
                }
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    o[j] = d * (f32::from(b[2 + j] & 0x0f) - 8.0);
                    o[j + 16] = d * (f32::from(b[2 + j] >> 4) - 8.0);
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..16 {
                    o[j] = d * f32::from(b[4 + j] & 0x0f) + m;
                    o[j + 16] = d * f32::from(b[4 + j] >> 4) + m;
                }
            }
        }
        _ => {
            let (len, bytes) = (dtype.block_len(), dtype.block_bytes());
            for (o, b) in out.chunks_exact_mut(len).zip(row.chunks_exact(bytes)) {
                decode_block(dtype, b, o);
            }
        }
    }
}

/// Decodes one block of a block type other than Q8_0/Q4_0/Q4_1 (those have their own loops).
#[inline]
pub fn decode_block(dtype: DType, block: &[u8], out: &mut [f32]) {
    match dtype {
        DType::Q5_0 => kquant::decode_q5_0(block, out),
        DType::Q5_1 => kquant::decode_q5_1(block, out),
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => {
            kquant::decode_super_block(dtype, block, out)
        }
        other => dequantize_row(other, block, out),
    }
}

/// Quantises `x` (a whole number of blocks for block types) into `dtype`, appending to `out`.
/// Used by the converter (down columns) and by tests that build tiny models. Q4 types use the
/// GGML round-to-nearest rules.
///
/// Panics if `x.len()` is not a whole number of `dtype` blocks.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    let need = dtype
        .row_bytes(x.len())
        .unwrap_or_else(|| panic!("{} values are not whole {dtype} blocks", x.len()));
    let at = out.len();
    out.resize(at + need, 0);
    quantize_row_into(dtype, x, &mut out[at..]);
}

/// [`quantize_row`] into a slice of exactly `dtype.row_bytes(x.len())` bytes, without
/// allocating (the KV cache writes its rows this way).
///
/// Panics if `x.len()` is not a whole number of blocks or `out` has another length.
pub fn quantize_row_into(dtype: DType, x: &[f32], out: &mut [u8]) {
    assert_eq!(
        dtype.row_bytes(x.len()),
        Some(out.len()),
        "{} values of {dtype} into {} bytes",
        x.len(),
        out.len()
    );
    match dtype {
        DType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(34).zip(x.chunks_exact(QK)) {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                for (q, v) in o[2..].iter_mut().zip(b) {
                    *q = ((v * id).round() as i8) as u8;
                }
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(18).zip(x.chunks_exact(QK)) {
                let max = b
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for (j, n) in o[2..].iter_mut().enumerate() {
                    *n = q(b[j]) | (q(b[j + 16]) << 4);
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(20).zip(x.chunks_exact(QK)) {
                let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                o[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for (j, n) in o[4..].iter_mut().enumerate() {
                    *n = q(b[j]) | (q(b[j + 16]) << 4);
                }
            }
        }
        _ => {
            let (len, bytes) = (dtype.block_len(), dtype.block_bytes());
            let encode = match dtype {
                DType::Q5_0 => kquant::encode_q5_0,
                DType::Q5_1 => kquant::encode_q5_1,
                DType::Q2K => kquant::encode_q2_k,
                DType::Q3K => kquant::encode_q3_k,
                DType::Q4K => kquant::encode_q4_k,
                DType::Q5K => kquant::encode_q5_k,
                _ => kquant::encode_q6_k,
            };
            for (o, b) in out.chunks_exact_mut(bytes).zip(x.chunks_exact(len)) {
                encode(b, o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_in_all_is_the_declaration_order() {
        // The kernel tables index by `dtype as usize`.
        for (i, dtype) in DType::ALL.into_iter().enumerate() {
            assert_eq!(dtype as usize, i, "{dtype}");
        }
    }

    #[test]
    fn row_bytes_rejects_partial_blocks() {
        assert_eq!(DType::Q4_1.row_bytes(576), Some(360));
        assert_eq!(DType::Q8_0.row_bytes(576), Some(612));
        assert_eq!(DType::Q4_0.row_bytes(33), None);
        assert_eq!(DType::F16.row_bytes(3), Some(6));
    }

    #[test]
    fn quantize_dequantize_round_trips_within_step() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.1)
            .collect();
        for dtype in DType::ALL {
            let mut bytes = Vec::new();
            quantize_row(dtype, &x, &mut bytes);
            assert_eq!(bytes.len(), dtype.row_bytes(x.len()).unwrap());
            let mut y = vec![0f32; x.len()];
            dequantize_row(dtype, &bytes, &mut y);
            let tol = match dtype {
                DType::F32 => 0.0,
                DType::F16 => 1e-3,
                DType::Bf16 => 1e-2,
                DType::Q8_0 => 0.9 / 127.0,
                DType::Q4_0 | DType::Q4_1 => 0.9 * 2.0 / 15.0,
                DType::Q5_0 => 0.9 * 2.0 / 31.0,
                // 6-bit scales and mins on top of the 4-bit steps.
                DType::Q4K => 0.9 * 2.0 / 15.0 + 0.02,
                DType::Q6K => 0.9 / 31.0 + 0.01,
                DType::Q5_1 => 0.9 * 2.0 / 31.0,
                DType::Q5K => 0.9 * 2.0 / 31.0 + 0.02,
                DType::Q3K => 0.9 / 4.0 + 0.02,
                DType::Q2K => 0.9 * 2.0 / 3.0 + 0.05,
            };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b}");
            }
        }
    }
}
