//! What the OpenAI endpoint costs: N streamed greedy chats through `leanstream-openai` (HTTP,
//! SSE) against the same chats through the Rust client library directly, on one daemon, in
//! one run, alternating which goes first. Each chat opens a session, streams, and closes it on
//! both paths. Prints time to first token and token rates, and the ratios.
//!
//! ```sh
//! cargo run --profile test -p leanstream-openai --example bench -- [N] [MAX_TOKENS]
//! ```
//!
//! The endpoint runs in this process on a runtime (and threads) of its own, as the binary
//! would, on a loopback port; the model is kept loaded between chats (`keep_alive`), so that
//! load times do not enter either side.

#[path = "../tests/common/http.rs"]
mod http;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use leanstream::contract::{ChatTurn, GenerateParams, StreamEvent};
use leanstream_e2e::{Bus, Daemon, DaemonConfig, MODEL, runtime};
use leanstream_openai::cli::Listen;
use leanstream_openai::{listen, server};
use serde_json::json;

const PROMPT: &str = "Write a long story about a robot who learns to paint.";

/// One chat's timings.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// Request sent → first token's text received.
    ttft: Duration,
    /// Request sent → last token received.
    total: Duration,
    tokens: usize,
}

impl Run {
    /// Tokens after the first, per second of decoding.
    fn decode_rate(&self) -> f64 {
        (self.tokens.saturating_sub(1)) as f64 / (self.total - self.ttft).as_secs_f64()
    }
    /// Tokens per second from the request to the last token.
    fn overall_rate(&self) -> f64 {
        self.tokens as f64 / self.total.as_secs_f64()
    }
}

async fn direct(client: &leanstream::Client, max_tokens: u32) -> Result<Run> {
    let turns = [ChatTurn {
        role: "user".into(),
        content: PROMPT.into(),
    }];
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    let start = Instant::now();
    let session = client.open_session(MODEL, 0).await?;
    let mut stream = session.generate_chat(&turns, &params).await?;
    let (mut ttft, mut tokens, mut last) = (None, 0, start);
    while let Some(event) = stream.next_event().await {
        match event? {
            StreamEvent::Token { text, .. } => {
                tokens += 1;
                last = Instant::now();
                if ttft.is_none() && !text.is_empty() {
                    ttft = Some(start.elapsed());
                }
            }
            StreamEvent::Done { .. } => break,
            _ => {}
        }
    }
    let total = last - start;
    session.close().await?;
    Ok(Run {
        ttft: ttft.context("no token")?,
        total,
        tokens,
    })
}

async fn through_endpoint(target: &http::Target, max_tokens: u32) -> Result<Run> {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    });
    let start = Instant::now();
    let mut response = http::send(target, "POST", "/v1/chat/completions", Some(&body)).await?;
    if response.status != 200 {
        bail!("status {}", response.status);
    }
    let mut reader = http::SseReader::default();
    let (mut ttft, mut tokens, mut last) = (None, 0, start);
    'read: while let Some(bytes) = response.next_bytes().await? {
        for event in reader.push(&bytes)? {
            if event == "[DONE]" {
                break 'read;
            }
            let chunk: serde_json::Value = serde_json::from_str(&event)?;
            if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str()
                && !text.is_empty()
            {
                tokens += 1;
                last = Instant::now();
                ttft.get_or_insert_with(|| start.elapsed());
            }
        }
    }
    Ok(Run {
        ttft: ttft.context("no token")?,
        total: last - start,
        tokens,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(10), |a| a.parse())?;
    let max_tokens: u32 = args.next().map_or(Ok(128), |a| a.parse())?;

    let bus = Bus::start()?;
    let rt = runtime();
    let cfg = DaemonConfig {
        max_tokens: 512,
        max_context: 1024,
        extra: format!("[models.{MODEL}]\nkeep_alive = 600\n"),
        ..DaemonConfig::default()
    };
    let daemon = rt.block_on(Daemon::start(&bus, &cfg))?;

    // The endpoint, on its own runtime as in the binary.
    let bound = listen::bind(&Listen::Tcp("127.0.0.1:0".parse()?))?;
    let target = http::Target::Tcp(bound.describe().parse()?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let address = bus.address.clone();
    let endpoint = std::thread::spawn(move || -> Result<()> {
        let rt = server::runtime()?;
        rt.block_on(async {
            let bus = leanstream::Bus::Address(address);
            let identities = server::connect(&bus, false).await?;
            let shutdown = async {
                let _ = stop_rx.await;
            };
            server::serve(bound, identities, shutdown).await?;
            Ok(())
        })
    });

    let (direct_runs, http_runs) = rt.block_on(async {
        let client =
            leanstream::Client::connect(&leanstream::Bus::Address(bus.address.clone())).await?;
        // Wait for the endpoint, then warm both paths (and load the model).
        let deadline = Instant::now() + Duration::from_secs(10);
        while http::get(&target, "/health").await.map(|r| r.0).ok() != Some(200) {
            if Instant::now() > deadline {
                bail!("the endpoint did not come up");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        direct(&client, max_tokens).await?;
        through_endpoint(&target, max_tokens).await?;
        let (mut d, mut h) = (Vec::new(), Vec::new());
        for i in 0..n {
            if i % 2 == 0 {
                d.push(direct(&client, max_tokens).await?);
                h.push(through_endpoint(&target, max_tokens).await?);
            } else {
                h.push(through_endpoint(&target, max_tokens).await?);
                d.push(direct(&client, max_tokens).await?);
            }
        }
        Ok::<_, anyhow::Error>((d, h))
    })?;
    let _ = stop_tx.send(());
    endpoint
        .join()
        .map_err(|_| anyhow::anyhow!("the endpoint thread panicked"))??;
    drop(daemon);

    println!(
        "\n{n} streamed greedy chats of up to {max_tokens} tokens on each path, model {MODEL}, \
         {} cores\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:<22} {:>7} {:>14} {:>14} {:>16} {:>16}",
        "path",
        "tokens",
        "TTFT med (ms)",
        "TTFT mean (ms)",
        "decode tok/s med",
        "overall tok/s med"
    );
    let row = |name: &str, runs: &[Run]| {
        let ttft: Vec<f64> = runs.iter().map(|r| r.ttft.as_secs_f64() * 1e3).collect();
        let decode: Vec<f64> = runs.iter().map(Run::decode_rate).collect();
        let overall: Vec<f64> = runs.iter().map(Run::overall_rate).collect();
        let tokens = runs.first().map_or(0, |r| r.tokens);
        println!(
            "{name:<22} {tokens:>7} {:>14.2} {:>14.2} {:>16.1} {:>16.1}",
            median(ttft.clone()),
            mean(&ttft),
            median(decode.clone()),
            median(overall.clone())
        );
        (median(ttft), median(decode), median(overall))
    };
    let (d_ttft, d_decode, d_overall) = row("Rust client (direct)", &direct_runs);
    let (h_ttft, h_decode, h_overall) = row("HTTP endpoint (SSE)", &http_runs);
    if direct_runs
        .iter()
        .zip(&http_runs)
        .any(|(d, h)| d.tokens != h.tokens)
    {
        println!("note: the two paths generated different token counts");
    }
    println!();
    println!(
        "medians:  decode tok/s endpoint/direct = {:.3} ({:+.1} %), overall = {:.3} ({:+.1} %), \
         TTFT added = {:+.2} ms",
        h_decode / d_decode,
        (h_decode / d_decode - 1.0) * 100.0,
        h_overall / d_overall,
        (h_overall / d_overall - 1.0) * 100.0,
        h_ttft - d_ttft
    );
    // Each endpoint chat against the direct chat run right before or after it, under the same
    // momentary load of the machine: the steadier figure where other work shares the cores.
    let pairs = || direct_runs.iter().zip(&http_runs);
    let decode_ratio = median(
        pairs()
            .map(|(d, h)| h.decode_rate() / d.decode_rate())
            .collect(),
    );
    let overall_ratio = median(
        pairs()
            .map(|(d, h)| h.overall_rate() / d.overall_rate())
            .collect(),
    );
    let ttft_added = median(
        pairs()
            .map(|(d, h)| (h.ttft.as_secs_f64() - d.ttft.as_secs_f64()) * 1e3)
            .collect(),
    );
    println!(
        "paired:   decode tok/s endpoint/direct = {decode_ratio:.3} ({:+.1} %), overall = \
         {overall_ratio:.3} ({:+.1} %), TTFT added = {ttft_added:+.2} ms",
        (decode_ratio - 1.0) * 100.0,
        (overall_ratio - 1.0) * 100.0,
    );
    println!("targets:  tok/s cost <= 5 %, TTFT added <= 5 ms");
    Ok(())
}
