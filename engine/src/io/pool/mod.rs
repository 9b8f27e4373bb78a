//! [`ThreadPoolIo`]: the [`IoEngine`] on plain OS threads (never async runtime workers) doing
//! coalesced, retried, vectored preads.
//!
//! Locking: one `Mutex` + `Condvar` around the request queue (workers wait on it for work) and one
//! around the completion list (the engine thread waits on it). Neither lock is held during a read.

use std::io::IoSliceMut;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::aligned::AlignedBuf;
use super::engine::{Completion, IoEngine, IoOptions, IoStats};
use super::queue::{ChunkCheck, ReadRequest, RequestQueue};
use super::read::{ReadAt, ReadCounters, read_exact_at};
use crate::{Error, Result};

#[derive(Debug, Default)]
pub(super) struct AtomicStats {
    pub(super) requests: AtomicU64,
    pub(super) syscalls: AtomicU64,
    pub(super) coalesced: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) gap_bytes: AtomicU64,
    pub(super) retries: AtomicU64,
    pub(super) failures: AtomicU64,
    pub(super) checksum_mismatches: AtomicU64,
    pub(super) busy_ns: AtomicU64,
}

pub(super) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

#[derive(Debug)]
pub(super) struct QueueState {
    pub(super) queue: RequestQueue,
    pub(super) shutdown: bool,
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) reader: Arc<dyn ReadAt>,
    pub(super) opts: IoOptions,
    pub(super) queue: Mutex<QueueState>,
    pub(super) work: Condvar,
    pub(super) done: Mutex<Vec<Completion>>,
    pub(super) done_cv: Condvar,
    pub(super) pending: AtomicUsize,
    pub(super) stats: AtomicStats,
}

/// Locks, ignoring poisoning: no code path panics while holding these locks with state half
/// updated, so the data is consistent even if another thread panicked elsewhere.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// [`IoEngine`] on `threads` OS threads named `leanstream-io-N`.
///
/// Coalescing: a worker pops the top request and the queued requests next to it in the file
/// (repeatedly, both ways, across holes of up to `max_gap_bytes`) up to `max_coalesce_bytes`, and
/// reads them with one vectored read, holes into a per-worker scratch buffer; each request still
/// gets its own [`Completion`].
///
/// Retries: a merged read that fails is not retried as a whole; its requests are re-read one by
/// one, so that one bad range cannot fail its neighbours. A single request is read up to
/// `1 + retries` times; then it completes with [`Error::Read`] naming its offset (or
/// [`Error::ShortRead`] if the file ended first), and the pool keeps serving others. `EINTR` and
/// short reads are not failures (the read loop continues them).
///
/// Verification: a request with a [`ChunkCheck`] is hashed (CRC-32) on the worker after its read
/// and before its completion, unless [`IoOptions::verify_chunks`] is off. A mismatch is read again
/// once, alone; a second mismatch completes it with [`Error::ChunkChecksum`], so that corrupted
/// bytes are never reported as a successful read.
///
/// Drop stops the workers, waits for reads in flight (so nothing is written into a target after
/// drop returns) and drops queued requests without completing them.
#[derive(Debug)]
pub struct ThreadPoolIo {
    pub(super) shared: Arc<Shared>,
    pub(super) workers: Vec<JoinHandle<()>>,
}

impl ThreadPoolIo {
    /// Starts `threads` (≥ 1) workers reading from `reader`.
    pub fn new(reader: Arc<dyn ReadAt>, threads: usize, opts: IoOptions) -> Result<Self> {
        if threads == 0 {
            return Err(Error::InvalidArgument {
                arg: "threads",
                reason: "the I/O pool needs at least one thread".into(),
            });
        }
        let shared = Arc::new(Shared {
            reader,
            queue: Mutex::new(QueueState {
                queue: RequestQueue::with_capacity(opts.queue_capacity),
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Mutex::new(Vec::with_capacity(opts.queue_capacity)),
            done_cv: Condvar::new(),
            pending: AtomicUsize::new(0),
            stats: AtomicStats::default(),
            opts,
        });
        let mut pool = ThreadPoolIo {
            shared,
            workers: Vec::with_capacity(threads),
        };
        for n in 0..threads {
            let shared = Arc::clone(&pool.shared);
            let name = format!("leanstream-io-{n}");
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || shared.worker())
                .map_err(|source| Error::Os {
                    what: format!("spawning I/O thread {name}"),
                    source,
                })?; // dropping `pool` stops the workers already started
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    pub(super) fn deliver(&self, c: Completion) {
        let mut done = lock(&self.shared.done);
        done.push(c);
        self.shared.done_cv.notify_all();
    }

    /// Counts `req` in and queues it; true when it was queued and a reader must be woken. An
    /// empty request completes at once, a duplicate id completes with an error. The part of
    /// `submit` both engines share: each wakes its own reader.
    pub(super) fn enqueue(&self, req: ReadRequest) -> bool {
        let sh = &self.shared;
        sh.pending.fetch_add(1, Ordering::AcqRel);
        add(&sh.stats.requests, 1);
        if req.target.is_empty() {
            self.deliver(Completion {
                id: req.id,
                result: Ok(()),
                bytes: 0,
            });
            return false;
        }
        let pushed = lock(&sh.queue).queue.push(req);
        match pushed {
            Ok(()) => true,
            Err(req) => {
                add(&sh.stats.failures, 1);
                self.deliver(Completion {
                    id: req.id,
                    result: Err(Error::InvalidArgument {
                        arg: "id",
                        reason: format!("request id {} is already queued", req.id),
                    }),
                    bytes: 0,
                });
                false
            }
        }
    }

    fn take_all(&self, done: &mut Vec<Completion>, out: &mut Vec<Completion>) -> usize {
        let n = done.len();
        out.append(done);
        self.shared.pending.fetch_sub(n, Ordering::AcqRel);
        n
    }
}

impl IoEngine for ThreadPoolIo {
    unsafe fn submit(&self, req: ReadRequest) {
        if self.enqueue(req) {
            self.shared.work.notify_one();
        }
    }

    fn reprioritize(&self, id: u64, priority: f32) -> bool {
        lock(&self.shared.queue).queue.reprioritize(id, priority)
    }

    fn cancel(&self, id: u64) -> bool {
        let removed = lock(&self.shared.queue).queue.remove(id).is_some();
        if removed {
            // Under the done lock, so that a waiter that saw pending > 0 is woken to recheck.
            let _done = lock(&self.shared.done);
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
            self.shared.done_cv.notify_all();
        }
        removed
    }

    fn wait(&self, out: &mut Vec<Completion>, timeout: Option<Duration>) -> usize {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut done = lock(&self.shared.done);
        while done.is_empty() {
            if self.shared.pending.load(Ordering::Acquire) == 0 {
                return 0;
            }
            done = match deadline {
                None => self
                    .shared
                    .done_cv
                    .wait(done)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return 0;
                    }
                    self.shared
                        .done_cv
                        .wait_timeout(done, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
        self.take_all(&mut done, out)
    }

    fn try_drain(&self, out: &mut Vec<Completion>) -> usize {
        let mut done = lock(&self.shared.done);
        self.take_all(&mut done, out)
    }

    fn pending(&self) -> usize {
        self.shared.pending.load(Ordering::Acquire)
    }

    fn stats(&self) -> IoStats {
        let s = &self.shared.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        IoStats {
            requests: get(&s.requests),
            syscalls: get(&s.syscalls),
            coalesced: get(&s.coalesced),
            bytes: get(&s.bytes),
            gap_bytes: get(&s.gap_bytes),
            retries: get(&s.retries),
            failures: get(&s.failures),
            checksum_mismatches: get(&s.checksum_mismatches),
            busy_ns: get(&s.busy_ns),
        }
    }

    fn reset_stats(&self) {
        let s = &self.shared.stats;
        for c in [
            &s.requests,
            &s.syscalls,
            &s.coalesced,
            &s.bytes,
            &s.gap_bytes,
            &s.retries,
            &s.failures,
            &s.checksum_mismatches,
            &s.busy_ns,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

impl Drop for ThreadPoolIo {
    fn drop(&mut self) {
        {
            let mut st = lock(&self.shared.queue);
            st.shutdown = true;
            let dropped = st.queue.len();
            st.queue.clear();
            self.shared.pending.fetch_sub(dropped, Ordering::AcqRel);
        }
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            // A worker that panicked has nothing in flight any more; nothing to report here.
            let _ = w.join();
        }
    }
}

/// Reuses a vector's allocation for slices of another lifetime. The vector is emptied first, so
/// the closure never runs and the in-place `collect` keeps the buffer.
#[expect(
    clippy::unnecessary_filter_map,
    reason = "filter_map is what changes the item type (its lifetime) while collecting in place"
)]
fn recycle<'a, 'b>(mut v: Vec<IoSliceMut<'a>>) -> Vec<IoSliceMut<'b>> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

impl Shared {
    fn worker(&self) {
        let mut batch: Vec<ReadRequest> = Vec::with_capacity(64);
        let mut iov: Vec<IoSliceMut<'static>> = Vec::with_capacity(64);
        let mut results: Vec<Completion> = Vec::with_capacity(64);
        // Holes of a merged read land here: the merged range, holes included, is at most
        // `max_coalesce_bytes`. Without it (no holes allowed, or no memory) only adjacent
        // requests merge.
        let mut scratch = if self.opts.max_gap_bytes > 0 {
            AlignedBuf::zeroed(self.opts.max_coalesce_bytes).ok()
        } else {
            None
        };
        let max_gap = if scratch.is_some() {
            self.opts.max_gap_bytes
        } else {
            0
        };
        loop {
            {
                let mut st = lock(&self.queue);
                while !st.shutdown && st.queue.is_empty() {
                    st = self.work.wait(st).unwrap_or_else(PoisonError::into_inner);
                }
                if st.shutdown {
                    return;
                }
                st.queue
                    .pop_merged(self.opts.max_coalesce_bytes, max_gap, &mut batch);
            }
            self.run_batch(&batch, &mut iov, scratch.as_mut(), &mut results);
            batch.clear();
            let mut done = lock(&self.done);
            done.append(&mut results);
            self.done_cv.notify_all();
        }
    }

    /// Reads an offset-sorted batch (holes between requests go to `scratch`) and appends one
    /// completion per request.
    fn run_batch(
        &self,
        batch: &[ReadRequest],
        iov: &mut Vec<IoSliceMut<'static>>,
        scratch: Option<&mut AlignedBuf>,
        out: &mut Vec<Completion>,
    ) {
        if batch.len() > 1 {
            add(&self.stats.coalesced, batch.len() as u64 - 1);
            if let Ok(holes) = self.read(batch, iov, scratch) {
                add(&self.stats.gap_bytes, holes);
                for r in batch {
                    match self.verify(r) {
                        Ok(()) => self.succeed(r, out),
                        Err(_) => {
                            add(&self.stats.retries, 1);
                            self.read_alone(r, iov, 1, out);
                        }
                    }
                }
                return;
            }
            add(&self.stats.retries, batch.len() as u64);
        }
        for r in batch {
            self.read_alone(r, iov, 0, out);
        }
    }

    /// Reads `r` by itself and appends its completion: a failed read is tried again up to
    /// `retries` times, a checksum mismatch once in all (`mismatches` counts those seen already,
    /// e.g. after a merged read).
    fn read_alone(
        &self,
        r: &ReadRequest,
        iov: &mut Vec<IoSliceMut<'static>>,
        mut mismatches: u32,
        out: &mut Vec<Completion>,
    ) {
        let mut attempt = 1;
        let error = loop {
            match self.read(std::slice::from_ref(r), iov, None) {
                Ok(_) => match self.verify(r) {
                    Ok(()) => return self.succeed(r, out),
                    Err((check, found)) => {
                        mismatches += 1;
                        if mismatches < 2 {
                            add(&self.stats.retries, 1);
                            continue;
                        }
                        break Error::ChunkChecksum {
                            path: self.reader.path().map(Into::into).unwrap_or_default(),
                            layer: check.layer,
                            chunk: check.chunk,
                            expected: check.crc32,
                            found,
                        };
                    }
                },
                Err(_) if attempt <= self.opts.retries => {
                    attempt += 1;
                    add(&self.stats.retries, 1);
                }
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    break Error::ShortRead {
                        offset: r.offset,
                        len: r.target.len(),
                    };
                }
                Err(source) => {
                    break Error::Read {
                        offset: r.offset,
                        len: r.target.len(),
                        attempts: attempt,
                        source,
                    };
                }
            }
        };
        add(&self.stats.failures, 1);
        out.push(Completion {
            id: r.id,
            result: Err(error),
            bytes: 0,
        });
    }

    /// Checks a request's freshly read target against its [`ChunkCheck`], when it has one and
    /// verification is on. Returns the check and the CRC-32 found on a mismatch.
    pub(super) fn verify(&self, r: &ReadRequest) -> Result<(), (ChunkCheck, u32)> {
        let Some(check) = r.check.filter(|_| self.opts.verify_chunks) else {
            return Ok(());
        };
        // SAFETY: as in `read`: the target is valid for its length and only this worker touches
        // it until the completion, which is pushed after this borrow ends; the read into it has
        // returned, so nothing writes it meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(r.target.as_ptr(), r.target.len()) };
        let found = crc32fast::hash(bytes);
        if found == check.crc32 {
            return Ok(());
        }
        add(&self.stats.checksum_mismatches, 1);
        tracing::warn!(
            layer = check.layer,
            chunk = check.chunk,
            offset = r.offset,
            "chunk checksum mismatch (expected {:#010x}, read {found:#010x})",
            check.crc32
        );
        Err((check, found))
    }

    pub(super) fn succeed(&self, r: &ReadRequest, out: &mut Vec<Completion>) {
        add(&self.stats.bytes, r.target.len() as u64);
        out.push(Completion {
            id: r.id,
            result: Ok(()),
            bytes: r.target.len(),
        });
    }

    /// One exact read of the offset-sorted `reqs` into their targets, the holes between them into
    /// `scratch`. Returns the bytes of the holes.
    fn read(
        &self,
        reqs: &[ReadRequest],
        spare: &mut Vec<IoSliceMut<'static>>,
        scratch: Option<&mut AlignedBuf>,
    ) -> std::io::Result<u64> {
        let mut bufs: Vec<IoSliceMut<'_>> = recycle(std::mem::take(spare));
        let mut free: &mut [u8] = scratch.map_or(&mut [], |s| s.as_mut_slice());
        let (mut pos, mut holes) = (reqs[0].offset, 0u64);
        for r in reqs {
            let hole = (r.offset - pos) as usize;
            if hole > 0 {
                if hole > free.len() {
                    *spare = recycle(bufs);
                    return Err(std::io::Error::other(
                        "a hole larger than the scratch buffer",
                    ));
                }
                let (h, rest) = std::mem::take(&mut free).split_at_mut(hole);
                free = rest;
                bufs.push(IoSliceMut::new(h));
                holes += hole as u64;
            }
            // SAFETY: the submitter guaranteed (IoEngine::submit) that the target is valid for
            // writes of its length and untouched by anyone else until the completion, which is
            // delivered only after this slice is gone; the request was popped from the queue, so
            // only this worker holds it.
            let s = unsafe { std::slice::from_raw_parts_mut(r.target.as_ptr(), r.target.len()) };
            bufs.push(IoSliceMut::new(s));
            pos = r.end();
        }
        let start = Instant::now();
        let mut counters = ReadCounters::default();
        let res = read_exact_at(&*self.reader, &mut bufs, reqs[0].offset, &mut counters);
        add(&self.stats.busy_ns, start.elapsed().as_nanos() as u64);
        add(&self.stats.syscalls, counters.syscalls);
        *spare = recycle(bufs);
        res.map(|()| holes)
    }
}

#[cfg(test)]
mod fault_tests;
#[cfg(test)]
pub(super) mod tests;
#[cfg(test)]
mod verify_tests;
