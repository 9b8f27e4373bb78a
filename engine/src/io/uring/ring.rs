//! The ring under [`super::UringIo`]: what the ring thread asks of it ([`Ring`]), the kernel's
//! io_uring behind that seam ([`KernelRing`]), and the [`Doorbell`] that wakes the ring thread.
//!
//! The seam is small (push an operation, submit and wait, reap completions) so that tests can put
//! a ring in its place that runs reads through any [`ReadAt`](super::super::ReadAt), faults
//! included (see `sim`), and drive the ring thread's retry and continuation logic with them.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use io_uring::{IoUring, opcode, types};

/// One operation for the ring.
#[derive(Clone, Copy, Debug)]
pub(super) enum Sqe {
    /// `preadv` of the engine's file: `n` iovecs at `iov`, from byte `offset`.
    Readv {
        iov: *const libc::iovec,
        n: u32,
        offset: u64,
    },
    /// Read the doorbell's 8-byte counter into `buf`: completes once the doorbell is rung.
    Wake { buf: *mut u64 },
}

// SAFETY: an Sqe only names memory that its pusher keeps valid until the operation's completion
// is reaped (the contract of `Ring::push`); carrying it to the thread (or kernel) that performs it
// is what it is for.
unsafe impl Send for Sqe {}

/// What the ring thread needs from a ring.
pub(super) trait Ring: Send {
    /// Queues `sqe` tagged `user_data` for the next submission. Returns false, queuing nothing,
    /// when the submission queue is full.
    ///
    /// # Safety
    /// The memory `sqe` names (iovecs, the buffers they point to, the doorbell buffer) must stay
    /// valid, and not be accessed by anyone else, until the completion tagged `user_data` has
    /// been reaped.
    unsafe fn push(&mut self, sqe: Sqe, user_data: u64) -> bool;
    /// Submits what was pushed and blocks until at least `want` completions can be reaped.
    fn submit_and_wait(&mut self, want: usize) -> io::Result<()>;
    /// Appends the completions available now as `(user_data, result)`; a result is a byte count
    /// or a negated `errno`, as in a CQE.
    fn reap(&mut self, out: &mut Vec<(u64, i32)>);
}

/// The kernel's io_uring reading one file, with the doorbell's eventfd for [`Sqe::Wake`].
pub(super) struct KernelRing {
    ring: IoUring,
    file: RawFd,
    bell: RawFd,
}

impl std::fmt::Debug for KernelRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelRing")
            .field("entries", &self.ring.params().sq_entries())
            .field("file", &self.file)
            .field("bell", &self.bell)
            .finish()
    }
}

/// A tag no read uses (reads are tagged with their slot index).
const PROBE: u64 = u64::MAX - 1;

impl KernelRing {
    /// A ring with room for `ops` operations in flight, reading `file`, waking on `bell`.
    /// Both descriptors must stay open while the ring lives.
    ///
    /// Fails where the kernel refuses io_uring (`EPERM` when `kernel.io_uring_disabled` or a
    /// seccomp filter forbids it, `ENOSYS` before Linux 5.1, `ENOMEM` when locked memory runs
    /// out): `io_uring_setup` is called, then a no-op is sent round the ring, so that a filter
    /// that allows setup but refuses `io_uring_enter` is also caught here.
    pub(super) fn new(ops: usize, file: RawFd, bell: RawFd) -> io::Result<Self> {
        let entries = u32::try_from(ops.max(1).next_power_of_two())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "ring too large"))?;
        let mut ring = KernelRing {
            ring: IoUring::new(entries)?,
            file,
            bell,
        };
        ring.probe()?;
        Ok(ring)
    }

    fn probe(&mut self) -> io::Result<()> {
        let nop = opcode::Nop::new().build().user_data(PROBE);
        // SAFETY: a no-op names no memory.
        unsafe { self.ring.submission().push(&nop) }
            .map_err(|_| io::Error::other("a new io_uring has no room for one entry"))?;
        loop {
            match self.ring.submit_and_wait(1) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            if let Some(cqe) = self.ring.completion().next() {
                return match cqe.result() {
                    r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
                    _ => Ok(()),
                };
            }
        }
    }
}

impl Ring for KernelRing {
    unsafe fn push(&mut self, sqe: Sqe, user_data: u64) -> bool {
        let entry = match sqe {
            Sqe::Readv { iov, n, offset } => opcode::Readv::new(types::Fd(self.file), iov, n)
                .offset(offset)
                .build(),
            Sqe::Wake { buf } => opcode::Read::new(types::Fd(self.bell), buf.cast(), 8).build(),
        };
        // SAFETY: the caller keeps what `sqe` names valid and untouched until its completion is
        // reaped (this function's contract); the descriptors outlive the ring (`new`).
        unsafe { self.ring.submission().push(&entry.user_data(user_data)) }.is_ok()
    }

    fn submit_and_wait(&mut self, want: usize) -> io::Result<()> {
        self.ring.submit_and_wait(want).map(drop)
    }

    fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        out.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result())),
        );
    }
}

/// An eventfd that callers ring to wake the ring thread, which keeps an [`Sqe::Wake`] read of it
/// in flight. Rings while the thread has not yet looked at the queue since the last ring are
/// folded into one write (`pending`), so a burst of submissions costs one syscall.
#[derive(Debug)]
pub(super) struct Doorbell {
    fd: OwnedFd,
    pending: AtomicBool,
}

impl Doorbell {
    pub(super) fn new() -> io::Result<Self> {
        // SAFETY: eventfd(2) takes no pointers; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Doorbell {
            // SAFETY: `fd` was just returned by eventfd(2), is open, and nothing else owns it.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            pending: AtomicBool::new(false),
        })
    }

    pub(super) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Wakes the ring thread unless a wake-up is already on its way. Call after queuing work.
    pub(super) fn ring(&self) {
        if !self.pending.swap(true, Ordering::SeqCst) {
            self.write();
        }
    }

    /// Wakes the ring thread even if a wake-up is on its way (for shutdown, which must not depend
    /// on the thread's bookkeeping).
    pub(super) fn ring_always(&self) {
        self.pending.store(true, Ordering::SeqCst);
        self.write();
    }

    /// Called by the ring thread just before it looks at the queue: a ring after this point wakes
    /// it again.
    pub(super) fn answer(&self) {
        self.pending.store(false, Ordering::SeqCst);
    }

    fn write(&self) {
        let one = 1u64;
        // SAFETY: writes the 8 bytes of `one`, which lives across the call, to our own eventfd.
        let n = unsafe { libc::write(self.raw_fd(), (&raw const one).cast(), 8) };
        if n != 8 {
            // Not expected on an open eventfd (the counter cannot reach its maximum one ring at a
            // time); if it happens the thread is still woken by its next completion.
            tracing::warn!("doorbell write failed: {}", io::Error::last_os_error());
        }
    }
}
