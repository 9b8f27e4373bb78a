//! The soak: a seeded random crowd of clients against the real daemon on a private bus, while a
//! sampler holds the daemon to the budget's promises.
//!
//! [`ACTORS`] clients each draw steps ([`crowd::Op`]): plain, chat and JSON Schema generations
//! at every priority, `Cancel` and `Close` mid-stream, connections dropped mid-stream, streams
//! never read, `leanstream generate` processes killed with SIGKILL, floods of `OpenSession`.
//! Meanwhile, every [`SAMPLE_EVERY`]:
//! - the daemon's RSS stays ≤ budget + F (`PROCESS_OVERHEAD_BYTES`, docs/memory.md);
//! - every [`LEDGER_EVERY`]th sample, `Memory()`'s ledger stays ≤ the budget.
//!
//! At the end every stream the crowd read has ended (each step checks its own), no session is
//! left, no reservation either (once the model is unloaded the ledger is 0), the RSS without a
//! model is back within [`IDLE_RSS_GROWTH`] of what it was before the model was loaded, and a
//! greedy generation still gives the fixture's ids. The test prints what it did: steps of each kind and their
//! refusals, faults injected, peak RSS ÷ budget.
//!
//! `SOAK_SECONDS` sets the crowd's length (90 s by default, what the test command runs; a
//! release check runs `SOAK_SECONDS=600`), `SOAK_SEED` its draw (1 by default).

mod crowd;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use crowd::{Ctx, Op, Outcome};
use leanstream::contract::PROCESS_OVERHEAD_BYTES;
use leanstream_e2e::*;

/// Clients in the crowd, each drawing its own steps.
const ACTORS: u64 = 6;
/// The daemon's budget: the model (about 100 MiB) and a handful of sessions, so that the crowd
/// meets `OverBudget` and `Busy` too.
const BUDGET: &str = "144MiB";
/// How often the sampler reads the daemon's RSS.
const SAMPLE_EVERY: Duration = Duration::from_millis(5);
/// Every this many RSS samples, the sampler also asks for `Memory()`.
const LEDGER_EVERY: u64 = 20;
/// How much more the daemon may hold without a model after the crowd than before the model was
/// first loaded: allocator arenas and the thread stacks the crowd's concurrency touched. A leak
/// of one session's KV per step would pass it within a few dozen steps.
const IDLE_RSS_GROWTH: u64 = 24 << 20;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Counts by name: steps, refusals, faults.
#[derive(Default)]
struct Tally(Mutex<BTreeMap<String, u64>>);

impl Tally {
    fn add(&self, key: impl Into<String>, n: u64) {
        if let Ok(mut counts) = self.0.lock() {
            *counts.entry(key.into()).or_default() += n;
        }
    }

    fn get(&self, key: &str) -> u64 {
        self.0
            .lock()
            .map_or(0, |counts| counts.get(key).copied().unwrap_or(0))
    }

    fn print(&self) -> String {
        self.0.lock().map_or_else(
            |_| String::new(),
            |counts| {
                let lines: Vec<String> =
                    counts.iter().map(|(k, n)| format!("  {k}: {n}")).collect();
                lines.join("\n")
            },
        )
    }
}

/// One client of the crowd: draws and runs steps until `stop`.
async fn actor(
    ctx: Ctx,
    seed: u64,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> anyhow::Result<()> {
    let mut rng = fastrand::Rng::with_seed(seed);
    while !stop.load(Ordering::Relaxed) {
        let op = Op::draw(&mut rng);
        let name = format!("{op:?}").to_lowercase();
        let outcome = tokio::time::timeout(STREAM_LIMIT, crowd::run(op, &ctx, &mut rng))
            .await
            .with_context(|| format!("{name} did not finish within {STREAM_LIMIT:?}"))?
            .with_context(|| format!("actor {seed}: {name}"))?;
        tally.add(format!("{name} steps"), 1);
        match outcome {
            Outcome::Ran => {}
            Outcome::Refused(why) => tally.add(format!("{name} refused {why}"), 1),
            Outcome::FinishedFirst => tally.add("kill: finished before the signal", 1),
            Outcome::Flooded { opened, refused } => {
                tally.add("flood: sessions opened", opened);
                tally.add("flood: calls refused", refused);
            }
        }
    }
    Ok(())
}

/// What the sampler saw.
#[derive(Debug, Default)]
struct Samples {
    rss: u64,
    ledger: u64,
    peak_rss: u64,
    peak_used: u64,
    broken: Vec<String>,
}

/// Samples the daemon until `stop`: RSS every [`SAMPLE_EVERY`], the ledger every
/// [`LEDGER_EVERY`]th time.
async fn sample(
    pid: u32,
    observer: Client,
    budget: u64,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Samples> {
    let mut s = Samples::default();
    let rss_limit = budget + PROCESS_OVERHEAD_BYTES;
    while !stop.load(Ordering::Relaxed) {
        let rss = rss_bytes_of(pid)?;
        s.rss += 1;
        s.peak_rss = s.peak_rss.max(rss);
        if rss > rss_limit && s.broken.len() < 10 {
            s.broken
                .push(format!("RSS {rss} B > budget + F = {rss_limit} B"));
        }
        if s.rss % LEDGER_EVERY == 0 {
            let used = observer.manager.memory().await?.used_bytes;
            s.ledger += 1;
            s.peak_used = s.peak_used.max(used);
            if used > budget && s.broken.len() < 10 {
                s.broken
                    .push(format!("ledger {used} B > budget {budget} B"));
            }
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    Ok(s)
}

/// The memory report once no session and no other client is left (sessions close a moment
/// after their clients go). Waits at most 30 s.
async fn settled(observer: &Client) -> anyhow::Result<leanstream::contract::MemoryReport> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let report = observer.manager.memory().await?;
        let quiet = report.sessions.is_empty() && report.clients.is_empty();
        if quiet || Instant::now() > deadline {
            return Ok(report);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn a_random_crowd_cannot_break_the_budgets_promises() -> anyhow::Result<()> {
    let secs = env_or("SOAK_SECONDS", 90);
    let seed = env_or("SOAK_SEED", 1);
    let limit = Duration::from_secs(secs) + 2 * STREAM_LIMIT;
    runtime().block_on_within(limit, async {
        let bus = Arc::new(Bus::start()?);
        let cfg = DaemonConfig {
            budget: BUDGET.into(),
            capture_log: true,
            ..DaemonConfig::default()
        };
        let daemon = crate::start_daemon(&bus, &cfg).await?;
        let observer = Client::new(&bus).await?;
        let idle_rss = daemon.rss_bytes()?;
        // Pinned, the model stays loaded between sessions.
        observer.manager.load_model(MODEL).await?;
        let budget = observer.manager.memory().await?.budget_bytes;

        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let sampler_stop = Arc::new(AtomicBool::new(false));
        let sampler = tokio::spawn(sample(
            daemon.pid(),
            Client::new(&bus).await?,
            budget,
            sampler_stop.clone(),
        ));
        let cli = cli_binary();
        let mut actors = Vec::new();
        for a in 0..ACTORS {
            let ctx = Ctx {
                bus: bus.clone(),
                cli: cli.clone(),
                client: Client::new(&bus).await?,
            };
            actors.push(tokio::spawn(actor(
                ctx,
                seed * 1000 + a,
                stop.clone(),
                tally.clone(),
            )));
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(secs)
            && !actors.iter().any(|a| a.is_finished())
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let mut failures = Vec::new();
        for a in actors {
            if let Err(e) = a.await? {
                failures.push(format!("{e:#}"));
            }
        }
        let crowd_secs = started.elapsed().as_secs_f64();
        let left = settled(&observer).await?;
        sampler_stop.store(true, Ordering::Relaxed);
        let samples = sampler.await??;
        // Unloaded, the model takes its stored prefixes and compiled grammars with it: the
        // ledger must come back to nothing at all.
        observer.manager.unload_model(MODEL).await?;
        let end = settled_memory(&observer).await?;
        let end_rss = daemon.rss_bytes()?;

        let mib = |b: u64| b as f64 / f64::from(1 << 20);
        let steps: u64 = [
            "plain",
            "chat",
            "schema",
            "cancel",
            "close",
            "vanish",
            "neverread",
            "kill",
            "flood",
        ]
        .iter()
        .map(|k| tally.get(&format!("{k} steps")))
        .sum();
        eprintln!(
            "soak: seed {seed}, {crowd_secs:.0} s, {ACTORS} clients, {steps} steps:\n{}\n  \
             faults injected: {} connections dropped mid-stream, {} streams left unread, {} \
             processes killed, {} floods\n  samples: {} of RSS, {} of the ledger; peak RSS \
             {:.1} MiB = {:.2} × budget ({:.1} MiB; budget + F = {:.1} MiB); peak ledger {:.1} \
             MiB; RSS without a model {:.1} MiB before, {:.1} MiB after",
            tally.print(),
            tally.get("vanish steps")
                - tally.get("vanish refused Busy")
                - tally.get("vanish refused OverBudget"),
            tally.get("neverread steps")
                - tally.get("neverread refused Busy")
                - tally.get("neverread refused OverBudget"),
            tally.get("kill steps") - tally.get("kill: finished before the signal"),
            tally.get("flood steps"),
            samples.rss,
            samples.ledger,
            mib(samples.peak_rss),
            samples.peak_rss as f64 / budget as f64,
            mib(budget),
            mib(budget + PROCESS_OVERHEAD_BYTES),
            mib(samples.peak_used),
            mib(idle_rss),
            mib(end_rss),
        );
        if !failures.is_empty() {
            let log = daemon.log().unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            anyhow::bail!(
                "the crowd failed: {failures:#?}\ndaemon log, last lines:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        assert!(
            samples.broken.is_empty(),
            "the budget's promises broke: {:#?}",
            samples.broken
        );
        assert!(samples.ledger >= 10, "too few ledger samples: {samples:?}");
        assert!(
            left.sessions.is_empty() && left.clients.is_empty(),
            "sessions left after the crowd: {left:?}"
        );
        assert!(
            end.used_bytes == 0 && end.models.is_empty(),
            "reservations left once the model is unloaded: {end:?}"
        );
        assert!(
            end_rss <= idle_rss + IDLE_RSS_GROWTH,
            "the RSS of the daemon without a model grew from {:.1} to {:.1} MiB over the crowd",
            mib(idle_rss),
            mib(end_rss)
        );
        for kind in ["plain", "chat", "schema", "cancel", "kill", "flood"] {
            assert!(
                tally.get(&format!("{kind} steps")) > 0,
                "no {kind} step ran:\n{}",
                tally.print()
            );
        }
        // The model loads again and generates the fixture's tokens.
        let out = generate_once(&observer, STORY_PROMPT, 16).await?;
        assert_eq!(out.ids, STORY_GREEDY, "greedy output after the crowd");
        Ok(())
    })
}
