//! NEON integer kernels over tiles ([`crate::quant::tiles`]) of the 32-value block types: the
//! eight rows of a tile in two vectors of four 32-bit lanes, one row per lane.
//!
//! A tile's column `c` holds bytes `4c..4c + 4` of each row's quants, so a row's four products
//! with the activation's bytes `4c..4c + 4` are one `sdot` lane: the by-element `sdot` (or,
//! without `dotprod`, [`dot16`] against the activation word copied to every lane) multiplies
//! four rows' columns by one activation word at once. Lane `c` of the one-row kernel's partial
//! sums (`blocks.rs: dot_q8`) is exactly the sum of the products of columns `c` (values
//! `4c..4c + 4`) and `c + 4` (values `16 + 4c..`); here that sum is accumulated in vector `c`, one
//! row per lane, with the same fused multiply-add by the same `d · d8`, and the four vectors are
//! added as `vaddvq_f32` adds a vector's lanes. So each row's result is the one-row kernel's, bit
//! for bit, and a tiled matrix computes what the same rows stored as rows compute.

use std::arch::aarch64::*;

use super::simd::{dot16, f16x4_ps, ld_16, ld_q, ld_u16x4, st_f32};
use crate::backend::cpu::Q8Block;

/// Bytes of a tile's block part: eight blocks of `BYTES`.
const fn part_bytes(bytes: usize) -> usize {
    8 * bytes
}

/// Four rows' quants of one block, as the one-row kernel's span would hold them: `lo[c]` the
/// values `4c..4c + 4` (signed, offset taken off), `hi[c]` the values `16 + 4c..16 + 4c + 4`,
/// lane `r` for row `r` of the half.
type Columns4 = ([int8x16_t; 4], [int8x16_t; 4]);

/// Column `w` of rows `4h..4h + 4` of a block part (after `SCALES` bytes of scales per row).
#[target_feature(enable = "neon")]
#[inline]
fn word<const SCALES: usize>(part: &[u8], w: usize, h: usize) -> uint8x16_t {
    ld_16(part, 8 * SCALES + 32 * w + 16 * h)
}

/// Q4 columns (16 nibble bytes after `SCALES` bytes of scales), minus `offset`.
#[target_feature(enable = "neon")]
#[inline]
fn q4<const SCALES: usize>(part: &[u8], h: usize, offset: i8) -> Columns4 {
    let (mask, o) = (vdupq_n_u8(0x0f), vdupq_n_s8(offset));
    let signed = |v| vsubq_s8(vreinterpretq_s8_u8(v), o);
    let mut out = ([vdupq_n_s8(0); 4], [vdupq_n_s8(0); 4]);
    for c in 0..4 {
        let w = word::<SCALES>(part, c, h);
        out.0[c] = signed(vandq_u8(w, mask));
        out.1[c] = signed(vshrq_n_u8::<4>(w));
    }
    out
}

/// Q5 columns: the nibbles of words 1..5 plus 16 where the high bits of word 0 are set, minus
/// `offset`. The high bits of column `c` are bits `4c..4c + 4` (low values) and `16 + 4c..`
/// (high values) of each lane's `qh`; a multiply copies four bits to bit 4 of four bytes.
#[target_feature(enable = "neon")]
#[inline]
fn q5<const SCALES: usize>(part: &[u8], h: usize, offset: i8) -> Columns4 {
    let qh = vreinterpretq_u32_u8(word::<SCALES>(part, 0, h));
    let sixteens = |shift: i32| {
        let bits = vandq_u32(vshlq_u32(qh, vdupq_n_s32(-shift)), vdupq_n_u32(0xf));
        let copies = vmulq_u32(bits, vdupq_n_u32(0x0204_0810));
        vreinterpretq_u8_u32(vandq_u32(copies, vdupq_n_u32(0x1010_1010)))
    };
    let (mask, o) = (vdupq_n_u8(0x0f), vdupq_n_s8(offset));
    let signed = |v| vsubq_s8(vreinterpretq_s8_u8(v), o);
    let mut out = ([vdupq_n_s8(0); 4], [vdupq_n_s8(0); 4]);
    for c in 0..4 {
        let w = word::<SCALES>(part, c + 1, h);
        let shift = 4 * c as i32;
        out.0[c] = signed(vorrq_u8(vandq_u8(w, mask), sixteens(shift)));
        out.1[c] = signed(vorrq_u8(vshrq_n_u8::<4>(w), sixteens(16 + shift)));
    }
    out
}

/// Q8_0 columns: words 0..4 and 4..8 as they are.
#[target_feature(enable = "neon")]
#[inline]
fn q8(part: &[u8], h: usize) -> Columns4 {
    let mut out = ([vdupq_n_s8(0); 4], [vdupq_n_s8(0); 4]);
    for c in 0..4 {
        out.0[c] = vreinterpretq_s8_u8(word::<2>(part, c, h));
        out.1[c] = vreinterpretq_s8_u8(word::<2>(part, c + 4, h));
    }
    out
}

/// Activation bytes `4c..4c + 4` of `q` (16 bytes) in every lane.
#[target_feature(enable = "neon")]
#[inline]
fn act_word(q: int8x16_t, c: usize) -> int8x16_t {
    let w = vreinterpretq_s32_s8(q);
    let lane = match c {
        0 => vdupq_laneq_s32::<0>(w),
        1 => vdupq_laneq_s32::<1>(w),
        2 => vdupq_laneq_s32::<2>(w),
        _ => vdupq_laneq_s32::<3>(w),
    };
    vreinterpretq_s8_s32(lane)
}

/// `acc + Σ` of four rows' products of a column with the activation word it meets, one row per
/// lane ([`dot16`] against the word copied to every lane).
#[target_feature(enable = "neon")]
#[inline]
fn column_dot(acc: int32x4_t, col: int8x16_t, act: int8x16_t, c: usize) -> int32x4_t {
    vaddq_s32(acc, dot16(col, act_word(act, c)))
}

/// [`column_dot`] in one by-element `sdot` (the intrinsic is not stable Rust yet).
#[target_feature(enable = "neon,dotprod")]
#[inline]
fn column_sdot(acc: int32x4_t, col: int8x16_t, act: int8x16_t, c: usize) -> int32x4_t {
    let mut acc = acc;
    macro_rules! sdot_lane {
        ($lane:literal) => {
            // SAFETY: `sdot` only reads and writes the three vector registers named; the dotprod
            // feature of this function means it only runs on a CPU that has the instruction.
            unsafe {
                std::arch::asm!(
                    concat!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.4b[", $lane, "]"),
                    acc = inout(vreg) acc,
                    a = in(vreg) col,
                    b = in(vreg) act,
                    options(pure, nomem, nostack, preserves_flags),
                )
            }
        };
    }
    match c {
        0 => sdot_lane!("0"),
        1 => sdot_lane!("1"),
        2 => sdot_lane!("2"),
        _ => sdot_lane!("3"),
    }
    acc
}

/// The tile kernel of one block type: for each token and each half of the tile (rows `4h..4h +
/// 4`), per block, `decode(part, h)` gives the columns, `idot` sums a column's products into an
/// accumulator, and the four column sums are scaled into four float accumulators as the one-row
/// kernel scales its four lanes; `m · s8` is added per block where `MIN`.
#[target_feature(enable = "neon")]
#[inline]
fn tile<const BYTES: usize, const MIN: bool>(
    tile: &[u8],
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    decode: impl Fn(&[u8], usize) -> Columns4,
    idot: impl Fn(int32x4_t, int8x16_t, int8x16_t, usize) -> int32x4_t,
) {
    assert_eq!(acts.len(), out.len(), "one output per token");
    assert!(
        tile.len().is_multiple_of(part_bytes(BYTES)),
        "a tile of whole blocks"
    );
    let n = tile.len() / part_bytes(BYTES);
    assert!(
        acts.iter().all(|a| a.len() >= n),
        "activations for {n} blocks"
    );
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        for h in 0..2 {
            let mut acc = [vdupq_n_f32(0.0); 4];
            let mut ms = vdupq_n_f32(0.0);
            for (i, b) in a[..n].iter().enumerate() {
                let part = &tile[i * part_bytes(BYTES)..(i + 1) * part_bytes(BYTES)];
                let (lo, hi) = decode(part, h);
                let [alo, ahi] = ld_q(&b.q);
                let d = f16x4_ps(ld_u16x4(part, 8 * h));
                let dd = vmulq_f32(d, vdupq_n_f32(b.d));
                for c in 0..4 {
                    let p = idot(idot(vdupq_n_s32(0), lo[c], alo, c), hi[c], ahi, c);
                    acc[c] = vfmaq_f32(acc[c], vcvtq_f32_s32(p), dd);
                }
                if MIN {
                    let m = f16x4_ps(ld_u16x4(part, 16 + 8 * h));
                    ms = vaddq_f32(ms, vmulq_f32(m, vdupq_n_f32(b.s)));
                }
            }
            // As `vaddvq_f32` adds one row's four lanes: (0 + 1) + (2 + 3).
            let sum = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
            let total = if MIN { vaddq_f32(sum, ms) } else { sum };
            st_f32(o, 4 * h, total);
        }
    }
}

macro_rules! tile_kernels {
    ($($bytes:literal, $min:literal, |$p:ident, $h:ident| $decode:expr => $plain:ident, $sdot:ident;)*) => {$(
        #[target_feature(enable = "neon")]
        pub(super) fn $plain(t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            tile::<$bytes, $min>(t, acts, out, |$p, $h| $decode, |s, w, a, c| column_dot(s, w, a, c))
        }
        #[target_feature(enable = "neon,dotprod")]
        pub(super) fn $sdot(t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            tile::<$bytes, $min>(t, acts, out, |$p, $h| $decode, |s, w, a, c| column_sdot(s, w, a, c))
        }
    )*};
}

tile_kernels! {
    34, false, |p, h| q8(p, h) => q8_0_q8_tile, q8_0_q8_tile_sdot;
    18, false, |p, h| q4::<2>(p, h, 8) => q4_0_q8_tile, q4_0_q8_tile_sdot;
    20, true, |p, h| q4::<4>(p, h, 0) => q4_1_q8_tile, q4_1_q8_tile_sdot;
    22, false, |p, h| q5::<2>(p, h, 16) => q5_0_q8_tile, q5_0_q8_tile_sdot;
    24, true, |p, h| q5::<4>(p, h, 0) => q5_1_q8_tile, q5_1_q8_tile_sdot;
}
