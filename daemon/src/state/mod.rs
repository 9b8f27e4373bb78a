//! The one task that owns the daemon's state: models, sessions, clients, the memory ledger. It
//! is split by concern:
//!
//! - [`models`]: loading, reserving and dropping models, and their neuron caches' grants;
//! - [`lifetime`]: how long an unused model stays (`keep_alive`, holds, the idle deadline);
//! - [`sessions`]: clients and their sessions, admission and the per-client limits;
//! - [`report`]: the `Memory()` report, redacted for the caller;
//! - [`internal`]: what the daemon's own threads (loaders, the scheduler) ask of it;
//! - [`port`]: what it needs from D-Bus, so that its unit tests run without a bus.
//!
//! The D-Bus objects send it [`Request`]s (`crate::request`) over a bounded channel and await
//! a oneshot reply; the daemon's own threads send it [`Internal`] messages on a channel of
//! their own, served first; the scheduler reports finished generations; the bus watcher reports
//! vanished clients.
//!
//! One table per fact, each keyed by the same [`SessionId`]: this owner's session table holds
//! who owns a session and what it has done; the ledger ([`Arbiter`]) holds only bytes; the
//! scheduler holds only the running work.
//!
//! Clients are counted by user: a client's uid comes from the bus the first time it asks for
//! something that holds memory, and the per-client limits, the holds on models ([`holds`]) and
//! shared prompt prefixes are per uid, so that one user's many connections are one client.

mod holds;
mod internal;
mod lifetime;
mod models;
mod port;
mod report;
mod sessions;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use leanstream::contract::LeanStreamError;
use tokio::sync::{mpsc, oneshot, watch};

use crate::arbiter::{Arbiter, ArbiterError, SessionId};
use crate::config::Params;
use crate::counters::Counters;
use crate::request::Request;
use crate::scheduler::{Command, Report};
pub use internal::{Budget, Internal};
use models::ModelEntry;
pub use port::{BusPort, Caller, Port};
use sessions::SessionEntry;

/// The channels the state owner serves, most urgent first.
pub struct Inbox {
    /// What the scheduler reports: generations that ended, sessions it dropped.
    pub events: mpsc::UnboundedReceiver<Report>,
    /// The unique bus names that left the bus.
    pub departures: mpsc::UnboundedReceiver<String>,
    /// What the daemon's own threads ask.
    pub internal: mpsc::UnboundedReceiver<Internal>,
    /// What clients ask, through the D-Bus objects.
    pub requests: mpsc::Receiver<Request>,
}

/// The state owner.
pub struct State<P> {
    params: Arc<Params>,
    ledger: Arbiter,
    port: P,
    internal: mpsc::UnboundedSender<Internal>,
    engine: crate::scheduler::Commands,
    /// The names of the models loaded and ready, for `ListModels` (answered outside this task).
    loaded_names: watch::Sender<BTreeSet<String>>,
    models: BTreeMap<String, ModelEntry>,
    sessions: BTreeMap<SessionId, SessionEntry>,
    /// Clients known to be on the bus (see [`State::admit_client`]).
    clients: BTreeMap<String, Caller>,
    next_id: SessionId,
    /// The operators' counters: generations and model loads are counted here.
    counters: Counters,
}

impl<P> std::fmt::Debug for State<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("models", &self.models.len())
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

impl<P: Port> State<P> {
    pub fn new(
        params: Arc<Params>,
        port: P,
        internal: mpsc::UnboundedSender<Internal>,
        engine: crate::scheduler::Commands,
        loaded_names: watch::Sender<BTreeSet<String>>,
        counters: Counters,
    ) -> State<P> {
        State {
            ledger: Arbiter::new(params.budget_bytes),
            params,
            port,
            internal,
            engine,
            loaded_names,
            models: BTreeMap::new(),
            sessions: BTreeMap::new(),
            clients: BTreeMap::new(),
            next_id: 1,
            counters,
        }
    }

    /// Serves `inbox` until `Shutdown` (or every request sender is gone).
    pub async fn run(mut self, mut inbox: Inbox) {
        self.preload().await;
        loop {
            // Engine events first: the engine reports a generation's end before the caller can
            // see it (EOF or an error reply), so a caller's next request never finds the session
            // still running. Then departures and the daemon's own threads, which wait on their
            // answers, then the keep-alive deadline, then clients.
            let next_unload = self.next_unload();
            tokio::select! {
                biased;
                Some(ev) = inbox.events.recv() => self.engine_event(ev),
                Some(client) = inbox.departures.recv() => self.client_gone(&client).await,
                Some(msg) = inbox.internal.recv() => self.internal(msg).await,
                () = lifetime::sleep_until(next_unload) => self.unload_idle(),
                req = inbox.requests.recv() => match req {
                    Some(Request::Shutdown { reply }) => {
                        self.shutdown().await;
                        let _ = reply.send(());
                        return;
                    }
                    Some(req) => self.handle(req).await,
                    None => {
                        self.shutdown().await;
                        return;
                    }
                },
            }
        }
    }

    async fn shutdown(&mut self) {
        let _ = self.engine.send(Command::Shutdown);
        for id in std::mem::take(&mut self.sessions).into_keys() {
            let _ = self.ledger.close_session(id);
            self.port.withdraw_session(id).await;
        }
    }

    fn engine_event(&mut self, ev: Report) {
        match ev {
            Report::Finished {
                id,
                position,
                outcome,
            } => {
                if let Some(o) = &outcome {
                    self.counters.generation(o);
                }
                self.finished(id, position, outcome.as_ref());
            }
            // A closed session's memory is free now: caches may grow into it.
            Report::Dropped { id } => {
                tracing::debug!("session {id} dropped by the scheduler");
                self.apply_cache_grants();
            }
        }
    }

    async fn handle(&mut self, req: Request) {
        match req {
            Request::LoadModel {
                file,
                client,
                keep_alive,
                reply,
            } => self.load_for(file, client, keep_alive, reply).await,
            Request::UnloadModel {
                name,
                client,
                reply,
            } => {
                let r = match self.admit_client(&client).await {
                    Ok(caller) => self.unload(&name, caller),
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
            Request::OpenSession {
                file,
                context,
                client,
                reply,
            } => self.open_for(file, context, client, reply).await,
            Request::Memory { client, reply } => {
                let r = self.report_for(&client).await;
                let _ = reply.send(r);
            }
            Request::Generate {
                id,
                client,
                input,
                spec,
                reply,
            } => self.generate(id, &client, input, spec, reply).await,
            Request::Cancel { id, client, reply } => {
                let r = self.owned(id, &client).map(|_| {
                    let _ = self.engine.send(Command::Cancel { id });
                });
                let _ = reply.send(r);
            }
            Request::Close { id, client, reply } => {
                let r = match self.owned(id, &client) {
                    Ok(_) => {
                        self.close(id).await;
                        Ok(())
                    }
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
            Request::Stats { id, client, reply } => {
                let _ = reply.send(self.stats(id, &client));
            }
            Request::Model { id, client, reply } => {
                let _ = reply.send(self.session_model(id, &client));
            }
            Request::Ping { reply } => {
                let (alive, answer) = oneshot::channel();
                let _ = self.engine.send(Command::Ping(alive));
                tokio::spawn(async move {
                    let stopped = || LeanStreamError::Internal("the scheduler has stopped".into());
                    let _ = reply.send(answer.await.map_err(|_| stopped()));
                });
            }
            Request::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    /// Serves a message of the daemon's own threads.
    async fn internal(&mut self, msg: Internal) {
        let over_budget = |e: ArbiterError| LeanStreamError::OverBudget(e.to_string());
        match msg {
            Internal::Reserve {
                name,
                footprint,
                reply,
            } => {
                let _ = reply.send(self.reserve(&name, footprint));
            }
            Internal::ResizeSession { id, bytes, reply } => {
                // The scheduler may ask for a session this owner has just closed (its client
                // vanished); the Close command is on its way to it, so the answer is a refusal.
                let r = if !self.sessions.contains_key(&id) {
                    Err(LeanStreamError::Internal(format!("session {id} is closed")))
                } else {
                    self.ledger.resize_session(id, bytes).map_err(over_budget)
                };
                self.settled(reply, r);
            }
            Internal::GrowModel { name, bytes, reply } => {
                let r = self.ledger.grow_resident(&name, bytes).map_err(over_budget);
                self.settled(reply, r);
            }
            Internal::ShrinkModel { name, bytes } => {
                // A model dropped meanwhile has nothing left to shrink.
                let _ = self.ledger.shrink_resident(&name, bytes);
                self.apply_cache_grants();
            }
            Internal::Dropped { ticket } => {
                self.ledger.dropped(ticket);
                self.apply_cache_grants();
            }
            Internal::Loaded { name, result } => self.loaded(&name, result).await,
        }
    }

    /// Answers a change to the ledger once the caches hold what it grants now.
    fn settled<T>(
        &self,
        reply: oneshot::Sender<Result<T, LeanStreamError>>,
        r: Result<T, LeanStreamError>,
    ) {
        if r.is_ok() {
            self.apply_cache_grants();
        }
        let _ = reply.send(r);
    }
}
