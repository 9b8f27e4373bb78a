//! `mmap` mode: the selected chunks are computed straight from the memory-mapped file, and the
//! OS page cache decides what stays in memory (llama.cpp's default way of loading weights, with
//! the same sparse selection as the other modes). Its reads cannot be counted per chunk; reports
//! take them from the process's I/O counters.

use std::sync::Arc;
use std::time::Instant;

use super::select::Selector;
use super::sparse_model::SparseModel;
use super::stats::PipelineStats;
use crate::Result;
use crate::backend::chunks::ChunkMath;
use crate::backend::cpu::{Kernels, Precision, QuantizedActs};
use crate::forward::FfnExecutor;
use crate::model::LayerWeights;

/// The `mmap` mode's FFN.
#[derive(Debug)]
pub struct MmapFfn {
    sm: Arc<SparseModel>,
    selector: Selector,
    precision: Precision,
    /// Count predictor recall against dense activations (measurement passes only).
    pub measure_recall: bool,
    stats: PipelineStats,
    margins: Vec<f32>,    // (chunks_per_layer)
    h: Vec<f32>,          // (n_ff)
    partials: Vec<f32>,   // (n_parts, d_model)
    acts: QuantizedActs,  // (d_model) for Fast
    selected: Vec<usize>, // chunks of this layer to compute
}

impl MmapFfn {
    /// An `mmap`-mode FFN over `sm` choosing chunks with `selector`.
    pub fn new(sm: Arc<SparseModel>, selector: Selector, precision: Precision) -> MmapFfn {
        let l = &sm.layout;
        MmapFfn {
            margins: vec![0.0; l.chunks_per_layer],
            h: vec![0.0; l.n_ff],
            partials: vec![0.0; crate::backend::cpu::compute_threads().max(1) * l.d_model],
            acts: QuantizedActs::new(l.d_model),
            selected: Vec::with_capacity(l.chunks_per_layer),
            measure_recall: false,
            stats: PipelineStats::default(),
            selector,
            precision,
            sm,
        }
    }

    /// Counters since the last reset.
    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    /// Zeroes the counters.
    pub fn reset_stats(&mut self) {
        self.stats = PipelineStats::default();
    }
}

impl FfnExecutor for MmapFfn {
    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()> {
        let sm = &*self.sm;
        let layout = &sm.layout;
        if l == 0 {
            self.stats.tokens += 1;
        }
        let t = Instant::now();
        self.selector.margins(layout, l, xn, &mut self.margins);
        self.stats.predict_ns += t.elapsed().as_nanos() as u64;
        let activation = sm.model.weights.config.activation;
        if self.measure_recall {
            super::recall::count(
                layout,
                layer,
                activation,
                sm.thresholds[l],
                xn,
                &self.margins,
                &mut self.h,
                &mut self.stats,
            );
        }
        self.selected.clear();
        for (c, &m) in self.margins.iter().enumerate() {
            if m >= 0.0 {
                self.selected.push(c);
            }
        }
        self.stats.chunks_needed += self.selected.len() as u64;
        let fast = (self.precision == Precision::Fast).then(|| {
            self.acts.quantize(xn);
            &self.acts
        });
        let math = ChunkMath {
            layout,
            kernels: Kernels::best(),
            activation,
            threshold: sm.thresholds[l],
            fast,
        };
        let bytes = sm.file.as_slice();
        let bytes_of = |c: usize| {
            let off = layout.file_offset(layout.id(l, c)) as usize;
            &bytes[off..off + layout.chunk_bytes]
        };
        out.fill(0.0);
        let active = math.chunks(
            &self.selected,
            &bytes_of,
            xn,
            &mut self.h,
            &mut self.partials,
            out,
        );
        self.stats.active_neurons += active as u64;
        self.stats.computed_neurons += self
            .selected
            .iter()
            .map(|&c| layout.neurons(c).len() as u64)
            .sum::<u64>();
        Ok(())
    }
}
