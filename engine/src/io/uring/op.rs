//! One read on the ring ([`Op`]): the requests it fills, the iovecs still to be filled, and what a
//! completion means for it ([`Step`]): continue (short read, `EINTR`, `EAGAIN`), done, or failed.

use std::io;
use std::time::Instant;

use super::super::queue::ReadRequest;
use super::ring::Sqe;

/// Where the holes of merged reads land. Every hole of every read in flight points at the same
/// bytes: they are dropped unread, so reads may overwrite each other's there.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scratch {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

/// A read of one or more offset-sorted requests, holes between them into the [`Scratch`].
#[derive(Debug)]
pub(super) struct Op {
    /// The requests, by offset; one for a read alone.
    pub(super) reqs: Vec<ReadRequest>,
    /// Targets and holes in file order; `iov[next..]` is what is left to read, the first entry
    /// advanced past the bytes a short read delivered. Its heap buffer is what the kernel reads
    /// the iovecs from, so it is not touched while the op is in flight.
    iov: Vec<libc::iovec>,
    next: usize,
    /// File offset of `iov[next]`.
    pos: u64,
    scratch: Scratch,
    /// Bytes of holes in the whole read.
    pub(super) holes: u64,
    /// Attempts of a read alone so far, counting the one in flight (1-based, as in
    /// `Error::Read::attempts`).
    pub(super) attempt: u32,
    /// Checksum mismatches seen for a read alone's request, including one in a merged read.
    pub(super) mismatches: u32,
    /// When the op's current SQE was issued, for `IoStats::busy_ns`.
    pub(super) issued: Instant,
}

/// What a completion means for its op.
#[derive(Debug)]
pub(super) enum Step {
    /// Issue the op again: it was interrupted, or read short and continues where it stopped.
    Again,
    /// Every byte is in.
    Done,
    /// The read failed (`UnexpectedEof` when the file ended first).
    Failed(io::Error),
}

impl Op {
    /// A read of the offset-sorted `reqs`. Gives them back when a hole between two of them does
    /// not fit the scratch (then they are read one by one).
    pub(super) fn new(reqs: Vec<ReadRequest>, scratch: Scratch) -> Result<Op, Vec<ReadRequest>> {
        let mut op = Op {
            reqs,
            iov: Vec::new(),
            next: 0,
            pos: 0,
            scratch,
            holes: 0,
            attempt: 1,
            mismatches: 0,
            issued: Instant::now(),
        };
        if op.rewind() { Ok(op) } else { Err(op.reqs) }
    }

    /// A read of `req` alone, after `mismatches` checksum mismatches.
    pub(super) fn alone(req: ReadRequest, mismatches: u32) -> Op {
        let none = Scratch {
            ptr: std::ptr::null_mut(),
            len: 0,
        };
        let mut op = Op {
            reqs: vec![req],
            iov: Vec::with_capacity(1),
            next: 0,
            pos: 0,
            scratch: none,
            holes: 0,
            attempt: 1,
            mismatches,
            issued: Instant::now(),
        };
        op.rewind(); // one request: no hole
        op
    }

    /// Sets the op back to reading everything from the start. False if a hole does not fit the
    /// scratch.
    pub(super) fn rewind(&mut self) -> bool {
        self.iov.clear();
        self.next = 0;
        self.holes = 0;
        let Some(first) = self.reqs.first() else {
            return true;
        };
        self.pos = first.offset;
        let mut end = first.offset;
        for r in &self.reqs {
            let hole = (r.offset - end) as usize;
            if hole > 0 {
                if hole > self.scratch.len {
                    return false;
                }
                self.iov.push(libc::iovec {
                    iov_base: self.scratch.ptr.cast(),
                    iov_len: hole,
                });
                self.holes += hole as u64;
            }
            self.iov.push(libc::iovec {
                iov_base: r.target.as_ptr().cast(),
                iov_len: r.target.len(),
            });
            end = r.end();
        }
        true
    }

    /// The SQE that reads what is left. Its iovec pointer stays valid while the op is neither
    /// changed nor dropped (moving the op does not move the iovecs).
    pub(super) fn sqe(&self) -> Sqe {
        let rest = &self.iov[self.next..];
        Sqe::Readv {
            iov: rest.as_ptr(),
            n: u32::try_from(rest.len()).unwrap_or(u32::MAX),
            offset: self.pos,
        }
    }

    /// Applies the result of the op's SQE (bytes read or `-errno`); `align` is the reader's
    /// alignment (a short read that leaves an unaligned position can only be the file's end).
    pub(super) fn complete(&mut self, res: i32, align: usize) -> Step {
        if res == -libc::EINTR || res == -libc::EAGAIN {
            return Step::Again;
        }
        if res < 0 {
            return Step::Failed(io::Error::from_raw_os_error(-res));
        }
        if res == 0 {
            return Step::Failed(self.eof());
        }
        self.advance(res as usize);
        if self.next == self.iov.len() {
            Step::Done
        } else if align > 1 && !self.aligned(align) {
            Step::Failed(self.eof())
        } else {
            Step::Again
        }
    }

    /// Moves past `n` bytes read.
    fn advance(&mut self, mut n: usize) {
        while n > 0 && self.next < self.iov.len() {
            let v = &mut self.iov[self.next];
            let step = n.min(v.iov_len);
            v.iov_base = v.iov_base.cast::<u8>().wrapping_add(step).cast();
            v.iov_len -= step;
            self.pos += step as u64;
            n -= step;
            if v.iov_len == 0 {
                self.next += 1;
            }
        }
    }

    /// Whether the position and what is left are `align`-aligned, as a direct read needs.
    fn aligned(&self, align: usize) -> bool {
        self.pos.is_multiple_of(align as u64)
            && self.iov[self.next..].iter().all(|v| {
                (v.iov_base as usize).is_multiple_of(align) && v.iov_len.is_multiple_of(align)
            })
    }

    fn eof(&self) -> io::Error {
        let (start, end) = match (self.reqs.first(), self.reqs.last()) {
            (Some(a), Some(b)) => (a.offset, b.end()),
            _ => (self.pos, self.pos),
        };
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "read of {} bytes at offset {start}: file ends at {}",
                end - start,
                self.pos
            ),
        )
    }
}
