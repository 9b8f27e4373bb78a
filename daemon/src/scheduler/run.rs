//! One generation in flight: the engine's [`Stepper`] plus what the scheduler adds to it — the
//! grammar's state, the stream's pipe and the bytes not yet written, the request's class and
//! deadlines, and the events each step writes.

use std::io::PipeWriter;
use std::time::Instant;

use leanstream::contract::{LeanStreamError, Priority, StreamEvent, StreamStats};
use leanstream_engine::constrain::Constraint;
use leanstream_engine::generate::{Decode, Next, Stepper, StopReason};
use leanstream_engine::tokenizer::Tokenizer;

use super::{GenSpec, SessionBudget, pipe};
use crate::memory::SessionId;

/// A generation in flight (see the module docs).
#[derive(Debug)]
pub struct Run {
    pub stepper: Stepper,
    /// The grammar's parser state, when the request carried one.
    constraint: Option<Constraint>,
    out: PipeWriter,
    /// Bytes not yet written (the pipe was full).
    pending: Vec<u8>,
    /// The final event is queued; the generation ends once it is written.
    ending: bool,
    pub priority: Priority,
    first_token_by: Option<Instant>,
    end_by: Option<Instant>,
    first_token_at: Option<Instant>,
    /// Tokens of the whole prompt, those already in the KV cache included.
    prompt_tokens: usize,
    /// Decode passes run together with other sessions' steps.
    pub shared_decode_passes: usize,
    /// Prompt pieces run together with other sessions' steps.
    pub shared_prompt_passes: usize,
    /// The session's reservation while this generation runs, in bytes: at its start, what the
    /// session holds plus the KV the rest of its prompt and first generated token will fill
    /// ([`Room::reserve_prompt`]). The prompt's pieces are allocated within it; it grows only
    /// when a step needs more ([`Room::grow`]), and shrinks only when blocks it paid for become
    /// a shared prefix (see the prefix module).
    pub reserved: u64,
}

/// Why a step failed: the budget refused the KV cache's growth, or the engine failed.
pub enum Failure {
    Budget(LeanStreamError),
    Engine(leanstream_engine::Error),
}

impl From<leanstream_engine::Error> for Failure {
    fn from(e: leanstream_engine::Error) -> Failure {
        Failure::Engine(e)
    }
}

impl Run {
    /// A generation of a `prompt_tokens`-token prompt, requested at `received`, for which
    /// `reserved` bytes are reserved.
    pub fn new(
        stepper: Stepper,
        constraint: Option<Constraint>,
        out: PipeWriter,
        spec: &GenSpec,
        received: Instant,
        prompt_tokens: usize,
        reserved: u64,
    ) -> Run {
        Run {
            stepper,
            constraint,
            out,
            pending: Vec::new(),
            ending: false,
            priority: spec.priority,
            first_token_by: spec.first_token_within.map(|d| received + d),
            end_by: spec.within.map(|d| received + d),
            first_token_at: None,
            prompt_tokens,
            shared_decode_passes: 0,
            shared_prompt_passes: 0,
            reserved,
        }
    }

    /// Whether the generation can take a step now: it is not ending and its pipe took
    /// everything.
    pub fn can_step(&self) -> bool {
        !self.ending && self.pending.is_empty()
    }

    /// The deadline the generation works towards now: the first token's while it is not out
    /// (or the end's, if earlier), then the end's.
    pub fn next_deadline(&self) -> Option<Instant> {
        match (self.first_token_at, self.first_token_by, self.end_by) {
            (None, Some(f), Some(e)) => Some(f.min(e)),
            (None, Some(f), None) => Some(f),
            (_, _, e) => e,
        }
    }

    /// The first `n` tokens of the prompt piece went through the model; the token sampled
    /// after the last piece goes out at once.
    pub fn prefilled(
        &mut self,
        n: usize,
        logits: &mut [f32],
        tok: &Tokenizer,
    ) -> Result<(), Failure> {
        self.stepper
            .prefilled(n, logits, self.constraint.as_mut())?;
        self.emit_due(tok)
    }

    /// The emitted token's forward pass ran: the next token is sampled and goes out at once.
    pub fn forwarded(&mut self, logits: &mut [f32], tok: &Tokenizer) -> Result<(), Failure> {
        self.stepper.forwarded(logits, self.constraint.as_mut())?;
        self.emit_due(tok)
    }

    /// Writes a sampled token to the stream, before any other forward pass runs; queues the
    /// `done` event when the generation is over.
    fn emit_due(&mut self, tok: &Tokenizer) -> Result<(), Failure> {
        match self.stepper.next() {
            Next::Emit(_) => {
                let token = self.stepper.emit(Some(tok))?;
                self.first_token_at.get_or_insert_with(Instant::now);
                self.queue(&StreamEvent::Token {
                    id: token.id,
                    text: token.text,
                });
                // A full pipe keeps it pending (written when it drains); a closed one ends the
                // generation when the scheduler settles it.
                let _ = self.flush();
                if let Some(reason) = token.stop {
                    self.end_done(reason);
                }
            }
            Next::Done(reason) => self.end_done(reason),
            Next::Prefill(_) | Next::Forward(_) => {}
        }
        Ok(())
    }

    /// Queues `event` as one JSON line.
    fn queue(&mut self, event: &StreamEvent) {
        // Serialising these plain types cannot fail; an empty line would be the only trace if
        // it did.
        if let Ok(line) = serde_json::to_vec(event) {
            self.pending.extend_from_slice(&line);
        }
        self.pending.push(b'\n');
    }

    /// Writes what the pipe takes. `Ok(true)`: bytes are left (pipe full); `Err`: the reader is
    /// gone.
    pub fn flush(&mut self) -> std::io::Result<bool> {
        pipe::flush(&mut self.out, &mut self.pending)
    }

    /// Writes what the pipe takes; true when the generation is over: its last event is out, or
    /// its reader is gone.
    pub fn flush_is_over(&mut self) -> bool {
        match self.flush() {
            Err(_) => true, // the reader closed its end: cancelled
            Ok(left) => !left && self.ending,
        }
    }

    fn end_done(&mut self, reason: StopReason) {
        let now = Instant::now();
        let st = self.stepper.stats();
        let missed = |by: Option<Instant>, at: Option<Instant>| {
            by.is_some_and(|by| at.is_none_or(|at| at > by))
        };
        let mut missed_deadlines = Vec::new();
        if missed(self.first_token_by, self.first_token_at) {
            missed_deadlines.push("first_token".to_string());
        }
        if missed(self.end_by, Some(now)) {
            missed_deadlines.push("end".to_string());
        }
        let stats = StreamStats {
            prompt_tokens: self.prompt_tokens,
            generated_tokens: st.generated_tokens,
            time_to_first_token_s: st.prefill.as_secs_f64(),
            prefill_tokens_per_s: st.prefill_tokens_per_s(),
            decode_tokens_per_s: st.decode_tokens_per_s(),
            shared_decode_passes: self.shared_decode_passes,
            shared_prompt_passes: self.shared_prompt_passes,
            cached_prompt_tokens: self.prompt_tokens - st.prompt_tokens,
            priority: self.priority.name().to_string(),
            missed_deadlines,
        };
        self.queue(&StreamEvent::Done {
            reason: reason.name().into(),
            stats,
        });
        self.ending = true;
    }

    /// Ends the generation with an error event (`name` without the interface prefix), unless
    /// its final event is queued already.
    pub fn end_with_error(&mut self, name: &str, message: &str) {
        if self.ending {
            return;
        }
        self.queue(&StreamEvent::Error {
            name: name.into(),
            message: message.into(),
        });
        self.stepper.end(StopReason::Cancelled);
        self.ending = true;
    }

    /// Ends the generation with the error event for `f`, logged as the kind of failure it is.
    pub fn fail(&mut self, id: SessionId, f: Failure) {
        match f {
            Failure::Budget(e) => {
                tracing::info!("session {id}: generation ended: {e}");
                self.end_with_error("OverBudget", &e.to_string());
            }
            Failure::Engine(e @ leanstream_engine::Error::Constraint(_)) => {
                tracing::info!("session {id}: generation ended by its grammar: {e}");
                self.end_with_error("InvalidArgument", &e.to_string());
            }
            Failure::Engine(e) => {
                tracing::error!("session {id}: generation failed: {e}");
                self.end_with_error("Internal", &e.to_string());
            }
        }
    }
}

/// A session's way to the budget.
pub struct Room<'a> {
    pub id: SessionId,
    pub budget: &'a dyn SessionBudget,
}

impl Room<'_> {
    /// Reserves at once what `session` will hold once the rest of `stepper`'s prompt and the
    /// first generated token are in its KV cache ([`need`]), and returns it (the run's
    /// [`Run::reserved`]). `OverBudget` when that does not fit: the generation is then refused
    /// before it runs. Prompts that arrive together thus each get all the KV they will fill, or
    /// are refused one by one, instead of each growing block by block until all run out half-way.
    pub fn reserve_prompt(
        &self,
        session: &dyn Decode,
        stepper: &Stepper,
    ) -> Result<u64, LeanStreamError> {
        let bytes = need(session, stepper);
        if bytes > session.bytes() {
            self.budget.resize(self.id, bytes)?;
        }
        Ok(bytes)
    }

    /// Makes room in the KV cache for `tokens` more tokens: reserves the blocks they need
    /// first (unless `reserved`, the run's reservation, holds them already: a prompt's pieces),
    /// then allocates them. Nothing is allocated when the reservation is refused. The
    /// reservation is absolute, so it is only ever raised here, never set below `reserved`.
    pub fn grow(
        &self,
        session: &mut dyn Decode,
        tokens: usize,
        reserved: &mut u64,
    ) -> Result<(), Failure> {
        let extra = session.kv_growth_bytes(tokens);
        if extra == 0 {
            return Ok(());
        }
        let bytes = session.bytes() + extra;
        if bytes > *reserved {
            self.budget
                .resize(self.id, bytes)
                .map_err(Failure::Budget)?;
            *reserved = bytes;
        }
        Ok(session.grow_kv(tokens)?)
    }
}

/// The bytes `session` holds once what `stepper` still has to write up to its first generated
/// token is in its KV cache: the rest of the prompt and that token while it prefills, nothing
/// more after that (decode steps reserve block by block: [`Room::grow`]).
pub fn need(session: &dyn Decode, stepper: &Stepper) -> u64 {
    let ahead = match stepper.next() {
        Next::Prefill(rest) => rest.len() + 1,
        Next::Forward(_) | Next::Emit(_) | Next::Done(_) => 0,
    };
    session.bytes() + session.kv_growth_bytes(ahead)
}
