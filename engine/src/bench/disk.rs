//! The disk's O_DIRECT read bandwidth, measured on the model file itself: the ceiling the I/O
//! workers are compared with (`disk_busy_share`, `storage_bound_tok_s`).
//!
//! The file's page cache is dropped first; then `queue_depth` threads (as many as the I/O pool
//! has workers) each take the next whole aligned block of `block_bytes` (default 1 MiB, the
//! pool's largest coalesced read) of the given range, in file order by default (the order in
//! which the pipelines mostly read a layer's chunks) or shuffled, never the same block twice,
//! until `max_bytes` or `max_time` is reached (2 GiB or 4 s by default). On the development VM,
//! in-order reads at queue depth 4 reach ~1.75 GB/s and shuffled ones ~1.4 GB/s. Where the
//! filesystem refuses O_DIRECT the reads go through the page cache and [`DiskBandwidth::direct`]
//! says so.

use std::io::IoSliceMut;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::io::{AlignedBuf, DirectFile, PAGE, align_down};
use crate::{Error, Result};

/// How to probe.
#[derive(Clone, Debug)]
pub struct ProbeOptions {
    /// Bytes per read, a multiple of 4 KiB. Default 1 MiB.
    pub block_bytes: usize,
    /// Reads in flight (threads). Default 4, the bench's default I/O workers.
    pub queue_depth: usize,
    /// Stop after this many bytes. Default 2 GiB.
    pub max_bytes: u64,
    /// Read the blocks in a seeded random order instead of file order. Default false.
    pub shuffle: bool,
    /// Stop after this long. Default 4 s. (On the development VM, probes of 2 GiB vary by about
    /// ±15 % from one run to the next.)
    pub max_time: Duration,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            block_bytes: 1 << 20,
            queue_depth: 4,
            max_bytes: 2 << 30,
            shuffle: false,
            max_time: Duration::from_secs(4),
        }
    }
}

/// A measured read bandwidth.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskBandwidth {
    /// Bytes read per second of wall time.
    pub bytes_per_s: f64,
    pub bytes: u64,
    pub seconds: f64,
    pub block_bytes: usize,
    pub queue_depth: usize,
    /// False when the filesystem refused O_DIRECT: the figure is then the page cache's speed.
    pub direct: bool,
}

/// Measures the read bandwidth over `range` of the file at `path` (clipped to whole pages of the
/// file). Errors name the file.
pub fn probe(path: &Path, range: Range<u64>, opts: &ProbeOptions) -> Result<DiskBandwidth> {
    crate::process::drop_page_cache(path);
    let file = DirectFile::open(path)?;
    let start = range.start.next_multiple_of(PAGE as u64);
    let end = range.end.min(align_down(file.len(), PAGE as u64));
    let len = end.saturating_sub(start);
    if len == 0 {
        return Err(Error::invalid_file(
            path,
            format!("no whole page to read in bytes {range:?}"),
        ));
    }
    let block = (opts.block_bytes.max(PAGE) as u64)
        .min(align_down(len, PAGE as u64))
        .next_multiple_of(PAGE as u64);
    let blocks = (len / block) as usize;
    // Optionally a seeded shuffle (splitmix64), so that no read follows its neighbour on disk.
    let mut order: Vec<u64> = (0..blocks as u64).collect();
    let mut s = 0x853c_49e6_748f_ea9bu64;
    for i in (1..order.len()).rev().filter(|_| opts.shuffle) {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        order.swap(i, ((z ^ (z >> 31)) % (i as u64 + 1)) as usize);
    }
    let next = AtomicUsize::new(0);
    let done = AtomicU64::new(0);
    let depth = opts.queue_depth.clamp(1, 64);
    let t = Instant::now();
    let results: Vec<std::io::Result<()>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..depth)
            .map(|_| {
                scope.spawn(|| {
                    let mut buf = AlignedBuf::zeroed(block as usize)?;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= blocks
                            || done.load(Ordering::Relaxed) >= opts.max_bytes
                            || t.elapsed() >= opts.max_time
                        {
                            return Ok(());
                        }
                        let at = start + order[i] * block;
                        file.read_exact_at(&mut [IoSliceMut::new(buf.as_mut_slice())], at)?;
                        done.fetch_add(block, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("probe thread panicked")))
            })
            .collect()
    });
    let seconds = t.elapsed().as_secs_f64();
    for r in results {
        r.map_err(|e| Error::io(path, e))?;
    }
    let bytes = done.into_inner();
    Ok(DiskBandwidth {
        bytes_per_s: bytes as f64 / seconds.max(1e-9),
        bytes,
        seconds,
        block_bytes: block as usize,
        queue_depth: depth,
        direct: file.is_direct(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_reads_whole_blocks_and_reports_a_positive_bandwidth() {
        // On the crate's disk (not /tmp, which may be tmpfs without O_DIRECT).
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("probe.bin");
        std::fs::write(&path, vec![7u8; 8 * PAGE + 100]).unwrap();
        let opts = ProbeOptions {
            block_bytes: 2 * PAGE,
            queue_depth: 2,
            ..ProbeOptions::default()
        };
        let bw = probe(&path, 100..u64::MAX, &opts).unwrap();
        // Pages 1..8 are whole: three blocks of two pages.
        assert_eq!((bw.block_bytes, bw.bytes), (2 * PAGE, 6 * PAGE as u64));
        assert!(bw.bytes_per_s > 0.0 && bw.seconds > 0.0, "{bw:?}");
        let shuffled = ProbeOptions {
            shuffle: true,
            ..opts.clone()
        };
        assert_eq!(
            probe(&path, 0..u64::MAX, &shuffled).unwrap().bytes,
            8 * PAGE as u64
        );
        let capped = ProbeOptions {
            max_bytes: 1,
            queue_depth: 1,
            ..opts
        };
        assert_eq!(
            probe(&path, 0..u64::MAX, &capped).unwrap().bytes,
            2 * PAGE as u64
        );
        let err = probe(&path, 8 * PAGE as u64..u64::MAX, &ProbeOptions::default()).unwrap_err();
        assert!(err.to_string().contains("probe.bin"), "{err}");
    }
}
