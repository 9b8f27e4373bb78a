//! A private `dbus-daemon` and a mock `leanstreamd` that implements the contract with canned
//! behaviour, so that the client, the CLI and the Python example are tested over a real bus
//! (real fd passing) without the engine or the real daemon.
//!
//! Mock behaviour: models `tiny` (loaded) and `other` (not loaded). `Generate(prompt)` streams
//! `echo: {prompt}` one character per token (id = the char's code point), cut at `max_tokens`
//! (`echo[KIND]: {prompt}` when the params carry a `grammar_kind`);
//! the prompt `fail` ends the stream with an `Internal` error event, `truncate` closes it without
//! `done`, an empty prompt is `InvalidArgument`, and `silent` ends at once (`eos`, no tokens).
//! `GenerateChat` answers `turn N: {last user message}` where N counts the user turns it was
//! given (`turn[KIND] N: …` with a `grammar_kind`; nothing when the last message is `silent`).

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use leanstream::contract::{
    BUS_NAME, ChatTurn, ClientMemory, GenerateParams, LeanStreamError, MANAGER_PATH, MemoryReport,
    ModelInfo, ModelMemory, ModelParts, SESSION_PATH_PREFIX, SessionStats, StreamEvent,
    StreamStats,
};
use zbus::object_server::ObjectServer;
use zbus::zvariant::{OwnedFd, OwnedObjectPath, OwnedValue};

/// A private bus; killed on drop.
pub struct TestBus {
    child: Child,
    _dir: tempfile::TempDir,
    pub address: String,
}

impl TestBus {
    /// Starts `dbus-daemon` on a socket in a temporary directory; `None` when the binary is not
    /// installed (the caller skips, saying so).
    pub fn start() -> Option<TestBus> {
        let dir = tempfile::tempdir().expect("temporary directory");
        let config = dir.path().join("bus.conf");
        std::fs::write(
            &config,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={}/bus</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"#,
                dir.path().display()
            ),
        )
        .expect("write the bus config");
        let mut child = match Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .args(["--nofork", "--print-address=1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "cannot run dbus-daemon under CI: {e}"
                );
                eprintln!("skipping: cannot run dbus-daemon: {e}");
                return None;
            }
        };
        // The address is printed once the socket listens.
        let stdout = child.stdout.take().expect("piped stdout");
        let mut address = String::new();
        BufReader::new(stdout)
            .read_line(&mut address)
            .expect("read the bus address");
        let address = address.trim().to_owned();
        assert!(!address.is_empty(), "dbus-daemon printed no address");
        Some(TestBus {
            child,
            _dir: dir,
            address,
        })
    }
}

impl Drop for TestBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the `leanstream` CLI on the bus at `address` with `stdin` as its input.
pub fn cli(address: &str, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .arg("--bus")
        .arg(address)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run leanstream");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("leanstream finishes")
}

/// Lossy UTF-8 of a process's output.
/// The ids of a JSON array of token ids (`run --json`'s `ids` and `prompt_ids`).
pub fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The mock daemon, served on its own thread and runtime until dropped.
pub struct MockDaemon {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockDaemon {
    pub fn start(address: &str) -> MockDaemon {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let address = address.to_owned();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("mock runtime");
            rt.block_on(async move {
                let connection = zbus::connection::Builder::address(address.as_str())
                    .expect("bus address")
                    .serve_at(MANAGER_PATH, MockManager::default())
                    .expect("serve the manager")
                    .name(BUS_NAME)
                    .expect("bus name")
                    .build()
                    .await
                    .expect("mock daemon connects");
                ready_tx.send(()).expect("test waits");
                let _ = stop_rx.await;
                drop(connection);
            });
        });
        ready_rx.recv().expect("mock daemon starts");
        MockDaemon {
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }
}

impl Drop for MockDaemon {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[derive(Default)]
struct MockManager {
    next_session: AtomicU32,
    loaded_other: Mutex<bool>,
}

fn models(loaded_other: bool) -> Vec<ModelInfo> {
    vec![
        ModelInfo {
            name: "tiny".into(),
            format: "lsm".into(),
            architecture: "llama".into(),
            quantization: "q8_0 100%".into(),
            file_bytes: 3 << 20,
            loaded: true,
        },
        ModelInfo {
            name: "other".into(),
            format: "gguf".into(),
            architecture: "gemma3".into(),
            quantization: "Q4_K_M (q8_0 60%, q4_k 40%)".into(),
            file_bytes: 5 << 20,
            loaded: loaded_other,
        },
    ]
}

fn known(name: &str) -> Result<(), LeanStreamError> {
    if name == "tiny" || name == "other" {
        Ok(())
    } else {
        Err(LeanStreamError::ModelNotFound(format!(
            "no model named {name:?} in the model directory"
        )))
    }
}

#[zbus::interface(name = "io.github.leanstream.LeanStream1.Manager")]
impl MockManager {
    async fn list_models(&self) -> Vec<ModelInfo> {
        models(*self.loaded_other.lock().expect("lock"))
    }

    async fn load_model(&self, name: &str) -> Result<(), LeanStreamError> {
        known(name)?;
        if name == "other" {
            *self.loaded_other.lock().expect("lock") = true;
        }
        Ok(())
    }

    async fn unload_model(&self, name: &str) -> Result<(), LeanStreamError> {
        known(name)?;
        if name == "tiny" {
            return Err(LeanStreamError::Busy("tiny has open sessions".into()));
        }
        *self.loaded_other.lock().expect("lock") = false;
        Ok(())
    }

    async fn open_session(
        &self,
        #[zbus(object_server)] server: &ObjectServer,
        model: &str,
        context_tokens: u32,
    ) -> Result<OwnedObjectPath, LeanStreamError> {
        known(model)?;
        if context_tokens > 1 << 20 {
            return Err(LeanStreamError::OverBudget(format!(
                "a {context_tokens}-token KV cache does not fit the budget"
            )));
        }
        let n = self.next_session.fetch_add(1, Ordering::Relaxed) + 1;
        let path = OwnedObjectPath::try_from(format!("{SESSION_PATH_PREFIX}/{n}"))
            .map_err(|e| LeanStreamError::Internal(e.to_string()))?;
        let session = MockSession {
            model: model.to_owned(),
            context_tokens: if context_tokens == 0 {
                2048
            } else {
                context_tokens
            },
            generations: AtomicU32::new(0),
        };
        server
            .at(&path, session)
            .await
            .map_err(|e| LeanStreamError::Internal(e.to_string()))?;
        Ok(path)
    }

    /// Counters: one model load of 1.5 s and some calls.
    #[zbus(out_args("counters"))]
    async fn counters(&self) -> HashMap<String, u64> {
        HashMap::from([
            ("model_load_ms.tiny".to_string(), 1500),
            ("model_loads.tiny".to_string(), 1),
            ("requests.Memory".to_string(), 3),
        ])
    }

    /// One struct argument on the wire, as the real daemon replies (a 1-tuple; a bare struct
    /// would be spread over its fields).
    #[zbus(out_args("report"))]
    async fn memory(&self) -> (MemoryReport,) {
        (MemoryReport {
            budget_bytes: 64 << 20,
            used_bytes: 10 << 20,
            rss_bytes: 30 << 20,
            models: vec![ModelMemory {
                name: "tiny".into(),
                resident_bytes: 6 << 20,
                cache_bytes: 2 << 20,
                cache_floor_bytes: 1 << 20,
                cache_wanted_bytes: 3 << 20,
                mode: "leanstream".into(),
                streamed_bytes_per_token: 0,
                idle_seconds: 0,
                unload_in_seconds: -1,
                parts: ModelParts {
                    weights: 4 << 20,
                    tokenizer: 1 << 20,
                    tables: 1 << 16,
                    ring: 0,
                    streamed_whole: 0,
                    streamed_sparse: 0,
                },
            }],
            sessions: vec![],
            clients: vec![ClientMemory {
                client: ":1.9".into(),
                sessions: 0,
                bytes: 0,
            }],
        },)
    }

    #[zbus(property)]
    async fn version(&self) -> String {
        "0.0.0-mock".into()
    }

    #[zbus(property)]
    async fn backend(&self) -> String {
        "cpu".into()
    }
}

struct MockSession {
    model: String,
    context_tokens: u32,
    generations: AtomicU32,
}

/// Writes `events` into a new pipe from a thread, each line in two pieces; returns the read end.
fn stream(events: Vec<StreamEvent>) -> Result<OwnedFd, LeanStreamError> {
    let (rx, mut tx) = std::io::pipe().map_err(|e| LeanStreamError::Internal(e.to_string()))?;
    std::thread::spawn(move || {
        for event in events {
            let mut line = serde_json::to_string(&event).expect("events serialise");
            line.push('\n');
            let (a, b) = line.as_bytes().split_at(line.len() / 2);
            if tx.write_all(a).and_then(|_| tx.flush()).is_err() || tx.write_all(b).is_err() {
                return; // The reader closed: cancelled.
            }
        }
    });
    Ok(OwnedFd::from(std::os::fd::OwnedFd::from(rx)))
}

fn token_events(text: &str, params: &GenerateParams) -> Vec<StreamEvent> {
    let mut events: Vec<StreamEvent> = text
        .chars()
        .map(|c| StreamEvent::Token {
            id: c as u32,
            text: c.to_string(),
        })
        .collect();
    let mut reason = "eos";
    if params.max_tokens > 0 && events.len() > params.max_tokens as usize {
        events.truncate(params.max_tokens as usize);
        reason = "max_tokens";
    }
    let n = events.len();
    events.push(StreamEvent::Done {
        reason: reason.into(),
        stats: StreamStats {
            prompt_tokens: 4,
            generated_tokens: n,
            time_to_first_token_s: 0.01,
            prefill_tokens_per_s: 400.0,
            decode_tokens_per_s: 100.0,
            shared_decode_passes: 0,
            shared_prompt_passes: 0,
            ..StreamStats::default()
        },
    });
    events
}

#[zbus::interface(name = "io.github.leanstream.LeanStream1.Session")]
impl MockSession {
    async fn generate(
        &self,
        prompt: &str,
        options: HashMap<String, OwnedValue>,
    ) -> Result<OwnedFd, LeanStreamError> {
        let params =
            GenerateParams::from_options(&options).map_err(LeanStreamError::InvalidArgument)?;
        self.generations.fetch_add(1, Ordering::Relaxed);
        let echo = match params.grammar_kind.as_str() {
            "" => format!("echo: {prompt}"),
            kind => format!("echo[{kind}]: {prompt}"),
        };
        let mut events = token_events(&echo, &params);
        match prompt {
            "silent" => events = token_events("", &params),
            "" => {
                return Err(LeanStreamError::InvalidArgument(
                    "the prompt is empty".into(),
                ));
            }
            "fail" => {
                events.truncate(2);
                events.push(StreamEvent::Error {
                    name: "Internal".into(),
                    message: "the mock failed on purpose".into(),
                });
            }
            "truncate" => events.truncate(3),
            _ => {}
        }
        stream(events)
    }

    async fn generate_chat(
        &self,
        messages: Vec<ChatTurn>,
        options: HashMap<String, OwnedValue>,
    ) -> Result<OwnedFd, LeanStreamError> {
        let params =
            GenerateParams::from_options(&options).map_err(LeanStreamError::InvalidArgument)?;
        self.generations.fetch_add(1, Ordering::Relaxed);
        let users: Vec<&ChatTurn> = messages.iter().filter(|m| m.role == "user").collect();
        let Some(last) = users.last() else {
            return Err(LeanStreamError::InvalidArgument("no user message".into()));
        };
        let reply = match (last.content.as_str(), params.grammar_kind.as_str()) {
            ("silent", _) => String::new(),
            (content, "") => format!("turn {}: {content}", users.len()),
            (content, kind) => format!("turn[{kind}] {}: {content}", users.len()),
        };
        stream(token_events(&reply, &params))
    }

    async fn cancel(&self) {}

    async fn close(
        &self,
        #[zbus(object_server)] server: &ObjectServer,
        #[zbus(header)] header: zbus::message::Header<'_>,
    ) -> Result<(), LeanStreamError> {
        let path = header
            .path()
            .ok_or_else(|| LeanStreamError::Internal("no path".into()))?
            .to_owned();
        server
            .remove::<MockSession, _>(path)
            .await
            .map_err(|e| LeanStreamError::Internal(e.to_string()))?;
        Ok(())
    }

    #[zbus(out_args("stats"))]
    async fn stats(&self) -> (SessionStats,) {
        (SessionStats {
            model: self.model.clone(),
            context_tokens: self.context_tokens,
            position: 0,
            generations: self.generations.load(Ordering::Relaxed),
            generated_tokens: 0,
            decode_passes: 0,
            draft_tokens: 0,
            accepted_draft_tokens: 0,
        },)
    }
}
