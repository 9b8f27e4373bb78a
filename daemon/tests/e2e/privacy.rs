//! Tokens never travel on the bus: a bus monitor (`BecomeMonitor` with no rules) and an
//! eavesdropping client (`AddMatch` with `eavesdrop='true'` and an empty rule) record every
//! message they get while another client generates; none of it carries the generated text. The
//! harness bus allows eavesdropping, the worst case of a session bus.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_lite::StreamExt;
use leanstream::contract::SESSION_INTERFACE;
use leanstream_e2e::*;
use zbus::message::Type as MsgType;

/// The 16 greedy tokens of [`STORY_PROMPT`], as text.
const EXPECTED_TEXT: &str = " girl named Emma who loved to play in the sun. She would often go to";

type Log = Arc<Mutex<Vec<zbus::Message>>>;

/// Records every message `conn` receives from now on, until the returned task is aborted.
fn record(conn: &zbus::Connection) -> (Log, tokio::task::JoinHandle<()>) {
    let log: Log = Arc::default();
    let mut stream = zbus::MessageStream::from(conn);
    let sink = log.clone();
    let task = tokio::spawn(async move {
        while let Some(msg) = stream.next().await {
            if let Ok(msg) = msg
                && let Ok(mut log) = sink.lock()
            {
                log.push(msg);
            }
        }
    });
    (log, task)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// The messages of `log` whose bytes (header and body) contain one of `secrets`, described.
fn leaks(log: &Log, secrets: &[String]) -> Vec<String> {
    let log = log.lock().map(|l| l.clone()).unwrap_or_default();
    let mut found = Vec::new();
    for msg in &log {
        let bytes: &[u8] = msg.data();
        for s in secrets {
            if contains(bytes, s.as_bytes()) {
                found.push(format!("{s:?} in {msg}"));
            }
        }
    }
    found
}

#[test]
fn a_bus_monitor_and_an_eavesdropper_never_see_generated_text() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;

        // The monitor: the stream exists before the call, so nothing after the reply is missed.
        let monitor = bus.connect().await?;
        let (monitor_log, monitor_task) = record(&monitor);
        monitor
            .call_method(
                Some("org.freedesktop.DBus"),
                "/org/freedesktop/DBus",
                Some("org.freedesktop.DBus.Monitoring"),
                "BecomeMonitor",
                &(&[] as &[&str], 0u32),
            )
            .await?;

        // The eavesdropper: an ordinary connection asking for everything.
        let eavesdropper = bus.connect().await?;
        let (eaves_log, eaves_task) = record(&eavesdropper);
        for rule in ["eavesdrop='true'", ""] {
            eavesdropper
                .call_method(
                    Some("org.freedesktop.DBus"),
                    "/org/freedesktop/DBus",
                    Some("org.freedesktop.DBus"),
                    "AddMatch",
                    &(rule,),
                )
                .await?;
        }

        // The generating client.
        let client = Client::new(&bus).await?;
        let me = client.conn.unique_name().map(|n| n.to_string());
        let session = client.open(128).await?;
        let fd = session.generate(STORY_PROMPT, &greedy(16)).await?;
        let out = read_stream(fd).await?;
        session.close().await?;
        assert_eq!(out.ids, STORY_GREEDY);
        assert_eq!(out.text, EXPECTED_TEXT);
        // A last round trip after the generation, then time for the bus to deliver it.
        let _ = client.manager.memory().await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        monitor_task.abort();
        eaves_task.abort();

        // The secrets: the joined text and every token but the shortest ones (" to", " in",
        // ".", …: a two-letter word may well appear in an unrelated string, such as an error
        // message of the bus; longer ones are covered through the joined text and neighbours).
        let mut secrets: Vec<String> = vec![out.text.clone()];
        for t in &out.tokens {
            if t.trim().len() >= 3 {
                secrets.push(t.clone());
            }
        }
        for pair in out.tokens.windows(2) {
            secrets.push(pair.concat());
        }
        // The prompt is the request and travels on the bus: a token that happens to occur in it
        // (" the" in " there") tells nothing.
        secrets.retain(|s| !STORY_PROMPT.contains(s.as_str()));
        for must in [" Emma", " loved", " sun", " girl", " named"] {
            assert!(secrets.iter().any(|s| s == must), "{must:?} in {secrets:?}");
        }

        // The monitor really monitored: it saw the Generate call and its reply.
        let seen = monitor_log.lock().map(|l| l.clone()).unwrap_or_default();
        let call = seen.iter().find(|m| {
            let h = m.header();
            m.message_type() == MsgType::MethodCall
                && h.member().map(|n| n.as_str()) == Some("Generate")
                && h.interface().map(|i| i.as_str()) == Some(SESSION_INTERFACE)
                && h.sender().map(|s| s.to_string()) == me
        });
        let call = call.ok_or_else(|| {
            anyhow::anyhow!(
                "the monitor did not see the Generate call ({} messages)",
                seen.len()
            )
        })?;
        // The prompt travels on the bus (that is the request); the generated text must not.
        assert!(contains(call.data(), STORY_PROMPT.as_bytes()));
        let serial = call.primary_header().serial_num();
        let reply = seen.iter().any(|m| {
            let h = m.header();
            m.message_type() == MsgType::MethodReturn
                && h.reply_serial() == Some(serial)
                && h.destination().map(|d| d.to_string()) == me
        });
        assert!(reply, "the monitor did not see the reply to Generate");

        let monitor_leaks = leaks(&monitor_log, &secrets);
        assert!(
            monitor_leaks.is_empty(),
            "the monitor saw {monitor_leaks:#?}"
        );
        let eaves_leaks = leaks(&eaves_log, &secrets);
        assert!(
            eaves_leaks.is_empty(),
            "the eavesdropper saw {eaves_leaks:#?}"
        );
        let eaves_count = eaves_log.lock().map(|l| l.len()).unwrap_or_default();
        eprintln!(
            "monitor: {} messages, eavesdropper: {eaves_count} messages, {} secrets checked",
            seen.len(),
            secrets.len()
        );
        Ok(())
    })
}
