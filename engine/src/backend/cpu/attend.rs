//! Decode attention over a KV cache as it is stored: f32, f16 or q8_0 rows, read in place.
//!
//! A query head is dotted with each cached key row and the value rows are accumulated one
//! position at a time, converting each row on the fly: no f32 copy of the cache is made. The f16
//! and q8_0 rows go through the dot and axpy kernels of [`Kernels`] (AVX2 + F16C where the CPU has
//! them), so the conversion happens in registers. The f32 path is the plain sequential sum the
//! engine has always used, so f32 caches give the same numbers as before to the bit.

use half::f16;

use super::Kernels;
use crate::kv::{KvRows, KvSpan};
use crate::quant::{DType, QK};

/// Bytes of one q8_0 block (f16 scale and 32 × i8).
const Q8_0_BLOCK_BYTES: usize = 34;

/// One query head's decode attention over `scores.len()` cached positions, read from `spans`
/// in order: `scores[p]` becomes the softmax of `q·k_p / sqrt(head_dim)` and `out` the scores'
/// weighted sum of values. Key and value `p` of this head are values `kv_off..kv_off + q.len()` of
/// row `p` (rows of `kv_stride` values). Positions the spans hold beyond `scores.len()` are
/// ignored. Positions before `first` are outside the window (a sliding-window layer; 0 sees them
/// all): they are not read, and their scores become 0.
///
/// Panics if the spans hold fewer positions than `scores`, `first` leaves no position,
/// `out` and `q` differ in length, or q8_0 rows are not whole blocks.
#[allow(clippy::too_many_arguments)]
pub fn attend_spans<'a>(
    k: &Kernels,
    q: &[f32],
    spans: impl Iterator<Item = KvSpan<'a>> + Clone,
    kv_stride: usize,
    kv_off: usize,
    first: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert!(first < scores.len(), "a window of no position");
    let hd = q.len();
    assert_eq!(out.len(), hd, "attention output of one head");
    let head = Head {
        k,
        stride: kv_stride,
        off: kv_off,
        hd,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    // Span positions `at..at + n`; the `skip` of them before the window are not read.
    let mut at = 0;
    for span in spans.clone() {
        let n = span.positions.min(scores.len() - at);
        let skip = first.saturating_sub(at).min(n);
        let keys = head.skip_rows(span.keys, skip);
        head.scores(keys, q, scale, &mut scores[at + skip..at + n]);
        at += n;
    }
    assert_eq!(
        at,
        scores.len(),
        "the KV spans hold fewer positions than scores"
    );
    scores[..first].fill(0.0);
    k.softmax(&mut scores[first..]);
    out.fill(0.0);
    let mut at = 0;
    for span in spans {
        let n = span.positions.min(scores.len() - at);
        let skip = first.saturating_sub(at).min(n);
        let values = head.skip_rows(span.values, skip);
        head.accumulate(values, &scores[at + skip..at + n], out);
        at += n;
    }
}

/// One query head's decode attention over f32 caches: [`attend_spans`] over the one span
/// `keys`/`values` (rows of `kv_stride` values).
///
/// Panics if the caches hold fewer positions than `scores`, or `out` and `q` differ in length.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    kv_stride: usize,
    kv_off: usize,
    first: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let span = KvSpan {
        keys: KvRows::F32(keys),
        values: KvRows::F32(values),
        positions: scores.len(),
    };
    attend_spans(
        Kernels::best(),
        q,
        std::iter::once(span),
        kv_stride,
        kv_off,
        first,
        scores,
        out,
    );
}

/// Where one head's `hd` values sit in a row of `stride` values (from value `off`).
struct Head<'k> {
    k: &'k Kernels,
    stride: usize,
    off: usize,
    hd: usize,
}

impl Head<'_> {
    /// Bytes of one q8_0 row and the byte range of this head in it, or `None` when the head does
    /// not start and end on block boundaries.
    fn q8_0_layout(&self) -> (usize, Option<std::ops::Range<usize>>) {
        assert!(
            self.stride.is_multiple_of(QK),
            "q8_0 rows of {} values",
            self.stride
        );
        let row = self.stride / QK * Q8_0_BLOCK_BYTES;
        let aligned = self.off.is_multiple_of(QK) && self.hd.is_multiple_of(QK);
        let range = aligned.then(|| {
            let start = self.off / QK * Q8_0_BLOCK_BYTES;
            start..start + self.hd / QK * Q8_0_BLOCK_BYTES
        });
        (row, range)
    }

    /// `rows` without its first `n` rows.
    fn skip_rows<'r>(&self, rows: KvRows<'r>, n: usize) -> KvRows<'r> {
        match rows {
            KvRows::F32(r) => KvRows::F32(&r[n * self.stride..]),
            KvRows::F16(r) => KvRows::F16(&r[2 * n * self.stride..]),
            KvRows::Q8_0(r) => KvRows::Q8_0(&r[n * self.q8_0_layout().0..]),
        }
    }

    /// `out[p] = q · key p * scale` for the first `out.len()` rows of `keys`.
    fn scores(&self, keys: KvRows<'_>, q: &[f32], scale: f32, out: &mut [f32]) {
        let (stride, off, hd) = (self.stride, self.off, self.hd);
        match keys {
            KvRows::F32(r) => {
                for (p, sc) in out.iter_mut().enumerate() {
                    let kh = &r[p * stride + off..][..hd];
                    *sc = q.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale;
                }
            }
            KvRows::F16(r) => {
                for (p, sc) in out.iter_mut().enumerate() {
                    let kh = &r[2 * (p * stride + off)..][..2 * hd];
                    *sc = self.k.dot(DType::F16, kh, q) * scale;
                }
            }
            KvRows::Q8_0(r) => {
                let (row_bytes, head) = self.q8_0_layout();
                for (p, sc) in out.iter_mut().enumerate() {
                    let row = &r[p * row_bytes..][..row_bytes];
                    let dot = match &head {
                        Some(range) => self.k.dot(DType::Q8_0, &row[range.clone()], q),
                        None => (0..hd).map(|j| q[j] * q8_0_value(row, off + j)).sum(),
                    };
                    *sc = dot * scale;
                }
            }
        }
    }

    /// `out += weights[p] * value p` for the first `weights.len()` rows of `values`, in order.
    fn accumulate(&self, values: KvRows<'_>, weights: &[f32], out: &mut [f32]) {
        let (stride, off, hd) = (self.stride, self.off, self.hd);
        match values {
            KvRows::F32(r) => {
                for (p, &sc) in weights.iter().enumerate() {
                    let vh = &r[p * stride + off..][..hd];
                    out.iter_mut().zip(vh).for_each(|(o, v)| *o += sc * v);
                }
            }
            KvRows::F16(r) => {
                for (p, &sc) in weights.iter().enumerate() {
                    let vh = &r[2 * (p * stride + off)..][..2 * hd];
                    self.k.axpy(DType::F16, vh, sc, out);
                }
            }
            KvRows::Q8_0(r) => {
                let (row_bytes, head) = self.q8_0_layout();
                for (p, &sc) in weights.iter().enumerate() {
                    let row = &r[p * row_bytes..][..row_bytes];
                    match &head {
                        Some(range) => self.k.axpy(DType::Q8_0, &row[range.clone()], sc, out),
                        None => {
                            for (j, o) in out.iter_mut().enumerate() {
                                *o += sc * q8_0_value(row, off + j);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Value `j` of a q8_0 row (for heads that do not fill whole blocks).
fn q8_0_value(row: &[u8], j: usize) -> f32 {
    let b = &row[j / QK * Q8_0_BLOCK_BYTES..][..Q8_0_BLOCK_BYTES];
    f16::from_le_bytes([b[0], b[1]]).to_f32() * f32::from(b[2 + j % QK] as i8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, quantize_row};

    /// Deterministic values in about [-1, 1].
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    /// `rows` rows of `stride` values encoded as `dtype`, and their decoded f32 values.
    fn encode(dtype: DType, x: &[f32], stride: usize) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::new();
        for row in x.chunks_exact(stride) {
            quantize_row(dtype, row, &mut bytes);
        }
        let mut decoded = vec![0f32; x.len()];
        let row_bytes = dtype.row_bytes(stride).expect("whole blocks");
        for (o, b) in decoded
            .chunks_exact_mut(stride)
            .zip(bytes.chunks_exact(row_bytes))
        {
            dequantize_row(dtype, b, o);
        }
        (bytes, decoded)
    }

    fn rows(dtype: DType, bytes: &[u8]) -> KvRows<'_> {
        match dtype {
            DType::F16 => KvRows::F16(bytes),
            DType::Q8_0 => KvRows::Q8_0(bytes),
            other => unreachable!("no {other} KV rows"),
        }
    }

    #[test]
    fn coded_rows_give_the_attention_of_their_decoded_values() {
        // Heads of 64 (block-aligned: the kernels) and of 16 (inside a block: the fallback).
        for (stride, hd) in [(192, 64), (64, 16)] {
            let n_pos = 37;
            let (keys, vals) = (values(n_pos * stride, 1), values(n_pos * stride, 2));
            let q = values(hd, 3);
            for dtype in [DType::F16, DType::Q8_0] {
                let (kb, kd) = encode(dtype, &keys, stride);
                let (vb, vd) = encode(dtype, &vals, stride);
                for off in (0..stride).step_by(hd) {
                    let (mut want, mut got) = (vec![0f32; hd], vec![0f32; hd]);
                    let (mut s1, mut s2) = (vec![0f32; n_pos], vec![0f32; n_pos]);
                    attend(&q, &kd, &vd, stride, off, 0, &mut s1, &mut want);
                    let span = KvSpan {
                        keys: rows(dtype, &kb),
                        values: rows(dtype, &vb),
                        positions: n_pos,
                    };
                    let once = std::iter::once(span);
                    attend_spans(Kernels::best(), &q, once, stride, off, 0, &mut s2, &mut got);
                    for (a, b) in want.iter().zip(&got) {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "{dtype} hd {hd} off {off}: {a} vs {b}"
                        );
                    }
                    // Far from the f32 values of a different cache: the check can fail.
                    attend(&q, &vd, &kd, stride, off, 0, &mut s1, &mut want);
                    let diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs());
                    assert!(diff.fold(0.0, f32::max) > 1e-3);
                }
            }
        }
    }

    #[test]
    fn attention_split_over_spans_equals_one_span_to_the_bit() {
        let (stride, hd, n_pos) = (64, 32, 50);
        let (keys, vals) = (values(n_pos * stride, 4), values(n_pos * stride, 5));
        let q = values(hd, 6);
        let (mut want, mut got) = (vec![0f32; hd], vec![0f32; hd]);
        let (mut s1, mut s2) = (vec![0f32; n_pos], vec![0f32; n_pos]);
        attend(&q, &keys, &vals, stride, hd, 0, &mut s1, &mut want);
        let split = 17 * stride;
        let spans = [
            KvSpan {
                keys: KvRows::F32(&keys[..split]),
                values: KvRows::F32(&vals[..split]),
                positions: 17,
            },
            KvSpan {
                keys: KvRows::F32(&keys[split..]),
                values: KvRows::F32(&vals[split..]),
                positions: n_pos - 17,
            },
        ];
        let k = Kernels::best();
        attend_spans(k, &q, spans.into_iter(), stride, hd, 0, &mut s2, &mut got);
        assert_eq!(want, got);
        assert_eq!(s1, s2);
    }

    #[test]
    fn a_window_over_coded_spans_reads_only_the_rows_it_sees() {
        // Windows starting in the first span, at the split, and in the second span.
        let (stride, hd, n_pos, split) = (64, 32, 50, 17);
        let (keys, vals) = (values(n_pos * stride, 7), values(n_pos * stride, 8));
        let q = values(hd, 9);
        let k = Kernels::best();
        for dtype in [DType::F16, DType::Q8_0] {
            let (kb, _) = encode(dtype, &keys, stride);
            let (vb, _) = encode(dtype, &vals, stride);
            let row = kb.len() / n_pos;
            let span = |from: usize, to: usize| KvSpan {
                keys: rows(dtype, &kb[from * row..to * row]),
                values: rows(dtype, &vb[from * row..to * row]),
                positions: to - from,
            };
            for first in [3, split, 30] {
                let (mut scores, mut got) = (vec![0f32; n_pos], vec![0f32; hd]);
                let spans = [span(0, split), span(split, n_pos)];
                attend_spans(
                    k,
                    &q,
                    spans.into_iter(),
                    stride,
                    0,
                    first,
                    &mut scores,
                    &mut got,
                );
                let (mut tail, mut want) = (vec![0f32; n_pos - first], vec![0f32; hd]);
                let once = std::iter::once(span(first, n_pos));
                attend_spans(k, &q, once, stride, 0, 0, &mut tail, &mut want);
                assert_eq!(got, want, "{dtype} first {first}");
                assert!(scores[..first].iter().all(|&s| s == 0.0));
                assert_eq!(scores[first..], tail[..], "{dtype} first {first}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "fewer positions")]
    fn spans_shorter_than_the_scores_are_refused() {
        let (stride, hd) = (32, 32);
        let (keys, vals) = (values(4 * stride, 1), values(4 * stride, 2));
        let span = KvSpan {
            keys: KvRows::F32(&keys),
            values: KvRows::F32(&vals),
            positions: 4,
        };
        let (mut scores, mut out) = (vec![0f32; 5], vec![0f32; hd]);
        let q = values(hd, 3);
        let once = std::iter::once(span);
        attend_spans(
            Kernels::best(),
            &q,
            once,
            stride,
            0,
            0,
            &mut scores,
            &mut out,
        );
    }

    #[test]
    fn a_window_attends_as_if_the_earlier_positions_were_not_cached() {
        let (stride, hd, n, first) = (64, 32, 9, 5);
        let (keys, vals) = (values(n * stride, 4), values(n * stride, 5));
        let q = values(hd, 6);
        let (mut scores, mut got) = (vec![0f32; n], vec![0f32; hd]);
        attend(&q, &keys, &vals, stride, hd, first, &mut scores, &mut got);
        let (mut tail_scores, mut want) = (vec![0f32; n - first], vec![0f32; hd]);
        let (k_tail, v_tail) = (&keys[first * stride..], &vals[first * stride..]);
        attend(
            &q,
            k_tail,
            v_tail,
            stride,
            hd,
            0,
            &mut tail_scores,
            &mut want,
        );
        assert_eq!(got, want);
        assert!(scores[..first].iter().all(|&s| s == 0.0), "{scores:?}");
        assert_eq!(scores[first..], tail_scores[..]);
    }
}
