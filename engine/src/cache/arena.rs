//! The neuron cache's arena: one anonymous private mapping, reserved once for the most slots the
//! cache could ever hold (every chunk of the model), of which a prefix — the slots the cache has
//! now — is readable and writable.
//!
//! Why one mapping rather than separately allocated segments: the slots must stay one contiguous
//! range at a fixed address, because the CUDA chunk path registers the arena with the driver as
//! one range and addresses a discrete GPU's twin by offset from its start. A reservation gives
//! that and still lets the cache give memory back:
//!
//! - **Reserve** (`Arena::new`): `PROT_NONE`, `MAP_NORESERVE`: address space only, no memory, no
//!   commit charge (so strict overcommit accounting sees only the usable prefix).
//! - **Grow** (`Arena::commit`): `mprotect` the new range read-write. Nothing is allocated yet:
//!   pages are faulted in, zeroed, when a read first fills a slot. The usable length is therefore
//!   an upper bound of what is resident.
//! - **Shrink** (`Arena::release`): `madvise(MADV_DONTNEED)` drops the range's pages (the process
//!   RSS falls at once; a later fault gives fresh zero pages), then `PROT_NONE` returns the commit
//!   charge and makes any stray access a fault instead of a silent use of a freed slot.
//!
//! Transparent huge pages are turned off for the arena (`MADV_NOHUGEPAGE`): a 2 MiB page faulted
//! in for one slot would make resident memory exceed the slots filled, and dropping part of one
//! frees its memory only when the kernel gets round to splitting it.
//!
//! The mapping is unmapped on drop.

use std::io;
use std::ops::Range;
use std::ptr::NonNull;

use crate::io::PAGE;

/// An address range reserved for slots; see the module docs. Invariant: `base` is the start of
/// a live mapping of `reserved` bytes (a positive multiple of [`PAGE`]) owned by this value.
#[derive(Debug)]
pub(crate) struct Arena {
    base: NonNull<u8>,
    reserved: usize,
}

// SAFETY: the arena owns its mapping exclusively; the cache that owns the arena decides who may
// touch which slot (see `NeuronCache`), so moving or sharing the handle is as sound as for a Vec.
unsafe impl Send for Arena {}
// SAFETY: as for Send: &self methods only query the mapping.
unsafe impl Sync for Arena {}

impl Arena {
    /// Reserves `bytes` of address space (rounded up to whole pages, at least one), none of it
    /// usable yet.
    pub(crate) fn new(bytes: usize) -> io::Result<Arena> {
        let reserved = bytes
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        // SAFETY: a fresh anonymous mapping at an address the kernel picks aliases nothing.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(raw.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        let arena = Arena { base, reserved };
        // SAFETY: the range is exactly our fresh mapping. Failure (a kernel without THP) only
        // loses the precision the module docs explain, so it is ignored.
        unsafe { libc::madvise(raw, reserved, libc::MADV_NOHUGEPAGE) };
        Ok(arena)
    }

    /// The first byte of the reservation (PAGE-aligned, fixed for the arena's life).
    pub(crate) fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// Makes `range` (byte offsets, page-aligned, inside the reservation) readable and writable.
    /// Its pages are allocated, zeroed, on first touch.
    pub(crate) fn commit(&self, range: Range<usize>) -> io::Result<()> {
        self.protect(range, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// Gives `range`'s memory back to the OS and makes it inaccessible again.
    ///
    /// # Safety
    /// Nothing may use the range any more: no reference into it, no read in flight into it, and
    /// no device registration covering it (locked pages cannot be dropped).
    pub(crate) unsafe fn release(&self, range: Range<usize>) -> io::Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        self.check(&range);
        // SAFETY: the range lies inside our mapping (checked) and, by the caller's contract, is
        // unused, so dropping its contents breaks nothing.
        let r = unsafe {
            libc::madvise(
                self.base.as_ptr().add(range.start).cast(),
                range.len(),
                libc::MADV_DONTNEED,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        self.protect(range, libc::PROT_NONE)
    }

    /// Bytes of `range` whose pages are resident now (`mincore`): a measurement for tests and
    /// benchmarks; the cache's accounting never depends on it.
    pub(crate) fn resident_bytes(&self, range: Range<usize>) -> io::Result<usize> {
        if range.is_empty() {
            return Ok(0);
        }
        self.check(&range);
        let mut pages = vec![0u8; range.len().div_ceil(PAGE)];
        // SAFETY: the range lies inside our mapping (checked, page-aligned start) and `pages` has
        // one byte per page of it, as mincore requires.
        let r = unsafe {
            libc::mincore(
                self.base.as_ptr().add(range.start).cast(),
                range.len(),
                pages.as_mut_ptr().cast(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(pages.iter().filter(|&&p| p & 1 == 1).count() * PAGE)
    }

    fn protect(&self, range: Range<usize>, prot: libc::c_int) -> io::Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        self.check(&range);
        // SAFETY: the range lies inside our mapping (checked); changing its protection affects no
        // memory outside it.
        let r = unsafe {
            libc::mprotect(
                self.base.as_ptr().add(range.start).cast(),
                range.len(),
                prot,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Panics unless `range` is page-aligned and inside the reservation: the cache computes
    /// ranges from slot indices, so a bad one is a broken invariant.
    fn check(&self, range: &Range<usize>) {
        assert!(
            range.start.is_multiple_of(PAGE)
                && range.end.is_multiple_of(PAGE)
                && range.start <= range.end
                && range.end <= self.reserved,
            "arena range {range:?} is not page-aligned inside the {} reserved bytes",
            self.reserved
        );
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `base`/`reserved` are the mapping made in `new`, unmapped only here; the owner
        // (the cache) is being dropped, so nothing uses the slots any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.reserved) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_pages_fault_in_on_touch_and_released_ones_leave() {
        let a = Arena::new(64 * PAGE).expect("reserve");
        assert_eq!(a.base().as_ptr() as usize % PAGE, 0);
        assert_eq!(a.resident_bytes(0..64 * PAGE).expect("mincore"), 0);
        a.commit(0..32 * PAGE).expect("commit");
        assert_eq!(
            a.resident_bytes(0..64 * PAGE).expect("mincore"),
            0,
            "nothing touched yet"
        );
        // SAFETY: the first 32 pages are committed and nothing else uses them.
        unsafe { std::ptr::write_bytes(a.base().as_ptr(), 7, 32 * PAGE) };
        assert_eq!(a.resident_bytes(0..64 * PAGE).expect("mincore"), 32 * PAGE);
        // SAFETY: no reference into pages 8..32 exists.
        unsafe { a.release(8 * PAGE..32 * PAGE) }.expect("release");
        assert_eq!(a.resident_bytes(0..64 * PAGE).expect("mincore"), 8 * PAGE);
        a.commit(8 * PAGE..16 * PAGE).expect("commit again");
        // SAFETY: page 8 is committed again and unused.
        let fresh = unsafe { *a.base().as_ptr().add(8 * PAGE) };
        assert_eq!(fresh, 0, "a released page comes back zeroed");
        // SAFETY: page 0 is committed and was written above.
        let kept = unsafe { *a.base().as_ptr() };
        assert_eq!(kept, 7, "kept pages keep their bytes");
    }
}
