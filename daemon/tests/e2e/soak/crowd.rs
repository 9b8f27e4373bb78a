//! The crowd's operations: what one client does in one step, well-behaved or not. Each returns
//! what it came to ([`Outcome`]); anything the contract does not allow (an error other than
//! `Busy` or `OverBudget`, a stream that does not end, greedy output other than the fixture's)
//! is an error that fails the soak.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use fastrand::Rng;
use leanstream::contract::{ChatTurn, GenerateParams, LeanStreamError, SessionProxy, StreamEvent};
use leanstream_e2e::*;
use zbus::zvariant::OwnedFd;

/// A JSON Schema the constrained requests use.
const SCHEMA: &str =
    r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}"#;

/// One kind of step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    /// Greedy generation, read to the end: the fixture's ids.
    Plain,
    /// A chat request.
    Chat,
    /// A JSON Schema request: when it ends at `eos`, the text parses.
    Schema,
    /// `Cancel` while the stream runs.
    Cancel,
    /// `Close` while the stream runs.
    Close,
    /// The connection drops mid-stream, nothing read.
    Vanish,
    /// The stream is left unread for up to 2 s, then the session closed or the connection
    /// dropped; the stream must still end.
    NeverRead,
    /// A `leanstream generate` process killed with SIGKILL mid-stream.
    Kill,
    /// 32 `OpenSession` calls at once from a new connection, which then drops.
    Flood,
}

impl Op {
    /// Every kind with its weight in the draw.
    const WEIGHTS: [(Op, u32); 9] = [
        (Op::Plain, 3),
        (Op::Chat, 2),
        (Op::Schema, 2),
        (Op::Cancel, 2),
        (Op::Close, 1),
        (Op::Vanish, 1),
        (Op::NeverRead, 1),
        (Op::Kill, 1),
        (Op::Flood, 1),
    ];

    pub fn draw(rng: &mut Rng) -> Op {
        let total: u32 = Op::WEIGHTS.iter().map(|(_, w)| w).sum();
        let mut pick = rng.u32(..total);
        for (op, w) in Op::WEIGHTS {
            if pick < w {
                return op;
            }
            pick -= w;
        }
        Op::Plain
    }
}

/// What a step came to.
#[derive(Debug)]
pub enum Outcome {
    /// It ran as asked (a fault, where the step injects one, was injected).
    Ran,
    /// The daemon refused it, as the contract allows: `Busy` or `OverBudget`.
    Refused(&'static str),
    /// A `Kill` whose process had finished before the signal.
    FinishedFirst,
    /// A flood: how many of its calls opened a session and how many were refused.
    Flooded { opened: u64, refused: u64 },
}

/// What every step may use: the bus, the CLI, and the actor's own connection.
pub struct Ctx {
    pub bus: Arc<Bus>,
    pub cli: std::path::PathBuf,
    pub client: Client,
}

/// Runs `op` with `rng`.
pub async fn run(op: Op, ctx: &Ctx, rng: &mut Rng) -> anyhow::Result<Outcome> {
    match op {
        Op::Plain => plain(&ctx.client, rng).await,
        Op::Chat => chat(&ctx.client, rng).await,
        Op::Schema => schema(&ctx.client, rng).await,
        Op::Cancel | Op::Close => interrupt(&ctx.client, rng, op == Op::Cancel).await,
        Op::Vanish => vanish(&ctx.bus, rng).await,
        Op::NeverRead => never_read(&ctx.bus, rng).await,
        Op::Kill => kill(&ctx.bus, &ctx.cli, rng).await,
        Op::Flood => flood(&ctx.bus).await,
    }
}

/// A refusal the contract allows, or the error.
fn refusal(e: zbus::Error) -> anyhow::Result<Outcome> {
    match LeanStreamError::from(e) {
        LeanStreamError::Busy(_) => Ok(Outcome::Refused("Busy")),
        LeanStreamError::OverBudget(_) => Ok(Outcome::Refused("OverBudget")),
        e => bail!("{e}"),
    }
}

/// A random class, so every priority runs.
fn params(rng: &mut Rng, max_tokens: u32) -> GenerateParams {
    GenerateParams {
        priority: ["background", "interactive", "realtime"][rng.usize(..3)].into(),
        ..greedy(max_tokens)
    }
}

/// A session with room for 64 to 256 tokens, or the refusal.
async fn open(c: &Client, rng: &mut Rng) -> anyhow::Result<Result<SessionProxy<'static>, Outcome>> {
    match c.manager.open_session(MODEL, rng.u32(64..=256)).await {
        Ok(path) => Ok(Ok(session_proxy(&c.conn, path).await?)),
        Err(e) => Ok(Err(refusal(e)?)),
    }
}

/// Starts a generation on a new session: its proxy and stream, or the refusal.
async fn start(
    c: &Client,
    rng: &mut Rng,
    prompt: &str,
    p: &GenerateParams,
) -> anyhow::Result<Result<(SessionProxy<'static>, OwnedFd), Outcome>> {
    let s = match open(c, rng).await? {
        Ok(s) => s,
        Err(refused) => return Ok(Err(refused)),
    };
    match s.generate(prompt, p).await {
        Ok(fd) => Ok(Ok((s, fd))),
        Err(e) => {
            s.close().await?;
            Ok(Err(refusal(e)?))
        }
    }
}

/// How a stream that was read to its end ended: `Some(reason)` for `done`, `None` for an
/// allowed error (`Cancelled` where `cancelled_ok`, `OverBudget` when its KV could not grow).
fn ending(out: &Stream, cancelled_ok: bool) -> anyhow::Result<Option<String>> {
    match &out.end {
        Some(StreamEvent::Done { reason, .. }) => Ok(Some(reason.clone())),
        Some(StreamEvent::Error { name, .. }) if name == "OverBudget" => Ok(None),
        Some(StreamEvent::Error { name, .. }) if cancelled_ok && name == "Cancelled" => Ok(None),
        other => bail!("the stream ended with {other:?}"),
    }
}

async fn plain(c: &Client, rng: &mut Rng) -> anyhow::Result<Outcome> {
    let n = rng.u32(4..=16);
    let p = params(rng, n);
    let (s, fd) = match start(c, rng, STORY_PROMPT, &p).await? {
        Ok(started) => started,
        Err(refused) => return Ok(refused),
    };
    let out = read_stream(fd).await?;
    if ending(&out, false)?.is_some() {
        ensure!(
            out.ids == STORY_GREEDY[..n as usize],
            "greedy ids {:?}, want {:?}",
            out.ids,
            &STORY_GREEDY[..n as usize]
        );
    }
    s.close().await?;
    Ok(Outcome::Ran)
}

async fn chat(c: &Client, rng: &mut Rng) -> anyhow::Result<Outcome> {
    let s = match open(c, rng).await? {
        Ok(s) => s,
        Err(refused) => return Ok(refused),
    };
    let turn = ChatTurn {
        role: "user".into(),
        content: "Name a colour.".into(),
    };
    let n = rng.u32(4..=12);
    let p = params(rng, n);
    let fd = match s.generate_chat(&[turn], &p).await {
        Ok(fd) => fd,
        Err(e) => {
            s.close().await?;
            return refusal(e);
        }
    };
    ending(&read_stream(fd).await?, false)?;
    s.close().await?;
    Ok(Outcome::Ran)
}

async fn schema(c: &Client, rng: &mut Rng) -> anyhow::Result<Outcome> {
    let p = GenerateParams {
        grammar_kind: "json_schema".into(),
        grammar: SCHEMA.into(),
        ..params(rng, 24)
    };
    let (s, fd) = match start(c, rng, "Is the sky blue? Answer in JSON.", &p).await? {
        Ok(started) => started,
        Err(refused) => return Ok(refused),
    };
    let out = read_stream(fd).await?;
    if ending(&out, false)?.as_deref() == Some("eos") {
        let v: serde_json::Value = serde_json::from_str(&out.text)
            .with_context(|| format!("constrained output {:?} is not JSON", out.text))?;
        ensure!(v["ok"].is_boolean(), "{v} does not validate");
    }
    s.close().await?;
    Ok(Outcome::Ran)
}

/// A stream interrupted by `Cancel` (`cancel`) or `Close`: it still ends.
async fn interrupt(c: &Client, rng: &mut Rng, cancel: bool) -> anyhow::Result<Outcome> {
    let p = params(rng, 48);
    let (s, fd) = match start(c, rng, STORY_PROMPT, &p).await? {
        Ok(started) => started,
        Err(refused) => return Ok(refused),
    };
    let reader = tokio::spawn(read_stream(fd));
    tokio::time::sleep(Duration::from_millis(rng.u64(..400))).await;
    if cancel {
        s.cancel().await?;
    } else {
        s.close().await?;
    }
    ending(&reader.await??, true)?;
    if cancel {
        s.close().await?;
    }
    Ok(Outcome::Ran)
}

/// A client whose connection drops mid-stream, its stream unread.
async fn vanish(bus: &Bus, rng: &mut Rng) -> anyhow::Result<Outcome> {
    let c = Client::new(bus).await?;
    let p = params(rng, 48);
    let (s, fd) = match start(&c, rng, STORY_PROMPT, &p).await? {
        Ok(started) => started,
        Err(refused) => return Ok(refused),
    };
    tokio::time::sleep(Duration::from_millis(rng.u64(..500))).await;
    drop((s, fd, c));
    Ok(Outcome::Ran)
}

/// A client that leaves its stream unread, then closes the session or drops its connection:
/// the stream it never read has ended.
async fn never_read(bus: &Bus, rng: &mut Rng) -> anyhow::Result<Outcome> {
    let c = Client::new(bus).await?;
    let p = params(rng, 64);
    let (s, fd) = match start(&c, rng, STORY_PROMPT, &p).await? {
        Ok(started) => started,
        Err(refused) => return Ok(refused),
    };
    tokio::time::sleep(Duration::from_millis(rng.u64(500..2000))).await;
    if rng.bool() {
        s.close().await?;
    }
    drop((s, c));
    ending(&read_stream(fd).await?, true)?;
    Ok(Outcome::Ran)
}

/// A `leanstream generate` process killed with SIGKILL after 0.1 to 2 s.
async fn kill(bus: &Bus, cli: &Path, rng: &mut Rng) -> anyhow::Result<Outcome> {
    let mut child = tokio::process::Command::new(cli)
        .args(["--bus", &bus.address, "generate", "--model", MODEL])
        .args(["--max-tokens", "48", "Tell me a story about a lighthouse."])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", cli.display()))?;
    tokio::time::sleep(Duration::from_millis(rng.u64(100..2000))).await;
    if child.try_wait()?.is_some() {
        return Ok(Outcome::FinishedFirst);
    }
    child.kill().await?;
    Ok(Outcome::Ran)
}

/// 32 `OpenSession` calls at once on a new connection, which then drops with whatever it got.
async fn flood(bus: &Bus) -> anyhow::Result<Outcome> {
    let c = Client::new(bus).await?;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let manager = c.manager.clone();
        calls.spawn(async move { manager.open_session(MODEL, 64).await });
    }
    let (mut opened, mut refused) = (0, 0);
    while let Some(answer) = calls.join_next().await {
        match answer? {
            Ok(_) => opened += 1,
            Err(e) => {
                refusal(e)?;
                refused += 1;
            }
        }
    }
    drop(c);
    Ok(Outcome::Flooded { opened, refused })
}
