//! Read requests and the priority queue the I/O workers pop from, with the coalescing plan.
//!
//! The queue is a plain data structure (no locking, no I/O) so that its ordering and its merge plan
//! can be tested directly; the pool wraps it in a `Mutex`.

use std::collections::{BTreeMap, HashMap};

/// Where a read lands: `len` bytes at `ptr`.
///
/// The submitter guarantees the memory stays valid and is not accessed until the read's completion
/// is delivered (or `cancel()` returned true). Typically a cache slot (see `crate::cache`).
#[derive(Debug)]
pub struct ReadTarget {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a ReadTarget is a promise of exclusive access to `len` bytes at `ptr` until the read
// completes (see `ReadTarget::new`); handing that promise to an I/O thread is what it is for.
unsafe impl Send for ReadTarget {}

impl ReadTarget {
    /// A target of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes (non-null, even when `len` is 0), and nothing
    /// else may read or write those bytes from the moment the request is submitted until its
    /// completion is delivered or it is cancelled. For an `O_DIRECT` reader, `ptr` and `len` must
    /// be [`super::PAGE`]-aligned (otherwise the read fails, safely, with `InvalidInput`).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        ReadTarget { ptr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the target is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// What a read's bytes must hash to: the CRC-32 of a streamed FFN chunk (the whole target,
/// padding included), with the chunk's place for the error that names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkCheck {
    /// CRC-32 (IEEE, as `crc32fast` computes it) of the target's bytes.
    pub crc32: u32,
    pub layer: usize,
    /// The chunk's index inside its layer.
    pub chunk: usize,
}

/// One read: fill `target` from byte `offset` of the file.
#[derive(Debug)]
pub struct ReadRequest {
    /// Caller's id; unique among requests not yet delivered.
    pub id: u64,
    /// Byte offset in the file.
    pub offset: u64,
    pub target: ReadTarget,
    /// Higher is read first; equal priorities are read in submission order. NaN counts as -∞.
    pub priority: f32,
    /// The checksum the bytes are verified against on the I/O thread before the read completes
    /// (when the pool's [`IoOptions::verify_chunks`](super::IoOptions::verify_chunks) is on);
    /// `None` reads unchecked.
    pub check: Option<ChunkCheck>,
}

impl ReadRequest {
    /// One past the last file byte this request reads.
    pub fn end(&self) -> u64 {
        self.offset + self.target.len as u64
    }
}

/// Maps an f32 to a u32 whose unsigned order is the float's total order, flipped so that the
/// highest priority sorts first. NaN is treated as -∞ (read last).
fn priority_key(p: f32) -> u32 {
    let p = if p.is_nan() { f32::NEG_INFINITY } else { p };
    let b = p.to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !ascending
}

/// A queued request with its queue bookkeeping.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) req: ReadRequest,
    seq: u64,
    key: u32,
}

/// The request queue: highest priority first, FIFO among equal priorities; O(log n) push, pop,
/// reprioritise and cancel; and an index by file position so that a pop can take the requests
/// next to the top one ([`RequestQueue::pop_merged`]).
#[derive(Debug, Default)]
pub(crate) struct RequestQueue {
    by_priority: BTreeMap<(u32, u64), u64>,
    /// (start offset, length, seq) → id: the first entry at a position is the shortest there.
    by_start: BTreeMap<(u64, usize, u64), u64>,
    /// (end offset, length, seq) → id.
    by_end: BTreeMap<(u64, usize, u64), u64>,
    entries: HashMap<u64, Queued>,
    next_seq: u64,
}

impl RequestQueue {
    pub(crate) fn with_capacity(n: usize) -> Self {
        RequestQueue {
            entries: HashMap::with_capacity(n),
            ..Default::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Queues `req`. Returns it back if its id is already queued.
    pub(crate) fn push(&mut self, req: ReadRequest) -> Result<(), ReadRequest> {
        if self.entries.contains_key(&req.id) {
            return Err(req);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let key = priority_key(req.priority);
        self.by_priority.insert((key, seq), req.id);
        let len = req.target.len;
        self.by_start.insert((req.offset, len, seq), req.id);
        self.by_end.insert((req.end(), len, seq), req.id);
        self.entries.insert(req.id, Queued { req, seq, key });
        Ok(())
    }

    /// Removes a queued request.
    pub(crate) fn remove(&mut self, id: u64) -> Option<ReadRequest> {
        let q = self.entries.remove(&id)?;
        self.by_priority.remove(&(q.key, q.seq));
        let len = q.req.target.len;
        self.by_start.remove(&(q.req.offset, len, q.seq));
        self.by_end.remove(&(q.req.end(), len, q.seq));
        Some(q.req)
    }

    /// Changes a queued request's priority, keeping its place among equals (submission order).
    /// Returns false if `id` is not queued.
    pub(crate) fn reprioritize(&mut self, id: u64, priority: f32) -> bool {
        let Some(q) = self.entries.get_mut(&id) else {
            return false;
        };
        self.by_priority.remove(&(q.key, q.seq));
        q.key = priority_key(priority);
        q.req.priority = priority;
        self.by_priority.insert((q.key, q.seq), id);
        true
    }

    /// Pops the highest-priority request.
    pub(crate) fn pop(&mut self) -> Option<ReadRequest> {
        let (_, &id) = self.by_priority.first_key_value()?;
        self.remove(id)
    }

    /// The coalescing plan: pops the highest-priority request, then repeatedly takes the queued
    /// request nearest after the merged range (starting at most `max_gap` bytes past its end) or
    /// nearest before it (ending at most `max_gap` bytes before its start), as long as the merged
    /// range, holes included, stays within `max_bytes` (the top request alone may exceed it).
    /// Forward and backward extensions alternate; the result is maximal (no queued request
    /// within `max_gap` of it would still fit). No queued request lies inside a hole.
    /// Appends the taken requests to `out` sorted by offset. Returns how many were appended
    /// (0 if the queue is empty).
    pub(crate) fn pop_merged(
        &mut self,
        max_bytes: usize,
        max_gap: usize,
        out: &mut Vec<ReadRequest>,
    ) -> usize {
        let first = out.len();
        let Some(top) = self.pop() else {
            return 0;
        };
        let (mut lo, mut hi) = (top.offset, top.end());
        out.push(top);
        let gap = max_gap as u64;
        let fits = |lo: u64, hi: u64| hi - lo <= max_bytes as u64;
        loop {
            let mut grew = false;
            if let Some(id) = self.nearest(&self.by_start, hi, hi.saturating_add(gap), false)
                && let Some(q) = self.entries.get(&id)
                && fits(lo, q.req.end())
                && let Some(r) = self.remove(id)
            {
                hi = r.end();
                out.push(r);
                grew = true;
            }
            if let Some(id) = self.nearest(&self.by_end, lo.saturating_sub(gap), lo, true)
                && let Some(q) = self.entries.get(&id)
                && fits(q.req.offset, hi)
                && let Some(r) = self.remove(id)
            {
                lo = r.offset;
                out.push(r);
                grew = true;
            }
            if !grew {
                break;
            }
        }
        out[first..].sort_unstable_by_key(|r| r.offset);
        out.len() - first
    }

    /// The request whose index position (start or end) is in `from..=to`, nearest to `from`
    /// (`last` false) or to `to` (`last` true); among equal positions the shortest, then the
    /// earliest submitted. If it does not fit in a merge, none farther does.
    fn nearest(
        &self,
        index: &BTreeMap<(u64, usize, u64), u64>,
        from: u64,
        to: u64,
        last: bool,
    ) -> Option<u64> {
        let mut range = index.range((from, 0, 0)..=(to, usize::MAX, u64::MAX));
        let pos = if last {
            range.next_back()?.0.0
        } else {
            range.next()?.0.0
        };
        index
            .range((pos, 0, 0)..=(pos, usize::MAX, u64::MAX))
            .next()
            .map(|(_, &id)| id)
    }

    /// Drops everything queued.
    pub(crate) fn clear(&mut self) {
        self.by_priority.clear();
        self.by_start.clear();
        self.by_end.clear();
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(id: u64, offset: u64, len: usize, priority: f32) -> ReadRequest {
        // SAFETY: these targets are never read into; a dangling non-null pointer is fine.
        let target = unsafe { ReadTarget::new(std::ptr::NonNull::dangling().as_ptr(), len) };
        ReadRequest {
            id,
            offset,
            target,
            priority,
            check: None,
        }
    }

    #[test]
    fn priority_key_orders_floats_highest_first() {
        let ps = [f32::INFINITY, 3.0, 1.0, 0.0, -0.0, -1.0, f32::NEG_INFINITY];
        let keys: Vec<u32> = ps.iter().map(|&p| priority_key(p)).collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
        assert_eq!(priority_key(f32::NAN), priority_key(f32::NEG_INFINITY));
    }

    #[test]
    fn pops_by_priority_then_fifo_and_supports_reprioritize_and_remove() {
        let mut q = RequestQueue::with_capacity(8);
        for (id, p) in [(1, 1.0), (2, 5.0), (3, 1.0), (4, 5.0), (5, 0.5)] {
            q.push(req(id, id * 1_000_000, 10, p)).expect("unique");
        }
        assert!(q.push(req(1, 0, 1, 0.0)).is_err(), "duplicate id");
        assert!(q.reprioritize(5, 9.0));
        assert!(q.remove(4).is_some());
        assert!(!q.reprioritize(4, 1.0));
        let order: Vec<u64> = std::iter::from_fn(|| q.pop()).map(|r| r.id).collect();
        assert_eq!(order, [5, 2, 1, 3]);
        assert!(q.is_empty());
    }

    #[test]
    fn merge_takes_adjacent_requests_both_ways_within_the_limit() {
        let mut q = RequestQueue::default();
        // Pages 0..6 queued out of order, plus a far one; top is page 3.
        for (id, page, p) in [
            (0, 0, 0.0),
            (1, 1, 0.0),
            (2, 2, 0.0),
            (3, 3, 9.0),
            (4, 4, 0.0),
        ] {
            q.push(req(id, page * 4096, 4096, p)).expect("unique");
        }
        q.push(req(9, 100 * 4096, 4096, 1.0)).expect("unique");
        let mut out = Vec::new();
        assert_eq!(q.pop_merged(3 * 4096, 0, &mut out), 3);
        let ids: Vec<u64> = out.iter().map(|r| r.id).collect();
        assert_eq!(ids, [2, 3, 4]);
        out.clear();
        assert_eq!(
            q.pop_merged(1 << 20, 0, &mut out),
            1,
            "the far one has priority 1.0"
        );
        assert_eq!(out[0].id, 9);
        out.clear();
        assert_eq!(q.pop_merged(1 << 20, 0, &mut out), 2);
        assert!(q.is_empty());
    }

    proptest! {
        /// The plan is an offset-sorted run with holes of at most `gap_pages` that contains the
        /// top-priority request, stays within the limit (unless the top alone exceeds it), has no
        /// queued request inside it, and is maximal: no queued request within the hole limit of
        /// either end would still fit.
        #[test]
        fn merge_plan_is_sorted_bounded_and_maximal(
            reqs in prop::collection::vec((0u64..40, 1usize..4, 0u8..4), 1..40),
            max_pages in 1usize..10,
            gap_pages in 0usize..3,
        ) {
            let mut q = RequestQueue::default();
            let mut best: Option<(u8, u64)> = None;
            // Non-overlapping requests, as the pipeline submits them (one per chunk).
            let mut taken = [false; 44];
            for (id, &(page, pages, p)) in reqs.iter().enumerate() {
                let span = page as usize..page as usize + pages;
                if taken[span.clone()].iter().any(|&t| t) {
                    continue;
                }
                taken[span].iter_mut().for_each(|t| *t = true);
                let id = id as u64;
                q.push(req(id, page * 4096, pages * 4096, p as f32)).expect("unique");
                if best.is_none_or(|(bp, _)| p > bp) {
                    best = Some((p, id));
                }
            }
            let queued = q.len();
            let (max, gap) = ((max_pages * 4096) as u64, (gap_pages * 4096) as u64);
            let mut out = Vec::new();
            let n = q.pop_merged(max as usize, gap as usize, &mut out);
            prop_assert_eq!(n, out.len());
            prop_assert!(out.iter().any(|r| Some(r.id) == best.map(|b| b.1)));
            prop_assert!(out.windows(2).all(|w| w[0].end() <= w[1].offset));
            prop_assert!(out.windows(2).all(|w| w[1].offset - w[0].end() <= gap));
            let (lo, hi) = (out[0].offset, out[n - 1].end());
            prop_assert!(hi - lo <= max || n == 1);
            let rest: Vec<&ReadRequest> = q.entries.values().map(|qd| &qd.req).collect();
            for r in &rest {
                prop_assert!(r.end() <= lo || r.offset >= hi, "{} inside the run", r.id);
            }
            // Only the nearest request on each side can extend the run (a farther one would
            // leave it inside a hole).
            if let Some(r) = rest.iter().filter(|r| r.offset >= hi).min_by_key(|r| r.offset) {
                let fits = r.offset - hi <= gap && r.end() - lo <= max;
                prop_assert!(!fits, "missed {} after the run", r.id);
            }
            if let Some(r) = rest.iter().filter(|r| r.end() <= lo).max_by_key(|r| r.end()) {
                let fits = lo - r.end() <= gap && hi - r.offset <= max;
                prop_assert!(!fits, "missed {} before the run", r.id);
            }
            prop_assert_eq!(q.len() + n, queued);
        }
    }
}
