//! Shared, cheaply clonable byte ranges over a loaded file image, a memory map or a buffer.
//!
//! # Why loaded models own their bytes
//!
//! A memory-mapped file stays part of the file: if another process truncates it while it is
//! loaded, the next touch of a page past the new end raises `SIGBUS` and kills the daemon, and
//! overwriting it in place silently changes the weights. So model files are loaded into memory
//! the process owns ([`read_file`]): an anonymous private mapping of the file's length, the wanted
//! ranges `pread` into it, then made read-only. After the load, nothing the file's owner does
//! reaches the weights.
//!
//! An anonymous mapping rather than a `Vec`: one allocation of exactly the file's length, page
//! aligned like the map it replaces (the 64-byte tensor alignment of the formats holds), and the
//! ranges that are skipped — the `.lsm` streamed FFN section when a streaming mode runs, read only
//! by the I/O workers with `O_DIRECT` into the neuron cache — are never touched, so their pages
//! are never resident (they read as zeros if anyone looked).
//!
//! The one exception is [`map_file`], kept for `mmap` mode, the llama.cpp-like baseline, which
//! by definition maps the file and so is not protected from truncation; and for reading a
//! header without loading a file.

use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use crate::{Error, Result};

#[derive(Debug)]
enum Backing {
    /// A memory map of the file: its pages belong to the page cache (and to the file).
    Mmap(memmap2::Mmap),
    /// A file image the process owns; `resident` counts the bytes that were read into it.
    Image {
        map: memmap2::Mmap,
        resident: usize,
    },
    Owned(Vec<u8>),
    /// A page-aligned buffer (a slot of the weight stream, refilled from storage between uses).
    Aligned(crate::io::AlignedBuf),
}

/// A byte range of a loaded file image, a memory-mapped file or an owned buffer. Cloning shares
/// the backing.
#[derive(Clone, Debug)]
pub struct TensorBytes {
    backing: Arc<Backing>,
    offset: usize,
    len: usize,
}

impl TensorBytes {
    /// Wraps a whole memory map.
    pub fn from_mmap(map: memmap2::Mmap) -> Self {
        Self::whole(Backing::Mmap(map))
    }

    /// Wraps an owned buffer.
    pub fn from_vec(v: Vec<u8>) -> Self {
        Self::whole(Backing::Owned(v))
    }

    /// Wraps a page-aligned buffer; [`TensorBytes::aligned_mut`] gives it back for refilling
    /// while no other view of it exists.
    pub fn from_aligned(b: crate::io::AlignedBuf) -> Self {
        Self::whole(Backing::Aligned(b))
    }

    /// The aligned buffer behind this range, writable — only when the range is the whole
    /// buffer and no clone or slice of it is alive (the weight stream refills a slot only after
    /// every view computed from it was dropped).
    pub fn aligned_mut(&mut self) -> Option<&mut crate::io::AlignedBuf> {
        let whole = self.offset == 0;
        match Arc::get_mut(&mut self.backing) {
            Some(Backing::Aligned(b)) if whole && b.len() == self.len => Some(b),
            _ => None,
        }
    }

    /// Where this range starts in its backing: the file offset for a file image or map.
    pub fn offset(&self) -> usize {
        self.offset
    }

    fn whole(backing: Backing) -> Self {
        let len = match &backing {
            Backing::Mmap(m) | Backing::Image { map: m, .. } => m.len(),
            Backing::Owned(v) => v.len(),
            Backing::Aligned(b) => b.len(),
        };
        TensorBytes {
            backing: Arc::new(backing),
            offset: 0,
            len,
        }
    }

    /// A sub-range, or `None` if `offset + len` runs past the end.
    pub fn slice(&self, offset: usize, len: usize) -> Option<TensorBytes> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| TensorBytes {
            backing: Arc::clone(&self.backing),
            offset: self.offset + offset,
            len,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        let all: &[u8] = match &*self.backing {
            Backing::Mmap(m) | Backing::Image { map: m, .. } => m,
            Backing::Owned(v) => v,
            Backing::Aligned(b) => b.as_slice(),
        };
        &all[self.offset..self.offset + self.len]
    }

    /// Whether the bytes are a memory map of a file (and so change or fault with the file).
    pub fn is_mapped(&self) -> bool {
        matches!(&*self.backing, Backing::Mmap(_))
    }

    /// Identifies the backing this range shares with its clones and slices, so that a sum over
    /// many ranges can count each backing once with [`TensorBytes::backing_bytes`].
    pub fn backing_id(&self) -> usize {
        Arc::as_ptr(&self.backing) as *const () as usize
    }

    /// Bytes of memory the process owns that the whole backing holds: the bytes read into a file
    /// image (skipped ranges are not resident; not heap), a buffer's capacity (heap); nothing for
    /// a file map, whose pages are the page cache's.
    pub fn backing_bytes(&self) -> OwnedBytes {
        match &*self.backing {
            Backing::Mmap(_) => OwnedBytes::default(),
            Backing::Image { resident, .. } => OwnedBytes {
                heap: 0,
                image: *resident as u64,
            },
            Backing::Owned(v) => OwnedBytes {
                heap: v.capacity() as u64,
                image: 0,
            },
            Backing::Aligned(b) => OwnedBytes {
                heap: b.capacity() as u64,
                image: 0,
            },
        }
    }
}

/// Memory the process owns, by where it lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnedBytes {
    /// Bytes allocated through the global allocator.
    pub heap: u64,
    /// Bytes of file images (anonymous private mappings) actually read into.
    pub image: u64,
}

impl OwnedBytes {
    /// Heap and image together.
    pub fn total(&self) -> u64 {
        self.heap + self.image
    }
}

impl std::ops::AddAssign for OwnedBytes {
    fn add_assign(&mut self, o: OwnedBytes) {
        self.heap += o.heap;
        self.image += o.image;
    }
}

impl std::ops::Deref for TensorBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// Maps a whole file read-only. Only for `mmap` mode and header reads: the map is part of the
/// file, so truncating the file while the map is in use raises `SIGBUS` (see the module docs).
pub fn map_file(path: &Path) -> Result<TensorBytes> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is read-only and private to us. Only mmap mode and header reads use it;
    // a concurrent truncation is a SIGBUS there, which no safe API over mmap can prevent, and is
    // why every other load goes through `read_file`.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    Ok(TensorBytes::from_mmap(map))
}

/// Maps `len` bytes of `path` from `offset` read-only: the `.lsm` streamed section's weight views
/// when the rest of the file is owned (their pages are touched only by recall measurement and
/// dense compute, never by the streaming modes; see the module docs).
pub fn map_range(path: &Path, offset: u64, len: u64) -> Result<TensorBytes> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = usize::try_from(len)
        .map_err(|_| Error::invalid_file(path, format!("{len} bytes do not fit in memory")))?;
    if len == 0 {
        return Ok(TensorBytes::from_vec(Vec::new()));
    }
    // SAFETY: as in `map_file`: read-only and private; the streaming modes never touch these
    // pages, so a truncation of the file cannot fault the serving path through them.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map(&file)
    }
    .map_err(|e| Error::io(path, e))?;
    Ok(TensorBytes::from_mmap(map))
}

/// Reads a whole file into memory the process owns (see the module docs).
pub fn read_file(path: &Path) -> Result<TensorBytes> {
    let mut image = FileImage::open(path)?;
    image.prefer_huge_pages();
    image.fill(0..u64::MAX)?;
    image.finish()
}

/// [`read_file`], with `edit` rewriting the image before it is made read-only (matrices stored
/// as tiles: the same bytes, permuted in place).
pub fn read_file_edited(path: &Path, edit: impl FnOnce(&mut [u8])) -> Result<TensorBytes> {
    let mut image = FileImage::open(path)?;
    image.prefer_huge_pages();
    image.fill(0..u64::MAX)?;
    let len = image.len;
    edit(&mut image.map[..len]);
    image.finish()
}

/// Reads only `ranges` of a file into an image of its whole length, the rest left as untouched
/// zero pages that are never resident: what a memory plan keeps of a model whose other weights
/// stream from storage (see the module docs).
pub fn read_ranges(path: &Path, ranges: &[Range<u64>]) -> Result<TensorBytes> {
    let mut image = FileImage::open(path)?;
    for r in ranges {
        image.fill(r.clone())?;
    }
    image.finish()
}

/// A file being read into an anonymous private mapping of its length, range by range; ranges
/// never filled stay untouched zero pages. [`FileImage::finish`] makes it read-only.
#[derive(Debug)]
pub(crate) struct FileImage {
    file: std::fs::File,
    path: std::path::PathBuf,
    map: memmap2::MmapMut,
    /// The file's length at open (the map is one page longer for an empty file).
    len: usize,
    resident: usize,
}

impl FileImage {
    /// Opens `path` and reserves its length (nothing is read yet).
    pub(crate) fn open(path: &Path) -> Result<FileImage> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let len = usize::try_from(len)
            .map_err(|_| Error::invalid_file(path, format!("{len} bytes do not fit in memory")))?;
        // An anonymous map cannot be empty; one page stands in for an empty file, sliced to 0.
        let map = memmap2::MmapMut::map_anon(len.max(1)).map_err(|e| {
            Error::io(
                path,
                std::io::Error::new(e.kind(), format!("reserving {len} bytes: {e}")),
            )
        })?;
        Ok(FileImage {
            file,
            path: path.to_path_buf(),
            map,
            len,
            resident: 0,
        })
    }

    /// Asks the kernel to back the image with huge pages where it can (Linux transparent huge
    /// pages, in `madvise` or `always` mode): for an image read whole. The compute kernels
    /// read eight rows side by side and jump between matrices, and with 4 KiB pages a model of
    /// 100 MB is some 25 000 pages, far more than the TLB holds; each miss is a page walk. Not
    /// for partial images, whose untouched ranges would become resident 2 MiB at a time.
    pub(crate) fn prefer_huge_pages(&self) {
        #[cfg(target_os = "linux")]
        if let Err(e) = self.map.advise(memmap2::Advice::HugePage) {
            tracing::debug!("no huge pages for {}: {e}", self.path.display());
        }
    }

    /// The file's length (at open) in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len as u64
    }

    /// Reads file bytes `range` (clamped to the file) into the same place of the image, looping
    /// over `EINTR` and short reads. A file that ends early (truncated since open) is an error
    /// naming the path and offset.
    pub(crate) fn fill(&mut self, range: Range<u64>) -> Result<()> {
        let end = range.end.min(self.len());
        if range.start >= end {
            return Ok(());
        }
        let (start, stop) = (range.start as usize, end as usize);
        self.file
            .read_exact_at(&mut self.map[start..stop], range.start)
            .map_err(|e| {
                Error::io(
                    &self.path,
                    std::io::Error::new(
                        e.kind(),
                        format!("reading {} bytes at offset {start}: {e}", stop - start),
                    ),
                )
            })?;
        self.resident += stop - start;
        Ok(())
    }

    /// The image as read so far (unfilled ranges are zeros).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map[..self.len]
    }

    /// Makes the image read-only and hands it over as one [`TensorBytes`] of the file's length.
    pub(crate) fn finish(self) -> Result<TensorBytes> {
        let len = self.len;
        let map = self
            .map
            .make_read_only()
            .map_err(|e| Error::io(&self.path, e))?;
        let whole = TensorBytes::whole(Backing::Image {
            map,
            resident: self.resident,
        });
        Ok(whole
            .slice(0, len)
            .expect("an image is at least its file's length"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(bytes).expect("write");
        f
    }

    #[test]
    fn a_read_file_keeps_its_bytes_after_the_file_is_cut_and_overwritten() {
        let data: Vec<u8> = (0..3 * 4096 + 10).map(|i| (i % 251) as u8).collect();
        let f = file_of(&data);
        let loaded = read_file(f.path()).expect("read");
        assert!(!loaded.is_mapped());
        assert_eq!(loaded.backing_bytes().image, data.len() as u64);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .expect("open");
        file.set_len(100).expect("truncate");
        file.write_all_at(&[0xee; 100], 0).expect("overwrite");
        assert_eq!(loaded.as_slice(), &data[..]);
    }

    #[test]
    fn skipped_ranges_read_as_zeros_and_are_not_counted_resident() {
        let data = vec![7u8; 5 * 4096];
        let f = file_of(&data);
        let mut image = FileImage::open(f.path()).expect("open");
        image.fill(0..4096).expect("head");
        image.fill(3 * 4096..u64::MAX).expect("tail, clamped");
        let b = image.finish().expect("finish");
        assert_eq!(b.len(), data.len());
        assert_eq!(b.backing_bytes().image, 3 * 4096);
        assert!(b[..4096].iter().all(|&x| x == 7));
        assert!(b[4096..3 * 4096].iter().all(|&x| x == 0));
        assert!(b[3 * 4096..].iter().all(|&x| x == 7));
    }

    #[test]
    fn an_empty_file_reads_as_empty_and_a_cut_file_names_the_offset() {
        let f = file_of(&[]);
        let b = read_file(f.path()).expect("empty");
        assert!(b.is_empty());
        let f = file_of(&[1u8; 8192]);
        let mut image = FileImage::open(f.path()).expect("open");
        f.as_file().set_len(4096).expect("truncate");
        let err = image.fill(0..8192).expect_err("the file ends early");
        assert!(err.to_string().contains("offset 0"), "{err}");
        assert!(
            err.to_string().contains(&f.path().display().to_string()),
            "{err}"
        );
    }
}
