//! The CUDA kernels against the CPU kernels, by normalised error (feature `cuda`). They need a
//! GPU and its driver; without one every test says it is skipped and why, and passes.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

use leanstream_engine::backend::cpu::{self, Kernels};
use leanstream_engine::backend::cuda::CudaBackend;
use leanstream_engine::quant::{DType, quantize_row};
use leanstream_engine::sample::argmax;

/// The backend, or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("{test}: skipped, no usable GPU ({e})");
            None
        }
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i ^ seed).wrapping_mul(2654435761).rotate_left(13);
            (h % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// ‖a − b‖ / ‖b‖.
fn normalised_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let norm: f32 = b.iter().map(|y| y * y).sum();
    (diff / norm.max(f32::MIN_POSITIVE)).sqrt()
}

#[test]
fn rmsnorm_matches_the_cpu() {
    let Some(g) = gpu("rmsnorm") else { return };
    let (x, w) = (values(3 * 576, 1), values(576, 2));
    let got = g.rmsnorm(&x, &w, 1e-5).unwrap();
    let mut want = vec![0.0; x.len()];
    for (o, r) in want.chunks_mut(576).zip(x.chunks(576)) {
        cpu::rmsnorm(o, r, &w, 1e-5);
    }
    let e = normalised_error(&got, &want);
    assert!(e < 1e-5, "{e}");
}

#[test]
fn elementwise_kernels_match_the_cpu() {
    let Some(g) = gpu("elementwise") else { return };
    let (a, b) = (values(1000, 3), values(1000, 4));
    let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert!(normalised_error(&g.add(&a, &b).unwrap(), &sum) < 1e-6);
    let silu: Vec<f32> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| x / (1.0 + (-x).exp()) * y)
        .collect();
    assert!(normalised_error(&g.silu_mul(&a, &b).unwrap(), &silu) < 1e-5);
}

#[test]
fn matvec_matches_the_cpu_in_every_type() {
    let Some(g) = gpu("matvec") else { return };
    let (rows, cols) = (40, 576);
    let x = values(cols, 5);
    let k = Kernels::best();
    for dtype in DType::ALL {
        let mut w = Vec::new();
        for r in 0..rows {
            quantize_row(dtype, &values(cols, 100 + r as u32), &mut w);
        }
        let row_bytes = dtype.row_bytes(cols).unwrap();
        let want: Vec<f32> = w
            .chunks(row_bytes)
            .map(|row| k.dot(dtype, row, &x))
            .collect();
        let got = g.matvec(&w, dtype, rows, cols, &x).unwrap();
        let e = normalised_error(&got, &want);
        assert!(e < 1e-4, "{dtype:?}: {e}");
    }
}

#[test]
fn argmax_matches_the_sampler_including_ties() {
    let Some(g) = gpu("argmax") else { return };
    let mut logits = values(49152, 6);
    logits[31000] = 5.0;
    logits[40000] = 5.0; // a tie: the lower index wins, as in the sampler
    assert_eq!(g.argmax(&logits).unwrap(), argmax(&logits));
    assert_eq!(argmax(&logits), 31000);
}
