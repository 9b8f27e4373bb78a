//! Mat-vec throughput of the CPU kernels, in GB/s of weights streamed (criterion's "thrpt").
//!
//! Every stored type, with the scalar table and the best one for this CPU, in both precisions, on
//! two shapes 1536 values wide (SmolLM2-135M's FFN width, a whole number of k-quant
//! super-blocks): 576 rows (its down projection: the weights stay in cache, so this is the
//! kernels' compute speed) and 32768 rows (an output head: tens of MB read from memory, so this
//! is the speed against the bandwidth bound; compare with `target/release/examples/membw`).
//! `.../Fast/tiles` is the best table on the same matrix stored as tiles (what a load for the
//! fast path stores for the 32-value block types).
//! `matmat16/...` runs a batch of 16 tokens through the best table (counted as 16 reads of the
//! weights, so its GB/s compare with the one-token figures).
//! Run: `cargo bench -p leanstream-engine --bench kernels` (add `-- --quick` for a short pass, or
//! a filter such as `-- q4_k` for one type).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use leanstream_engine::backend::cpu::{Kernels, Precision, QuantizedActs};
use leanstream_engine::model::{QRows, TensorBytes};
use leanstream_engine::quant::{DType, quantize_row, tiles};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn matrix(dtype: DType, rows: usize, cols: usize) -> QRows {
    let mut data = Vec::new();
    quantize_row(dtype, &values(rows * cols, 7), &mut data);
    QRows::contiguous(dtype, rows, cols, TensorBytes::from_vec(data))
        .expect("bench matrix shape is valid")
}

fn matvec(c: &mut Criterion) {
    let cols = 1536;
    let x = values(cols, 3);
    let mut scratch = QuantizedActs::new(cols);
    let tables = [Kernels::scalar(), Kernels::best()];
    for dtype in DType::ALL {
        for rows in [576, 32768] {
            let m = matrix(dtype, rows, cols);
            let mut out = vec![0f32; rows];
            let mut group = c.benchmark_group(format!("matvec/{dtype}/{rows}x{cols}"));
            group.throughput(Throughput::Bytes(m.stored_bytes() as u64));
            for k in tables {
                for precision in [Precision::Exact, Precision::Fast] {
                    let id = format!("{}/{precision:?}", k.name());
                    group.bench_function(id, |b| {
                        b.iter(|| {
                            k.matvec(&m, black_box(&x), &mut out, precision, &mut scratch);
                            black_box(&out);
                        })
                    });
                }
            }
            if tiles::tiles(dtype) {
                let t = tiled(&m);
                let k = Kernels::best();
                group.bench_function(format!("{}/Fast/tiles", k.name()), |b| {
                    b.iter(|| {
                        k.matvec(&t, black_box(&x), &mut out, Precision::Fast, &mut scratch);
                        black_box(&out);
                    })
                });
            }
            group.finish();
        }
    }
}

/// `m` stored as tiles, as a load for the fast kernels stores it.
fn tiled(m: &QRows) -> QRows {
    let mut bytes = m.backing().as_slice().to_vec();
    tiles::tile_matrix_in_place(m.dtype, m.rows, &mut bytes);
    QRows::contiguous(m.dtype, m.rows, m.cols, TensorBytes::from_vec(bytes))
        .and_then(|q| q.as_tiled())
        .expect("a tileable matrix")
}

/// A batch of [`TOKENS`] tokens through each matrix (a prefill step): every group of rows is read
/// once for all tokens. Only the best table; 576 rows of 1536 values, as above.
fn matmat(c: &mut Criterion) {
    const TOKENS: usize = 16;
    let (rows, cols) = (576, 1536);
    let x = values(TOKENS * cols, 5);
    let mut scratch = QuantizedActs::new(x.len());
    let k = Kernels::best();
    for dtype in DType::ALL {
        let m = matrix(dtype, rows, cols);
        let mut out = vec![0f32; TOKENS * rows];
        let mut group = c.benchmark_group(format!("matmat{TOKENS}/{dtype}/{rows}x{cols}"));
        group.throughput(Throughput::Bytes((TOKENS * m.stored_bytes()) as u64));
        for precision in [Precision::Exact, Precision::Fast] {
            let id = format!("{}/{precision:?}", k.name());
            group.bench_function(id, |b| {
                b.iter(|| {
                    let x = k.prepare(black_box(&x), precision, &mut scratch);
                    k.matmats(x, TOKENS, [(&m, &mut out[..])]);
                    black_box(&out);
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = matvec, matmat
}
criterion_main!(benches);
