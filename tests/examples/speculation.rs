//! Speculative decoding through the daemon (a benchmark, not a test: timings never go in tests).
//! Serves SmolLM2 under `[models.smollm2] max_bytes` (its weights stream from storage every
//! token) twice — `speculate = "off"`, then `"auto"` — and runs 4 clients at once, each with its
//! own prompt, greedy. Every client's ids are checked against its prompt generated alone by the
//! daemon without speculation (a difference fails the benchmark); the aggregate rate is every
//! client's tokens ÷ the wall time from the first Generate call to the last token.
//!
//! `cargo run --profile test -p leanstream-e2e --example speculation [out.json] [MAX_BYTES]`
//! (`MAX_BYTES` default `48MB`; `LEANSTREAMD_BIN` runs the release daemon, as for `concurrency`).

use std::time::Instant;

use leanstream_e2e::*;

const TOKENS: u32 = 64;

/// Four of the bench's completion prompts.
const PROMPTS: [&str; 4] = [
    "The robot arm paused above the conveyor belt, waiting for the camera to report",
    "To calibrate the wheel odometry of a small rover, first measure",
    "The three most important things to check before a drone takes off are",
    "Dear team, this week we finished the new charging dock and",
];

/// One client's greedy generation of `prompt`, started when all are ready: its ids, when it
/// started and when its last token arrived, and its done event's tokens per pass.
async fn one(
    client: Client,
    prompt: &'static str,
    start: std::sync::Arc<tokio::sync::Barrier>,
) -> anyhow::Result<(Vec<u32>, Instant, Instant, f64)> {
    let session = client.open(256).await?;
    start.wait().await;
    let started = Instant::now();
    let fd = session.generate(prompt, &greedy(TOKENS)).await?;
    let (out, arrivals) = read_stream_timed(fd).await?;
    session.close().await?;
    let Some(&last) = arrivals.last() else {
        anyhow::bail!("no tokens: {:?}", out.end);
    };
    let per_pass = match &out.end {
        Some(leanstream::contract::StreamEvent::Done { stats, .. }) => {
            stats.speculation_tokens_per_pass
        }
        other => anyhow::bail!("{prompt}: ended with {other:?}"),
    };
    Ok((out.ids, started, last, per_pass))
}

/// The daemon serving the model under `max_bytes` with `speculate`: each prompt's ids alone,
/// then the 4 at once. Returns the ids alone, the ids together, the aggregate tokens/s and the
/// mean tokens per pass.
async fn serve(
    max_bytes: &str,
    speculate: &str,
) -> anyhow::Result<(Vec<Vec<u32>>, Vec<Vec<u32>>, f64, f64)> {
    let bus = Bus::start()?;
    let config = DaemonConfig {
        budget: "1GiB".into(),
        max_tokens: 256,
        extra: format!(
            "[models.{MODEL}]\nmax_bytes = \"{max_bytes}\"\nspeculate = \"{speculate}\"\n"
        ),
        ..DaemonConfig::default()
    };
    let _daemon = Daemon::start(&bus, &config).await?;
    let admin = Client::new(&bus).await?;
    admin.manager.load_model(MODEL).await?;
    let mut alone = Vec::new();
    for prompt in PROMPTS {
        alone.push(generate_once(&admin, prompt, TOKENS).await?.ids);
    }
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(PROMPTS.len()));
    let mut tasks = Vec::new();
    for prompt in PROMPTS {
        let client = Client::new(&bus).await?;
        tasks.push(tokio::spawn(one(client, prompt, barrier.clone())));
    }
    let mut together = Vec::new();
    let (mut first, mut last, mut tokens, mut per_pass) =
        (None::<Instant>, None::<Instant>, 0, 0.0);
    for t in tasks {
        let (ids, started, ended, p) = t.await??;
        tokens += ids.len();
        per_pass += p / PROMPTS.len() as f64;
        first = Some(first.map_or(started, |f| f.min(started)));
        last = Some(last.map_or(ended, |l| l.max(ended)));
        together.push(ids);
    }
    let wall = match (first, last) {
        (Some(f), Some(l)) => l.duration_since(f).as_secs_f64(),
        _ => anyhow::bail!("no client ran"),
    };
    Ok((alone, together, tokens as f64 / wall, per_pass))
}

fn main() -> anyhow::Result<()> {
    let out_path = std::env::args().nth(1);
    let max_bytes = std::env::args().nth(2).unwrap_or_else(|| "48MB".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (plain_alone, plain_together, plain_rate, _) = serve(&max_bytes, "off").await?;
        let (spec_alone, spec_together, spec_rate, per_pass) = serve(&max_bytes, "auto").await?;
        for (i, prompt) in PROMPTS.iter().enumerate() {
            for (what, ids) in [
                ("off, together", &plain_together[i]),
                ("auto, alone", &spec_alone[i]),
                ("auto, together", &spec_together[i]),
            ] {
                anyhow::ensure!(
                    *ids == plain_alone[i],
                    "{prompt:?}: {what} differs from its plain solo run"
                );
            }
        }
        println!(
            "{} clients, max_bytes {max_bytes}, {TOKENS} greedy tokens each: every output equals its plain solo run",
            PROMPTS.len()
        );
        println!("| speculate | aggregate tok/s | tokens per pass |");
        println!("|---|---|---|");
        println!("| off | {plain_rate:.1} | 1.00 |");
        println!("| auto | {spec_rate:.1} | {per_pass:.2} |");
        println!("auto ÷ off: {:.2}×", spec_rate / plain_rate);
        if let Some(path) = out_path {
            let json = serde_json::json!({
                "clients": PROMPTS.len(),
                "tokens": TOKENS,
                "max_bytes": max_bytes,
                "off_tokens_per_s": plain_rate,
                "auto_tokens_per_s": spec_rate,
                "auto_tokens_per_pass": per_pass,
            });
            std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
        }
        Ok(())
    })
}
