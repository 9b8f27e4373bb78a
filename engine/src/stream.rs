//! Weights that a [`Plan`] streams: the plan's units are read, in compute order and cycle after
//! cycle, through the I/O engine ([`crate::io::open_engine`]: io_uring where the kernel allows
//! it, its thread pool elsewhere) into a ring of page-aligned slots, while the forward pass
//! computes the slot before. The forward pass [`WeightStream::acquire`]s the unit it needs next
//! and drops the [`Lease`] when done, which hands the slot back for the next read.
//!
//! The same engine reads the sparse pipelines' chunks; here every unit is cut into requests of
//! [`REQUEST_BYTES`] queued in order (equal priority is first in, first out), so the engine keeps
//! [`READERS`] of them in flight and a unit's requests go out before the next unit's.
//!
//! The protocol: whenever a slot is free, the next unit (`pos, pos + 1, …`, wrapping) is queued
//! into it; [`SLOTS`] units are ahead at most. A consumer that asks for a unit other than the
//! first one queued (a prompt of two batches skips the head between them) cancels what is queued,
//! waits for what is in flight, and starts over at the unit it wants: the units read for nothing
//! are counted as wasted. A slot is refilled only when no view of it is alive
//! ([`TensorBytes::aligned_mut`]), so a computation can never see a slot change under it.

use std::collections::VecDeque;
use std::io::IoSliceMut;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::io::{
    AlignedBuf, Completion, DirectFile, IoEngine, IoOptions, PAGE, ReadAt, ReadCounters,
    ReadRequest, ReadTarget, align_down, open_engine, read_exact_at,
};
use crate::model::TensorBytes;
use crate::plan::{Plan, SLOTS, Unit};
use crate::{Error, Result};

/// What a weight stream has read and waited for since it started. Named for the stream it
/// counts: the client contract's `StreamStats` are a generation's statistics, and
/// [`crate::io::ReadCounters`] the system calls of one read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WeightStreamCounters {
    /// Bytes of units read into slots (page-aligned).
    pub bytes_read: u64,
    /// Bytes of embedding rows read (the pages holding each row).
    pub row_bytes_read: u64,
    /// Units read and handed back unused (after a change of order).
    pub wasted_units: u64,
    /// Time the forward pass waited for a unit to be read.
    pub wait_ns: u64,
}

/// Bytes of one read request: a unit is cut into requests of this size so that several are in
/// flight at once (one request at a time leaves much of an SSD's bandwidth unused).
pub const REQUEST_BYTES: usize = 512 << 10;

/// Requests in flight at once. Reading two units at once (each in 4 requests) measured slower
/// on the development VM's disk than one (SmolLM2 at a 59 MB cap: 7.6 against 8.5 tok/s), so the
/// depth is one unit's worth.
pub const READERS: usize = 4;

/// A unit queued into a slot, until the consumer takes it.
struct Queued {
    unit: usize,
    slot: TensorBytes,
    /// Its requests are ids `first_id..first_id + requests`.
    first_id: u64,
    requests: usize,
    finished: usize,
    error: Option<Error>,
    /// The file's last, partial page, read here rather than by the engine (a direct read of it
    /// comes back short): only the unit that ends the file has one.
    tail: Option<Tail>,
}

/// Where the file's last page goes in a slot, and how many of its bytes the unit needs.
#[derive(Clone, Copy)]
struct Tail {
    slot_at: usize,
    offset: u64,
    need: usize,
}

/// The ring's state: free slots, the units queued in order, the counters.
struct Ring {
    free: Vec<TensorBytes>,
    queued: VecDeque<Queued>,
    /// The unit queued next.
    next: usize,
    next_id: u64,
    completions: Vec<Completion>,
    counters: WeightStreamCounters,
    /// The buffer embedding rows are read into.
    row: AlignedBuf,
}

/// The streaming side of a planned model. Shared by the sessions on it; one forward pass uses
/// it at a time.
pub struct WeightStream {
    units: Vec<Unit>,
    file: Arc<DirectFile>,
    io: Box<dyn IoEngine>,
    ring: Mutex<Ring>,
    slot_bytes: usize,
    /// Where each slot is in memory (address, bytes), fixed from the start.
    slot_memory: Vec<(usize, usize)>,
}

impl std::fmt::Debug for WeightStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStream")
            .field("units", &self.units.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish_non_exhaustive()
    }
}

/// A unit being computed: its slot's bytes. Dropping it returns the slot to the ring; every view
/// made from [`Lease::bytes`] must be dropped first (or the slot is not refilled).
#[derive(Debug)]
pub struct Lease<'a> {
    slot: Option<TensorBytes>,
    stream: &'a WeightStream,
}

impl Lease<'_> {
    /// The unit's bytes, laid out as [`Unit::slot_offset`] says.
    pub fn bytes(&self) -> &TensorBytes {
        self.slot.as_ref().expect("present until dropped")
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            let mut ring = self.stream.lock();
            ring.free.push(s);
            self.stream.queue_ahead(&mut ring);
        }
    }
}

fn os(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Os { what, source }
}

impl WeightStream {
    /// Starts reading `plan`'s units from `file` (the model file) into a ring of [`SLOTS`]
    /// slots; `max_row_bytes` sizes the buffer embedding rows are read into.
    pub fn start(plan: &Plan, file: DirectFile, max_row_bytes: usize) -> Result<Self> {
        let slot_bytes = plan.slot_bytes as usize;
        let row = AlignedBuf::zeroed(max_row_bytes.next_multiple_of(PAGE) + PAGE)
            .map_err(os("allocating the embedding row buffer".into()))?;
        let mut free = Vec::new();
        if !plan.units.is_empty() {
            for _ in 0..SLOTS {
                let buf = AlignedBuf::zeroed(slot_bytes)
                    .map_err(os(format!("allocating a {slot_bytes}-byte stream slot")))?;
                free.push(TensorBytes::from_aligned(buf));
            }
        }
        let slot_memory = free
            .iter()
            .map(|s| (s.as_slice().as_ptr() as usize, s.len()))
            .collect();
        let file = Arc::new(file);
        let opts = IoOptions {
            max_coalesce_bytes: REQUEST_BYTES,
            max_gap_bytes: 0,
            verify_chunks: false,
            ..IoOptions::default()
        };
        let io = open_engine(Arc::clone(&file) as Arc<dyn ReadAt>, READERS, READERS, opts)?;
        let stream = WeightStream {
            units: plan.units.clone(),
            file,
            io,
            ring: Mutex::new(Ring {
                free,
                queued: VecDeque::new(),
                next: 0,
                next_id: 0,
                completions: Vec::new(),
                counters: WeightStreamCounters::default(),
                row,
            }),
            slot_bytes,
            slot_memory,
        };
        stream.queue_ahead(&mut stream.lock());
        Ok(stream)
    }

    /// The streamed units, in compute order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// Where the ring's slots are in memory, `(address, bytes)` each, for as long as the stream
    /// lives: what a GPU maps once to read the slots in place.
    pub fn slot_memory(&self) -> &[(usize, usize)] {
        &self.slot_memory
    }

    /// Bytes of the ring (0 when nothing streams).
    pub fn ring_bytes(&self) -> u64 {
        if self.units.is_empty() {
            0
        } else {
            (SLOTS * self.slot_bytes.next_multiple_of(PAGE)) as u64
        }
    }

    /// Counters since the start.
    pub fn counters(&self) -> WeightStreamCounters {
        self.lock().counters
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        Error::Io {
            path: self.file.path().to_path_buf(),
            source: e,
        }
    }

    /// Queues the next units into the free slots, up to [`SLOTS`] ahead.
    fn queue_ahead(&self, ring: &mut Ring) {
        while ring.queued.len() < SLOTS && !self.units.is_empty() {
            let Some(mut slot) = ring.free.pop() else {
                return;
            };
            let Some(buf) = slot.aligned_mut() else {
                // A view of this slot is still alive: it is queued again when the caller drops it.
                ring.free.push(slot);
                return;
            };
            let unit = ring.next;
            let (first_id, requests, tail) = self.submit(&self.units[unit], buf, &mut ring.next_id);
            ring.queued.push_back(Queued {
                unit,
                slot,
                first_id,
                requests,
                finished: 0,
                error: None,
                tail,
            });
            ring.next = (unit + 1) % self.units.len();
        }
    }

    /// Queues the requests of `unit` into `slot`. Returns the first id, the number of requests
    /// and the partial last page of the file if the unit holds it.
    fn submit(
        &self,
        unit: &Unit,
        slot: &mut AlignedBuf,
        next_id: &mut u64,
    ) -> (u64, usize, Option<Tail>) {
        let first_id = *next_id;
        // Bytes a direct read can return in full: the file's whole pages.
        let whole_pages = align_down(self.file.len(), PAGE as u64);
        let (mut at, mut tail) = (0usize, None);
        let base = slot.as_mut_ptr();
        for r in &unit.reads {
            let mut off = r.start;
            while off < r.end {
                let len = ((r.end - off) as usize).min(REQUEST_BYTES);
                let direct = (whole_pages.saturating_sub(off) as usize).min(len);
                if direct < len {
                    let offset = off + direct as u64;
                    tail = Some(Tail {
                        slot_at: at + direct,
                        offset,
                        need: unit.end.saturating_sub(offset) as usize,
                    });
                }
                if direct > 0 {
                    // SAFETY: `at + direct` lies inside the slot (the plan sizes slots for the
                    // largest unit); the slot is not touched until every request of this unit
                    // has completed or been cancelled (`take`, `discard`, `Drop`).
                    let target = unsafe { ReadTarget::new(base.add(at), direct) };
                    let req = ReadRequest {
                        id: *next_id,
                        offset: off,
                        target,
                        priority: 0.0,
                        check: None,
                    };
                    *next_id += 1;
                    // SAFETY: as above; ids grow, so they are unique.
                    unsafe { self.io.submit(req) };
                }
                off += len as u64;
                at += len;
            }
        }
        (first_id, (*next_id - first_id) as usize, tail)
    }

    /// Counts `completions` against the queued units they belong to.
    fn absorb(&self, ring: &mut Ring) {
        let Ring {
            queued,
            completions,
            ..
        } = ring;
        for c in completions.drain(..) {
            let Some(q) = queued
                .iter_mut()
                .find(|q| (q.first_id..q.first_id + q.requests as u64).contains(&c.id))
            else {
                continue;
            };
            q.finished += 1;
            if let (Err(e), None) = (c.result, &q.error) {
                q.error = Some(e);
            }
        }
    }

    /// Waits until the first queued unit's requests have all completed.
    fn wait_front(&self, ring: &mut Ring) {
        while let Some(q) = ring.queued.front()
            && q.finished < q.requests
        {
            let mut got = std::mem::take(&mut ring.completions);
            self.io.wait(&mut got, None);
            ring.completions = got;
            self.absorb(ring);
        }
    }

    /// Cancels every queued unit, waits for its requests in flight and frees its slot. Returns
    /// how many units were dropped.
    fn discard(&self, ring: &mut Ring) -> usize {
        for q in ring.queued.iter_mut() {
            for id in q.first_id..q.first_id + q.requests as u64 {
                if self.io.cancel(id) {
                    q.finished += 1;
                }
            }
        }
        let n = ring.queued.len();
        while !ring.queued.is_empty() {
            self.wait_front(ring);
            let q = ring.queued.pop_front().expect("not empty");
            ring.free.push(q.slot);
        }
        n
    }

    /// Waits for unit `unit` (an index into [`WeightStream::units`]) and leases its slot.
    pub fn acquire(&self, unit: usize) -> Result<Lease<'_>> {
        let mut ring = self.lock();
        let t = Instant::now();
        if ring.queued.front().map(|q| q.unit) != Some(unit) {
            let wasted = self.discard(&mut ring);
            ring.counters.wasted_units += wasted as u64;
            ring.next = unit;
            self.queue_ahead(&mut ring);
        }
        self.wait_front(&mut ring);
        let Some(mut q) = ring.queued.pop_front() else {
            return Err(Error::Os {
                what: "the weight stream has no free slot: a view of a slot outlived its lease"
                    .into(),
                source: std::io::Error::other("stream slot still in use"),
            });
        };
        let mut result = q.error.take().map_or(Ok(()), Err);
        if let (Ok(()), Some(t)) = (&result, q.tail) {
            let buf = q
                .slot
                .aligned_mut()
                .expect("no view of a queued slot exists");
            let page = &mut buf.as_mut_slice()[t.slot_at..t.slot_at + PAGE];
            result = read_to_eof(&*self.file, page, t.offset, t.need).map_err(|e| self.io_error(e));
        }
        ring.counters.wait_ns += t.elapsed().as_nanos() as u64;
        if let Err(e) = result {
            ring.free.push(q.slot);
            self.queue_ahead(&mut ring);
            return Err(e);
        }
        ring.counters.bytes_read += self.units[unit].bytes();
        self.queue_ahead(&mut ring);
        Ok(Lease {
            slot: Some(q.slot),
            stream: self,
        })
    }

    /// Reads file bytes `range` (one embedding row) and hands them to `f`, synchronously.
    pub fn read_row(&self, range: std::ops::Range<u64>, f: impl FnOnce(&[u8])) -> Result<()> {
        let mut ring = self.lock();
        let start = align_down(range.start, PAGE as u64);
        let len = ((range.end - start) as usize).next_multiple_of(PAGE);
        let buf = &mut ring.row.as_mut_slice()[..len];
        read_to_eof(&*self.file, buf, start, (range.end - start) as usize)
            .map_err(|e| self.io_error(e))?;
        let at = (range.start - start) as usize;
        f(&buf[at..at + (range.end - range.start) as usize]);
        ring.counters.row_bytes_read += len as u64;
        Ok(())
    }
}

impl Drop for WeightStream {
    fn drop(&mut self) {
        // No read may land in a slot after the slot is freed.
        let mut ring = self.lock();
        self.discard(&mut ring);
    }
}

/// Fills `buf` (page-aligned length) from `offset`, accepting a file that ends after `need`
/// bytes (the last page of a file is read short).
fn read_to_eof(
    reader: &dyn ReadAt,
    buf: &mut [u8],
    offset: u64,
    need: usize,
) -> std::io::Result<()> {
    let whole = buf.len().min(need) / PAGE * PAGE;
    let mut counters = ReadCounters::default();
    read_exact_at(
        reader,
        &mut [IoSliceMut::new(&mut buf[..whole])],
        offset,
        &mut counters,
    )?;
    if whole >= need {
        return Ok(());
    }
    // The tail: one page-aligned request that may come back short at the end of the file.
    let tail = &mut buf[whole..];
    let mut done = 0;
    while whole + done < need {
        match reader.read_at(
            &mut [IoSliceMut::new(&mut tail[done..])],
            offset + (whole + done) as u64,
        ) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("file ends before byte {}", offset + need as u64),
                ));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if whole + done < need && !done.is_multiple_of(reader.alignment().max(1)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("file ends before byte {}", offset + need as u64),
            ));
        }
    }
    Ok(())
}
