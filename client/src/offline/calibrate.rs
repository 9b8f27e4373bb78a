//! `leanstream calibrate`: activation thresholds, neuron statistics and predictors for a `.lsm`
//! file, written into it (or into a copy).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use leanstream_engine::calibrate::{self, CalibrateOptions, Stage};
use leanstream_engine::predict::{HashingParams, LowRankParams};

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// The `.lsm` file to calibrate (see `leanstream convert`).
    pub model: PathBuf,
    /// Calibration text (UTF-8). Default: the built-in `data/text/calibration.txt`.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Target fraction of FFN activations below the per-layer thresholds, in [0, 1).
    #[arg(long, default_value_t = CalibrateOptions::default().sparsity)]
    pub sparsity: f32,
    /// Most calibration tokens.
    #[arg(long, default_value_t = CalibrateOptions::default().max_tokens)]
    pub tokens: usize,
    /// Held-out text for the measurements (UTF-8; must not overlap the calibration text).
    /// Default: the built-in `data/text/heldout-eval.txt`.
    #[arg(long)]
    pub eval_text: Option<PathBuf>,
    /// Most held-out tokens for the measurements.
    #[arg(long, default_value_t = CalibrateOptions::default().eval_tokens)]
    pub eval_tokens: usize,
    /// Keep the neuron order instead of sorting neurons by activation frequency. By default hot
    /// neurons share chunks and sit first in each layer, so a cache of hot chunks is one
    /// contiguous range and the misses read as large requests (see `docs/bench/sparse.md`).
    #[arg(long = "no-reorder", action = clap::ArgAction::SetFalse)]
    pub reorder: bool,
    /// Recall of active neurons the predictor cut-offs aim for.
    #[arg(long, default_value_t = CalibrateOptions::default().target_recall)]
    pub recall: f32,
    /// Rank of the low-rank predictor.
    #[arg(long, default_value_t = LowRankParams::default().rank)]
    pub rank: usize,
    /// Sign bits per stage of the hashing predictor.
    #[arg(long, default_value_t = HashingParams::default().bits)]
    pub hash_bits: usize,
    /// Stages of the hashing predictor.
    #[arg(long, default_value_t = HashingParams::default().stages)]
    pub hash_stages: usize,
    /// Output file (default: rewrite MODEL in place, atomically).
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(args: CalibrateArgs) -> anyhow::Result<()> {
    super::init_threads(args.threads)?;
    let (text, source) = match &args.text {
        Some(p) => {
            let t = std::fs::read_to_string(p)
                .with_context(|| format!("reading calibration text {}", p.display()))?;
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            (t, name.unwrap_or_default())
        }
        None => (
            calibrate::CALIBRATION_TEXT.to_string(),
            calibrate::BUILTIN_TEXT_SOURCE.to_string(),
        ),
    };
    let eval_text = match &args.eval_text {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading held-out text {}", p.display()))?,
        None => calibrate::HELDOUT_TEXT.to_string(),
    };
    let defaults = CalibrateOptions::default();
    let opts = CalibrateOptions {
        sparsity: args.sparsity,
        max_tokens: args.tokens,
        eval_tokens: args.eval_tokens,
        reorder: args.reorder,
        target_recall: args.recall,
        lowrank: LowRankParams { rank: args.rank },
        hashing: HashingParams {
            bits: args.hash_bits,
            stages: args.hash_stages,
            ..defaults.hashing
        },
        text_source: source,
        ..defaults
    };
    let dst = args.output.clone().unwrap_or_else(|| args.model.clone());
    let bar = ProgressBar::new(1).with_style(
        ProgressStyle::with_template("{msg:28} [{bar:30}] {pos}/{len} ({elapsed})")
            .map_err(anyhow::Error::msg)?
            .progress_chars("=> "),
    );
    let report = calibrate::calibrate(
        &args.model,
        &dst,
        &text,
        &eval_text,
        &opts,
        &mut |stage, done, total| {
            bar.set_message(match stage {
                Stage::Collect => "running the dense model",
                Stage::Train => "thresholds and predictors",
                Stage::Evaluate => "held-out perplexity",
                Stage::Write => "writing",
            });
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    )
    .with_context(|| format!("calibrating {}", args.model.display()))?;
    bar.finish_and_clear();

    let (d, t) = (&report.dense, &report.thresholded);
    println!(
        "calibrated on {} tokens at target sparsity {:.2}; wrote {} ({:.1} MiB)",
        report.calibration_tokens,
        opts.sparsity,
        dst.display(),
        report.file_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "held-out perplexity ({} tokens, exact): dense {:.3}, thresholded {:.3} ({:+.2} %), {:.1} % of activations zeroed",
        d.tokens,
        d.ppl(),
        t.ppl(),
        100.0 * (t.ppl() / d.ppl() - 1.0),
        100.0 * t.sparsity
    );
    println!(
        "{:<10} {:>8} {:>8} {:>12} {:>10}  params",
        "predictor", "recall", "fetch", "memory", "µs/layer"
    );
    for p in &report.predictors {
        let kind = p.kind.map(|k| k.to_string()).unwrap_or_default();
        let params = if p.rank > 0 {
            format!("rank {}", p.rank)
        } else {
            format!("{} stages x {} bits", p.stages, p.bits)
        };
        println!(
            "{kind:<10} {:>8.3} {:>8.3} {:>9.1} KiB {:>10.1}  {params}",
            p.heldout_recall,
            p.heldout_fetch_fraction,
            p.bytes as f64 / 1024.0,
            p.heldout_us_per_layer,
        );
    }
    println!(
        "(recall and fetch fraction on held-out text at cut-offs set for recall {:.2} on the calibration text)",
        opts.target_recall
    );
    for (kind, cost) in &report.quality_cost {
        let (lo, hi) = cost
            .iter()
            .fold((f32::INFINITY, 0f32), |(a, b), &c| (a.min(c), b.max(c)));
        let mean = cost.iter().sum::<f32>() / cost.len().max(1) as f32;
        println!(
            "{kind}: per-layer quality cost (relative RMS error of the FFN output run sparsely, \
             held-out) mean {mean:.3}, {lo:.3} to {hi:.3}; per-neuron selection probabilities \
             stored (`select.*`)"
        );
    }
    if let Some(r) = &report.reorder {
        println!(
            "reordering by frequency: chunks holding an active neuron per token-layer {:.2} -> {:.2} of {}",
            r.chunks_touched_before, r.chunks_touched_after, r.chunks_per_layer
        );
    }
    Ok(())
}
