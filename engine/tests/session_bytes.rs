//! `Session::bytes`, `session_open_bytes` and `kv_growth_bytes` against what the allocator really
//! hands out: a counting global allocator measures the live heap growth of the calling thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session, session_open_bytes};
use leanstream_engine::kv::{KV_BLOCK_TOKENS, KvCache, KvType};
use leanstream_engine::model::gguf::TinyLlama;
use leanstream_engine::quant::DType;

/// Counts the bytes of every allocation made by a thread while its `COUNTING` flag is set.
struct Counting;

thread_local! {
    // Const-initialised cells without destructors: reading them never allocates.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<i64> = const { Cell::new(0) };
}

fn count(delta: i64) {
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        let _ = LIVE.try_with(|l| l.set(l.get() + delta));
    }
}

// SAFETY: every call forwards to the system allocator with the caller's layout and pointer;
// the counting only reads and writes this thread's cells.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result with the live heap bytes this thread gained meanwhile.
fn measure<T>(f: impl FnOnce() -> T) -> (T, i64) {
    LIVE.with(|l| l.set(0));
    COUNTING.with(|c| c.set(true));
    let out = f();
    COUNTING.with(|c| c.set(false));
    (out, LIVE.with(Cell::get))
}

fn tiny_model(dir: &std::path::Path) -> Arc<Model> {
    let path = dir.join("tiny.gguf");
    TinyLlama::new(5)
        .write_gguf(&path, DType::Q8_0)
        .expect("write");
    let model = Model::load(&path).expect("load");
    // The first session and forward pass start the compute team and pick the kernels: nothing a
    // later session allocates. A full batch and a partial one take every path a later forward
    // pass takes.
    let mut warm =
        Session::new(Arc::clone(&model), 64, Precision::Exact, KvType::F32).expect("session");
    warm.forward_batch(&[1; 40]).expect("forward");
    warm.forward(1).expect("forward");
    model
}

#[test]
fn opening_a_session_allocates_exactly_what_bytes_and_session_open_bytes_say() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    for kv in KvType::ALL {
        for max_context in [1, 100, 256] {
            let promised = session_open_bytes(&model, max_context, kv);
            let (s, live) = measure(|| {
                Session::new(Arc::clone(&model), max_context, Precision::Exact, kv)
                    .expect("session")
            });
            assert_eq!(s.bytes(), promised, "{kv} at {max_context}");
            assert_eq!(live, promised as i64, "{kv} at {max_context}: allocated");
            assert_eq!(s.kv_growth_bytes(0), 0);
        }
    }
}

#[test]
fn growing_and_releasing_the_kv_cache_moves_exactly_the_bytes_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    let c = model.weights.config.clone();
    for kv in KvType::ALL {
        let mut s = Session::new(Arc::clone(&model), 256, Precision::Exact, kv).expect("session");
        let open = s.bytes();
        // Two blocks for 100 tokens.
        let want = s.kv_growth_bytes(100);
        let (grown, live) = measure(|| s.grow_kv(100));
        grown.expect("grow");
        assert_eq!(live, want as i64, "{kv}: allocated by grow_kv");
        assert_eq!(s.bytes() - open, want, "{kv}: bytes() after grow_kv");
        // A block is its storage and the `Arc` that lets sessions share it.
        let block = KvCache::full_bytes(kv, c.n_layers, c.kv_dim(), KV_BLOCK_TOKENS);
        let storage = KV_BLOCK_TOKENS as u64 * kv.bytes_per_token(c.n_layers, c.kv_dim());
        assert!((storage..storage + 256).contains(&block), "{kv}: {block}");
        assert_eq!(want, 2 * block, "{kv}: two whole blocks");
        assert_eq!(s.kv_growth_bytes(2 * KV_BLOCK_TOKENS), 0);

        // A forward pass inside the grown blocks allocates nothing that stays (the compute team
        // allocates nothing per region).
        let (_, live) = measure(|| s.forward_batch(&[1; 2 * KV_BLOCK_TOKENS]).map(|_| ()));
        assert_eq!(live, 0, "{kv}: forward inside the blocks: {live}");
        // One past them grows by exactly one block, by itself.
        let next = s.kv_growth_bytes(1);
        assert_eq!(next, block);
        let (_, live) = measure(|| s.forward(2).map(|_| ()));
        let extra = live - next as i64;
        assert_eq!(extra, 0, "{kv}: forward across a block: {live}");
        assert_eq!(s.bytes(), open + want + next);

        // reset keeps the blocks; release_kv frees them all.
        s.reset();
        assert_eq!(s.bytes(), open + want + next);
        let (_, live) = measure(|| s.release_kv());
        assert_eq!(live, -((want + next) as i64), "{kv}: freed by release_kv");
        assert_eq!((s.bytes(), s.position()), (open, 0));
    }
}

#[test]
fn growth_beyond_max_context_is_refused_and_allocates_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    let mut s = Session::new(model, 100, Precision::Exact, KvType::F16).expect("session");
    let (refused, live) = measure(|| s.grow_kv(101).is_err());
    assert!(refused);
    assert_eq!(live, 0);
    // The last block holds only the 36 tokens up to max_context.
    let c = s.model().weights.config.clone();
    let full = KvCache::full_bytes(KvType::F16, c.n_layers, c.kv_dim(), 100);
    let per_token = KvType::F16.bytes_per_token(c.n_layers, c.kv_dim());
    assert!((100 * per_token..100 * per_token + 512).contains(&full));
    assert_eq!(s.kv_growth_bytes(100), full);
    assert_eq!(s.kv_growth_bytes(1000), full);
}

/// Sharing a prefix allocates only the prefix's list of blocks and adopting it nothing; the
/// holders' bytes then add up to what was allocated; the first write into a shared block
/// allocates exactly the copy `kv_growth_bytes` counts, made by `grow_kv`, not by the pass.
#[test]
fn sharing_a_prefix_allocates_what_its_holders_report_and_a_write_copies_what_is_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tiny_model(dir.path());
    for kv in KvType::ALL {
        let open = || Session::new(Arc::clone(&model), 256, Precision::Exact, kv).expect("session");
        let (mut source, mut adopter) = (open(), open());
        let open_bytes = adopter.bytes();
        let (grown, blocks) = measure(|| source.grow_kv(100));
        grown.expect("grow");
        source.forward_batch(&[3; 100]).expect("forward");

        let (prefix, list) = measure(|| source.share_prefix(70).expect("share"));
        let ((), adopted) = measure(|| adopter.adopt_prefix(&prefix).expect("adopt"));
        assert_eq!(adopted, 0, "{kv}: adopting allocates nothing");
        assert_eq!(
            source.bytes(),
            open_bytes,
            "{kv}: the blocks are the prefix's"
        );
        assert_eq!(
            source.bytes() + adopter.bytes() + prefix.bytes(),
            2 * open_bytes + (blocks + list) as u64,
            "{kv}: every allocated byte counted once"
        );

        let want = adopter.kv_growth_bytes(1);
        assert!(want > 0, "{kv}: position 70 is in a shared block");
        let (grown, live) = measure(|| adopter.grow_kv(1));
        grown.expect("grow");
        assert_eq!(live, want as i64, "{kv}: the copy of block 1");
        assert_eq!(adopter.bytes(), open_bytes + want, "{kv}");
        let (_, live) = measure(|| adopter.forward(5).map(|_| ()));
        assert_eq!(live, 0, "{kv}: a copy in the pass: {live}");
    }
}
