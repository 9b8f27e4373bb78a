//! `leanstream bench`: every pipeline mode over one `.lsm` file at several neuron-cache budgets,
//! printed as a table, optionally written as JSON rows and an SVG plot.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use leanstream_engine::backend::select::BackendChoice;
use leanstream_engine::bench::{self, BenchConfig, report};
use leanstream_engine::model::lsm::PredictorKind;
use leanstream_engine::pipeline::Mode;

use super::PrecisionArg;
use super::capped;

/// The prompts used when `--prompts` is not given (one per line).
const DEFAULT_PROMPTS: &str = include_str!("../../../data/prompts/bench.txt");
/// The held-out text used when `--heldout` is not given.
const DEFAULT_HELDOUT: &str = include_str!("../../../data/text/heldout-eval.txt");

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A calibrated `.lsm` file (see `leanstream calibrate`).
    #[arg(long)]
    pub model: PathBuf,
    /// Comma-separated modes: dense, mmap, on-demand, prefetch, leanstream.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "dense,mmap,on-demand,prefetch,leanstream"
    )]
    pub modes: Vec<Mode>,
    /// Comma-separated neuron-cache sizes as percentages of the streamed FFN bytes.
    #[arg(long, value_delimiter = ',', default_value = "5%,10%,20%,25%,50%", value_parser = parse_percent)]
    pub ffn_budget: Vec<f64>,
    /// Tokens to decode per prompt.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// A text file with one prompt per line (default: the set shipped with LeanStream).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Held-out text for perplexity and predictor recall (default: the shipped evaluation text).
    #[arg(long)]
    pub heldout: Option<PathBuf>,
    /// Held-out tokens to score per run.
    #[arg(long, default_value_t = 256)]
    pub heldout_tokens: usize,
    /// The predictor choosing which chunks to compute.
    #[arg(long, default_value = "lowrank", value_parser = parse_predictor)]
    pub predictor: PredictorKind,
    #[arg(long, value_enum, default_value_t)]
    pub precision: PrecisionArg,
    /// I/O worker threads of the cache-backed modes.
    #[arg(long, default_value_t = 4)]
    pub io_threads: usize,
    /// Largest hole (bytes) a merged read may bridge; 0 merges only
    /// adjacent chunks.
    #[arg(long, default_value_t = leanstream_engine::io::DEFAULT_MAX_GAP_BYTES)]
    pub io_gap: usize,
    /// Do not verify streamed chunks against their checksums (only to measure what the check
    /// costs: a corrupted file then gives wrong tokens silently).
    #[arg(long)]
    pub no_verify_chunks: bool,
    /// Also run the ablation of LeanStream's refinements at this budget (e.g. 20%).
    #[arg(long, value_parser = parse_percent)]
    pub ablation: Option<f64>,
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Skip the disk bandwidth probe (by default the model file's O_DIRECT read bandwidth is
    /// measured once, up to 2 GiB or 4 s, when a cache-backed mode runs).
    #[arg(long)]
    pub no_disk_probe: bool,
    /// Where the forward pass runs: auto (CUDA when built with it and a GPU is present), cpu
    /// or cuda.
    #[arg(long, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG plot of tokens/s and miss ratio against the budget here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Run the capped bench instead: each engine in its own memory cgroup capped at each of
    /// these (percentages of the GGUF's size, or sizes like `60MB`), page cache dropped first.
    /// `--model` may then be a GGUF or a `.lsm` file. Needs root.
    #[arg(long, value_delimiter = ',', value_parser = capped::parse_cap)]
    pub memory_cap: Vec<capped::Cap>,
    /// The GGUF llama.cpp runs and cap percentages refer to (default: `--model`).
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// A llama.cpp build (its directory or `bin/`) to run on the same GGUF, prompts and caps
    /// (`scripts/build-llama` makes one).
    #[arg(long)]
    pub peer_llama: Option<PathBuf>,
    /// Capped bench: LeanStream's rows at each cap: `unified` (placement auto), `unified-nospec`
    /// (placement auto, `--speculate off`), `planned-dense` (placement dense), or a sparse policy
    /// of the FFN layers streamed by neuron (`on-demand`, `prefetch`, `leanstream`, or an
    /// ablation step: `serial`, `overlapped`, `refined-load`, `refined-retention`). All but
    /// `unified-nospec` run with speculative decoding `auto`.
    #[arg(long, value_delimiter = ',', default_value = "unified,planned-dense", value_parser = capped::parse_engine)]
    pub engines: Vec<capped::Engine>,
    /// Capped bench: runs of every row, interleaved; tables show the median run.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Capped bench: prompts per row (the first N of the prompt set).
    #[arg(long, default_value_t = 3)]
    pub capped_prompts: usize,
    /// Capped bench: context of every run (llama.cpp's `-c`).
    #[arg(long, default_value_t = 256)]
    pub context: usize,
    /// Capped bench: a child running longer than this many seconds is killed (`timeout`).
    #[arg(long, default_value_t = 300)]
    pub row_timeout: u64,
}

/// Parses `20%`, `20` (both percent) or `0.2` (a fraction).
fn parse_percent(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, percent) = match t.strip_suffix('%') {
        Some(n) => (n, true),
        None => (t, false),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a percentage"))?;
    let f = if percent || v > 1.0 { v / 100.0 } else { v };
    if !(f > 0.0 && f <= 1.0) {
        return Err(format!("`{s}` is outside (0 %, 100 %]"));
    }
    Ok(f)
}

fn parse_predictor(s: &str) -> Result<PredictorKind, String> {
    PredictorKind::ALL
        .into_iter()
        .find(|k| k.name() == s)
        .ok_or_else(|| format!("unknown predictor `{s}` (lowrank or hashing)"))
}

fn read_text(path: &PathBuf) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{}: not UTF-8 text ({e})", path.display()))
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    super::init_threads(args.threads)?;
    let prompts = match &args.prompts {
        Some(p) => read_text(p)?,
        None => DEFAULT_PROMPTS.to_string(),
    };
    let prompts: Vec<String> = prompts
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if prompts.is_empty() {
        anyhow::bail!("no prompts: the prompt file has no non-empty lines");
    }
    if !args.memory_cap.is_empty() {
        return run_capped(&args, prompts);
    }
    let heldout = match &args.heldout {
        Some(p) => read_text(p)?,
        None => DEFAULT_HELDOUT.to_string(),
    };
    let cfg = BenchConfig {
        model: args.model.clone(),
        modes: args.modes.clone(),
        budgets: args.ffn_budget.clone(),
        tokens: args.tokens.max(2),
        prompts,
        heldout,
        heldout_tokens: args.heldout_tokens.max(2),
        predictor: args.predictor,
        precision: args.precision.into(),
        io_threads: args.io_threads,
        io_gap_bytes: args.io_gap,
        verify_chunks: !args.no_verify_chunks,
        ablation_budget: args.ablation,
        disk_probe: !args.no_disk_probe,
        backend: super::resolve_backend(args.backend)?,
    };
    let runs = cfg.modes.iter().filter(|m| !m.uses_cache()).count()
        + cfg.modes.iter().filter(|m| m.uses_cache()).count() * cfg.budgets.len()
        + if cfg.ablation_budget.is_some() { 4 } else { 0 }
        + usize::from(cfg.disk_probe)
        + 1;
    let bar = indicatif::ProgressBar::new(runs as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            .expect("static template"),
    );
    let rows = bench::run(&cfg, &mut |what| {
        if !bar.message().is_empty() {
            bar.inc(1);
        }
        bar.set_message(what.to_string());
    })?;
    bar.finish_and_clear();
    print!("{}", report::table(&rows));
    if let Some(bw) = rows.iter().find_map(|r| r.disk_bandwidth) {
        println!(
            "disk: {:.0} MB/s measured with in-order O_DIRECT reads of 1 MiB at queue depth {} on {}; \
             disk busy = io MB/s / disk MB/s during decode; bound tok/s = disk MB/s / bytes \
             missing from the cache per token (miss/tok)",
            bw / 1e6,
            cfg.io_threads.max(1),
            args.model.display()
        );
    }
    let title = format!(
        "{} — decode tokens/s and cache miss ratio",
        file_name(&args.model)
    );
    write_outputs(&args, || report::json(&rows), || report::svg(&rows, &title))
}

/// Writes `--json` and `--plot` where asked.
fn write_outputs(
    args: &BenchArgs,
    json: impl FnOnce() -> String,
    svg: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    let write = |path: &PathBuf, text: String| {
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    };
    if let Some(path) = &args.json {
        write(path, json())?;
    }
    if let Some(path) = &args.plot {
        write(path, svg())?;
    }
    Ok(())
}

/// `--memory-cap`: the capped bench (see [`capped`]).
fn run_capped(args: &BenchArgs, prompts: Vec<String>) -> anyhow::Result<()> {
    let gguf = args.gguf.clone().unwrap_or_else(|| args.model.clone());
    let disk_probe = (!args.no_disk_probe).then(|| capped::DiskProbe {
        path: args.model.clone(),
        options: leanstream_engine::bench::disk::ProbeOptions {
            queue_depth: leanstream_engine::stream::READERS,
            block_bytes: 512 << 10,
            ..Default::default()
        },
    });
    // The children read the held-out text from a file: the one given, or the shipped one.
    let shipped =
        std::env::temp_dir().join(format!("leanstream-heldout-{}.txt", std::process::id()));
    let heldout = match &args.heldout {
        Some(p) => p.clone(),
        None => {
            std::fs::write(&shipped, DEFAULT_HELDOUT)
                .with_context(|| format!("writing {}", shipped.display()))?;
            shipped.clone()
        }
    };
    let cfg = capped::CappedConfig {
        model: args.model.clone(),
        gguf,
        caps: args.memory_cap.clone(),
        engines: args.engines.clone(),
        runs: args.runs,
        prompts: prompts
            .into_iter()
            .take(args.capped_prompts.max(1))
            .collect(),
        tokens: args.tokens.max(2),
        context: args.context,
        threads: args.threads,
        peer_llama: args.peer_llama.clone(),
        row_timeout: std::time::Duration::from_secs(args.row_timeout),
        disk_probe,
        heldout,
        heldout_tokens: args.heldout_tokens,
    };
    let rows = capped::run(&cfg, &mut |what| eprintln!("{what}"));
    let _ = std::fs::remove_file(&shipped);
    let rows = rows?;
    print!("{}", capped::table(&rows));
    print!("{}", capped::floors(&rows));
    if let Some(d) = &cfg.disk_probe {
        println!(
            "disk MB/s: probed before each LeanStream row (O_DIRECT, 512 KiB reads, {} in flight, on {}); plan bound tok/s = disk MB/s / plan read/tok",
            d.options.queue_depth,
            args.model.display()
        );
    }
    let title = format!(
        "{} — decode tokens/s under a memory cap",
        file_name(&cfg.gguf)
    );
    write_outputs(args, || capped::json(&rows), || capped::svg(&rows, &title))
}

fn file_name(p: &std::path::Path) -> String {
    p.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}
