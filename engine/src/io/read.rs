//! The one-syscall read seam ([`ReadAt`]) and the exact-read loop built on it.
//!
//! Everything above this file (the worker pool, the pipeline) reads through [`ReadAt`], so tests can
//! put a [`super::FaultyReader`] in front of a real file to inject errors, short reads and `EINTR`.

use std::io::{self, ErrorKind, IoSliceMut};

/// A positioned, vectored reader: one call is one `preadv(2)`'s worth of work.
pub trait ReadAt: Send + Sync + std::fmt::Debug {
    /// Reads into `bufs` (in order) from byte `offset` of the source, like `preadv(2)`: returns the
    /// number of bytes read, which may be fewer than asked (0 at end of file), or an error
    /// (`ErrorKind::Interrupted` for `EINTR`, which callers retry).
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize>;

    /// Alignment in bytes that `offset`, every buffer address and every buffer length must have
    /// (1 when anything goes; [`super::PAGE`] for an O_DIRECT file).
    fn alignment(&self) -> usize {
        1
    }

    /// The file being read, for error messages (`None` for memory and other sources).
    fn path(&self) -> Option<&std::path::Path> {
        None
    }

    /// The open file that `read_at` reads, for engines that issue reads on it themselves (the
    /// io_uring engine, [`super::UringIo`]); `None` (the default) when reads must go through
    /// `read_at`: memory sources, and wrappers that change what a read does (fault injection).
    /// The descriptor stays open as long as the reader lives.
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

/// What one exact read cost, for the pool's statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadCounters {
    /// `read_at` calls made (including interrupted ones).
    pub syscalls: u64,
    /// Calls that returned `ErrorKind::Interrupted` and were retried.
    pub interrupts: u64,
}

/// Checks that `offset` and every buffer's address and length are multiples of `align`.
pub fn check_alignment(bufs: &[IoSliceMut<'_>], offset: u64, align: usize) -> io::Result<()> {
    if align <= 1 {
        return Ok(());
    }
    let bad = |what: String| {
        Err(io::Error::new(
            ErrorKind::InvalidInput,
            format!("direct read needs {align}-byte alignment: {what}"),
        ))
    };
    if !offset.is_multiple_of(align as u64) {
        return bad(format!("offset {offset}"));
    }
    for (i, b) in bufs.iter().enumerate() {
        if !(b.as_ptr() as usize).is_multiple_of(align) {
            return bad(format!("buffer {i} address {:p}", b.as_ptr()));
        }
        if b.len() % align != 0 {
            return bad(format!("buffer {i} length {}", b.len()));
        }
    }
    Ok(())
}

/// Fills every buffer in `bufs` from `offset` on, looping over short reads (advancing across the
/// buffers) and `EINTR`.
///
/// Errors: `InvalidInput` if the reader needs alignment ([`ReadAt::alignment`]) that the request
/// lacks; `UnexpectedEof` naming the offset if the source ends first (for an aligned reader, also
/// when a short read leaves a position that is not aligned, which only happens at end of file);
/// any other error of the reader as is. `counters` is updated even on error. On error the buffers
/// hold unspecified bytes.
pub fn read_exact_at<R: ReadAt + ?Sized>(
    reader: &R,
    mut bufs: &mut [IoSliceMut<'_>],
    offset: u64,
    counters: &mut ReadCounters,
) -> io::Result<()> {
    let align = reader.alignment();
    check_alignment(bufs, offset, align)?;
    let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let mut pos = offset;
    IoSliceMut::advance_slices(&mut bufs, 0); // drop leading empty buffers
    while !bufs.is_empty() {
        counters.syscalls += 1;
        match reader.read_at(bufs, pos) {
            Ok(0) => return Err(eof(offset, total, pos)),
            Ok(n) => {
                pos += n as u64;
                IoSliceMut::advance_slices(&mut bufs, n);
                if !bufs.is_empty() && align > 1 && check_alignment(bufs, pos, align).is_err() {
                    return Err(eof(offset, total, pos));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => counters.interrupts += 1,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn eof(offset: u64, total: u64, pos: u64) -> io::Error {
    io::Error::new(
        ErrorKind::UnexpectedEof,
        format!("read of {total} bytes at offset {offset}: file ends at {pos}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{Fault, FaultKind, FaultyReader, MemReader};
    use std::sync::Arc;

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn exact_read_crosses_buffers_through_short_reads_and_eintr() {
        let src = data(10_000);
        let mem = Arc::new(MemReader::new(src.clone()));
        let faulty = FaultyReader::new(
            mem,
            vec![
                Fault::on_call(0, FaultKind::Interrupted),
                Fault::on_call(1, FaultKind::Short(3)),
                Fault::on_call(2, FaultKind::Short(1000)),
                Fault::on_call(3, FaultKind::Interrupted),
            ],
        );
        let (mut a, mut b, mut c) = (vec![0u8; 7], vec![0u8; 2000], vec![0u8; 5000]);
        let mut bufs = [
            IoSliceMut::new(&mut a),
            IoSliceMut::new(&mut []),
            IoSliceMut::new(&mut b),
            IoSliceMut::new(&mut c),
        ];
        let mut counters = ReadCounters::default();
        read_exact_at(&faulty, &mut bufs, 100, &mut counters).expect("read");
        assert_eq!(a, src[100..107]);
        assert_eq!(b, src[107..2107]);
        assert_eq!(c, src[2107..7107]);
        assert_eq!(counters.interrupts, 2);
        assert_eq!(counters.syscalls, 5);
    }

    #[test]
    fn early_end_of_file_is_unexpected_eof_naming_the_offset() {
        let mem = MemReader::new(data(100));
        let mut buf = vec![0u8; 64];
        let mut counters = ReadCounters::default();
        let err = read_exact_at(&mem, &mut [IoSliceMut::new(&mut buf)], 50, &mut counters)
            .expect_err("past the end");
        assert_eq!(err.kind(), ErrorKind::UnexpectedEof);
        assert!(err.to_string().contains("offset 50"), "{err}");
    }

    #[test]
    fn errors_other_than_eintr_are_returned() {
        let mem = Arc::new(MemReader::new(data(100)));
        let faulty = FaultyReader::new(
            mem,
            vec![Fault::on_call(0, FaultKind::Error(ErrorKind::Other))],
        );
        let mut buf = vec![0u8; 10];
        let mut counters = ReadCounters::default();
        let err = read_exact_at(&faulty, &mut [IoSliceMut::new(&mut buf)], 0, &mut counters)
            .expect_err("injected");
        assert_eq!(err.kind(), ErrorKind::Other);
    }

    #[test]
    fn alignment_is_checked() {
        let mut buf = crate::io::AlignedBuf::zeroed(2 * crate::io::PAGE).expect("alloc");
        let ok = [IoSliceMut::new(buf.as_mut_slice())];
        assert!(check_alignment(&ok, 4096, 4096).is_ok());
        assert!(check_alignment(&ok, 512, 4096).is_err());
        let s = &mut buf.as_mut_slice()[..100];
        assert!(check_alignment(&[IoSliceMut::new(s)], 0, 4096).is_err());
        let s = &mut buf.as_mut_slice()[1..4097];
        assert!(check_alignment(&[IoSliceMut::new(s)], 0, 4096).is_err());
        assert!(check_alignment(&[IoSliceMut::new(s)], 3, 1).is_ok());
    }
}
