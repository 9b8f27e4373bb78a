//! Integer dot products of eight rows at once against one vector of 8-bit activation blocks
//! ([`Precision::Fast`](super::super::Precision::Fast)), for the 32-value block types.
//!
//! A one-row kernel spends most of its instructions per block on the block's bookkeeping: it
//! converts the row's f16 scale, multiplies it by the activation's, and folds eight partial sums
//! into its accumulator. Here eight rows share that work: each row's block yields its integer
//! products (eight i32 partial sums), a transposing reduction ([`sum_lanes`]) turns the eight
//! rows' partial sums into one vector of eight block sums, lane `r` for row `r`, and the scales
//! of the eight rows are converted together. The activation block is loaded once for the eight.
//!
//! Each lane does exactly what the scalar kernel (`scalar::q4_1_q8` and its siblings) does for its
//! row: the block's integer sum, then `total += d·d8·isum (+ m·s8)` in f32 in the same order, with
//! no fused multiply-add. So every row's result is bit-identical to the scalar kernel's, whatever
//! rows share its call — which keeps a conversation's tokens the same alone or in a batch.

use std::arch::x86_64::*;

use super::{hsum, ld_32, ld_ps, ld_q, nibbles, q4_1_ps, q5_bytes};
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

/// Lane `r` of the result is the sum of the eight lanes of `v[r]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn sum_lanes(v: [__m256i; 8]) -> __m256i {
    // After two rounds of pairwise adds, each 128-bit half of `ab` holds rows 0..4's sums of that
    // half's lanes, and `cd` rows 4..8's; the last add folds the halves.
    let ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(ab, cd),
        _mm256_permute2x128_si256::<0x31>(ab, cd),
    )
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

/// `Σ q` of an activation block, as the i32 in every lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn act_sum(q: __m256i) -> __m256i {
    let s = udot(_mm256_set1_epi8(1), q);
    let s = _mm256_add_epi32(s, _mm256_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm256_add_epi32(s, _mm256_shuffle_epi32::<0b10_11_00_01>(s));
    _mm256_add_epi32(s, _mm256_permute2x128_si256::<0x01>(s, s))
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

/// The eight-row kernel of one block type for up to [`TOKENS`] tokens: per block, each row's
/// values are decoded once (`decode`, at the block's byte offset), multiplied with each token's
/// activations (`product`: eight i32 partial sums), the eight rows' sums gathered into one
/// vector, and folded into the token's total by `finish(total, isum, d, m, block, q)` with the
/// rows' `d` and `m` (the first two f16 of the block; `m` is meaningless for types without one).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tile(
    rows: &Rows8<'_>,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    block_bytes: usize,
    decode: impl Fn(&[u8], usize) -> __m256i,
    product: impl Fn(__m256i, __m256i) -> __m256i,
    finish: impl Fn(__m256, __m256i, __m256, __m256, &Q8Block, __m256i) -> __m256,
) {
    assert!(
        acts.len() <= TOKENS && acts.len() == out.len(),
        "tokens vs outputs"
    );
    let n = blocks_of(rows, block_bytes, acts, 1);
    let mut total = [_mm256_setzero_ps(); TOKENS];
    for i in 0..n {
        let at = i * block_bytes;
        let mut w = [_mm256_setzero_si256(); 8];
        for (w, r) in w.iter_mut().zip(rows) {
            *w = decode(r, at);
        }
        let (d, m) = f16_pairs(words(rows, at));
        for (a, total) in acts.iter().zip(&mut total) {
            let a = &a[i];
            let q = ld_q(&a.q);
            let mut p = [_mm256_setzero_si256(); 8];
            for (p, w) in p.iter_mut().zip(w) {
                *p = product(w, q);
            }
            let isum = sum_lanes(p);
            *total = finish(*total, isum, d, m, a, q);
        }
    }
    for (o, t) in out.iter_mut().zip(total) {
        *o = lanes(t);
    }
}

/// [`tile`] over every token, [`TOKENS`] at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tiles(
    rows: &Rows8<'_>,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    block_bytes: usize,
    decode: impl Fn(&[u8], usize) -> __m256i + Copy,
    product: impl Fn(__m256i, __m256i) -> __m256i + Copy,
    finish: impl Fn(__m256, __m256i, __m256, __m256, &Q8Block, __m256i) -> __m256 + Copy,
) {
    assert_eq!(acts.len(), out.len(), "one output per token");
    for (a, o) in acts.chunks(TOKENS).zip(out.chunks_mut(TOKENS)) {
        tile(rows, a, o, block_bytes, decode, product, finish);
    }
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
    rows: &Rows8<'_>,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    block_bytes: usize,
    offset: i32,
    decode: impl Fn(&[u8], usize) -> __m256i + Copy,
    product: impl Fn(__m256i, __m256i) -> __m256i + Copy,
) {
    tiles(
        rows,
        acts,
        out,
        block_bytes,
        decode,
        product,
        |total, isum, d, _, a, q| {
            let shift = _mm256_mullo_epi32(act_sum(q), _mm256_set1_epi32(offset));
            add_scaled(total, d, a.d, _mm256_sub_epi32(isum, shift))
        },
    );
}

/// Unsigned weights with a min (Q4_1 and Q5_1): `d·d8·isum + m·s8` per block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn min_tiles(
    rows: &Rows8<'_>,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    block_bytes: usize,
    decode: impl Fn(&[u8], usize) -> __m256i + Copy,
    product: impl Fn(__m256i, __m256i) -> __m256i + Copy,
) {
    tiles(
        rows,
        acts,
        out,
        block_bytes,
        decode,
        product,
        |total, isum, d, m, a, _| {
            let dd = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
            let t = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum));
            let u = _mm256_mul_ps(m, _mm256_set1_ps(a.s));
            _mm256_add_ps(total, _mm256_add_ps(t, u))
        },
    );
}

/// The five kernels for one instruction set: `$features` enabled, `$udot` its product of
/// unsigned by signed bytes into eight i32 partial sums, `$q5` its decoder of Q5 blocks.
macro_rules! row_kernels {
    (
        $features:literal,
        $udot:ident,
        $q5:ident,
        [$q8_0:ident, $q4_0:ident, $q4_1:ident, $q5_0:ident, $q5_1:ident]
    ) => {
        #[target_feature(enable = $features)]
        pub(super) fn $q8_0(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            // Signed × signed through the sign trick: |w| · (q with w's sign).
            let product = |w, q| $udot(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w));
            let finish = |total, isum, d, _, a: &Q8Block, _| add_scaled(total, d, a.d, isum);
            tiles(
                &rows,
                acts,
                out,
                34,
                |r, at| ld_32(r, at + 2),
                product,
                finish,
            );
        }

        #[target_feature(enable = $features)]
        pub(super) fn $q4_0(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            let decode = |r: &[u8], at| nibbles(r, at + 2);
            offset_tiles(&rows, acts, out, 18, 8, decode, |w, q| $udot(w, q));
        }

        #[target_feature(enable = $features)]
        pub(super) fn $q5_0(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            let decode = |r: &[u8], at| $q5(r, at + 2);
            offset_tiles(&rows, acts, out, 22, 16, decode, |w, q| $udot(w, q));
        }

        #[target_feature(enable = $features)]
        pub(super) fn $q4_1(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            let decode = |r: &[u8], at| nibbles(r, at + 4);
            min_tiles(&rows, acts, out, 20, decode, |w, q| $udot(w, q));
        }

        #[target_feature(enable = $features)]
        pub(super) fn $q5_1(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            let decode = |r: &[u8], at| $q5(r, at + 4);
            min_tiles(&rows, acts, out, 24, decode, |w, q| $udot(w, q));
        }
    };
}

row_kernels!(
    "avx2,fma,f16c",
    udot,
    q5_bytes,
    [q8_0_q8_x8, q4_0_q8_x8, q4_1_q8_x8, q5_0_q8_x8, q5_1_q8_x8]
);

/// [`udot`] in one instruction, on CPUs with AVX-512 VNNI (Ice Lake, Zen 4 and later): the same
/// exact integer sums. With AVX-512VL enabled the compiler may also use the sixteen extra vector
/// registers.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
#[inline]
pub(super) fn udot_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// [`q5_bytes`] with AVX-512BW's byte masks: the block's 32 high bits are the mask that adds 16
/// to the nibbles, one instruction instead of spreading the bits to bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
#[inline]
fn q5_bytes_bw(b: &[u8], at: usize) -> __m256i {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let n = nibbles(b, at + 4);
    _mm256_mask_add_epi8(n, qh, n, _mm256_set1_epi8(0x10))
}

row_kernels!(
    "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw",
    udot_vnni,
    q5_bytes_bw,
    [
        q8_0_q8_x8_vnni,
        q4_0_q8_x8_vnni,
        q4_1_q8_x8_vnni,
        q5_0_q8_x8_vnni,
        q5_1_q8_x8_vnni
    ]
);

// ---- exact (f32 activation) kernels ------------------------------------------------------------

/// Lane `r` of the result is the sum of the eight lanes of `v[r]` (the f32 [`sum_lanes`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_lanes_puts_row_r_in_lane_r() {
        if super::super::detect().is_none() {
            return;
        }
        // SAFETY: AVX2, FMA and F16C were detected above.
        let got = unsafe {
            let v: [__m256i; 8] = std::array::from_fn(|r| {
                let base = 100 * r as i32;
                _mm256_setr_epi32(base, base + 1, base + 2, base + 3, 4, 5, 6, -7 * r as i32)
            });
            let mut out = [0i32; 8];
            _mm256_storeu_si256(out.as_mut_ptr().cast(), sum_lanes(v));
            out
        };
        let want: [i32; 8] = std::array::from_fn(|r| 4 * 100 * r as i32 + 6 + 15 - 7 * r as i32);
        assert_eq!(got, want);
    }
}
