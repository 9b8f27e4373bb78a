//! Concurrency benchmark (not a test: timings never go in tests). Starts a private bus and the
//! real daemon through the harness, then for N = 1, 4, 8 concurrent clients (separate
//! connections, one session each, the same prompt, greedy, 32 tokens) measures per client the
//! time to first token (from the Generate call to the first token event) and the decode rate
//! (tokens after the first ÷ time from the first to the last token). Prints a table; writes JSON
//! to the path given as the first argument, if any.
//!
//! `cargo run --profile test -p leanstream-e2e --example concurrency [out.json]`
//! (the test profile: the harness builds the daemon with it and looks for it next to this binary).

use std::time::{Duration, Instant};

use leanstream_e2e::*;

const TOKENS: u32 = 32;

struct Sample {
    ttft: Duration,
    decode_tok_s: f64,
    tokens: usize,
    started: Instant,
    last: Instant,
}

async fn one(
    client: Client,
    start: std::sync::Arc<tokio::sync::Barrier>,
) -> anyhow::Result<Sample> {
    let session = client.open(128).await?;
    start.wait().await;
    let started = Instant::now();
    let fd = session.generate(STORY_PROMPT, &greedy(TOKENS)).await?;
    let (out, arrivals) = read_stream_timed(fd).await?;
    session.close().await?;
    let (Some(&first), Some(&last)) = (arrivals.first(), arrivals.last()) else {
        anyhow::bail!("no tokens: {:?}", out.end);
    };
    let decode = last.duration_since(first).as_secs_f64();
    Ok(Sample {
        ttft: first.duration_since(started),
        decode_tok_s: if decode > 0.0 {
            (arrivals.len() - 1) as f64 / decode
        } else {
            0.0
        },
        tokens: arrivals.len(),
        started,
        last,
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn main() -> anyhow::Result<()> {
    let out_path = std::env::args().nth(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let bus = Bus::start()?;
        let _daemon = Daemon::start(&bus, &DaemonConfig::default()).await?;
        let admin = Client::new(&bus).await?;
        admin.manager.load_model(MODEL).await?;
        // Warm-up: one generation, not measured.
        generate_once(&admin, STORY_PROMPT, 8).await?;

        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!("prompt {STORY_PROMPT:?}, greedy, {TOKENS} tokens, {cores} cores");
        println!(
            "{:>3} | {:>16} | {:>13} | {:>20} | {:>15}",
            "N", "median TTFT (ms)", "max TTFT (ms)", "median client tok/s", "aggregate tok/s"
        );
        let mut rows = Vec::new();
        for n in [1usize, 4, 8] {
            let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
            let mut tasks = Vec::new();
            for _ in 0..n {
                let client = Client::new(&bus).await?;
                tasks.push(tokio::spawn(one(client, barrier.clone())));
            }
            let mut samples = Vec::new();
            for t in tasks {
                samples.push(t.await??);
            }
            let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
            let mut rate: Vec<f64> = samples.iter().map(|s| s.decode_tok_s).collect();
            let max_ttft = ttft.iter().copied().fold(0.0, f64::max);
            let med_ttft = median(&mut ttft);
            let med_rate = median(&mut rate);
            // Aggregate: every token of every client ÷ wall time from the first Generate call to
            // the last token.
            let first = samples.iter().map(|s| s.started).min();
            let last = samples.iter().map(|s| s.last).max();
            let total: usize = samples.iter().map(|s| s.tokens).sum();
            let wall = match (first, last) {
                (Some(f), Some(l)) => l.duration_since(f).as_secs_f64(),
                _ => 0.0,
            };
            let aggregate = if wall > 0.0 { total as f64 / wall } else { 0.0 };
            println!(
                "{n:>3} | {med_ttft:>16.1} | {max_ttft:>13.1} | {med_rate:>20.1} | {aggregate:>15.1}"
            );
            rows.push(serde_json::json!({
                "clients": n,
                "ttft_ms": ttft,
                "median_ttft_ms": med_ttft,
                "max_ttft_ms": max_ttft,
                "client_decode_tok_s": rate,
                "median_client_decode_tok_s": med_rate,
                "aggregate_tok_s": aggregate,
                "tokens": total,
            }));
        }
        if let Some(path) = out_path {
            let json = serde_json::json!({
                "prompt": STORY_PROMPT,
                "max_tokens": TOKENS,
                "cores": cores,
                "rows": rows,
            });
            std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
            println!("wrote {path}");
        }
        Ok(())
    })
}
