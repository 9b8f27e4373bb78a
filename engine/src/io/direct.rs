//! [`DirectFile`]: a read-only file opened with `O_DIRECT`, so that chunk reads land in cache slots
//! without passing through (and polluting) the page cache.
//!
//! Where the filesystem refuses `O_DIRECT` (`EINVAL` at open: older tmpfs, some FUSE and network
//! filesystems) the file is opened for ordinary buffered reads instead and the reason is logged once
//! per process. Nothing else changes for the caller, except that [`DirectFile::is_direct`] says so
//! and alignment is no longer required.

use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Once;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use super::PAGE;
use super::read::{ReadAt, ReadCounters, check_alignment, read_exact_at};
use crate::{Error, Result};

/// A read-only file for positioned, vectored reads, opened with `O_DIRECT` where the filesystem
/// allows it. With `O_DIRECT`, every read's offset, buffer addresses and lengths must be multiples
/// of [`PAGE`] (requests that are not fail with `InvalidInput`).
#[derive(Debug)]
pub struct DirectFile {
    fd: OwnedFd,
    path: PathBuf,
    direct: bool,
    len: u64,
}

static FALLBACK_LOGGED: Once = Once::new();

impl DirectFile {
    /// Opens `path` read-only with `O_DIRECT`, falling back to buffered reads when the filesystem
    /// refuses `O_DIRECT` (logged once per process). Errors name the path.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path.as_ref(), |p| {
            nix::fcntl::open(
                p,
                OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_DIRECT,
                Mode::empty(),
            )
        })
    }

    /// Opens `path` read-only for ordinary buffered reads (through the page cache): the `mmap`-free
    /// baselines and tools that want it.
    pub fn open_buffered(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let fd = open_plain(path).map_err(|e| Error::io(path, e.into()))?;
        Self::finish(fd, path, false)
    }

    /// [`DirectFile::open`] with the `O_DIRECT` open injected, so tests can make it refuse.
    fn open_with(
        path: &Path,
        open_direct: impl FnOnce(&Path) -> nix::Result<OwnedFd>,
    ) -> Result<Self> {
        match open_direct(path) {
            Ok(fd) => Self::finish(fd, path, true),
            Err(Errno::EINVAL) => {
                FALLBACK_LOGGED.call_once(|| {
                    tracing::warn!(
                        path = %path.display(),
                        "the filesystem refuses O_DIRECT (EINVAL); model chunks are read through \
                         the page cache instead, which costs memory outside the budget"
                    );
                });
                let fd = open_plain(path).map_err(|e| Error::io(path, e.into()))?;
                Self::finish(fd, path, false)
            }
            Err(e) => Err(Error::io(path, e.into())),
        }
    }

    fn finish(fd: OwnedFd, path: &Path, direct: bool) -> Result<Self> {
        let stat = nix::sys::stat::fstat(&fd).map_err(|e| Error::io(path, e.into()))?;
        Ok(DirectFile {
            fd,
            path: path.to_owned(),
            direct,
            len: u64::try_from(stat.st_size).unwrap_or(0),
        })
    }

    /// Whether reads bypass the page cache (`O_DIRECT` accepted).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The file's size in bytes at open time.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file was empty at open time.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fills `bufs` (in order) from byte `offset`: loops over `EINTR` and short reads; fails with
    /// `UnexpectedEof` if the file ends first and `InvalidInput` on a misaligned direct request.
    pub fn read_exact_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        read_exact_at(self, bufs, offset, &mut ReadCounters::default())
    }
}

fn open_plain(path: &Path) -> nix::Result<OwnedFd> {
    nix::fcntl::open(path, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
}

impl ReadAt for DirectFile {
    fn read_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        check_alignment(bufs, offset, self.alignment())?;
        let offset = libc::off_t::try_from(offset).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("offset {offset} does not fit off_t"),
            )
        })?;
        // One preadv(2); EINTR comes back as `Interrupted` and short reads as a smaller count,
        // which the exact-read loop continues.
        Ok(nix::sys::uio::preadv(&self.fd, bufs, offset)?)
    }

    fn alignment(&self) -> usize {
        if self.direct { PAGE } else { 1 }
    }

    fn path(&self) -> Option<&Path> {
        Some(&self.path)
    }

    fn raw_fd(&self) -> Option<RawFd> {
        Some(self.fd.as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::AlignedBuf;
    use std::io::{ErrorKind, Write};

    /// A temp dir on the worktree's disk (ext4, which accepts O_DIRECT), not /tmp (maybe tmpfs).
    pub(crate) fn disk_tempdir() -> tempfile::TempDir {
        tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).expect("tempdir in the crate dir")
    }

    pub(crate) fn write_file(dir: &Path, len: usize) -> (PathBuf, Vec<u8>) {
        let data: Vec<u8> = (0..len)
            .map(|i| (i.wrapping_mul(7919) >> 3) as u8)
            .collect();
        let path = dir.join("chunks.bin");
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&data).expect("write");
        (path, data)
    }

    #[test]
    fn direct_reads_match_the_file_and_check_alignment() {
        let dir = disk_tempdir();
        let (path, data) = write_file(dir.path(), 10 * PAGE + 100);
        let f = DirectFile::open(&path).expect("open");
        assert_eq!(f.len(), data.len() as u64);
        if !f.is_direct() {
            eprintln!(
                "note: {} refuses O_DIRECT; testing the fallback only",
                path.display()
            );
        }
        let mut a = AlignedBuf::zeroed(PAGE).expect("alloc");
        let mut b = AlignedBuf::zeroed(2 * PAGE).expect("alloc");
        f.read_exact_at(
            &mut [
                IoSliceMut::new(a.as_mut_slice()),
                IoSliceMut::new(b.as_mut_slice()),
            ],
            3 * PAGE as u64,
        )
        .expect("read");
        assert_eq!(a.as_slice(), &data[3 * PAGE..4 * PAGE]);
        assert_eq!(b.as_slice(), &data[4 * PAGE..6 * PAGE]);
        if f.is_direct() {
            let err = f
                .read_exact_at(&mut [IoSliceMut::new(a.as_mut_slice())], 100)
                .expect_err("misaligned offset");
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
            let err = f
                .read_exact_at(&mut [IoSliceMut::new(&mut b.as_mut_slice()[..10])], 0)
                .expect_err("misaligned length");
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
        }
        // The last page is partial: the file ends early.
        let err = f
            .read_exact_at(&mut [IoSliceMut::new(b.as_mut_slice())], 9 * PAGE as u64)
            .expect_err("past the end");
        assert_eq!(err.kind(), ErrorKind::UnexpectedEof);
    }

    #[test]
    fn refused_o_direct_falls_back_to_buffered_reads() {
        let dir = disk_tempdir();
        let (path, data) = write_file(dir.path(), 3 * PAGE);
        let f = DirectFile::open_with(&path, |_| Err(Errno::EINVAL)).expect("fallback open");
        assert!(!f.is_direct());
        assert_eq!(f.alignment(), 1);
        let mut buf = vec![0u8; 1000];
        f.read_exact_at(&mut [IoSliceMut::new(&mut buf)], 17)
            .expect("unaligned ok");
        assert_eq!(buf, data[17..1017]);
        // A second fallback logs nothing more and still works.
        assert!(
            !DirectFile::open_with(&path, |_| Err(Errno::EINVAL))
                .expect("again")
                .is_direct()
        );
        let buffered = DirectFile::open_buffered(&path).expect("buffered");
        assert!(!buffered.is_direct());
    }

    #[test]
    fn tmpfs_open_either_direct_or_fallback_reads_correctly() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            return; // no tmpfs here: the fallback test above covers the path
        };
        let (path, data) = write_file(dir.path(), 2 * PAGE);
        let f = DirectFile::open(&path).expect("open on tmpfs");
        let mut buf = AlignedBuf::zeroed(2 * PAGE).expect("alloc");
        f.read_exact_at(&mut [IoSliceMut::new(buf.as_mut_slice())], 0)
            .expect("read");
        assert_eq!(buf.as_slice(), &data[..]);
    }

    #[test]
    fn open_errors_name_the_path() {
        let err = DirectFile::open("/nonexistent/leanstream.lsm").expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/leanstream.lsm"),
            "{err}"
        );
        let err = DirectFile::open_with(Path::new("/x"), |_| Err(Errno::EACCES)).expect_err("e");
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }
}
