//! `leanstream bench`: every mode over the same model file, predictor, prompts and cache
//! budgets, each run starting cold, with one row of figures per mode and budget.
//!
//! A run: drop the file's page cache and reset the peak-RSS counter; open the model afresh; for
//! each prompt, prefill it token by token, then decode greedily (timed, counted); then score the
//! held-out text teacher-forced, measuring perplexity and predictor recall (not timed, after the
//! peak RSS was taken, because recall reads every neuron's weights). `dense` runs first: it is
//! the reference for greedy agreement and perplexity. Before all runs, the disk's O_DIRECT
//! bandwidth is probed once on the model file ([`disk`]), the ceiling the I/O workers'
//! throughput during decode is compared with.

pub mod disk;
pub mod disk_curve;

pub mod report;
mod run;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::backend::cpu::Precision;
use crate::model::lsm::PredictorKind;
use crate::pipeline::Mode;

pub use run::run;

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub model: PathBuf,
    pub modes: Vec<Mode>,
    /// Neuron-cache sizes as fractions of the streamed FFN bytes (cache-backed modes run once per
    /// budget; `dense` and `mmap` once).
    pub budgets: Vec<f64>,
    /// Tokens decoded per prompt.
    pub tokens: usize,
    pub prompts: Vec<String>,
    /// Held-out text for perplexity and recall, and how many of its tokens to score.
    pub heldout: String,
    pub heldout_tokens: usize,
    pub predictor: PredictorKind,
    pub precision: Precision,
    pub io_threads: usize,
    /// Largest hole a merged read may bridge (`--io-gap`).
    pub io_gap_bytes: usize,
    /// Verify streamed chunks' checksums as they are read (off: `--no-verify-chunks`, to
    /// measure what the check costs).
    pub verify_chunks: bool,
    /// Also run LeanStream's ablation ladder at this budget.
    pub ablation_budget: Option<f64>,
    /// Measure the disk's O_DIRECT read bandwidth on the model file once, before the runs
    /// ([`disk::probe`] at queue depth `io_threads`), for `disk_busy_share` and
    /// `storage_bound_tok_s`. Skipped when no cache-backed mode runs.
    pub disk_probe: bool,
    /// Where the forward pass runs (resolved from `--backend`).
    pub backend: crate::backend::select::Backend,
}

/// One mode at one budget. Ratios are in 0..=1; `None` where a figure does not apply.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    pub mode: String,
    /// `cpu` or `cuda`.
    #[serde(default)]
    pub backend: String,
    /// Bytes of GPU memory the run held (weights, KV cache, cache twin); `None` on the CPU.
    #[serde(default)]
    pub device_bytes: Option<u64>,
    /// Cache size as a fraction of the streamed FFN bytes (`None` for dense and mmap).
    pub ffn_budget: Option<f64>,
    pub decode_tokens_per_s: f64,
    pub prefill_tokens_per_s: f64,
    pub peak_rss_bytes: u64,
    /// Bytes the process read from storage per decoded token.
    pub bytes_read_per_token: f64,
    pub cache_miss_ratio: Option<f64>,
    pub redundant_read_fraction: Option<f64>,
    pub io_wait_fraction: Option<f64>,
    pub predictor_recall: Option<f64>,
    /// Share of generated tokens equal to `dense` mode's at the same position.
    pub greedy_agreement: f64,
    /// Held-out perplexity relative to `dense`: `ppl / ppl_dense − 1`.
    pub nll_delta: f64,
    pub perplexity: f64,
    /// Bytes of the neuron cache (cache-backed modes).
    pub cache_bytes: Option<u64>,
    /// Share of FFN neurons computed per token.
    pub computed_fraction: Option<f64>,
    pub tokens_decoded: u64,
    /// Bytes the I/O workers read per second of decode wall time (cache-backed modes).
    #[serde(default)]
    pub io_bytes_per_s: Option<f64>,
    /// Bytes of needed chunks that were missing from the cache, per decoded token.
    #[serde(default)]
    pub missing_bytes_per_token: Option<f64>,
    /// The disk's measured O_DIRECT read bandwidth in bytes/s (one probe per bench run, the same
    /// in every row; see [`disk::probe`]).
    #[serde(default)]
    pub disk_bandwidth: Option<f64>,
    /// `io_bytes_per_s / disk_bandwidth`: how busy the workers kept the disk during decode.
    #[serde(default)]
    pub disk_busy_share: Option<f64>,
    /// `disk_bandwidth / missing_bytes_per_token`: the tokens/s at which reading the missing
    /// chunks alone would take all the time (none when nothing was missing).
    #[serde(default)]
    pub storage_bound_tok_s: Option<f64>,
}
