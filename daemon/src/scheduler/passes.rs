//! The forward passes of a round: what each generation's step needs (a piece of its prompt or
//! the pass of the token it emitted last, with the drafts of speculative decoding after it),
//! the grouping of those steps into passes that one pass over a model's weights can run, and
//! running them (see the scheduler's module docs, step 3).
//!
//! A decode step with drafts is a verification pass: it asks for the logits of every one of
//! its tokens, and the stepper keeps the drafts its samples agree with. The session then
//! forgets the positions after those ([`Decode::rewind`]), and `seen`, which mirrors its KV
//! cache, keeps only the tokens kept. A step whose drafts the session makes itself as it runs
//! (from its output head's shortlist: [`Decode::forward_shortlist`]) runs alone, and is
//! verified the same way.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use leanstream::contract::Priority;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{FfnExecutor, MAX_BATCH, Session, forward_each_rows};
use leanstream_engine::generate::{Decode, Next};
use leanstream_engine::pipeline::Executor;

use super::room::Room;
use super::run::{Failure, Run};
use super::worker::Worker;
use super::{Entry, LoadedModel, urgency};
use crate::arbiter::SessionId;

/// What sessions must share to run in one pass: the same loaded model (by address: its weights
/// and, in a sparse mode, its pipeline) and the same CPU precision.
type BatchKey = (usize, Precision);

/// One generation's step in a pass: `tokens` of its prompt, or of its decode step (the token
/// emitted last and its drafts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Step {
    pub id: SessionId,
    pub tokens: usize,
}

/// A session whose step is in the pass being run, borrowed apart for [`Worker::run_pass`]: its
/// engine session, and the rest of what the step touches.
struct Due<'a> {
    session: &'a mut Box<dyn Decode + Send>,
    step: Stepped<'a>,
}

/// What a step updates once its pass has run.
struct Stepped<'a> {
    id: SessionId,
    model: &'a LoadedModel,
    seen: &'a mut Vec<u32>,
    run: &'a mut Run,
    /// The tokens this pass runs for it (for a shortlist step, the token emitted last until
    /// the pass ran, then every token it ran).
    piece: Vec<u32>,
    kind: Kind,
    /// The session's position before the pass: where `piece` is written.
    at: usize,
}

/// What a step's piece is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A piece of the prompt.
    Prompt,
    /// The token emitted last, then the drafts after it, if any (a verification pass).
    Forward,
    /// The token emitted last, then the tokens the session drafts from its shortlist as it
    /// runs, this many in all at most: a pass of its own ([`Decode::forward_shortlist`]).
    Shortlist(usize),
}

impl Worker {
    /// The step generation `id` wants next, with the most tokens it may take in one pass: a
    /// decode step is the token emitted last and its drafts (one token without speculation); a
    /// prompt goes in pieces of up to [`MAX_BATCH`] tokens through the batched pass, dense or
    /// sparse, except through a sparse pipeline on the GPU (one token at a time there). `None`
    /// when it has no forward pass to run (ending, or a token waiting to be written).
    pub(super) fn wanted(&self, id: SessionId) -> Option<Step> {
        let s = self.sessions.get(&id)?;
        let tokens = match s.run.as_ref()?.stepper.next() {
            Next::Prefill(_) if s.model.ffn.is_some() && s.model.on_gpu() => 1,
            Next::Prefill(rest) => rest.len().min(MAX_BATCH),
            Next::Forward(tokens) => tokens.len(),
            Next::Draft(_, n) => n,
            Next::Emit(_) | Next::Done(_) => return None,
        };
        Some(Step { id, tokens })
    }

    /// Groups the steps of a round (in turn order) into passes: the CPU sessions of one model
    /// and precision share a pass, dense or through the model's sparse pipeline, at most
    /// [`MAX_BATCH`] tokens a pass; a step that does not fit whole in a pass's room is cut to
    /// it: a prompt piece's rest goes in a later round, a decode step's trailing drafts are
    /// dropped ([`Worker::run_pass`] trims them). GPU sessions run alone, and so does a step
    /// whose session drafts from its shortlist as it runs. Every class gets passes this long: a
    /// more urgent request does not wait for one to end (see [`Worker::run_pass`]).
    pub(super) fn batches(&mut self, steps: Vec<Step>) -> Vec<Vec<Step>> {
        let mut passes: Vec<(Option<BatchKey>, Vec<Step>)> = Vec::new();
        for step in steps {
            let Some(s) = self.sessions.get_mut(&step.id) else {
                continue;
            };
            let drafts_itself = s
                .run
                .as_ref()
                .is_some_and(|r| matches!(r.stepper.next(), Next::Draft(..)));
            let key = s
                .session
                .as_cpu()
                .filter(|_| !drafts_itself)
                .map(|cpu| (Arc::as_ptr(&s.model) as usize, cpu.precision()));
            let room = |steps: &[Step]| MAX_BATCH - steps.iter().map(|s| s.tokens).sum::<usize>();
            match passes
                .iter_mut()
                .find(|(k, steps)| key.is_some() && *k == key && room(steps) > 0)
            {
                Some((_, steps)) => {
                    let tokens = step.tokens.min(room(steps));
                    steps.push(Step { tokens, ..step });
                }
                None => passes.push((key, vec![step])),
            }
        }
        passes.into_iter().map(|(_, steps)| steps).collect()
    }

    /// Runs the steps of `pass` (see [`Worker::batches`]), of generations of `class`, samples
    /// each session's next tokens and writes them out: one forward pass for all, after making
    /// each one's KV room (within what its prompt reserved, or reserved now: a session the
    /// budget refuses ends alone). A CPU pass is given up before a layer when a request of a more
    /// urgent class has been admitted (the scheduler's module docs, step 1); its steps are then
    /// still to run.
    pub(super) fn run_pass(&mut self, pass: &[Step], class: Priority) {
        let waiting = Arc::clone(&self.waiting);
        let stop = move || waiting.load(Ordering::Acquire) > urgency(class);
        let budget = self.budget.as_ref();
        let mut ready: Vec<Due<'_>> = Vec::with_capacity(pass.len());
        for (&id, s) in self.sessions.iter_mut() {
            let Entry {
                model,
                session,
                seen,
                run: Some(r),
                ..
            } = s
            else {
                continue;
            };
            let Some(step) = pass.iter().find(|s| s.id == id) else {
                continue;
            };
            // A decode step cut to the pass's room runs without its trailing drafts.
            if let Next::Forward(tokens) = r.stepper.next()
                && tokens.len() > step.tokens
            {
                r.stepper.trim_pass(step.tokens);
            }
            // A command since the round began may have cancelled it.
            let (piece, kind) = match r.stepper.next() {
                Next::Prefill(rest) => (rest[..step.tokens.min(rest.len())].to_vec(), Kind::Prompt),
                Next::Forward(tokens) => (tokens.to_vec(), Kind::Forward),
                Next::Draft(token, n) => (vec![token], Kind::Shortlist(n)),
                Next::Emit(_) | Next::Done(_) => continue,
            };
            let room = Room {
                id,
                budget,
                beside: r.rows_bytes(),
            };
            let tokens = match kind {
                Kind::Shortlist(n) => n,
                Kind::Prompt | Kind::Forward => piece.len(),
            };
            match room.grow(session.as_mut(), tokens, &mut r.reserved) {
                Ok(()) => ready.push(Due {
                    step: Stepped {
                        id,
                        model,
                        seen,
                        run: r,
                        piece,
                        kind,
                        at: session.position(),
                    },
                    session,
                }),
                Err(f) => r.fail(id, f),
            }
        }
        if ready.is_empty() {
            // Every step was refused its KV room: those generations have ended.
        } else if ready
            .iter_mut()
            .all(|d| d.session.as_cpu().is_some() && !matches!(d.step.kind, Kind::Shortlist(_)))
        {
            run_together(&mut ready, &stop);
        } else {
            for Due { session, step } in &mut ready {
                let result = run_alone(session.as_mut(), step).and_then(|last| step.done(last));
                if let Err(f) = result.and_then(|kept| step.keep(session.as_mut(), kept)) {
                    step.run.fail(step.id, f);
                }
            }
        }
        for step in pass {
            self.settle(step.id);
        }
    }
}

impl Stepped<'_> {
    /// Whether the step asks the pass for the logits of every one of its tokens: a decode step
    /// with drafts (a verification pass). The rows go to the run's buffer ([`Run::rows`]).
    fn rows(&self) -> bool {
        self.kind == Kind::Forward && self.piece.len() > 1
    }

    /// The pass ran: the piece is in the KV cache, and `last` holds its last token's logits
    /// (`None` for a verification pass: its rows are in the run's buffer). Samples and writes
    /// out what is due; returns how many of the piece's tokens the session keeps.
    fn done(&mut self, last: Option<&mut [f32]>) -> Result<usize, Failure> {
        // Whatever the sampling says, the KV cache holds the whole piece now.
        self.seen.extend_from_slice(&self.piece);
        let tok = &self.model.model.tokenizer;
        match (self.kind, last) {
            (Kind::Prompt, Some(logits)) => {
                self.run.prefilled(self.piece.len(), logits, tok)?;
                Ok(self.piece.len())
            }
            (Kind::Shortlist(_), _) => self.run.drafted(&self.piece, tok),
            (_, last) => self.run.forwarded(last, tok),
        }
    }

    /// The session keeps the first `kept` tokens of the piece: it forgets the positions of the
    /// drafts after them, and `seen` the drafts.
    fn keep(&mut self, session: &mut dyn Decode, kept: usize) -> Result<(), Failure> {
        let dropped = self.piece.len() - kept;
        if dropped > 0 {
            session.rewind(self.at + kept)?;
            self.seen.truncate(self.seen.len() - dropped);
        }
        Ok(())
    }
}

/// One pass for every session of `ready` (CPU sessions of one model; one or more), through the
/// model's sparse pipeline when it has one, which then reads each chunk that any of them needs
/// once ([`forward_each_rows`]), given up when `stop` says so before a layer. A verification
/// pass's step gets the logits of every token of its piece, the others those of their last. An
/// error (a chunk that could not be read) ends every generation of the pass.
fn run_together(ready: &mut [Due<'_>], stop: &(dyn Fn() -> bool + Sync)) {
    // The pieces are copied out: the sessions are borrowed mutably beside them.
    let pieces: Vec<Vec<u32>> = ready.iter().map(|d| d.step.piece.clone()).collect();
    let pieces: Vec<&[u32]> = pieces.iter().map(Vec::as_slice).collect();
    let model: &LoadedModel = ready[0].step.model;
    let mut cpu: Vec<&mut Session> = Vec::with_capacity(ready.len());
    let mut rows: Vec<Option<&mut Vec<f32>>> = Vec::with_capacity(ready.len());
    for Due { session, step } in ready.iter_mut() {
        let Some(session) = session.as_cpu() else {
            continue; // run_pass hands over CPU sessions only
        };
        cpu.push(session);
        rows.push(step.rows().then_some(&mut step.run.rows));
    }
    let ran = match &model.ffn {
        Some(ffn) => forward_each_rows(&mut cpu, &pieces, &mut rows, Some(&mut *lock(ffn)), stop),
        None => forward_each_rows(&mut cpu, &pieces, &mut rows, None, stop),
    };
    drop((cpu, rows));
    match ran {
        Ok(true) => {}
        Ok(false) => {
            tracing::debug!(
                "a pass of {} sessions gave way to a more urgent request",
                ready.len()
            );
            return;
        }
        Err(e) => {
            tracing::error!("batched pass failed: {e}");
            for d in ready.iter_mut() {
                d.step.run.end_with_error("Internal", &e.to_string());
            }
            return;
        }
    }
    let shared = ready.len() > 1;
    for Due { session, step } in ready.iter_mut() {
        match step.kind {
            Kind::Prompt if shared => step.run.shared_prompt_passes += 1,
            Kind::Forward if shared => step.run.shared_decode_passes += 1,
            _ => {}
        }
        let cpu = session
            .as_cpu()
            .expect("batches() groups CPU sessions only");
        let last = if step.rows() {
            None
        } else {
            Some(cpu.logits())
        };
        let result = step.done(last);
        if let Err(f) = result.and_then(|kept| step.keep(session.as_mut(), kept)) {
            step.run.fail(step.id, f);
        }
    }
}

/// Runs `step`'s piece (its KV room already reserved) on `session` alone: a session that is not
/// a CPU session (the GPU's), or one that drafts from its shortlist as it runs. Its batched
/// pass, or through the model's sparse FFN pipeline one token at a time when it has one
/// ([`Worker::wanted`] gives such a session one prompt token a pass). Returns the last token's
/// logits; a verification pass writes every token's to the run's rows buffer instead
/// ([`Decode::forward_rows`], [`Decode::forward_shortlist`]), and returns `None`.
fn run_alone<'s>(
    session: &'s mut dyn Decode,
    step: &mut Stepped<'_>,
) -> Result<Option<&'s mut [f32]>, Failure> {
    let (model, piece) = (step.model, step.piece.as_slice());
    if let Kind::Shortlist(n) = step.kind {
        let mut fed = Vec::with_capacity(n);
        session.forward_shortlist(piece[0], n, &mut fed, &mut step.run.rows)?;
        step.piece = fed;
        return Ok(None);
    }
    if step.rows() {
        let rows = &mut step.run.rows;
        match &model.ffn {
            Some(ffn) => {
                let mut exec = lock(ffn);
                session.forward_rows(piece, Some(&mut *exec as &mut dyn FfnExecutor), rows)?;
            }
            None => session.forward_rows(piece, None, rows)?,
        }
        return Ok(None);
    }
    let (Some(ffn), Some((&last, before))) = (&model.ffn, piece.split_last()) else {
        return Ok(Some(session.forward_batch(piece)?));
    };
    let mut exec = lock(ffn);
    for &token in before {
        session.forward_with(token, &mut *exec)?;
    }
    Ok(Some(session.forward_with(last, &mut *exec)?))
}

/// The model's sparse pipeline, for one pass. A panic while the scheduler held the lock would
/// have ended this thread, so a poisoned lock cannot be seen here; take it anyway rather than add
/// a panic path.
fn lock(ffn: &std::sync::Mutex<Executor>) -> std::sync::MutexGuard<'_, Executor> {
    ffn.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
