//! Page-aligned owned buffers and alignment arithmetic for O_DIRECT reads.
//!
//! O_DIRECT needs the file offset, the length and the memory address of every read aligned to the
//! device's logical block size; we use one page ([`PAGE`], 4 KiB) everywhere, which covers every
//! block size in use on Jetson storage (512 B and 4 KiB).

use std::alloc::Layout;
use std::ptr::NonNull;

/// The alignment of every direct read: offset, length and address, in bytes.
pub const PAGE: usize = 4096;

/// Rounds `n` up to a multiple of `to`. `to` must be a power of two (panics otherwise, as this is
/// only ever called with compile-time alignments). Overflow wraps to a panic in debug builds; callers
/// pass sizes far below `u64::MAX`.
pub const fn align_up(n: u64, to: u64) -> u64 {
    assert!(to.is_power_of_two(), "alignment must be a power of two");
    (n + (to - 1)) & !(to - 1)
}

/// Rounds `n` down to a multiple of `to`, a power of two.
pub const fn align_down(n: u64, to: u64) -> u64 {
    assert!(to.is_power_of_two(), "alignment must be a power of two");
    n & !(to - 1)
}

/// [`align_up`] for `usize`.
pub const fn align_up_usize(n: usize, to: usize) -> usize {
    align_up(n as u64, to as u64) as usize
}

/// Whether `n` is a multiple of [`PAGE`].
pub const fn is_page_aligned(n: u64) -> bool {
    n.is_multiple_of(PAGE as u64)
}

/// An owned, zero-initialised heap buffer whose start is [`PAGE`]-aligned.
///
/// Invariants: `ptr` points to an allocation of `capacity()` bytes (a whole number of pages, at
/// least one) made with `Layout::from_size_align(capacity, PAGE)`; the first `len` bytes are the
/// buffer. Ownership is unique, so moving it between threads is sound (`Send + Sync` like `Vec`).
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like Vec<u8>); &self only gives shared reads
// and &mut self exclusive writes, so it can be sent and shared across threads.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send: no interior mutability.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes, [`PAGE`]-aligned; the allocation is rounded up to whole pages
    /// (at least one), so a direct read of `align_up(len)` bytes also fits. Large buffers come from
    /// `calloc`-like zeroed pages and cost no resident memory until touched.
    ///
    /// Fails with [`std::io::ErrorKind::OutOfMemory`] when the allocator refuses.
    pub fn zeroed(len: usize) -> std::io::Result<Self> {
        let oom = || {
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("cannot allocate an aligned buffer of {len} bytes"),
            )
        };
        let capacity = len.max(1).checked_next_multiple_of(PAGE).ok_or_else(oom)?;
        let layout = Layout::from_size_align(capacity, PAGE).map_err(|_| oom())?;
        // SAFETY: `layout` has a non-zero size (capacity >= PAGE).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(oom)?;
        Ok(AlignedBuf { ptr, len, capacity })
    }

    /// Length in bytes, as requested at construction.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes actually allocated: `len` rounded up to whole pages (at least one page).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The buffer as bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for `capacity >= len` initialised (zeroed) bytes, owned by self and
        // borrowed shared for the lifetime of &self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer as mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Start of the buffer (PAGE-aligned). Writing through it needs `&mut self` to be held or an
    /// equivalent guarantee of exclusive access to the written range.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the buffer (PAGE-aligned), for handing disjoint ranges to I/O threads.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated in `zeroed` with exactly this layout (the same constructor
        // succeeded with these values) and is freed only here.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.capacity, PAGE),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buffer_is_zeroed_aligned_and_writable() {
        for len in [0, 1, 4095, 4096, 4097, 3 * PAGE + 5] {
            let mut b = AlignedBuf::zeroed(len).expect("alloc");
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % PAGE, 0);
            assert!(b.capacity() >= len.max(1) && b.capacity().is_multiple_of(PAGE));
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice().iter_mut().for_each(|x| *x = 7);
            assert!(b.as_slice().iter().all(|&x| x == 7));
        }
    }

    #[test]
    fn absurd_size_is_an_error_not_an_abort() {
        let err = AlignedBuf::zeroed(usize::MAX - 10).expect_err("must fail");
        assert_eq!(err.kind(), std::io::ErrorKind::OutOfMemory);
    }

    proptest! {
        #[test]
        fn align_up_down_properties(n in 0u64..(1 << 50), shift in 0u32..20) {
            let to = 1u64 << shift;
            let up = align_up(n, to);
            let down = align_down(n, to);
            prop_assert_eq!(up % to, 0);
            prop_assert_eq!(down % to, 0);
            prop_assert!(down <= n && n <= up);
            prop_assert!(up - n < to && n - down < to);
            prop_assert_eq!(up == n, n % to == 0);
            prop_assert_eq!(down == n, n % to == 0);
            prop_assert_eq!(align_up(up, to), up);
            prop_assert_eq!(align_down(down, to), down);
        }
    }
}
