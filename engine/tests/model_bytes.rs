//! `Model::bytes()` against what loading allocates: a counting global allocator measures the
//! live heap a load leaves behind, the file image (an anonymous mapping, not heap) is counted
//! apart, and the estimate from the header alone bounds both; on both real models (a BPE and a
//! SentencePiece vocabulary) and tiny ones.

#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};

use leanstream_engine::forward::{Model, load_bytes_estimate};
use leanstream_engine::pipeline::SparseModel;

/// Live heap bytes, through every allocation of the process: what malloc holds for each
/// block (its usable size and 8-byte header), not just the bytes asked for, since that is what
/// the process's resident size pays (a vocabulary is mostly blocks of 32 bytes holding a few).
static LIVE: AtomicI64 = AtomicI64::new(0);

/// Bytes malloc holds for the block at `p` (not null).
fn held(p: *mut u8) -> i64 {
    // SAFETY: `p` is a live block from the system allocator (glibc malloc), which
    // `malloc_usable_size` accepts.
    (unsafe { libc::malloc_usable_size(p.cast()) } + 8) as i64
}

struct Counting;

// SAFETY: every call is forwarded to `System` unchanged; only a counter is updated beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout, which the caller guarantees is valid.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(held(p), Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(held(p), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(held(ptr), Ordering::Relaxed);
        // SAFETY: `ptr` came from this allocator (so from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let before = held(ptr);
        // SAFETY: `ptr` came from `System` with `layout`; the caller guarantees `new_size`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(held(p) - before, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

/// Resident set size of this process, in bytes (Linux).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

const MIB: u64 = 1 << 20;

/// Loads with `load`, checks the model's footprint against the heap the load kept (only the
/// lower bound when the load keeps more than the model, `model_only` false) and the estimate.
fn check<T>(
    what: &str,
    load: impl Fn() -> T,
    model: impl Fn(&T) -> &Model,
    (image, model_only): (u64, bool),
    estimate: u64,
) {
    drop(load()); // one-time global set-up (thread pools, lazy tables) is not the model's
    let (heap0, rss0) = (live(), rss());
    let loaded = load();
    let (heap1, rss1) = (live(), rss());
    let grown = (heap1 - heap0).max(0) as u64;
    let fp = model(&loaded).footprint();
    eprintln!(
        "{what}: bytes() {} = weights image {} + weights heap {} + tokenizer {} + other {}; \
         measured heap growth {grown}, RSS growth {}; estimate {estimate}",
        fp.total(),
        fp.weights.image,
        fp.weights.heap,
        fp.tokenizer,
        fp.other,
        rss1.saturating_sub(rss0),
    );
    assert_eq!(
        fp.weights.image, image,
        "{what}: the image is the file less what is skipped"
    );
    assert!(
        estimate >= fp.total(),
        "{what}: estimate {estimate} < {}",
        fp.total()
    );
    assert!(
        estimate >= grown + image,
        "{what}: estimate below the measurement"
    );
    if !model_only {
        return;
    }
    assert!(
        fp.heap() >= grown,
        "{what}: heap {} < measured {grown}",
        fp.heap()
    );
    assert!(
        fp.heap() <= grown + grown / 10 + MIB,
        "{what}: heap {} is more than 10 % + 1 MiB over the measured {grown}",
        fp.heap()
    );
    assert_eq!(model(&loaded).bytes(), fp.total());
}

fn len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

#[test]
fn model_bytes_cover_what_loading_allocates_and_the_estimate_covers_both() {
    let real = leanstream_engine::testing::real_model();
    // Gemma 3's SentencePiece vocabulary: 262 144 tokens, 514 847 derived merges, 6 414 added
    // tokens (a BPE vocabulary's tables are not its tables).
    let gemma = leanstream_engine::testing::gemma_model();
    let dir = tempfile::tempdir().unwrap();
    let (gguf, lsm) = (dir.path().join("tiny.gguf"), dir.path().join("tiny.lsm"));
    leanstream_engine::testing::tiny_lsm(31, &gguf, &lsm).unwrap();
    let streamed = leanstream_engine::model::lsm::LsmFile::open(&lsm)
        .unwrap()
        .header
        .streamed
        .len;

    for path in [&real, &gemma, &gguf, &lsm] {
        let estimate = load_bytes_estimate(path, false).unwrap();
        check(
            &path.display().to_string(),
            || Model::load(path).unwrap(),
            |m| m,
            (len(path), true),
            estimate,
        );
    }
    let estimate = load_bytes_estimate(&lsm, true).unwrap();
    assert!(estimate < load_bytes_estimate(&lsm, false).unwrap());
    check(
        "tiny .lsm, streamed section skipped",
        || SparseModel::open(&lsm, false).unwrap(),
        |sm| &sm.model,
        (len(&lsm) - streamed, false), // the sparse model keeps its own tables too
        estimate,
    );
}
