//! The admission stage: the thread between the state owner and the worker. It takes every
//! command in the order it was sent and does, for a `Generate`, everything that can refuse it
//! and costs work:
//!
//! 1. the session is open (its model and context are kept here from its `Open`);
//! 2. the sampler's settings are valid;
//! 3. the input becomes token ids (the chat template rendered first): [`prompt_ids`];
//! 4. the prompt holds at least one token and fits the session's context;
//! 5. the grammar compiles (the first one of a model also builds its token trie and reserves
//!    it: [`LoadedModel::grammar`]), and its parser state for this generation is made;
//! 6. the stream's pipe is made non-blocking.
//!
//! A refusal is answered here (the state owner first, then the caller: see
//! [`super::refuse`]). Only an admitted request goes on to the worker's queue, and only then is
//! the urgency mark raised ([`WorkQueue::send`]): a request that fails never makes a pass in
//! flight give itself up.
//!
//! What needs the worker's session state stays with the worker: reusing what the session's KV
//! cache holds, adopting a shared prefix, and reserving the KV the prompt will fill (which may
//! still refuse it with `OverBudget`, before it runs).
//!
//! Open, Close and Cancel go through here too, unchanged, so that the worker sees every command
//! in the order it was sent: a Close or Cancel never overtakes the Generate before it.

use std::collections::BTreeMap;
use std::io::PipeWriter;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use leanstream::contract::LeanStreamError;
use leanstream_engine::constrain::Constraint;
use leanstream_engine::generate::Decode;

use super::{Command, GenSpec, Gone, Input, LoadedModel, Report, SessionBudget, pipe};
use super::{not_open, refuse, urgency};
use crate::arbiter::SessionId;

/// A `Generate` that passed admission: what the worker needs to install it.
#[derive(Debug)]
pub(super) struct Admitted {
    pub id: SessionId,
    /// The prompt's tokens: at least one, at most the session's context.
    pub ids: Vec<u32>,
    /// The grammar's parser at the start of the output, when the request carried one.
    pub constraint: Option<Constraint>,
    pub spec: GenSpec,
    /// The stream's write end, non-blocking already.
    pub out: PipeWriter,
    /// When the request reached the scheduler: its deadlines count from here.
    pub received: Instant,
}

/// What the admission stage hands on to the worker, in the order the commands came.
#[derive(Debug)]
pub(super) enum Work {
    Open {
        id: SessionId,
        model: Arc<LoadedModel>,
        session: Box<dyn Decode + Send>,
        user: u32,
        /// The session's position as last reported, shared with the admission stage.
        reported: Arc<AtomicU32>,
    },
    Close {
        id: SessionId,
    },
    Generate {
        admitted: Box<Admitted>,
        reply: tokio::sync::oneshot::Sender<Result<(), LeanStreamError>>,
    },
    Cancel {
        id: SessionId,
    },
    /// Answered by the worker between two passes: it is alive (the watchdog's question).
    Ping(tokio::sync::oneshot::Sender<()>),
    Shutdown,
}

/// The worker's queue. Handing it an admitted `Generate` also raises the urgency mark to the
/// request's class; a CPU pass of a less urgent class sees it before its next layer and gives
/// itself up (see the scheduler's module docs, step 1).
#[derive(Debug)]
pub(super) struct WorkQueue {
    tx: Sender<Work>,
    /// The most urgent class handed on since the worker last took its work, as
    /// [`urgency`]; 0 when none. The worker clears it before it takes its work.
    waiting: Arc<AtomicU8>,
}

impl WorkQueue {
    /// A queue, the worker's end of it, and the urgency mark they share.
    pub fn new() -> (WorkQueue, Receiver<Work>, Arc<AtomicU8>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let waiting = Arc::new(AtomicU8::new(0));
        let queue = WorkQueue {
            tx,
            waiting: Arc::clone(&waiting),
        };
        (queue, rx, waiting)
    }

    /// Hands `work` to the worker; `Gone` once its thread has stopped.
    pub fn send(&self, work: Work) -> Result<(), Gone> {
        let class = match &work {
            Work::Generate { admitted, .. } => Some(admitted.spec.priority),
            _ => None,
        };
        self.tx.send(work).map_err(|_| Gone)?;
        // Marked after the send: the worker clears the mark before it takes its work, so a
        // mark always belongs to work it has not taken yet or has just taken (then at most one
        // pass is given up for nothing, and the mark is cleared again before the next one).
        if let Some(class) = class {
            self.waiting.fetch_max(urgency(class), Ordering::AcqRel);
        }
        Ok(())
    }
}

/// What admission keeps of an open session.
#[derive(Debug)]
struct Known {
    model: Arc<LoadedModel>,
    /// Room of its KV cache, in tokens.
    max_context: usize,
    /// Its position as the worker last reported it, for the reports of refusals.
    reported: Arc<AtomicU32>,
}

/// The admission stage's state.
pub(super) struct Admission {
    pub(super) rx: Receiver<Command>,
    pub(super) work: WorkQueue,
    reports: tokio::sync::mpsc::UnboundedSender<Report>,
    /// For the grammar token tries, kept by their model.
    budget: Box<dyn SessionBudget>,
    sessions: BTreeMap<SessionId, Known>,
}

impl Admission {
    pub fn new(
        rx: Receiver<Command>,
        work: WorkQueue,
        reports: tokio::sync::mpsc::UnboundedSender<Report>,
        budget: Box<dyn SessionBudget>,
    ) -> Admission {
        Admission {
            rx,
            work,
            reports,
            budget,
            sessions: BTreeMap::new(),
        }
    }

    /// Takes commands until one asks to shut down (handed on first), the daemon drops its end,
    /// or the worker is gone.
    pub fn run(mut self) {
        while let Ok(cmd) = self.rx.recv() {
            if self.handle(cmd) {
                return;
            }
        }
        let _ = self.work.send(Work::Shutdown);
    }

    /// Handles one command: a `Generate` is prepared and handed on, or refused here (reported
    /// to the state owner before its caller hears of it, so the session is no longer busy by
    /// the time the caller can try again); anything else is handed on as it is. True when the
    /// scheduler stops: a `Shutdown`, or the worker is gone.
    pub fn handle(&mut self, cmd: Command) -> bool {
        let work = match cmd {
            Command::Open {
                id,
                model,
                session,
                user,
            } => {
                let reported = Arc::new(AtomicU32::new(session.position() as u32));
                let known = Known {
                    model: Arc::clone(&model),
                    max_context: session.max_context(),
                    reported: Arc::clone(&reported),
                };
                self.sessions.insert(id, known);
                Work::Open {
                    id,
                    model,
                    session,
                    user,
                    reported,
                }
            }
            Command::Close { id } => {
                self.sessions.remove(&id);
                Work::Close { id }
            }
            Command::Cancel { id } => Work::Cancel { id },
            Command::Ping(reply) => Work::Ping(reply),
            Command::Generate {
                id,
                input,
                spec,
                out,
                reply,
            } => {
                let received = Instant::now();
                match self.prepare(id, input, &spec, &out) {
                    Ok((ids, constraint)) => Work::Generate {
                        admitted: Box::new(Admitted {
                            id,
                            ids,
                            constraint,
                            spec,
                            out,
                            received,
                        }),
                        reply,
                    },
                    Err(e) => {
                        let position = self
                            .sessions
                            .get(&id)
                            .map_or(0, |s| s.reported.load(Ordering::Acquire));
                        refuse(&self.reports, id, position, reply, e);
                        return false;
                    }
                }
            }
            Command::Shutdown => {
                let _ = self.work.send(Work::Shutdown);
                return true;
            }
        };
        self.work.send(work).is_err()
    }

    /// Steps 1 to 6 of the module docs: the prompt's tokens and the grammar's parser state, or
    /// why the request is refused.
    fn prepare(
        &self,
        id: SessionId,
        input: Input,
        spec: &GenSpec,
        out: &PipeWriter,
    ) -> Result<(Vec<u32>, Option<Constraint>), LeanStreamError> {
        let s = self.sessions.get(&id).ok_or_else(|| not_open(id))?;
        let invalid = |e: leanstream_engine::Error| LeanStreamError::InvalidArgument(e.to_string());
        spec.sampler.validate().map_err(invalid)?;
        let ids = prompt_ids(&s.model, input)?;
        if ids.is_empty() {
            return Err(LeanStreamError::InvalidArgument(
                "the prompt encodes to no tokens".into(),
            ));
        }
        if ids.len() > s.max_context {
            return Err(LeanStreamError::InvalidArgument(format!(
                "the prompt is {} tokens; the session's context holds {}",
                ids.len(),
                s.max_context
            )));
        }
        let constraint = match &spec.grammar {
            Some((kind, text)) => {
                let budget = self.budget.as_ref();
                let reserve = |bytes| budget.grow_model(&s.model.name, bytes);
                Some(s.model.grammar(*kind, text, reserve)?.start())
            }
            None => None,
        };
        pipe::set_nonblocking(out)?;
        Ok((ids, constraint))
    }
}

/// The token ids of `input` on `model`: a chat is rendered with the model's template, its
/// messages' text never read as control tokens.
/// The one place the daemon turns a request's input into ids.
pub fn prompt_ids(model: &LoadedModel, input: Input) -> Result<Vec<u32>, LeanStreamError> {
    let invalid = |e: leanstream_engine::Error| LeanStreamError::InvalidArgument(e.to_string());
    let tokenizer = &model.model.tokenizer;
    match input {
        Input::Text(text) => tokenizer.encode(&text).map_err(invalid),
        // Message text is encoded as text: control-token spellings in it stay characters.
        Input::Chat(messages) => (model.template)
            .render_ids(tokenizer, &messages, true)
            .map_err(invalid),
    }
}
