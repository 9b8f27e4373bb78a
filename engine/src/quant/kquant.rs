//! The 5-bit and k-quant block layouts of GGML, one decoder and one round-to-nearest encoder
//! each. The decoders follow the format definitions bit for bit (checked against the `gguf`
//! Python package's dequantiser on random blocks); the encoders are plain round-to-nearest, not
//! llama.cpp's error-minimising search: good enough for tests and tiny models, not for
//! quantising real weights (LeanStream keeps a file's k-quant rows as they are).
//!
//! - `Q5_0`: 22 bytes per 32 values = f16 `d`, u32 `qh` (bit `j` is the fifth bit of value `j`),
//!   16 bytes of nibbles (as Q4_0); value = `d * (q - 16)`.
//! - `Q5_1`: 24 bytes per 32 = f16 `d`, f16 `m`, then as Q5_0; value = `d * q + m`.
//! - `Q2_K`: 84 bytes per 256 = 16 bytes of 4-bit scale/min pairs (one per 16 values), 64 bytes
//!   of 2-bit values, f16 `d`, f16 `dmin`; value = `d * sc * q - dmin * m`. Byte `32h + l`
//!   holds values `128h + 32s + l` for `s = 0..4` in its bit pairs `2s`.
//! - `Q3_K`: 110 bytes per 256 = 32 bytes of high bits (bit `s` of byte `l` belongs to value
//!   `32s + l`), 64 bytes of 2-bit low parts (as Q2_K), 12 bytes of sixteen 6-bit scales
//!   (offset 32), f16 `d`; value = `d * sc * (low - 4 * (1 - high))`.
//! - `Q5_K`: 176 bytes per 256 = as Q4_K with 32 bytes of fifth bits (as Q3_K's high bits)
//!   before the nibbles.
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
    let mut q = [0u8; 32];
    five_bit(
        &b[6..22],
        u32::from_le_bytes([b[2], b[3], b[4], b[5]]),
        &mut q,
    );
    for (o, q) in out.iter_mut().zip(q) {
        *o = d * (f32::from(q) - 16.0);
    }
}

/// The fifth bits of a Q5_0/Q5_1 block: bit `j` of `qh` for value `j`.
fn five_bit(lo_nibbles: &[u8], qh: u32, out: &mut [u8; 32]) {
    for j in 0..16 {
        out[j] = (lo_nibbles[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        out[j + 16] = (lo_nibbles[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
}

/// Decodes one Q5_1 block (24 bytes) into 32 values.
pub fn decode_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let mut q = [0u8; 32];
    five_bit(
        &b[8..24],
        u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        &mut q,
    );
    for (o, q) in out.iter_mut().zip(q) {
        *o = d * f32::from(q) + m;
    }
}

/// Packs 32 five-bit values as a Q5_0/Q5_1 block body: `qh`, then 16 bytes of nibbles.
fn pack_five(q: &[u32; 32], out: &mut [u8]) {
    let mut qh = 0u32;
    for j in 0..16 {
        out[4 + j] = ((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4)) as u8;
        qh |= ((q[j] >> 4) << j) | ((q[j + 16] >> 4) << (j + 16));
    }
    out[..4].copy_from_slice(&qh.to_le_bytes());
}

/// Encodes 32 values as one Q5_1 block: `d = (max - min) / 31`, `m = min`.
pub fn encode_q5_1(x: &[f32], out: &mut [u8]) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    out[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
    let q: [u32; 32] =
        std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as i32).clamp(0, 31) as u32);
    pack_five(&q, &mut out[4..]);
}

/// Encodes 32 values as one Q5_0 block (the Q4_0 rule with 5 bits: `d = max / -16`).
pub fn encode_q5_0(x: &[f32], out: &mut [u8]) {
    let max = x
        .iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let q: [u32; 32] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i32).clamp(0, 31) as u32);
    pack_five(&q, &mut out[2..]);
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

/// A super-block quantised as `d * sc_s * q - dmin * m_s` (Q2_K, Q4_K, Q5_K), before packing.
struct ScaledMin {
    d: f16,
    dmin: f16,
    sc: Vec<u8>,
    m: Vec<u8>,
    q: Vec<u8>,
}

/// Round-to-nearest of 256 values in sub-blocks of `sub` values with `levels` steps each: per
/// sub-block an offset (its minimum, if negative) and a step covering its range, both stored as
/// unsigned multiples (up to `scale_max`) of `dmin` and `d`.
fn scaled_min(x: &[f32], sub: usize, levels: f32, scale_max: f32) -> ScaledMin {
    let (mut steps, mut mins) = (Vec::new(), Vec::new());
    for s in x.chunks_exact(sub) {
        let lo = s.iter().copied().fold(0f32, f32::min);
        let hi = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        steps.push((hi - lo) / levels);
        mins.push(-lo);
    }
    let d = f16::from_f32(steps.iter().copied().fold(0f32, f32::max) / scale_max);
    let dmin = f16::from_f32(mins.iter().copied().fold(0f32, f32::max) / scale_max);
    let unit = |v: f32, u: f32| {
        if u > 0.0 {
            (v / u).round().clamp(0.0, scale_max) as u8
        } else {
            0
        }
    };
    let sc: Vec<u8> = steps.iter().map(|&v| unit(v, d.to_f32())).collect();
    let m: Vec<u8> = mins.iter().map(|&v| unit(v, dmin.to_f32())).collect();
    let q = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let step = d.to_f32() * f32::from(sc[i / sub]);
            let off = dmin.to_f32() * f32::from(m[i / sub]);
            if step > 0.0 {
                ((v + off) / step).round().clamp(0.0, levels) as u8
            } else {
                0
            }
        })
        .collect();
    ScaledMin { d, dmin, sc, m, q }
}

/// The 12 bytes of eight 6-bit scale/min pairs of Q4_K and Q5_K.
fn pack_scale_min_k4(sc: &[u8], m: &[u8], out: &mut [u8]) {
    for j in 0..4 {
        out[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        out[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        out[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
}

/// Encodes 256 values as one Q4_K block (see [`scaled_min`]).
pub fn encode_q4_k(x: &[f32], out: &mut [u8]) {
    let e = scaled_min(x, 32, 15.0, 63.0);
    out[..2].copy_from_slice(&e.d.to_le_bytes());
    out[2..4].copy_from_slice(&e.dmin.to_le_bytes());
    pack_scale_min_k4(&e.sc, &e.m, &mut out[4..16]);
    for c in 0..4 {
        for l in 0..32 {
            out[16 + 32 * c + l] = e.q[64 * c + l] | (e.q[64 * c + 32 + l] << 4);
        }
    }
}

/// Decodes one Q5_K block (176 bytes) into 256 values.
pub fn decode_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        for l in 0..32 {
            let low = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f;
            let high = (qh[l] >> s) & 1;
            out[32 * s + l] = d1 * f32::from(low | (high << 4)) - m1;
        }
    }
}

/// Encodes 256 values as one Q5_K block (see [`scaled_min`]).
pub fn encode_q5_k(x: &[f32], out: &mut [u8]) {
    let e = scaled_min(x, 32, 31.0, 63.0);
    out[..2].copy_from_slice(&e.d.to_le_bytes());
    out[2..4].copy_from_slice(&e.dmin.to_le_bytes());
    pack_scale_min_k4(&e.sc, &e.m, &mut out[4..16]);
    out[16..176].fill(0);
    for (i, &q) in e.q.iter().enumerate() {
        let (s, l) = (i / 32, i % 32);
        out[16 + l] |= (q >> 4) << s;
        out[48 + 32 * (s / 2) + l] |= (q & 0x0f) << (4 * (s % 2));
    }
}

/// The 2-bit part of value `i` (0..256) of a Q2_K/Q3_K block's 64 bytes `qs`.
fn two_bit(qs: &[u8], i: usize) -> u8 {
    let (h, s, l) = (i / 128, (i % 128) / 32, i % 32);
    (qs[32 * h + l] >> (2 * s)) & 3
}

/// Where value `i`'s 2-bit part goes in the 64 bytes `qs`: (byte, shift).
fn two_bit_at(i: usize) -> (usize, usize) {
    let (h, s, l) = (i / 128, (i % 128) / 32, i % 32);
    (32 * h + l, 2 * s)
}

/// Decodes one Q2_K block (84 bytes) into 256 values.
pub fn decode_q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, o) in out.iter_mut().enumerate().take(256) {
        let s = scales[i / 16];
        *o = d * f32::from(s & 0x0f) * f32::from(two_bit(qs, i)) - dmin * f32::from(s >> 4);
    }
}

/// Encodes 256 values as one Q2_K block (see [`scaled_min`], 16-value sub-blocks).
pub fn encode_q2_k(x: &[f32], out: &mut [u8]) {
    let e = scaled_min(x, 16, 3.0, 15.0);
    for (o, (sc, m)) in out[..16].iter_mut().zip(e.sc.iter().zip(&e.m)) {
        *o = sc | (m << 4);
    }
    out[16..80].fill(0);
    for (i, &q) in e.q.iter().enumerate() {
        let (at, shift) = two_bit_at(i);
        out[16 + at] |= q << shift;
    }
    out[80..82].copy_from_slice(&e.d.to_le_bytes());
    out[82..84].copy_from_slice(&e.dmin.to_le_bytes());
}

/// Scale `j` (0..16) of a Q3_K block's 12 packed bytes, offset removed.
fn scale_k3(q: &[u8], j: usize) -> i8 {
    let low = if j < 8 { q[j] & 0x0f } else { q[j - 8] >> 4 };
    let high = (q[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Decodes one Q3_K block (110 bytes) into 256 values.
pub fn decode_q3_k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, scales) = (&b[..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for (i, o) in out.iter_mut().enumerate().take(256) {
        let high = (hmask[i % 32] >> (i / 32)) & 1;
        let q = i32::from(two_bit(qs, i)) - 4 * (1 - i32::from(high));
        *o = d * f32::from(scale_k3(scales, i / 16)) * q as f32;
    }
}

/// Encodes 256 values as one Q3_K block: per 16 values a signed step (`amax / 4`, values
/// -4..=3) stored as a 6-bit signed multiple of `d`.
pub fn encode_q3_k(x: &[f32], out: &mut [u8]) {
    let steps: Vec<f32> = x
        .chunks_exact(16)
        .map(|s| s.iter().fold(0f32, |a, v| a.max(v.abs())) / 4.0)
        .collect();
    let d = f16::from_f32(steps.iter().copied().fold(0f32, f32::max) / 31.0);
    let df = d.to_f32();
    let sc: Vec<i32> = steps
        .iter()
        .map(|&s| {
            if df > 0.0 {
                (s / df).round().clamp(-32.0, 31.0) as i32
            } else {
                0
            }
        })
        .collect();
    out[..108].fill(0);
    for (j, &s) in sc.iter().enumerate() {
        let v = (s + 32) as u8;
        if j < 8 {
            out[96 + j] |= v & 0x0f;
        } else {
            out[96 + j - 8] |= (v & 0x0f) << 4;
        }
        out[104 + j % 4] |= (v >> 4) << (2 * (j / 4));
    }
    for (i, &v) in x.iter().enumerate() {
        let step = df * sc[i / 16] as f32;
        let q = if step != 0.0 {
            (v / step).round().clamp(-4.0, 3.0) as i32
        } else {
            0
        } + 4;
        let (at, shift) = two_bit_at(i);
        out[32 + at] |= ((q & 3) as u8) << shift;
        out[i % 32] |= ((q >> 2) as u8) << (i / 32);
    }
    out[108..110].copy_from_slice(&d.to_le_bytes());
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
