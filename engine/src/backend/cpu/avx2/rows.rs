//! Integer dot products of eight rows at once against one vector of 8-bit activation blocks
//! ([`Precision::Fast`](super::super::Precision::Fast)), for the 32-value block types.
//!
//! A one-row kernel spends most of its instructions per block on the block's bookkeeping: it
//! converts the row's f16 scale, multiplies it by the activation's, and folds eight partial sums
//! into its accumulator. Here eight rows share that work, one row per 32-bit lane. A block's
//! values are decoded once for all tokens, transposed into eight vectors of 4-value words
//! ([`Columns`]: lane `r` of column `k` holds row `r`'s values `4k..4k + 4`), and each column
//! meets the activation's bytes `4k..4k + 4`, broadcast to every lane. After the eight columns,
//! lane `r` holds row `r`'s exact block sum: no reduction across lanes per token (an earlier
//! version multiplied each row separately and reduced with horizontal adds, 14 shuffles per
//! token and block; this one decodes 23 % to 27 % more prompt tokens per second). The scales
//! of the eight rows are converted together.
//!
//! Each lane does exactly what the scalar kernel (`scalar::q4_1_q8` and its siblings) does for its
//! row: the block's integer sum, then `total += d·d8·isum (+ m·s8)` in f32 in the same order, with
//! no fused multiply-add. So every row's result is bit-identical to the scalar kernel's, whatever
//! rows share its call — which keeps a conversation's tokens the same alone or in a batch.

use std::arch::x86_64::*;

use super::{hsum, ld_16, ld_32, ld_ps, q4_1_ps};
use crate::backend::cpu::Q8Block;

/// Eight rows of the same type and length, each exactly its bytes.
///
/// The kernels below loop over the eight rows with `for`, never `array::map`: `map` is a generic
/// function without the kernels' target features, so LLVM may keep it out of line, and then
/// every closure it calls (with the features) stays a call too, with the vectors passed through
/// memory. One such build ran SmolLM2's exact decode at a quarter of its speed.
pub(in crate::backend::cpu) type Rows8<'a> = [&'a [u8]; 8];

/// Number of whole blocks of `block_bytes` in the rows (checked to be of one length), and that
/// every token's activations cover them at `per_block` activations a block.
#[inline]
pub(super) fn blocks_of<A>(
    rows: &Rows8<'_>,
    block_bytes: usize,
    acts: &[&[A]],
    per_block: usize,
) -> usize {
    let len = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == len), "rows of one length");
    let n = len / block_bytes;
    assert!(
        acts.iter().all(|a| a.len() >= n * per_block),
        "activations for {n} blocks"
    );
    n
}

/// Eight i32 partial sums of `Σ u·s` for unsigned bytes `u` (≤ 63, so no pair of products
/// saturates the i16 step) and signed bytes `s` (≥ -127).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn udot(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// The four bytes at `at` of each row, little-endian, in lane `r`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn words(rows: &Rows8<'_>, at: usize) -> __m256i {
    let mut w = [0i32; 8];
    for (w, r) in w.iter_mut().zip(rows) {
        *w = i32::from_le_bytes(r[at..at + 4].try_into().expect("four bytes"));
    }
    _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7])
}

/// The f16 pairs of [`words`] (a block's `d` and `m`), as f32 in lane `r`: the low halves, then
/// the high halves.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16_pairs(v: __m256i) -> (__m256, __m256) {
    // Within each 128-bit half: the four low halves, then the four high halves; the permute puts
    // rows 0..8's low halves in the low 128 bits and their high halves in the high ones.
    let lo = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    let packed = _mm256_packus_epi32(lo, _mm256_srli_epi32::<16>(v));
    let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(ordered)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(ordered)),
    )
}

/// The eight results as an array.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn lanes(v: __m256) -> [f32; 8] {
    let mut out = [0f32; 8];
    // SAFETY: `out` is exactly eight f32; storeu has no alignment requirement.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// Most tokens one pass over a block of eight rows serves: their running totals stay in
/// registers next to the eight decoded rows.
pub(super) const TOKENS: usize = 4;

/// The 16 bytes at `at` of each of the eight rows, as four vectors of 4-byte words: lane `r` of
/// `out[k]` is bytes `4k..4k + 4` of row `r` (a transpose of 8 × 4 words).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn word_columns(rows: &Rows8<'_>, at: usize) -> [__m256i; 4] {
    // Rows r and r + 4 share a vector, one per 128-bit half; the rest works within the halves.
    let mut y = [_mm256_setzero_si256(); 4];
    for (r, y) in y.iter_mut().enumerate() {
        *y = _mm256_set_m128i(ld_16(rows[r + 4], at), ld_16(rows[r], at));
    }
    let [y0, y1, y2, y3] = y;
    // Words 0 and 1 (`lo`), 2 and 3 (`hi`) of rows 0 and 1, and of rows 2 and 3, interleaved...
    let (lo01, hi01) = (_mm256_unpacklo_epi32(y0, y1), _mm256_unpackhi_epi32(y0, y1));
    let (lo23, hi23) = (_mm256_unpacklo_epi32(y2, y3), _mm256_unpackhi_epi32(y2, y3));
    // ...then one word of all four rows per half.
    [
        _mm256_unpacklo_epi64(lo01, lo23),
        _mm256_unpackhi_epi64(lo01, lo23),
        _mm256_unpacklo_epi64(hi01, hi23),
        _mm256_unpackhi_epi64(hi01, hi23),
    ]
}

/// A block's 32 values of the eight rows as eight vectors of 4-value words, one row per lane:
/// `out[k]` holds values `4k..4k + 4`, which meet the activation bytes `4k..4k + 4`.
type Columns = [__m256i; 8];

/// The nibbles of Q4 blocks (16 bytes at `at`; value `j` in the low nibble of byte `j`, value
/// `j + 16` in its high nibble), unsigned, as [`Columns`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibble_columns(rows: &Rows8<'_>, at: usize) -> Columns {
    nibbles(word_columns(rows, at))
}

/// Four columns of Q4 bytes split into the [`Columns`] of their low nibbles (values `0..16`)
/// and high nibbles (values `16..32`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibbles(words: [__m256i; 4]) -> Columns {
    let mask = _mm256_set1_epi8(0x0f);
    let mut out = [_mm256_setzero_si256(); 8];
    for (k, w) in words.into_iter().enumerate() {
        out[k] = _mm256_and_si256(w, mask);
        out[k + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(w), mask);
    }
    out
}

/// Q5 blocks at `at`: the nibbles at `at + HIGH + 4` plus 16 where the block's 32 high bits (the
/// four bytes at `at + HIGH`, bit `j` for value `j`) are set.
///
/// `HIGH` is a constant so that Q5_0 and Q5_1 call their own copies: LLVM did not inline one
/// copy shared by four kernels, and a call passes the eight columns through memory every block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q5_columns<const HIGH: usize>(rows: &Rows8<'_>, at: usize) -> Columns {
    with_high_bits(nibble_columns(rows, at + HIGH + 4), words(rows, at + HIGH))
}

/// Q5's nibble columns with 16 added where the rows' high bits (lane `r` of `high`: bit `j` for
/// value `j`) are set.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn with_high_bits(mut out: Columns, high: __m256i) -> Columns {
    for (k, col) in out.iter_mut().enumerate() {
        *col = _mm256_or_si256(*col, high_sixteens(high, k));
    }
    out
}

/// Column `k`'s high bits as 16 or 0 per byte: bits `4k..4k + 4` of lane `r` of `high` moved to
/// bit 4 of the lane's four bytes. A multiply makes four copies of the four bits, shifted by 4, 11,
/// 18 and 25 (they do not overlap, so nothing carries): copy `b` puts bit `b` at bit `8b + 4`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn high_sixteens(high: __m256i, k: usize) -> __m256i {
    let shift = _mm_cvtsi32_si128(4 * k as i32);
    let bits = _mm256_and_si256(_mm256_srl_epi32(high, shift), _mm256_set1_epi32(0xf));
    let copies = _mm256_mullo_epi32(bits, _mm256_set1_epi32(0x0204_0810));
    _mm256_and_si256(copies, _mm256_set1_epi32(0x1010_1010))
}

/// The signed bytes of Q8_0 blocks (32 at `at`) as [`Columns`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn byte_columns(rows: &Rows8<'_>, at: usize) -> Columns {
    let (lo, hi) = (word_columns(rows, at), word_columns(rows, at + 16));
    [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
}

/// Activation bytes `4k..4k + 4` of a block in every lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn act_word(a: &Q8Block, k: usize) -> __m256i {
    let q = &a.q[4 * k..4 * k + 4];
    _mm256_set1_epi32(i32::from_le_bytes([
        q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8,
    ]))
}

/// One token's part of a block in [`tiles`]: the eight rows' exact integer sums with the
/// token's block `a`, folded into its `total`. `accumulate(sum, column, activation word)` adds
/// each lane's four products to its running i32 sum, so that after the eight columns lane `r`
/// holds row `r`'s block sum with no reduction across lanes; `finish(total, isum, d, m, a)`
/// scales it with the rows' `d` and `m`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn token_step(
    total: __m256,
    w: &Columns,
    (d, m): (__m256, __m256),
    a: &Q8Block,
    accumulate: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    finish: impl Fn(__m256, __m256i, __m256, __m256, &Q8Block) -> __m256,
) -> __m256 {
    // Two sums, for two chains of dependent instructions instead of one.
    let mut sums = [_mm256_setzero_si256(); 2];
    for (k, &w) in w.iter().enumerate() {
        sums[k % 2] = accumulate(sums[k % 2], w, act_word(a, k));
    }
    finish(total, _mm256_add_epi32(sums[0], sums[1]), d, m, a)
}

/// The eight-row kernel of one block type, for every token, [`TOKENS`] at a time: per block, the
/// rows' values are decoded once into [`Columns`] along with their `d` and `m` (`block(i)` for
/// block `i`; `m` is meaningless for types without one), then each token takes a
/// [`token_step`].
///
/// The token count is matched inside the block loop so that each arm's loop over tokens has a
/// constant length: the totals then stay in registers (with a run-time count they went through
/// the stack every block), and the decoder is written out once per kernel, not once per count
/// (four copies of it were too big for LLVM to inline).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tiles(
    n: usize,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    block: impl Fn(usize) -> (Columns, (__m256, __m256)),
    accumulate: impl Fn(__m256i, __m256i, __m256i) -> __m256i + Copy,
    finish: impl Fn(__m256, __m256i, __m256, __m256, &Q8Block) -> __m256 + Copy,
) {
    assert_eq!(acts.len(), out.len(), "one output per token");
    assert!(
        acts.iter().all(|a| a.len() >= n),
        "activations for {n} blocks"
    );
    for (acts, out) in acts.chunks(TOKENS).zip(out.chunks_mut(TOKENS)) {
        let mut total = [_mm256_setzero_ps(); TOKENS];
        for i in 0..n {
            let (w, scales) = block(i);
            let mut step = |t: usize| {
                total[t] = token_step(total[t], &w, scales, &acts[t][i], accumulate, finish);
            };
            match acts.len() {
                1 => step(0),
                2 => (0..2).for_each(&mut step),
                3 => (0..3).for_each(&mut step),
                _ => (0..TOKENS).for_each(&mut step),
            }
        }
        for (o, t) in out.iter_mut().zip(total) {
            *o = lanes(t);
        }
    }
}

/// Where a kernel reads its eight rows from: eight rows as stored (each block's values
/// transposed and its scales gathered every time), or one tile of them
/// ([`crate::quant::tiles`]: every column and scale vector one load).
#[derive(Clone, Copy)]
pub(super) enum Source<'a> {
    Rows(Rows8<'a>),
    Tile(&'a [u8]),
}

/// A block's columns and its rows' `d` and `m` (`m` is `d` for types without one).
type Block = (Columns, (__m256, __m256));

/// The number of blocks of `block_bytes` in eight rows, checked to be of one length.
fn row_blocks(rows: &Rows8<'_>, block_bytes: usize) -> usize {
    let len = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == len), "rows of one length");
    len / block_bytes
}

/// The number of blocks of `block_bytes` per row in a tile, checked to be whole blocks.
fn tile_blocks(tile: &[u8], block_bytes: usize) -> usize {
    assert!(
        tile.len().is_multiple_of(8 * block_bytes),
        "a tile of whole blocks"
    );
    tile.len() / (8 * block_bytes)
}

/// `body` with `n`, the block count, and `block`, the block decoder of `src`: `rows(rows, i)`
/// or `tile(tile, i)` for block `i`. The body is written out once per source, so each decoder
/// inlines into its own loop (one function serving both was kept out of line, its columns passed
/// through memory).
macro_rules! by_source {
    ($src:expr, $bytes:expr, $rows:expr, $tile:expr, |$n:ident, $block:ident| $body:expr) => {
        match $src {
            Source::Rows(rows) => {
                let ($n, $block) = (row_blocks(&rows, $bytes), |i| $rows(&rows, i));
                $body
            }
            Source::Tile(t) => {
                let ($n, $block) = (tile_blocks(t, $bytes), |i| $tile(t, i));
                $body
            }
        }
    };
}

/// Block `i` of a tile of `BYTES`-byte blocks: its bytes and, as f32 vectors, its eight `d`
/// and, where `SCALES` is 4, its eight `m` (else `d` twice).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tile_block<const BYTES: usize, const SCALES: usize>(
    tile: &[u8],
    i: usize,
) -> (&[u8], (__m256, __m256)) {
    let part = &tile[i * 8 * BYTES..(i + 1) * 8 * BYTES];
    let d = _mm256_cvtph_ps(ld_16(part, 0));
    let m = if SCALES == 4 {
        _mm256_cvtph_ps(ld_16(part, 16))
    } else {
        d
    };
    (part, (d, m))
}

/// Column `w` of a tile's block part (`part`, after `SCALES` bytes of scales per row): lane `r`
/// holds row `r`'s block bytes `SCALES + 4w..SCALES + 4w + 4`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tile_word<const SCALES: usize>(part: &[u8], w: usize) -> __m256i {
    ld_32(part, 8 * SCALES + 32 * w)
}

/// Block `i` of eight Q4 rows (`SCALES` bytes of scales, then 16 bytes of nibbles).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4_rows<const BYTES: usize, const SCALES: usize>(rows: &Rows8<'_>, i: usize) -> Block {
    let at = i * BYTES;
    (
        nibble_columns(rows, at + SCALES),
        f16_pairs(words(rows, at)),
    )
}

/// [`q4_rows`] from a tile.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4_tile<const BYTES: usize, const SCALES: usize>(tile: &[u8], i: usize) -> Block {
    let (p, scales) = tile_block::<BYTES, SCALES>(tile, i);
    let w = |k| tile_word::<SCALES>(p, k);
    (nibbles([w(0), w(1), w(2), w(3)]), scales)
}

/// Block `i` of eight Q5 rows (`SCALES` bytes of scales, four bytes of high bits, then 16
/// bytes of nibbles).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q5_rows<const BYTES: usize, const SCALES: usize>(rows: &Rows8<'_>, i: usize) -> Block {
    let at = i * BYTES;
    (q5_columns::<SCALES>(rows, at), f16_pairs(words(rows, at)))
}

/// [`q5_rows`] from a tile.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q5_tile<const BYTES: usize, const SCALES: usize>(tile: &[u8], i: usize) -> Block {
    let (p, scales) = tile_block::<BYTES, SCALES>(tile, i);
    let w = |k| tile_word::<SCALES>(p, k);
    let low = nibbles([w(1), w(2), w(3), w(4)]);
    (with_high_bits(low, w(0)), scales)
}

/// Block `i` of eight Q8_0 rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_rows(rows: &Rows8<'_>, i: usize) -> Block {
    let at = i * 34;
    (byte_columns(rows, at + 2), f16_pairs(words(rows, at)))
}

/// [`q8_rows`] from a tile.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_tile(tile: &[u8], i: usize) -> Block {
    let (p, scales) = tile_block::<34, 2>(tile, i);
    let mut out = [_mm256_setzero_si256(); 8];
    for (k, c) in out.iter_mut().enumerate() {
        *c = tile_word::<2>(p, k);
    }
    (out, scales)
}

/// `total + (d·d8)·isum` per lane, as the scalar kernels round it.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn add_scaled(total: __m256, d: __m256, d8: f32, isum: __m256i) -> __m256 {
    let dd = _mm256_mul_ps(d, _mm256_set1_ps(d8));
    _mm256_add_ps(total, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)))
}

/// Signed weights stored with an offset (`q - offset`, Q4_0 and Q5_0): the unsigned products
/// minus `offset · Σq8`, an exact integer identity.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn offset_tiles(
    n: usize,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    offset: i32,
    block: impl Fn(usize) -> (Columns, (__m256, __m256)),
    accumulate: impl Fn(__m256i, __m256i, __m256i) -> __m256i + Copy,
) {
    tiles(n, acts, out, block, accumulate, |total, isum, d, _, a| {
        let shift = _mm256_set1_epi32(offset * a.sum);
        add_scaled(total, d, a.d, _mm256_sub_epi32(isum, shift))
    });
}

/// Unsigned weights with a min (Q4_1 and Q5_1): `d·d8·isum + m·s8` per block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn min_tiles(
    n: usize,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    block: impl Fn(usize) -> (Columns, (__m256, __m256)),
    accumulate: impl Fn(__m256i, __m256i, __m256i) -> __m256i + Copy,
) {
    tiles(n, acts, out, block, accumulate, |total, isum, d, m, a| {
        let dd = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
        let t = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum));
        let u = _mm256_mul_ps(m, _mm256_set1_ps(a.s));
        _mm256_add_ps(total, _mm256_add_ps(t, u))
    });
}

/// `sum` plus [`udot`]: each lane's four products of unsigned `u` by signed `s` added to it.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn udot_add(sum: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi32(sum, udot(u, s))
}

/// The four 4- and 5-bit kernels for one instruction set, each over a [`Source`]: `$features`
/// enabled, `$add` its accumulating product of unsigned by signed bytes (each lane's four
/// products added to the lane's i32).
macro_rules! row_kernels {
    (
        $features:literal,
        $add:ident,
        [$q4_0:ident, $q4_1:ident, $q5_0:ident, $q5_1:ident]
    ) => {
        #[target_feature(enable = $features)]
        pub(super) fn $q4_0(src: Source<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            by_source!(src, 18, q4_rows::<18, 2>, q4_tile::<18, 2>, |n, block| {
                offset_tiles(n, acts, out, 8, block, |s, w, q| $add(s, w, q))
            })
        }

        #[target_feature(enable = $features)]
        pub(super) fn $q5_0(src: Source<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            by_source!(src, 22, q5_rows::<22, 2>, q5_tile::<22, 2>, |n, block| {
                offset_tiles(n, acts, out, 16, block, |s, w, q| $add(s, w, q))
            })
        }

        #[target_feature(enable = $features)]
        pub(super) fn $q4_1(src: Source<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            by_source!(src, 20, q4_rows::<20, 4>, q4_tile::<20, 4>, |n, block| {
                min_tiles(n, acts, out, block, |s, w, q| $add(s, w, q))
            })
        }

        #[target_feature(enable = $features)]
        pub(super) fn $q5_1(src: Source<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            by_source!(src, 24, q5_rows::<24, 4>, q5_tile::<24, 4>, |n, block| {
                min_tiles(n, acts, out, block, |s, w, q| $add(s, w, q))
            })
        }
    };
}

row_kernels!(
    "avx2,fma,f16c",
    udot_add,
    [q4_0_q8_x8, q4_1_q8_x8, q5_0_q8_x8, q5_1_q8_x8]
);

/// Q8_0: signed × signed through the sign trick, |w| · (q with w's sign) (the unsigned operand
/// of `maddubs` must stay small enough that a pair of products cannot saturate 16 bits).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q8_0_q8_x8(src: Source<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
    let accumulate = |sum, w, q| udot_add(sum, _mm256_abs_epi8(w), _mm256_sign_epi8(q, w));
    let finish = |total, isum, d, _, a: &Q8Block| add_scaled(total, d, a.d, isum);
    by_source!(src, 34, q8_rows, q8_tile, |n, block| {
        tiles(n, acts, out, block, accumulate, finish)
    })
}

/// [`udot`] in one instruction, on CPUs with AVX-512 VNNI (Ice Lake, Zen 4 and later): the same
/// exact integer sums. With AVX-512VL enabled the compiler may also use the sixteen extra vector
/// registers.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
#[inline]
pub(super) fn udot_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// [`udot_add`] in one instruction ([`udot_vnni`]'s).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
#[inline]
fn udot_add_vnni(sum: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(sum, u, s)
}

row_kernels!(
    "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw",
    udot_add_vnni,
    [
        q4_0_q8_x8_vnni,
        q4_1_q8_x8_vnni,
        q5_0_q8_x8_vnni,
        q5_1_q8_x8_vnni
    ]
);

/// Q8_0 with VNNI: the weights made unsigned by flipping their sign bits (`w + 128`), whose
/// products `vpdpbusd` sums without saturating, then `128 · Σq` taken off as for Q4_0; two
/// instructions fewer per column and token than the sign trick.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
pub(super) fn q8_0_q8_x8_vnni(src: Source<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
    let flip = _mm256_set1_epi8(i8::MIN);
    by_source!(src, 34, q8_rows, q8_tile, |n, block| {
        let flipped = |i| {
            let (mut columns, scales): Block = block(i);
            for c in &mut columns {
                *c = _mm256_xor_si256(*c, flip);
            }
            (columns, scales)
        };
        offset_tiles(n, acts, out, 128, flipped, |s, w, q| udot_add_vnni(s, w, q))
    })
}

// ---- exact (f32 activation) kernels ------------------------------------------------------------

/// Lane `r` of the result is the sum of the eight lanes of `v[r]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn sum_lanes_ps(v: [__m256; 8]) -> __m256 {
    let ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(ab, cd),
        _mm256_permute2f128_ps::<0x31>(ab, cd),
    )
}

/// Exact Q4_1 over eight rows and up to [`TOKENS`] tokens at a time: per block, each row's 32
/// nibbles are widened to f32 once, multiplied with each token's 32 activations into eight
/// partial sums, the eight rows' sums gathered into one vector (lane `r` for row `r`), and then
/// `total += d·Σq·x + m·Σx` with the rows' `d` and `m` as vectors. The same bits for a row
/// whatever else is in the call.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q4_1_x8(rows: Rows8<'_>, xs: &[&[f32]], out: &mut [[f32; 8]]) {
    assert_eq!(xs.len(), out.len(), "one output per token");
    let n = blocks_of(&rows, 20, xs, 32);
    for (xs, out) in xs.chunks(TOKENS).zip(out.chunks_mut(TOKENS)) {
        let mut total = [_mm256_setzero_ps(); TOKENS];
        for i in 0..n {
            let at = i * 20;
            let mut w = [[_mm256_setzero_ps(); 4]; 8];
            for (w, r) in w.iter_mut().zip(rows) {
                *w = q4_1_ps(r, at);
            }
            let (d, m) = f16_pairs(words(&rows, at));
            for (x, total) in xs.iter().zip(&mut total) {
                let xb = &x[i * 32..i * 32 + 32];
                let xv = [ld_ps(xb, 0), ld_ps(xb, 8), ld_ps(xb, 16), ld_ps(xb, 24)];
                let mut p = [_mm256_setzero_ps(); 8];
                for (p, q) in p.iter_mut().zip(&w) {
                    let s = _mm256_mul_ps(q[0], xv[0]);
                    let s = _mm256_fmadd_ps(q[1], xv[1], s);
                    let s = _mm256_fmadd_ps(q[2], xv[2], s);
                    *p = _mm256_fmadd_ps(q[3], xv[3], s);
                }
                let qx = sum_lanes_ps(p);
                let sx = _mm256_add_ps(_mm256_add_ps(xv[0], xv[1]), _mm256_add_ps(xv[2], xv[3]));
                let sx = _mm256_set1_ps(hsum(sx));
                *total = _mm256_fmadd_ps(d, qx, _mm256_fmadd_ps(m, sx, *total));
            }
        }
        for (o, t) in out.iter_mut().zip(total) {
            *o = lanes(t);
        }
    }
}
