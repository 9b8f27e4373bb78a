//! The sparse FFN pipelines over a `.lsm` file: the five modes of
//! `docs/bench/sparse.md`, all over the same file, predictor and cache budget so that comparisons
//! between them are fair.
//!
//! | mode | FFN weights come from | what decides the cache |
//! |---|---|---|
//! | `dense` | memory, all of them (the dense [`crate::forward::Session`] path) | — |
//! | `mmap` | the memory map; the OS page cache decides what stays | the kernel |
//! | `on-demand` | per layer: predict → read the missing chunks → wait → compute | LRU |
//! | `prefetch` | reads for the next layers issued early from one prediction, never revised | calibrated frequency |
//! | `leanstream` | speculate → refine: see [`streaming`] | refined priorities |
//!
//! Each sparse mode computes the chunks its [`select::Selector`] picks for the exact layer input
//! and zeroes activations below the calibrated threshold; they differ only in when they read,
//! what they keep, and in what order they compute.

mod decoder;
pub mod executor;
pub mod mmap;
mod recall;
pub mod select;
pub mod sparse_model;
pub mod stats;
pub mod streaming;

use std::fmt;
use std::str::FromStr;

pub use decoder::open_decoder;
pub use executor::{Executor, ExecutorOptions, WithFfn};
pub use select::{AllNeurons, NeuronScorer, Selector};
pub use sparse_model::SparseModel;
pub use stats::PipelineStats;
pub use streaming::{Policy, Retention, StreamingFfn};

/// How the FFN weights reach the compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    Dense,
    Mmap,
    OnDemand,
    Prefetch,
    LeanStream,
}

impl Mode {
    /// Every mode, in the order reports list them.
    pub const ALL: [Mode; 5] = [
        Mode::Dense,
        Mode::Mmap,
        Mode::OnDemand,
        Mode::Prefetch,
        Mode::LeanStream,
    ];

    /// The name used on the command line, in configs and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dense => "dense",
            Mode::Mmap => "mmap",
            Mode::OnDemand => "on-demand",
            Mode::Prefetch => "prefetch",
            Mode::LeanStream => "leanstream",
        }
    }

    /// True for the modes that stream chunks through the neuron cache.
    pub fn uses_cache(self) -> bool {
        matches!(self, Mode::OnDemand | Mode::Prefetch | Mode::LeanStream)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Mode::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mode `{s}` (one of {})", names.join(", "))
            })
    }
}
