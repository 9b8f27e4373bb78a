//! The disk as a curve: O_DIRECT read bandwidth by block size and queue depth, blocks shuffled.
//!
//! One number does not describe an SSD. A dense layer streams as 1 MiB reads, one or a few at a
//! time; a sparse FFN layer reads neuron bundles of 4–64 KiB, and such small reads reach the
//! disk's bandwidth only when many are in flight. The planner needs both ends, so the probe
//! measures a grid ([`CurveOptions`]: 4 KiB to 1 MiB × depth 1 to 64 by default), each point a
//! short [`super::disk::probe`] in a shuffled order (no read follows its neighbour on disk), and
//! [`DiskCurve::bytes_per_s`] answers for any block size and depth in between.

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::disk::{DiskBandwidth, ProbeOptions, probe};
use crate::Result;

/// Which points to measure, and how long each may take.
#[derive(Clone, Debug)]
pub struct CurveOptions {
    /// Bytes per read, multiples of 4 KiB, ascending.
    pub blocks: Vec<usize>,
    /// Reads in flight, ascending.
    pub depths: Vec<usize>,
    /// Longest time one point may take (the probe also stops at [`Self::bytes_per_point`]).
    pub time_per_point: Duration,
    pub bytes_per_point: u64,
}

impl Default for CurveOptions {
    /// 4 KiB to 1 MiB in powers of two × depths 1, 4, 16, 64; a quarter second per point, so the
    /// whole curve takes about 8 s plus a page-cache drop per point.
    fn default() -> Self {
        CurveOptions {
            blocks: (12..=20).map(|p| 1usize << p).collect(),
            depths: vec![1, 4, 16, 64],
            time_per_point: Duration::from_millis(250),
            bytes_per_point: 512 << 20,
        }
    }
}

/// Measured points, in the order of [`CurveOptions::blocks`] then [`CurveOptions::depths`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskCurve {
    pub points: Vec<DiskBandwidth>,
}

/// Measures the curve over `range` of the file at `path`.
pub fn measure(path: &Path, range: Range<u64>, opts: &CurveOptions) -> Result<DiskCurve> {
    let mut points = Vec::with_capacity(opts.blocks.len() * opts.depths.len());
    for &block_bytes in &opts.blocks {
        for &queue_depth in &opts.depths {
            let point = ProbeOptions {
                block_bytes,
                queue_depth,
                max_bytes: opts.bytes_per_point,
                shuffle: true,
                max_time: opts.time_per_point,
            };
            points.push(probe(path, range.clone(), &point)?);
        }
    }
    Ok(DiskCurve { points })
}

impl DiskCurve {
    /// False when the filesystem refused O_DIRECT: the figures are the page cache's then.
    pub fn direct(&self) -> bool {
        self.points.iter().all(|p| p.direct)
    }

    /// Predicted bandwidth for reads of `block` bytes with `depth` in flight: at the deepest
    /// measured depth not above `depth` (more in flight than measured is not assumed to help),
    /// interpolated between the two nearest measured block sizes on a log scale, and held flat
    /// beyond the smallest and largest. `None` for an empty curve.
    pub fn bytes_per_s(&self, block: usize, depth: usize) -> Option<f64> {
        let depths = self.depths();
        let d = depths
            .iter()
            .copied()
            .filter(|&d| d <= depth.max(1))
            .max()
            .or_else(|| depths.first().copied())?;
        let row: Vec<&DiskBandwidth> = self.points.iter().filter(|p| p.queue_depth == d).collect();
        let below = row
            .iter()
            .filter(|p| p.block_bytes <= block)
            .max_by_key(|p| p.block_bytes);
        let above = row
            .iter()
            .filter(|p| p.block_bytes >= block)
            .min_by_key(|p| p.block_bytes);
        match (below, above) {
            (Some(b), Some(a)) if a.block_bytes > b.block_bytes => {
                let span = (a.block_bytes as f64).ln() - (b.block_bytes as f64).ln();
                let t = ((block as f64).ln() - (b.block_bytes as f64).ln()) / span;
                Some(b.bytes_per_s + t * (a.bytes_per_s - b.bytes_per_s))
            }
            (Some(p), _) | (None, Some(p)) => Some(p.bytes_per_s),
            (None, None) => None,
        }
    }

    /// Seconds to read `bytes` as reads of `block` bytes with `depth` in flight.
    pub fn seconds(&self, bytes: u64, block: usize, depth: usize) -> Option<f64> {
        self.bytes_per_s(block, depth)
            .map(|bw| bytes as f64 / bw.max(1.0))
    }

    fn depths(&self) -> Vec<usize> {
        let mut d: Vec<usize> = self.points.iter().map(|p| p.queue_depth).collect();
        d.sort_unstable();
        d.dedup();
        d
    }

    fn blocks(&self) -> Vec<usize> {
        let mut b: Vec<usize> = self.points.iter().map(|p| p.block_bytes).collect();
        b.sort_unstable();
        b.dedup();
        b
    }

    /// The curve as a table: one row per block size, one column per depth, in MB/s.
    pub fn table(&self) -> String {
        let depths = self.depths();
        let mut out = format!(
            "disk curve: MB/s by read size and reads in flight ({}, shuffled)\n{:>9}",
            if self.direct() {
                "O_DIRECT"
            } else {
                "page cache: O_DIRECT refused"
            },
            "read"
        );
        for d in &depths {
            out.push_str(&format!(" {:>8}", format!("qd {d}")));
        }
        out.push('\n');
        for block in self.blocks() {
            out.push_str(&format!("{:>9}", size(block)));
            for &d in &depths {
                let cell = self
                    .points
                    .iter()
                    .find(|p| p.block_bytes == block && p.queue_depth == d)
                    .map_or("-".to_string(), |p| format!("{:.0}", p.bytes_per_s / 1e6));
                out.push_str(&format!(" {cell:>8}"));
            }
            out.push('\n');
        }
        out
    }
}

/// `4 KiB`, `1 MiB`.
fn size(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::io::PAGE;

    fn point(block_bytes: usize, queue_depth: usize, mb_s: f64) -> DiskBandwidth {
        DiskBandwidth {
            bytes_per_s: mb_s * 1e6,
            bytes: 1,
            seconds: 1.0,
            block_bytes,
            queue_depth,
            direct: true,
        }
    }

    fn curve() -> DiskCurve {
        DiskCurve {
            points: vec![
                point(4 << 10, 1, 40.0),
                point(4 << 10, 16, 400.0),
                point(64 << 10, 1, 300.0),
                point(64 << 10, 16, 1600.0),
            ],
        }
    }

    #[test]
    fn between_measured_sizes_the_bandwidth_is_interpolated_on_a_log_scale() {
        let c = curve();
        let mb = |block, depth| c.bytes_per_s(block, depth).unwrap() / 1e6;
        assert_eq!(mb(4 << 10, 1), 40.0);
        assert_eq!(mb(64 << 10, 16), 1600.0);
        // 16 KiB is half-way from 4 to 64 KiB on a log scale.
        assert!((mb(16 << 10, 16) - 1000.0).abs() < 1e-6);
        // Beyond the ends: held flat.
        assert_eq!(mb(1 << 20, 1), 300.0);
        assert_eq!(mb(512, 16), 400.0);
    }

    #[test]
    fn a_depth_is_served_by_the_deepest_measured_depth_not_above_it() {
        let c = curve();
        assert_eq!(c.bytes_per_s(4 << 10, 8).unwrap(), 40e6);
        assert_eq!(c.bytes_per_s(4 << 10, 64).unwrap(), 400e6);
        assert_eq!(c.bytes_per_s(4 << 10, 0).unwrap(), 40e6);
        assert!((c.seconds(400_000_000, 4 << 10, 16).unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(DiskCurve { points: vec![] }.bytes_per_s(4096, 1), None);
    }

    #[test]
    fn the_table_has_a_row_per_size_and_a_column_per_depth() {
        let t = curve().table();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(
            lines[1].contains("qd 1") && lines[1].contains("qd 16"),
            "{t}"
        );
        assert!(
            lines[2].starts_with("    4 KiB") && lines[2].ends_with("400"),
            "{t}"
        );
        assert!(
            lines[3].contains("64 KiB") && lines[3].ends_with("1600"),
            "{t}"
        );
    }

    #[test]
    fn every_point_of_the_grid_is_measured() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("curve.bin");
        std::fs::write(&path, vec![1u8; 64 * PAGE]).unwrap();
        let opts = CurveOptions {
            blocks: vec![PAGE, 4 * PAGE],
            depths: vec![1, 4],
            time_per_point: Duration::from_millis(50),
            bytes_per_point: 1 << 20,
        };
        let c = measure(&path, 0..u64::MAX, &opts).unwrap();
        let grid: Vec<(usize, usize)> = c
            .points
            .iter()
            .map(|p| (p.block_bytes, p.queue_depth))
            .collect();
        assert_eq!(grid, [(PAGE, 1), (PAGE, 4), (4 * PAGE, 1), (4 * PAGE, 4)]);
        assert!(c.points.iter().all(|p| p.bytes > 0 && p.bytes_per_s > 0.0));
    }
}
