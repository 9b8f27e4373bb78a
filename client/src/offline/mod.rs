//! Offline subcommands: the engine runs inside this process.

pub mod bench;
pub mod calibrate;
pub mod capped;
pub mod convert;
pub mod export_gguf;
pub mod perplexity;
pub mod plan;
pub mod run;
pub mod synth;

use clap::ValueEnum;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::backend::select::{self, Backend, BackendChoice};

/// Activation precision of the quantised dot products (see `docs/bench/precision.md`).
#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum PrecisionArg {
    /// f32 activations over dequantised weights: within ~1e-3 of an f32 reference.
    #[default]
    Exact,
    /// 8-bit activations with integer dot products (llama.cpp style): faster, ~0.1 logit error.
    Fast,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Precision {
        match p {
            PrecisionArg::Exact => Precision::Exact,
            PrecisionArg::Fast => Precision::Fast,
        }
    }
}

/// The context a run under `--memory-budget` plans for when `--context` is not given: its KV
/// cache is part of the floor, so planning for the model's whole context would waste the budget.
pub const PLANNED_CONTEXT: usize = 512;

/// Parses a byte size for clap (`60MB`, `64MiB`, `1.5G`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    leanstream_engine::plan::parse_bytes(s)
}

/// Sets the size of the compute thread pool (0 = one per core).
pub fn init_threads(threads: usize) -> anyhow::Result<()> {
    if threads > 0 {
        rayon_pool(threads)?;
    }
    Ok(())
}

fn rayon_pool(threads: usize) -> anyhow::Result<()> {
    leanstream_engine::set_compute_threads(threads).map_err(anyhow::Error::msg)
}

/// Resolves `--backend` (`auto` probes for a GPU) and says on stderr which backend runs and why.
pub fn resolve_backend(choice: BackendChoice) -> anyhow::Result<Backend> {
    let (backend, why) = choice.resolve_with(select::cuda_available)?;
    eprintln!("compute backend: {} ({why})", backend.name());
    Ok(backend)
}
