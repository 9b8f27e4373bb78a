//! Model lifetime: `keep_alive` (how long a model without sessions stays loaded), `preload`
//! (loaded at start and kept) and `LoadModelFor` (a client's lifetime instead of a pin), as
//! `Memory()` and `ListModels` report them.

use std::time::{Duration, Instant};

use leanstream::contract::ModelMemory;
use leanstream_e2e::*;

/// The model's line in `Memory()`, if it is loaded.
async fn loaded(c: &Client) -> anyhow::Result<Option<ModelMemory>> {
    let report = c.manager.memory().await?;
    Ok(report.models.into_iter().find(|m| m.name == MODEL))
}

/// Starts a daemon whose `[models.smollm2]` table is `table`.
async fn daemon_with(bus: &Bus, table: &str) -> anyhow::Result<Daemon> {
    let cfg = DaemonConfig {
        extra: format!("[models.{MODEL}]\n{table}\n"),
        ..DaemonConfig::default()
    };
    crate::start_daemon(bus, &cfg).await
}

/// Opens a session, generates a token and closes it; returns when it closed.
async fn use_once(c: &Client) -> anyhow::Result<Instant> {
    let out = generate_once(c, STORY_PROMPT, 1).await?;
    anyhow::ensure!(out.ids == STORY_GREEDY[..1], "{:?}", out.end);
    Ok(Instant::now())
}

#[test]
fn a_model_stays_loaded_for_its_keep_alive_after_the_last_session_then_unloads()
-> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = daemon_with(&bus, "keep_alive = 2").await?;
        let c = Client::new(&bus).await?;
        let closed = use_once(&c).await?;
        let m = loaded(&c)
            .await?
            .ok_or_else(|| anyhow::anyhow!("unloaded at the last close despite keep_alive"))?;
        assert!((0..=2).contains(&m.unload_in_seconds), "{m:?}");
        // A session in the meantime restarts the wait.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let closed = closed.max(use_once(&c).await?);
        let deadline = Instant::now() + Duration::from_secs(15);
        while loaded(&c).await?.is_some() {
            assert!(
                Instant::now() < deadline,
                "still loaded 15 s after its keep_alive"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let idle = closed.elapsed();
        assert!(
            idle >= Duration::from_millis(1900),
            "unloaded after {idle:?} idle"
        );
        // And it loads again on demand.
        use_once(&c).await?;
        Ok(())
    })
}

#[test]
fn keep_alive_minus_one_keeps_a_model_and_preload_loads_it_at_start() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let daemon = daemon_with(&bus, "keep_alive = -1").await?;
        let c = Client::new(&bus).await?;
        use_once(&c).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let m = loaded(&c)
            .await?
            .ok_or_else(|| anyhow::anyhow!("keep_alive = -1 unloaded the model"))?;
        assert_eq!(m.unload_in_seconds, -1, "{m:?}");
        assert!(m.idle_seconds >= 1, "{m:?}");
        drop(c);
        drop(daemon);

        let bus = Bus::start()?;
        let _daemon = daemon_with(&bus, "preload = true").await?;
        let c = Client::new(&bus).await?;
        // Nobody asked for it: it is loading or loaded from the start.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !c
            .manager
            .list_models()
            .await?
            .iter()
            .any(|m| m.name == MODEL && m.loaded)
        {
            assert!(
                Instant::now() < deadline,
                "the preloaded model never loaded"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Pinned: a session coming and going does not unload it.
        use_once(&c).await?;
        let m = loaded(&c)
            .await?
            .ok_or_else(|| anyhow::anyhow!("a preloaded model unloaded"))?;
        assert_eq!(m.unload_in_seconds, -1, "{m:?}");
        Ok(())
    })
}

#[test]
fn load_model_for_keeps_a_model_its_lifetime_without_sessions_and_refuses_zero()
-> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        // Configured to unload at the last close: only the asked lifetime keeps it.
        let _daemon = daemon_with(&bus, "keep_alive = 0").await?;
        let c = Client::new(&bus).await?;
        for bad in [0, -2, KEEP_ALIVE_TOO_LONG] {
            let r = c.manager.load_model_for(MODEL, bad).await;
            assert_eq!(error_name(r), "InvalidArgument", "{bad}");
        }
        assert!(
            loaded(&c).await?.is_none(),
            "a refused call loaded the model"
        );

        let asked = Instant::now();
        c.manager.load_model_for(MODEL, 2).await?;
        let m = loaded(&c)
            .await?
            .ok_or_else(|| anyhow::anyhow!("LoadModelFor did not load the model"))?;
        assert!((0..=2).contains(&m.unload_in_seconds), "{m:?}");
        // Not a pin: UnloadModel is not needed, and a session's close restarts the wait.
        let closed = use_once(&c).await?;
        assert!(loaded(&c).await?.is_some(), "unloaded at the last close");
        let deadline = Instant::now() + Duration::from_secs(15);
        while loaded(&c).await?.is_some() {
            assert!(
                Instant::now() < deadline,
                "still loaded 15 s after its lifetime"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            closed.elapsed() >= Duration::from_millis(1900),
            "unloaded {:?} after the last close, {:?} after the call",
            closed.elapsed(),
            asked.elapsed()
        );

        // -1 pins, as LoadModel does.
        c.manager.load_model_for(MODEL, -1).await?;
        use_once(&c).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let m = loaded(&c)
            .await?
            .ok_or_else(|| anyhow::anyhow!("-1 did not pin the model"))?;
        assert_eq!(m.unload_in_seconds, -1, "{m:?}");
        Ok(())
    })
}

/// One second more than the longest lifetime the contract accepts (a week).
const KEEP_ALIVE_TOO_LONG: i64 = 604_801;
