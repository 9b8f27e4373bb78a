//! The decode passes of a round: grouping the due sessions into passes that one pass over the
//! weights can run, and running them (see the scheduler's module docs, step 3).

use std::sync::Arc;

use leanstream::contract::Priority;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{MAX_BATCH, Session, forward_each};
use leanstream_engine::generate::{Decode, Next};

use super::run::{Failure, Room, Run};
use super::{Entry, LoadedModel, Worker};
use crate::memory::SessionId;

/// What sessions must share to run in one decode pass: the same loaded model (by address) and the
/// same CPU precision.
type BatchKey = (usize, Precision);

/// A session whose decode pass is due, borrowed apart for [`Worker::decode`].
struct Due<'a> {
    id: SessionId,
    model: &'a LoadedModel,
    session: &'a mut Box<dyn Decode + Send>,
    seen: &'a mut Vec<u32>,
    run: &'a mut Run,
    token: u32,
}

impl Worker {
    /// Groups the sessions whose decode pass is due into batches that one pass can run: CPU
    /// sessions of the same dense model and precision, at most [`batch_limit`]`(class)` a pass.
    /// Others (a sparse pipeline, the GPU) run alone.
    pub(super) fn batches(&mut self, due: Vec<SessionId>, class: Priority) -> Vec<Vec<SessionId>> {
        let limit = batch_limit(class);
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
                .find(|(k, ids)| key.is_some() && *k == key && ids.len() < limit)
            {
                Some((_, ids)) => ids.push(id),
                None => groups.push((key, vec![id])),
            }
        }
        groups.into_iter().map(|(_, ids)| ids).collect()
    }

    /// Runs the due forward passes of `batch` (see [`Worker::batches`]), samples each session's
    /// next token and writes it out: one pass for all when there are several, after reserving
    /// each one's KV room (a session the budget refuses ends alone).
    pub(super) fn decode(&mut self, batch: &[SessionId]) {
        let budget = self.budget.as_ref();
        let mut ready: Vec<Due<'_>> = Vec::with_capacity(batch.len());
        for (&id, s) in self.sessions.iter_mut() {
            let Entry {
                model,
                session,
                seen,
                run: Some(r),
            } = s
            else {
                continue;
            };
            // A command since the step may have cancelled it.
            let Next::Forward(token) = r.stepper.next() else {
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
                    run: r,
                    token,
                }),
                Err(f) => r.fail(id, f),
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
                        d.run.shared_passes += 1;
                        let cpu = d
                            .session
                            .as_cpu()
                            .expect("batches() groups CPU sessions only");
                        d.seen.push(d.token);
                        let tok = &d.model.model.tokenizer;
                        if let Err(f) = d.run.forwarded(cpu.logits(), tok) {
                            d.run.fail(d.id, f);
                        }
                    }
                }
                Err(e) => {
                    tracing::error!("batched decode pass failed: {e}");
                    for d in &mut ready {
                        d.run.end_with_error("Internal", &e.to_string());
                    }
                }
            }
        } else {
            for d in &mut ready {
                let room = Room { id: d.id, budget };
                let tok = &d.model.model.tokenizer;
                let result = forward(d.model, d.session.as_mut(), d.token, &room).and_then(|l| {
                    d.seen.push(d.token);
                    d.run.forwarded(l, tok)
                });
                if let Err(f) = result {
                    d.run.fail(d.id, f);
                }
            }
        }
        for &id in batch {
            self.settle(id);
        }
    }
}

/// Most sessions one decode pass of `class` advances. Background passes stay short, so that a more
/// urgent request waits for little when it arrives during one (a pass cannot be interrupted):
/// on SmolLM2 with 2 cores a pass for 4 conversations already gains what a pass for 8 does
/// (`engine/examples/batch_decode.rs`: 1.33× against 1.35×) in half the time.
fn batch_limit(class: Priority) -> usize {
    match class {
        Priority::Background => BACKGROUND_BATCH,
        Priority::Interactive | Priority::Realtime => MAX_BATCH,
    }
}

/// See [`batch_limit`].
const BACKGROUND_BATCH: usize = 4;
/// One forward pass of `session`, through the model's sparse FFN pipeline when it has one,
/// after making room for the token in its KV cache.
pub(super) fn forward<'s>(
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
