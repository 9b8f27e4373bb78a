//! Test readers: an in-memory [`ReadAt`] and a fault-injecting wrapper.
//!
//! Public (not `cfg(test)`) so that other modules' tests and integration tests can drive the I/O
//! pool and the pipeline through storage that fails, reads short, is interrupted or is slow, in a
//! deterministic way.

use std::io::{self, ErrorKind, IoSliceMut};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::ReadAt;

/// A [`ReadAt`] over bytes in memory; never fails, never reads short except at the end.
#[derive(Debug, Clone)]
pub struct MemReader {
    data: Arc<[u8]>,
}

impl MemReader {
    /// Serves `data` as the file contents.
    pub fn new(data: impl Into<Arc<[u8]>>) -> Self {
        MemReader { data: data.into() }
    }

    /// The file contents.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
}

impl ReadAt for MemReader {
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        let mut pos = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(self.data.len());
        let start = pos;
        for b in bufs.iter_mut() {
            let n = b.len().min(self.data.len() - pos);
            b[..n].copy_from_slice(&self.data[pos..pos + n]);
            pos += n;
        }
        Ok(pos - start)
    }
}

/// What an injected fault does to the call it fires on.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultKind {
    /// Fail with an error of this kind (the message names the offset).
    Error(ErrorKind),
    /// Fail with `ErrorKind::Interrupted`, as `EINTR` would.
    Interrupted,
    /// Do the read but report at most this many bytes (≥ 1; the rest is unspecified, as after a
    /// real short read).
    Short(usize),
    /// Sleep this long, then do the read normally (slow storage).
    Delay(Duration),
    /// Do the read, then flip the bits of the first byte read (a transfer that went wrong
    /// silently; only a checksum can tell).
    Corrupt,
}

#[derive(Debug, Clone)]
enum Trigger {
    Call(u64),
    Every(u64),
    Range(Range<u64>),
}

/// One fault rule: when it fires (a call number, every n-th call, or any call whose byte range
/// overlaps a range) and what it does; optionally limited to its first `k` firings.
#[derive(Debug)]
pub struct Fault {
    trigger: Trigger,
    kind: FaultKind,
    limit: Option<u64>,
    fired: AtomicU64,
}

impl Fault {
    fn new(trigger: Trigger, kind: FaultKind) -> Self {
        Fault {
            trigger,
            kind,
            limit: None,
            fired: AtomicU64::new(0),
        }
    }

    /// Fires on call number `n` (0-based, counting every `read_at` on the wrapper).
    pub fn on_call(n: u64, kind: FaultKind) -> Self {
        Self::new(Trigger::Call(n), kind)
    }

    /// Fires on calls `n-1, 2n-1, …` (every n-th call; `n` ≥ 1).
    pub fn every(n: u64, kind: FaultKind) -> Self {
        Self::new(Trigger::Every(n.max(1)), kind)
    }

    /// Fires on every call whose byte range `offset..offset+len` overlaps `range`: a persistent
    /// fault at those bytes (a bad sector), or a transient one with [`Fault::times`].
    pub fn on_range(range: Range<u64>, kind: FaultKind) -> Self {
        Self::new(Trigger::Range(range), kind)
    }

    /// Fires at most `k` times, then never again.
    pub fn times(mut self, k: u64) -> Self {
        self.limit = Some(k);
        self
    }

    /// How many times this rule has fired.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Relaxed)
    }

    fn matches(&self, call: u64, range: &Range<u64>) -> bool {
        let hit = match &self.trigger {
            Trigger::Call(n) => call == *n,
            Trigger::Every(n) => (call + 1).is_multiple_of(*n),
            Trigger::Range(r) => r.start < range.end && range.start < r.end,
        };
        if !hit {
            return false;
        }
        match self.limit {
            None => {
                self.fired.fetch_add(1, Ordering::Relaxed);
                true
            }
            Some(k) => self
                .fired
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |f| {
                    (f < k).then_some(f + 1)
                })
                .is_ok(),
        }
    }
}

/// Wraps a [`ReadAt`] and applies the first matching [`Fault`] rule to each call. Deterministic
/// for a given sequence of calls (call numbers count every `read_at`, from 0).
#[derive(Debug)]
pub struct FaultyReader {
    inner: Arc<dyn ReadAt>,
    faults: Vec<Fault>,
    calls: AtomicU64,
}

impl FaultyReader {
    /// Wraps `inner` with `faults` (checked in order; the first that matches fires).
    pub fn new(inner: Arc<dyn ReadAt>, faults: Vec<Fault>) -> Self {
        FaultyReader {
            inner,
            faults,
            calls: AtomicU64::new(0),
        }
    }

    /// `read_at` calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The rules, to ask how often each fired.
    pub fn faults(&self) -> &[Fault] {
        &self.faults
    }
}

impl ReadAt for FaultyReader {
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        let range = offset..offset.saturating_add(len);
        let fault = self.faults.iter().find(|f| f.matches(call, &range));
        match fault.map(|f| &f.kind) {
            None => self.inner.read_at(bufs, offset),
            Some(FaultKind::Error(kind)) => Err(io::Error::new(
                *kind,
                format!("injected fault on call {call} at offset {offset}"),
            )),
            Some(FaultKind::Interrupted) => Err(io::Error::from(ErrorKind::Interrupted)),
            Some(FaultKind::Short(max)) => {
                let n = self.inner.read_at(bufs, offset)?;
                Ok(n.min((*max).max(1)))
            }
            Some(FaultKind::Delay(d)) => {
                std::thread::sleep(*d);
                self.inner.read_at(bufs, offset)
            }
            Some(FaultKind::Corrupt) => {
                let n = self.inner.read_at(bufs, offset)?;
                if n > 0
                    && let Some(b) = bufs.iter_mut().find(|b| !b.is_empty())
                {
                    b[0] = !b[0];
                }
                Ok(n)
            }
        }
    }

    fn alignment(&self) -> usize {
        self.inner.alignment()
    }

    fn path(&self) -> Option<&std::path::Path> {
        self.inner.path()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_fire_as_configured() {
        let mem = Arc::new(MemReader::new(vec![1u8; 100]));
        let r = FaultyReader::new(
            mem,
            vec![
                Fault::on_call(1, FaultKind::Interrupted),
                Fault::on_range(50..60, FaultKind::Error(ErrorKind::Other)).times(2),
                Fault::every(4, FaultKind::Short(1)),
            ],
        );
        let mut buf = [0u8; 10];
        let mut read = |off| r.read_at(&mut [IoSliceMut::new(&mut buf)], off);
        assert_eq!(read(0).expect("call 0"), 10);
        assert_eq!(read(0).expect_err("call 1").kind(), ErrorKind::Interrupted);
        assert_eq!(read(45).expect_err("call 2").kind(), ErrorKind::Other);
        assert_eq!(read(1).expect("call 3, every 4th"), 1);
        assert_eq!(read(55).expect_err("call 4").kind(), ErrorKind::Other);
        assert_eq!(read(55).expect("limit reached"), 10);
        assert_eq!(read(95).expect("short at the end"), 5);
        assert_eq!(r.calls(), 7);
        assert_eq!(r.faults()[1].fired(), 2);
    }

    #[test]
    fn a_corrupting_fault_flips_the_first_byte_read_and_only_that() {
        let mem = Arc::new(MemReader::new(vec![0x0fu8; 100]));
        let r = FaultyReader::new(mem, vec![Fault::on_call(0, FaultKind::Corrupt)]);
        let (mut a, mut b) = ([0u8; 0], [0u8; 4]);
        let n = r
            .read_at(&mut [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)], 0)
            .expect("read");
        assert_eq!((n, b), (4, [0xf0, 0x0f, 0x0f, 0x0f]));
        r.read_at(&mut [IoSliceMut::new(&mut b)], 0).expect("read");
        assert_eq!(b, [0x0f; 4]);
    }
}
