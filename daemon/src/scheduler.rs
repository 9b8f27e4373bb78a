//! The scheduler: two OS threads between the state owner and the engine, never on tokio
//! workers. The **admission stage** ([`admit`]) takes every command in order and prepares each
//! `Generate` (template, tokens, context check, grammar), answering refusals itself; the
//! **worker** owns every engine [`Session`](leanstream_engine::forward::Session), decides who
//! runs next, runs the forward passes and writes each token to its pipe. What a generation *is*
//! (sampling, stop rules, detokenising, timings) is the engine's [`Stepper`]; this module only
//! drives steppers.
//!
//! ```text
//! state owner ──Commands──▶ admission ──admitted work──▶ worker ──tokens──▶ pipes
//!      ▲                        │ refusals                 │
//!      └────────── Report ──────┴──────────────────────────┘
//! ```
//!
//! Policy, one round at a time:
//!
//! 1. **Class first.** Only generations of the most urgent [`Priority`] with work to do take
//!    steps; a lower class waits. A request of a more urgent class pre-empts a CPU pass in
//!    flight: once the admission stage has admitted it, handing it to the worker raises an
//!    urgency mark that the pass checks before each layer, and a pass of a less urgent class
//!    gives itself up there (its sessions do not advance, and run the same step again later: the
//!    same bits). The newcomer thus waits for one layer, not a whole pass. A request that is
//!    refused at admission (a grammar that does not compile, a prompt longer than the context)
//!    never raises the mark, so it costs the generations in flight nothing. Commands are taken
//!    after every pass, and a round ends early when a more urgent generation has arrived. A GPU
//!    pass runs to its end.
//! 2. **Within a class, turns.** Every generation of the class takes one step per round, the
//!    one with the earliest deadline first. A step is a piece of the prompt (prefill: up to
//!    [`MAX_BATCH`](leanstream_engine::forward::MAX_BATCH) tokens through the batched pass; one
//!    token at a time through a sparse pipeline on the GPU) or the forward pass of the token it
//!    emitted last, with the tokens speculative decoding drafted after it (at most
//!    [`room::max_draft`]; see [`passes`]). A long prompt therefore cannot stall the others: it
//!    goes in pieces, interleaved with their decode steps.
//! 3. **One pass for many.** The steps of a round run together where they can: the CPU sessions
//!    of one model share one pass, decode steps and prompt pieces alike, up to `MAX_BATCH`
//!    tokens a pass ([`passes`]). In `dense` mode that is one pass over the model's weights; in
//!    a streaming mode the union of the chunks the pass's tokens need is read once and each chunk
//!    is applied to every token that needs it. Eight clients that send their prompts at once
//!    thus get their first tokens from one or two passes, not eight.
//! 4. **Tokens out at once.** A sampled token is written to its pipe before any other forward
//!    pass starts.
//!
//! Memory: when the worker starts a generation it reserves at once the KV its whole prompt and
//! first generated token will fill; a request whose reservation does not fit is refused with
//! `OverBudget` before it runs. Prompts that arrive together therefore each get all they need or
//! are refused one by one, instead of each getting part of it and all failing half-way. Decode
//! steps reserve block by block as before. A generation that speculates also reserves, at its
//! start, the buffer its verification passes write every row's logits to, and hands it back at
//! its end; when only the prompt fits, it runs without speculation.
//!
//! A prompt that starts with tokens another session of the same user and model has run (a
//! system prompt) starts from their shared keys and values instead of computing them (see
//! [`prefix`]).
//!
//! Sessions on one model share its `Arc<Model>` (weights, tokenizer) and, in a sparse mode, its
//! FFN pipeline with the neuron cache (see [`crate::loader`]); each owns its KV cache.
//!
//! Errors: a forward pass that fails (in a streaming mode: a chunk that could not be read after
//! the I/O workers' retries) ends only the generations it was for (all those of a shared pass),
//! with an `Internal` error event; the pipeline drops the failed pass and serves the next one as
//! usual.
//!
//! Token stream: each event is a [`StreamEvent`](leanstream::contract::StreamEvent) JSON line on
//! the generation's pipe. The write end is non-blocking: a reader that does not keep up only pauses
//! its own generation (the scheduler skips it until the pipe drains), never the others. A write
//! error (EPIPE: the reader closed its end) cancels that generation quietly.
//!
//! The parts, one file each:
//!
//! - this file: what the rest of the daemon sees (the commands, the reports, the budget it
//!   reserves through), the start of the two threads, and the little the parts below share (an
//!   open session's entry, the urgency mark's scale, refusals);
//! - [`admit`]: the admission stage;
//! - [`worker`]: the worker's sessions, its rounds, and how a generation starts and ends;
//! - [`passes`]: the steps of a round grouped into forward passes, and running them;
//! - [`run`]: one generation in flight and the events it writes;
//! - [`room`]: a generation's reservations in the budget;
//! - [`sentences`]: sentence and phrase marks in the stream, for speech;
//! - [`prefix`]: prompt prefixes shared between sessions;
//! - [`pipe`]: the non-blocking write end of a stream.

mod admit;
mod passes;
mod pipe;
mod prefix;
mod room;
mod run;
mod sentences;
#[cfg(test)]
mod tests;
mod worker;

use std::io::PipeWriter;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::sync::mpsc::Sender;
use std::time::Duration;

use leanstream::contract::{LeanStreamError, Priority};
use leanstream_engine::chat::ChatMessage;
use leanstream_engine::constrain::GrammarKind;
use leanstream_engine::generate::{Decode, Stepper};
use leanstream_engine::sample::SamplerConfig;

use crate::arbiter::SessionId;
pub use crate::loader::LoadedModel;
pub use admit::prompt_ids;
use admit::{Admission, WorkQueue};
use run::Run;
use worker::Worker;

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
    /// A grammar the output must match, compiled at admission.
    pub grammar: Option<(GrammarKind, String)>,
    pub priority: Priority,
    /// The first token should be out this long after the request.
    pub first_token_within: Option<Duration>,
    /// The generation should be over this long after the request.
    pub within: Option<Duration>,
    /// Mark sentence and phrase ends in the stream (`StreamEvent::Sentence`).
    pub sentences: bool,
}

#[cfg(test)]
impl GenSpec {
    /// A greedy generation of `max_tokens` tokens in class `priority`, without deadlines.
    pub fn greedy(max_tokens: usize, priority: Priority) -> GenSpec {
        GenSpec {
            max_tokens,
            sampler: leanstream_engine::sample::SamplerConfig::default(),
            stop: Vec::new(),
            grammar: None,
            priority,
            first_token_within: None,
            within: None,
            sentences: false,
        }
    }
}

/// Commands to the scheduler, taken in the order they are sent.
#[derive(Debug)]
pub enum Command {
    Open {
        id: SessionId,
        model: Arc<LoadedModel>,
        session: Box<dyn Decode + Send>,
        /// The uid of the session's owner: prompt prefixes are shared only between sessions of
        /// one user (see [`prefix`]).
        user: u32,
    },
    /// Drops the session (and cancels its generation without a final event: the stream just ends).
    Close { id: SessionId },
    /// Starts a generation. The reply is `Ok` once it runs, or the reason it was refused (a
    /// refusal is reported as [`Report::Finished`] before the reply is sent).
    Generate {
        id: SessionId,
        input: Input,
        spec: GenSpec,
        out: PipeWriter,
        reply: tokio::sync::oneshot::Sender<Result<(), LeanStreamError>>,
    },
    /// Ends the running generation of `id` with a `Cancelled` event.
    Cancel { id: SessionId },
    /// Answered once the worker is between two passes: both threads are alive (the systemd
    /// watchdog's check).
    Ping(tokio::sync::oneshot::Sender<()>),
    /// Cancels everything (streams end with `Cancelled`), flushes for at most a second, exits.
    Shutdown,
}

/// Reports from the scheduler's threads to the state owner.
#[derive(Debug)]
pub enum Report {
    /// A `Generate` command is over: `position` is where the session stands now (after a
    /// refusal too).
    Finished {
        id: SessionId,
        position: u32,
        /// How it went; `None` when it was refused up front.
        outcome: Option<Outcome>,
    },
    /// A closed session has been dropped: its memory is handed back.
    Dropped { id: SessionId },
}

/// What a generation's decode phase ran: its forward passes, and the draft tokens they verified
/// and accepted (none without speculation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodePasses {
    pub passes: u64,
    pub drafted: u64,
    pub accepted: u64,
}

/// How an admitted generation went, for its session's statistics and the daemon's counters.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub priority: Priority,
    /// Tokens of the whole prompt, and of them those whose keys and values were already in
    /// memory (not computed).
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub generated: u64,
    pub passes: DecodePasses,
    /// From the request's arrival to its first token; `None` when no token came.
    pub first_token_after: Option<Duration>,
    /// How it ended: a stop reason (`eos`, `max_tokens`, `stop_string`, `context_full`), an
    /// error name (`Cancelled`, `OverBudget`, …), or `stream_closed` (the reader closed its end).
    pub end: String,
}

impl DecodePasses {
    /// Those of `stepper`'s generation: its speculation's counts, or one pass per generated
    /// token after the first without speculation.
    fn of(stepper: &Stepper) -> DecodePasses {
        match stepper.speculation() {
            Some(s) => DecodePasses {
                passes: s.passes as u64,
                drafted: s.drafted.iter().sum::<usize>() as u64,
                accepted: s.accepted.iter().sum::<usize>() as u64,
            },
            None => DecodePasses {
                passes: stepper.ids().len().saturating_sub(1) as u64,
                ..DecodePasses::default()
            },
        }
    }
}

/// Where the scheduler reserves memory before a session's KV cache grows or a model keeps
/// more: the state owner, which asks the arbiter (shrinking neuron caches first when needed).
/// Blocking: the calling thread waits for the answer before it allocates.
pub trait SessionBudget: Send {
    /// Sets session `id`'s reservation to `bytes` (absolute, not a delta); `OverBudget` when
    /// that does not fit.
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError>;
    /// Adds `bytes` to model `name`'s reservation for the rest of its life; `OverBudget`
    /// when that does not fit.
    fn grow_model(&self, name: &str, bytes: u64) -> Result<(), LeanStreamError>;
    /// Takes `bytes` back off model `name`'s reservation: something it kept is gone.
    fn shrink_model(&self, name: &str, bytes: u64);
}

/// Handle of the scheduler's threads.
#[derive(Debug)]
pub struct Scheduler {
    pub tx: Commands,
    /// The admission stage's thread, which joins the worker's before it ends: once it is
    /// joined, both have stopped.
    pub thread: std::thread::JoinHandle<()>,
}

/// The scheduler's inbox (its admission stage's), cloned by whoever gives it work.
#[derive(Clone, Debug)]
pub struct Commands {
    tx: Sender<Command>,
}

impl Commands {
    /// Hands `cmd` to the scheduler; `Gone` once its threads have stopped.
    pub fn send(&self, cmd: Command) -> Result<(), Gone> {
        self.tx.send(cmd).map_err(|_| Gone)
    }
}

/// The scheduler's threads have stopped: a command could not be handed to them.
#[derive(Debug)]
pub struct Gone;

/// A class as the urgency mark holds it: higher is more urgent; 0 is "nothing waiting".
fn urgency(class: Priority) -> u8 {
    match class {
        Priority::Background => 1,
        Priority::Interactive => 2,
        Priority::Realtime => 3,
    }
}

/// Stack of the admission and worker threads. Compiling a grammar (admission) and computing its
/// token mask at every constrained step (worker) recurse as deep as the grammar nests; the
/// engine bounds that nesting, and this size leaves what the bounds let through wide headroom
/// (the default 2 MiB does not: a chain of a thousand Lark rules overflowed it). It is address
/// space, not memory: the kernel backs only the pages a recursion actually touches, so a shallow
/// grammar costs what it would on a small stack.
const STACK_BYTES: usize = 64 << 20;

impl Scheduler {
    /// Starts the worker and admission threads and waits until both are up (the ready
    /// handshake). `budget` is called once per thread that reserves memory (the admission stage
    /// for grammar tries, the worker for KV caches and shared prefixes): each gets its own.
    pub fn start(
        reports: tokio::sync::mpsc::UnboundedSender<Report>,
        budget: impl Fn() -> Box<dyn SessionBudget>,
    ) -> std::io::Result<Scheduler> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (work, work_rx, waiting) = WorkQueue::new();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(2);
        let worker = Worker::new(work_rx, waiting, reports.clone(), budget());
        let ready = ready_tx.clone();
        let worker = std::thread::Builder::new()
            .name("leanstream-sched".into())
            .stack_size(STACK_BYTES)
            .spawn(move || {
                let _ = ready.send(());
                worker.run();
            })?;
        let admission = Admission::new(rx, work, reports, budget());
        let thread = std::thread::Builder::new()
            .name("leanstream-admit".into())
            .stack_size(STACK_BYTES)
            .spawn(move || {
                let _ = ready_tx.send(());
                admission.run();
                // Shutting down (or the worker is gone): wait for the worker's last flush.
                if worker.join().is_err() {
                    tracing::error!("the scheduler's worker thread panicked");
                }
            })?;
        for _ in 0..2 {
            ready_rx
                .recv()
                .map_err(|_| std::io::Error::other("a scheduler thread died while starting"))?;
        }
        Ok(Scheduler {
            tx: Commands { tx },
            thread,
        })
    }
}

/// One open session of the worker: its model, its engine session and what its KV cache holds.
/// The worker's passes and the prefix store read and change it too.
#[derive(Debug)]
struct Entry {
    model: Arc<LoadedModel>,
    /// The uid of the session's owner.
    user: u32,
    session: Box<dyn Decode + Send>,
    /// The tokens in the KV cache, in order.
    seen: Vec<u32>,
    /// The generation in flight, if any.
    run: Option<Run>,
    /// The position last reported to the state owner, shared with the admission stage, whose
    /// refusals report it (nothing moves a session between its generations).
    reported: Arc<AtomicU32>,
}

/// Answers a `Generate` that will not run: the state owner hears of it first (and clears the
/// session's busy flag), then the caller, so that by the time the caller can try again the
/// session is free. Both scheduler threads refuse through here.
fn refuse(
    reports: &tokio::sync::mpsc::UnboundedSender<Report>,
    id: SessionId,
    position: u32,
    reply: tokio::sync::oneshot::Sender<Result<(), LeanStreamError>>,
    error: LeanStreamError,
) {
    let _ = reports.send(Report::Finished {
        id,
        position,
        outcome: None,
    });
    let _ = reply.send(Err(error));
}

/// The error for a command about session `id`, which is not open.
fn not_open(id: SessionId) -> LeanStreamError {
    LeanStreamError::Internal(format!("session {id} is not open"))
}
