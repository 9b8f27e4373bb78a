//! `leanstream perplexity`: teacher-forced mean negative log-likelihood of a text file.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use leanstream_engine::backend::select::Backend;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::score;
use leanstream_engine::kv::KvType;
use serde_json::json;

use super::PrecisionArg;

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// A GGUF file, a Hugging Face safetensors directory or a `.lsm` file.
    #[arg(long)]
    pub model: PathBuf,
    /// UTF-8 text to score.
    #[arg(long)]
    pub file: PathBuf,
    /// The text is scored in consecutive windows of this many tokens, each from an empty
    /// context; the first token of a window is not predicted.
    #[arg(long, default_value_t = 512)]
    pub window: usize,
    #[arg(long, value_enum, default_value_t)]
    pub precision: PrecisionArg,
    /// Element type of the KV cache: f16 (default), f32 or q8_0.
    #[arg(long, default_value_t = KvType::default())]
    pub kv_type: KvType,
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
    /// Score at most this many tokens of the file (0 = all of it).
    #[arg(long, default_value_t = 0)]
    pub tokens: usize,
    /// Run inside this many bytes (e.g. `60MB`): the memory planner streams what does not fit,
    /// as for `run --memory-budget`; planned for one session of `--window` tokens.
    #[arg(long, value_parser = super::parse_size)]
    pub memory_budget: Option<u64>,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    super::init_threads(args.threads)?;
    let text =
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let text = String::from_utf8(text)
        .map_err(|e| anyhow::anyhow!("{}: not UTF-8 text ({e})", args.file.display()))?;
    let model = match args.memory_budget {
        // Dense: the held-out score is of the file's weights, whatever a sparse plan would skip.
        Some(b) => Model::load_within_placed(
            &args.model,
            b,
            args.window.max(2),
            args.kv_type,
            leanstream_engine::plan::PlacementPolicy::Dense,
        )?,
        None => Model::load_for(&args.model, args.precision.into(), Backend::Cpu)?,
    };
    let mut ids = model.tokenizer.encode(&text)?;
    if args.tokens > 0 {
        ids.truncate(args.tokens);
    }
    if ids.len() < 2 {
        anyhow::bail!(
            "{}: needs at least 2 tokens to score, has {}",
            args.file.display(),
            ids.len()
        );
    }
    let window = args.window.clamp(2, model.weights.config.context_length);
    let mut session = Session::new(model.clone(), window, args.precision.into(), args.kv_type)?;
    let (mut nll, mut n) = (0.0, 0);
    for chunk in ids.chunks(window) {
        session.reset();
        let (sum, count) = score(&mut session, chunk)?;
        nll += sum;
        n += count;
    }
    let mean = nll / n as f64;
    if args.json {
        let kv = args.kv_type.name();
        println!(
            "{}",
            json!({"tokens": n, "nll": mean, "ppl": mean.exp(), "kv_type": kv,
                   "session_bytes": session.bytes()})
        );
    } else {
        println!(
            "{n} tokens scored: mean NLL {mean:.4} nats, perplexity {:.3} ({} KV cache, {} session bytes)",
            mean.exp(),
            args.kv_type,
            session.bytes()
        );
    }
    Ok(())
}
