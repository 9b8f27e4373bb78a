//! Eight-row integer kernels for the k-quant super-block types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K),
//! for [`Precision::Fast`](super::super::Precision::Fast). (The exact path's k-quant kernels take
//! one row at a time for several tokens, in `kquant.rs`.)
//!
//! # Layout
//! A call gets eight rows of one type and length and several tokens. Per super-block (256 values)
//! the eight rows' scales and mins are decoded once ([`groups`], the decoder every kernel shares)
//! and transposed ([`Scales8`]): `scale[k]` holds group `k`'s scale with row `r` in lane `r`. Then
//! for each 32-value span, each row's quants are decoded once (`span_*` of `kquant.rs`) and
//! used for up to [`TOKENS`] tokens; the eight rows' integer products with a token's activation
//! bytes (`maddubs`/`madd`, or `vpdpbusd` on VNNI) are summed per 16-value group by a transposing
//! reduction, which yields one vector per group with row `r`'s sum in lane `r`. From there every
//! step is the same per lane, so the arithmetic of a (row, token) pair never depends on what else
//! is in the call. Q3_K and Q6_K quants are signed; they are decoded with their bias added
//! (0..=7, 0..=63) and the bias times the activation bytes' sum is taken off the group's integer
//! sum, an exact identity.
//!
//! The scales are decoded once per super-block for all the tokens of a call (at most
//! [`TOKEN_GROUP`] at a time; their running totals wait in memory while the next [`TOKENS`] are
//! computed), where the one-row kernels decode them again for every row and token.
//!
//! # Bit-identical to the scalar kernel
//! `scalar_kquant::dot_q8` computes, per activation block `a` over groups `k0 = 2s`, `k1 = 2s+1`:
//! `sub = 0 + (scale[k0]·isum0 - min[k0]·qsum0)`, `sub += scale[k1]·isum1 - min[k1]·qsum1`,
//! `total += a.d · sub`, with `isum` the exact integer sum of a group's products and `qsum` that of
//! its activation bytes. The lanes here compute the same integers exactly, convert them the same
//! way and do the same roundings in the same order with separate multiplies, subtracts and adds
//! (no fused multiply-add; Rust never contracts). Two steps are left out, which can only change
//! the sign of a zero in an intermediate value: the `0 +` that starts `sub`, and for Q3_K and
//! Q6_K, whose mins are `+0.0`, the `- min·qsum`. A zero's sign cannot reach the result: `total`
//! starts at `+0.0`, a sum of floats is `-0.0` only when both terms are, and adding a zero of
//! either sign to anything else gives the same bits.

use std::arch::x86_64::*;

use super::kquant::{
    Q3_K_BIAS, Q6_K_BIAS, has_min, span_q2_k, span_q3_k_biased, span_q4_k, span_q5_k,
    span_q6_k_biased,
};
use super::rows::{Rows8, TOKENS, blocks_of, lanes, udot, udot_vnni};
use super::{ld_ps, ld_q};
use crate::backend::cpu::{Q8Block, TOKEN_GROUP};
use crate::quant::kquant::{GROUPS, QK_K, groups};
use crate::quant::{DType, QK};

/// 32-value spans (activation blocks) per super-block.
const SPANS: usize = QK_K / QK;

/// How many super-blocks ahead of the one being computed the kernels prefetch.
const AHEAD: usize = 2;

/// Super-block `i` of each of the eight rows.
#[inline]
fn super_blocks<'a, const BB: usize>(rows: &Rows8<'a>, i: usize) -> [&'a [u8; BB]; 8] {
    rows.map(|r| {
        r[i * BB..(i + 1) * BB]
            .try_into()
            .expect("a whole super-block")
    })
}

/// Asks for super-block `i` of the eight rows to be loaded into the cache, where it exists: a
/// kernel reads its rows side by side, eight streams that the hardware prefetcher follows poorly
/// (without, Gemma-3's k-quant rows decode at under half the one-row kernel's speed).
#[inline]
fn prefetch_ahead(rows: &Rows8<'_>, bb: usize, i: usize) {
    for r in rows {
        if let Some(b) = r.get(i * bb..(i + 1) * bb) {
            super::super::prefetch(b);
        }
    }
}

/// The transpose of an 8×8 matrix held as eight rows: lane `r` of `out[c]` is lane `c` of `m[r]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn transpose(m: [__m256; 8]) -> [__m256; 8] {
    // Within each 128-bit half: pairs of rows interleaved (columns 0,1 and 2,3 of the half)...
    let pairs = |a, b| (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    // ...then four rows' column c of the half, for c = 0..4...
    let quads = |(lo01, hi01), (lo23, hi23)| {
        [
            _mm256_shuffle_ps::<0b01_00_01_00>(lo01, lo23),
            _mm256_shuffle_ps::<0b11_10_11_10>(lo01, lo23),
            _mm256_shuffle_ps::<0b01_00_01_00>(hi01, hi23),
            _mm256_shuffle_ps::<0b11_10_11_10>(hi01, hi23),
        ]
    };
    let top = quads(pairs(m[0], m[1]), pairs(m[2], m[3]));
    let bottom = quads(pairs(m[4], m[5]), pairs(m[6], m[7]));
    // ...and the halves put together: the low halves hold columns 0..4, the high ones 4..8.
    let mut out = [_mm256_setzero_ps(); 8];
    for c in 0..4 {
        out[c] = _mm256_permute2f128_ps::<0x20>(top[c], bottom[c]);
        out[c + 4] = _mm256_permute2f128_ps::<0x31>(top[c], bottom[c]);
    }
    out
}

/// Sixteen floats of each of eight rows, transposed: lane `r` of `out[k]` is `v[r][k]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn transpose16(v: [&[f32; GROUPS]; 8]) -> [__m256; GROUPS] {
    let (mut lo, mut hi) = ([_mm256_setzero_ps(); 8], [_mm256_setzero_ps(); 8]);
    for ((lo, hi), g) in lo.iter_mut().zip(&mut hi).zip(v) {
        (*lo, *hi) = (ld_ps(g, 0), ld_ps(g, 8));
    }
    let mut out = [_mm256_setzero_ps(); GROUPS];
    out[..8].copy_from_slice(&transpose(lo));
    out[8..].copy_from_slice(&transpose(hi));
    out
}

/// The scales and mins of one super-block of eight rows: lane `r` of `scale[k]` is group `k`'s
/// scale in row `r` (as [`groups`] decodes it), the same for `min` (zero for types without).
struct Scales8 {
    scale: [__m256; GROUPS],
    min: [__m256; GROUPS],
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales8<const BB: usize>(dtype: DType, blocks: &[&[u8; BB]; 8]) -> Scales8 {
    let g = blocks.map(|b| groups(dtype, b));
    Scales8 {
        scale: transpose16(g.each_ref().map(|g| &g.scale)),
        min: if has_min(dtype) {
            transpose16(g.each_ref().map(|g| &g.min))
        } else {
            [_mm256_setzero_ps(); GROUPS]
        },
    }
}

// ---- fast path -----------------------------------------------------------------------------------

/// The per-group sums of eight rows' span products: `v[r]` holds row `r`'s eight i32 partial
/// sums, lanes 0-3 from the span's first 16-value group and 4-7 from its second. Lane `r` of the
/// results is row `r`'s sum over the first group, and over the second.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn group_sums(v: [__m256i; 8]) -> (__m256i, __m256i) {
    // Each 128-bit half of `ab` holds rows 0..4's sums of that half's lanes (the first group in
    // the low half, the second in the high one), `cd` rows 4..8's.
    let ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    (
        _mm256_permute2x128_si256::<0x20>(ab, cd),
        _mm256_permute2x128_si256::<0x31>(ab, cd),
    )
}

/// The sums of the activation bytes of each 16-value half, from their eight i32 partial sums
/// (`Σ 1·q`): every lane of the first result holds the first half's, of the second the second's.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn act_group_sums(partial: __m256i) -> (__m256i, __m256i) {
    let s = _mm256_add_epi32(partial, _mm256_shuffle_epi32::<0b01_00_11_10>(partial));
    let s = _mm256_add_epi32(s, _mm256_shuffle_epi32::<0b10_11_00_01>(s));
    (
        _mm256_permute2x128_si256::<0x00>(s, s),
        _mm256_permute2x128_si256::<0x11>(s, s),
    )
}

/// One group's term of the scalar kernel in lanes, `scale·isum - min·qsum`, rounded as it
/// rounds it (the min part only for types with mins).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn group_term(with_min: bool, scale: __m256, min: __m256, isum: __m256i, qsum: __m256i) -> __m256 {
    let t = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum));
    if with_min {
        _mm256_sub_ps(t, _mm256_mul_ps(min, _mm256_cvtepi32_ps(qsum)))
    } else {
        t
    }
}

/// A k-quant type as the fast kernel sees it.
#[derive(Clone, Copy)]
struct Fast {
    dtype: DType,
    /// Added to every quant by the span decoder, to make it unsigned.
    bias: i32,
}

/// `total + a.d · sub` for span `s` of eight rows (`w`, unsigned quants) against activation
/// block `a`, `sub` being the scalar kernel's two group terms.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fold_q8(
    ty: Fast,
    total: __m256,
    w: &[__m256i; 8],
    a: &Q8Block,
    g: &Scales8,
    s: usize,
    udot: impl Fn(__m256i, __m256i) -> __m256i,
) -> __m256 {
    let q = ld_q(&a.q);
    let mut p = [_mm256_setzero_si256(); 8];
    for (p, &w) in p.iter_mut().zip(w) {
        *p = udot(w, q);
    }
    let (mut isum0, mut isum1) = group_sums(p);
    let (qsum0, qsum1) = act_group_sums(udot(_mm256_set1_epi8(1), q));
    if ty.bias != 0 {
        let bias = _mm256_set1_epi32(ty.bias);
        isum0 = _mm256_sub_epi32(isum0, _mm256_mullo_epi32(bias, qsum0));
        isum1 = _mm256_sub_epi32(isum1, _mm256_mullo_epi32(bias, qsum1));
    }
    let with_min = has_min(ty.dtype);
    let (k0, k1) = (2 * s, 2 * s + 1);
    let sub = _mm256_add_ps(
        group_term(with_min, g.scale[k0], g.min[k0], isum0, qsum0),
        group_term(with_min, g.scale[k1], g.min[k1], isum1, qsum1),
    );
    _mm256_add_ps(total, _mm256_mul_ps(_mm256_set1_ps(a.d), sub))
}

/// The fast eight-row kernel of one k-quant type for at most [`TOKEN_GROUP`] tokens: per
/// super-block the scales once, per span each row's quants once for up to [`TOKENS`] tokens.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_group<const BB: usize>(
    ty: Fast,
    rows: &Rows8<'_>,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    span: impl Fn(&[u8], usize) -> __m256i + Copy,
    udot: impl Fn(__m256i, __m256i) -> __m256i + Copy,
) {
    let n = blocks_of(rows, BB, acts, SPANS);
    let mut totals = [_mm256_setzero_ps(); TOKEN_GROUP];
    for i in 0..n {
        prefetch_ahead(rows, BB, i + AHEAD);
        let blocks = super_blocks::<BB>(rows, i);
        let g = scales8(ty.dtype, &blocks);
        for (acts, totals) in acts.chunks(TOKENS).zip(totals.chunks_mut(TOKENS)) {
            for s in 0..SPANS {
                let mut w = [_mm256_setzero_si256(); 8];
                for (w, b) in w.iter_mut().zip(&blocks) {
                    *w = span(*b, s);
                }
                for (a, t) in acts.iter().zip(totals.iter_mut()) {
                    *t = fold_q8(ty, *t, &w, &a[SPANS * i + s], &g, s, udot);
                }
            }
        }
    }
    for (o, t) in out.iter_mut().zip(totals) {
        *o = lanes(t);
    }
}

/// [`q8_group`] over every token, [`TOKEN_GROUP`] at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_x8<const BB: usize>(
    ty: Fast,
    rows: &Rows8<'_>,
    acts: &[&[Q8Block]],
    out: &mut [[f32; 8]],
    span: impl Fn(&[u8], usize) -> __m256i + Copy,
    udot: impl Fn(__m256i, __m256i) -> __m256i + Copy,
) {
    assert_eq!(acts.len(), out.len(), "one output per token");
    for (a, o) in acts.chunks(TOKEN_GROUP).zip(out.chunks_mut(TOKEN_GROUP)) {
        q8_group::<BB>(ty, rows, a, o, span, udot);
    }
}

/// The five fast kernels for one instruction set: `$features` enabled, `$udot` its product of
/// unsigned by signed bytes into eight i32 partial sums.
macro_rules! fast_kernels {
    (
        $features:literal,
        $udot:ident,
        [$($name:ident: $dtype:ident, $bytes:literal, $span:ident, $bias:expr;)*]
    ) => {$(
        #[target_feature(enable = $features)]
        pub(super) fn $name(rows: Rows8<'_>, acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
            let ty = Fast {
                dtype: DType::$dtype,
                bias: $bias,
            };
            q8_x8::<$bytes>(ty, &rows, acts, out, |b, s| $span(b, s), |u, q| $udot(u, q));
        }
    )*};
}

fast_kernels!(
    "avx2,fma,f16c",
    udot,
    [
        q2_k_q8_x8: Q2K, 84, span_q2_k, 0;
        q3_k_q8_x8: Q3K, 110, span_q3_k_biased, Q3_K_BIAS;
        q4_k_q8_x8: Q4K, 144, span_q4_k, 0;
        q5_k_q8_x8: Q5K, 176, span_q5_k, 0;
        q6_k_q8_x8: Q6K, 210, span_q6_k_biased, Q6_K_BIAS;
    ]
);

fast_kernels!(
    "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw",
    udot_vnni,
    [
        q2_k_q8_x8_vnni: Q2K, 84, span_q2_k, 0;
        q3_k_q8_x8_vnni: Q3K, 110, span_q3_k_biased, Q3_K_BIAS;
        q4_k_q8_x8_vnni: Q4K, 144, span_q4_k, 0;
        q5_k_q8_x8_vnni: Q5K, 176, span_q5_k, 0;
        q6_k_q8_x8_vnni: Q6K, 210, span_q6_k_biased, Q6_K_BIAS;
    ]
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_puts_row_r_in_lane_r() {
        if super::super::detect().is_none() {
            return;
        }
        let m: [[f32; 8]; 8] =
            std::array::from_fn(|r| std::array::from_fn(|c| (10 * r + c) as f32));
        // SAFETY: AVX2, FMA and F16C were detected above.
        let got = unsafe { transpose(m.each_ref().map(|row| ld_ps(row, 0))).map(|c| lanes(c)) };
        let want: [[f32; 8]; 8] = std::array::from_fn(|c| std::array::from_fn(|r| m[r][c]));
        assert_eq!(got, want);
    }
}
