//! Predictor recall, measured against the truth: the dense activations of every neuron of a layer
//! (from the memory-mapped weights; only in measurement passes, never while timing).

use super::stats::PipelineStats;
use crate::backend::cpu::Kernels;
use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, LayerWeights};

/// Counts the neurons of `layer` that are active for input `xn` under `threshold`, and how many
/// of them lie in chunks with a margin ≥ 0, into `stats`. `h` is scratch of `n_ff` values.
#[allow(clippy::too_many_arguments)]
pub fn count(
    layout: &ChunkLayout,
    layer: &LayerWeights,
    activation: FfnActivation,
    threshold: f32,
    xn: &[f32],
    margins: &[f32],
    h: &mut [f32],
    stats: &mut PipelineStats,
) {
    let k = Kernels::best();
    let (gate, up) = (&layer.ffn.gate, &layer.ffn.up);
    for (i, hi) in h.iter_mut().enumerate() {
        let g = k.dot(gate.dtype, gate.row(i), xn);
        let u = k.dot(up.dtype, up.row(i), xn);
        *hi = activation.apply(g) * u;
    }
    for (c, &m) in margins.iter().enumerate() {
        let active = h[layout.neurons(c)]
            .iter()
            .filter(|a| crate::sparsity::is_active(**a, threshold))
            .count() as u64;
        stats.truth_active += active;
        if m >= 0.0 {
            stats.truth_selected += active;
        }
    }
}
