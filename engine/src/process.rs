//! What the operating system knows about this process: peak resident memory, bytes read from
//! storage, and how to make a run start cold. Linux only; elsewhere the figures read as 0.

use std::path::Path;

/// Peak resident set size (`VmHWM`) in bytes, or 0 where unavailable.
pub fn peak_rss_bytes() -> u64 {
    status_kib("VmHWM:") * 1024
}

/// Current resident set size (`VmRSS`) in bytes, or 0 where unavailable.
pub fn rss_bytes() -> u64 {
    status_kib("VmRSS:") * 1024
}

fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse().ok())
        })
        .unwrap_or(0)
}

/// Resets the peak resident set size to the current one (Linux ≥ 4.0; ignored elsewhere).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Bytes this process has caused to be read from storage (`read_bytes` of `/proc/self/io`, all
/// threads; O_DIRECT reads and page-cache misses both count, page-cache hits do not).
pub fn storage_read_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("read_bytes:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// Asks the kernel to drop the page cache of `path` (clean pages not mapped by anyone), so that
/// the next run starts cold. Returns false if it could not.
pub fn drop_page_cache(path: &Path) -> bool {
    std::fs::File::open(path)
        .ok()
        .and_then(|f| {
            nix::fcntl::posix_fadvise(
                &f,
                0,
                0,
                nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
            )
            .ok()
        })
        .is_some()
}
