//! The forward passes of a round: what each generation's step needs (a piece of its prompt or
//! the pass of the token it emitted last), the grouping of those steps into passes that one pass
//! over a model's weights can run, and running them (see the scheduler's module docs, step 3).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use leanstream::contract::Priority;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{MAX_BATCH, Session, forward_each_unless};
use leanstream_engine::generate::{Decode, Next};
use leanstream_engine::pipeline::Executor;

use super::run::{Failure, Room, Run};
use super::{Entry, LoadedModel, Worker, urgency};
use crate::memory::SessionId;

/// What sessions must share to run in one pass: the same loaded model (by address: its weights
/// and, in a sparse mode, its pipeline) and the same CPU precision.
type BatchKey = (usize, Precision);

/// One generation's step in a pass: `tokens` of its prompt, or 1 for a decode step.
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
    /// The tokens this pass runs for it.
    piece: Vec<u32>,
    /// Whether `piece` is part of the prompt (else it is the token emitted last).
    prompt: bool,
}

impl Worker {
    /// The step generation `id` wants next, with the most tokens it may take in one pass: a
    /// decode step is one token; a prompt goes in pieces of up to [`MAX_BATCH`] tokens through
    /// the batched pass, dense or sparse, except through a sparse pipeline on the GPU (one token
    /// at a time there). `None` when it has no forward pass to run (ending, or a token waiting to
    /// be written).
    pub(super) fn wanted(&self, id: SessionId) -> Option<Step> {
        let s = self.sessions.get(&id)?;
        let tokens = match s.run.as_ref()?.stepper.next() {
            Next::Prefill(_) if s.model.ffn.is_some() && s.model.on_gpu() => 1,
            Next::Prefill(rest) => rest.len().min(MAX_BATCH),
            Next::Forward(_) => 1,
            Next::Emit(_) | Next::Done(_) => return None,
        };
        Some(Step { id, tokens })
    }

    /// Groups the steps of a round (in turn order) into passes: the CPU sessions of one model
    /// and precision share a pass, dense or through the model's sparse pipeline, at most
    /// [`MAX_BATCH`] tokens a pass; a prompt piece that does not fit whole in a pass's room is
    /// cut to it (the rest goes in a later round). GPU sessions run alone. Every class gets
    /// passes this long: a more urgent request does not wait for one to end (see
    /// [`Worker::run_pass`]).
    pub(super) fn batches(&mut self, steps: Vec<Step>) -> Vec<Vec<Step>> {
        let mut passes: Vec<(Option<BatchKey>, Vec<Step>)> = Vec::new();
        for step in steps {
            let Some(s) = self.sessions.get_mut(&step.id) else {
                continue;
            };
            let key = s
                .session
                .as_cpu()
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
    /// each session's next token and writes it out: one forward pass for all, after making each
    /// one's KV room (within what its prompt reserved, or reserved now: a session the budget
    /// refuses ends alone). A CPU pass is given up before a layer when a request of a more
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
            // A command since the round began may have cancelled it.
            let (piece, prompt) = match r.stepper.next() {
                Next::Prefill(rest) => (rest[..step.tokens.min(rest.len())].to_vec(), true),
                Next::Forward(token) => (vec![token], false),
                Next::Emit(_) | Next::Done(_) => continue,
            };
            let room = Room { id, budget };
            match room.grow(session.as_mut(), piece.len(), &mut r.reserved) {
                Ok(()) => ready.push(Due {
                    session,
                    step: Stepped {
                        id,
                        model,
                        seen,
                        run: r,
                        piece,
                        prompt,
                    },
                }),
                Err(f) => r.fail(id, f),
            }
        }
        if ready.is_empty() {
            // Every step was refused its KV room: those generations have ended.
        } else if ready.iter_mut().all(|d| d.session.as_cpu().is_some()) {
            run_together(&mut ready, &stop);
        } else {
            for Due { session, step } in &mut ready {
                let result = run_alone(step.model, session.as_mut(), &step.piece);
                if let Err(f) = result.and_then(|logits| step.done(logits)) {
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
    /// The pass ran: the piece is in the KV cache, and `logits` are its last token's.
    fn done(&mut self, logits: &mut [f32]) -> Result<(), Failure> {
        self.seen.extend_from_slice(&self.piece);
        let tok = &self.model.model.tokenizer;
        if self.prompt {
            self.run.prefilled(self.piece.len(), logits, tok)
        } else {
            self.run.forwarded(logits, tok)
        }
    }
}

/// One pass for every session of `ready` (CPU sessions of one model; one or more), through the
/// model's sparse pipeline when it has one, which then reads each chunk that any of them needs
/// once ([`forward_each_unless`]), given up when `stop` says so before a layer. An error (a
/// chunk that could not be read) ends every generation of the pass.
fn run_together(ready: &mut [Due<'_>], stop: &(dyn Fn() -> bool + Sync)) {
    // The pieces are copied out: the sessions are borrowed mutably beside them.
    let pieces: Vec<Vec<u32>> = ready.iter().map(|d| d.step.piece.clone()).collect();
    let pieces: Vec<&[u32]> = pieces.iter().map(Vec::as_slice).collect();
    let model: &LoadedModel = ready[0].step.model;
    let mut cpu: Vec<&mut Session> = ready
        .iter_mut()
        .filter_map(|d| d.session.as_cpu())
        .collect();
    let ran = match &model.ffn {
        Some(ffn) => forward_each_unless(&mut cpu, &pieces, Some(&mut *lock(ffn)), stop),
        None => forward_each_unless(&mut cpu, &pieces, None, stop),
    };
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
        match step.prompt {
            true if shared => step.run.shared_prompt_passes += 1,
            false if shared => step.run.shared_decode_passes += 1,
            _ => {}
        }
        let cpu = session
            .as_cpu()
            .expect("batches() groups CPU sessions only");
        if let Err(f) = step.done(cpu.logits()) {
            step.run.fail(step.id, f);
        }
    }
}

/// Runs `piece` (its KV room already reserved) on a session that is not a CPU session (the
/// GPU's): its batched pass, or through
/// the model's sparse FFN pipeline one token at a time when it has one ([`Worker::wanted`] gives
/// such a session one token a pass). Returns the last token's logits.
fn run_alone<'s>(
    model: &LoadedModel,
    session: &'s mut dyn Decode,
    piece: &[u32],
) -> Result<&'s mut [f32], Failure> {
    let (Some(ffn), Some((&last, before))) = (&model.ffn, piece.split_last()) else {
        return Ok(session.forward_batch(piece)?);
    };
    let mut exec = lock(ffn);
    for &token in before {
        session.forward_with(token, &mut *exec)?;
    }
    Ok(session.forward_with(last, &mut *exec)?)
}

/// The model's sparse pipeline, for one pass. A panic while the scheduler held the lock would
/// have ended this thread, so a poisoned lock cannot be seen here; take it anyway rather than add
/// a panic path.
fn lock(ffn: &std::sync::Mutex<Executor>) -> std::sync::MutexGuard<'_, Executor> {
    ffn.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
