//! Shared, cheaply clonable byte ranges over a memory map or an owned buffer.

use std::sync::Arc;

#[derive(Debug)]
enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// A byte range of a memory-mapped file or an owned buffer. Cloning shares the backing.
#[derive(Clone, Debug)]
pub struct TensorBytes {
    backing: Arc<Backing>,
    offset: usize,
    len: usize,
}

impl TensorBytes {
    /// Wraps a whole memory map.
    pub fn from_mmap(map: memmap2::Mmap) -> Self {
        let len = map.len();
        TensorBytes {
            backing: Arc::new(Backing::Mmap(map)),
            offset: 0,
            len,
        }
    }

    /// Wraps an owned buffer.
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        TensorBytes {
            backing: Arc::new(Backing::Owned(v)),
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
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        };
        &all[self.offset..self.offset + self.len]
    }
}

impl std::ops::Deref for TensorBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// Maps a whole file read-only.
pub fn map_file(path: &std::path::Path) -> crate::Result<TensorBytes> {
    let file = std::fs::File::open(path).map_err(|e| crate::Error::io(path, e))?;
    // SAFETY: the map is read-only and private to us. Model files are treated as immutable while
    // loaded (documented in the README); a concurrent truncation by another process would be a
    // SIGBUS, which no safe API over mmap can prevent.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| crate::Error::io(path, e))?;
    Ok(TensorBytes::from_mmap(map))
}
