//! End to end: a private dbus-daemon, the real leanstreamd, the real SmolLM2 model, clients through
//! the contract's proxies. Each test starts its own bus and daemon.

use std::time::{Duration, Instant};

use leanstream::contract::{GenerateParams, StreamEvent};
use leanstream_e2e::*;

fn done_reason(s: &Stream) -> &str {
    match &s.end {
        Some(StreamEvent::Done { reason, .. }) => reason,
        Some(StreamEvent::Error { name, .. }) => name,
        _ => "(no end event)",
    }
}

#[test]
fn greedy_generation_matches_the_engine_fixture() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let client = Client::new(&bus).await?;
        assert_eq!(client.manager.backend().await?, "cpu");
        let models = client.manager.list_models().await?;
        let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, [MODEL], "the escaping symlink is not listed");
        assert_eq!(
            (
                models[0].architecture.as_str(),
                models[0].quantization.as_str()
            ),
            ("llama", "Q4_1 (q4_1 69%, q8_0 31%)")
        );
        let out = generate_once(&client, STORY_PROMPT, 16).await?;
        assert_eq!(out.ids, STORY_GREEDY);
        assert_eq!(done_reason(&out), "max_tokens");
        // The streamed text is the decoding of the ids.
        let model = leanstream_engine::forward::Model::load(&real_model())?;
        assert_eq!(out.text, model.tokenizer.decode(&out.ids)?);
        // Memory returns when the session closes (the model is unloaded with its last session).
        let report = settled_memory(&client).await?;
        assert_eq!((report.used_bytes, report.sessions.len()), (0, 0));
        Ok(())
    })
}

#[test]
fn eight_clients_at_once_get_their_single_client_outputs() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            budget: "200MiB".into(),
            ..DaemonConfig::default()
        };
        let _daemon = crate::start_daemon(&bus, &cfg).await?;
        let prompts: Vec<String> = (0..8)
            .map(|i| format!("Story number {i}: once upon a time, a robot named R{i}"))
            .collect();
        // Single-client outputs, one after another. Loading the model explicitly keeps it loaded
        // between sessions.
        let solo = Client::new(&bus).await?;
        solo.manager.load_model(MODEL).await?;
        let mut expected = Vec::new();
        for p in &prompts {
            expected.push(generate_once(&solo, p, 12).await?.ids);
        }
        // All at once, each on its own connection; sample memory while they run.
        let mut clients = Vec::new();
        for _ in 0..8 {
            clients.push(Client::new(&bus).await?);
        }
        let budget = solo.manager.memory().await?.budget_bytes;
        let tasks: Vec<_> = clients
            .into_iter()
            .zip(prompts.clone())
            .map(|(c, p)| tokio::spawn(async move { generate_once(&c, &p, 12).await }))
            .collect();
        let mut peak = 0;
        while !tasks.iter().all(|t| t.is_finished()) {
            let r = solo.manager.memory().await?;
            assert!(r.used_bytes <= budget, "{} > {budget}", r.used_bytes);
            peak = peak.max(r.used_bytes);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(peak > 0, "memory was sampled while sessions were open");
        for (i, t) in tasks.into_iter().enumerate() {
            let out = t.await??;
            assert_eq!(out.ids, expected[i], "client {i}");
            assert_eq!(done_reason(&out), "max_tokens");
        }
        Ok(())
    })
}

#[test]
fn a_vanished_client_loses_its_sessions_and_memory_at_once() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let observer = Client::new(&bus).await?;
        let other = Client::new(&bus).await?;
        let other_task = tokio::spawn(async move {
            let out = generate_once(&other, STORY_PROMPT, 16).await;
            (other, out)
        });
        let doomed = Client::new(&bus).await?;
        let doomed_name = doomed.conn.unique_name().map(|n| n.to_string());
        let s1 = doomed.open(128).await?;
        let _s2 = doomed.open(64).await?;
        let fd = s1.generate(STORY_PROMPT, &greedy(64)).await?;
        let before = observer.manager.memory().await?;
        assert!(
            before
                .clients
                .iter()
                .any(|c| Some(&c.client) == doomed_name.as_ref() && c.sessions == 2),
            "{before:?}"
        );
        // Drop the connection mid-stream (the fd stays open, so only the disconnect is seen).
        drop((s1, _s2));
        drop(doomed);
        let gone = Instant::now();
        loop {
            let r = observer.manager.memory().await?;
            if !r
                .clients
                .iter()
                .any(|c| Some(&c.client) == doomed_name.as_ref())
            {
                break;
            }
            // Generous: the other end-to-end tests load the same two cores meanwhile; a leak
            // is never released at all.
            assert!(
                gone.elapsed() < Duration::from_secs(10),
                "not released: {r:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Its stream ends (EOF) without hanging.
        let out = tokio::time::timeout(Duration::from_secs(5), read_stream(fd)).await??;
        assert!(out.ids.len() < 64);
        let (_other, out) = other_task.await?;
        assert_eq!(out?.ids, STORY_GREEDY, "the other client is unaffected");
        Ok(())
    })
}

#[test]
fn a_sessions_stats_count_its_decode_passes_and_the_drafts_they_verified() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        // Under max_bytes the weights stream, so speculation drafts; the output repeats itself,
        // so lookup drafts are accepted.
        let config = DaemonConfig {
            extra: format!("[models.{MODEL}]\nmax_bytes = \"48MB\"\n"),
            ..DaemonConfig::default()
        };
        let _daemon = crate::start_daemon(&bus, &config).await?;
        let client = Client::new(&bus).await?;
        let session = client.open(128).await?;
        // SmolLM2 repeats its second sentence ("We're going to be using it for the next 2
        // weeks") in its first 32 greedy tokens.
        let prompt = "Dear team, this week we finished the new charging dock and";
        let out = read_stream(session.generate(prompt, &greedy(32)).await?).await?;
        assert_eq!(out.ids.len(), 32);
        let stats = session.stats().await?;
        assert_eq!(stats.generated_tokens, 32);
        // Each decode pass samples one token plus the drafts it accepted.
        assert_eq!(
            stats.decode_passes + stats.accepted_draft_tokens,
            31,
            "{stats:?}"
        );
        assert!(
            stats.accepted_draft_tokens > 0 && stats.draft_tokens >= stats.accepted_draft_tokens,
            "{stats:?}"
        );
        Ok(())
    })
}

#[test]
fn another_connection_cannot_use_a_session() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let owner = Client::new(&bus).await?;
        let intruder = Client::new(&bus).await?;
        let path = owner.manager.open_session(MODEL, 64).await?;
        let theirs = session_proxy(&intruder.conn, path.clone()).await?;
        assert_eq!(
            error_name(theirs.generate("hi", &greedy(2)).await),
            "AccessDenied"
        );
        assert_eq!(error_name(theirs.stats().await), "AccessDenied");
        assert_eq!(error_name(theirs.cancel().await), "AccessDenied");
        assert_eq!(error_name(theirs.close().await), "AccessDenied");
        let mine = session_proxy(&owner.conn, path).await?;
        let out = read_stream(mine.generate(STORY_PROMPT, &greedy(4)).await?).await?;
        assert_eq!(out.ids, STORY_GREEDY[..4]);
        assert_eq!(mine.stats().await?.generations, 1);
        Ok(())
    })
}

#[test]
fn bad_input_gets_named_errors_and_the_daemon_keeps_serving() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            max_sessions: 2,
            ..DaemonConfig::default()
        };
        let daemon = crate::start_daemon(&bus, &cfg).await?;
        // A file that is not a model, and a GGUF that ends in its header.
        let models = daemon.dir.path().join("models");
        std::fs::write(models.join("garbage.gguf"), b"this is not a model at all")?;
        let header = std::fs::read(real_model())?;
        std::fs::write(models.join("cut.gguf"), &header[..4096])?;
        let c = Client::new(&bus).await?;
        let m = &c.manager;
        let still_works = || async {
            let out = generate_once(&c, STORY_PROMPT, 2).await?;
            assert_eq!(out.ids, STORY_GREEDY[..2]);
            anyhow::Ok(())
        };
        for (name, want) in [
            ("nosuchmodel", "ModelNotFound"),
            ("../x", "InvalidArgument"),
            ("/etc/passwd", "InvalidArgument"),
            ("..", "InvalidArgument"),
            ("escape", "ModelNotFound"),
            ("", "InvalidArgument"),
            ("garbage", "InvalidModel"),
            ("cut", "InvalidModel"),
        ] {
            assert_eq!(error_name(m.open_session(name, 64).await), want, "{name:?}");
            assert_eq!(error_name(m.load_model(name).await), want, "{name:?}");
        }
        still_works().await?;
        assert_eq!(
            error_name(m.open_session(MODEL, 1 << 30).await),
            "InvalidArgument"
        );

        let s = c.open(64).await?;
        let big = "word ".repeat(1000);
        assert_eq!(
            error_name(s.generate("", &greedy(2)).await),
            "InvalidArgument"
        );
        assert_eq!(
            error_name(s.generate(&big, &greedy(2)).await),
            "InvalidArgument"
        );
        // Fits the byte limit but not the 64-token context.
        let long = "robot ".repeat(200);
        assert_eq!(
            error_name(s.generate(&long, &greedy(2)).await),
            "InvalidArgument"
        );
        let absurd: [fn(&mut GenerateParams); 6] = [
            |p| p.temperature = f64::NAN,
            |p| p.temperature = 1e6,
            |p| p.top_p = 7.0,
            |p| p.top_p = 0.0,
            // Positive as an f64, zero as the sampler's f32.
            |p| p.top_p = 5e-324,
            |p| p.max_tokens = 1_000_000,
        ];
        for f in absurd {
            let mut p = greedy(2);
            f(&mut p);
            assert_eq!(
                error_name(s.generate("hi", &p).await),
                "InvalidArgument",
                "{p:?}"
            );
        }
        // A second generation while one runs is Busy.
        let fd = s.generate(STORY_PROMPT, &greedy(32)).await?;
        assert_eq!(error_name(s.generate("hi", &greedy(2)).await), "Busy");
        s.cancel().await?;
        let out = read_stream(fd).await?;
        assert!(
            matches!(&out.end, Some(StreamEvent::Error { name, .. }) if name == "Cancelled"),
            "{:?}",
            out.end
        );
        // Session limit: 2 (this one and one more).
        let s2 = c.open(64).await?;
        assert_eq!(error_name(m.open_session(MODEL, 64).await), "Busy");
        s2.close().await?;
        s.close().await?;
        still_works().await?;
        Ok(())
    })
}

#[test]
fn a_conversation_that_outgrows_the_budget_ends_over_budget_and_the_session_stays_usable()
-> anyhow::Result<()> {
    runtime().block_on(async {
        // What the model, a new session and one KV block hold, as the daemon reports them.
        let (resident, open, block) = {
            let bus = Bus::start()?;
            let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
            let c = Client::new(&bus).await?;
            let s = c.open(256).await?;
            let r = c.manager.memory().await?;
            let (resident, open) = (r.models[0].resident_bytes, r.sessions[0].bytes);
            read_stream(s.generate(STORY_PROMPT, &greedy(2)).await?).await?;
            let grown = c.manager.memory().await?.sessions[0].bytes;
            (resident, open, grown - open)
        };
        assert!(block > 0, "a session's first tokens grow one KV block");
        // Room for the model, the session and one and a half blocks.
        let budget = resident + open + block + block / 2;
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            budget: budget.to_string(),
            max_tokens: 128,
            ..DaemonConfig::default()
        };
        let _daemon = crate::start_daemon(&bus, &cfg).await?;
        let c = Client::new(&bus).await?;
        // The context is a limit, not a reservation: a 256-token session opens.
        let s = c.open(256).await?;
        // Its second block does not fit: the generation ends there, naming the budget.
        let out = read_stream(s.generate(STORY_PROMPT, &greedy(100)).await?).await?;
        assert!(
            matches!(&out.end, Some(StreamEvent::Error { name, .. }) if name == "OverBudget"),
            "{:?}",
            out.end
        );
        assert_eq!(
            out.ids[..16],
            STORY_GREEDY,
            "the tokens before the end are right"
        );
        let r = c.manager.memory().await?;
        assert!(r.used_bytes <= r.budget_bytes, "{r:?}");
        // The session is still usable for what fits.
        let out = read_stream(s.generate(STORY_PROMPT, &greedy(2)).await?).await?;
        assert_eq!(out.ids, STORY_GREEDY[..2]);
        // A second session does not fit, and asking changes nothing.
        let before = c.manager.memory().await?;
        assert_eq!(
            error_name(c.manager.open_session(MODEL, 16).await),
            "OverBudget"
        );
        let after = c.manager.memory().await?;
        assert_eq!(
            (after.used_bytes, after.sessions.len()),
            (before.used_bytes, before.sessions.len())
        );
        Ok(())
    })
}

#[test]
fn sigterm_cancels_generations_and_exits_zero() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let mut daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(256).await?;
        let fd = s.generate(STORY_PROMPT, &greedy(64)).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        daemon.terminate()?;
        let out = tokio::time::timeout(Duration::from_secs(10), read_stream(fd)).await??;
        assert!(
            matches!(&out.end, Some(StreamEvent::Error { name, .. }) if name == "Cancelled"),
            "{:?}",
            out.end
        );
        let status =
            tokio::task::spawn_blocking(move || daemon.wait(Duration::from_secs(10))).await??;
        assert!(status.success(), "{status:?}");
        Ok(())
    })
}

/// Sends `Session.Generate` with a prompt whose bytes are not UTF-8, over a raw socket (no
/// binding can build such a message): the bus refuses it, and the daemon keeps serving.
#[test]
fn a_prompt_that_is_not_utf8_is_refused_and_the_daemon_keeps_serving() -> anyhow::Result<()> {
    use std::io::{Read, Write};
    use std::os::unix::fs::MetadataExt;
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let path = c.manager.open_session(MODEL, 64).await?;

        let socket = bus
            .address
            .strip_prefix("unix:path=")
            .and_then(|a| a.split(',').next())
            .ok_or_else(|| anyhow::anyhow!("unexpected bus address {}", bus.address))?
            .to_string();
        let placeholder = "PLACEHOLDER";
        let hello = zbus::Message::method_call("/org/freedesktop/DBus", "Hello")?
            .destination("org.freedesktop.DBus")?
            .interface("org.freedesktop.DBus")?
            .build(&())?;
        let call = zbus::Message::method_call(path.as_str(), "Generate")?
            .destination(leanstream::contract::BUS_NAME)?
            .interface(leanstream::contract::SESSION_INTERFACE)?
            .build(&(placeholder, greedy(2)))?;
        let mut bytes = call.data().to_vec();
        let at = bytes
            .windows(placeholder.len())
            .position(|w| w == placeholder.as_bytes())
            .ok_or_else(|| anyhow::anyhow!("placeholder not found"))?;
        bytes[at..at + 4].copy_from_slice(&[0xff, 0xfe, 0xc3, 0x28]);
        let hello = hello.data().to_vec();
        let (reply, closed) =
            tokio::task::spawn_blocking(move || -> anyhow::Result<(Vec<u8>, bool)> {
                let mut s = std::os::unix::net::UnixStream::connect(socket)?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                let uid = std::fs::metadata("/proc/self")?.uid();
                let hex: String = uid
                    .to_string()
                    .bytes()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                s.write_all(format!("\0AUTH EXTERNAL {hex}\r\n").as_bytes())?;
                let mut buf = [0u8; 256];
                let n = s.read(&mut buf)?;
                anyhow::ensure!(buf[..n].starts_with(b"OK"), "auth failed");
                s.write_all(b"BEGIN\r\n")?;
                s.write_all(&hello)?;
                s.write_all(&bytes)?;
                // Read until the bus closes the connection or the timeout.
                let mut all = Vec::new();
                let closed = loop {
                    match s.read(&mut buf) {
                        Ok(0) => break true,
                        Ok(n) => all.extend_from_slice(&buf[..n]),
                        Err(_) => break false,
                    }
                };
                Ok((all, closed))
            })
            .await??;
        // The bus validates every string and drops a connection that sends invalid UTF-8, so
        // the call never reaches the daemon; failing that, the answer must be an error.
        let text = String::from_utf8_lossy(&reply);
        assert!(
            closed || text.contains("org.freedesktop.DBus.Error") || text.contains(".Error."),
            "the malformed call was neither refused nor answered with an error: {text:?}"
        );
        // The daemon still serves, the same session included.
        let mine = session_proxy(&c.conn, path).await?;
        let out = read_stream(mine.generate(STORY_PROMPT, &greedy(2)).await?).await?;
        assert_eq!(out.ids, STORY_GREEDY[..2]);
        Ok(())
    })
}

/// The `type`s of the `out` arguments of `method` in an introspection document.
fn out_signature(xml: &str, method: &str) -> anyhow::Result<String> {
    let start = xml
        .find(&format!("<method name=\"{method}\">"))
        .ok_or_else(|| anyhow::anyhow!("{method} is not introspected"))?;
    let body = &xml[start..];
    let body = &body[..body.find("</method>").unwrap_or(body.len())];
    let mut sig = String::new();
    for arg in body.split("<arg ").skip(1) {
        let tag = &arg[..arg.find('>').unwrap_or(arg.len())];
        if tag.contains("direction=\"out\"") {
            let t = tag
                .split("type=\"")
                .nth(1)
                .and_then(|t| t.split('"').next())
                .ok_or_else(|| anyhow::anyhow!("an argument of {method} has no type"))?;
            sig.push_str(t);
        }
    }
    Ok(sig)
}

/// The signature field of a message as it is on the wire. zbus parses it into one structure
/// whether the body is one struct argument or several arguments, so it cannot tell `(tt)` from
/// `tt`; a C or Python client can, so this reads the header bytes as they do.
fn wire_signature(msg: &zbus::Message) -> anyhow::Result<String> {
    let b: &[u8] = msg.data();
    anyhow::ensure!(b.first() == Some(&b'l'), "not a little-endian message");
    let u32_at = |at: usize| -> anyhow::Result<usize> {
        let bytes = b
            .get(at..at + 4)
            .ok_or_else(|| anyhow::anyhow!("short header"))?;
        Ok(u32::from_le_bytes(bytes.try_into()?) as usize)
    };
    let byte_at = |at: usize| {
        b.get(at)
            .copied()
            .map(usize::from)
            .ok_or_else(|| anyhow::anyhow!("short header"))
    };
    // Fields: an array of (code: byte, value: variant) structures, each aligned to 8.
    let end = 16 + u32_at(12)?;
    let mut at = 16;
    while at < end {
        at = at.next_multiple_of(8);
        let code = byte_at(at)?;
        let kind_len = byte_at(at + 1)?;
        let kind = b.get(at + 2..at + 2 + kind_len).unwrap_or_default();
        at += 2 + kind_len + 1;
        match kind {
            b"g" => {
                let n = byte_at(at)?;
                if code == 8 {
                    return Ok(String::from_utf8(b[at + 1..at + 1 + n].to_vec())?);
                }
                at += 1 + n + 1;
            }
            b"s" | b"o" => {
                at = at.next_multiple_of(4);
                at += 4 + u32_at(at)? + 1;
            }
            b"u" => at = at.next_multiple_of(4) + 4,
            other => anyhow::bail!("unexpected header field type {other:?}"),
        }
    }
    Ok(String::new())
}

/// Calls `method` with `args` through a plain message, as a C or Python client would.
async fn call<B>(
    conn: &zbus::Connection,
    path: &str,
    interface: &str,
    method: &str,
    args: &B,
) -> zbus::Result<zbus::Message>
where
    B: serde::Serialize + zbus::zvariant::DynamicType,
{
    conn.call_method(
        Some(leanstream::contract::BUS_NAME),
        path,
        Some(interface),
        method,
        args,
    )
    .await
}

#[test]
fn replies_have_the_introspected_signatures_and_argument_lists_are_strict() -> anyhow::Result<()> {
    use leanstream::contract::{MANAGER_INTERFACE, MANAGER_PATH, SESSION_INTERFACE};
    const INTROSPECTABLE: &str = "org.freedesktop.DBus.Introspectable";
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let session_path = c.manager.open_session(MODEL, 64).await?;
        let session = session_path.as_str();
        let manager_xml: String = call(&c.conn, MANAGER_PATH, INTROSPECTABLE, "Introspect", &())
            .await?
            .body()
            .deserialize()?;
        let session_xml: String = call(&c.conn, session, INTROSPECTABLE, "Introspect", &())
            .await?
            .body()
            .deserialize()?;
        for (path, interface, xml, method, want) in [
            (
                MANAGER_PATH,
                MANAGER_INTERFACE,
                &manager_xml,
                "Memory",
                "(ttta(sttttsttx(tttttt))a(osst)a(sut))",
            ),
            (
                MANAGER_PATH,
                MANAGER_INTERFACE,
                &manager_xml,
                "ListModels",
                "a(sssstb)",
            ),
            (
                session,
                SESSION_INTERFACE,
                &session_xml,
                "Stats",
                "(suuutttt)",
            ),
        ] {
            assert_eq!(out_signature(xml, method)?, want, "{method} introspected");
            let reply = call(&c.conn, path, interface, method, &()).await?;
            assert_eq!(wire_signature(&reply)?, want, "{method} replied");
        }
        // A call with more arguments than the method takes gets an error, not an answer.
        let strict = [
            (MANAGER_PATH, MANAGER_INTERFACE, "Memory"),
            (MANAGER_PATH, MANAGER_INTERFACE, "ListModels"),
            (MANAGER_PATH, MANAGER_INTERFACE, "UnloadModel"),
            (session, SESSION_INTERFACE, "Stats"),
            (session, SESSION_INTERFACE, "Cancel"),
        ];
        for (path, interface, method) in strict {
            let r = call(&c.conn, path, interface, method, &("extra", 7u32)).await;
            assert!(
                matches!(r, Err(zbus::Error::MethodError(..))),
                "{method}: {r:?}"
            );
        }
        let r = call(
            &c.conn,
            MANAGER_PATH,
            MANAGER_INTERFACE,
            "OpenSession",
            &(MODEL, 64u32, 1u32),
        );
        assert!(
            matches!(r.await, Err(zbus::Error::MethodError(..))),
            "OpenSession"
        );
        // The session survived all of that.
        let mine = session_proxy(&c.conn, session_path.clone()).await?;
        let out = read_stream(mine.generate(STORY_PROMPT, &greedy(2)).await?).await?;
        assert_eq!(out.ids, STORY_GREEDY[..2]);
        Ok(())
    })
}

/// A chat reply that ends at the model's end-of-turn token reports the token by id, but its
/// text (and so the history a client keeps) has no `<|im_end|>`.
#[test]
fn a_chat_reply_ends_at_its_end_of_turn_without_the_marker_in_its_text() -> anyhow::Result<()> {
    use leanstream::contract::ChatTurn;
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(256).await?;
        let mut history = vec![ChatTurn {
            role: "user".into(),
            content: "Hi".into(),
        }];
        for turn in 0..2 {
            let out = read_stream(s.generate_chat(&history, &greedy(64)).await?).await?;
            assert_eq!(done_reason(&out), "eos", "turn {turn}: {:?}", out.text);
            assert!(
                !out.text.contains("<|im_end|>"),
                "turn {turn}: {:?}",
                out.text
            );
            assert!(!out.text.trim().is_empty(), "turn {turn}: an empty reply");
            assert_eq!(
                out.tokens.last().map(String::as_str),
                Some(""),
                "turn {turn}"
            );
            assert_eq!(out.tokens.concat(), out.text);
            history.push(ChatTurn {
                role: "assistant".into(),
                content: out.text,
            });
            history.push(ChatTurn {
                role: "user".into(),
                content: "Thanks!".into(),
            });
        }
        Ok(())
    })
}
