//! The client library, the blocking wrapper, the CLI and the Python example against a mock
//! `leanstreamd` on a private `dbus-daemon` (see `support`): real bus, real fd passing, canned
//! generations. Skips (saying so) where `dbus-daemon` is not installed.

use crate::support::{MockDaemon, TestBus, cli, text};
use leanstream::contract::{ChatTurn, GenerateParams, LeanStreamError, StreamEvent};
use leanstream::{Bus, Client, Error};
use serde_json::Value;

fn bus(address: &str) -> Bus {
    address.parse().expect("dbus-daemon prints a valid address")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_client_round_trip() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let _daemon = MockDaemon::start(&test_bus.address);
    let client = Client::connect(&bus(&test_bus.address))
        .await
        .expect("connect");

    let models = client.list_models().await.expect("list");
    assert_eq!(models.len(), 2);
    assert_eq!(client.version().await.expect("version"), "0.0.0-mock");
    assert_eq!(client.backend().await.expect("backend"), "cpu");
    client.load("other").await.expect("load");
    match client.load("nosuch").await {
        Err(Error::Daemon(LeanStreamError::ModelNotFound(m))) => assert!(m.contains("nosuch")),
        other => panic!("expected ModelNotFound, got {other:?}"),
    }
    match client.unload("tiny").await {
        Err(Error::Daemon(LeanStreamError::Busy(_))) => {}
        other => panic!("expected Busy, got {other:?}"),
    }
    match client.open_session("tiny", u32::MAX).await {
        Err(Error::Daemon(LeanStreamError::OverBudget(_))) => {}
        other => panic!("expected OverBudget, got {other:?}"),
    }

    let session = client.open_session("tiny", 512).await.expect("open");
    assert!(
        session
            .path()
            .as_str()
            .starts_with("/io/github/leanstream/LeanStream1/session/")
    );

    // Streamed event by event.
    let mut stream = session
        .generate("hi", &GenerateParams::default())
        .await
        .expect("generate");
    let mut text = String::new();
    let mut done = None;
    while let Some(event) = stream.next_event().await {
        match event.expect("no stream error") {
            StreamEvent::Token { text: t, .. } => text.push_str(&t),
            StreamEvent::Done { reason, .. } => done = Some(reason),
            StreamEvent::Sentence { .. } => unreachable!("no sentences were asked for"),
            StreamEvent::Error { .. } => unreachable!("errors come as Err"),
        }
    }
    assert_eq!(text, "echo: hi");
    assert_eq!(done.as_deref(), Some("eos"));

    // Collected, with a token limit.
    let params = GenerateParams {
        max_tokens: 3,
        ..GenerateParams::default()
    };
    let generation = session
        .generate("hello", &params)
        .await
        .expect("generate")
        .finish()
        .await
        .expect("finish");
    assert_eq!(generation.text, "ech");
    assert_eq!(generation.ids, vec!['e' as u32, 'c' as u32, 'h' as u32]);
    assert_eq!(generation.reason, "max_tokens");
    assert_eq!(generation.stats.generated_tokens, 3);

    // Failures: a method error, an error event, EOF without done.
    match session.generate("", &GenerateParams::default()).await {
        Err(Error::Daemon(LeanStreamError::InvalidArgument(_))) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let failed = session
        .generate("fail", &GenerateParams::default())
        .await
        .expect("starts");
    match failed.finish().await {
        Err(Error::Daemon(LeanStreamError::Internal(m))) => assert!(m.contains("on purpose")),
        other => panic!("expected Internal, got {other:?}"),
    }
    let cut = session
        .generate("truncate", &GenerateParams::default())
        .await
        .expect("starts");
    assert!(matches!(
        cut.finish().await,
        Err(Error::Truncated { tokens: 3 })
    ));

    let chat = [
        ChatTurn {
            role: "user".into(),
            content: "a".into(),
        },
        ChatTurn {
            role: "assistant".into(),
            content: "b".into(),
        },
        ChatTurn {
            role: "user".into(),
            content: "c".into(),
        },
    ];
    let reply = session
        .generate_chat(&chat, &GenerateParams::default())
        .await
        .expect("chat")
        .finish()
        .await
        .expect("finish");
    assert_eq!(reply.text, "turn 2: c");

    session.cancel().await.expect("cancel");
    let stats = session.stats().await.expect("stats");
    assert_eq!((stats.model.as_str(), stats.context_tokens), ("tiny", 512));
    assert_eq!(stats.generations, 6);
    let report = client.memory().await.expect("memory");
    assert_eq!(report.budget_bytes, 64 << 20);

    let path = session.path().to_owned();
    session.close().await.expect("close");
    let gone = leanstream::SessionHandle::attach(client.connection(), path.into())
        .await
        .expect("a proxy needs no call");
    assert!(
        gone.stats().await.is_err(),
        "a closed session still answers"
    );
}

#[test]
fn blocking_client_round_trip() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let _daemon = MockDaemon::start(&test_bus.address);
    let client = leanstream::blocking::Client::connect(&bus(&test_bus.address)).expect("connect");
    assert_eq!(client.list_models().expect("list").len(), 2);
    let session = client.open_session("tiny", 0).expect("open");
    let events: Vec<_> = session
        .generate("ok", &GenerateParams::default())
        .expect("generate")
        .collect::<Result<_, _>>()
        .expect("no stream error");
    assert_eq!(events.len(), "echo: ok".len() + 1);
    assert!(matches!(events.last(), Some(StreamEvent::Done { .. })));
    let mut seen = String::new();
    let generation = session
        .generate("x", &GenerateParams::default())
        .expect("generate")
        .finish_with(|t| seen.push_str(t))
        .expect("finish");
    assert_eq!(
        (seen.as_str(), generation.text.as_str()),
        ("echo: x", "echo: x")
    );
    session.close().expect("close");
}

#[tokio::test]
async fn no_daemon_on_the_bus_is_unreachable() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let client = Client::connect(&bus(&test_bus.address))
        .await
        .expect("the bus is there");
    let e = client.list_models().await.expect_err("no daemon");
    assert!(matches!(e, Error::NotRunning { .. }), "{e:?}");
}

#[tokio::test]
async fn no_bus_is_unreachable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let address = format!("unix:path={}/missing", dir.path().display());
    let e = Client::connect(&bus(&address))
        .await
        .expect_err("no socket");
    assert!(matches!(e, Error::Connect { .. }), "{e:?}");
    assert!(e.is_unreachable());
}

#[test]
fn cli_against_the_mock_daemon() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let _daemon = MockDaemon::start(&test_bus.address);
    let a = test_bus.address.as_str();

    let out = cli(a, &["models"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|l| {
            l.split("  ")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect()
        })
        .collect();
    assert_eq!(
        lines[0],
        ["NAME", "FORMAT", "ARCH", "QUANTIZATION", "SIZE", "LOADED"],
        "{table}"
    );
    assert_eq!(
        lines[1],
        ["tiny", "lsm", "llama", "q8_0 100%", "3.0 MiB", "yes"],
        "{table}"
    );

    // Streams text; the only loaded model is picked; the prompt goes in as a user message.
    let out = cli(a, &["generate", "hello robot"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "turn 1: hello robot\n");
    assert!(
        text(&out.stderr).contains("stop: eos"),
        "{}",
        text(&out.stderr)
    );

    let out = cli(
        a,
        &[
            "generate",
            "--model",
            "tiny",
            "--max-tokens",
            "4",
            "--json",
            "--raw",
            "hey",
        ],
        "",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(v["text"], "echo");
    assert_eq!(v["ids"].as_array().map(Vec::len), Some(4));
    assert_eq!(v["reason"], "max_tokens");
    assert_eq!(v["stats"]["generated_tokens"], 4);

    let out = cli(a, &["generate", "--raw", "-"], "from stdin");
    assert_eq!(text(&out.stdout), "echo: from stdin\n");

    let dir = tempfile::tempdir().expect("tempdir");
    let grammar = dir.path().join("yes.lark");
    std::fs::write(&grammar, "start: \"yes\"").expect("write the grammar");
    let out = cli(
        a,
        &["generate", "--grammar", grammar.to_str().unwrap(), "x"],
        "",
    );
    assert_eq!(text(&out.stdout), "turn[lark] 1: x\n");
    let out = cli(
        a,
        &["generate", "--json-schema", "/nonexistent/schema.json", "x"],
        "",
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("/nonexistent/schema.json"),
        "{}",
        text(&out.stderr)
    );

    let out = cli(a, &["generate", "--model", "nosuch", "x"], "");
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("no such model in the daemon's model directory"),
        "{err}"
    );
    assert!(err.contains("\"nosuch\""), "{err}");
    assert!(err.contains("ModelNotFound"), "{err}");

    let out = cli(a, &["generate", "--raw", "fail"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("internal daemon error: the mock failed"),
        "{}",
        text(&out.stderr)
    );

    let out = cli(
        a,
        &["chat", "--model", "tiny"],
        "first\n\nsecond\n/exit\nnot sent\n",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "turn 1: first\nturn 2: second\n");
    let out = cli(a, &["chat", "--model", "tiny"], "only\n");
    assert_eq!(text(&out.stdout), "turn 1: only\n", "EOF ends the chat");
    assert!(out.status.success());

    let out = cli(a, &["status"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status = text(&out.stdout);
    assert!(
        status.starts_with("budget 64.0 MiB, used 10.0 MiB (15.6 %)"),
        "{status}"
    );
    assert!(
        status.contains("tiny   leanstream   6.0 MiB  2.0 MiB"),
        "{status}"
    );
    assert!(status.contains("LOADED IN"), "{status}");
    assert!(
        status.contains("  1.50s\n"),
        "the load time from Counters(): {status}"
    );
    let out = cli(a, &["counters"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let counters = text(&out.stdout);
    assert!(counters.starts_with("COUNTER "), "{counters}");
    assert!(counters.contains("model_load_ms.tiny"), "{counters}");
    let out = cli(a, &["counters", "--json"], "");
    let v: Value = serde_json::from_slice(&out.stdout).expect("counters --json is JSON");
    assert_eq!(v["requests.Memory"], 3);
    let out = cli(a, &["status", "--json"], "");
    let v: Value = serde_json::from_slice(&out.stdout).expect("status --json is JSON");
    assert_eq!(v["budget_bytes"], 64u64 << 20);
    assert_eq!(v["models"][0]["name"], "tiny");
    assert_eq!(v["models"][0]["mode"], "leanstream");

    let out = cli(a, &["load", "other"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = cli(a, &["unload", "tiny"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("the daemon is busy"),
        "{}",
        text(&out.stderr)
    );
    // Two loaded models now: generate without --model must ask.
    let out = cli(a, &["generate", "x"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("pass --model NAME"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn cli_without_a_daemon_exits_3_with_a_hint() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let out = cli(&test_bus.address, &["models"], "");
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("is leanstreamd running"), "{err}");

    let dir = tempfile::tempdir().expect("tempdir");
    let missing = format!("unix:path={}/missing", dir.path().display());
    let out = cli(&missing, &["status"], "");
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("cannot connect to the unix:path="));
}
