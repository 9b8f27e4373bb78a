//! Conformance test bodies shared by every backend: each drives one kernel of a
//! [`KernelOps`] and compares it, by normalised error, with a plain f32 computation written here
//! from the definitions (dequantise, then loop), independent of the optimised CPU kernels.
//!
//! The CPU backend runs them in `cpu/tests.rs`, the CUDA backend in
//! `engine/tests/cuda_conformance.rs`, both through [`crate::conformance_tests!`], so adding a
//! body here adds it to every backend. Shapes are chosen to hit the edges: lengths that are not
//! a multiple of a block or warp, grouped-query heads, more positions than threads, a short last
//! chunk, chunks out of order, every stored type, ties in sampling.

use super::ops::{AttentionShape, FfnChunks, KernelOps, Matrix, rope_table};
use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, RopeStyle};
use crate::quant::{DType, dequantize_row, quantize_row};

/// Deterministic values in [-1, 1).
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i.wrapping_add(seed.wrapping_mul(0x9e37_79b9)))
                .wrapping_mul(2_654_435_761)
                .rotate_left(13)
                ^ seed;
            (h % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// ‖got − want‖ / ‖want‖ (against 1 when `want` is all zeros).
pub fn normalised_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths");
    let diff: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let norm: f32 = want.iter().map(|b| b * b).sum();
    (diff / norm.max(1e-30)).sqrt()
}

fn assert_close(backend: &dyn KernelOps, what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = normalised_error(got, want);
    assert!(
        e <= tol,
        "{}: {what}: normalised error {e:e} above {tol:e}",
        backend.name()
    );
}

/// `rows` rows of `cols` values quantised to `dtype`, back to back, and their dequantised f32.
fn quantised(dtype: DType, rows: usize, cols: usize, seed: u32) -> (Vec<u8>, Vec<f32>) {
    let (mut bytes, mut deq) = (Vec::new(), vec![0.0; rows * cols]);
    let rb = dtype.row_bytes(cols).expect("whole blocks");
    for (r, out) in deq.chunks_exact_mut(cols).enumerate() {
        quantize_row(dtype, &values(cols, seed + r as u32), &mut bytes);
        dequantize_row(dtype, &bytes[r * rb..], out);
    }
    (bytes, deq)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// RMSNorm over several rows whose width is not a multiple of the block size.
pub fn rmsnorm(b: &dyn KernelOps) {
    let n = 576 + 8;
    let (x, w) = (values(3 * n, 1), values(n, 2));
    let got = b.rmsnorm(&x, &w, 1e-5).expect("rmsnorm");
    let want: Vec<f32> = x
        .chunks(n)
        .flat_map(|r| {
            let s = 1.0 / (dot(r, r) / n as f32 + 1e-5).sqrt();
            r.iter().zip(&w).map(move |(v, w)| v * s * w)
        })
        .collect();
    assert_close(b, "rmsnorm", &got, &want, 1e-5);
}

/// The gated activation of every FFN type and the residual add, over a length that is not a
/// multiple of a block.
pub fn elementwise(b: &dyn KernelOps) {
    let (g, u) = (values(1000, 3), values(1000, 4));
    let g: Vec<f32> = g.iter().map(|v| 6.0 * v).collect(); // past GELU's bend
    for act in [
        FfnActivation::Silu,
        FfnActivation::Relu,
        FfnActivation::GeluTanh,
    ] {
        let want: Vec<f32> = g.iter().zip(&u).map(|(g, u)| act.apply(*g) * u).collect();
        let got = b.gate(act, &g, &u).expect("gate");
        assert_close(b, &format!("gate {act:?}"), &got, &want, 1e-5);
    }
    let sum: Vec<f32> = g.iter().zip(&u).map(|(x, y)| x + y).collect();
    assert_close(b, "add", &b.add(&g, &u).expect("add"), &sum, 1e-6);
    assert!(
        b.add(&g, &u[1..]).is_err(),
        "{}: length mismatch accepted",
        b.name()
    );
}

/// Dense mat-vec in every stored type, with and without a bias, rows not a multiple of 8.
pub fn matvec(b: &dyn KernelOps) {
    let (rows, cols) = (45, 768); // 24 blocks of 32, 3 of 256
    let x = values(cols, 5);
    let bias = values(rows, 6);
    for dtype in DType::ALL {
        let (bytes, deq) = quantised(dtype, rows, cols, 100);
        let w = Matrix {
            dtype,
            rows,
            cols,
            bytes: &bytes,
        };
        let want: Vec<f32> = deq.chunks(cols).map(|r| dot(r, &x)).collect();
        let got = b.matvec(w, &x, None).expect("matvec");
        assert_close(b, &format!("matvec {dtype:?}"), &got, &want, 1e-4);
        let with_bias: Vec<f32> = want.iter().zip(&bias).map(|(y, b)| y + b).collect();
        let got = b.matvec(w, &x, Some(&bias)).expect("matvec + bias");
        assert_close(
            b,
            &format!("matvec {dtype:?} + bias"),
            &got,
            &with_bias,
            1e-4,
        );
    }
}

/// RoPE in both pairings at a far position (large angles), several heads, frequencies scaled
/// by per-pair factors (Llama 3's RoPE scaling: each pair its own frequency).
pub fn rope(b: &dyn KernelOps) {
    let (hd, heads, pos, base) = (64, 9, 1234, 10_000.0f64);
    let x = values(heads * hd, 7);
    let inv_freq: Vec<f64> = (0..hd / 2)
        .map(|i| base.powf(-2.0 * i as f64 / hd as f64) / (1.0 + (i % 5) as f64))
        .collect();
    let table: Vec<f32> = inv_freq.iter().map(|&f| f as f32).collect();
    for style in [RopeStyle::AdjacentPairs, RopeStyle::HalfSplit] {
        let mut want = x.clone();
        for head in want.chunks_exact_mut(hd) {
            for (i, f) in inv_freq.iter().enumerate() {
                let theta = pos as f64 * f;
                let (s, c) = (theta.sin() as f32, theta.cos() as f32);
                let (a, bb) = match style {
                    RopeStyle::AdjacentPairs => (2 * i, 2 * i + 1),
                    RopeStyle::HalfSplit => (i, i + hd / 2),
                };
                let (x0, x1) = (head[a], head[bb]);
                head[a] = x0 * c - x1 * s;
                head[bb] = x0 * s + x1 * c;
            }
        }
        let got = b.rope(&x, hd, pos, &table, style).expect("rope");
        // f32 angles of ~1e3 radians carry ~1e-4 absolute error, in both backends.
        assert_close(b, &format!("rope {style:?}"), &got, &want, 2e-3);
    }
    assert_eq!(
        rope_table(&table, 0)[5],
        (0.0, 1.0),
        "position 0 rotates nothing"
    );
    assert!(
        b.rope(&x, hd, pos, &table[1..], RopeStyle::HalfSplit)
            .is_err(),
        "{}: a frequency table of the wrong length",
        b.name()
    );
}

/// Decode attention with grouped-query heads (3 query heads per KV head) over more positions
/// than a block has threads, over a single position, over a sliding window's last positions,
/// and with heads that are not whole warps (16 and 80 values).
pub fn attention_decode(b: &dyn KernelOps) {
    for (first, n_pos, head_dim) in [
        (0, 1, 64),
        (0, 300, 64),
        (295, 300, 64),
        (37, 300, 64),
        (3, 20, 16),
        (0, 7, 80),
    ] {
        let shape = AttentionShape {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim,
            first,
            n_pos,
        };
        let (hd, kv) = (shape.head_dim, shape.kv_dim());
        let q: Vec<f32> = values(shape.n_heads * hd, 8)
            .iter()
            .map(|v| 3.0 * v)
            .collect();
        let (k, v) = (values(n_pos * kv, 9), values(n_pos * kv, 10));
        let mut want = vec![0.0; q.len()];
        for h in 0..shape.n_heads {
            let off = (h / 3) * hd;
            let qh = &q[h * hd..(h + 1) * hd];
            let s: Vec<f32> = (first..n_pos)
                .map(|p| dot(qh, &k[p * kv + off..p * kv + off + hd]) / (hd as f32).sqrt())
                .collect();
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for (p, e) in (first..n_pos).zip(&e) {
                for i in 0..hd {
                    want[h * hd + i] += e / z * v[p * kv + off + i];
                }
            }
        }
        let got = b.attention_decode(&q, &k, &v, shape).expect("attention");
        let what = format!("attention over {first}..{n_pos}, heads of {head_dim}");
        assert_close(b, &what, &got, &want, 1e-4);
    }
    let empty = AttentionShape {
        n_heads: 3,
        n_kv_heads: 3,
        head_dim: 64,
        first: 2,
        n_pos: 2,
    };
    let (q, kv) = (values(3 * 64, 1), values(2 * 3 * 64, 2));
    assert!(
        b.attention_decode(&q, &kv, &kv, empty).is_err(),
        "{}: a window with no position",
        b.name()
    );
}

/// A layer of neuron chunks as the `.lsm` stores them, with a short last chunk, and the f32
/// gate, up and down rows of every neuron.
struct TestLayer {
    layout: ChunkLayout,
    chunks: Vec<Vec<u8>>,
    gate: Vec<Vec<f32>>,
    up: Vec<Vec<f32>>,
    down: Vec<Vec<f32>>,
}

fn test_layer(dtypes: [DType; 3], seed: u32) -> TestLayer {
    let (n_ff, d, cn) = (200, 256, 48); // 5 chunks, the last of 8 neurons; rows of one k-block
    let layout = ChunkLayout::one_layer(n_ff, d, cn, dtypes).expect("geometry");
    let mut t = TestLayer {
        chunks: vec![vec![0u8; layout.chunk_bytes]; layout.chunks_per_layer],
        gate: Vec::new(),
        up: Vec::new(),
        down: Vec::new(),
        layout,
    };
    for n in 0..n_ff {
        let mut bundle = Vec::new();
        let mut rows = [Vec::new(), Vec::new(), Vec::new()];
        for (k, (dtype, row)) in dtypes.iter().zip(&mut rows).enumerate() {
            let at = bundle.len();
            quantize_row(*dtype, &values(d, seed + (3 * n + k) as u32), &mut bundle);
            *row = vec![0.0; d];
            dequantize_row(*dtype, &bundle[at..], row);
        }
        let [g, u, dn] = rows;
        t.gate.push(g);
        t.up.push(u);
        t.down.push(dn);
        let (c, j) = (n / cn, n % cn);
        let at = j * t.layout.bundle_bytes;
        t.chunks[c][at..at + bundle.len()].copy_from_slice(&bundle);
    }
    t
}

impl TestLayer {
    /// The plain computation of [`KernelOps::ffn_chunks`] over the chunks `list`.
    fn want(&self, list: &[usize], act: FfnActivation, threshold: f32, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; self.layout.d_model];
        for &c in list {
            for n in self.layout.neurons(c) {
                let a = act.apply(dot(&self.gate[n], x)) * dot(&self.up[n], x);
                if crate::sparsity::is_active(a, threshold) {
                    out.iter_mut()
                        .zip(&self.down[n])
                        .for_each(|(o, d)| *o += a * d);
                }
            }
        }
        out
    }
}

/// The sparse FFN over a subset of chunks in any order, the short last chunk included, in every
/// stored type, both activations, with and without a threshold.
pub fn ffn_chunks(b: &dyn KernelOps) {
    let x = values(256, 11);
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        // Down columns in the next type, so each type is also read by the axpy side.
        let down = DType::ALL[(i + 1) % DType::ALL.len()];
        let layer = test_layer([dtype, dtype, down], 200);
        for (act, threshold) in [
            (FfnActivation::Silu, 0.0),
            (FfnActivation::Silu, 0.05),
            (FfnActivation::Relu, 0.0),
            (FfnActivation::GeluTanh, 0.0),
        ] {
            let list = [4, 1, 3]; // out of order; chunk 4 is the short one
            let chunks: Vec<(usize, &[u8])> =
                list.iter().map(|&c| (c, &layer.chunks[c][..])).collect();
            let f = FfnChunks {
                layout: &layer.layout,
                chunks: &chunks,
                activation: act,
                threshold,
                x: &x,
            };
            let got = b.ffn_chunks(&f).expect("ffn_chunks");
            let what = format!("ffn {dtype:?} {act:?} threshold {threshold}");
            assert_close(
                b,
                &what,
                &got.out,
                &layer.want(&list, act, threshold, &x),
                1e-4,
            );
            let listed = |n: usize| list.contains(&(n / layer.layout.chunk_neurons));
            let kept = (0..layer.layout.n_ff)
                .filter(|&n| got.h[n] != 0.0 && listed(n))
                .count();
            assert_eq!(got.active, kept, "{}: {what}: active count", b.name());
            assert!(
                (0..layer.layout.n_ff).all(|n| listed(n) || got.h[n] == 0.0),
                "{}: {what}: activations written outside the listed chunks",
                b.name()
            );
            if threshold > 0.0 {
                assert!(
                    got.h
                        .iter()
                        .all(|&a| a == 0.0 || crate::sparsity::is_active(a, threshold)),
                    "{}: {what}: a neuron under the threshold was kept",
                    b.name()
                );
            }
        }
        let twice = [(1, &layer.chunks[1][..]), (1, &layer.chunks[1][..])];
        let f = FfnChunks {
            layout: &layer.layout,
            chunks: &twice,
            activation: FfnActivation::Silu,
            threshold: 0.0,
            x: &x,
        };
        assert!(
            b.ffn_chunks(&f).is_err(),
            "{}: a chunk listed twice",
            b.name()
        );
    }
}

/// Argmax and top-k over a vocabulary-sized vector with ties: the lower index wins.
pub fn sampling(b: &dyn KernelOps) {
    let mut logits = values(49_152, 12);
    logits[31_000] = 5.0;
    logits[40_000] = 5.0;
    logits[7] = 4.0;
    assert_eq!(b.argmax(&logits).expect("argmax"), 31_000, "{}", b.name());
    let top = b.top_k(&logits, 4).expect("top_k");
    assert_eq!(
        top.iter().map(|t| t.0).collect::<Vec<_>>()[..3],
        [31_000, 40_000, 7],
        "{}: top-k order",
        b.name()
    );
    let fourth = logits
        .iter()
        .enumerate()
        .filter(|(i, _)| ![31_000, 40_000, 7].contains(i))
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        });
    assert_eq!(top[3], (fourth.0 as u32, fourth.1), "{}: 4th", b.name());
    assert!(b.top_k(&logits, 0).is_err(), "{}: k = 0 accepted", b.name());
}

/// One `#[test]` per conformance body for a backend. `$backend` is a function of the test's
/// name returning `Option<B>` with `B: KernelOps`; `None` skips the test (after saying why).
#[macro_export]
macro_rules! conformance_tests {
    ($backend:expr) => {
        $crate::conformance_tests!(@each $backend;
            rmsnorm, elementwise, matvec, rope, attention_decode, ffn_chunks, sampling);
    };
    (@each $backend:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                if let Some(b) = ($backend)(stringify!($name)) {
                    $crate::backend::conformance::$name(&b);
                }
            }
        )*
    };
}
