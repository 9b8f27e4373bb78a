//! `leanstream run`: load a model in-process and generate, streaming text to stdout.

use std::io::Write;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use leanstream_engine::backend::select::BackendChoice;
use leanstream_engine::chat::{ChatMessage, ChatTemplate};
use leanstream_engine::constrain::{ConstraintVocab, Grammar, GrammarKind};

use leanstream_engine::forward::Model;
use leanstream_engine::generate::speculate::{DraftKind, MAX_DRAFT};
use leanstream_engine::generate::{
    Decode, SpeculateMode, generate, generate_constrained, speculation_for,
};
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::{Executor, Policy, WithFfn, open_decoder};
use leanstream_engine::plan::PlacementPolicy;
use leanstream_engine::sample::SamplerConfig;
use leanstream_engine::tokenizer::{TextStream, Tokenizer};
use serde_json::json;

use super::PrecisionArg;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A GGUF file, a Hugging Face safetensors directory or a `.lsm` file.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text. Special tokens written in it (e.g. `<|im_start|>`) are recognised.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate (generation also stops at end-of-sequence).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Generate exactly `--max-tokens` tokens: end-of-sequence does not stop the generation
    /// (for benchmarks, so every run times the same number of decode passes, as llama-bench's
    /// `-n` does).
    #[arg(long, conflicts_with_all = ["json_schema", "grammar"])]
    pub ignore_eos: bool,
    /// Cut or repeat the prompt to exactly N tokens: its text is repeated (space-separated)
    /// until it tokenises to at least N, then the ids are cut to N (for benchmarks, so the
    /// prefill runs the same length on every tokenizer, as llama-bench's `-p N` does).
    #[arg(long, value_name = "N")]
    pub prompt_tokens: Option<NonZeroUsize>,
    /// Before the timed generation, run the prompt and one decode pass untimed, then rewind the
    /// session to empty (for benchmarks: threads started, weights and code in cache, as after
    /// llama-bench's warm-up run). The `stream` and `sparse` byte counters of `--json` include
    /// it.
    #[arg(long)]
    pub warmup: bool,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling cut (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// KV cache size in tokens (default: the model's context length, at most 4096).
    #[arg(long)]
    pub context: Option<usize>,
    #[arg(long, value_enum, default_value_t)]
    pub precision: PrecisionArg,
    /// Element type of the KV cache: f16 (default), f32 or q8_0.
    #[arg(long, default_value_t = KvType::default())]
    pub kv_type: KvType,
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Where the forward pass runs: auto (CUDA when built with it and a GPU is present), cpu
    /// or cuda.
    #[arg(long, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Run inside this many bytes (e.g. `60MB`, `64MiB`): the memory planner keeps what fits and
    /// streams the other weights from storage every token (`leanstream plan` shows the plan).
    #[arg(long, value_parser = super::parse_size)]
    pub memory_budget: Option<u64>,
    /// With `--memory-budget`: `auto` lets the plan stream FFN layers of a calibrated `.lsm` by
    /// neuron where that reads faster than dense; `dense` never does.
    #[arg(long, default_value_t = PlacementPolicy::Auto, requires = "memory_budget")]
    pub placement: PlacementPolicy,
    /// How the FFN layers a plan streams by neuron are read, computed and cached: `leanstream`
    /// (speculate and refine), the presets `on-demand` and `prefetch`, or a step of the
    /// ablation (`serial`, `overlapped`, `refined-load`, `refined-retention`).
    #[arg(long, default_value = "leanstream", value_parser = Policy::named)]
    pub sparse_policy: Policy,
    /// Constrain the output to the JSON Schema in FILE: the text is one line of JSON that
    /// validates against it (unless `--max-tokens` cuts it short, which is reported).
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<PathBuf>,
    /// Constrain the output to the grammar in FILE (llguidance's Lark dialect).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    /// Speculative decoding: `auto` drafts tokens (a grammar's forced text, n-grams of the
    /// context) and verifies them in one pass where measured acceptance pays for the extra
    /// rows; `off` runs one pass per token. The output is the same either way.
    #[arg(long, default_value = "auto", value_parser = parse_speculate)]
    pub speculate: SpeculateMode,
}

/// `auto` or `off`, for `--speculate`.
pub fn parse_speculate(s: &str) -> Result<SpeculateMode, String> {
    SpeculateMode::parse(s).ok_or_else(|| format!("{s:?} is not auto or off"))
}

/// The grammar `--json-schema` or `--grammar` names, compiled for `model`'s vocabulary.
fn load_grammar(args: &RunArgs, model: &Model) -> anyhow::Result<Option<Grammar>> {
    let (path, kind) = match (&args.json_schema, &args.grammar) {
        (Some(p), _) => (p, GrammarKind::JsonSchema),
        (None, Some(p)) => (p, GrammarKind::Lark),
        (None, None) => return Ok(None),
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let vocab = ConstraintVocab::new(&model.tokenizer)?;
    let grammar =
        Grammar::new(&vocab, kind, &text).with_context(|| format!("in {}", path.display()))?;
    Ok(Some(grammar))
}

/// Renders `prompt` as a single user turn with the model's template (or its fallback).
pub fn chat_prompt(model: &Model, prompt: &str) -> anyhow::Result<String> {
    let template = ChatTemplate::for_model(model.chat_template.as_deref(), &model.tokenizer)?;
    let messages = [ChatMessage {
        role: "user".into(),
        content: prompt.into(),
    }];
    Ok(template.render(&messages, true)?)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    super::init_threads(args.threads)?;
    // Read before the model is loaded: summarising parses the file's header again (for a
    // 262k-token vocabulary, ~9 MiB of metadata), which must not land on top of a model that
    // fills its `--memory-budget`.
    let quantization = args
        .json
        .then(|| leanstream_engine::model::summarize(&args.model).ok())
        .flatten()
        .map(|s| s.quantization);
    let backend = super::resolve_backend(args.backend)?;
    let model = match args.memory_budget {
        Some(budget) => {
            let context = args.context.unwrap_or(super::PLANNED_CONTEXT);
            let m = Model::load_within_placed(
                &args.model,
                budget,
                context,
                args.kv_type,
                args.placement,
            )?;
            if let Some(plan) = m.plan().filter(|_| !args.json) {
                eprint!("{}", plan.table());
            }
            m
        }
        None => Model::load_for(&args.model, args.precision.into(), backend)?,
    };
    let text = if args.chat {
        chat_prompt(&model, &args.prompt)?
    } else {
        args.prompt.clone()
    };
    let prompt_ids = match args.prompt_tokens {
        Some(n) => prompt_of_length(&model.tokenizer, &text, n.get())?,
        None => model.tokenizer.encode(&text)?,
    };
    // A context given is checked by the session; the default is clipped to the model's.
    let context = args.context.unwrap_or_else(|| {
        let default = if args.memory_budget.is_some() {
            super::PLANNED_CONTEXT
        } else {
            4096
        };
        default.min(model.weights.config.context_length)
    });
    // A plan that streams FFN layers by neuron runs them through its sparse executor.
    let mut exec = Executor::for_plan(&model, args.sparse_policy, 4, args.precision.into())?;
    let decoder = open_decoder(
        backend,
        &model,
        context,
        args.precision.into(),
        args.kv_type,
        exec.as_mut(),
    )?;
    let (mut sparse, mut dense) = match exec {
        Some(exec) => (Some(WithFfn { decoder, exec }), None),
        None => (None, Some(decoder)),
    };
    let session: &mut dyn Decode = match (&mut sparse, &mut dense) {
        (Some(s), _) => s,
        (None, Some(d)) => d.as_mut(),
        (None, None) => unreachable!("one of the two was built"),
    };
    let sampler = SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..Default::default()
    };
    if args.warmup {
        warm_up(session, &prompt_ids, &sampler)?;
    }
    let setup = Instant::now();
    let grammar = load_grammar(&args, &model)?;
    let mut constraint = grammar.as_ref().map(Grammar::start);
    let constraint_setup = setup.elapsed();
    let eos = model.tokenizer.specials().eos.clone();
    let stop_ids: &[u32] = if args.ignore_eos { &[] } else { &eos };
    let mut stream = TextStream::default();
    let mut stdout = std::io::stdout().lock();
    let mut failure = None;
    // Bytes the dense stream had read when the first token came out of the prefill: what it
    // reads after that is decode's.
    let stream_bytes = || {
        model
            .stream_counters()
            .map_or(0, |s| s.bytes_read + s.row_bytes_read)
    };
    let mut after_prefill = None;
    let generation = generate_constrained(
        &mut *session,
        &prompt_ids,
        args.max_tokens,
        &sampler,
        stop_ids,
        constraint.as_mut(),
        speculation_for(&model, args.speculate, MAX_DRAFT),
        |id| {
            after_prefill.get_or_insert_with(stream_bytes);
            // The end-of-generation token is not part of the text (as in the daemon's stream).
            if args.json || eos.contains(&id) {
                return true;
            }
            let piece = stream
                .push(&model.tokenizer, id)
                .map(|p| p.map(|s| stdout.write_all(s.as_bytes()).and_then(|_| stdout.flush())));
            match piece {
                Ok(Some(Err(e))) => failure = Some(anyhow::Error::from(e)),
                Err(e) => failure = Some(e.into()),
                _ => {}
            }
            failure.is_none()
        },
    )
    .with_context(|| format!("generating with {}", args.model.display()))?;
    if let Some(e) = failure {
        return Err(e);
    }
    let stats = &generation.stats;
    let peak = leanstream_engine::process::peak_rss_bytes();
    let session_bytes = session.bytes();
    let decode_passes = stats.generated_tokens.saturating_sub(1).max(1) as f64;
    let stream_per_token =
        stream_bytes().saturating_sub(after_prefill.unwrap_or(0)) as f64 / decode_passes;
    // The sparse layers run token by token in the prefill too: their reads per token are
    // averaged over every token they saw.
    let sparse_per_token = sparse.as_ref().map_or(0.0, |s| {
        let p = s.exec.stats();
        p.bytes_read as f64 / p.tokens.max(1) as f64
    });
    // Whether the constrained text is whole (`None` without a constraint).
    let complete = constraint.as_mut().map(|c| c.is_complete());
    if complete == Some(false) && !args.json {
        eprintln!(
            "warning: stopped ({:?}) before the grammar was complete",
            generation.stop
        );
    }
    if args.json {
        let out = json!({
            "prompt_ids": prompt_ids,
            "ids": generation.ids,
            "text": model.tokenizer.decode(text_ids(&generation.ids, &eos))?,
            "stop_reason": generation.stop.name(),
            "constraint": grammar.as_ref().map(|g| json!({
                "kind": g.kind().to_string(),
                "complete": complete,
                "setup_s": constraint_setup.as_secs_f64(),
                "mask_s_per_token": stats.constraint.as_secs_f64()
                    / stats.generated_tokens.max(1) as f64,
            })),
            "quantization": quantization,
            "stats": {
                "prefill_tokens_per_s": stats.prefill_tokens_per_s(),
                "decode_tokens_per_s": stats.decode_tokens_per_s(),
                "peak_rss_bytes": peak,
                "weight_bytes_per_token": model.weights.dense_bytes_per_token(),
                "prompt_tokens": stats.prompt_tokens,
                "generated_tokens": stats.generated_tokens,
                "precision": format!("{:?}", args.precision).to_lowercase(),
                "kv_type": args.kv_type.name(),
                "session_bytes": session_bytes,
                "backend": backend.name(),
                "kernel": leanstream_engine::backend::cpu::kernel_name(),
            },
            "plan": model.plan().map(|p| json!({
                "budget_bytes": p.budget,
                "planned_bytes": p.planned_bytes(),
                "floor_bytes": p.floor.total(),
                "floor": p.floor,
                "resident_weight_bytes": p.resident_bytes,
                "streamed_bytes_per_token": p.streamed_bytes_per_token(),
                "read_bytes_per_token": p.read_bytes_per_token(),
                "streamed_layers": p.layers.iter().filter(|l| **l == leanstream_engine::plan::Placement::Streamed).count(),
                "head": format!("{:?}", p.head).to_lowercase(),
                "head_resident_rows": p.head_resident_rows,
                "sparse_layers": p.sparse_ffn.iter().filter(|s| **s).count(),
                "sparse_bytes_per_token": p.sparse_bytes_per_token,
                "cache_bytes": p.floor.cache,
            })),
            "speculation": {
                "mode": args.speculate.name(),
                "on": stats.speculation.is_some(),
                "tokens_per_pass": stats.speculation.as_ref().map_or(1.0, |s| s.tokens_per_pass()),
                "passes": stats.speculation.as_ref().map(|s| s.passes),
                "verify_passes": stats.speculation.as_ref().map(|s| s.verify_passes),
                "drafts": DraftKind::ALL.map(|k| json!({
                    "kind": k.name(),
                    "drafted": stats.speculation.as_ref().map_or(0, |s| s.drafted[k as usize]),
                    "accepted": stats.speculation.as_ref().map_or(0, |s| s.accepted[k as usize]),
                    "acceptance": stats.speculation.as_ref().and_then(|s| s.acceptance(k)),
                })),
            },
            "read_bytes_per_token": {
                "stream": stream_per_token,
                "sparse": sparse_per_token,
                "total": stream_per_token + sparse_per_token,
            },
            "stream": model.stream_counters().map(|s| json!({
                "bytes_read": s.bytes_read,
                "wait_s": s.wait_ns as f64 * 1e-9,
                "wasted_units": s.wasted_units,
            })),
            "sparse": sparse.as_ref().map(|s| {
                let p = s.exec.stats();
                json!({
                    "bytes_read": p.bytes_read,
                    "cache_bytes": s.exec.cache_bytes(),
                    "hits": p.hits,
                    "misses": p.misses,
                    "tokens": p.tokens,
                })
            }),
        });
        writeln!(stdout, "{out}")?;
    } else {
        if let Some(rest) = stream.finish(&model.tokenizer)? {
            stdout.write_all(rest.as_bytes())?;
        }
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, peak RSS {:.0} MiB, {:?} precision, {} kernels]",
            stats.prompt_tokens,
            stats.prefill_tokens_per_s(),
            stats.generated_tokens,
            stats.decode_tokens_per_s(),
            peak as f64 / (1 << 20) as f64,
            args.precision,
            leanstream_engine::backend::cpu::kernel_name(),
        );
    }
    Ok(())
}

/// `text` tokenised to exactly `n` ids: as many copies of it, a space between them, as make at
/// least `n` tokens, cut to `n`. Repeating the text rather than the ids keeps a tokenizer's
/// beginning-of-sequence id at the start only.
fn prompt_of_length(tokenizer: &Tokenizer, text: &str, n: usize) -> anyhow::Result<Vec<u32>> {
    let (mut copies, mut shorter) = (1, 0);
    loop {
        let mut ids = tokenizer.encode(&vec![text; copies].join(" "))?;
        if ids.len() >= n {
            ids.truncate(n);
            return Ok(ids);
        }
        anyhow::ensure!(
            ids.len() > shorter,
            "the prompt {text:?} adds no tokens when repeated; it cannot make {n} tokens"
        );
        shorter = ids.len();
        // Enough copies at the rate these made tokens (usually the last encoding).
        copies = (copies * n).div_ceil(ids.len()).max(copies + 1);
    }
}

/// Runs `prompt` and one decode pass on `session`, untimed, and rewinds it to where it was: a
/// benchmark's warm-up.
fn warm_up(
    session: &mut dyn Decode,
    prompt: &[u32],
    sampler: &SamplerConfig,
) -> anyhow::Result<()> {
    let start = session.position();
    generate(session, prompt, 2, sampler, &[], |_| true).context("warming up")?;
    session.rewind(start)?;
    Ok(())
}

/// The generated ids that make up the text: all but a final end-of-generation token.
fn text_ids<'a>(ids: &'a [u32], eos: &[u32]) -> &'a [u32] {
    match ids.split_last() {
        Some((last, rest)) if eos.contains(last) => rest,
        _ => ids,
    }
}
