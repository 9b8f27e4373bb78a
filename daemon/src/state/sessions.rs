//! Clients and their sessions: who a client is, admission against the daemon's and each
//! user's limits, opening and closing sessions, and what happens when a client leaves the bus.
//! Whether a session is generating is the scheduler's to say (it answers `Busy`); this table
//! holds who owns each session and what it has done.

use std::sync::Arc;

use leanstream::contract::{LeanStreamError, Priority, SessionStats};
use leanstream_engine::forward::session_open_bytes;
use tokio::sync::oneshot;
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

use super::models::{ModelEntry, Slot, Waiter};
use super::{Caller, Port, State};
use crate::arbiter::{ArbiterError, SessionId};
use crate::models::ModelFile;
use crate::request::Reply;
use crate::scheduler::{Command, DecodePasses, GenSpec, Input, LoadedModel, Outcome};

/// An open session.
#[derive(Debug)]
pub(super) struct SessionEntry {
    pub model: String,
    /// The unique bus name of the client that opened it.
    pub client: String,
    /// The client's uid.
    pub user: u32,
    pub context: u32,
    /// Tokens in its KV cache after its last generation.
    pub position: u32,
    pub generations: u32,
    pub generated_tokens: u64,
    /// The decode passes of its generations, and the draft tokens they verified and accepted.
    pub passes: DecodePasses,
}

impl<P: Port> State<P> {
    /// Checks that `client` is still on the bus the first time it asks for something that
    /// holds memory, and records who it is. This closes the race between a request and its
    /// client's departure: the bus announces a departure after the name is gone, so either the
    /// departure is handled after this request (and releases what it got), or it came first
    /// (forgetting the client) and the port now answers that the name has no owner (and the
    /// request is refused). A known client needs no new check: its departure is still to come.
    pub(super) async fn admit_client(&mut self, client: &str) -> Result<Caller, LeanStreamError> {
        if let Some(known) = self.clients.get(client) {
            return Ok(*known);
        }
        let caller = self.port.caller(client).await?;
        self.clients.insert(client.to_string(), caller);
        Ok(caller)
    }

    /// Sessions open or waiting for their model: every user's, or `user`'s only.
    fn sessions_of(&self, user: Option<u32>) -> usize {
        let mine = |u: u32| user.is_none_or(|want| want == u);
        let open = self.sessions.values().filter(|s| mine(s.user)).count();
        let waiting: usize = (self.models.values())
            .map(|m| match &m.slot {
                Slot::Loading(w) => (w.iter())
                    .filter(|w| matches!(w, Waiter::Open { user: u, .. } if mine(*u)))
                    .count(),
                Slot::Ready(_) => 0,
            })
            .sum();
        open + waiting
    }

    /// Room for one more session: the daemon's limit and the user's (all its connections
    /// together), counting the sessions that wait for their model. The one check of both
    /// limits. Returns the client's uid.
    async fn admit_session(&mut self, client: &str) -> Result<u32, LeanStreamError> {
        let user = self.admit_client(client).await?.user;
        if self.sessions_of(None) >= self.params.max_sessions {
            return Err(LeanStreamError::Busy(format!(
                "the daemon already has its maximum of {} sessions",
                self.params.max_sessions
            )));
        }
        let limit = self.params.max_sessions_per_client;
        if self.sessions_of(Some(user)) >= limit {
            return Err(LeanStreamError::Busy(format!(
                "this user already has its maximum of {limit} sessions, over all its \
                 connections (`limits.max_sessions_per_client`)"
            )));
        }
        Ok(user)
    }

    /// Room for `client`'s user to hold `model` (holding a model it already holds is free).
    /// Returns the client's uid.
    pub(super) async fn admit_pin(
        &mut self,
        client: &str,
        model: &str,
    ) -> Result<u32, LeanStreamError> {
        let limit = self.params.max_pins_per_client;
        let user = self.admit_client(client).await?.user;
        let held = |m: &ModelEntry| m.holds.by(user);
        let holds_it = self.models.get(model).is_some_and(held);
        if !holds_it && self.models.values().filter(|m| held(m)).count() >= limit {
            return Err(LeanStreamError::Busy(format!(
                "this user already keeps its maximum of {limit} models loaded \
                 (`limits.max_pins_per_client`): unload one first"
            )));
        }
        Ok(user)
    }

    /// `OpenSession`: admits it, then opens it once its model is loaded.
    pub(super) async fn open_for(
        &mut self,
        file: ModelFile,
        context: u32,
        client: String,
        reply: Reply<OwnedObjectPath>,
    ) {
        let user = match self.admit_session(&client).await {
            Ok(user) => user,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let waiter = Waiter::Open {
            context,
            client,
            user,
            reply,
        };
        self.load(file, waiter).await;
    }

    /// Opens an admitted session on a loaded model: checks its context (the one check of
    /// `max_context`), reserves its bytes and hands the engine's session to the scheduler.
    pub(super) fn open(
        &mut self,
        model: &Arc<LoadedModel>,
        context: u32,
        client: String,
        user: u32,
    ) -> Result<SessionId, LeanStreamError> {
        let model_ctx = model.model.weights.config.context_length;
        let limit = self.params.max_context.min(model_ctx);
        let context = match context as usize {
            0 => limit,
            c if c <= limit => c,
            c => {
                return Err(LeanStreamError::InvalidArgument(format!(
                    "context of {c} tokens is over the limit of {limit}"
                )));
            }
        };
        let id = self.next_id;
        let p = self.params.model(&model.name);
        // What the engine will allocate for a new session (its scratch; KV blocks come later,
        // each reserved by the scheduler before it is allocated).
        let bytes = session_open_bytes(&model.model, context, p.kv_type);
        let over_budget = |e: ArbiterError| LeanStreamError::OverBudget(e.to_string());
        (self
            .ledger
            .open_session(id, &model.name, bytes, p.cache_class))
        .map_err(over_budget)?;
        // Caches may have shrunk to make room: free that before the session allocates.
        self.apply_cache_grants();
        let session = match model.open_session(context, self.params.precision, p.kv_type) {
            Ok(s) => s,
            Err(e) => {
                let _ = self.ledger.close_session(id);
                return Err(LeanStreamError::Internal(e.to_string()));
            }
        };
        // The session says what it holds; on the GPU that includes device buffers the CPU
        // estimate does not know.
        let held = session.bytes();
        if held != bytes
            && let Err(e) = self.ledger.resize_session(id, held)
        {
            let _ = self.ledger.close_session(id);
            return Err(over_budget(e));
        }
        self.next_id += 1;
        let _ = self.engine.send(Command::Open {
            id,
            model: Arc::clone(model),
            session,
            user,
        });
        // Debug, not info: a client looping over open and close would otherwise write the
        // journal full.
        tracing::debug!(
            "session {id} on {} for {client}: up to {context} tokens, {held} bytes at open",
            model.name
        );
        let entry = SessionEntry {
            model: model.name.clone(),
            client,
            user,
            context: context as u32,
            position: 0,
            generations: 0,
            generated_tokens: 0,
            passes: DecodePasses::default(),
        };
        self.sessions.insert(id, entry);
        Ok(id)
    }

    /// Session `id` if `client` owns it.
    pub(super) fn owned(
        &self,
        id: SessionId,
        client: &str,
    ) -> Result<&SessionEntry, LeanStreamError> {
        match self.sessions.get(&id) {
            Some(s) if s.client == client => Ok(s),
            Some(_) => Err(LeanStreamError::AccessDenied(
                "the session belongs to another client".into(),
            )),
            None => Err(LeanStreamError::InvalidArgument(format!(
                "session {id} is not open"
            ))),
        }
    }

    pub(super) fn stats(
        &self,
        id: SessionId,
        client: &str,
    ) -> Result<SessionStats, LeanStreamError> {
        self.owned(id, client).map(|s| SessionStats {
            model: s.model.clone(),
            context_tokens: s.context,
            position: s.position,
            generations: s.generations,
            generated_tokens: s.generated_tokens,
            decode_passes: s.passes.passes,
            draft_tokens: s.passes.drafted,
            accepted_draft_tokens: s.passes.accepted,
        })
    }

    /// The model session `id` runs on, if `client` owns the session.
    pub(super) fn session_model(
        &self,
        id: SessionId,
        client: &str,
    ) -> Result<Arc<LoadedModel>, LeanStreamError> {
        let s = self.owned(id, client)?;
        (self.models.get(&s.model).and_then(|m| m.ready()).cloned())
            .ok_or_else(|| LeanStreamError::Internal(format!("model {} is not loaded", s.model)))
    }

    /// The scheduler reports a generation's end.
    pub(super) fn finished(&mut self, id: SessionId, position: u32, outcome: Option<&Outcome>) {
        if let Some(s) = self.sessions.get_mut(&id) {
            s.position = position;
            if let Some(o) = outcome {
                s.generations += 1;
                s.generated_tokens += o.generated;
                s.passes.passes += o.passes.passes;
                s.passes.drafted += o.passes.drafted;
                s.passes.accepted += o.passes.accepted;
            }
        }
    }

    /// `Generate`: hands the request to the scheduler (which answers `Busy` while the session
    /// runs another) and replies with the read end of its stream once the scheduler admits it.
    pub(super) async fn generate(
        &mut self,
        id: SessionId,
        client: &str,
        input: Input,
        spec: GenSpec,
        reply: Reply<OwnedFd>,
    ) {
        if let Err(e) = self.may_generate(id, client, &spec).await {
            let _ = reply.send(Err(e));
            return;
        }
        let (read, write) = match std::io::pipe() {
            Ok(p) => p,
            Err(e) => {
                let _ = reply.send(Err(LeanStreamError::Internal(format!("pipe: {e}"))));
                return;
            }
        };
        let (engine_reply, engine_rx) = oneshot::channel();
        let sent = self.engine.send(Command::Generate {
            id,
            input,
            spec,
            out: write,
            reply: engine_reply,
        });
        if sent.is_err() {
            let _ = reply.send(Err(LeanStreamError::Internal(
                "the engine has stopped".into(),
            )));
            return;
        }
        tokio::spawn(async move {
            let r = match engine_rx.await {
                Ok(Ok(())) => Ok(OwnedFd::from(std::os::fd::OwnedFd::from(read))),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(LeanStreamError::Internal("the engine has stopped".into())),
            };
            let _ = reply.send(r);
        });
    }

    /// Whether `client` may run `spec` on session `id`: it owns the session, and only a
    /// privileged caller asks for the realtime class, which can starve everyone else.
    async fn may_generate(
        &mut self,
        id: SessionId,
        client: &str,
        spec: &GenSpec,
    ) -> Result<(), LeanStreamError> {
        self.owned(id, client)?;
        if spec.priority == Priority::Realtime && !self.admit_client(client).await?.admin {
            return Err(LeanStreamError::AccessDenied(
                "the realtime priority is for root, the daemon's user and the admin group".into(),
            ));
        }
        Ok(())
    }

    pub(super) async fn close(&mut self, id: SessionId) {
        let Some(s) = self.sessions.remove(&id) else {
            return;
        };
        let _ = self.engine.send(Command::Close { id });
        let _ = self.ledger.close_session(id);
        self.port.withdraw_session(id).await;
        tracing::debug!("session {id} closed");
        self.unload_if_unused(&s.model);
    }

    /// `client` left the bus: its waiting requests are forgotten and its sessions closed.
    pub(super) async fn client_gone(&mut self, client: &str) {
        self.clients.remove(client);
        self.forget_waiters(client);
        let ids: Vec<SessionId> = (self.sessions.iter())
            .filter(|(_, s)| s.client == client)
            .map(|(id, _)| *id)
            .collect();
        if !ids.is_empty() {
            tracing::info!("client {client} is gone: closing sessions {ids:?}");
        }
        for id in ids {
            self.close(id).await;
        }
    }
}
