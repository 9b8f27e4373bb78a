//! The 5-bit and k-quant block layouts of GGML, their decoders and round-to-nearest encoders.
//! The decoders follow the format definitions bit for bit (checked against the `gguf` Python
//! package's dequantiser on random blocks); the encoders are plain round-to-nearest, not
//! llama.cpp's error-minimising search: good enough for tests and tiny models, not for
//! quantising real weights (LeanStream keeps a file's k-quant rows as they are).
//!
//! Every k-quant type decodes to one form, [`Groups`] (a float scale and min per 16 values) and
//! [`quants`] (an i8 per value); the reference dequantiser and all the kernels (scalar, AVX2,
//! CUDA) build on that form, so a type's layout is spelled out once per language.
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

use super::DType;

/// Values per k-quant super-block.
pub const QK_K: usize = 256;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes one Q5_0 block (22 bytes) into 32 values.
pub fn decode_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, o) in out.iter_mut().enumerate().take(32) {
        *o = d * (f32::from(q5(b, 2, j)) - 16.0);
    }
}

/// Decodes one Q5_1 block (24 bytes) into 32 values.
pub fn decode_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, o) in out.iter_mut().enumerate().take(32) {
        *o = d * f32::from(q5(b, 4, j)) + m;
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

/// Values per scale group of the decoded form.
pub const GROUP: usize = 16;
/// Groups per super-block.
pub const GROUPS: usize = QK_K / GROUP;

/// The float scale and min of each 16-value group of one super-block: value `j` of the block is
/// `scale[j / 16] * q[j] - min[j / 16]` with the integer quants of [`quants`]. Every k-quant type
/// decodes to this one form (types with 32-value sub-blocks repeat a sub-block's scale for its
/// two groups); the reference dequantiser and every kernel are built on it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Groups {
    pub scale: [f32; GROUPS],
    pub min: [f32; GROUPS],
}

/// The scales and mins of one super-block of `dtype`.
///
/// The small integer scales and mins are unpacked first, then turned into floats in one loop over
/// the sixteen groups (which the compiler vectorises): the float step is a single multiply per
/// value either way, so the results are the same as converting group by group.
///
/// Panics if `dtype` is not a k-quant type (a broken caller invariant).
///
/// Always inlined: the kernels call it once per super-block with a constant `dtype` (which then
/// selects one arm), and a call there made them spill their running vectors around it, since a
/// call may clobber every vector register.
#[inline(always)]
pub fn groups(dtype: DType, b: &[u8]) -> Groups {
    let mut sc = [0i8; GROUPS];
    let mut m = [0i8; GROUPS];
    let (d, dmin) = match dtype {
        DType::Q2K => {
            for ((s, m), &v) in sc.iter_mut().zip(&mut m).zip(&b[..16]) {
                (*s, *m) = ((v & 0x0f) as i8, (v >> 4) as i8);
            }
            (f16_at(b, 80), f16_at(b, 82))
        }
        DType::Q3K => {
            for (k, s) in sc.iter_mut().enumerate() {
                *s = scale_k3(&b[96..108], k);
            }
            (f16_at(b, 108), 0.0)
        }
        DType::Q4K | DType::Q5K => {
            // One 6-bit scale and min per 32 values: both of its groups get them.
            let (scales, mins) = scales_mins_k4(b[4..16].try_into().expect("12 bytes"));
            for j in 0..8 {
                sc[2 * j..2 * j + 2].fill(scales[j] as i8);
                m[2 * j..2 * j + 2].fill(mins[j] as i8);
            }
            (f16_at(b, 0), f16_at(b, 2))
        }
        DType::Q6K => {
            for (s, &v) in sc.iter_mut().zip(&b[192..208]) {
                *s = v as i8;
            }
            (f16_at(b, 208), 0.0)
        }
        other => panic!("{other} is not a k-quant type"),
    };
    let mut g = Groups {
        scale: [0.0; GROUPS],
        min: [0.0; GROUPS],
    };
    for (k, (scale, min)) in g.scale.iter_mut().zip(&mut g.min).enumerate() {
        *scale = d * f32::from(sc[k]);
        *min = dmin * f32::from(m[k]);
    }
    g
}

/// The integer quants of one super-block of `dtype`, in element order (see the layouts in the
/// module docs; every quant fits an i8).
///
/// Panics if `dtype` is not a k-quant type (a broken caller invariant).
#[inline]
pub fn quants(dtype: DType, b: &[u8], q: &mut [i8; QK_K]) {
    for (e, q) in q.iter_mut().enumerate() {
        // Value e sits in byte l of its 32-byte span; s is its bit pair in Q2_K/Q3_K/Q6_K bytes.
        let l = e % 32;
        *q = match dtype {
            DType::Q2K => two_bit(&b[16..80], e) as i8,
            DType::Q3K => {
                let high = (b[l] >> (e / 32)) & 1;
                two_bit(&b[32..96], e) as i8 - 4 * (1 - high as i8)
            }
            DType::Q4K => ((b[16 + 32 * (e / 64) + l] >> (4 * (e / 32 % 2))) & 0x0f) as i8,
            DType::Q5K => {
                let low = (b[48 + 32 * (e / 64) + l] >> (4 * (e / 32 % 2))) & 0x0f;
                let high = (b[16 + l] >> (e / 32)) & 1;
                (low | (high << 4)) as i8
            }
            DType::Q6K => {
                let (h, s) = (e / 128, e % 128 / 32);
                let low = (b[64 * h + e % 64] >> (4 * (e % 128 / 64))) & 0x0f;
                let high = (b[128 + 32 * h + l] >> (2 * s)) & 3;
                (low | (high << 4)) as i8 - 32
            }
            other => panic!("{other} is not a k-quant type"),
        };
    }
}

/// Decodes one super-block of `dtype` into 256 values through [`groups`] and [`quants`].
pub fn decode_super_block(dtype: DType, b: &[u8], out: &mut [f32]) {
    let g = groups(dtype, b);
    let mut q = [0i8; QK_K];
    quants(dtype, b, &mut q);
    for (e, (o, q)) in out.iter_mut().zip(q).enumerate() {
        *o = g.scale[e / GROUP] * f32::from(q) - g.min[e / GROUP];
    }
}

/// The five-bit quant `j` (0..32) of a Q5_0/Q5_1 block whose `qh` is at `b[at..at + 4]`, its
/// nibbles after.
#[inline]
pub fn q5(b: &[u8], at: usize, j: usize) -> u8 {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let nib = b[at + 4 + j % 16];
    let low = if j < 16 { nib & 0x0f } else { nib >> 4 };
    low | ((((qh >> j) & 1) as u8) << 4)
}

/// The eight 6-bit scales and mins of a Q4_K / Q5_K super-block from its 12 packed bytes (the
/// layout [`pack_scale_min_k4`] writes), four bytes at a time: bytes 0-3 hold scales 0-3 in their
/// low six bits, 4-7 mins 0-3, 8-11 the low nibbles of scales 4-7 and (high nibble) of mins 4-7,
/// whose two high bits are the top bits of bytes 0-3 and 4-7. The decode runs once per
/// super-block and row in every k-quant kernel, so it works on words rather than byte by byte.
fn scales_mins_k4(q: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([q[i], q[i + 1], q[i + 2], q[i + 3]]);
    let (lo, mid, hi) = (word(0), word(4), word(8));
    // In each byte, `x >> 2 & 0x30` is that byte's bits 6-7 moved to 4-5: what the shift pulls
    // in from the next byte lands in bits 6-7, which the mask clears.
    let scales_hi = (hi & 0x0f0f_0f0f) | ((lo >> 2) & 0x3030_3030);
    let mins_hi = ((hi >> 4) & 0x0f0f_0f0f) | ((mid >> 2) & 0x3030_3030);
    let join = |a: u32, b: u32| (u64::from(a) | (u64::from(b) << 32)).to_le_bytes();
    (
        join(lo & 0x3f3f_3f3f, scales_hi),
        join(mid & 0x3f3f_3f3f, mins_hi),
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_scales_and_mins_unpack_to_what_was_packed() {
        // Every 6-bit value in every position, with a scramble so that neighbours differ.
        for seed in 0..64u32 {
            let six = |j: u32| ((seed * 37 + j * 11 + (j * j) % 7) % 64) as u8;
            let sc: Vec<u8> = (0..8).map(six).collect();
            let m: Vec<u8> = (8..16).map(six).collect();
            let mut packed = [0u8; 12];
            pack_scale_min_k4(&sc, &m, &mut packed);
            let (scales, mins) = scales_mins_k4(&packed);
            assert_eq!((&scales[..], &mins[..]), (&sc[..], &m[..]), "seed {seed}");
        }
    }
}
