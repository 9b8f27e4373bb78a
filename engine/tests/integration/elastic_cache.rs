//! Elastic neuron caches on a tiny seeded model: resizing between tokens changes the bytes held,
//! never the tokens; shrinking keeps what the mode values most; a size below the floor is refused
//! and changes nothing; the floor known from the file header is the one the pipeline enforces.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use leanstream_engine::Error;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::cache::Lookup;
use leanstream_engine::forward::Session;
use leanstream_engine::kv::KvType;
use leanstream_engine::model::lsm::{ChunkLayout, LsmFile};
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, SparseModel};
use leanstream_engine::sample::argmax;
use leanstream_engine::testing;

const STREAMING: [Mode; 3] = [Mode::OnDemand, Mode::Prefetch, Mode::LeanStream];

fn tiny_model(dir: &Path) -> (PathBuf, Arc<SparseModel>) {
    let path = dir.join("tiny.lsm");
    testing::tiny_lsm(3, &dir.join("tiny.gguf"), &path).expect("tiny .lsm");
    let sm = SparseModel::open(&path, false).expect("open");
    (path, sm)
}

fn options(mode: Mode, cache_bytes: usize) -> ExecutorOptions {
    leanstream_engine::testing::exact_options(mode, cache_bytes)
}

/// Greedy generation of `steps` tokens after a prompt, calling `between(pass, exec)` before
/// every forward pass but the first; returns the ids and the logits of every pass.
fn generate(
    sm: &SparseModel,
    exec: &mut Executor,
    steps: usize,
    mut between: impl FnMut(usize, &mut Executor),
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let prompt = sm
        .model
        .tokenizer
        .encode("the cat sat on the mat")
        .expect("encode");
    let mut s =
        Session::new(Arc::clone(&sm.model), 64, Precision::Exact, KvType::F32).expect("session");
    let mut logits = Vec::new();
    let mut pass = 0;
    let mut step = |token: u32, exec: &mut Executor, logits: &mut Vec<Vec<f32>>| {
        if pass > 0 {
            between(pass, exec);
        }
        pass += 1;
        let out = s.forward_with(token, exec).expect("forward").to_vec();
        let next = argmax(&out);
        logits.push(out);
        next
    };
    let mut next = 0;
    for &t in &prompt {
        next = step(t, exec, &mut logits);
    }
    let mut ids = vec![next];
    for _ in 1..steps {
        next = step(next, exec, &mut logits);
        ids.push(next);
    }
    (ids, logits)
}

fn cached_chunks(exec: &Executor, total: usize) -> Vec<u32> {
    let Executor::Streaming(e) = exec else {
        panic!("a cache-backed mode has a streaming executor")
    };
    (0..total as u32)
        .filter(|&c| matches!(e.cache().lookup(c), Lookup::Ready(_)))
        .collect()
}

#[test]
fn a_cache_resized_between_tokens_generates_the_tokens_of_an_unresized_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, sm) = tiny_model(dir.path());
    let l = &sm.layout;
    let (full, floor) = (l.streamed_bytes(), l.floor_bytes());
    assert!(floor < full, "the tiny model has more than one layer");
    // Floor, everything, a size between (not a whole number of chunks), everything.
    let sizes = [floor, full, floor + 3 * l.chunk_bytes + 100, full];
    for mode in STREAMING {
        let mut exec = Executor::new(&sm, options(mode, full)).expect("executor");
        let (want_ids, want_logits) = generate(&sm, &mut exec, 8, |_, _| {});

        let mut exec = Executor::new(&sm, options(mode, full)).expect("executor");
        let (ids, logits) = generate(&sm, &mut exec, 8, |pass, exec| {
            let size = sizes[pass % sizes.len()];
            let held = exec.resize_cache(size).expect("resize");
            let whole = size / l.chunk_bytes * l.chunk_bytes;
            assert_eq!(held, whole, "{mode}: rounded down to whole chunks");
            assert_eq!(exec.cache_bytes(), held, "{mode}");
            assert!(cached_chunks(exec, l.total_chunks()).len() * l.chunk_bytes <= held);
        });
        assert_eq!(ids, want_ids, "{mode}: greedy ids");
        for (pass, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-4, "{mode}: pass {pass} logits differ by {diff}");
        }
        let stats = exec.stats();
        assert_eq!(stats.hits + stats.misses, stats.chunks_needed, "{mode}");
        assert!(
            stats.misses > l.total_chunks() as u64,
            "{mode}: shrinking evicted: {stats:?}"
        );
    }
}

#[test]
fn shrinking_keeps_the_chunks_the_retention_values_most() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, sm) = tiny_model(dir.path());
    let l = &sm.layout;
    // On-demand retains by recency: after one token the last layer's chunks are the newest.
    let mut exec = Executor::new(&sm, options(Mode::OnDemand, l.streamed_bytes())).expect("exec");
    generate(&sm, &mut exec, 1, |_, _| {});
    let total = l.total_chunks();
    assert_eq!(
        cached_chunks(&exec, total).len(),
        total,
        "everything read once"
    );
    assert_eq!(
        exec.resize_cache(l.floor_bytes()).expect("shrink"),
        l.floor_bytes()
    );
    let last_layer: Vec<u32> = (0..l.chunks_per_layer)
        .map(|c| l.id(l.n_layers - 1, c))
        .collect();
    assert_eq!(cached_chunks(&exec, total), last_layer);
}

#[test]
fn a_resize_below_the_floor_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, sm) = tiny_model(dir.path());
    let l = &sm.layout;
    for mode in STREAMING {
        let mut exec = Executor::new(&sm, options(mode, l.streamed_bytes())).expect("exec");
        generate(&sm, &mut exec, 2, |_, _| {});
        let (stats, bytes) = (exec.stats(), exec.cache_bytes());
        let cached = cached_chunks(&exec, l.total_chunks());
        let below = l.floor_bytes() - 1;
        let err = exec.resize_cache(below).expect_err("below the floor");
        assert!(matches!(err, Error::OverBudget { .. }), "{mode}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&l.floor_bytes().to_string()) && msg.contains(&below.to_string()),
            "{mode}: {msg}"
        );
        assert_eq!(exec.cache_bytes(), bytes, "{mode}");
        assert_eq!(cached_chunks(&exec, l.total_chunks()), cached, "{mode}");
        assert_eq!(
            exec.stats(),
            stats,
            "{mode}: no read cancelled, nothing evicted"
        );
    }
}

#[test]
fn the_floor_read_from_the_header_is_the_floor_the_pipeline_enforces() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, sm) = tiny_model(dir.path());
    let header = LsmFile::open(&path).expect("parse").header;
    let floor = ChunkLayout::from_header(&path, &header)
        .expect("layout")
        .floor_bytes();
    assert_eq!(floor, sm.layout.chunks_per_layer * sm.layout.chunk_bytes);
    for mode in STREAMING {
        let err = Executor::new(&sm, options(mode, floor - 1)).expect_err("below the floor");
        assert!(
            err.to_string().contains(&floor.to_string()),
            "{mode}: {err}"
        );
        let mut exec = Executor::new(&sm, options(mode, floor)).expect("at the floor");
        assert_eq!(exec.cache_floor_bytes(), floor, "{mode}");
        assert_eq!(exec.cache_bytes(), floor, "{mode}");
        let grown = exec.resize_cache(usize::MAX).expect("grow");
        assert_eq!(
            grown,
            sm.layout.streamed_bytes(),
            "{mode}: capped at every chunk"
        );
    }
    // The mmap mode computes from a map of the file, so it needs the model opened mapped.
    let mapped = SparseModel::open_for_mode(&path, Mode::Mmap, false).expect("open mapped");
    let mut mmap = Executor::new(&mapped, options(Mode::Mmap, 0)).expect("mmap");
    assert_eq!(mmap.cache_floor_bytes(), 0);
    assert_eq!(
        mmap.resize_cache(1 << 20).expect("no-op"),
        0,
        "mmap has no cache"
    );
    assert_eq!(mmap.cache_bytes(), 0);
}
