//! Weights that a [`Plan`] streams: one I/O thread reads the plan's units, in compute order and
//! cycle after cycle, into a ring of page-aligned slots, while the forward pass computes the
//! slot before. The forward pass [`WeightStream::acquire`]s the unit it needs next and drops
//! the [`Lease`] when done, which hands the slot back for the next read.
//!
//! Why our own thread and not the chunk I/O pool: these reads are few (one per layer), large
//! (megabytes), always in the same order and always needed — no priorities, no cancellation, no
//! merging — so one thread reading ahead into a fixed ring is all it takes, and it keeps the
//! pool's queue for the sparse chunks it was built for.
//!
//! The protocol, per lane (a reader thread serving every [`LANES`]-th unit with its own
//! slots): the reader fills free slots with units `pos, pos + 1, …` (wrapping) and sends
//! each with the `epoch` it was read in. A consumer that finds a unit other than the one it
//! asks for (a prompt of two batches skips the head between them) starts a new epoch at the unit
//! it wants: the reader moves there and the slots of the old epoch come back unused (counted as
//! wasted). A slot is refilled only when no view of it is alive ([`TensorBytes::aligned_mut`]),
//! so a computation can never see a slot change under it.

use std::io::IoSliceMut;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::io::{AlignedBuf, PAGE, ReadAt, ReadCounters, align_down, read_exact_at};
use crate::model::TensorBytes;
use crate::plan::{Plan, Unit};
use crate::{Error, Result};

/// Counters of a stream since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Bytes of units read into slots (page-aligned).
    pub bytes_read: u64,
    /// Bytes of embedding rows read (the pages holding each row).
    pub row_bytes_read: u64,
    /// Units read and handed back unused (after a change of order).
    pub wasted_units: u64,
    /// Time the forward pass waited for a unit to be read.
    pub wait_ns: u64,
}

enum Cmd {
    Free(TensorBytes),
    Seek { unit: usize, epoch: u64 },
}

struct Filled {
    /// The unit's index in its lane.
    unit: usize,
    epoch: u64,
    slot: TensorBytes,
    result: std::io::Result<()>,
}

/// One reader thread with its own slots, serving every [`LANES`]-th unit. Units of different
/// lanes are read at the same time, so while one layer computes, the next two are in flight.
struct Lane {
    cmd: Sender<Cmd>,
    filled: Mutex<(Receiver<Filled>, u64)>, // and the epoch the consumer expects
    worker: Option<JoinHandle<()>>,
}

/// Reader threads (lanes, at most one per unit); unit `u` is read by lane `u % lanes`. One: on the development VM's
/// disk two units in flight at once (each in [`READERS`] requests) read slower than one
/// (SmolLM2 at a 59 MB cap: 7.6 against 8.5 tok/s); a board's NVMe may want two.
pub const LANES: usize = 1;

/// Slots per lane: one computed, one read ahead, one being read.
pub const SLOTS_PER_LANE: usize = 3;

/// The streaming side of a planned model. Shared by the sessions on it; one forward pass uses
/// it at a time.
pub struct WeightStream {
    units: Arc<Vec<Unit>>,
    reader: Arc<dyn ReadAt>,
    lanes: Vec<Lane>,
    stats: Mutex<(StreamStats, AlignedBuf)>, // and the embedding row buffer
    slot_bytes: usize,
}

impl std::fmt::Debug for WeightStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStream")
            .field("units", &self.units.len())
            .field("slot_bytes", &self.slot_bytes)
            .field("lanes", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

/// A unit being computed: its slot's bytes. Dropping it returns the slot to its reader; every
/// view made from [`Lease::bytes`] must be dropped first (or the slot is not refilled).
#[derive(Debug)]
pub struct Lease<'a> {
    slot: Option<TensorBytes>,
    cmd: &'a Sender<Cmd>,
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
            let _ = self.cmd.send(Cmd::Free(s));
        }
    }
}

fn os(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Os { what, source }
}

impl WeightStream {
    /// Starts the readers of `plan`'s units from `reader` (a [`crate::io::DirectFile`] of the
    /// model file; its alignment is honoured). Allocates the ring.
    pub fn start(plan: &Plan, reader: Arc<dyn ReadAt>, max_row_bytes: usize) -> Result<Self> {
        let units = Arc::new(plan.units.clone());
        let slot_bytes = plan.slot_bytes as usize;
        let row = AlignedBuf::zeroed(max_row_bytes.next_multiple_of(PAGE) + PAGE)
            .map_err(os("allocating the embedding row buffer".into()))?;
        let mut lanes = Vec::new();
        let n_lanes = LANES.min(units.len());
        for lane in 0..n_lanes {
            let mine: Vec<Unit> = units.iter().skip(lane).step_by(n_lanes).cloned().collect();
            let (cmd, cmd_rx) = mpsc::channel();
            let (filled_tx, filled) = mpsc::channel();
            let mut free = Vec::with_capacity(SLOTS_PER_LANE);
            for _ in 0..SLOTS_PER_LANE {
                let buf = AlignedBuf::zeroed(slot_bytes)
                    .map_err(os(format!("allocating a {slot_bytes}-byte stream slot")))?;
                free.push(TensorBytes::from_aligned(buf));
            }
            let reader = Arc::clone(&reader);
            let worker = std::thread::Builder::new()
                .name(format!("ls-stream-{lane}"))
                .spawn(move || read_loop(&mine, &*reader, free, &cmd_rx, &filled_tx))
                .map_err(os("spawning a weight stream reader".into()))?;
            lanes.push(Lane {
                cmd,
                filled: Mutex::new((filled, 0)),
                worker: Some(worker),
            });
        }
        Ok(WeightStream {
            units,
            reader,
            lanes,
            stats: Mutex::new((StreamStats::default(), row)),
            slot_bytes,
        })
    }

    /// The streamed units, in compute order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// Bytes of the ring (all slots of all lanes).
    pub fn ring_bytes(&self) -> u64 {
        (self.lanes.len() * SLOTS_PER_LANE * self.slot_bytes.next_multiple_of(PAGE)) as u64
    }

    /// Counters since the start.
    pub fn stats(&self) -> StreamStats {
        lock(&self.stats).0
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        Error::Io {
            path: self
                .reader
                .path()
                .map(|p| p.to_path_buf())
                .unwrap_or_default(),
            source: e,
        }
    }

    /// Waits for unit `unit` (an index into [`WeightStream::units`]) and leases its slot.
    pub fn acquire(&self, unit: usize) -> Result<Lease<'_>> {
        let lane = &self.lanes[unit % self.lanes.len()];
        let local = unit / self.lanes.len();
        let t = Instant::now();
        let mut wasted = 0;
        let mut guard = lock(&lane.filled);
        let (filled, epoch) = &mut *guard;
        let got = loop {
            let f = filled.recv().map_err(|_| Error::Os {
                what: "the weight stream reader stopped".into(),
                source: std::io::Error::other("reader thread gone"),
            })?;
            if f.epoch != *epoch {
                let _ = lane.cmd.send(Cmd::Free(f.slot));
                continue;
            }
            if f.unit != local {
                wasted += 1;
                *epoch += 1;
                let _ = lane.cmd.send(Cmd::Free(f.slot));
                let _ = lane.cmd.send(Cmd::Seek {
                    unit: local,
                    epoch: *epoch,
                });
                continue;
            }
            break f;
        };
        drop(guard);
        let mut st = lock(&self.stats);
        st.0.wait_ns += t.elapsed().as_nanos() as u64;
        st.0.wasted_units += wasted;
        if let Err(e) = got.result {
            let _ = lane.cmd.send(Cmd::Free(got.slot));
            return Err(self.io_error(e));
        }
        st.0.bytes_read += self.units[unit].bytes();
        Ok(Lease {
            slot: Some(got.slot),
            cmd: &lane.cmd,
        })
    }

    /// Reads file bytes `range` (one embedding row) and hands them to `f`, synchronously.
    pub fn read_row(&self, range: std::ops::Range<u64>, f: impl FnOnce(&[u8])) -> Result<()> {
        let mut st = lock(&self.stats);
        let (stats, row) = &mut *st;
        let start = align_down(range.start, PAGE as u64);
        let len = ((range.end - start) as usize).next_multiple_of(PAGE);
        let buf = &mut row.as_mut_slice()[..len];
        read_to_eof(&*self.reader, buf, start, (range.end - start) as usize)
            .map_err(|e| self.io_error(e))?;
        let at = (range.start - start) as usize;
        f(&buf[at..at + (range.end - range.start) as usize]);
        stats.row_bytes_read += len as u64;
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for WeightStream {
    fn drop(&mut self) {
        // Closing a lane's command channel stops its reader; it may first finish one read.
        for lane in &mut self.lanes {
            let (tx, _) = mpsc::channel();
            drop(std::mem::replace(&mut lane.cmd, tx));
            if let Some(w) = lane.worker.take() {
                let _ = w.join();
            }
        }
    }
}

/// The reader thread: fills free slots with the next units until the command channel closes.
fn read_loop(
    units: &[Unit],
    reader: &dyn ReadAt,
    mut free: Vec<TensorBytes>,
    cmd: &Receiver<Cmd>,
    filled: &Sender<Filled>,
) {
    let (mut pos, mut epoch) = (0usize, 0u64);
    loop {
        loop {
            let c = if free.is_empty() {
                match cmd.recv() {
                    Ok(c) => c,
                    Err(_) => return,
                }
            } else {
                match cmd.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            };
            match c {
                Cmd::Free(s) => free.push(s),
                Cmd::Seek { unit, epoch: e } => (pos, epoch) = (unit, e),
            }
        }
        let Some(mut slot) = free.pop() else { continue };
        let result = match slot.aligned_mut() {
            Some(buf) => read_unit(reader, &units[pos], buf.as_mut_slice()),
            None => Err(std::io::Error::other("a stream slot is still in use")),
        };
        if filled
            .send(Filled {
                unit: pos,
                epoch,
                slot,
                result,
            })
            .is_err()
        {
            return;
        }
        pos = (pos + 1) % units.len();
    }
}

/// Bytes of one read request of a unit: a unit's reads are split into pieces of this size and
/// read [`READERS`] at a time, since one request at a time leaves most of an SSD's bandwidth
/// unused (measured on the dev VM: 1 MiB requests one at a time ~0.7 GB/s, four at a time
/// 1.7 GB/s). With [`LANES`] units in flight, up to `LANES × READERS` requests are.
const PIECE_BYTES: usize = 512 << 10;

/// Requests of one unit in flight at once.
pub const READERS: usize = 4;

fn read_unit(reader: &dyn ReadAt, unit: &Unit, slot: &mut [u8]) -> std::io::Result<()> {
    // (slot bytes, file offset, bytes the file must hold) of every piece.
    let mut pieces: Vec<(&mut [u8], u64, usize)> = Vec::new();
    let mut rest = slot;
    for r in &unit.reads {
        let mut off = r.start;
        while off < r.end {
            let len = ((r.end - off) as usize).min(PIECE_BYTES);
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            let need = len.min(unit.end.saturating_sub(off) as usize);
            pieces.push((piece, off, need));
            off += len as u64;
        }
    }
    if pieces.len() == 1 {
        let (buf, off, len) = pieces.pop().expect("one piece");
        return read_to_eof(reader, buf, off, len);
    }
    // A few scoped threads share the pieces; each reads its share in file order.
    let per = pieces.len().div_ceil(READERS);
    std::thread::scope(|scope| {
        let handles: Vec<_> = pieces
            .chunks_mut(per)
            .map(|share| {
                scope.spawn(move || {
                    for (buf, off, len) in share.iter_mut() {
                        read_to_eof(reader, buf, *off, *len)?;
                    }
                    Ok::<(), std::io::Error>(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a reader panicked")))
        })
    })
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
