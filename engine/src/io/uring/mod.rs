//! [`UringIo`]: the [`IoEngine`] on io_uring: one thread keeps up to `depth` coalesced reads in
//! flight on a ring, instead of one blocking `preadv` per pool thread. [`open_engine`] picks it
//! where the kernel allows io_uring and falls back to [`ThreadPoolIo`] elsewhere.
//!
//! - `ring`: the `Ring` seam, the kernel's ring behind it, the eventfd doorbell;
//! - `op`: one read on the ring, its iovecs, and what a completion means for it;
//! - `driver`: the ring thread: filling slots from the queue, retries, verification, delivery;
//! - `open`: [`open_engine`], the choice between io_uring and the pool (`LEANSTREAM_IO`);
//! - `sim` (tests only): a ring that performs reads through any `ReadAt` on threads, so that the
//!   pool's gate and fault-injection tests also drive this engine's retry logic.
//!
//! Threads: one ring thread, `leanstream-uring`, owns the ring, so neither queue of the ring is
//! ever shared or locked. Callers' `submit` only queues the request (in the pool's priority queue,
//! behind the same mutex) and rings an eventfd doorbell; the ring thread keeps a read of that
//! eventfd in flight on the ring, so it sleeps in one `io_uring_enter` until either a read
//! completes or work arrives, and a burst of submissions costs one doorbell write. Submitting
//! from the caller's thread instead would need a lock around the submission queue and would move
//! the queue's merge planning onto the pipeline's thread, and a completion thread would be needed
//! all the same (to continue short reads, retry and verify checksums), so one thread does both.
//! Checksums are verified on that thread too: while it hashes, completions wait, but the reads
//! already in flight go on, and CRC-32 runs at several GB/s.
//!
//! What a caller sees is the pool's own code: the request queue and its coalescing plan, the
//! completion list, `cancel`/`reprioritize`/`wait`/`try_drain`/`pending`, the counters and the
//! chunk verification (a [`ThreadPoolIo`] with no worker threads serves as the front; only
//! `submit` differs, to ring the doorbell), so the two engines cannot drift apart in what they
//! promise.

mod driver;
mod op;
mod open;
mod ring;
#[cfg(test)]
pub(crate) mod sim;
#[cfg(test)]
mod tests;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::engine::{Completion, IoEngine, IoOptions, IoStats};
use super::pool::{QueueState, Shared, ThreadPoolIo, lock};
use super::queue::{ReadRequest, RequestQueue};
use super::read::ReadAt;
use crate::{Error, Result};
use driver::Driver;
use ring::{Doorbell, KernelRing, Ring};

pub use open::{IO_BACKEND_ENV, IoBackend, open_engine, open_engine_with};

/// Deepest ring [`UringIo::new`] sets up; deeper requests are clamped to it.
pub const MAX_DEPTH: usize = 4096;

/// [`IoEngine`] on an io_uring: up to `depth` reads in flight from one thread.
///
/// Same behaviour as [`ThreadPoolIo`], which documents it: priority order, coalescing (merged
/// reads bridge holes of up to `max_gap_bytes`), retries (a failed merged read is re-read request
/// by request; a request alone is read up to `1 + retries` times, then fails with
/// [`Error::Read`], or [`Error::ShortRead`] if the file ended first), verification of
/// [`ChunkCheck`](super::ChunkCheck)s (a mismatch is read again once), and the same [`IoStats`],
/// where `syscalls` counts SQEs (each read issued, continued or retried) and `busy_ns` sums each
/// SQE's time from issue to completion. A short read is continued where it stopped; `EINTR` and
/// `EAGAIN` completions are issued again and are not failures.
///
/// The holes of merged reads all land in one scratch buffer of `max_gap_bytes`, shared by the
/// reads in flight (the bytes are dropped unread), so memory does not grow with `depth`.
///
/// Drop stops taking requests, waits for every read in flight (the kernel writes into the
/// targets until their completions) and drops queued requests without completing them.
#[derive(Debug)]
pub struct UringIo {
    front: ThreadPoolIo,
    bell: Arc<Doorbell>,
    thread: Option<JoinHandle<()>>,
    depth: usize,
}

impl UringIo {
    /// Starts an engine reading `reader`'s file with up to `depth` (1..=[`MAX_DEPTH`]; larger is
    /// clamped) reads in flight.
    ///
    /// Fails with [`Error::InvalidArgument`] if `depth` is 0 or `reader` has no file descriptor
    /// ([`ReadAt::raw_fd`]), and with [`Error::Os`] where the kernel refuses io_uring (`EPERM`:
    /// `kernel.io_uring_disabled`, seccomp; `ENOSYS`: before Linux 5.1; `ENOMEM`: locked memory).
    pub fn new(reader: Arc<dyn ReadAt>, depth: usize, opts: IoOptions) -> Result<Self> {
        let depth = checked_depth(depth)?;
        let Some(fd) = reader.raw_fd() else {
            return Err(Error::InvalidArgument {
                arg: "reader",
                reason: "io_uring reads a file descriptor; this reader has none".into(),
            });
        };
        let os = |what: &str, source| Error::Os {
            what: format!("{what} for {}", describe(&*reader)),
            source,
        };
        let bell = Doorbell::new().map_err(|e| os("creating the io_uring doorbell", e))?;
        let ring = KernelRing::new(depth + 1, fd, bell.raw_fd())
            .map_err(|e| os("setting up io_uring", e))?;
        Self::start(reader, depth, opts, bell, ring)
    }

    /// Reads in flight at most.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Starts the ring thread on `ring`, which reads `reader`'s file and wakes on `bell`.
    fn start<R: Ring + 'static>(
        reader: Arc<dyn ReadAt>,
        depth: usize,
        opts: IoOptions,
        bell: Doorbell,
        ring: R,
    ) -> Result<Self> {
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
            stats: Default::default(),
            opts,
        });
        let bell = Arc::new(bell);
        let thread = {
            let (shared, bell) = (Arc::clone(&shared), Arc::clone(&bell));
            std::thread::Builder::new()
                .name("leanstream-uring".into())
                .spawn(move || Driver::new(shared, bell, ring, depth).run())
                .map_err(|source| Error::Os {
                    what: "spawning the io_uring thread".into(),
                    source,
                })?
        };
        let front = ThreadPoolIo {
            shared,
            workers: Vec::new(),
        };
        Ok(UringIo {
            front,
            bell,
            thread: Some(thread),
            depth,
        })
    }
}

fn checked_depth(depth: usize) -> Result<usize> {
    if depth == 0 {
        return Err(Error::InvalidArgument {
            arg: "depth",
            reason: "the io_uring engine needs at least one read in flight".into(),
        });
    }
    Ok(depth.min(MAX_DEPTH))
}

fn describe(reader: &dyn ReadAt) -> String {
    reader
        .path()
        .map_or_else(|| "a reader".into(), |p| p.display().to_string())
}

impl IoEngine for UringIo {
    unsafe fn submit(&self, req: ReadRequest) {
        // The pool's queueing, with the doorbell in place of the workers' condvar.
        if self.front.enqueue(req) {
            self.bell.ring();
        }
    }

    fn reprioritize(&self, id: u64, priority: f32) -> bool {
        self.front.reprioritize(id, priority)
    }

    fn cancel(&self, id: u64) -> bool {
        self.front.cancel(id)
    }

    fn wait(&self, out: &mut Vec<Completion>, timeout: Option<Duration>) -> usize {
        self.front.wait(out, timeout)
    }

    fn try_drain(&self, out: &mut Vec<Completion>) -> usize {
        self.front.try_drain(out)
    }

    fn pending(&self) -> usize {
        self.front.pending()
    }

    fn stats(&self) -> IoStats {
        self.front.stats()
    }

    fn reset_stats(&self) {
        self.front.reset_stats()
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        lock(&self.front.shared.queue).shutdown = true;
        self.bell.ring_always();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            // The driver's own drop waited for its reads in flight while unwinding.
            tracing::error!("the io_uring thread panicked");
        }
        // Then `front` drops the requests still queued.
    }
}
