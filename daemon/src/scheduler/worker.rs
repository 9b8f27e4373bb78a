//! The worker thread: it owns every open session (its engine session and what its KV cache
//! holds), takes what the admission stage hands on in order, and runs rounds of the most urgent
//! class (the scheduler's module docs, steps 1, 2 and 4; the forward passes of a round are in
//! [`super::passes`]). It installs an admitted generation, reusing what the session's KV cache
//! holds or adopting a shared prefix and reserving the KV its prompt will fill, and ends it once
//! its last event is out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use leanstream::contract::{LeanStreamError, Priority};
use leanstream_engine::generate::{Stepper, StopRules};

use super::admit::{Admitted, Work};
use super::room::Room;
use super::run::Run;
use super::{Entry, Outcome, Report, SessionBudget, not_open, prefix, refuse};
use crate::arbiter::SessionId;

/// The worker thread's state.
pub(super) struct Worker {
    rx: Receiver<Work>,
    /// The urgency mark of [`WorkQueue`](super::admit::WorkQueue).
    pub waiting: Arc<AtomicU8>,
    reports: tokio::sync::mpsc::UnboundedSender<Report>,
    pub budget: Box<dyn SessionBudget>,
    pub sessions: BTreeMap<SessionId, Entry>,
}

impl Worker {
    /// A worker with no session open, taking its work from `rx` (the other end of the
    /// admission stage's queue, whose urgency mark `waiting` is).
    pub fn new(
        rx: Receiver<Work>,
        waiting: Arc<AtomicU8>,
        reports: tokio::sync::mpsc::UnboundedSender<Report>,
        budget: Box<dyn SessionBudget>,
    ) -> Worker {
        Worker {
            rx,
            waiting,
            reports,
            budget,
            sessions: BTreeMap::new(),
        }
    }

    /// Takes work and runs rounds until a `Shutdown`, or until the admission stage is gone;
    /// then ends every generation and flushes their streams for at most a second.
    pub fn run(mut self) {
        loop {
            // Take commands: wait for one if there is nothing to compute.
            let first = if self.most_urgent().is_some() {
                match self.rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return self.shutdown(),
                }
            } else if self.sessions.values().any(|s| s.run.is_some()) {
                // Only full pipes are left: look again shortly.
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
            // Every command waiting is taken before the round, so that requests which arrived
            // together start in the same passes.
            if let Some(cmd) = first
                && (self.handle(cmd) || self.take_commands())
            {
                return self.shutdown();
            }
            if self.round() {
                return self.shutdown();
            }
        }
    }

    /// The most urgent class with a generation that can take a step now (not ending, pipe not
    /// full).
    fn most_urgent(&self) -> Option<Priority> {
        self.sessions
            .values()
            .filter_map(|s| s.run.as_ref())
            .filter(|r| r.can_step())
            .map(|r| r.priority)
            .max()
    }

    /// Takes every waiting command; true when one asks to shut down (or the daemon is gone).
    pub fn take_commands(&mut self) -> bool {
        self.waiting.store(0, Ordering::Release);
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

    /// One round of the most urgent class (see the module docs). True when a command asked to
    /// shut down.
    pub fn round(&mut self) -> bool {
        // Pipes that drained since the last round: their pending bytes go out first.
        let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        for &id in &ids {
            self.settle(id);
        }
        let Some(class) = self.most_urgent() else {
            return false;
        };
        let mut turn: Vec<(Option<Instant>, SessionId)> = self
            .sessions
            .iter()
            .filter_map(|(id, s)| s.run.as_ref().map(|r| (id, r)))
            .filter(|(_, r)| r.priority == class && r.can_step())
            .map(|(id, r)| (r.next_deadline(), *id))
            .collect();
        // Earliest deadline first; those without one after, in session order.
        turn.sort_by_key(|&(deadline, id)| (deadline.is_none(), deadline, id));
        let steps = turn.iter().filter_map(|&(_, id)| self.wanted(id)).collect();
        for pass in self.batches(steps) {
            self.run_pass(&pass, class);
            if self.take_commands() {
                return true;
            }
            if self.most_urgent() > Some(class) {
                return false; // pre-empted: the next round serves the newcomer
            }
        }
        false
    }

    /// Handles what the admission stage handed on; returns true on shutdown.
    fn handle(&mut self, work: Work) -> bool {
        match work {
            Work::Open {
                id,
                model,
                session,
                user,
                reported,
            } => {
                let entry = Entry {
                    model,
                    user,
                    session,
                    seen: Vec::new(),
                    run: None,
                    reported,
                };
                self.sessions.insert(id, entry);
            }
            Work::Close { id } => {
                if let Some(mut s) = self.sessions.remove(&id) {
                    if let Some(mut r) = s.run.take() {
                        // Not yet reported, unless it ended and is only writing its last bytes.
                        let unreported = !r.ending() || r.to_report();
                        // The stream ends with an event, not a bare EOF (which means the daemon
                        // broke). One write, as much as the pipe takes: a reader that has let
                        // its pipe fill up gets EOF.
                        r.end_with_error("Cancelled", "the session was closed");
                        r.release_last();
                        let _ = r.flush();
                        if unreported {
                            self.finished(id, 0, r.outcome());
                        }
                    }
                    drop(s);
                    leanstream_engine::alloc::trim();
                    let _ = self.reports.send(Report::Dropped { id });
                }
            }
            Work::Cancel { id } => {
                if let Some(r) = self.sessions.get_mut(&id).and_then(|s| s.run.as_mut()) {
                    r.end_with_error("Cancelled", "the generation was cancelled");
                }
            }
            Work::Generate { admitted, reply } => {
                let id = admitted.id;
                if let Err(e) = self.start(*admitted) {
                    let position = self.position(id);
                    self.note_position(id, position);
                    refuse(&self.reports, id, position, reply, e);
                } else {
                    let _ = reply.send(Ok(()));
                }
            }
            Work::Ping(reply) => {
                let _ = reply.send(());
            }
            Work::Shutdown => return true,
        }
        false
    }

    fn position(&self, id: SessionId) -> u32 {
        self.sessions
            .get(&id)
            .map_or(0, |s| s.session.position() as u32)
    }

    /// Shares `position` with the admission stage, before the state owner hears of it.
    fn note_position(&self, id: SessionId, position: u32) {
        if let Some(s) = self.sessions.get(&id) {
            s.reported.store(position, Ordering::Release);
        }
    }

    fn finished(&self, id: SessionId, position: u32, outcome: Outcome) {
        self.note_position(id, position);
        let _ = self.reports.send(Report::Finished {
            id,
            position,
            outcome: Some(outcome),
        });
    }

    /// Installs an admitted generation: reuses what the session's KV cache holds or adopts a
    /// shared prefix, then reserves the KV the rest of the prompt will fill. Errors (the
    /// reservation refused, above all) are for the caller; nothing has run then.
    fn start(&mut self, admitted: Admitted) -> Result<(), LeanStreamError> {
        let Admitted {
            id,
            ids,
            constraint,
            spec,
            out,
            received,
        } = admitted;
        let s = entry(&mut self.sessions, id)?;
        if s.run.is_some() {
            return Err(LeanStreamError::Busy(
                "a generation is already running on this session".into(),
            ));
        }
        // Reuse the KV cache when the new prompt extends what the session has seen; else start
        // from a prefix other sessions of its user share, if there is one.
        if !(s.seen.len() < ids.len() && ids.starts_with(&s.seen)) {
            s.session.reset();
            s.seen.clear();
        }
        if s.seen.is_empty() {
            prefix::adopt(&mut self.sessions, self.budget.as_ref(), id, &ids);
        }
        let s = entry(&mut self.sessions, id)?;
        let tok = &s.model.model.tokenizer;
        let rules = StopRules {
            max_tokens: spec.max_tokens,
            eos: tok.specials().eos.clone(),
            strings: spec.stop.clone(),
        };
        let (seen, prompt) = ids.split_at(s.seen.len());
        let room = s.session.max_context() - seen.len();
        let vocab = s.model.model.weights.config.vocab_size;
        let mut stepper = Stepper::new(prompt, seen, room, spec.sampler.clone(), vocab, rules)
            .map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))?;
        let start = s.session.position();
        let budget = self.budget.as_ref();
        let reserve = Room {
            id,
            budget,
            beside: 0,
        };
        let mut reserved = reserve.reserve_prompt(s.session.as_ref(), &stepper)?;
        let vocab = s.session.vocab_size();
        let rows;
        (stepper, rows) = reserve.speculate(stepper, &s.model, vocab, spec.priority, &mut reserved);
        s.run = Some(Run::new(
            stepper,
            constraint,
            out,
            &spec,
            received,
            ids.len(),
            start,
            reserved,
            rows,
        ));
        Ok(())
    }

    /// Writes what the pipe takes. A generation that has ended, or whose reader is gone, is
    /// reported to the state owner before its final event is let out (so a caller that reads
    /// that event finds the generation in `Stats()`): its session rewound to where it ends, its
    /// reservation cut back to the session's bytes (a prompt cancelled before it filled what was
    /// reserved for it). The run is dropped once everything is written or the reader is gone.
    pub fn settle(&mut self, id: SessionId) {
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(r) = &mut s.run else {
            return;
        };
        let gone = r.flush().is_err();
        if r.to_report() || (gone && !r.ending()) {
            r.rewind_to_end(s.session.as_mut(), &mut s.seen);
            r.release_last();
            let (reserved, outcome) = (r.reserved, r.outcome());
            let held = s.session.bytes();
            let position = s.session.position() as u32;
            if reserved > held {
                let _ = self.budget.resize(id, held); // a decrease
            }
            self.finished(id, position, outcome);
        }
        if let Some(s) = self.sessions.get_mut(&id)
            && let Some(r) = &mut s.run
            && (gone || r.flush().is_err() || r.written())
        {
            s.run = None;
        }
    }

    fn shutdown(mut self) {
        for s in self.sessions.values_mut() {
            if let Some(r) = &mut s.run {
                r.end_with_error("Cancelled", "the daemon is shutting down");
                r.release_last();
            }
        }
        // Give readers a moment to drain full pipes, then drop everything (EOF).
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            let mut left = false;
            for s in self.sessions.values_mut() {
                if let Some(r) = &mut s.run {
                    match r.flush() {
                        Ok(true) => left = true,
                        _ => s.run = None,
                    }
                }
            }
            if !left {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        tracing::info!("scheduler stopped");
    }
}

/// Open session `id` of `sessions`, or the error a command for a session that is not open gets.
fn entry(
    sessions: &mut BTreeMap<SessionId, Entry>,
    id: SessionId,
) -> Result<&mut Entry, LeanStreamError> {
    sessions.get_mut(&id).ok_or_else(|| not_open(id))
}
