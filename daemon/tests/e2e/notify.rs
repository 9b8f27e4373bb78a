//! Under systemd (`Type=notify`, `WatchdogSec`): the daemon says it is ready once it serves the
//! bus name, then pings the watchdog for as long as its state owner and scheduler answer.

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use leanstream_e2e::*;

#[test]
fn the_daemon_tells_systemd_it_is_ready_then_keeps_the_watchdog_fed() -> anyhow::Result<()> {
    runtime().block_on(async {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("notify");
        let systemd = UnixDatagram::bind(&socket)?;
        systemd.set_read_timeout(Some(Duration::from_secs(10)))?;
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            env: vec![
                ("NOTIFY_SOCKET".into(), socket.display().to_string()),
                // A watchdog of 0.4 s: a ping at least every 0.2 s.
                ("WATCHDOG_USEC".into(), "400000".into()),
            ],
            ..DaemonConfig::default()
        };
        let started = Instant::now();
        let daemon = crate::start_daemon(&bus, &cfg).await?;
        let messages = tokio::task::spawn_blocking(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 256];
            while got
                .iter()
                .filter(|m: &&String| m.contains("WATCHDOG=1"))
                .count()
                < 5
            {
                let n = systemd.recv(&mut buf)?;
                got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
            anyhow::Ok(got)
        })
        .await??;
        assert!(messages[0].contains("READY=1"), "{messages:?}");
        // Five pings came within the time a watchdog of 0.4 s allows for them.
        assert!(started.elapsed() < Duration::from_secs(10), "{messages:?}");
        // The daemon answers calls all the while.
        let c = Client::new(&bus).await?;
        let out = generate_once(&c, STORY_PROMPT, 2).await?;
        assert_eq!(out.ids, STORY_GREEDY[..2]);
        daemon.terminate()?;
        Ok(())
    })
}
