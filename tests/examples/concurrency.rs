//! Many-clients benchmark (not a test: timings never go in tests). Starts a private bus and the
//! real daemon through the harness (budget 1 GiB, the real model), then for N = 1, 4, 8, 16
//! concurrent clients (separate connections, one session each, a different prompt each, greedy,
//! 24 tokens) measures per client the time to first token (from the Generate call to the first
//! token event reaching the client) and, for the run, the aggregate rate (every client's tokens ÷
//! wall time from the first Generate call to the last token). Every client's tokens are compared
//! with the same prompt generated alone, before the timed runs: a difference fails the benchmark.
//! Then two scheduler measurements: a `realtime` request's time to first token idle and while 8
//! `background` generations run, and the time to first token of a prompt behind a ~300-token
//! system prompt cold, shared with an open session, and from the model's prefix store.
//! Prints a table; writes JSON to the path given as the first argument, if any.
//!
//! `cargo run --profile test -p leanstream-e2e --example concurrency [out.json] [exact|fast] [LSM]`
//! (the second argument is the daemon's `[engine] precision`, exact by default; a calibrated
//! `.lsm` file as the third is served instead of the `.gguf`, in `leanstream` mode with a neuron
//! cache of half its streamed FFN, so that the FFN streams from storage while clients run)
//! (the test profile: the harness builds the daemon with it and looks for it next to this binary;
//! `LEANSTREAMD_BIN` runs another daemon binary against the same clients: the release build for
//! the product's numbers, as the test profile's debug assertions make a token ~2.5× slower, or
//! an older build).

use std::time::{Duration, Instant};

use leanstream::contract::{GenerateParams, Priority, SessionProxy, StreamEvent};
use leanstream_e2e::*;

const TOKENS: u32 = 24;
const CLIENTS: [usize; 4] = [1, 4, 8, 16];

/// One prompt per client: different texts and lengths, as separate apps would send.
const PROMPTS: [&str; 16] = [
    STORY_PROMPT,
    "The robot arm picked up the red block and",
    "Here is a short list of fruits: apple,",
    "To make a cup of tea, first",
    "The weather today is",
    "In the year 2050, cities will",
    "My favourite book is about a dragon who",
    "The quick brown fox",
    "Water boils at one hundred degrees because",
    "A good morning routine starts with",
    "The planet Mars is known for",
    "When the battery runs low, the robot should",
    "Dear friend, I am writing to tell you that",
    "The three primary colours are",
    "Once a week, the gardener",
    "The train left the station at noon and",
];

struct Sample {
    ids: Vec<u32>,
    ttft: Duration,
    started: Instant,
    last: Instant,
}

async fn one(
    client: Client,
    prompt: &'static str,
    start: std::sync::Arc<tokio::sync::Barrier>,
) -> anyhow::Result<Sample> {
    let session = client.open(128).await?;
    start.wait().await;
    let started = Instant::now();
    let fd = session.generate(prompt, &greedy(TOKENS)).await?;
    let (out, arrivals) = read_stream_timed(fd).await?;
    session.close().await?;
    let (Some(&first), Some(&last)) = (arrivals.first(), arrivals.last()) else {
        anyhow::bail!("no tokens: {:?}", out.end);
    };
    Ok(Sample {
        ids: out.ids,
        ttft: first.duration_since(started),
        started,
        last,
    })
}

/// The `q`-quantile of `v` (nearest rank).
fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// A robot's system prompt of about 300 tokens, shared by the sessions of the cached-prefix run.
fn system_prompt() -> String {
    let rules = [
        "You are the voice of a warehouse robot that moves shelves between stations.",
        "Answer in one short sentence unless the operator asks for details.",
        "Never promise an action that the planner has not confirmed.",
        "When a person is within two metres, say that you are slowing down.",
        "Report battery levels in percent and round them to the nearest five.",
        "If a command is unclear, ask one question that resolves it.",
        "Stations are named by a letter and a number, for example B4 or K12.",
        "Shelves carry at most four hundred kilograms; refuse heavier loads politely.",
    ];
    let mut text = String::from("<|im_start|>system\n");
    for round in 0..2 {
        for (i, rule) in rules.iter().enumerate() {
            text.push_str(&format!("Rule {}: {rule} ", round * rules.len() + i + 1));
        }
    }
    text.push_str("<|im_end|>\n<|im_start|>user\n");
    text
}

/// Time to first token of one greedy generation of `n` tokens with `params`' class, on a new
/// session that stays open (the caller closes it).
async fn first_token(
    client: &Client,
    prompt: &str,
    params: GenerateParams,
) -> anyhow::Result<(Duration, Stream, SessionProxy<'static>)> {
    let session = client.open(512).await?;
    let started = Instant::now();
    let fd = session.generate(prompt, &params).await?;
    let (out, arrivals) = read_stream_timed(fd).await?;
    let Some(&first) = arrivals.first() else {
        anyhow::bail!("no tokens: {:?}", out.end);
    };
    Ok((first.duration_since(started), out, session))
}

fn class(n: u32, priority: Priority) -> GenerateParams {
    GenerateParams {
        priority: priority.name().into(),
        ..greedy(n)
    }
}

/// A `realtime` request's time to first token idle, then while 8 `background` generations run
/// (each past its first token). Medians of 3; milliseconds.
async fn realtime_under_load(bus: &Bus) -> anyhow::Result<(f64, f64)> {
    let rt = Client::new(bus).await?;
    let mut idle = Vec::new();
    for _ in 0..3 {
        let (t, _, s) = first_token(&rt, PROMPTS[1], class(TOKENS, Priority::Realtime)).await?;
        s.close().await?;
        idle.push(t.as_secs_f64() * 1e3);
    }
    let mut loaded = Vec::new();
    for _ in 0..3 {
        let mut background = Vec::new();
        for &prompt in &PROMPTS[2..10] {
            let client = Client::new(bus).await?;
            let session = client.open(512).await?;
            let fd = session
                .generate(prompt, &class(200, Priority::Background))
                .await?;
            background.push((client, session, fd));
        }
        // Let every background generation get going (its prompt is in), then ask.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (t, _, s) = first_token(&rt, PROMPTS[1], class(TOKENS, Priority::Realtime)).await?;
        s.close().await?;
        loaded.push(t.as_secs_f64() * 1e3);
        for (_client, session, fd) in background {
            session.close().await?;
            drop(fd);
        }
    }
    Ok((quantile(&idle, 0.5), quantile(&loaded, 0.5)))
}

/// Time to first token of a prompt that starts with a ~300-token system prompt: cold (no other
/// session has run it), then cached (another session that ran it is open), then from the
/// model's store (that session closed). Milliseconds, and the prompt's token count.
async fn cached_system_prompt(bus: &Bus) -> anyhow::Result<serde_json::Value> {
    let system = system_prompt();
    let ask = |q: &str| format!("{system}{q}<|im_end|>\n<|im_start|>assistant\n");
    let client = Client::new(bus).await?;
    let (cold, out, first) = first_token(&client, &ask("Where is shelf B4?"), greedy(8)).await?;
    let prompt_tokens = match &out.end {
        Some(StreamEvent::Done { stats, .. }) => stats.prompt_tokens,
        other => anyhow::bail!("cold run: {other:?}"),
    };
    let (cached, out, second) =
        first_token(&client, &ask("What is the battery level?"), greedy(8)).await?;
    let cached_tokens = match &out.end {
        Some(StreamEvent::Done { stats, .. }) => stats.cached_prompt_tokens,
        other => anyhow::bail!("cached run: {other:?}"),
    };
    first.close().await?;
    second.close().await?;
    let (stored, _, third) = first_token(&client, &ask("Can you carry 300 kg?"), greedy(8)).await?;
    third.close().await?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok(serde_json::json!({
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_tokens,
        "cold_ttft_ms": ms(cold),
        "cached_ttft_ms": ms(cached),
        "stored_ttft_ms": ms(stored),
    }))
}

fn main() -> anyhow::Result<()> {
    let out_path = std::env::args().nth(1);
    let precision = match std::env::args().nth(2).as_deref() {
        None | Some("exact") => "exact",
        Some("fast") => "fast",
        Some(other) => anyhow::bail!("precision {other:?}: exact or fast"),
    };
    let lsm = std::env::args().nth(3).map(std::path::PathBuf::from);
    let mode = if lsm.is_some() { "leanstream" } else { "dense" };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let bus = Bus::start()?;
        let config = DaemonConfig {
            budget: "1GiB".into(),
            max_sessions: 32,
            // Room for the ~300-token system prompt and the background generations.
            max_context: 512,
            max_tokens: 256,
            precision,
            extra: match lsm {
                Some(_) => format!("[models.{MODEL}]\nmode = \"{mode}\"\ncache_share = 0.5\n"),
                None => String::new(),
            },
            lsm,
            ..DaemonConfig::default()
        };
        let _daemon = Daemon::start(&bus, &config).await?;
        let admin = Client::new(&bus).await?;
        admin.manager.load_model(MODEL).await?;
        // Each prompt alone: the tokens every concurrent run must reproduce (and the warm-up).
        let mut alone = Vec::new();
        for prompt in PROMPTS {
            alone.push(generate_once(&admin, prompt, TOKENS).await?.ids);
        }

        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!(
            "{} prompts, greedy, {TOKENS} tokens, {mode} mode, {precision} precision, {cores} cores",
            PROMPTS.len()
        );
        println!(
            "{:>3} | {:>14} | {:>14} | {:>14} | {:>15} | {:>9}",
            "N", "TTFT p50 (ms)", "TTFT p95 (ms)", "TTFT max (ms)", "aggregate tok/s", "identical"
        );
        let mut rows = Vec::new();
        let mut all_identical = true;
        for n in CLIENTS {
            let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
            let mut tasks = Vec::new();
            for &prompt in &PROMPTS[..n] {
                let client = Client::new(&bus).await?;
                tasks.push(tokio::spawn(one(client, prompt, barrier.clone())));
            }
            let mut samples = Vec::new();
            for t in tasks {
                samples.push(t.await??);
            }
            let identical = samples.iter().zip(&alone).all(|(s, a)| &s.ids == a);
            let ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
            let first = samples.iter().map(|s| s.started).min();
            let last = samples.iter().map(|s| s.last).max();
            let total: usize = samples.iter().map(|s| s.ids.len()).sum();
            let wall = match (first, last) {
                (Some(f), Some(l)) => l.duration_since(f).as_secs_f64(),
                _ => 0.0,
            };
            let aggregate = if wall > 0.0 { total as f64 / wall } else { 0.0 };
            let (p50, p95, max) = (
                quantile(&ttft, 0.5),
                quantile(&ttft, 0.95),
                quantile(&ttft, 1.0),
            );
            println!(
                "{n:>3} | {p50:>14.1} | {p95:>14.1} | {max:>14.1} | {aggregate:>15.1} | {:>9}",
                if identical { "yes" } else { "NO" }
            );
            rows.push(serde_json::json!({
                "clients": n,
                "ttft_ms": ttft,
                "ttft_p50_ms": p50,
                "ttft_p95_ms": p95,
                "ttft_max_ms": max,
                "aggregate_tok_s": aggregate,
                "tokens": total,
                "identical_to_alone": identical,
            }));
            all_identical &= identical;
        }
        let (rt_idle, rt_loaded) = realtime_under_load(&bus).await?;
        println!(
            "realtime time to first token (median of 3): idle {rt_idle:.1} ms, with 8 background \
             generations {rt_loaded:.1} ms ({:.2}x idle)",
            rt_loaded / rt_idle
        );
        let prefix = cached_system_prompt(&bus).await?;
        let ratio = |k: &str| {
            prefix[k].as_f64().unwrap_or(0.0) / prefix["cold_ttft_ms"].as_f64().unwrap_or(1.0)
        };
        println!(
            "system prompt of {} tokens: time to first token cold {:.1} ms, shared with an open \
             session {:.1} ms ({:.2}x cold, {} tokens cached), from the model's store {:.1} ms \
             ({:.2}x cold)",
            prefix["prompt_tokens"],
            prefix["cold_ttft_ms"].as_f64().unwrap_or(0.0),
            prefix["cached_ttft_ms"].as_f64().unwrap_or(0.0),
            ratio("cached_ttft_ms"),
            prefix["cached_prompt_tokens"],
            prefix["stored_ttft_ms"].as_f64().unwrap_or(0.0),
            ratio("stored_ttft_ms"),
        );
        if let Some(path) = out_path {
            let json = serde_json::json!({
                "prompts": PROMPTS,
                "max_tokens": TOKENS,
                "budget": config.budget,
                "precision": precision,
                "mode": mode,
                "cores": cores,
                "rows": rows,
                "realtime": {
                    "idle_ttft_ms": rt_idle,
                    "with_8_background_ttft_ms": rt_loaded,
                },
                "system_prompt": prefix,
            });
            std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
            println!("wrote {path}");
        }
        if !all_identical {
            anyhow::bail!("a client's tokens differ from its prompt generated alone");
        }
        Ok(())
    })
}
