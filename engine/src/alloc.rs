//! How a process running the engine hands freed memory back to the system, so that its
//! resident size follows what a memory budget accounts and does not keep the high-water mark of
//! past sessions or of a model's load (the daemon and `leanstream run --memory-budget`).
//!
//! The allocator is glibc's malloc, tuned at start rather than replaced (a second allocator
//! would be one more thing to build for every board image, and the engine's large buffers do
//! not need one):
//!
//! - **Large blocks go straight to `mmap`.** KV blocks, scratch buffers, neuron-cache arenas
//!   and owned weights are far above [`MMAP_THRESHOLD`], so each is its own mapping that
//!   `free` unmaps at once. Setting the threshold explicitly also turns off glibc's dynamic
//!   threshold, which otherwise rises (up to 32 MiB on 64-bit) after such a block is freed and
//!   lets the next ones live in the heap, where they are retained.
//! - **Few arenas.** Each thread that allocates may get its own arena, and memory freed into
//!   an arena is kept there. [`MAX_ARENAS`] bounds that retention; the daemon allocates on its
//!   control threads, not on the compute threads' per-token path.
//! - **Trim after releases.** [`trim`] (`malloc_trim`) returns the free pages of every arena to
//!   the system; it runs after a session or a model is dropped, which is when a large amount of
//!   small allocations (a tokenizer's vocabulary, a chat history) comes free at once.
//!
//! On other C libraries (musl images) these are no-ops: musl's allocator returns large blocks
//! itself and keeps no per-thread arenas.

/// Allocations of at least this many bytes are their own `mmap`.
pub const MMAP_THRESHOLD: usize = 128 << 10;
/// Most malloc arenas.
pub const MAX_ARENAS: usize = 2;
/// Free memory at the top of the main heap beyond this is returned at once.
pub const TRIM_THRESHOLD: usize = 1 << 20;

/// Applies the settings above; call once at start, before threads are spawned.
pub fn configure() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before other threads
    // exist, and every value is in the range glibc documents for its parameter.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
        libc::mallopt(libc::M_ARENA_MAX, MAX_ARENAS as libc::c_int);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int);
    }
}

/// Returns the allocator's free pages to the system.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim is thread-safe (it takes each arena's lock) and has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Anonymous resident memory of this process, from /proc/self/status (RssAnon).
    fn rss_anon() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb << 10)
    }

    #[test]
    fn freed_small_allocations_are_handed_back_after_a_trim() {
        configure();
        // 64 MiB in 4 KiB pieces: below the mmap threshold, so they live in the heap.
        let mut pieces: Vec<Vec<u8>> = (0..16 * 1024).map(|_| vec![1u8; 4096]).collect();
        let full = rss_anon();
        // Keep the last piece so the heap's top is not free: only a trim can return the rest.
        let last = pieces.pop();
        drop(pieces);
        trim();
        let after = rss_anon();
        assert!(last.is_some());
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(
                after + (48 << 20) < full,
                "RssAnon {full} bytes with the pieces, {after} after freeing and trimming"
            );
        }
    }
}
