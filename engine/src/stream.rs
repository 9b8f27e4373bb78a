//! Weights that a [`Plan`] streams: one I/O thread reads the plan's units, in compute order and
//! cycle after cycle, into a ring of page-aligned slots, while the forward pass computes the
//! slot before. The forward pass [`WeightStream::acquire`]s the unit it needs next and drops
//! the [`Lease`] when done, which hands the slot back for the next read.
//!
//! Why our own thread and not the chunk I/O pool: these reads are few (one per layer), large
//! (megabytes), always in the same order and always needed — no priorities, no cancellation, no
//! merging — so one thread reading ahead into a fixed ring is all it takes, and it keeps the
//! pool's queue for the sparse chunks it was built for. Each unit is read in [`READERS`]
//! concurrent requests on a small thread pool of the stream's own.
//!
//! The protocol: the reader fills free slots with units `pos, pos + 1, …` (wrapping) and sends
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

use rayon::prelude::*;

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
    unit: usize,
    epoch: u64,
    slot: TensorBytes,
    result: std::io::Result<()>,
}

/// What the forward pass side of the stream keeps between calls: the reader's results, the
/// epoch it expects, the counters, and the buffer embedding rows are read into.
struct Consumer {
    filled: Receiver<Filled>,
    epoch: u64,
    stats: StreamStats,
    row: AlignedBuf,
}

/// The streaming side of a planned model. Shared by the sessions on it; one forward pass uses
/// it at a time.
pub struct WeightStream {
    units: Arc<Vec<Unit>>,
    reader: Arc<dyn ReadAt>,
    cmd: Sender<Cmd>,
    consumer: Mutex<Consumer>,
    worker: Option<JoinHandle<()>>,
    slot_bytes: usize,
}

impl std::fmt::Debug for WeightStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStream")
            .field("units", &self.units.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish_non_exhaustive()
    }
}

/// A unit being computed: its slot's bytes. Dropping it returns the slot to the reader; every
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
    /// Starts the reader of `plan`'s units from `reader` (a [`crate::io::DirectFile`] of the
    /// model file; its alignment is honoured). Allocates the ring of [`SLOTS`] slots.
    pub fn start(plan: &Plan, reader: Arc<dyn ReadAt>, max_row_bytes: usize) -> Result<Self> {
        let units = Arc::new(plan.units.clone());
        let slot_bytes = plan.slot_bytes as usize;
        let row = AlignedBuf::zeroed(max_row_bytes.next_multiple_of(PAGE) + PAGE)
            .map_err(os("allocating the embedding row buffer".into()))?;
        let (cmd, cmd_rx) = mpsc::channel();
        let (filled_tx, filled) = mpsc::channel();
        let worker = if units.is_empty() {
            None
        } else {
            let mut free = Vec::with_capacity(SLOTS);
            for _ in 0..SLOTS {
                let buf = AlignedBuf::zeroed(slot_bytes)
                    .map_err(os(format!("allocating a {slot_bytes}-byte stream slot")))?;
                free.push(TensorBytes::from_aligned(buf));
            }
            // The requests of one unit run on these threads, kept for the stream's life.
            let requests = rayon::ThreadPoolBuilder::new()
                .num_threads(READERS)
                .thread_name(|i| format!("ls-stream-io-{i}"))
                .build()
                .map_err(|e| Error::Os {
                    what: "starting the weight stream's I/O threads".into(),
                    source: std::io::Error::other(e),
                })?;
            let (units, reader) = (Arc::clone(&units), Arc::clone(&reader));
            Some(
                std::thread::Builder::new()
                    .name("ls-stream".into())
                    .spawn(move || {
                        read_loop(&units, &*reader, &requests, free, &cmd_rx, &filled_tx)
                    })
                    .map_err(os("spawning the weight stream reader".into()))?,
            )
        };
        Ok(WeightStream {
            units,
            reader,
            cmd,
            consumer: Mutex::new(Consumer {
                filled,
                epoch: 0,
                stats: StreamStats::default(),
                row,
            }),
            worker,
            slot_bytes,
        })
    }

    /// The streamed units, in compute order.
    pub fn units(&self) -> &[Unit] {
        &self.units
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
    pub fn stats(&self) -> StreamStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Consumer> {
        self.consumer.lock().unwrap_or_else(|p| p.into_inner())
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
        let mut c = self.lock();
        let t = Instant::now();
        let got = loop {
            let f = c.filled.recv().map_err(|_| Error::Os {
                what: "the weight stream reader stopped".into(),
                source: std::io::Error::other("reader thread gone"),
            })?;
            if f.epoch != c.epoch {
                let _ = self.cmd.send(Cmd::Free(f.slot));
                continue;
            }
            if f.unit != unit {
                c.stats.wasted_units += 1;
                c.epoch += 1;
                let epoch = c.epoch;
                let _ = self.cmd.send(Cmd::Free(f.slot));
                let _ = self.cmd.send(Cmd::Seek { unit, epoch });
                continue;
            }
            break f;
        };
        c.stats.wait_ns += t.elapsed().as_nanos() as u64;
        if let Err(e) = got.result {
            let _ = self.cmd.send(Cmd::Free(got.slot));
            return Err(self.io_error(e));
        }
        c.stats.bytes_read += self.units[unit].bytes();
        Ok(Lease {
            slot: Some(got.slot),
            cmd: &self.cmd,
        })
    }

    /// Reads file bytes `range` (one embedding row) and hands them to `f`, synchronously.
    pub fn read_row(&self, range: std::ops::Range<u64>, f: impl FnOnce(&[u8])) -> Result<()> {
        let mut c = self.lock();
        let start = align_down(range.start, PAGE as u64);
        let len = ((range.end - start) as usize).next_multiple_of(PAGE);
        let buf = &mut c.row.as_mut_slice()[..len];
        read_to_eof(&*self.reader, buf, start, (range.end - start) as usize)
            .map_err(|e| self.io_error(e))?;
        let at = (range.start - start) as usize;
        f(&buf[at..at + (range.end - range.start) as usize]);
        c.stats.row_bytes_read += len as u64;
        Ok(())
    }
}

impl Drop for WeightStream {
    fn drop(&mut self) {
        // Closing the command channel stops the reader; it may first finish one read.
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.cmd, tx));
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The reader thread: fills free slots with the next units until the command channel closes.
fn read_loop(
    units: &[Unit],
    reader: &dyn ReadAt,
    requests: &rayon::ThreadPool,
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
            Some(buf) => read_unit(reader, requests, &units[pos], buf.as_mut_slice()),
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
/// read [`READERS`] at a time, since one request at a time leaves much of an SSD's bandwidth
/// unused. Reading two units at once (each in 4 requests) measured slower on the development
/// VM's disk than one (SmolLM2 at a 59 MB cap: 7.6 against 8.5 tok/s), so one unit is in flight.
const PIECE_BYTES: usize = 512 << 10;

/// Requests of one unit in flight at once.
pub const READERS: usize = 4;

/// Slots of the ring: one computed, one read ahead, one being read.
pub const SLOTS: usize = 3;

fn read_unit(
    reader: &dyn ReadAt,
    requests: &rayon::ThreadPool,
    unit: &Unit,
    slot: &mut [u8],
) -> std::io::Result<()> {
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
    requests.install(|| {
        pieces
            .par_iter_mut()
            .try_for_each(|(buf, off, need)| read_to_eof(reader, buf, *off, *need))
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
