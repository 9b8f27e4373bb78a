//! The scheduler's tests, on small generated models, one theme a file:
//!
//! - [`lifecycle`]: one generation from its start to its end: each token out before the next
//!   pass, a close while it runs, a KV budget that refuses its prompt or ends it;
//! - [`batching`]: sessions sharing forward passes, the streaming modes, a read error;
//! - [`classes`]: classes, deadlines, and a pass that gives way to a more urgent request;
//! - [`sharing`]: prompt prefixes shared between sessions, and the store that keeps them;
//! - [`hostile`]: what a hostile local client must not be able to do;
//! - [`speculative`]: speculative decoding.
//!
//! This file holds what they share: budgets, loading, sending commands, running generations on
//! a scheduler (on its threads, or its two stages by hand) and reading their streams;
//! [`doubles`] holds the engine sessions that stand in for real ones.
#![allow(clippy::unwrap_used)]

mod batching;
mod classes;
mod doubles;
mod hostile;
mod lifecycle;
mod sharing;
mod speculative;

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use leanstream::contract::{StreamEvent, StreamStats};
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::kv::KvType;
use leanstream_engine::sample::SamplerConfig;

use super::admit::{Admission, WorkQueue};
use super::worker::Worker;
use super::*;
use crate::loader::Footprint;
use crate::models::ModelFile;
use crate::testing::Fixture;
use doubles::{Hooked, gate, handed_on};

const PROMPT: &str = "the cat sat on the";
const TOKENS: usize = 12;
/// The uid that owns the sessions of a test, unless it says otherwise.
const USER: u32 = 1000;

/// A budget factory for [`Scheduler::start`]: each thread gets a clone of `b`.
fn budget<B: SessionBudget + Clone + 'static>(b: B) -> impl Fn() -> Box<dyn SessionBudget> {
    move || Box::new(b.clone())
}

/// A budget that grants every reservation up to a per-session limit the test can change
/// while the scheduler runs, and sums what models hand back.
#[derive(Clone)]
struct SharedLimit(
    Arc<std::sync::atomic::AtomicU64>,
    Arc<std::sync::atomic::AtomicU64>,
);

impl SharedLimit {
    fn new(limit: u64) -> SharedLimit {
        let limit = Arc::new(std::sync::atomic::AtomicU64::new(limit));
        SharedLimit(limit, Arc::default())
    }
}

impl SessionBudget for SharedLimit {
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError> {
        let limit = self.0.load(std::sync::atomic::Ordering::SeqCst);
        if bytes <= limit {
            Ok(())
        } else {
            Err(LeanStreamError::OverBudget(format!(
                "session {id} needs {bytes} bytes, over {limit}"
            )))
        }
    }

    fn grow_model(&self, _name: &str, _bytes: u64) -> Result<(), LeanStreamError> {
        Ok(())
    }

    fn shrink_model(&self, _name: &str, bytes: u64) {
        self.1.fetch_add(bytes, std::sync::atomic::Ordering::SeqCst);
    }
}

fn load(fx: &Fixture, file: &ModelFile, toml: &str) -> LoadedModel {
    let params = fx.params(toml);
    let fp = Footprint::of(file, params.model(&file.name)).unwrap();
    LoadedModel::load(file, &params, fp.cache_bytes).unwrap()
}

/// A session of `model` in exact precision, for `context` tokens stored as `kv`.
fn exact(model: &LoadedModel, context: usize, kv: KvType) -> Box<dyn Decode + Send> {
    model.open_session(context, Precision::Exact, kv).unwrap()
}

/// Opens `session` on `model` as session `id` of the scheduler, owned by [`USER`].
fn open(
    engine: &Scheduler,
    id: SessionId,
    model: &Arc<LoadedModel>,
    session: Box<dyn Decode + Send>,
) {
    open_as(&engine.tx, id, model, session, USER);
}

/// Opens `session` on `model` as session `id`, owned by `user`, through `inbox`.
fn open_as(
    inbox: &Commands,
    id: SessionId,
    model: &Arc<LoadedModel>,
    session: Box<dyn Decode + Send>,
    user: u32,
) {
    let model = Arc::clone(model);
    let cmd = Command::Open {
        id,
        model,
        session,
        user,
    };
    inbox.send(cmd).unwrap();
}

/// A greedy generation of `max_tokens` tokens in class `priority`, without deadlines.
fn spec(max_tokens: usize, priority: Priority) -> GenSpec {
    GenSpec::greedy(max_tokens, priority)
}

/// Sends a `Generate` command to `inbox` without waiting for the scheduler to take it; returns
/// where its answer comes.
fn send_generate(
    inbox: &Commands,
    id: SessionId,
    prompt: &str,
    spec: GenSpec,
    out: std::io::PipeWriter,
) -> tokio::sync::oneshot::Receiver<Result<(), LeanStreamError>> {
    let (reply, accepted) = tokio::sync::oneshot::channel();
    let input = Input::Text(prompt.to_string());
    let cmd = Command::Generate {
        id,
        input,
        spec,
        out,
        reply,
    };
    inbox.send(cmd).unwrap();
    accepted
}

/// Sends a `Generate` of `prompt` as `spec` says to `inbox`; returns the read end of its stream
/// and where its answer comes.
fn request(
    inbox: &Commands,
    id: SessionId,
    prompt: &str,
    spec: GenSpec,
) -> (
    std::io::PipeReader,
    tokio::sync::oneshot::Receiver<Result<(), LeanStreamError>>,
) {
    let (read, out) = std::io::pipe().unwrap();
    (read, send_generate(inbox, id, prompt, spec, out))
}

/// Starts a generation of `prompt` on session `id` that writes its stream to `out`.
fn start_into(engine: &Scheduler, id: SessionId, prompt: &str, out: std::io::PipeWriter) {
    let accepted = send_generate(
        &engine.tx,
        id,
        prompt,
        spec(TOKENS, Priority::default()),
        out,
    );
    accepted.blocking_recv().unwrap().unwrap();
}

/// Starts a generation of `prompt` on session `id`; returns the read end of its stream.
fn start(engine: &Scheduler, id: SessionId, prompt: &str) -> std::io::PipeReader {
    let (read, out) = std::io::pipe().unwrap();
    start_into(engine, id, prompt, out);
    read
}

/// Reads a stream to its end.
fn read_events(mut read: std::io::PipeReader) -> Vec<StreamEvent> {
    let mut text = String::new();
    read.read_to_string(&mut text).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn ids(events: &[StreamEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// The text of a stream's tokens.
fn text(events: &[StreamEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Token { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// The stats of a stream's `done` event.
fn done_stats(events: &[StreamEvent]) -> &StreamStats {
    match events.last() {
        Some(StreamEvent::Done { stats, .. }) => stats,
        other => panic!("the stream did not end with done: {other:?}"),
    }
}

/// Runs one greedy generation per (model, prompt), all at once on one scheduler, and returns
/// each stream's events.
fn generate(runs: &[(&Arc<LoadedModel>, &str)]) -> Vec<Vec<StreamEvent>> {
    let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    let mut readers = Vec::new();
    for (i, (model, prompt)) in runs.iter().enumerate() {
        let id = i as SessionId + 1;
        open(&engine, id, model, exact(model, 64, KvType::F32));
        readers.push(start(&engine, id, prompt));
    }
    let streams = readers.into_iter().map(read_events).collect();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    streams
}

/// [`generate`], with every request queued before the scheduler takes any of them: a session
/// of another kind (a wrapper, which runs alone) holds the worker inside its first pass until
/// all are admitted, so that they all start in the same round whatever the machine's timing.
fn generate_queued(runs: &[(&Arc<LoadedModel>, &str)]) -> Vec<Vec<StreamEvent>> {
    generate_queued_for(runs, TOKENS)
}

/// [`generate_queued`], each generation `max_tokens` long.
fn generate_queued_for(
    runs: &[(&Arc<LoadedModel>, &str)],
    max_tokens: usize,
) -> Vec<Vec<StreamEvent>> {
    let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    let model = runs[0].0;
    let (release, held) = gate(model);
    let gate_id = runs.len() as SessionId + 1;
    open(&engine, gate_id, model, Box::new(held));
    let (_gate_read, out) = std::io::pipe().unwrap();
    let gate_answer = send_generate(
        &engine.tx,
        gate_id,
        PROMPT,
        spec(1, Priority::default()),
        out,
    );
    let mut readers = Vec::new();
    let mut answers = Vec::new();
    for (i, (model, prompt)) in runs.iter().enumerate() {
        let id = i as SessionId + 1;
        open(&engine, id, model, exact(model, 64, KvType::F32));
        let (read, out) = std::io::pipe().unwrap();
        answers.push(send_generate(
            &engine.tx,
            id,
            prompt,
            spec(max_tokens, Priority::default()),
            out,
        ));
        readers.push(read);
    }
    handed_on(&engine, model);
    release.send(()).unwrap();
    for a in std::iter::once(gate_answer).chain(answers) {
        a.blocking_recv().unwrap().unwrap();
    }
    let streams = readers.into_iter().map(read_events).collect();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    streams
}

/// The scheduler's two stages without their threads, driven by hand: the inbox the state owner
/// sends to, the admission stage and the worker (each handles only what a test hands it), and
/// the state owner's end of the reports.
struct ByHand {
    inbox: Commands,
    admission: Admission,
    worker: Worker,
    reports: tokio::sync::mpsc::UnboundedReceiver<Report>,
}

impl ByHand {
    fn new<B: SessionBudget + Clone + 'static>(budget: B) -> ByHand {
        let (tx, rx) = std::sync::mpsc::channel();
        let (work, work_rx, waiting) = WorkQueue::new();
        let (reports, reports_rx) = tokio::sync::mpsc::unbounded_channel();
        let admission = Admission::new(rx, work, reports.clone(), Box::new(budget.clone()));
        let worker = Worker::new(work_rx, waiting, reports, Box::new(budget));
        ByHand {
            inbox: Commands { tx },
            admission,
            worker,
            reports: reports_rx,
        }
    }

    /// Puts every command sent so far through the admission stage (not the worker).
    fn admit(&mut self) {
        while let Ok(cmd) = self.admission.rx.try_recv() {
            assert!(!self.admission.handle(cmd), "the worker's queue is open");
        }
    }

    /// The urgency mark as the worker sees it.
    fn mark(&self) -> u8 {
        self.worker.waiting.load(Ordering::Acquire)
    }
}
