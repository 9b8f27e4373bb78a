//! A stand-in ring for tests: each operation runs on a thread of its own (as the kernel's io-wq
//! workers would), reading through any [`ReadAt`], so that the ring thread's continuation, retry
//! and verification logic runs against readers without a file descriptor: gates that hold reads
//! back, fault injection (errors, `EINTR`, short reads, corruption), memory.

use std::io::{self, IoSliceMut};
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use super::super::aligned::AlignedBuf;
use super::super::engine::IoOptions;
use super::super::read::ReadAt;
use super::UringIo;
use super::ring::{Doorbell, Ring, Sqe};
use crate::Result;

/// Name of the threads that perform the simulated operations.
pub(crate) const SIM_THREAD: &str = "uring-sim";

type Cq = Arc<(Mutex<Vec<(u64, i32)>>, Condvar)>;

/// A [`Ring`] whose reads go through a [`ReadAt`] on threads of their own.
#[derive(Debug)]
pub(crate) struct SimRing {
    reader: Arc<dyn ReadAt>,
    bell: RawFd,
    queued: Vec<(Sqe, u64)>,
    cq: Cq,
}

impl UringIo {
    /// The engine on the kernel's ring when `reader` has a file descriptor, else on a
    /// [`SimRing`] reading through it.
    pub(crate) fn for_tests(
        reader: Arc<dyn ReadAt>,
        depth: usize,
        opts: IoOptions,
    ) -> Result<Self> {
        if reader.raw_fd().is_some() {
            return UringIo::new(reader, depth, opts);
        }
        let bell = Doorbell::new().map_err(|source| crate::Error::Os {
            what: "doorbell".into(),
            source,
        })?;
        let ring = SimRing {
            reader: Arc::clone(&reader),
            bell: bell.raw_fd(),
            queued: Vec::new(),
            cq: Arc::default(),
        };
        UringIo::start(reader, super::checked_depth(depth)?, opts, bell, ring)
    }
}

impl Ring for SimRing {
    unsafe fn push(&mut self, sqe: Sqe, user_data: u64) -> bool {
        self.queued.push((sqe, user_data));
        true
    }

    fn submit_and_wait(&mut self, want: usize) -> io::Result<()> {
        for (sqe, tag) in self.queued.drain(..) {
            let (reader, cq, bell) = (Arc::clone(&self.reader), Arc::clone(&self.cq), self.bell);
            std::thread::Builder::new()
                .name(SIM_THREAD.into())
                .spawn(move || {
                    // SAFETY: `push`'s contract keeps what the SQE names valid until its
                    // completion, which is posted below, after the operation.
                    let res = unsafe { perform(&*reader, bell, sqe) };
                    let (list, cv) = &*cq;
                    list.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push((tag, res));
                    cv.notify_all();
                })?;
        }
        let (list, cv) = &*self.cq;
        let mut list = list.lock().unwrap_or_else(PoisonError::into_inner);
        while list.len() < want {
            list = cv.wait(list).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        let (list, _) = &*self.cq;
        out.append(&mut list.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

/// Performs `sqe` as the kernel would; returns the CQE result.
///
/// # Safety
/// What `sqe` names is valid (for writes) and not accessed by anyone else during the call.
unsafe fn perform(reader: &dyn ReadAt, bell: RawFd, sqe: Sqe) -> i32 {
    match sqe {
        Sqe::Wake { buf } => {
            // SAFETY: `buf` is valid for 8 bytes (this function's contract).
            let n = unsafe { libc::read(bell, buf.cast(), 8) };
            if n < 0 {
                -io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO)
            } else {
                n as i32
            }
        }
        Sqe::Readv { iov, n, offset } => {
            // SAFETY: the iovec array is valid for `n` entries (this function's contract).
            let iov = unsafe { std::slice::from_raw_parts(iov, n as usize) };
            // SAFETY: passed on.
            unsafe { readv(reader, iov, offset) }
        }
    }
}

/// One `read_at` into a bounce buffer, then scattered: two iovecs may name the same scratch bytes,
/// which a Rust slice per iovec could not.
///
/// # Safety
/// Every iovec is valid for writes and not accessed by anyone else during the call.
unsafe fn readv(reader: &dyn ReadAt, iov: &[libc::iovec], offset: u64) -> i32 {
    let total = iov.iter().map(|v| v.iov_len).sum();
    let Ok(mut bounce) = AlignedBuf::zeroed(total) else {
        return -libc::ENOMEM;
    };
    match reader.read_at(&mut [IoSliceMut::new(bounce.as_mut_slice())], offset) {
        Ok(n) => {
            let mut from = &bounce.as_slice()[..n.min(total)];
            for v in iov {
                let k = from.len().min(v.iov_len);
                // SAFETY: `v` is valid for writes of `iov_len >= k` bytes (this function's
                // contract) and cannot overlap the bounce buffer, which was just allocated.
                unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), v.iov_base.cast(), k) };
                from = &from[k..];
            }
            i32::try_from(n).unwrap_or(i32::MAX)
        }
        Err(e) => -e.raw_os_error().unwrap_or(match e.kind() {
            io::ErrorKind::Interrupted => libc::EINTR,
            io::ErrorKind::WouldBlock => libc::EAGAIN,
            io::ErrorKind::InvalidInput => libc::EINVAL,
            _ => libc::EIO,
        }),
    }
}
