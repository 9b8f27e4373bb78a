//! The endpoint's life around requests: a client that leaves mid-generation leaves no daemon
//! session behind; it listens only on loopback or its Unix socket (mode 0660, replacing a stale
//! one).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::*;
use serde_json::json;

/// A request that generates for a long time: a raw prompt the model keeps counting on.
fn long_completion(stream: bool) -> serde_json::Value {
    json!({
        "model": MODEL,
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "max_tokens": 1000,
        "temperature": 0,
        "stream": stream,
    })
}

/// A daemon that lets a generation run long (1000 tokens take seconds on the test machine).
fn long_config() -> DaemonConfig {
    DaemonConfig {
        max_context: 2048,
        max_tokens: 1024,
        ..DaemonConfig::default()
    }
}

/// Waits until the daemon has exactly `n` sessions.
async fn sessions_become(bus: &Bus, n: usize, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let sessions = daemon_sessions(bus).await?;
        if sessions.len() == n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("expected {n} sessions, the daemon has {sessions:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn a_client_leaving_mid_stream_leaves_no_session() -> Result<()> {
    let bus = Bus::start()?;
    let rt = runtime();
    let _daemon = rt.block_on(Daemon::start(&bus, &long_config()))?;
    let endpoint = Endpoint::tcp(&bus)?;
    let t = &endpoint.target;
    rt.block_on(async {
        // Streamed: read a few chunks, then hang up.
        let mut response = send(t, "POST", "/v1/completions", Some(&long_completion(true))).await?;
        assert_eq!(response.status, 200);
        let mut reader = SseReader::default();
        let mut chunks = 0;
        while chunks < 3 {
            let bytes = response
                .next_bytes()
                .await?
                .context("the stream ended early")?;
            let events = reader.push(&bytes)?;
            assert!(
                !events.iter().any(|e| e == "[DONE]"),
                "it ended before the test hung up"
            );
            chunks += events.len();
        }
        assert_eq!(
            daemon_sessions(&bus).await?.len(),
            1,
            "the generation's session"
        );
        let hung_up = Instant::now();
        drop(response);
        no_sessions_within(&bus, Duration::from_secs(5)).await?;
        eprintln!(
            "session closed {:?} after the client hung up",
            hung_up.elapsed()
        );

        // Not streamed: hang up while the answer is being generated.
        let body = long_completion(false);
        let target = t.clone();
        let request = tokio::spawn(async move {
            send(&target, "POST", "/v1/completions", Some(&body))
                .await
                .map(|r| r.status)
        });
        sessions_become(&bus, 1, Duration::from_secs(10)).await?;
        request.abort();
        let _ = request.await;
        no_sessions_within(&bus, Duration::from_secs(5)).await?;

        // The endpoint still serves.
        let (status, answer) = post(t, "/v1/chat/completions", &chat_body("Hi", 4)).await?;
        assert_eq!(status, 200, "{answer}");
        no_sessions_within(&bus, Duration::from_secs(5)).await?;
        Ok(())
    })
}

#[test]
fn it_listens_on_loopback_only() -> Result<()> {
    for address in ["0.0.0.0:0", "192.168.1.10:8080", "[::]:8080", "10.1.2.3:80"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_leanstream-openai"))
            .args(["--bus", "unix:path=/nonexistent", "--listen", address])
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{address} was accepted");
        assert!(
            stderr.contains("not a loopback address"),
            "{address}: {stderr}"
        );
    }
    Ok(())
}

#[test]
fn unix_socket_is_0660_replaces_a_stale_one_and_serves() -> Result<()> {
    let bus = Bus::start()?;
    let rt = runtime();
    let _daemon = rt.block_on(Daemon::start(&bus, &DaemonConfig::default()))?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("openai.sock");
    // A stale socket file, as a crashed endpoint leaves it.
    drop(std::os::unix::net::UnixListener::bind(&path)?);
    let endpoint = Endpoint::start(&bus.address, &format!("unix:{}", path.display()), &[])?;
    let mode = std::fs::metadata(&path)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    // A second endpoint on the live socket is refused.
    let second = std::process::Command::new(env!("CARGO_BIN_EXE_leanstream-openai"))
        .args([
            "--bus",
            &bus.address,
            "--listen",
            &format!("unix:{}", path.display()),
        ])
        .output()?;
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("in use"));
    rt.block_on(async {
        let (status, answer) = post(
            &endpoint.target,
            "/v1/chat/completions",
            &chat_body("Hi", 4),
        )
        .await?;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["usage"]["completion_tokens"], 4);
        Ok::<_, anyhow::Error>(())
    })?;
    drop(endpoint);
    assert!(!path.exists(), "the endpoint removes its socket at exit");
    Ok(())
}
