//! FFN layers streamed by neuron: which layers of a calibrated `.lsm` a plan reads sparsely
//! (only the bundles its predictor selects, through the neuron cache), and what they cost.
//!
//! A sparse layer reads, per token, each chunk its predictor selects that the cache does not
//! hold: `Σ P(chunk) · chunk_bytes` at the disk's speed for chunk-sized reads at depth, against
//! its whole FFN at the speed of large reads when streamed dense. A layer goes sparse only where
//! that is faster; a model whose neuron is smaller than a read (SmolLM2, Gemma 3: 2–3 neurons a
//! page, fetched 90 % of the time) plans dense by construction.

use crate::Result;
use crate::model::lsm::{ChunkLayout, LsmFile};
use crate::predict;

/// The disk's speed for the two kinds of read a plan makes, in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiskSpeeds {
    /// Dense pieces: 512 KiB requests, a few in flight.
    pub dense: f64,
    /// Neuron chunks: reads of one chunk (merged where adjacent), tens in flight.
    pub sparse: f64,
}

/// Random `O_DIRECT` reads at queue depth 32, bytes per second by read size, and 1 MiB reads at
/// depth 4: measured with fio on the development VM's disk (`docs/bench/sparse.md`, "The disk as
/// a curve"). What a plan assumes unless given a measured curve (`leanstream plan --disk-probe`).
const TYPICAL_DEPTH_32: [(usize, f64); 5] = [
    (4 << 10, 418e6),
    (8 << 10, 694e6),
    (16 << 10, 1179e6),
    (64 << 10, 1339e6),
    (1 << 20, 1785e6),
];
const TYPICAL_DENSE: f64 = 1912e6;

impl DiskSpeeds {
    /// The typical disk for chunks of `chunk_bytes`: the table's speed at the nearest size at or
    /// below it.
    pub fn typical(chunk_bytes: usize) -> DiskSpeeds {
        let sparse = TYPICAL_DEPTH_32
            .iter()
            .rev()
            .find(|(size, _)| *size <= chunk_bytes)
            .unwrap_or(&TYPICAL_DEPTH_32[0])
            .1;
        DiskSpeeds {
            dense: TYPICAL_DENSE,
            sparse,
        }
    }
}

/// What a plan needs to know of a calibrated `.lsm`'s FFN to stream layers of it sparsely.
#[derive(Clone, Debug)]
pub struct SparseFfn {
    pub chunk_bytes: u64,
    /// Per layer, per chunk: the probability that the predictor selects the chunk for a token
    /// (from the calibrated per-neuron selection probabilities: a chunk is read when any of its
    /// neurons is selected).
    pub chunk_probability: Vec<Vec<f32>>,
    /// The predictor's tables, resident while any layer is sparse.
    pub predictor_bytes: u64,
    /// The smallest neuron cache the pipeline runs with ([`ChunkLayout::floor_bytes`]).
    pub cache_floor_bytes: u64,
    pub disk: DiskSpeeds,
}

impl SparseFfn {
    /// Reads the calibration of the `.lsm` `file`. `None` when it has none (or predates per-neuron
    /// selection probabilities): such a file streams dense.
    pub fn of(file: &LsmFile, path: &std::path::Path) -> Result<Option<SparseFfn>> {
        let Ok(cal) = file.calibration(path) else {
            return Ok(None);
        };
        let Ok(selection) = cal.selection_probabilities() else {
            return Ok(None);
        };
        let layout = ChunkLayout::from_header(path, &file.header)?;
        let chunk_probability = selection
            .iter()
            .map(|q| {
                (0..layout.chunks_per_layer)
                    .map(|c| {
                        1.0 - q[layout.neurons(c)]
                            .iter()
                            .map(|p| 1.0 - p)
                            .product::<f32>()
                    })
                    .collect()
            })
            .collect();
        let predictor_bytes =
            predict::load(&cal, crate::model::lsm::PredictorKind::DEFAULT)?.bytes();
        Ok(Some(SparseFfn {
            chunk_bytes: layout.chunk_bytes as u64,
            chunk_probability,
            predictor_bytes: predictor_bytes as u64,
            cache_floor_bytes: layout.floor_bytes() as u64,
            disk: DiskSpeeds::typical(layout.chunk_bytes),
        }))
    }

    /// Bytes layer `l` reads per token with no cache.
    pub fn expected_bytes(&self, l: usize) -> f64 {
        self.chunk_probability[l]
            .iter()
            .map(|&p| f64::from(p))
            .sum::<f64>()
            * self.chunk_bytes as f64
    }

    /// Whether layer `l`, whose FFN is `dense_bytes` streamed dense, reads faster sparse.
    pub fn pays(&self, l: usize, dense_bytes: u64) -> bool {
        self.expected_bytes(l) / self.disk.sparse < dense_bytes as f64 / self.disk.dense
    }

    /// Bytes the sparse layers `layers` read per token through a cache of `cache_bytes` holding
    /// their most often selected chunks (what frequency retention converges to).
    pub fn miss_bytes(&self, layers: &[usize], cache_bytes: u64) -> f64 {
        let mut p: Vec<f32> = layers
            .iter()
            .flat_map(|&l| self.chunk_probability[l].iter().copied())
            .collect();
        p.sort_by(|a, b| b.total_cmp(a));
        let cached = (cache_bytes / self.chunk_bytes.max(1)) as usize;
        p.iter().skip(cached).map(|&p| f64::from(p)).sum::<f64>() * self.chunk_bytes as f64
    }

    /// Bytes of the chunks of `layers` worth caching before any dense byte is kept resident:
    /// those selected more often than the sparse-to-dense speed ratio (a cached byte of such a
    /// chunk saves more disk time than a resident dense byte).
    pub fn hot_bytes(&self, layers: &[usize]) -> u64 {
        let ratio = (self.disk.sparse / self.disk.dense) as f32;
        let hot = layers
            .iter()
            .flat_map(|&l| self.chunk_probability[l].iter())
            .filter(|&&p| p > ratio)
            .count();
        hot as u64 * self.chunk_bytes
    }

    /// Bytes of every chunk of `layers`.
    pub fn all_bytes(&self, layers: &[usize]) -> u64 {
        layers
            .iter()
            .map(|&l| self.chunk_probability[l].len() as u64 * self.chunk_bytes)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ffn(p: Vec<Vec<f32>>) -> SparseFfn {
        SparseFfn {
            chunk_bytes: 8192,
            chunk_probability: p,
            predictor_bytes: 0,
            cache_floor_bytes: 0,
            disk: DiskSpeeds {
                dense: 2e9,
                sparse: 0.7e9,
            },
        }
    }

    #[test]
    fn a_layer_goes_sparse_only_where_its_reads_take_less_time() {
        // 100 chunks of 8 KiB = 800 KiB dense; at 0.35 of the dense speed, sparse pays below a
        // fetch fraction of 0.35.
        let f = ffn(vec![vec![0.2; 100], vec![0.5; 100]]);
        let dense = 100 * 8192;
        assert!(f.pays(0, dense));
        assert!(!f.pays(1, dense));
    }

    #[test]
    fn the_cache_takes_the_most_often_selected_chunks_first() {
        let f = ffn(vec![vec![0.9, 0.1, 0.5, 0.3]]);
        let none = f.miss_bytes(&[0], 0);
        assert!((none - 1.8 * 8192.0).abs() < 1e-2, "{none}");
        let one = f.miss_bytes(&[0], 8192);
        assert!((one - 0.9 * 8192.0).abs() < 1e-3, "{one}");
        assert_eq!(
            f.hot_bytes(&[0]),
            2 * 8192,
            "0.9 and 0.5 beat the speed ratio 0.35"
        );
        assert_eq!(DiskSpeeds::typical(8960).sparse, 694e6);
    }
}
