//! `leanstream synth`: writes a synthetic `.lsm` file with the shapes of a real model and seeded
//! random weights with planted activation statistics (see
//! `leanstream_engine::model::lsm::synth`), for scale runs of the streaming pipeline. It is not a
//! trained model: what it generates is meaningless text.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use leanstream_engine::calibrate::{self, ActivityOptions};
use leanstream_engine::model::lsm::synth::{self, SynthOptions, SynthShape, SynthTokenizer};
use leanstream_engine::quant::DType;

/// Leading positions the measurement leaves out: a context's first positions are the warm-up of
/// the planted token correlation (see `synth::carry`), so leave them out with or without it.
const MEASURE_SKIP: usize = 16;
/// Tokens measured by default when `--token-correlation` is set.
const DEFAULT_MEASURE_TOKENS: usize = 96;

/// The tokenizer used for the `llama-7b` shape when `--tokenizer-from` is not given.
const DEFAULT_DONOR: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Shape {
    /// Llama-2-7B: 32 layers, d 4096, FFN 11008, 32 heads, vocabulary 32000 (~4.5 GB with Q8_0
    /// down columns).
    #[value(name = "llama-7b")]
    Llama7b,
    /// SmolLM2-135M: 30 layers, d 576, FFN 1536, 9 heads / 3 KV heads, vocabulary 49152.
    #[value(name = "smollm2-135m")]
    Smollm2,
    /// 2 layers, d 128, FFN 512: for tests.
    Tiny,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum WeightType {
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DownType {
    #[value(name = "q8_0")]
    Q8_0,
    F16,
    #[value(name = "q5_0")]
    Q5_0,
    #[value(name = "q4_0")]
    Q4_0,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// The model shape to imitate.
    #[arg(long, value_enum, default_value = "llama-7b")]
    pub shape: Shape,
    /// Output `.lsm` path.
    #[arg(
        short = 'o',
        long = "output",
        required_unless_present = "save_tokenizer"
    )]
    pub dst: Option<PathBuf>,
    /// Seed of every random value.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Target share of inactive FFN activations, in (0, 1).
    #[arg(long, default_value_t = 0.4)]
    pub sparsity: f32,
    /// Hot/cold skew of the neurons' activation frequencies (probit spread; 0 = uniform).
    #[arg(long, default_value_t = 1.5)]
    pub skew: f32,
    /// Gate noise the predictor cannot see, relative to what it can: it sets how many neurons the
    /// predictor must fetch for its target recall. ~1.5 at --sparsity 0.5 and ~0.6 at 0.8 give a
    /// realistic over-fetch of about 1.5x the active neurons (docs/cli.md).
    #[arg(long, default_value_t = 0.25)]
    pub noise: f32,
    /// Target carry-over of active neurons from one token to the next (e.g. 0.8; real models
    /// show 0.8-0.85), planted through attention as an AR(1) residual stream; 0 keeps tokens
    /// independent (and the file as without the option).
    #[arg(long, default_value_t = 0.0)]
    pub token_correlation: f32,
    /// Tokens of the built-in held-out text to run through the written model (dense forward
    /// pass) to measure carry-over, sparsity and recall; 0 skips it. Default: 96 with
    /// --token-correlation, else 0. It loads the whole model into memory (llama-7b: 8.5 GB peak
    /// RSS, about a minute for 64 tokens).
    #[arg(long)]
    pub measure_tokens: Option<usize>,
    /// Rank of the planted gate subspace (= the low-rank predictor's rank); default 48, 16 for
    /// the tiny shape.
    #[arg(long)]
    pub rank: Option<usize>,
    /// Neurons per chunk; default 32, 8 for the tiny shape.
    #[arg(long)]
    pub chunk_neurons: Option<usize>,
    /// Storage type of the attention, embedding, output, gate and up matrices.
    #[arg(long, value_enum, default_value = "q4_0")]
    pub weight_type: WeightType,
    /// Storage type of the FFN down columns.
    #[arg(long, value_enum, default_value = "q8_0")]
    pub down_type: DownType,
    /// A GGUF or `.lsm` model whose tokenizer (and chat template) to borrow, cut to the shape's
    /// vocabulary, or a `.json` file written by `--save-tokenizer` (default for llama-7b and
    /// smollm2-135m: SmolLM2's, from models/; the tiny shape has its own).
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    /// Write the borrowed tokenizer to this JSON file (a few MiB, for `--tokenizer-from` on a
    /// machine without the donor model) instead of a model.
    #[arg(long, conflicts_with = "dst")]
    pub save_tokenizer: Option<PathBuf>,
}

fn donor(args: &SynthArgs) -> anyhow::Result<SynthTokenizer> {
    let path = match (&args.tokenizer_from, args.shape) {
        (Some(p), _) => p.clone(),
        (None, Shape::Tiny) => return Ok(SynthTokenizer::tiny()),
        (None, Shape::Llama7b | Shape::Smollm2) => PathBuf::from(DEFAULT_DONOR),
    };
    if !path.is_file() {
        anyhow::bail!(
            "no tokenizer donor at {} (run scripts/fetch-model, or pass --tokenizer-from MODEL)",
            path.display()
        );
    }
    if path.extension().is_some_and(|e| e == "json") {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        return serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a tokenizer saved by --save-tokenizer",
                path.display()
            )
        });
    }
    let (_, tokenizer, template) = leanstream_engine::model::load(&path)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    Ok(SynthTokenizer::from_tokenizer(
        &tokenizer,
        template,
        name.into_owned(),
    )?)
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    let tokenizer = donor(&args)?;
    if let Some(path) = &args.save_tokenizer {
        let json = serde_json::to_string(&tokenizer)?;
        std::fs::write(path, &json).with_context(|| format!("writing {}", path.display()))?;
        println!(
            "wrote the tokenizer of {} to {} ({:.1} MiB)",
            tokenizer.source,
            path.display(),
            json.len() as f64 / (1 << 20) as f64
        );
        return Ok(());
    }
    let Some(dst) = &args.dst else {
        anyhow::bail!("synth needs --output (or --save-tokenizer)");
    };
    let shape = match args.shape {
        Shape::Llama7b => SynthShape::LLAMA_7B,
        Shape::Smollm2 => SynthShape::SMOLLM2_135M,
        Shape::Tiny => SynthShape::TINY,
    };
    let mut opts = SynthOptions::new(shape);
    opts.seed = args.seed;
    opts.sparsity = args.sparsity;
    opts.skew = args.skew;
    opts.noise = args.noise;
    opts.token_correlation = args.token_correlation;
    opts.rank = args.rank.unwrap_or(opts.rank);
    opts.chunk_neurons = args.chunk_neurons.unwrap_or(opts.chunk_neurons);
    opts.weight_dtype = match args.weight_type {
        WeightType::Q4_0 => DType::Q4_0,
        WeightType::Q4_1 => DType::Q4_1,
    };
    opts.down_dtype = match args.down_type {
        DownType::Q8_0 => DType::Q8_0,
        DownType::F16 => DType::F16,
        DownType::Q5_0 => DType::Q5_0,
        DownType::Q4_0 => DType::Q4_0,
    };
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {elapsed}, eta {eta})",
        )
        .map_err(anyhow::Error::msg)?
        .progress_chars("=> "),
    );
    bar.set_message("writing synthetic weights");
    let t = Instant::now();
    let mut report = synth::synthesize(dst, &opts, &tokenizer, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    let written = t.elapsed();
    let measure_tokens = args
        .measure_tokens
        .unwrap_or(if opts.token_correlation > 0.0 {
            DEFAULT_MEASURE_TOKENS
        } else {
            0
        });
    if measure_tokens > 0 {
        let m = Instant::now();
        eprintln!(
            "measuring: dense forward pass over {measure_tokens} tokens of the held-out text..."
        );
        let activity = calibrate::measure_activity(
            dst,
            calibrate::HELDOUT_TEXT,
            &ActivityOptions {
                max_tokens: measure_tokens,
                skip: MEASURE_SKIP.min(measure_tokens.saturating_sub(2)),
                ..ActivityOptions::default()
            },
        )
        .with_context(|| format!("measuring {}", dst.display()))?;
        eprintln!("measured in {:.0} s", m.elapsed().as_secs_f64());
        report.measured = Some(activity.to_synth());
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "wrote {} in {:.0} s: {:.1} MiB (resident {:.1} MiB, streamed {:.1} MiB in {} B chunks, \
         calibration {:.1} MiB)",
        dst.display(),
        written.as_secs_f64(),
        mib(report.file_bytes),
        mib(report.resident_bytes),
        mib(report.streamed_bytes),
        report.chunk_bytes,
        mib(report.calibration_bytes),
    );
    println!(
        "SYNTHETIC: seeded random weights (seed {}) with planted activation statistics, not a \
         trained model; tokenizer: {} ({} ids)",
        opts.seed, tokenizer.source, report.tokenizer_vocab
    );
    println!(
        "planted: sparsity {:.2} (simulated {:.3}), skew {}, gate noise {} (effective with Q4 \
         rounding {:.3}); low-rank predictor rank {}: simulated recall {:.3} at fetch fraction \
         {:.3}",
        opts.sparsity,
        report.sim_sparsity,
        opts.skew,
        opts.noise,
        report.effective_noise,
        opts.rank,
        report.sim_recall,
        report.sim_fetch_fraction,
    );
    if report.correlated_layers > 0 {
        println!(
            "carry-over of active neurons between consecutive tokens, expected: {:.3} planted \
             (AR(1) residual stream, lag-1 correlation {:.3}; the attention of the first {} \
             layer(s) transforms {} directions each), {:.3} for independent tokens",
            report.planned_carry_over,
            report.token_correlation,
            report.correlated_layers,
            report.directions_per_layer,
            report.carry_over
        );
    } else {
        println!(
            "carry-over of active neurons between consecutive tokens, expected: {:.3} \
             (independent tokens)",
            report.carry_over
        );
    }
    if let Some(m) = &report.measured {
        let by_layer: Vec<String> = m
            .carry_over_by_layer
            .iter()
            .map(|c| format!("{c:.2}"))
            .collect();
        println!(
            "measured (dense forward pass, {} tokens, the first {} left out): carry-over {:.3} \
             (independent tokens with these frequencies: {:.3}; by layer {}), sparsity {:.3}, \
             low-rank predictor recall {:.3} at fetch fraction {:.3}",
            m.tokens,
            m.skipped,
            m.carry_over,
            m.independent_carry_over,
            by_layer.join(" "),
            m.sparsity,
            m.recall,
            m.fetch_fraction
        );
    }
    Ok(())
}
