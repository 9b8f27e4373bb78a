//! The memory budget with real parts: a private dbus-daemon, the real leanstreamd, the real
//! model. The process's resident memory must stay within the budget plus the documented fixed
//! overhead F at every sample, the ledger within the budget, and clients that vanish or hoard
//! must leave nothing behind and take nothing from the others.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leanstream::contract::{
    BUS_NAME, MANAGER_INTERFACE, MANAGER_PATH, PROCESS_OVERHEAD_BYTES, StreamEvent,
};
use leanstream_e2e::*;

/// Links the real model into the daemon's model directory under `name` (dense, GGUF).
fn add_model(daemon: &Daemon, name: &str) -> anyhow::Result<()> {
    let target = daemon
        .dir
        .path()
        .join("models")
        .join(format!("{name}.gguf"));
    let source = real_model().canonicalize()?;
    if std::fs::hard_link(&source, &target).is_err() {
        std::fs::copy(&source, &target)?;
    }
    Ok(())
}

/// Sends `OpenSession` (or `LoadModel`) on a fresh connection and closes it at once, without
/// waiting for the answer.
async fn open_and_vanish(bus: &Bus, i: usize) -> anyhow::Result<()> {
    let conn = bus.connect().await?;
    let msg = if i % 4 == 3 {
        zbus::Message::method_call(MANAGER_PATH, "LoadModel")?
            .destination(BUS_NAME)?
            .interface(MANAGER_INTERFACE)?
            .build(&(MODEL,))?
    } else {
        zbus::Message::method_call(MANAGER_PATH, "OpenSession")?
            .destination(BUS_NAME)?
            .interface(MANAGER_INTERFACE)?
            .build(&(MODEL, 64u32))?
    };
    conn.send(&msg).await?;
    // Every third one waits a moment, so the daemon sees the request before the disconnect
    // sometimes, and after it other times.
    if i.is_multiple_of(3) {
        tokio::task::yield_now().await;
    }
    drop(conn);
    Ok(())
}

#[test]
fn clients_that_open_and_vanish_leave_no_session_behind() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            max_sessions: 16,
            ..DaemonConfig::default()
        };
        let daemon = crate::start_daemon(&bus, &cfg).await?;
        let normal = Client::new(&bus).await?;
        normal.manager.load_model(MODEL).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        // A normal client generates all along and must be served every time.
        let worker = {
            let (stop, served) = (Arc::clone(&stop), Arc::clone(&served));
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let out = generate_once(&normal, STORY_PROMPT, 2).await?;
                    anyhow::ensure!(out.ids == STORY_GREEDY[..2], "{:?}", out.end);
                    served.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(normal)
            })
        };
        for i in 0..1000 {
            open_and_vanish(&bus, i).await?;
        }
        stop.store(true, Ordering::Relaxed);
        let normal = worker.await??;
        assert!(
            served.load(Ordering::Relaxed) > 0,
            "the normal client was served"
        );
        // Every vanished client's session is closed once the daemon has seen it go.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let report = normal.manager.memory().await?;
            if report.sessions.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} sessions left behind: {:?}",
                report.sessions.len(),
                report.sessions
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The daemon still has room for a full set of sessions.
        let mut open = Vec::new();
        for _ in 0..4 {
            open.push(normal.open(64).await?);
        }
        drop(open);
        drop(daemon);
        Ok(())
    })
}

#[test]
fn one_client_cannot_hoard_sessions_or_models() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            budget: "1GiB".into(),
            max_sessions: 8,
            extra: "max_sessions_per_client = 3\nmax_pins_per_client = 2\n".into(),
            ..DaemonConfig::default()
        };
        let daemon = crate::start_daemon(&bus, &cfg).await?;
        add_model(&daemon, "second")?;
        add_model(&daemon, "third")?;
        // Limits are per user: the other client must be another user (the tests run as root).
        let other_user = match unprivileged_users() {
            Ok([user, _]) => user,
            Err(why) => {
                eprintln!("one_client_cannot_hoard_sessions_or_models: skipped, {why}");
                return Ok(());
            }
        };
        let hoarder = Client::new(&bus).await?;
        let other = Client::new_as(&bus, &other_user).await?;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(hoarder.open(64).await?);
        }
        assert_eq!(
            error_name(hoarder.manager.open_session(MODEL, 64).await),
            "Busy"
        );
        // Another client is served beside it.
        let out = generate_once(&other, STORY_PROMPT, 2).await?;
        assert_eq!(out.ids, STORY_GREEDY[..2]);
        // Pins: two models, then Busy; pinning one again is free.
        hoarder.manager.load_model("second").await?;
        hoarder.manager.load_model(MODEL).await?;
        hoarder.manager.load_model("second").await?;
        assert_eq!(
            error_name(hoarder.manager.load_model("third").await),
            "Busy"
        );
        other.manager.load_model("third").await?;
        // Unloading frees a pin.
        hoarder.manager.unload_model("second").await?;
        hoarder.manager.load_model("third").await?;
        for s in held {
            s.close().await?;
        }
        Ok(())
    })
}

/// The memory report without the sampled RSS, for before/after comparisons.
fn ledger(mut r: leanstream::contract::MemoryReport) -> leanstream::contract::MemoryReport {
    r.rss_bytes = 0;
    r
}

#[test]
fn the_process_stays_within_its_budget_while_clients_generate_and_models_come_and_go()
-> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let budget: u64 = 200 << 20;
        let cfg = DaemonConfig {
            budget: format!("{budget}"),
            max_sessions: 12,
            max_context: 256,
            // Every client here is root, one user: its pins are counted together.
            extra: "max_pins_per_client = 8\n[models.stream]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 0.5\n"
                .into(),
            ..DaemonConfig::default()
        };
        let daemon = crate::start_daemon(&bus, &cfg).await?;
        let lsm = real_lsm();
        let target = daemon.dir.path().join("models").join("stream.lsm");
        if std::fs::hard_link(&lsm, &target).is_err() {
            std::fs::copy(&lsm, &target)?;
        }
        for name in ["third", "fourth", "fifth"] {
            add_model(&daemon, name)?;
        }
        let limit = budget + PROCESS_OVERHEAD_BYTES;

        // Sample RSS and the ledger every 100 ms until told to stop.
        let stop = Arc::new(AtomicBool::new(false));
        let observer = Client::new(&bus).await?;
        let pid = daemon.pid();
        let sampler = {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let (mut peak_rss, mut peak_used, mut samples) = (0u64, 0u64, 0u32);
                while !stop.load(Ordering::Relaxed) {
                    let rss = rss_bytes_of(pid)?;
                    let report = observer.manager.memory().await?;
                    anyhow::ensure!(
                        report.used_bytes <= report.budget_bytes,
                        "ledger {} over the budget {}",
                        report.used_bytes,
                        report.budget_bytes
                    );
                    peak_rss = peak_rss.max(rss);
                    peak_used = peak_used.max(report.used_bytes);
                    samples += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                anyhow::Ok((peak_rss, peak_used, samples, observer))
            })
        };

        // Eight clients hold conversations whose context grows turn by turn.
        let mut talkers = Vec::new();
        for i in 0..8 {
            let c = Client::new(&bus).await?;
            talkers.push(tokio::spawn(async move {
                let s = c.open(256).await?;
                let mut prompt = format!("Robot {i} reports: the arm moved to position {i}.");
                let (mut tokens, mut over) = (0usize, 0usize);
                for turn in 0..3 {
                    // A prompt whose KV does not fit is refused as the reply, before it runs; a
                    // generation that grows past the budget later ends with an event.
                    let fd = match s.generate(&prompt, &greedy(24)).await {
                        Ok(fd) => fd,
                        Err(e) if error_name::<()>(Err(e.clone())) == "OverBudget" => {
                            over += 1;
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let out = read_stream(fd).await?;
                    match &out.end {
                        Some(StreamEvent::Done { .. }) => {}
                        Some(StreamEvent::Error { name, .. }) if name == "OverBudget" => over += 1,
                        other => anyhow::bail!("client {i} turn {turn}: {other:?}"),
                    }
                    tokens += out.ids.len();
                    prompt.push_str(&out.text);
                    prompt.push_str(&format!(" Next step {turn}."));
                }
                s.close().await?;
                anyhow::Ok((tokens, over))
            }));
        }
        // Meanwhile a streaming model loads, serves a session and unloads, again and again.
        let loader = Client::new(&bus).await?;
        let mut cycles = 0;
        let mut refused_loads = 0;
        while talkers.iter().any(|t| !t.is_finished()) {
            match loader
                .manager
                .load_model("stream")
                .await
                .map_err(Into::into)
            {
                Ok(()) => {
                    // The model fitted, but its session may not: the talkers' sessions hold the
                    // rest. A refused open is a refusal like a refused load.
                    let path = match loader.manager.open_session("stream", 64).await {
                        Ok(path) => path,
                        Err(e) if error_name::<()>(Err(e.clone())) == "OverBudget" => {
                            loader.manager.unload_model("stream").await?;
                            refused_loads += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let s = session_proxy(&loader.conn, path).await?;
                    // The session opened, but growing it for the prompt may not fit either.
                    match s.generate("Hello", &greedy(4)).await {
                        Ok(fd) => {
                            let out = read_stream(fd).await?;
                            anyhow::ensure!(out.end.is_some(), "the streaming session's stream ended");
                            cycles += 1;
                        }
                        Err(e) if error_name::<()>(Err(e.clone())) == "OverBudget" => {
                            refused_loads += 1;
                        }
                        Err(e) => return Err(e.into()),
                    }
                    s.close().await?;
                    loader.manager.unload_model("stream").await?;
                }
                Err(leanstream::contract::LeanStreamError::OverBudget(_)) => {
                    refused_loads += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => anyhow::bail!("loading the streaming model: {e}"),
            }
        }
        let mut tokens = 0;
        for t in talkers {
            tokens += t.await??.0;
        }
        assert!(tokens > 0, "the talkers generated");
        assert!(cycles + refused_loads > 0);

        // A request that does not fit leaves the ledger as it was.
        let quiet = Client::new(&bus).await?;
        // Unloaded models' memory is handed back a moment after the unload.
        settled_memory(&quiet).await?;
        quiet.manager.load_model(MODEL).await?;
        // Models load one after another until one does not fit: a 200 MiB budget holds at most
        // two copies of the ~100 MB model, so the refusal comes by the third of these.
        // Each load comes from its own client, kept connected (its pins count against the one
        // user all these clients are, whose limit this test raises).
        let (mut refused, mut loaders) = (None, Vec::new());
        for name in ["third", "fourth", "fifth"] {
            let before = ledger(settled_memory(&quiet).await?);
            let client = Client::new(&bus).await?;
            let answer = error_name(client.manager.load_model(name).await);
            loaders.push(client);
            if answer != "ok: ()" {
                assert_eq!(answer, "OverBudget", "loading {name}");
                refused = Some((name, before));
                break;
            }
        }
        let (name, before) = refused.expect("one of three more models is refused");
        assert_eq!(
            ledger(quiet.manager.memory().await?),
            before,
            "the refused load of {name} left the ledger as it was"
        );

        stop.store(true, Ordering::Relaxed);
        let (peak_rss, peak_used, samples, _) = sampler.await??;
        eprintln!(
            "budget {budget} B, F {PROCESS_OVERHEAD_BYTES} B: peak RSS {peak_rss} B ({:.2} of \
             the budget), peak ledger {peak_used} B, {samples} samples, {tokens} tokens, \
             {cycles} load cycles, {refused_loads} refused loads",
            peak_rss as f64 / budget as f64
        );
        assert!(samples > 5, "{samples} samples");
        assert!(
            peak_rss <= limit,
            "peak RSS {peak_rss} B over budget + F = {limit} B"
        );
        Ok(())
    })
}
