//! The engine side: one scheduler OS thread that owns every engine [`Session`] and runs the
//! generations, never on tokio workers.
//!
//! Scheduling policy: round-robin, one forward pass per active generation per round, whether that
//! pass is a piece of the prompt (prefill: up to [`MAX_BATCH`] tokens through the batched
//! forward pass of a dense model, one token through a sparse pipeline) or a decode step. Every
//! client gets a similar share of the compute, a long prompt cannot starve the others, and
//! commands (cancel, close, new work) are taken between any two passes, so they wait at most one
//! forward pass. Each forward pass is
//! itself parallel on the rayon pool (`[engine] compute_threads`). Sessions on one model share
//! its `Arc<Model>` (weights, tokenizer) and, in a sparse mode, its FFN pipeline with the neuron
//! cache (see [`crate::loader`]); each owns its KV cache.
//!
//! Errors: a forward pass that fails (in a streaming mode: a chunk that could not be read after
//! the I/O workers' retries) ends only the generation it was for, with an `Internal` error
//! event; the pipeline drops the failed token and serves the next pass as usual.
//!
//! Token stream: each step appends a [`StreamEvent`] JSON line to the generation's pipe. The write
//! end is non-blocking: a reader that does not keep up only pauses its own generation (the
//! scheduler skips it until the pipe drains), never the others. A write error (EPIPE: the reader
//! closed its end) cancels that generation quietly.

use std::collections::BTreeMap;
use std::io::{ErrorKind, PipeWriter, Write};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use leanstream::contract::{LeanStreamError, StreamEvent, StreamStats};
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::chat::ChatMessage;
use leanstream_engine::constrain::{Constraint, GrammarKind};
use leanstream_engine::forward::{MAX_BATCH, Session, forward_each};
use leanstream_engine::generate::{Decode, sample_next};
use leanstream_engine::sample::{Sampler, SamplerConfig};
use leanstream_engine::tokenizer::Tokenizer;

pub use crate::loader::LoadedModel;
use crate::memory::SessionId;

/// What to generate from.
#[derive(Debug)]
pub enum Input {
    Text(String),
    /// The whole conversation so far; the KV cache is reused for the prefix it shares with what
    /// the session has already seen.
    Chat(Vec<ChatMessage>),
}

/// A validated generation request.
#[derive(Debug)]
pub struct GenSpec {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// A grammar the output must match, compiled when the generation starts.
    pub grammar: Option<(GrammarKind, String)>,
}

/// Commands to the scheduler thread.
#[derive(Debug)]
pub enum EngineCmd {
    Open {
        id: SessionId,
        model: Arc<LoadedModel>,
        session: Box<dyn Decode + Send>,
    },
    /// Drops the session (and cancels its generation without a final event: the stream just ends).
    Close { id: SessionId },
    Generate {
        id: SessionId,
        input: Input,
        spec: GenSpec,
        out: PipeWriter,
        reply: tokio::sync::oneshot::Sender<Result<(), LeanStreamError>>,
    },
    /// Ends the running generation of `id` with a `Cancelled` event.
    Cancel { id: SessionId },
    /// Cancels everything (streams end with `Cancelled`), flushes for at most a second, exits.
    Shutdown,
}

/// Reports from the scheduler thread to the state owner.
#[derive(Debug)]
pub enum EngineEvent {
    /// A `Generate` command is over (`accepted` false: it was refused up front).
    Finished {
        id: SessionId,
        accepted: bool,
        generated: u64,
        position: u32,
    },
    /// A closed session has been dropped: its memory is handed back.
    Dropped { id: SessionId },
}

/// Where the scheduler reserves memory before a session's KV cache grows: the state owner, which
/// asks the arbiter (shrinking neuron caches first when needed). Blocking: the scheduler waits
/// for the answer before it allocates.
pub trait SessionBudget: Send {
    /// Sets session `id`'s reservation to `bytes`; `OverBudget` when that does not fit.
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError>;
    /// Adds `bytes` to model `name`'s reservation for the rest of its life; `OverBudget`
    /// when that does not fit.
    fn grow_model(&self, name: &str, bytes: u64) -> Result<(), LeanStreamError>;
}

/// Handle of the scheduler thread.
#[derive(Debug)]
pub struct Engine {
    pub tx: Sender<EngineCmd>,
    pub thread: std::thread::JoinHandle<()>,
}

impl Engine {
    /// Starts the scheduler thread and waits until it is up (the ready handshake).
    pub fn start(
        events: tokio::sync::mpsc::UnboundedSender<EngineEvent>,
        budget: Box<dyn SessionBudget>,
    ) -> std::io::Result<Engine> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("leanstream-sched".into())
            .spawn(move || {
                let _ = ready_tx.send(());
                Scheduler {
                    rx,
                    events,
                    budget,
                    sessions: BTreeMap::new(),
                }
                .run();
            })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("the scheduler thread died while starting"))?;
        Ok(Engine { tx, thread })
    }
}

/// Incremental detokenizer over a shared model (the same algorithm as the engine's
/// `TextStream`, which borrows its tokenizer and so cannot live in a session table).
#[derive(Debug, Default)]
struct Detok {
    ids: Vec<u32>,
    context: usize,
    prefix: String,
}

impl Detok {
    const MAX_PENDING: usize = 8;

    fn push(&mut self, tok: &Tokenizer, id: u32) -> leanstream_engine::Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        let pending = self.ids.len() - self.context;
        let complete = !text.ends_with('\u{FFFD}');
        if text.len() > self.prefix.len() && complete || pending >= Self::MAX_PENDING {
            let new = match text.strip_prefix(self.prefix.as_str()) {
                Some(rest) => rest.to_string(),
                None => tok.decode(&self.ids[self.context..])?,
            };
            self.ids.drain(..self.context);
            self.context = self.ids.len();
            self.prefix = tok.decode(&self.ids)?;
            Ok(new)
        } else {
            Ok(String::new())
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Feeding prompt tokens; `fed` of them are in the KV cache.
    Prefill { fed: usize },
    /// `next` was sampled and is written to the stream on the next step.
    Decode { next: u32 },
    /// `token` was written; its forward pass is due ([`Scheduler::decode`]).
    Forward { token: u32 },
    /// The final event is queued; the generation ends once it is written.
    Ending,
}

#[derive(Debug)]
struct Generation {
    prompt: Vec<u32>,
    phase: Phase,
    sampler: Sampler,
    /// The grammar's parser state, when the request carried one.
    constraint: Option<Constraint>,
    spec: GenSpec,
    /// Tokens the repetition penalty sees: the prompt, then the generated ids.
    history: Vec<u32>,
    generated: Vec<u32>,
    text: String,
    detok: Detok,
    out: PipeWriter,
    /// Bytes not yet written (the pipe was full).
    pending: Vec<u8>,
    started: Instant,
    prompt_tokens: usize,
    prefill: Duration,
    decode_start: Option<Instant>,
    /// Decode passes run together with other sessions'.
    shared_passes: usize,
}

#[derive(Debug)]
struct EngineSession {
    model: Arc<LoadedModel>,
    session: Box<dyn Decode + Send>,
    /// The tokens in the KV cache, in order.
    seen: Vec<u32>,
    generation: Option<Generation>,
}

struct Scheduler {
    rx: Receiver<EngineCmd>,
    events: tokio::sync::mpsc::UnboundedSender<EngineEvent>,
    budget: Box<dyn SessionBudget>,
    sessions: BTreeMap<SessionId, EngineSession>,
}

/// What sessions must share to run in one decode pass: the same loaded model (by address) and the
/// same CPU precision.
type BatchKey = (usize, Precision);

/// A session whose decode pass is due, borrowed apart for [`Scheduler::decode`].
struct Due<'a> {
    id: SessionId,
    model: &'a LoadedModel,
    session: &'a mut Box<dyn Decode + Send>,
    seen: &'a mut Vec<u32>,
    g: &'a mut Generation,
    token: u32,
}

impl Scheduler {
    fn run(mut self) {
        loop {
            // Take commands: wait for one if there is nothing to compute.
            let runnable = self.sessions.values().any(|s| {
                s.generation
                    .as_ref()
                    .is_some_and(|g| g.pending.is_empty() && g.phase != Phase::Ending)
            });
            let waiting = self.sessions.values().any(|s| s.generation.is_some());
            let first = if runnable {
                match self.rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return self.shutdown(),
                }
            } else if waiting {
                match self.rx.recv_timeout(Duration::from_millis(5)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return self.shutdown(),
                }
            } else {
                match self.rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return self.shutdown(),
                }
            };
            if let Some(cmd) = first
                && self.handle(cmd)
            {
                return self.shutdown();
            }
            if self.round() {
                return self.shutdown();
            }
        }
    }

    /// Takes every waiting command; true when one asks to shut down (or the daemon is gone).
    fn take_commands(&mut self) -> bool {
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    if self.handle(cmd) {
                        return true;
                    }
                }
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => return true,
            }
        }
    }

    /// One round. Each active generation takes one step: it writes its next token and queues that
    /// token's forward pass, or runs a piece of its prompt. Then the queued decode passes run, one
    /// pass per model for all the sessions that can share it ([`forward_each`]). Commands are
    /// taken after every pass. True when a command asked to shut down.
    fn round(&mut self) -> bool {
        let ids: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.generation.is_some())
            .map(|(id, _)| *id)
            .collect();
        let mut due = Vec::new();
        for id in ids {
            match self.step(id) {
                Some(()) => due.push(id),
                None => {
                    if self.take_commands() {
                        return true;
                    }
                }
            }
        }
        for batch in self.batches(due) {
            self.decode(&batch);
            if self.take_commands() {
                return true;
            }
        }
        false
    }

    /// Handles a command; returns true on shutdown.
    fn handle(&mut self, cmd: EngineCmd) -> bool {
        match cmd {
            EngineCmd::Open { id, model, session } => {
                self.sessions.insert(
                    id,
                    EngineSession {
                        model,
                        session,
                        seen: Vec::new(),
                        generation: None,
                    },
                );
            }
            EngineCmd::Close { id } => {
                if let Some(mut s) = self.sessions.remove(&id) {
                    if s.generation.take().is_some() {
                        self.finished(id, true, 0, 0);
                    }
                    drop(s);
                    leanstream_engine::alloc::trim();
                    let _ = self.events.send(EngineEvent::Dropped { id });
                }
            }
            EngineCmd::Cancel { id } => {
                if let Some(s) = self.sessions.get_mut(&id)
                    && let Some(g) = &mut s.generation
                    && g.phase != Phase::Ending
                {
                    end_with_error(g, "Cancelled", "the generation was cancelled");
                }
            }
            EngineCmd::Generate {
                id,
                input,
                spec,
                out,
                reply,
            } => {
                let result = self.start(id, input, spec, out);
                // A refusal is reported to the state owner before the caller hears of it, so
                // the session is no longer busy by the time the caller can try again.
                if result.is_err() {
                    let position = self.position(id);
                    self.finished(id, false, 0, position);
                }
                let _ = reply.send(result);
            }
            EngineCmd::Shutdown => return true,
        }
        false
    }

    fn position(&self, id: SessionId) -> u32 {
        self.sessions
            .get(&id)
            .map_or(0, |s| s.session.position() as u32)
    }

    fn finished(&self, id: SessionId, accepted: bool, generated: u64, position: u32) {
        let _ = self.events.send(EngineEvent::Finished {
            id,
            accepted,
            generated,
            position,
        });
    }

    /// Tokenises the input and installs the generation; errors are for the caller.
    fn start(
        &mut self,
        id: SessionId,
        input: Input,
        spec: GenSpec,
        out: PipeWriter,
    ) -> Result<(), LeanStreamError> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or_else(|| LeanStreamError::Internal(format!("session {id} is not open")))?;
        if s.generation.is_some() {
            return Err(LeanStreamError::Busy(
                "a generation is already running on this session".into(),
            ));
        }
        let text = match input {
            Input::Text(t) => t,
            Input::Chat(messages) => s
                .model
                .template
                .render(&messages, true)
                .map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))?,
        };
        let ids = s
            .model
            .model
            .tokenizer
            .encode(&text)
            .map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))?;
        if ids.is_empty() {
            return Err(LeanStreamError::InvalidArgument(
                "the prompt encodes to no tokens".into(),
            ));
        }
        let vocab = s.model.model.weights.config.vocab_size;
        let sampler = Sampler::new(spec.sampler.clone(), vocab)
            .map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))?;
        let constraint = match &spec.grammar {
            Some((kind, text)) => {
                let budget = self.budget.as_ref();
                let reserve = |bytes| budget.grow_model(&s.model.name, bytes);
                Some(s.model.grammar(*kind, text, reserve)?.start())
            }
            None => None,
        };
        // Reuse the KV cache when the new prompt extends what the session has seen.
        let max = s.session.max_context();
        let reuse = s.seen.len() < ids.len() && ids.starts_with(&s.seen);
        if !reuse || ids.len() > max {
            s.session.reset();
            s.seen.clear();
        }
        if ids.len() > max {
            return Err(LeanStreamError::InvalidArgument(format!(
                "the prompt is {} tokens; the session's context holds {max}",
                ids.len()
            )));
        }
        let suffix = ids[s.seen.len()..].to_vec();
        set_nonblocking(&out)?;
        s.generation = Some(Generation {
            prompt: suffix,
            phase: Phase::Prefill { fed: 0 },
            sampler,
            constraint,
            history: ids.clone(),
            generated: Vec::with_capacity(spec.max_tokens),
            text: String::new(),
            detok: Detok::default(),
            out,
            pending: Vec::new(),
            started: Instant::now(),
            prompt_tokens: ids.len(),
            prefill: Duration::ZERO,
            decode_start: None,
            shared_passes: 0,
            spec,
        });
        Ok(())
    }

    /// Writes what the pipe takes, then takes the generation's next step if it can: a piece of
    /// its prompt, or its next token out. `Some` when the generation now waits for the forward
    /// pass of the token it wrote ([`Phase::Forward`]), which [`Scheduler::decode`] runs.
    fn step(&mut self, id: SessionId) -> Option<()> {
        let s = self.sessions.get_mut(&id)?;
        let g = s.generation.as_mut()?;
        match flush(g) {
            Ok(true) => return None,
            Ok(false) if g.phase != Phase::Ending => {
                let room = Room {
                    id,
                    budget: self.budget.as_ref(),
                };
                let model = s.model.as_ref();
                let result = match g.phase {
                    Phase::Prefill { fed } => {
                        prefill(model, s.session.as_mut(), &mut s.seen, g, fed, &room)
                    }
                    Phase::Decode { next } => emit(model, s.session.as_ref(), g, next),
                    Phase::Forward { .. } | Phase::Ending => Ok(()),
                };
                if let Err(f) = result {
                    fail(id, g, f);
                }
            }
            _ => {}
        }
        let waits = matches!(g.phase, Phase::Forward { .. });
        self.settle(id);
        waits.then_some(())
    }

    /// Writes what the pipe takes; ends the generation once its last event is out (or its reader
    /// is gone).
    fn settle(&mut self, id: SessionId) {
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(g) = &mut s.generation else {
            return;
        };
        let over = match flush(g) {
            Err(_) => true, // the reader closed its end: cancelled
            Ok(left) => !left && g.phase == Phase::Ending,
        };
        if over && let Some(g) = s.generation.take() {
            let position = s.session.position() as u32;
            self.finished(id, true, g.generated.len() as u64, position);
        }
    }

    /// Groups the sessions whose decode pass is due into batches that one pass can run: CPU
    /// sessions of the same dense model and precision, at most [`MAX_BATCH`] a pass. Others
    /// (a sparse pipeline, the GPU) run alone.
    fn batches(&mut self, due: Vec<SessionId>) -> Vec<Vec<SessionId>> {
        let mut groups: Vec<(Option<BatchKey>, Vec<SessionId>)> = Vec::new();
        for id in due {
            let Some(s) = self.sessions.get_mut(&id) else {
                continue;
            };
            let dense = s.model.ffn.is_none();
            let key = s
                .session
                .as_cpu()
                .filter(|_| dense)
                .map(|cpu| (Arc::as_ptr(&s.model) as usize, cpu.precision()));
            match groups
                .iter_mut()
                .find(|(k, ids)| key.is_some() && *k == key && ids.len() < MAX_BATCH)
            {
                Some((_, ids)) => ids.push(id),
                None => groups.push((key, vec![id])),
            }
        }
        groups.into_iter().map(|(_, ids)| ids).collect()
    }

    /// Runs the due forward passes of `batch` (see [`Scheduler::batches`]) and samples each
    /// session's next token: one pass for all when there are several, after reserving each
    /// one's KV room (a session the budget refuses ends alone).
    fn decode(&mut self, batch: &[SessionId]) {
        let budget = self.budget.as_ref();
        let mut ready: Vec<Due<'_>> = Vec::with_capacity(batch.len());
        for (&id, s) in self.sessions.iter_mut() {
            let EngineSession {
                model,
                session,
                seen,
                generation: Some(g),
            } = s
            else {
                continue;
            };
            // A command since the step may have cancelled it.
            let Phase::Forward { token } = g.phase else {
                continue;
            };
            if !batch.contains(&id) {
                continue;
            }
            let room = Room { id, budget };
            match room.grow(session.as_mut(), 1) {
                Ok(()) => ready.push(Due {
                    id,
                    model,
                    session,
                    seen,
                    g,
                    token,
                }),
                Err(f) => fail(id, g, f),
            }
        }
        if ready.len() > 1 {
            let tokens: Vec<u32> = ready.iter().map(|d| d.token).collect();
            let mut cpu: Vec<&mut Session> = ready
                .iter_mut()
                .filter_map(|d| d.session.as_cpu())
                .collect();
            match forward_each(&mut cpu, &tokens) {
                Ok(()) => {
                    for d in &mut ready {
                        d.g.shared_passes += 1;
                        let Due {
                            id,
                            session,
                            seen,
                            g,
                            token,
                            ..
                        } = d;
                        let cpu = session
                            .as_cpu()
                            .expect("batches() groups CPU sessions only");
                        if let Err(f) = next_token(g, seen, *token, cpu.logits()) {
                            fail(*id, g, f);
                        }
                    }
                }
                Err(e) => {
                    tracing::error!("batched decode pass failed: {e}");
                    for d in &mut ready {
                        end_with_error(d.g, "Internal", &e.to_string());
                    }
                }
            }
        } else {
            for d in &mut ready {
                let room = Room { id: d.id, budget };
                let result = forward(d.model, d.session.as_mut(), d.token, &room)
                    .and_then(|logits| next_token(d.g, d.seen, d.token, logits));
                if let Err(f) = result {
                    fail(d.id, d.g, f);
                }
            }
        }
        for &id in batch {
            self.settle(id);
        }
    }

    fn shutdown(mut self) {
        for s in self.sessions.values_mut() {
            if let Some(g) = &mut s.generation
                && g.phase != Phase::Ending
            {
                end_with_error(g, "Cancelled", "the daemon is shutting down");
            }
        }
        // Give readers a moment to drain full pipes, then drop everything (EOF).
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            let mut left = false;
            for s in self.sessions.values_mut() {
                if let Some(g) = &mut s.generation {
                    match flush(g) {
                        Ok(true) => left = true,
                        _ => s.generation = None,
                    }
                }
            }
            if !left {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        tracing::info!("engine scheduler stopped");
    }
}

/// Puts the pipe's write end in non-blocking mode.
fn set_nonblocking(out: &PipeWriter) -> Result<(), LeanStreamError> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let flags = fcntl(out, FcntlArg::F_GETFL)
        .map_err(|e| LeanStreamError::Internal(format!("pipe flags: {e}")))?;
    fcntl(
        out,
        FcntlArg::F_SETFL(OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK),
    )
    .map(drop)
    .map_err(|e| LeanStreamError::Internal(format!("pipe flags: {e}")))
}

/// Queues `event` as one JSON line.
fn queue(g: &mut Generation, event: &StreamEvent) {
    // Serialising these plain types cannot fail; an empty line would be the only trace if it did.
    if let Ok(line) = serde_json::to_vec(event) {
        g.pending.extend_from_slice(&line);
    }
    g.pending.push(b'\n');
}

/// Writes what the pipe takes. `Ok(true)`: bytes are left (pipe full); `Err`: the reader is gone.
fn flush(g: &mut Generation) -> std::io::Result<bool> {
    while !g.pending.is_empty() {
        match g.out.write(&g.pending) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                g.pending.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(true),
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

fn end_with_error(g: &mut Generation, name: &str, message: &str) {
    queue(
        g,
        &StreamEvent::Error {
            name: name.into(),
            message: message.into(),
        },
    );
    g.phase = Phase::Ending;
}

fn end_done(g: &mut Generation, reason: &str) {
    let decode = g.decode_start.map_or(Duration::ZERO, |t| t.elapsed());
    let n = g.generated.len();
    let rate = |k: usize, d: Duration| {
        if d.is_zero() {
            0.0
        } else {
            k as f64 / d.as_secs_f64()
        }
    };
    let stats = StreamStats {
        prompt_tokens: g.prompt_tokens,
        generated_tokens: n,
        time_to_first_token_s: g.prefill.as_secs_f64(),
        prefill_tokens_per_s: rate(g.prompt.len(), g.prefill),
        decode_tokens_per_s: rate(n.saturating_sub(1), decode),
        shared_decode_passes: g.shared_passes,
    };
    queue(
        g,
        &StreamEvent::Done {
            reason: reason.into(),
            stats,
        },
    );
    g.phase = Phase::Ending;
}

/// Ends `g` with the error event for `f`, logged as the kind of failure it is.
fn fail(id: SessionId, g: &mut Generation, f: Failure) {
    match f {
        Failure::Budget(e) => {
            tracing::info!("session {id}: generation ended: {e}");
            end_with_error(g, "OverBudget", &e.to_string());
        }
        Failure::Engine(e @ leanstream_engine::Error::Constraint(_)) => {
            tracing::info!("session {id}: generation ended by its grammar: {e}");
            end_with_error(g, "InvalidArgument", &e.to_string());
        }
        Failure::Engine(e) => {
            tracing::error!("session {id}: generation failed: {e}");
            end_with_error(g, "Internal", &e.to_string());
        }
    }
}

/// Why a step failed: the budget refused the KV cache's growth, or the engine failed.
enum Failure {
    Budget(LeanStreamError),
    Engine(leanstream_engine::Error),
}

impl From<leanstream_engine::Error> for Failure {
    fn from(e: leanstream_engine::Error) -> Failure {
        Failure::Engine(e)
    }
}

/// A session's way to the budget.
struct Room<'a> {
    id: SessionId,
    budget: &'a dyn SessionBudget,
}

impl Room<'_> {
    /// Makes room in the KV cache for `tokens` more tokens: reserves the blocks they need
    /// first, then allocates them. Nothing is allocated when the reservation is refused.
    fn grow(&self, session: &mut dyn Decode, tokens: usize) -> Result<(), Failure> {
        let extra = session.kv_growth_bytes(tokens);
        if extra == 0 {
            return Ok(());
        }
        self.budget
            .resize(self.id, session.bytes() + extra)
            .map_err(Failure::Budget)?;
        Ok(session.grow_kv(tokens)?)
    }
}

/// One forward pass of `session`, through the model's sparse FFN pipeline when it has one,
/// after making room for the token in its KV cache.
fn forward<'s>(
    model: &LoadedModel,
    session: &'s mut dyn Decode,
    token: u32,
    room: &Room<'_>,
) -> Result<&'s mut [f32], Failure> {
    room.grow(session, 1)?;
    Ok(match &model.ffn {
        // A panic while the scheduler held the lock would have ended this thread, so a poisoned
        // lock cannot be seen here; take it anyway rather than add a panic path.
        Some(ffn) => session.forward_with(
            token,
            &mut *ffn
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )?,
        None => session.forward(token)?,
    })
}

/// Samples the next token through the engine's step (a grammar, if any, masks and follows it).
fn pick(g: &mut Generation, logits: &mut [f32]) -> leanstream_engine::Result<u32> {
    sample_next(
        &mut g.sampler,
        g.constraint.as_mut(),
        logits,
        &g.history,
        None,
    )
}

/// Runs the next piece of the prompt, from token `fed`: a dense model takes up to [`MAX_BATCH`]
/// tokens in one batched pass, like the engine's `generate` (the same pieces as its own split, so
/// the same logits); a sparse pipeline one token a pass. After the last piece the first token is
/// sampled.
fn prefill(
    model: &LoadedModel,
    session: &mut dyn Decode,
    seen: &mut Vec<u32>,
    g: &mut Generation,
    fed: usize,
    room: &Room<'_>,
) -> Result<(), Failure> {
    let n = match model.ffn {
        Some(_) => 1,
        None => MAX_BATCH.min(g.prompt.len() - fed),
    };
    let piece = &g.prompt[fed..fed + n];
    let logits = match model.ffn {
        Some(_) => forward(model, session, piece[0], room)?,
        None => {
            room.grow(session, n)?;
            session.forward_batch(piece)?
        }
    };
    seen.extend_from_slice(piece);
    if fed + n < g.prompt.len() {
        g.phase = Phase::Prefill { fed: fed + n };
    } else {
        let next = pick(g, logits)?;
        g.prefill = g.started.elapsed();
        g.decode_start = Some(Instant::now());
        g.phase = Phase::Decode { next };
    }
    Ok(())
}

/// Writes token `next` to the stream, then either ends the generation (a stop rule) or leaves
/// it waiting for `next`'s forward pass ([`Phase::Forward`]).
fn emit(
    model: &LoadedModel,
    session: &dyn Decode,
    g: &mut Generation,
    next: u32,
) -> Result<(), Failure> {
    let tok = &model.model.tokenizer;
    g.generated.push(next);
    g.history.push(next);
    // The end-of-generation token (`<|im_end|>`, `<end_of_turn>`) is reported by id but is not
    // part of the text: a chat client keeps the text as the reply.
    let piece = if tok.is_eos(next) {
        String::new()
    } else {
        g.detok.push(tok, next)?
    };
    g.text.push_str(&piece);
    queue(
        g,
        &StreamEvent::Token {
            id: next,
            text: piece,
        },
    );
    // The token goes out now, before any forward pass. A full pipe keeps it pending (written
    // when it drains); a closed one ends the generation when the scheduler settles it.
    let _ = flush(g);
    if tok.is_eos(next) {
        end_done(g, "eos");
    } else if g.spec.stop.iter().any(|s| g.text.contains(s.as_str())) {
        end_done(g, "stop_string");
    } else if g.generated.len() >= g.spec.max_tokens {
        end_done(g, "max_tokens");
    } else if session.position() >= session.max_context() {
        end_done(g, "context_full");
    } else {
        g.phase = Phase::Forward { token: next };
    }
    Ok(())
}

/// After `token`'s forward pass: notes it in the KV cache's record and samples the next token
/// from `logits`.
fn next_token(
    g: &mut Generation,
    seen: &mut Vec<u32>,
    token: u32,
    logits: &mut [f32],
) -> Result<(), Failure> {
    seen.push(token);
    let next = pick(g, logits)?;
    g.phase = Phase::Decode { next };
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::io::Read;
    use std::sync::Mutex;

    use leanstream_engine::backend::cpu::Precision;
    use leanstream_engine::io::{DirectFile, Fault, FaultKind, FaultyReader, ThreadPoolIo};
    use leanstream_engine::kv::KvType;
    use leanstream_engine::pipeline::{
        Executor, Mode, Policy, Selector, SparseModel, StreamingFfn,
    };
    use leanstream_engine::sample::SamplerConfig;

    use super::*;
    use crate::loader::Footprint;
    use crate::models::ModelFile;
    use crate::testing::Fixture;

    const PROMPT: &str = "the cat sat on the";
    const TOKENS: usize = 12;

    /// A budget that grants every reservation up to a per-session limit the test can change
    /// while the scheduler runs.
    #[derive(Clone)]
    struct SharedLimit(Arc<std::sync::atomic::AtomicU64>);

    impl SharedLimit {
        fn new(limit: u64) -> SharedLimit {
            SharedLimit(Arc::new(std::sync::atomic::AtomicU64::new(limit)))
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
    }

    fn load(fx: &Fixture, file: &ModelFile, toml: &str) -> LoadedModel {
        let params = fx.params(toml);
        let fp = Footprint::of(file, params.model(&file.name)).unwrap();
        LoadedModel::load(file, &params, fp.cache_bytes).unwrap()
    }

    /// Runs one greedy generation per (model, prompt), all at once on one scheduler, and returns
    /// each stream's events.
    fn generate(runs: &[(&Arc<LoadedModel>, &str)]) -> Vec<Vec<StreamEvent>> {
        let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
        let engine = Engine::start(events, Box::new(SharedLimit::new(u64::MAX))).unwrap();
        let mut readers = Vec::new();
        for (i, (model, prompt)) in runs.iter().enumerate() {
            let id = i as SessionId + 1;
            let session = model
                .open_session(64, Precision::Exact, KvType::F32)
                .unwrap();
            let model = Arc::clone(model);
            engine
                .tx
                .send(EngineCmd::Open { id, model, session })
                .unwrap();
            readers.push(start(&engine, id, prompt));
        }
        let streams = readers.into_iter().map(read_events).collect();
        engine.tx.send(EngineCmd::Shutdown).unwrap();
        engine.thread.join().unwrap();
        streams
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

    /// Starts a generation of `prompt` on session `id`; returns the read end of its stream.
    fn start(engine: &Engine, id: SessionId, prompt: &str) -> std::io::PipeReader {
        let (read, out) = std::io::pipe().unwrap();
        start_into(engine, id, prompt, out);
        read
    }

    /// Starts a generation of `prompt` on session `id` that writes its stream to `out`.
    fn start_into(engine: &Engine, id: SessionId, prompt: &str, out: std::io::PipeWriter) {
        let (reply, accepted) = tokio::sync::oneshot::channel();
        let spec = GenSpec {
            max_tokens: TOKENS,
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            grammar: None,
        };
        let input = Input::Text(prompt.to_string());
        let cmd = EngineCmd::Generate {
            id,
            input,
            spec,
            out,
            reply,
        };
        engine.tx.send(cmd).unwrap();
        accepted.blocking_recv().unwrap().unwrap();
    }

    /// Reads a stream to its end.
    fn read_events(mut read: std::io::PipeReader) -> Vec<StreamEvent> {
        let mut text = String::new();
        read.read_to_string(&mut text).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Runs a generation of `prompt` on session `id` and returns its stream's events.
    fn run_one(engine: &Engine, id: SessionId, prompt: &str) -> Vec<StreamEvent> {
        read_events(start(engine, id, prompt))
    }

    /// A session that notes, at every forward pass, how many bytes of the token stream are
    /// waiting in the pipe (`FIONREAD` on a duplicate of the read end, which reads nothing).
    #[derive(Debug)]
    struct PipeWatch {
        inner: Box<dyn Decode + Send>,
        pipe: std::os::fd::OwnedFd,
        seen: Arc<Mutex<Vec<usize>>>,
    }

    impl PipeWatch {
        fn note(&self) {
            use std::os::fd::AsRawFd;
            let mut waiting: libc::c_int = 0;
            // SAFETY: FIONREAD writes one int through the pointer, which points at `waiting`;
            // the fd is open for the lifetime of `self.pipe`.
            let rc = unsafe { libc::ioctl(self.pipe.as_raw_fd(), libc::FIONREAD, &mut waiting) };
            assert_eq!(rc, 0, "FIONREAD on the stream's pipe");
            self.seen.lock().unwrap().push(waiting as usize);
        }
    }

    impl Decode for PipeWatch {
        fn forward(&mut self, token: u32) -> leanstream_engine::Result<&mut [f32]> {
            self.note();
            self.inner.forward(token)
        }
        fn forward_batch(&mut self, tokens: &[u32]) -> leanstream_engine::Result<&mut [f32]> {
            self.note();
            self.inner.forward_batch(tokens)
        }
        fn position(&self) -> usize {
            self.inner.position()
        }
        fn max_context(&self) -> usize {
            self.inner.max_context()
        }
        fn vocab_size(&self) -> usize {
            self.inner.vocab_size()
        }
        fn forward_with(
            &mut self,
            token: u32,
            exec: &mut dyn leanstream_engine::forward::FfnExecutor,
        ) -> leanstream_engine::Result<&mut [f32]> {
            self.note();
            self.inner.forward_with(token, exec)
        }
        fn reset(&mut self) {
            self.inner.reset()
        }
        fn bytes(&self) -> u64 {
            self.inner.bytes()
        }
        fn kv_growth_bytes(&self, tokens: usize) -> u64 {
            self.inner.kv_growth_bytes(tokens)
        }
        fn grow_kv(&mut self, tokens: usize) -> leanstream_engine::Result<()> {
            self.inner.grow_kv(tokens)
        }
        fn release_kv(&mut self) {
            self.inner.release_kv()
        }
    }

    #[test]
    fn each_token_is_in_the_pipe_before_the_next_forward_pass_starts() {
        let fx = Fixture::new();
        let file = fx.gguf("tiny");
        let model = Arc::new(load(&fx, &file, ""));
        let (events, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
        let engine = Engine::start(events, Box::new(SharedLimit::new(u64::MAX))).unwrap();
        let (read, out) = std::io::pipe().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let session = Box::new(PipeWatch {
            inner: model
                .open_session(64, Precision::Exact, KvType::F32)
                .unwrap(),
            pipe: std::os::fd::OwnedFd::from(read.try_clone().unwrap()),
            seen: Arc::clone(&seen),
        });
        engine
            .tx
            .send(EngineCmd::Open {
                id: 1,
                model: Arc::clone(&model),
                session,
            })
            .unwrap();
        start_into(&engine, 1, PROMPT, out);
        // Read nothing until the generation is over (the whole stream fits in the pipe), so
        // what the session saw waiting is everything written so far.
        while !matches!(
            events_rx.blocking_recv(),
            Some(EngineEvent::Finished { id: 1, .. }) | None
        ) {}
        let mut text = String::new();
        let mut read = read;
        read.read_to_string(&mut text).unwrap();
        engine.tx.send(EngineCmd::Shutdown).unwrap();
        engine.thread.join().unwrap();

        // Bytes of the stream once token k (1-based) was written.
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        let tokens = lines.len() - 1; // the last line is `done`
        assert_eq!(tokens, TOKENS, "{text}");
        let written: Vec<usize> = lines
            .iter()
            .scan(0, |sum, l| {
                *sum += l.len();
                Some(*sum)
            })
            .collect();
        // The last TOKENS - 1 forward passes each follow a token: the one they run on must be
        // in the pipe already.
        let seen = seen.lock().unwrap();
        // The prompt (under MAX_BATCH tokens) went through one batched pass.
        assert_eq!(seen.len(), 1 + (TOKENS - 1), "{seen:?}");
        let decode = &seen[1..];
        assert_eq!(
            decode,
            &written[..TOKENS - 1],
            "bytes waiting at each decode pass"
        );
    }

    #[test]
    fn a_kv_block_over_budget_ends_the_generation_and_the_session_stays_usable() {
        let fx = Fixture::new();
        let file = fx.gguf("tiny");
        let model = Arc::new(load(&fx, &file, ""));
        let session = model
            .open_session(64, Precision::Exact, KvType::F16)
            .unwrap();
        let open_bytes = session.bytes();
        let block = session.kv_growth_bytes(1);
        assert!(block > 0, "a new session holds no KV block");
        let limit = SharedLimit::new(open_bytes);
        let (events, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
        let engine = Engine::start(events, Box::new(limit.clone())).unwrap();
        let id = 1;
        let cmd = EngineCmd::Open {
            id,
            model: Arc::clone(&model),
            session,
        };
        engine.tx.send(cmd).unwrap();
        // No room for the first block: the generation ends at once, naming the budget.
        let refused = run_one(&engine, id, PROMPT);
        assert!(
            matches!(refused.as_slice(), [StreamEvent::Error { name, .. }] if name == "OverBudget"),
            "{refused:?}"
        );
        // With room for one block the same session generates as usual.
        limit
            .0
            .store(open_bytes + block, std::sync::atomic::Ordering::SeqCst);
        let served = run_one(&engine, id, PROMPT);
        assert!(
            matches!(served.last(), Some(StreamEvent::Done { .. })),
            "{served:?}"
        );
        assert_eq!(ids(&served).len(), TOKENS);
        engine.tx.send(EngineCmd::Close { id }).unwrap();
        engine.tx.send(EngineCmd::Shutdown).unwrap();
        engine.thread.join().unwrap();
        let mut dropped = false;
        while let Ok(ev) = events_rx.try_recv() {
            dropped |= matches!(ev, EngineEvent::Dropped { id: 1 });
        }
        assert!(dropped, "closing reports that the session's memory is free");
    }

    #[test]
    fn streaming_modes_with_sparsity_off_generate_the_dense_tokens() {
        let fx = Fixture::new();
        let file = fx.lsm("tiny", None);
        let dense = Arc::new(load(&fx, &file, ""));
        let prompt_tokens = dense.model.tokenizer.encode(PROMPT).unwrap().len();
        let expected = generate(&[(&dense, PROMPT)]).remove(0);
        assert!(
            matches!(expected.last(), Some(StreamEvent::Done { .. })),
            "{expected:?}"
        );
        let expected = ids(&expected);
        assert!(!expected.is_empty());
        for mode in [Mode::Mmap, Mode::OnDemand, Mode::Prefetch, Mode::LeanStream] {
            // Half the chunks: one layer, so every token evicts and reads again.
            let share = if mode.uses_cache() {
                "cache_share = 0.5\n"
            } else {
                ""
            };
            let toml = format!("[models.tiny]\nmode = \"{mode}\"\nsparsity = 0\n{share}");
            let sparse = Arc::new(load(&fx, &file, &toml));
            // Alongside a dense generation, as the scheduler interleaves them.
            let out = generate(&[(&sparse, PROMPT), (&dense, PROMPT)]);
            assert_eq!(ids(&out[0]), expected, "{mode}");
            assert_eq!(ids(&out[1]), expected, "{mode}: the dense run beside it");
            // Every forward pass went through the model's pipeline: the prompt, then each
            // generated token but the last.
            let stats = sparse.ffn.as_ref().unwrap().lock().unwrap().stats();
            let passes = prompt_tokens + expected.len() - 1;
            assert_eq!(stats.tokens as usize, passes, "{mode}");
            if mode.uses_cache() {
                assert!(
                    stats.misses > 0 && stats.bytes_read > 0,
                    "{mode}: {stats:?}"
                );
            }
        }
    }

    /// The stats of a stream's `done` event.
    fn done_stats(events: &[StreamEvent]) -> &StreamStats {
        match events.last() {
            Some(StreamEvent::Done { stats, .. }) => stats,
            other => panic!("the stream did not end with done: {other:?}"),
        }
    }

    #[test]
    fn sessions_decoding_together_share_passes_and_keep_their_tokens() {
        let fx = Fixture::new();
        let file = fx.gguf("tiny");
        let model = Arc::new(load(&fx, &file, ""));
        let prompts = [PROMPT, "a bird sang", "one two three four five six"];
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| ids(&generate(&[(&model, p)])[0]))
            .collect();
        let runs: Vec<(&Arc<LoadedModel>, &str)> = prompts.iter().map(|p| (&model, *p)).collect();
        let together = generate(&runs);
        let mut shared = 0;
        for (i, events) in together.iter().enumerate() {
            assert_eq!(
                ids(events),
                alone[i],
                "session {i}'s tokens beside the others"
            );
            shared += done_stats(events).shared_decode_passes;
        }
        for events in generate(&runs[..1]) {
            assert_eq!(done_stats(&events).shared_decode_passes, 0, "alone");
        }
        // All three start within one round of each other: most of their passes are shared.
        assert!(shared >= TOKENS, "shared passes: {shared}");
    }

    #[test]
    fn a_read_error_ends_only_its_generation() {
        let fx = Fixture::new();
        let file = fx.lsm("tiny", None);
        let toml = "[models.tiny]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 1.0\n";
        let healthy = Arc::new(load(&fx, &file, toml));
        // The same model, but the first chunk of layer 0 sits on a bad sector.
        let mut faulty = load(&fx, &file, toml);
        let sm = SparseModel::open(&file.path, false).unwrap();
        let at = sm.layout.file_offset(sm.layout.id(0, 0));
        let fault = Fault::on_range(at..at + 1, FaultKind::Error(std::io::ErrorKind::Other));
        let reader =
            FaultyReader::new(Arc::new(DirectFile::open(&file.path).unwrap()), vec![fault]);
        let io = ThreadPoolIo::new(Arc::new(reader), 1, Default::default()).unwrap();
        let ffn = StreamingFfn::new(
            Arc::clone(&sm),
            Selector::new(sm.scorer(None).unwrap(), sm.layout.n_ff),
            Policy::for_mode(Mode::LeanStream).unwrap(),
            sm.layout.streamed_bytes(),
            Box::new(io),
            Precision::Exact,
        )
        .unwrap();
        faulty.ffn = Some(Mutex::new(Executor::Streaming(Box::new(ffn))));
        let faulty = Arc::new(faulty);

        let expected = ids(&generate(&[(&healthy, PROMPT)])[0]);
        let out = generate(&[
            (&faulty, PROMPT),
            (&healthy, PROMPT),
            (&faulty, "a bird sang"),
        ]);
        for failed in [&out[0], &out[2]] {
            match failed.as_slice() {
                [StreamEvent::Error { name, message }] => {
                    assert_eq!(name, "Internal");
                    assert!(message.contains("chunk 0"), "{message}");
                }
                other => panic!("expected one error event, got {other:?}"),
            }
        }
        assert_eq!(ids(&out[1]), expected, "the other generation goes on");
        assert!(matches!(out[1].last(), Some(StreamEvent::Done { .. })));
    }
}
