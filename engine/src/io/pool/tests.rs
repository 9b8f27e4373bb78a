//! Tests of the I/O engines: real files (direct and buffered), ordering, cancellation,
//! coalescing and shutdown (fault injection: `fault_tests`; checksums: `verify_tests`). Each
//! behavioural test runs on every engine of [`ENGINES`]: the pool and [`UringIo`].

use std::io::IoSliceMut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::io::uring::sim::SIM_THREAD;
use crate::io::{AlignedBuf, DirectFile, MemReader, PAGE, ReadRequest, ReadTarget, UringIo};

/// An engine the behavioural tests run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Engine {
    Pool,
    /// [`UringIo`]: on the kernel's ring for a reader with a file descriptor; through a simulated
    /// ring (reads on threads of their own, through the reader) for the gates, fault-injecting and
    /// memory readers these tests use, so the same faults reach its retry logic.
    Uring,
}

/// Every engine, for tests to loop over.
pub(crate) const ENGINES: [Engine; 2] = [Engine::Pool, Engine::Uring];

impl Engine {
    /// Opens this engine on `reader`: `n` threads for the pool, `n` reads in flight for io_uring
    /// (so `n` = 1 serves one read at a time on either). Prints its name, so that a failing
    /// test's output says which engine failed.
    pub(crate) fn open(
        self,
        reader: Arc<dyn ReadAt>,
        n: usize,
        opts: IoOptions,
    ) -> Box<dyn IoEngine> {
        eprintln!("engine: {self:?}");
        match self {
            Engine::Pool => Box::new(ThreadPoolIo::new(reader, n, opts).expect("pool")),
            Engine::Uring => Box::new(UringIo::for_tests(reader, n, opts).expect("uring")),
        }
    }

    /// The name of the thread that performs the reads of a reader without a file descriptor.
    fn reading_thread(self) -> &'static str {
        match self {
            Engine::Pool => "leanstream-io-0",
            Engine::Uring => SIM_THREAD,
        }
    }
}

/// Blocks every read while closed; counts reads started and finished and the reading threads.
#[derive(Debug)]
pub(crate) struct Gate {
    inner: Arc<dyn ReadAt>,
    open: Mutex<bool>,
    cv: Condvar,
    pub(crate) started: AtomicU64,
    pub(crate) finished: AtomicU64,
    thread_name: Mutex<Option<String>>,
}

impl Gate {
    pub(crate) fn new(inner: Arc<dyn ReadAt>) -> Arc<Self> {
        Arc::new(Gate {
            inner,
            open: Mutex::new(false),
            cv: Condvar::new(),
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            thread_name: Mutex::new(None),
        })
    }

    pub(crate) fn open(&self) {
        *self.open.lock().expect("gate lock") = true;
        self.cv.notify_all();
    }
}

impl ReadAt for Gate {
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> std::io::Result<usize> {
        self.started.fetch_add(1, Ordering::SeqCst);
        *self.thread_name.lock().expect("lock") = std::thread::current().name().map(String::from);
        let mut open = self.open.lock().expect("gate lock");
        while !*open {
            open = self.cv.wait(open).expect("gate wait");
        }
        drop(open);
        let r = self.inner.read_at(bufs, offset);
        self.finished.fetch_add(1, Ordering::SeqCst);
        r
    }
}

pub(crate) fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub(crate) fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect()
}

/// Submits a read of `pages` pages at file page `page` into slot `slot` (4 pages per slot).
pub(crate) fn submit(
    io: &dyn IoEngine,
    arena: &mut AlignedBuf,
    id: u64,
    page: u64,
    pages: usize,
    slot: usize,
    prio: f32,
) {
    assert!(pages <= 4 && (slot + 1) * 4 * PAGE <= arena.len());
    // SAFETY: slot `slot` lies inside the arena; every test declares the arena before the pool,
    // so it outlives the pool's workers, and reads the slot only after its completion.
    let target = unsafe { ReadTarget::new(arena.as_mut_ptr().add(slot * 4 * PAGE), pages * PAGE) };
    let req = ReadRequest {
        id,
        offset: page * PAGE as u64,
        target,
        priority: prio,
        check: None,
    };
    // SAFETY: as above: the target stays valid and untouched until the completion.
    unsafe { io.submit(req) };
}

pub(crate) fn slot(arena: &AlignedBuf, slot: usize, pages: usize) -> &[u8] {
    &arena.as_slice()[slot * 4 * PAGE..][..pages * PAGE]
}

pub(crate) fn collect(io: &dyn IoEngine, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "only {} of {n} completions",
            out.len()
        );
        io.wait(&mut out, Some(Duration::from_millis(100)));
    }
    out
}

pub(crate) fn ids(cs: &[Completion]) -> Vec<u64> {
    cs.iter().map(|c| c.id).collect()
}

#[test]
fn recycling_the_iovec_vector_keeps_its_allocation() {
    let v: Vec<IoSliceMut<'static>> = Vec::with_capacity(16);
    let p = v.as_ptr() as usize;
    let w: Vec<IoSliceMut<'_>> = recycle(v);
    assert_eq!((w.as_ptr() as usize, w.capacity()), (p, 16));
}

#[test]
fn zero_threads_is_an_error() {
    let mem: Arc<dyn ReadAt> = Arc::new(MemReader::new(vec![0u8; 10]));
    assert!(ThreadPoolIo::new(mem, 0, IoOptions::default()).is_err());
}

#[test]
fn reads_match_the_file_at_random_offsets_direct_and_buffered() {
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).expect("tempdir on disk");
    let data = pattern(256 * PAGE);
    let path = dir.path().join("model.lsm");
    std::fs::write(&path, &data).expect("write");
    for (engine, direct) in ENGINES.into_iter().flat_map(|e| [(e, true), (e, false)]) {
        let file = if direct {
            DirectFile::open(&path)
        } else {
            DirectFile::open_buffered(&path)
        };
        let file = file.expect("open");
        assert!(
            !direct || file.is_direct(),
            "the worktree's disk accepts O_DIRECT"
        );
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 200;
        let mut arena = AlignedBuf::zeroed(n * 4 * PAGE).expect("arena");
        let io = engine.open(Arc::new(file), 3, IoOptions::default());
        let mut expect = Vec::new();
        for id in 0..n {
            let pages = rng.random_range(1..=4usize);
            let page = rng.random_range(0..=(256 - pages) as u64);
            submit(
                &*io,
                &mut arena,
                id as u64,
                page,
                pages,
                id,
                rng.random_range(0.0..1.0),
            );
            expect.push((page as usize, pages));
        }
        let done = collect(&*io, n);
        assert_eq!(done.len(), n);
        for c in &done {
            c.result.as_ref().expect("read ok");
            let (page, pages) = expect[c.id as usize];
            assert_eq!(c.bytes, pages * PAGE);
            assert_eq!(
                slot(&arena, c.id as usize, pages),
                &data[page * PAGE..][..pages * PAGE]
            );
        }
        let s = io.stats();
        assert_eq!((s.requests, s.failures, s.retries), (n as u64, 0, 0));
        assert_eq!(
            s.bytes,
            expect.iter().map(|e| (e.1 * PAGE) as u64).sum::<u64>()
        );
        assert!(s.syscalls + s.coalesced >= n as u64 && s.busy_ns > 0);
        assert_eq!(io.pending(), 0);
    }
}

#[test]
fn one_worker_reads_highest_priority_first_fifo_among_equals() {
    for engine in ENGINES {
        let gate = Gate::new(Arc::new(MemReader::new(pattern(64 * PAGE))));
        let mut arena = AlignedBuf::zeroed(8 * 4 * PAGE).expect("arena");
        let io = engine.open(gate.clone(), 1, IoOptions::default());
        submit(&*io, &mut arena, 0, 0, 1, 0, 0.0);
        wait_until("the first read to block", || {
            gate.started.load(Ordering::SeqCst) == 1
        });
        // Pages 10, 20, … are not adjacent, so nothing merges.
        for (id, prio) in [(1, 1.0), (2, 5.0), (3, 3.0), (4, 5.0), (5, 2.0), (6, 9.0)] {
            submit(&*io, &mut arena, id, id * 10, 1, id as usize, prio);
        }
        gate.open();
        let done = collect(&*io, 7);
        assert_eq!(ids(&done), [0, 6, 2, 4, 3, 5, 1]);
        assert_eq!(
            gate.thread_name.lock().expect("lock").as_deref(),
            Some(engine.reading_thread())
        );
    }
}

#[test]
fn reprioritize_and_cancel_apply_only_to_queued_requests() {
    for engine in ENGINES {
        reprioritize_and_cancel_on(engine);
    }
}

fn reprioritize_and_cancel_on(engine: Engine) {
    let gate = Gate::new(Arc::new(MemReader::new(pattern(64 * PAGE))));
    let mut arena = AlignedBuf::zeroed(4 * 4 * PAGE).expect("arena");
    let io = engine.open(gate.clone(), 1, IoOptions::default());
    submit(&*io, &mut arena, 0, 0, 1, 0, 0.0);
    wait_until("the first read to block", || {
        gate.started.load(Ordering::SeqCst) == 1
    });
    for id in 1..=3u64 {
        submit(&*io, &mut arena, id, id * 10, 1, id as usize, id as f32);
    }
    assert!(!io.reprioritize(0, 100.0), "in flight");
    assert!(!io.cancel(0), "in flight");
    assert!(io.cancel(2));
    assert!(!io.cancel(2), "already cancelled");
    assert!(!io.reprioritize(2, 1.0));
    assert!(io.reprioritize(1, 10.0));
    assert!(!io.reprioritize(99, 1.0), "unknown id");
    assert_eq!(io.pending(), 3);
    gate.open();
    let done = collect(&*io, 3);
    assert_eq!(ids(&done), [0, 1, 3]);
    let mut more = Vec::new();
    assert_eq!(
        io.try_drain(&mut more),
        0,
        "no completion for a cancelled read"
    );
    assert_eq!(io.pending(), 0);
    let t = Instant::now();
    assert_eq!(io.wait(&mut more, None), 0, "nothing pending: no blocking");
    assert!(t.elapsed() < Duration::from_secs(1));
}

/// Submits pages 0..16 in scrambled order behind a blocked read, then counts the reads.
fn coalesce_run(engine: Engine, max_coalesce_bytes: usize) -> (IoStats, bool) {
    let data = pattern(64 * PAGE);
    let gate = Gate::new(Arc::new(MemReader::new(data.clone())));
    let mut arena = AlignedBuf::zeroed(17 * 4 * PAGE).expect("arena");
    let opts = IoOptions {
        max_coalesce_bytes,
        ..IoOptions::default()
    };
    let io = engine.open(gate.clone(), 1, opts);
    submit(&*io, &mut arena, 100, 60, 1, 16, 0.0);
    wait_until("the first read to block", || {
        gate.started.load(Ordering::SeqCst) == 1
    });
    for i in 0..16u64 {
        let page = (i * 7) % 16;
        submit(&*io, &mut arena, page, page, 1, page as usize, 1.0);
    }
    gate.open();
    let done = collect(&*io, 17);
    let ok = done.iter().all(|c| c.result.is_ok())
        && (0..16).all(|p| slot(&arena, p, 1) == &data[p * PAGE..][..PAGE]);
    (io.stats(), ok)
}

#[test]
fn coalescing_reduces_syscalls_and_fills_each_target() {
    for engine in ENGINES {
        let (s, ok) = coalesce_run(engine, 1 << 20);
        assert!(ok, "every target holds its own page");
        assert_eq!(
            (s.syscalls, s.coalesced),
            (2, 15),
            "one blocked read, one merged read"
        );
        let (s, ok) = coalesce_run(engine, 4 * PAGE);
        assert!(ok);
        // Merges of at most 4 pages: at least 4 reads for the 16 pages, and still fewer than 16
        // (the greedy plan need not find the best partition: here it makes 5).
        let merged_reads = s.syscalls - 1;
        assert!((4..16).contains(&merged_reads), "{s:?}");
        assert_eq!(s.coalesced, 16 - merged_reads, "{s:?}");
    }
}

/// Queues pages 0, 2, 3, 6 and 20 behind a blocked read and reads them with holes of up to
/// `max_gap_pages` bridged.
fn hole_run(engine: Engine, max_gap_pages: usize) -> (IoStats, bool) {
    let data = pattern(64 * PAGE);
    let gate = Gate::new(Arc::new(MemReader::new(data.clone())));
    let mut arena = AlignedBuf::zeroed(6 * 4 * PAGE).expect("arena");
    let opts = IoOptions {
        max_gap_bytes: max_gap_pages * PAGE,
        ..IoOptions::default()
    };
    let io = engine.open(gate.clone(), 1, opts);
    submit(&*io, &mut arena, 100, 60, 1, 5, 0.0);
    wait_until("the first read to block", || {
        gate.started.load(Ordering::SeqCst) == 1
    });
    let pages = [0u64, 2, 3, 6, 20];
    for (i, &page) in pages.iter().enumerate() {
        submit(&*io, &mut arena, page, page, 1, i, 1.0);
    }
    gate.open();
    let done = collect(&*io, pages.len() + 1);
    let ok = done.iter().all(|c| c.result.is_ok())
        && pages
            .iter()
            .enumerate()
            .all(|(i, &p)| slot(&arena, i, 1) == &data[p as usize * PAGE..][..PAGE]);
    (io.stats(), ok)
}

#[test]
fn merged_reads_bridge_small_holes_into_scratch() {
    for engine in ENGINES {
        // Holes of 1 and 2 pages are bridged; the 13-page hole to page 20 is not.
        let (s, ok) = hole_run(engine, 2);
        assert!(ok, "every target holds its own page");
        assert_eq!((s.syscalls, s.coalesced), (3, 3), "{s:?}");
        assert_eq!(s.gap_bytes, 3 * PAGE as u64, "{s:?}");
        assert_eq!(s.bytes, 6 * PAGE as u64, "holes are not delivered bytes");
        // Without holes only pages 2 and 3 merge.
        let (s, ok) = hole_run(engine, 0);
        assert!(ok);
        assert_eq!((s.syscalls, s.coalesced, s.gap_bytes), (5, 1, 0), "{s:?}");
    }
}

#[test]
fn duplicate_ids_and_empty_targets_complete_at_once() {
    for engine in ENGINES {
        duplicate_ids_and_empty_targets_on(engine);
    }
}

fn duplicate_ids_and_empty_targets_on(engine: Engine) {
    let gate = Gate::new(Arc::new(MemReader::new(pattern(64 * PAGE))));
    let mut arena = AlignedBuf::zeroed(4 * 4 * PAGE).expect("arena");
    let io = engine.open(gate.clone(), 1, IoOptions::default());
    submit(&*io, &mut arena, 0, 0, 1, 0, 0.0);
    wait_until("the first read to block", || {
        gate.started.load(Ordering::SeqCst) == 1
    });
    submit(&*io, &mut arena, 1, 10, 1, 1, 0.0);
    submit(&*io, &mut arena, 1, 20, 1, 2, 0.0);
    submit(&*io, &mut arena, 2, 30, 0, 3, 0.0);
    let mut out = Vec::new();
    wait_until("two immediate completions", || {
        io.try_drain(&mut out);
        out.len() == 2
    });
    assert!(matches!(
        out[0].result,
        Err(Error::InvalidArgument { arg: "id", .. })
    ));
    assert!(out[1].id == 2 && out[1].result.is_ok() && out[1].bytes == 0);
    assert_eq!(
        io.wait(&mut out, Some(Duration::from_millis(20))),
        0,
        "timeout"
    );
    gate.open();
    assert_eq!(ids(&collect(&*io, 2)), [0, 1]);
}

#[test]
fn drop_waits_for_reads_in_flight_and_drops_queued_ones() {
    for engine in ENGINES {
        drop_waits_on(engine);
    }
}

fn drop_waits_on(engine: Engine) {
    let gate = Gate::new(Arc::new(MemReader::new(pattern(64 * PAGE))));
    let mut arena = AlignedBuf::zeroed(5 * 4 * PAGE).expect("arena");
    let io = engine.open(gate.clone(), 1, IoOptions::default());
    for id in 0..5u64 {
        submit(&*io, &mut arena, id, id * 10, 1, id as usize, 0.0);
    }
    wait_until("the first read to block", || {
        gate.started.load(Ordering::SeqCst) == 1
    });
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            gate.open();
        })
    };
    drop(io);
    assert_eq!(
        gate.finished.load(Ordering::SeqCst),
        1,
        "drop returned before the read ended"
    );
    assert_eq!(
        gate.started.load(Ordering::SeqCst),
        1,
        "queued reads were started"
    );
    opener.join().expect("opener");
    assert_eq!(slot(&arena, 0, 1), &pattern(PAGE)[..]);
}
