//! One generation in flight: the engine's [`Stepper`] plus what the scheduler adds to it — the
//! grammar's state, the stream's pipe and the bytes not yet written, the request's class and
//! deadlines, and the events each step writes.

use std::io::PipeWriter;
use std::time::Instant;

use leanstream::contract::{LeanStreamError, Priority, StreamEvent, StreamStats};
use leanstream_engine::constrain::Constraint;
use leanstream_engine::generate::{Decode, Next, SpeculationStats, Stepper, StopReason};
use leanstream_engine::tokenizer::Tokenizer;

use super::sentences::Sentences;
use super::{DecodePasses, GenSpec, Outcome, pipe};
use crate::arbiter::SessionId;

/// A generation in flight (see the module docs).
#[derive(Debug)]
pub struct Run {
    pub stepper: Stepper,
    /// The grammar's parser state, when the request carried one.
    constraint: Option<Constraint>,
    out: PipeWriter,
    /// Bytes not yet written (the pipe was full).
    pending: Vec<u8>,
    /// The final event (`done` or `error`), held back until the state owner has been told that
    /// the generation is over ([`Run::release_last`]): a caller that reads it and asks for the
    /// session's `Stats()` or the daemon's counters finds this generation in them.
    last: Vec<u8>,
    /// The final event is queued; the generation ends once it is written.
    ending: bool,
    pub priority: Priority,
    /// When the request arrived.
    received: Instant,
    first_token_by: Option<Instant>,
    end_by: Option<Instant>,
    first_token_at: Option<Instant>,
    /// How it ended, once it has: a stop reason or an error name (see [`Outcome::end`]).
    end: Option<String>,
    /// Tokens of the whole prompt, those already in the KV cache included.
    prompt_tokens: usize,
    /// Decode passes run together with other sessions' steps.
    pub shared_decode_passes: usize,
    /// Prompt pieces run together with other sessions' steps.
    pub shared_prompt_passes: usize,
    /// The session's reservation while this generation runs, in bytes: at its start, what the
    /// session holds plus the KV the rest of its prompt and first generated token will fill
    /// ([`Room::reserve_prompt`](super::room::Room::reserve_prompt)). The prompt's pieces are
    /// allocated within it; it grows only when a step needs more
    /// ([`Room::grow`](super::room::Room::grow)), and shrinks only when blocks it paid for become a
    /// shared prefix (see the prefix module).
    pub reserved: u64,
    /// The session's position when the generation started (what its KV cache held of earlier
    /// turns and shared prefixes): with [`Stepper::kv_tokens`], where it ends.
    start: usize,
    /// The logits of every token of a verification pass (speculative decoding), one row each.
    /// Its capacity, allocated once at the start for the longest pass the speculation asks for,
    /// is part of [`Run::reserved`]; empty without speculation.
    pub rows: Vec<f32>,
    /// Sentence marks, with the `sentences` option.
    sentences: Option<Sentences>,
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
    /// A generation of a `prompt_tokens`-token prompt, requested at `received`, on a session
    /// at position `start`, for which `reserved` bytes are reserved; `rows` is its verification
    /// rows buffer (see [`Run::rows`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        stepper: Stepper,
        constraint: Option<Constraint>,
        out: PipeWriter,
        spec: &GenSpec,
        received: Instant,
        prompt_tokens: usize,
        start: usize,
        reserved: u64,
        rows: Vec<f32>,
    ) -> Run {
        Run {
            stepper,
            constraint,
            out,
            pending: Vec::new(),
            last: Vec::new(),
            ending: false,
            priority: spec.priority,
            received,
            first_token_by: spec.first_token_within.map(|d| received + d),
            end_by: spec.within.map(|d| received + d),
            first_token_at: None,
            end: None,
            prompt_tokens,
            shared_decode_passes: 0,
            shared_prompt_passes: 0,
            reserved,
            start,
            rows,
            sentences: spec.sentences.then(Sentences::default),
        }
    }

    /// How the generation went (see [`Outcome`]), once it is over.
    pub fn outcome(&self) -> Outcome {
        let st = self.stepper.stats();
        Outcome {
            priority: self.priority,
            prompt_tokens: self.prompt_tokens as u64,
            cached_prompt_tokens: (self.prompt_tokens - st.prompt_tokens) as u64,
            generated: self.stepper.ids().len() as u64,
            passes: DecodePasses::of(&self.stepper),
            first_token_after: self.first_token_at.map(|at| at - self.received),
            end: (self.end.clone()).unwrap_or_else(|| "stream_closed".into()),
        }
    }

    /// Bytes of the verification rows buffer, which the run's reservation holds beside the
    /// session's own (0 without speculation).
    pub fn rows_bytes(&self) -> u64 {
        (self.rows.capacity() * std::mem::size_of::<f32>()) as u64
    }

    /// The generation is over: forgets what the session's KV cache holds past what plain
    /// decoding leaves in it (drafts accepted after the token that stopped it, or a
    /// verification pass whose sampling failed), and cuts `seen`, its mirror, to match, so that
    /// a later prompt extending the conversation reuses exactly what is there. A session that
    /// cannot rewind forgets everything instead.
    pub fn rewind_to_end(&self, session: &mut dyn Decode, seen: &mut Vec<u32>) {
        let end = self.start + self.stepper.kv_tokens();
        if session.position() != end
            && let Err(e) = session.rewind(end)
        {
            tracing::warn!("a session could not rewind to {end} at the end of a generation: {e}");
            session.reset();
            seen.clear();
            return;
        }
        seen.truncate(end);
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

    /// The forward pass of the emitted token (and of its drafts, when the speculation drafted
    /// some) ran: `last` holds its only token's logits, or with `None` the run's
    /// [`Run::rows`] hold every token's (a verification pass). The tokens sampled from them go
    /// out at once. Returns how many of the pass's positions the session keeps: the caller
    /// rewinds it to the pass's start plus that.
    pub fn forwarded(
        &mut self,
        last: Option<&mut [f32]>,
        tok: &Tokenizer,
    ) -> Result<usize, Failure> {
        let constraint = self.constraint.as_mut();
        let kept = match last {
            Some(logits) => self.stepper.forwarded(logits, constraint)?,
            None => self.stepper.forwarded(&mut self.rows, constraint)?,
        };
        self.emit_due(tok)?;
        Ok(kept)
    }

    /// The pass of the emitted token and what the session drafted from its shortlist as it
    /// ran went through the model: `fed` holds the tokens it ran, the run's [`Run::rows`]
    /// their logits. As [`Run::forwarded`].
    pub fn drafted(&mut self, fed: &[u32], tok: &Tokenizer) -> Result<usize, Failure> {
        let constraint = self.constraint.as_mut();
        let kept = self.stepper.drafted(fed, &mut self.rows, constraint)?;
        self.emit_due(tok)?;
        Ok(kept)
    }

    /// Writes every sampled token to the stream (a verification pass samples several), before
    /// any other forward pass runs; queues the `done` event when the generation is over.
    fn emit_due(&mut self, tok: &Tokenizer) -> Result<(), Failure> {
        let ended = loop {
            match self.stepper.next() {
                Next::Emit(_) => {
                    let token = self.stepper.emit(Some(tok))?;
                    self.first_token_at.get_or_insert_with(Instant::now);
                    let pieces = (self.sentences.as_mut()).map(|s| s.push(&token.text));
                    self.queue(&StreamEvent::Token {
                        id: token.id,
                        text: token.text,
                    });
                    for text in pieces.into_iter().flatten() {
                        self.queue(&StreamEvent::Sentence { text });
                    }
                    if token.stop.is_some() {
                        break token.stop;
                    }
                }
                Next::Done(reason) => break Some(reason),
                Next::Prefill(_) | Next::Forward(_) | Next::Draft(..) => break None,
            }
        };
        if let Some(reason) = ended {
            self.end_done(reason);
        }
        // A full pipe keeps the rest pending (written when it drains); a closed one ends the
        // generation when the scheduler settles it.
        let _ = self.flush();
        Ok(())
    }

    /// Queues `event` as one JSON line.
    fn queue(&mut self, event: &StreamEvent) {
        write_line(&mut self.pending, event);
    }

    /// Holds `event` back as the stream's last line (see [`Run::last`]).
    fn queue_last(&mut self, event: &StreamEvent) {
        write_line(&mut self.last, event);
        self.ending = true;
    }

    /// Writes what the pipe takes. `Ok(true)`: bytes are left (pipe full); `Err`: the reader is
    /// gone.
    pub fn flush(&mut self) -> std::io::Result<bool> {
        pipe::flush(&mut self.out, &mut self.pending)
    }

    /// Whether the generation has ended (its last event is queued) and that event has not been
    /// released to the stream yet: the state owner still has to hear of it.
    pub fn to_report(&self) -> bool {
        self.ending && !self.last.is_empty()
    }

    /// Lets the final event go out with the next flush (the state owner has been told), and
    /// frees the verification rows, which the session's reservation no longer counts.
    pub fn release_last(&mut self) {
        self.pending.append(&mut self.last);
        self.rows = Vec::new();
    }

    /// Whether the final event is queued.
    pub fn ending(&self) -> bool {
        self.ending
    }

    /// Whether everything is written, the final event included.
    pub fn written(&self) -> bool {
        self.ending && self.pending.is_empty() && self.last.is_empty()
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
            speculation_tokens_per_pass: st
                .speculation
                .as_ref()
                .map_or(0.0, SpeculationStats::tokens_per_pass),
            draft_acceptance: st.speculation.as_ref().map_or(0.0, acceptance),
        };
        if let Some(text) = self.sentences.as_mut().and_then(Sentences::finish) {
            self.queue(&StreamEvent::Sentence { text });
        }
        self.queue_last(&StreamEvent::Done {
            reason: reason.name().into(),
            stats,
        });
        self.end = Some(reason.name().into());
    }

    /// Ends the generation with an error event (`name` without the interface prefix), unless
    /// its final event is queued already.
    pub fn end_with_error(&mut self, name: &str, message: &str) {
        if self.ending {
            return;
        }
        self.queue_last(&StreamEvent::Error {
            name: name.into(),
            message: message.into(),
        });
        self.stepper.end(StopReason::Cancelled);
        self.end = Some(name.into());
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

/// Accepted ÷ drafted tokens over every kind of draft; 0 when none was drafted.
fn acceptance(s: &SpeculationStats) -> f64 {
    let drafted: usize = s.drafted.iter().sum();
    let accepted: usize = s.accepted.iter().sum();
    if drafted == 0 {
        0.0
    } else {
        accepted as f64 / drafted as f64
    }
}

/// Appends `event` to `out` as one JSON line.
fn write_line(out: &mut Vec<u8>, event: &StreamEvent) {
    // Serialising these plain types cannot fail; an empty line would be the only trace if it did.
    if let Ok(line) = serde_json::to_vec(event) {
        out.extend_from_slice(&line);
    }
    out.push(b'\n');
}
