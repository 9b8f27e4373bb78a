//! The I/O engine interface the pipeline drives: requests go in by priority, completions come out.
//! [`super::UringIo`] (io_uring) and [`super::ThreadPoolIo`] (OS threads, the fallback where
//! io_uring is refused) implement it; [`super::open_engine`] picks one.

use std::time::Duration;

use super::queue::ReadRequest;
use crate::Result;

/// The outcome of one request. Exactly one is delivered per submitted request, unless it was
/// cancelled (`cancel()` returned true) or the engine was dropped first.
#[derive(Debug)]
pub struct Completion {
    pub id: u64,
    /// `Err(Error::Read { offset, .. })` after the retries failed, `Err(Error::ShortRead { .. })`
    /// if the file ended first, `Err(Error::ChunkChecksum { .. })` if the bytes twice did not
    /// match the request's [`ChunkCheck`](super::ChunkCheck); the target holds unspecified bytes
    /// then.
    pub result: Result<()>,
    /// Bytes read into the target (its length on success, 0 on failure).
    pub bytes: usize,
}

/// Counters since construction or the last `reset_stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Requests submitted.
    pub requests: u64,
    /// Reads issued: `preadv` calls of the pool, reads submitted to the ring of [`UringIo`]
    /// (continuations of short reads included); interrupted ones included.
    ///
    /// [`UringIo`]: super::UringIo
    pub syscalls: u64,
    /// Requests that rode along in another request's read (a merged read of n requests adds n-1).
    pub coalesced: u64,
    /// Bytes delivered into targets by successful requests.
    pub bytes: u64,
    /// Bytes read only to bridge a gap between merged requests, then dropped.
    pub gap_bytes: u64,
    /// Reads issued again after a failed one (see [`ThreadPoolIo`](super::ThreadPoolIo) for the policy).
    pub retries: u64,
    /// Requests completed with an error.
    pub failures: u64,
    /// Reads whose bytes did not match their chunk's checksum (each is re-read once).
    pub checksum_mismatches: u64,
    /// Wall time workers spent inside reads, in nanoseconds, summed over workers.
    pub busy_ns: u64,
}

/// An engine that reads file ranges into caller memory, highest priority first.
pub trait IoEngine: Send + Sync {
    /// Queues a read. Its completion is delivered by `wait`/`try_drain`.
    ///
    /// # Safety
    /// `req.target`'s memory must stay valid and must not be accessed until this request's
    /// completion has been delivered or `cancel(req.id)` returned true. Ids must be unique among
    /// requests not yet delivered.
    unsafe fn submit(&self, req: ReadRequest);
    /// Changes a queued request's priority. True if it was still queued (not started).
    fn reprioritize(&self, id: u64, priority: f32) -> bool;
    /// Removes a queued request. True if it had not started; then no completion is ever delivered
    /// for it and its target is free again.
    fn cancel(&self, id: u64) -> bool;
    /// Blocks until at least one completion is available or `timeout` passes, then appends all
    /// available completions to `out`. Returns how many were appended; returns 0 at once when
    /// nothing is pending.
    fn wait(&self, out: &mut Vec<Completion>, timeout: Option<Duration>) -> usize;
    /// Appends the completions available now; never blocks. Returns how many.
    fn try_drain(&self, out: &mut Vec<Completion>) -> usize;
    /// Requests submitted and neither delivered nor cancelled (queued, in flight, or completed
    /// but not yet drained).
    fn pending(&self) -> usize;
    /// Counters since construction or the last reset.
    fn stats(&self) -> IoStats;
    /// Zeroes the counters.
    fn reset_stats(&self);
}

/// Default of [`IoOptions::max_gap_bytes`] (see the I/O notes of `docs/bench/sparse.md` for the
/// measurement).
pub const DEFAULT_MAX_GAP_BYTES: usize = 8 << 10;

/// Options of either engine ([`super::UringIo`], [`super::ThreadPoolIo`]).
#[derive(Clone, Debug)]
pub struct IoOptions {
    /// Largest merged read, in bytes (default 1 MiB). A single larger request is still read whole.
    pub max_coalesce_bytes: usize,
    /// Largest hole between two queued requests that a merged read may span (default 8 KiB):
    /// the hole's bytes are read into a scratch buffer and dropped. A separate request costs
    /// more than a few pages of transfer on an SSD, so bridging small holes (left by chunks
    /// that are cached or not needed) keeps reads large. 0 merges exactly adjacent requests only.
    pub max_gap_bytes: usize,
    /// Extra attempts for a failed request (default 3): up to `1 + retries` reads per request.
    pub retries: u32,
    /// Queue entries to preallocate (default 4096); the queue grows past it if needed.
    pub queue_capacity: usize,
    /// Verify each read that carries a [`ChunkCheck`](super::ChunkCheck) against its CRC-32 on
    /// the I/O thread before completing it (default true). Off only to measure what the check
    /// costs: a corrupted chunk is then computed with silently.
    pub verify_chunks: bool,
}

impl Default for IoOptions {
    fn default() -> Self {
        IoOptions {
            max_coalesce_bytes: 1 << 20,
            max_gap_bytes: DEFAULT_MAX_GAP_BYTES,
            retries: 3,
            queue_capacity: 4096,
            verify_chunks: true,
        }
    }
}
