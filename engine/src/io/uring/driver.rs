//! The ring thread ([`Driver`]): takes merged reads from the queue while fewer than `depth` are in
//! flight, issues them on the ring, and turns their completions into [`Completion`]s with the
//! pool's policy (continue short reads, retry failures, verify checksums).

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::super::aligned::AlignedBuf;
use super::super::engine::Completion;
use super::super::pool::{Shared, add, lock};
use super::super::queue::ReadRequest;
use super::op::{Op, Scratch, Step};
use super::ring::{Doorbell, Ring, Sqe};
use crate::Error;

/// The tag of the doorbell read (reads are tagged with their slot, `0..depth`).
const WAKE: u64 = u64::MAX;

/// The state of the ring thread. Dropping it waits until nothing is in flight.
#[derive(Debug)]
pub(super) struct Driver<R: Ring> {
    shared: Arc<Shared>,
    bell: Arc<Doorbell>,
    ring: R,
    /// Ops in flight, by slot (the SQE's tag).
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    /// Started ops waiting for a slot (reads alone after a merged read failed or mismatched):
    /// issued before anything new is taken from the queue.
    backlog: VecDeque<Op>,
    /// Where the doorbell read puts the eventfd's counter (never read).
    wake_buf: Box<UnsafeCell<u64>>,
    /// Whether the doorbell read is in flight.
    waking: bool,
    scratch: Option<AlignedBuf>,
    max_gap: usize,
    align: usize,
    batches: Vec<Vec<ReadRequest>>,
    cqes: Vec<(u64, i32)>,
    done: Vec<Completion>,
    ring_error_logged: bool,
}

impl<R: Ring> Driver<R> {
    /// A driver keeping up to `depth` (≥ 1) reads in flight on `ring`.
    pub(super) fn new(shared: Arc<Shared>, bell: Arc<Doorbell>, ring: R, depth: usize) -> Self {
        let opts = &shared.opts;
        // One scratch for every hole of every read (see `Scratch`); without it only exactly
        // adjacent requests merge, as in the pool.
        let scratch = (opts.max_gap_bytes > 0)
            .then(|| AlignedBuf::zeroed(opts.max_gap_bytes).ok())
            .flatten();
        let max_gap = scratch.as_ref().map_or(0, |_| opts.max_gap_bytes);
        let align = shared.reader.alignment();
        Driver {
            shared,
            bell,
            ring,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            backlog: VecDeque::new(),
            wake_buf: Box::new(UnsafeCell::new(0)),
            waking: false,
            scratch,
            max_gap,
            align,
            batches: Vec::with_capacity(depth),
            cqes: Vec::with_capacity(depth + 1),
            done: Vec::with_capacity(depth),
            ring_error_logged: false,
        }
    }

    /// Serves the queue until the engine shuts down and every read in flight has completed.
    pub(super) fn run(mut self) {
        loop {
            let stopping = self.fill();
            if stopping {
                self.backlog.clear();
            } else if !self.waking {
                self.arm_wake();
            }
            if stopping && self.idle() {
                return;
            }
            self.wait();
            self.reap(stopping);
            self.deliver();
        }
    }

    fn idle(&self) -> bool {
        !self.waking && self.free.len() == self.slots.len()
    }

    /// Issues backlog ops, then merged reads from the queue, while slots are free. Returns true
    /// once the engine is shutting down (then nothing new is taken).
    fn fill(&mut self) -> bool {
        while !self.free.is_empty()
            && let Some(op) = self.backlog.pop_front()
        {
            self.issue(op);
        }
        let room = self.free.len();
        if room > 0 {
            // Before looking at the queue: a request queued after this rings the bell again.
            self.bell.answer();
        }
        let (max_bytes, max_gap) = (self.shared.opts.max_coalesce_bytes, self.max_gap);
        let mut batches = std::mem::take(&mut self.batches);
        {
            let mut st = lock(&self.shared.queue);
            if st.shutdown {
                return true;
            }
            while batches.len() < room {
                let mut batch = Vec::new();
                if st.queue.pop_merged(max_bytes, max_gap, &mut batch) == 0 {
                    break;
                }
                batches.push(batch);
            }
        }
        for batch in batches.drain(..) {
            self.start(batch);
        }
        self.batches = batches;
        false
    }

    fn start(&mut self, batch: Vec<ReadRequest>) {
        if batch.len() > 1 {
            add(&self.shared.stats.coalesced, batch.len() as u64 - 1);
        }
        let scratch = match self.scratch.as_mut() {
            Some(s) => Scratch {
                ptr: s.as_mut_ptr(),
                len: s.len(),
            },
            None => Scratch {
                ptr: std::ptr::null_mut(),
                len: 0,
            },
        };
        match Op::new(batch, scratch) {
            Ok(op) => self.issue(op),
            Err(reqs) => self.split(reqs),
        }
    }

    /// Puts `op` in a free slot and pushes its SQE (back to the backlog if no slot is free).
    fn issue(&mut self, mut op: Op) {
        let Some(slot) = self.free.pop() else {
            self.backlog.push_front(op);
            return;
        };
        op.issued = std::time::Instant::now();
        let sqe = op.sqe();
        self.slots[slot] = Some(op);
        // SAFETY: the SQE names the op's iovecs (heap memory that stays put while the op sits
        // in its slot, unchanged, until this tag's completion is reaped), the request targets
        // (valid and reserved for this engine until their completions: `IoEngine::submit`'s
        // contract) and the scratch (owned by this driver, never read). The driver does not
        // drop any of them before reaping every completion (`Drop`).
        unsafe { self.push(sqe, slot as u64) };
        add(&self.shared.stats.syscalls, 1);
    }

    fn arm_wake(&mut self) {
        let sqe = Sqe::Wake {
            buf: self.wake_buf.get(),
        };
        // SAFETY: the counter buffer is owned by the driver, written only through this pointer,
        // never read, and outlives the read (`Drop` waits for it).
        unsafe { self.push(sqe, WAKE) };
        self.waking = true;
    }

    /// Pushes an SQE, submitting first if the submission queue is full (it holds at least
    /// `depth + 1` entries, so it is not, but a ring may say so).
    ///
    /// # Safety
    /// As [`Ring::push`]: what `sqe` names stays valid and untouched until the completion tagged
    /// `tag` is reaped.
    unsafe fn push(&mut self, sqe: Sqe, tag: u64) {
        // SAFETY: passed on from this function's contract.
        while !unsafe { self.ring.push(sqe, tag) } {
            self.submit_or_log(0);
        }
    }

    fn wait(&mut self) {
        self.submit_or_log(1);
    }

    /// Submits and waits for `want` completions. An interrupted wait just returns; other
    /// errors (the kernel out of memory for the moment) are logged once and waited out.
    fn submit_or_log(&mut self, want: usize) {
        match self.ring.submit_and_wait(want) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => {
                if !std::mem::replace(&mut self.ring_error_logged, true) {
                    tracing::warn!("io_uring submit failed, retrying: {e}");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Takes the completions available; while `stopping`, ops are only retired, not continued.
    fn reap(&mut self, stopping: bool) {
        let mut cqes = std::mem::take(&mut self.cqes);
        self.ring.reap(&mut cqes);
        for &(tag, res) in &cqes {
            if tag == WAKE {
                self.waking = false;
                continue;
            }
            let slot = tag as usize;
            let Some(op) = self.slots.get_mut(slot).and_then(Option::take) else {
                continue;
            };
            self.free.push(slot);
            let busy = op.issued.elapsed().as_nanos();
            add(
                &self.shared.stats.busy_ns,
                u64::try_from(busy).unwrap_or(u64::MAX),
            );
            if !stopping {
                self.advance(op, res);
            }
        }
        cqes.clear();
        self.cqes = cqes;
    }

    fn advance(&mut self, mut op: Op, res: i32) {
        match op.complete(res, self.align) {
            Step::Again => self.issue(op),
            Step::Done => self.finished(op),
            Step::Failed(e) => self.failed(op, e),
        }
    }

    /// Verifies and completes the requests of a read that got all its bytes. A mismatch in a
    /// merged read is read again alone; one alone is read again once, then fails.
    fn finished(&mut self, mut op: Op) {
        if op.reqs.len() > 1 {
            add(&self.shared.stats.gap_bytes, op.holes);
            for r in op.reqs {
                match self.shared.verify(&r) {
                    Ok(()) => self.shared.succeed(&r, &mut self.done),
                    Err(_) => {
                        add(&self.shared.stats.retries, 1);
                        self.backlog.push_back(Op::alone(r, 1));
                    }
                }
            }
            return;
        }
        let Some(r) = op.reqs.first() else { return };
        match self.shared.verify(r) {
            Ok(()) => self.shared.succeed(r, &mut self.done),
            Err(_) if op.mismatches == 0 => {
                op.mismatches = 1;
                add(&self.shared.stats.retries, 1);
                op.rewind();
                self.issue(op);
            }
            Err((check, found)) => {
                let error = Error::ChunkChecksum {
                    path: self
                        .shared
                        .reader
                        .path()
                        .map(Into::into)
                        .unwrap_or_default(),
                    layer: check.layer,
                    chunk: check.chunk,
                    expected: check.crc32,
                    found,
                };
                self.fail(r.id, error);
            }
        }
    }

    /// A failed merged read is split into reads alone; a read alone is retried up to
    /// `opts.retries` times, then completes with the error.
    fn failed(&mut self, mut op: Op, err: std::io::Error) {
        if op.reqs.len() > 1 {
            return self.split(op.reqs);
        }
        if op.attempt <= self.shared.opts.retries {
            op.attempt += 1;
            add(&self.shared.stats.retries, 1);
            op.rewind();
            return self.issue(op);
        }
        let Some(r) = op.reqs.first() else { return };
        let (offset, len) = (r.offset, r.target.len());
        let error = if err.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::ShortRead { offset, len }
        } else {
            Error::Read {
                offset,
                len,
                attempts: op.attempt,
                source: err,
            }
        };
        self.fail(r.id, error);
    }

    /// Re-reads the requests of a failed merged read one by one, so that one bad range cannot
    /// fail its neighbours.
    fn split(&mut self, reqs: Vec<ReadRequest>) {
        add(&self.shared.stats.retries, reqs.len() as u64);
        self.backlog
            .extend(reqs.into_iter().map(|r| Op::alone(r, 0)));
    }

    fn fail(&mut self, id: u64, error: Error) {
        add(&self.shared.stats.failures, 1);
        self.done.push(Completion {
            id,
            result: Err(error),
            bytes: 0,
        });
    }

    fn deliver(&mut self) {
        if self.done.is_empty() {
            return;
        }
        lock(&self.shared.done).append(&mut self.done);
        self.shared.done_cv.notify_all();
    }
}

impl<R: Ring> Drop for Driver<R> {
    /// The kernel writes into request targets, the scratch and the doorbell buffer until each
    /// operation's completion: wait for all of them, also when unwinding from a panic. (The
    /// doorbell read ends when the engine's drop rings it.)
    fn drop(&mut self) {
        while !self.idle() {
            self.wait();
            self.reap(true);
        }
    }
}
