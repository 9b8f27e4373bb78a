//! What an active FFN neuron is: the one definition calibration, the CPU and GPU chunk kernels
//! and recall measurement share (the CUDA kernel in `cuda-kernels/src/ffn.cu` spells the same
//! rule in C); and how well a score cut-off recovers the active neurons ([`cutoff_for_recall`],
//! [`RecallCounter`]), which calibration (setting and measuring the predictors' cut-offs) and the
//! synthetic model generator share.
//!
//! A leaf: it imports nothing from the crate, so the file format and the predictors can both use
//! it.

mod cutoff;

pub use cutoff::{RecallCounter, cutoff_for_recall};

/// Whether activation `a = act(gate·x) · (up·x)` counts at `threshold`: nonzero and at least
/// the threshold in magnitude. A threshold of 0 keeps every nonzero activation (sparsity off,
/// or a ReLU model's natural zeros).
#[inline]
pub fn is_active(a: f32, threshold: f32) -> bool {
    a != 0.0 && a.abs() >= threshold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_itself_is_active_and_zero_never_is() {
        assert!(is_active(0.5, 0.5));
        assert!(is_active(-0.5, 0.5));
        assert!(!is_active(0.49, 0.5));
        assert!(!is_active(0.0, 0.0));
        assert!(is_active(1e-30, 0.0));
    }
}
