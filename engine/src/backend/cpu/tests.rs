//! Conformance of every kernel table present (scalar always; AVX2, NEON and NEON with dotprod where
//! the CPU has them) against the scalar oracle `quant::dequantize_row` + an f64 dot product, by
//! error normalised by `Σ|w·x|`.

use proptest::prelude::*;

use super::*;
use crate::model::TensorBytes;
use crate::quant::{dequantize_row, quantize_row};

mod tiles;

const DTYPES: [DType; 13] = DType::ALL;

/// `cols` rounded up to whole blocks of `dtype`: the shapes below are chosen for 32-value blocks
/// (odd block counts, rows that are not a multiple of the SIMD width); the 256-value k-quant
/// super-blocks get the next width that fits.
fn width(dtype: DType, cols: usize) -> usize {
    cols.next_multiple_of(dtype.block_len())
}

/// The tables to test: every one this CPU supports, scalar first.
fn tables() -> Vec<&'static Kernels> {
    Kernels::supported()
}

/// SplitMix64: small, seeded, good enough for test data.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in [-scale, scale).
    pub(super) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

fn quantized(dtype: DType, w: &[f32]) -> Vec<u8> {
    let mut row = Vec::new();
    quantize_row(dtype, w, &mut row);
    row
}

/// (Σ w·x, Σ|w·x|) in f64 over the dequantised row.
fn oracle(dtype: DType, row: &[u8], x: &[f32]) -> (f64, f64) {
    let mut w = vec![0f32; x.len()];
    dequantize_row(dtype, row, &mut w);
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (w, x)| {
        let p = f64::from(*w) * f64::from(*x);
        (s + p, a + p.abs())
    })
}

fn tolerance(dtype: DType, precision: Precision) -> f64 {
    if precision == Precision::Fast && !dtype.is_float() {
        1e-2
    } else {
        1e-5
    }
}

/// Asserts `got` is within `tol · Σ|w·x|` of the oracle (and exactly 0 when that is 0).
#[track_caller]
fn check(what: &str, got: f32, (want, scale): (f64, f64), tol: f64) {
    let err = (f64::from(got) - want).abs();
    assert!(
        err <= tol * scale,
        "{what}: got {got}, want {want}, error {err:.3e} > {tol:.0e} × Σ|w·x| = {scale:.3e}"
    );
}

/// The worst case of 8-bit activation quantisation: each `x[j]` moves by at most half its block's
/// step `amax / 127`, so the fast result may differ by `Σ|w[j]|·step/2` (plus float rounding). A
/// single product that dominates a sum can make this exceed 1e-2 relative, so the extreme-value
/// tests use this bound and the random-data tests the plain 1e-2.
fn fast_bound(dtype: DType, row: &[u8], x: &[f32]) -> f64 {
    let mut w = vec![0f32; x.len()];
    dequantize_row(dtype, row, &mut w);
    let (_, scale) = oracle(dtype, row, x);
    let mut bound = 1e-5 * scale;
    for (wb, xb) in w.chunks(QK).zip(x.chunks(QK)) {
        let step = f64::from(xb.iter().fold(0f32, |a, v| a.max(v.abs()))) / 127.0;
        bound += wb.iter().map(|w| f64::from(w.abs())).sum::<f64>() * step * 0.5 * 1.001;
    }
    bound
}

fn check_dot(
    k: &Kernels,
    dtype: DType,
    row: &[u8],
    x: &[f32],
    acts: &mut QuantizedActs,
    what: &str,
    extreme: bool,
) {
    let want = oracle(dtype, row, x);
    let name = k.name();
    check(
        &format!("{name} dot {dtype} {what}"),
        k.dot(dtype, row, x),
        want,
        tolerance(dtype, Precision::Exact),
    );
    acts.quantize_with(k, x);
    let got = k.dot_q8(dtype, row, acts);
    let what = format!("{name} dot_q8 {dtype} {what}");
    if extreme && !dtype.is_float() {
        let err = (f64::from(got) - want.0).abs();
        let bound = fast_bound(dtype, row, x);
        assert!(
            err <= bound,
            "{what}: got {got}, want {}, error {err:.3e} > {bound:.3e}",
            want.0
        );
    } else {
        check(&what, got, want, tolerance(dtype, Precision::Fast));
    }
}

#[test]
fn dot_matches_oracle_for_every_length() {
    let mut rng = Rng(1);
    let mut acts = QuantizedActs::new(4096);
    for k in tables() {
        for dtype in DTYPES {
            for n in (dtype.block_len().max(32)..=4096).step_by(dtype.block_len().max(32)) {
                let row = quantized(dtype, &rng.vec(n, 0.5));
                let x = rng.vec(n, 2.0);
                check_dot(k, dtype, &row, &x, &mut acts, &format!("n={n}"), false);
            }
        }
    }
}

#[test]
fn float_rows_of_odd_length() {
    let mut rng = Rng(2);
    for k in tables() {
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            for n in [1, 7, 8, 9, 15, 16, 17, 33, 100] {
                let row = quantized(dtype, &rng.vec(n, 1.0));
                let x = rng.vec(n, 1.0);
                let want = oracle(dtype, &row, &x);
                check(
                    &format!("{} {dtype} n={n}", k.name()),
                    k.dot(dtype, &row, &x),
                    want,
                    1e-5,
                );
                let mut out = rng.vec(n, 1.0);
                let mut expect = out.clone();
                axpy_oracle(dtype, &row, -0.75, &mut expect);
                k.axpy(dtype, &row, -0.75, &mut out);
                assert_close(&out, &expect, &format!("{} axpy {dtype} n={n}", k.name()));
            }
        }
    }
}

#[test]
fn dot_handles_extreme_values() {
    let mut rng = Rng(3);
    let mut acts = QuantizedActs::new(1024);
    let n = 1024;
    let outlier = |rng: &mut Rng| {
        let mut v = rng.vec(n, 1e-3);
        v[37] = 1e3;
        v[500] = -2e3;
        v
    };
    for k in tables() {
        for dtype in DTYPES {
            let weights: [(&str, Vec<f32>); 4] = [
                ("zero w", vec![0.0; n]),
                ("large w", rng.vec(n, 3e4)),
                ("tiny w", rng.vec(n, 1e-3)),
                ("outlier w", outlier(&mut rng)),
            ];
            let acts_cases: [(&str, Vec<f32>); 4] = [
                ("zero x", vec![0.0; n]),
                ("large x", rng.vec(n, 1e4)),
                ("tiny x", rng.vec(n, 1e-6)),
                ("outlier x", outlier(&mut rng)),
            ];
            for (wn, w) in &weights {
                let row = quantized(dtype, w);
                for (xn, x) in &acts_cases {
                    check_dot(k, dtype, &row, x, &mut acts, &format!("{wn}, {xn}"), true);
                }
            }
        }
    }
}

#[test]
fn fast_path_is_integer_exact_on_quantised_activations() {
    // With activations that are already 8-bit (x = d·q), the fast path has no quantisation error
    // left, so it must agree with the oracle as tightly as the exact one.
    let mut rng = Rng(4);
    let mut acts = QuantizedActs::new(768);
    for k in tables() {
        for dtype in DTYPES.into_iter().filter(|d| !d.is_float()) {
            let row = quantized(dtype, &rng.vec(768, 1.0));
            let x: Vec<f32> = (0..768)
                .map(|j| {
                    if j % 32 == 0 {
                        127.0
                    } else {
                        ((rng.next() % 255) as f32) - 127.0
                    }
                })
                .collect();
            acts.quantize_with(k, &x);
            let want = oracle(dtype, &row, &x);
            check(
                &format!("{} {dtype}", k.name()),
                k.dot_q8(dtype, &row, &acts),
                want,
                1e-5,
            );
        }
    }
}

fn axpy_oracle(dtype: DType, row: &[u8], a: f32, out: &mut [f32]) {
    let mut w = vec![0f32; out.len()];
    dequantize_row(dtype, row, &mut w);
    for (o, w) in out.iter_mut().zip(&w) {
        *o = (f64::from(*o) + f64::from(a) * f64::from(*w)) as f32;
    }
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{what}: [{j}] got {g}, want {w}"
        );
    }
}

#[test]
fn axpy_matches_oracle() {
    let mut rng = Rng(5);
    for k in tables() {
        for dtype in DTYPES {
            let step = if dtype.is_float() {
                32 * 7
            } else {
                dtype.block_len() * 7
            };
            for n in (dtype.block_len().max(32)..=4096).step_by(step) {
                let row = quantized(dtype, &rng.vec(n, 1.0));
                let a = rng.unit() * 3.0;
                let mut out = rng.vec(n, 2.0);
                let mut want = out.clone();
                axpy_oracle(dtype, &row, a, &mut want);
                k.axpy(dtype, &row, a, &mut out);
                assert_close(&out, &want, &format!("{} axpy {dtype} n={n}", k.name()));
            }
        }
    }
}

/// A matrix of random rows of `dtype`; with `strided`, rows sit in groups of 5 with padding
/// between rows and between groups, as in the `.lsm` bundles.
fn matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, strided: bool) -> QRows {
    let rb = dtype.row_bytes(cols).expect("whole blocks");
    if !strided {
        let mut data = Vec::new();
        for _ in 0..rows {
            quantize_row(dtype, &rng.vec(cols, 1.0), &mut data);
        }
        return QRows::contiguous(dtype, rows, cols, TensorBytes::from_vec(data)).expect("shape");
    }
    let (group_rows, row_stride, first) = (5, rb + 8, 3);
    let group_stride = group_rows * row_stride + 40;
    let mut data = vec![0xAAu8; first + rows.div_ceil(group_rows) * group_stride];
    for i in 0..rows {
        let at = first + (i / group_rows) * group_stride + (i % group_rows) * row_stride;
        let mut row = Vec::new();
        quantize_row(dtype, &rng.vec(cols, 1.0), &mut row);
        data[at..at + rb].copy_from_slice(&row);
    }
    let bytes = TensorBytes::from_vec(data);
    QRows::strided(
        dtype,
        rows,
        cols,
        bytes,
        first,
        row_stride,
        group_rows,
        group_stride,
    )
    .expect("layout")
}

#[test]
fn matvec_and_matvec_rows_match_oracle() {
    let mut rng = Rng(6);
    let mut scratch = QuantizedActs::new(768);
    for k in tables() {
        for dtype in DTYPES {
            for (rows, cols, strided) in [
                (1, 32, false),
                (3, 64, true),
                (63, 96, false),
                (65, 576, true),
                (129, 128, false),
                (1001, 576, false),
                (777, 160, true),
            ] {
                let cols = width(dtype, cols);
                let m = matrix(&mut rng, dtype, rows, cols, strided);
                let x = rng.vec(cols, 1.0);
                let wants: Vec<_> = (0..rows).map(|i| oracle(dtype, m.row(i), &x)).collect();
                let picked: Vec<u32> = (0..rows as u32 * 2 / 3)
                    .map(|_| (rng.next() % rows as u64) as u32)
                    .collect();
                for precision in [Precision::Exact, Precision::Fast] {
                    let tol = tolerance(dtype, precision);
                    let what = format!("{} {dtype} {rows}x{cols} {precision:?}", k.name());
                    let mut out = vec![f32::NAN; rows];
                    k.matvec(&m, &x, &mut out, precision, &mut scratch);
                    for (i, got) in out.iter().enumerate() {
                        check(&format!("{what} row {i}"), *got, wants[i], tol);
                    }
                    let mut out = vec![f32::NAN; picked.len()];
                    k.matvec_rows(&m, &picked, &x, &mut out, precision, &mut scratch);
                    for (got, &r) in out.iter().zip(&picked) {
                        check(
                            &format!("{what} gathered row {r}"),
                            *got,
                            wants[r as usize],
                            tol,
                        );
                    }
                }
            }
        }
    }
}

/// `matvecs`/`matmats` (fused, batched) give every token the bits `matvec` gives it alone, with
/// row counts that do not divide into `FUSED_ROWS` items and several matrices in one region.
#[test]
fn fused_and_batched_matvecs_match_matvec() {
    let mut rng = Rng(9);
    for k in tables() {
        for dtype in DTYPES {
            let cols = width(dtype, 96);
            let (a, b) = (
                matrix(&mut rng, dtype, 70, cols, false),
                matrix(&mut rng, dtype, 33, cols, true),
            );
            for n in [1, 3] {
                let x = rng.vec(n * cols, 1.0);
                for precision in [Precision::Exact, Precision::Fast] {
                    let mut scratch = QuantizedActs::new(n * cols);
                    let (mut oa, mut ob) = (vec![f32::NAN; n * 70], vec![f32::NAN; n * 33]);
                    let prepared = k.prepare(&x, precision, &mut scratch);
                    k.matmats(prepared, n, [(&a, &mut oa[..]), (&b, &mut ob[..])]);
                    let mut single = QuantizedActs::new(cols);
                    for t in 0..n {
                        let xt = &x[t * cols..(t + 1) * cols];
                        for (m, out) in [(&a, &oa), (&b, &ob)] {
                            let mut want = vec![0f32; m.rows];
                            k.matvec(m, xt, &mut want, precision, &mut single);
                            let got = &out[t * m.rows..(t + 1) * m.rows];
                            assert_eq!(
                                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                "{} {dtype} {precision:?} token {t} of {n}, {} rows",
                                k.name(),
                                m.rows
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn free_functions_use_the_best_table() {
    let mut rng = Rng(7);
    let m = matrix(&mut rng, DType::Q4_1, 200, 576, false);
    let x = rng.vec(576, 1.0);
    let mut scratch = QuantizedActs::new(576);
    for precision in [Precision::Exact, Precision::Fast] {
        let mut a = vec![0f32; 200];
        let mut b = vec![0f32; 200];
        matvec(&m, &x, &mut a, precision, &mut scratch);
        Kernels::best().matvec(&m, &x, &mut b, precision, &mut scratch);
        assert_eq!(a, b, "{precision:?}");
    }
    assert_eq!(kernel_name(), Kernels::best().name());
    // scripts/test-aarch64 names the table each emulated CPU must get.
    if let Ok(want) = std::env::var("LEANSTREAM_EXPECT_KERNELS") {
        assert_eq!(kernel_name(), want, "LEANSTREAM_EXPECT_KERNELS");
    }
    #[cfg(target_arch = "x86_64")]
    {
        let simd = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        assert_eq!(kernel_name() != "scalar", simd, "{}", kernel_name());
    }
    #[cfg(target_arch = "aarch64")]
    {
        let want = if std::arch::is_aarch64_feature_detected!("dotprod") {
            "neon+dotprod"
        } else {
            "neon"
        };
        assert_eq!(kernel_name(), want);
    }
}

#[test]
fn supported_tables_start_with_scalar_and_end_with_the_best() {
    let t = tables();
    assert!(std::ptr::eq(t[0], Kernels::scalar()));
    assert!(std::ptr::eq(t[t.len() - 1], Kernels::best()));
    let mut names: Vec<_> = t.iter().map(|k| k.name()).collect();
    names.dedup();
    assert_eq!(names.len(), t.len(), "a table listed twice: {names:?}");
}

/// The `sdot` integer kernels fill the same i32 lanes as the plain NEON ones and share the rest,
/// so the two tables agree bit for bit (where the CPU has both).
#[test]
#[cfg(target_arch = "aarch64")]
fn neon_tables_agree_bit_for_bit() {
    let t = tables();
    let (Some(plain), Some(sdot)) = (
        t.iter().find(|k| k.name() == "neon"),
        t.iter().find(|k| k.name() == "neon+dotprod"),
    ) else {
        eprintln!("skipped: this CPU has no dotprod");
        return;
    };
    let mut rng = Rng(10);
    let mut acts = QuantizedActs::new(1024);
    for dtype in DTYPES.into_iter().filter(|d| !d.is_float()) {
        for n in [256, 1024] {
            // Raw random blocks reach every quant value, including -128 for q8_0.
            let mut row: Vec<u8> = (0..dtype.row_bytes(n).expect("whole blocks"))
                .map(|_| rng.next() as u8)
                .collect();
            for b in row.chunks_exact_mut(dtype.block_bytes()) {
                for &at in dtype.f16_fields() {
                    b[at..at + 2].copy_from_slice(&half::f16::from_f32(rng.unit()).to_le_bytes());
                }
            }
            let mut x = rng.vec(n, 1.0);
            x[0] = 4.0; // one block whose largest value quantises to exactly 127
            acts.quantize_with(plain, &x);
            let (a, b) = (
                plain.dot_q8(dtype, &row, &acts),
                sdot.dot_q8(dtype, &row, &acts),
            );
            assert_eq!(a.to_bits(), b.to_bits(), "{dtype} n={n}: {a} vs {b}");
            assert!(a.is_finite() && a != 0.0, "{dtype} n={n}: {a}");
        }
    }
}

#[test]
fn quantize_is_the_same_in_every_table_and_does_not_reallocate() {
    let mut rng = Rng(8);
    let mut a = QuantizedActs::new(1536);
    let mut b = QuantizedActs::new(1536);
    let (xp, bp) = (a.x.as_ptr(), a.blocks.as_ptr());
    for n in [0, 5, 32, 45, 576, 1536] {
        let mut x = rng.vec(n, 3.0);
        if n > 40 {
            x[33..40].fill(0.0); // a partly zero block
        }
        a.quantize_with(Kernels::scalar(), &x);
        for k in tables() {
            b.quantize_with(k, &x);
            let bits = |q: &QuantizedActs| {
                let b = q.blocks();
                b.iter()
                    .map(|b| (b.d.to_bits(), b.s.to_bits(), b.sum, b.q))
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&a), bits(&b), "{} n={n}", k.name());
        }
        assert_eq!(a.len(), n);
        assert_eq!(a.values(), &x[..]);
        for (blk, xb) in a.blocks().iter().zip(x.chunks(QK)) {
            let sum: i32 = blk.q.iter().map(|&q| i32::from(q)).sum();
            assert_eq!((blk.sum, blk.s), (sum, blk.d * sum as f32));
            for (q, v) in blk.q.iter().zip(xb) {
                assert!((f32::from(*q) * blk.d - v).abs() <= blk.d * 0.5 + 1e-6);
            }
        }
    }
    assert_eq!(
        (xp, bp),
        (a.x.as_ptr(), a.blocks.as_ptr()),
        "scratch reallocated"
    );
}

#[test]
fn quantize_rounds_ties_to_even_in_every_table() {
    // amax = 127 makes d = 1 exactly, so every x.5 below is a tie.
    let mut x = [0f32; 2 * QK];
    let ties = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5];
    x[..ties.len()].copy_from_slice(&ties);
    x[QK..QK + ties.len()].copy_from_slice(&ties.map(|v| -v));
    let mut want = [0i8; QK];
    want[..ties.len()].copy_from_slice(&[127, 0, 2, 2, 0, -2, -2, 126, -126, 4]);
    let sum: i32 = want.iter().map(|&q| i32::from(q)).sum();
    let mut acts = QuantizedActs::new(x.len());
    for k in tables() {
        acts.quantize_with(k, &x);
        let [b0, b1] = acts.blocks() else {
            panic!("two blocks")
        };
        assert_eq!(
            (b0.d, b0.s, b0.sum, b0.q),
            (1.0, sum as f32, sum, want),
            "{}",
            k.name()
        );
        assert_eq!(
            (b1.d, b1.s, b1.sum, b1.q),
            (1.0, -sum as f32, -sum, want.map(|q| -q)),
            "{}",
            k.name()
        );
    }
}

#[test]
#[should_panic(expected = "values need")]
fn short_row_is_rejected() {
    let row = quantized(DType::Q8_0, &[0.5; 32]);
    let _ = dot(DType::Q8_0, &row, &[1.0; 64]);
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(DTYPES.to_vec())
}

proptest! {
    /// Random block contents: any quant bytes, finite scales over many magnitudes.
    #[test]
    fn dot_matches_oracle_on_random_blocks(
        dtype in dtype_strategy(),
        blocks in 1usize..12,
        seed in any::<u64>(),
        scale_exp in -12i32..12,
    ) {
        let mut rng = Rng(seed);
        let n = blocks * dtype.block_len().max(QK);
        let scale = 2f32.powi(scale_exp);
        let row: Vec<u8> = if dtype.block_len() == 1 {
            quantized(dtype, &rng.vec(n, scale))
        } else {
            let mut row: Vec<u8> = (0..dtype.row_bytes(n).unwrap_or(0))
                .map(|_| rng.next() as u8)
                .collect();
            for b in row.chunks_exact_mut(dtype.block_bytes()) {
                for &at in dtype.f16_fields() {
                    let v = half::f16::from_f32(rng.unit() * scale).to_le_bytes();
                    b[at..at + 2].copy_from_slice(&v);
                }
            }
            row
        };
        let x = rng.vec(n, 1.0);
        let mut acts = QuantizedActs::new(n);
        for k in tables() {
            let want = oracle(dtype, &row, &x);
            let got = k.dot(dtype, &row, &x);
            let err = (f64::from(got) - want.0).abs();
            prop_assert!(err <= 1e-5 * want.1, "{} {dtype}: {got} vs {}", k.name(), want.0);
            acts.quantize_with(k, &x);
            let got = k.dot_q8(dtype, &row, &acts);
            let err = (f64::from(got) - want.0).abs();
            prop_assert!(
                err <= tolerance(dtype, Precision::Fast) * want.1,
                "{} fast {dtype}: {got} vs {}", k.name(), want.0
            );
        }
    }
}

#[test]
fn dense_helpers_match_f64() {
    let mut rng = Rng(9);
    for n in [1, 7, 8, 576, 1001] {
        let x = rng.vec(n, 3.0);
        let w = rng.vec(n, 1.0);
        let mut out = vec![0f32; n];
        rmsnorm(&mut out, &x, &w, 1e-5);
        let ms = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n as f64;
        let scale = 1.0 / (ms + 1e-5).sqrt();
        for j in 0..n {
            let want = f64::from(x[j]) * scale * f64::from(w[j]);
            assert!(
                (f64::from(out[j]) - want).abs() <= 1e-5 * want.abs().max(1.0),
                "rmsnorm"
            );
        }

        let mut s = x.clone();
        softmax_inplace(&mut s);
        let max = x.iter().fold(f64::MIN, |m, v| m.max(f64::from(*v)));
        let z: f64 = x.iter().map(|v| (f64::from(*v) - max).exp()).sum();
        for j in 0..n {
            let want = (f64::from(x[j]) - max).exp() / z;
            assert!((f64::from(s[j]) - want).abs() <= 1e-6, "softmax");
        }

        let mut g = x.clone();
        silu_mul(&mut g, &w);
        for j in 0..n {
            let gj = f64::from(x[j]);
            let want = gj / (1.0 + (-gj).exp()) * f64::from(w[j]);
            assert!(
                (f64::from(g[j]) - want).abs() <= 1e-5 * want.abs().max(1.0),
                "silu"
            );
        }

        let mut a = x.clone();
        add_inplace(&mut a, &w);
        for j in 0..n {
            assert_eq!(a[j], x[j] + w[j], "add");
        }
    }
    let mut big = [1000.0f32, 0.0, -1000.0];
    softmax_inplace(&mut big);
    assert_eq!(big, [1.0, 0.0, 0.0]);
}

/// The shared conformance bodies (`backend/conformance.rs`) on the CPU backend.
mod conformance {
    use crate::backend::ops::CpuOps;

    crate::conformance_tests!(|_: &str| Some(CpuOps));
}

/// A backend whose mat-vec is off by one part in a thousand: the conformance bodies must catch
/// it (they are not checks that cannot fail).
mod conformance_catches_errors {
    use crate::Result;
    use crate::backend::conformance;
    use crate::backend::ops::{AttentionShape, CpuOps, FfnChunks, FfnOutput, KernelOps, Matrix};
    use crate::model::{FfnActivation, RopeStyle};

    struct Skewed;

    impl KernelOps for Skewed {
        fn name(&self) -> String {
            "skewed".into()
        }
        fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>> {
            CpuOps.rmsnorm(x, w, eps)
        }
        fn gate(&self, a: FfnActivation, g: &[f32], u: &[f32]) -> Result<Vec<f32>> {
            CpuOps.gate(a, g, u)
        }
        fn add(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
            CpuOps.add(a, b)
        }
        fn matvec(&self, w: Matrix<'_>, x: &[f32], bias: Option<&[f32]>) -> Result<Vec<f32>> {
            let y = CpuOps.matvec(w, x, bias)?;
            Ok(y.iter().map(|v| v * 1.001).collect())
        }
        fn rope(
            &self,
            x: &[f32],
            hd: usize,
            pos: usize,
            f: &[f32],
            s: RopeStyle,
        ) -> Result<Vec<f32>> {
            // Off by one position: a real bug a kernel could have.
            CpuOps.rope(x, hd, pos + 1, f, s)
        }
        fn attention_decode(
            &self,
            q: &[f32],
            k: &[f32],
            v: &[f32],
            s: AttentionShape,
        ) -> Result<Vec<f32>> {
            // Forgets the sliding window.
            CpuOps.attention_decode(q, k, v, AttentionShape { first: 0, ..s })
        }
        fn ffn_chunks(&self, f: &FfnChunks<'_>) -> Result<FfnOutput> {
            // Forgets the threshold.
            CpuOps.ffn_chunks(&FfnChunks {
                threshold: 0.0,
                ..*f
            })
        }
        fn argmax(&self, logits: &[f32]) -> Result<u32> {
            CpuOps.argmax(logits)
        }
        fn top_k(&self, logits: &[f32], k: usize) -> Result<Vec<(u32, f32)>> {
            CpuOps.top_k(logits, k)
        }
    }

    #[test]
    #[should_panic(expected = "matvec")]
    fn a_skewed_matvec_fails() {
        conformance::matvec(&Skewed);
    }

    #[test]
    #[should_panic(expected = "rope")]
    fn a_rope_at_the_wrong_position_fails() {
        conformance::rope(&Skewed);
    }

    #[test]
    #[should_panic(expected = "attention over 295..300, heads of 64")]
    fn attention_that_ignores_the_window_fails() {
        conformance::attention_decode(&Skewed);
    }

    #[test]
    #[should_panic(expected = "threshold")]
    fn an_ffn_that_ignores_the_threshold_fails() {
        conformance::ffn_chunks(&Skewed);
    }
}

/// Every table's integer kernels compute what the scalar ones compute from the same quantised
/// activations, to float rounding: the fast path's tolerance against the f32 oracle
/// ([`tolerance`]) is loose enough to hide a wrong scale or offset term, this is not.
#[test]
fn integer_kernels_match_the_scalar_integer_kernels() {
    let mut rng = Rng(11);
    let scalar = Kernels::scalar();
    for k in tables() {
        for dtype in DTYPES.into_iter().filter(|d| !d.is_float()) {
            for blocks in [1, 3, 4, 5, 18, 48] {
                let cols = width(dtype, 32 * blocks);
                let mut row = Vec::new();
                quantize_row(dtype, &rng.vec(cols, 1.0), &mut row);
                let mut acts = QuantizedActs::new(cols);
                acts.quantize_with(scalar, &rng.vec(cols, 1.0));
                let (want, got) = (
                    scalar.dot_q8(dtype, &row, &acts),
                    k.dot_q8(dtype, &row, &acts),
                );
                let scale = acts
                    .blocks()
                    .iter()
                    .map(|b| b.d.abs())
                    .sum::<f32>()
                    .max(1.0);
                assert!(
                    (got - want).abs() <= 1e-4 * scale * 127.0,
                    "{} {dtype} {cols} values: {got} vs scalar {want}",
                    k.name()
                );
            }
        }
    }
}

/// The many-token path of every table ([`Kernels::rows_dot_each`], which pads the last group of
/// eight rows and splits the tokens into groups) gives each (row, token) pair exactly the result
/// of a one-row kernel: the scalar one where the table has an eight-row kernel for the type (which
/// rounds as the scalar one does), else the table's own. On contiguous and strided matrices whose
/// row count is not a multiple of eight, for one token and for more than one group of tokens.
#[test]
fn row_groups_equal_the_scalar_kernel_bit_for_bit() {
    let mut rng = Rng(23);
    let scalar = Kernels::scalar();
    for k in tables() {
        for dtype in DTYPES.into_iter().filter(|d| !d.is_float()) {
            let one_row = match k.dot_q8_x8[dtype_index(dtype)] {
                Some(_) => scalar,
                None => k,
            };
            for (rows, blocks, strided) in [(1, 1, false), (13, 3, true), (29, 18, false)] {
                let cols = width(dtype, 32 * blocks);
                let m = matrix(&mut rng, dtype, rows, cols, strided);
                for n_tokens in [1, 3, TOKEN_GROUP] {
                    let x = rng.vec(n_tokens * cols, 2.0);
                    let mut scratch = QuantizedActs::new(x.len());
                    let prepared = k.prepare(&x, Precision::Fast, &mut scratch);
                    let first = rows / 3;
                    let mut got = vec![vec![f32::NAN; rows - first]; n_tokens];
                    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| &mut o[..]).collect();
                    k.rows_dot_each(&m, first, prepared, &mut outs);
                    for (t, out) in got.iter().enumerate() {
                        let mut acts = QuantizedActs::new(cols);
                        acts.quantize_with(scalar, &x[t * cols..(t + 1) * cols]);
                        for (i, &g) in out.iter().enumerate() {
                            let want = one_row.dot_q8(dtype, m.row(first + i), &acts);
                            assert_eq!(
                                g.to_bits(),
                                want.to_bits(),
                                "{} {dtype} row {} of {rows}, token {t} of {n_tokens}: {g} vs {want}",
                                k.name(),
                                first + i
                            );
                        }
                    }
                }
            }
        }
    }
}

/// In both precisions a batch gives each token exactly what [`Kernels::rows_dot`] gives it alone
/// (the eight-row kernels' sums do not depend on the other rows or tokens of a call), and the
/// exact eight-row kernels stay within the exact path's tolerance of the oracle.
#[test]
fn a_batch_gives_each_token_its_own_results() {
    let mut rng = Rng(29);
    for k in tables() {
        for dtype in DTYPES {
            for (rows, blocks) in [(3, 1), (21, 6)] {
                let cols = width(dtype, 32 * blocks);
                let m = matrix(&mut rng, dtype, rows, cols, false);
                for precision in [Precision::Exact, Precision::Fast] {
                    let n_tokens = 5;
                    let x = rng.vec(n_tokens * cols, 1.0);
                    let mut scratch = QuantizedActs::new(x.len());
                    let batch = k.prepare(&x, precision, &mut scratch);
                    let mut got = vec![vec![f32::NAN; rows]; n_tokens];
                    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| &mut o[..]).collect();
                    k.rows_dot_each(&m, 0, batch, &mut outs);
                    for (t, got) in got.iter().enumerate() {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let mut alone = QuantizedActs::new(cols);
                        let mut want = vec![f32::NAN; rows];
                        k.rows_dot(&m, 0, k.prepare(xt, precision, &mut alone), &mut want);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(got),
                            bits(&want),
                            "{} {dtype} {precision:?} token {t}",
                            k.name()
                        );
                        if precision == Precision::Exact {
                            for (r, &g) in got.iter().enumerate() {
                                let what = format!("{} {dtype} exact row {r}", k.name());
                                check(
                                    &what,
                                    g,
                                    oracle(dtype, m.row(r), xt),
                                    tolerance(dtype, precision),
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
