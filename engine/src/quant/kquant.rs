//! The 5-bit and k-quant block layouts of GGML, one decoder and one round-to-nearest encoder
//! each. The decoders follow the format definitions bit for bit (checked against the `gguf`
//! Python package's dequantiser on random blocks); the encoders are plain round-to-nearest, not
//! llama.cpp's error-minimising search: good enough for tests and tiny models, not for
//! quantising real weights (LeanStream keeps a file's k-quant rows as they are).
//!
//! - `Q5_0`: 22 bytes per 32 values = f16 `d`, u32 `qh` (bit `j` is the fifth bit of value `j`),
//!   16 bytes of nibbles (as Q4_0); value = `d * (q - 16)`.
//! - `Q4_K`: 144 bytes per 256 = f16 `d`, f16 `dmin`, 12 bytes of eight 6-bit scale/min pairs,
//!   128 bytes of nibbles; sub-block `s` of 32 values: value = `d * sc_s * q - dmin * m_s`. Bytes
//!   `32c..32c+32` hold values `64c..64c+32` in their low nibbles, `64c+32..64c+64` in the high.
//! - `Q6_K`: 210 bytes per 256 = 128 bytes of low nibbles `ql`, 64 bytes of high bit pairs `qh`,
//!   16 × i8 scales (one per 16 values), f16 `d`; value = `d * sc * (q - 32)`.

use half::f16;

/// Values per k-quant super-block.
pub const QK_K: usize = 256;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes one Q5_0 block (22 bytes) into 32 values.
pub fn decode_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let lo = (b[6 + j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (b[6 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        out[j] = d * (f32::from(lo) - 16.0);
        out[j + 16] = d * (f32::from(hi) - 16.0);
    }
}

/// Encodes 32 values as one Q5_0 block (the Q4_0 rule with 5 bits: `d = max / -16`).
pub fn encode_q5_0(x: &[f32], out: &mut [u8]) {
    let max = x
        .iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let q = |v: f32| ((v * id + 16.5) as i32).clamp(0, 31) as u32;
    let mut qh = 0u32;
    for j in 0..16 {
        let (lo, hi) = (q(x[j]), q(x[j + 16]));
        out[6 + j] = ((lo & 0x0f) | ((hi & 0x0f) << 4)) as u8;
        qh |= ((lo >> 4) << j) | ((hi >> 4) << (j + 16));
    }
    out[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// Scale and min of Q4_K sub-block `j` (0..8) from the 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Decodes one Q4_K block (144 bytes) into 256 values.
pub fn decode_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, d2) = (d * f32::from(sc1), d * f32::from(sc2));
        let (m1, m2) = (dmin * f32::from(m1), dmin * f32::from(m2));
        let q = &qs[32 * c..32 * c + 32];
        let o = &mut out[64 * c..64 * c + 64];
        for l in 0..32 {
            o[l] = d1 * f32::from(q[l] & 0x0f) - m1;
            o[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

/// Encodes 256 values as one Q4_K block: per 32-value sub-block an offset (its minimum, if
/// negative) and a step covering its range, both stored as 6-bit multiples of `dmin` and `d`.
pub fn encode_q4_k(x: &[f32], out: &mut [u8]) {
    let mut steps = [0f32; 8];
    let mut mins = [0f32; 8];
    for (s, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().copied().fold(0f32, f32::min);
        let hi = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        steps[s] = (hi - lo) / 15.0;
        mins[s] = -lo;
    }
    let d = steps.iter().copied().fold(0f32, f32::max) / 63.0;
    let dmin = mins.iter().copied().fold(0f32, f32::max) / 63.0;
    let (d, dmin) = (f16::from_f32(d), f16::from_f32(dmin));
    out[..2].copy_from_slice(&d.to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_le_bytes());
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    let six = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).round().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let sc: Vec<u8> = steps.iter().map(|&s| six(s, d)).collect();
    let m: Vec<u8> = mins.iter().map(|&v| six(v, dmin)).collect();
    let scales = &mut out[4..16];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    let q = |v: f32, s: usize| {
        let step = d * f32::from(sc[s]);
        if step > 0.0 {
            ((v + dmin * f32::from(m[s])) / step)
                .round()
                .clamp(0.0, 15.0) as u8
        } else {
            0
        }
    };
    for c in 0..4 {
        for l in 0..32 {
            let (a, b) = (q(x[64 * c + l], 2 * c), q(x[64 * c + 32 + l], 2 * c + 1));
            out[16 + 32 * c + l] = a | (b << 4);
        }
    }
}

/// Decodes one Q6_K block (210 bytes) into 256 values.
pub fn decode_q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for h in 0..2 {
        let (ql, qh, sc) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..]);
        let o = &mut out[128 * h..128 * h + 128];
        for l in 0..32 {
            let is = l / 16;
            let q =
                |low: u8, shift: u32| f32::from((low | (((qh[l] >> shift) & 3) << 4)) as i8 - 32);
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            o[l] = s(0) * q(ql[l] & 0x0f, 0);
            o[l + 32] = s(2) * q(ql[l + 32] & 0x0f, 2);
            o[l + 64] = s(4) * q(ql[l] >> 4, 4);
            o[l + 96] = s(6) * q(ql[l + 32] >> 4, 6);
        }
    }
}

/// Encodes 256 values as one Q6_K block: per 16 values a signed step (`amax / 31`), stored as an
/// i8 multiple of `d`.
pub fn encode_q6_k(x: &[f32], out: &mut [u8]) {
    let steps: Vec<f32> = x
        .chunks_exact(16)
        .map(|s| s.iter().fold(0f32, |a, v| a.max(v.abs())) / 31.0)
        .collect();
    let d = f16::from_f32(steps.iter().copied().fold(0f32, f32::max) / 127.0);
    out[208..210].copy_from_slice(&d.to_le_bytes());
    let d = d.to_f32();
    let sc: Vec<i8> = steps
        .iter()
        .map(|&s| {
            if d > 0.0 {
                (s / d).round().clamp(-128.0, 127.0) as i8
            } else {
                0
            }
        })
        .collect();
    for (o, s) in out[192..208].iter_mut().zip(&sc) {
        *o = *s as u8;
    }
    // q(i) in 0..64 for value i, laid out as decode_q6_k reads it.
    let q = |i: usize| {
        let step = d * f32::from(sc[i / 16]);
        if step != 0.0 {
            ((x[i] / step).round().clamp(-32.0, 31.0) as i32 + 32) as u8
        } else {
            32
        }
    };
    out[..192].fill(0);
    for h in 0..2 {
        for l in 0..32 {
            let base = 128 * h;
            let (q1, q2, q3, q4) = (
                q(base + l),
                q(base + l + 32),
                q(base + l + 64),
                q(base + l + 96),
            );
            out[64 * h + l] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
            out[64 * h + l + 32] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
            out[128 + 32 * h + l] =
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
}
