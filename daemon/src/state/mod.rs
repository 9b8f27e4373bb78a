//! The one task that owns the daemon's state: models, sessions, owners, memory accounting. The
//! D-Bus objects send it [`Request`]s (`crate::request`) over a bounded channel and await a
//! oneshot reply; the
//! daemon's own threads (loaders, the scheduler) send it [`Internal`] messages on a channel of
//! their own, served first; the scheduler thread reports finished generations; the bus watcher
//! reports vanished clients.
//!
//! Clients are counted by user: a client's uid comes from the bus (`GetConnectionUnixUser`) the
//! first time it asks for something that holds memory, and the per-client limits, the holds on
//! models ([`holds`]) and shared prompt prefixes are per uid, so that one user's many
//! connections are one client.
//!
//! Model loads run on their own OS threads; requests that need a model being loaded wait in its
//! slot and are answered when it is ready. A loader thread first works out the model's
//! [`Footprint`] from the file's header and asks the state owner to reserve it
//! ([`Internal::Reserve`]); it maps weights and allocates the neuron cache only once that is
//! done, so a load that does not fit is refused before it uses the memory.
//!
//! An unused model's `keep_alive` is one deadline per model, re-armed whenever it becomes
//! unused: the owner's loop sleeps until the earliest one (no timer task per request).

mod holds;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use leanstream::contract::{
    ClientMemory, LeanStreamError, MemoryReport, ModelMemory, ModelParts, SESSION_PATH_PREFIX,
    SessionMemory, SessionStats,
};
use leanstream_engine::forward::session_open_bytes;
use tokio::sync::{mpsc, oneshot, watch};
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

use crate::config::{KeepAlive, Params};
use crate::loader::{Footprint, LoadError};
use crate::memory::{Memory, SessionId};
use crate::models::{self, ModelFile};
use crate::request::{Reply, Request};
use crate::scheduler::{Command, DecodePasses, GenSpec, Input, LoadedModel, Report};
use crate::typed::Typed;
use holds::{Holds, Unload};

/// Messages from the daemon's own threads (loaders, the scheduler, model drops) to the state
/// owner. They travel on their own unbounded channel, served before client requests, so that a
/// flood of D-Bus calls never delays a KV reservation the scheduler waits on. Each sender waits
/// for its reply or sends once per event, so the channel holds a handful at most.
#[derive(Debug)]
pub enum Internal {
    /// A loader thread asks to reserve its model's memory before it loads.
    Reserve {
        name: String,
        footprint: Footprint,
        reply: oneshot::Sender<Result<(), LoadError>>,
    },
    /// From the scheduler: session `id` needs its reservation set to `bytes`
    /// before it allocates more KV blocks. Neuron caches have shrunk by the time the reply is
    /// `Ok`.
    ResizeSession {
        id: SessionId,
        bytes: u64,
        reply: oneshot::Sender<Result<(), LeanStreamError>>,
    },
    /// From the scheduler: model `name` keeps `bytes` more for its lifetime (the
    /// grammar parser's token trie, built on its first constrained generation).
    GrowModel {
        name: String,
        bytes: u64,
        reply: oneshot::Sender<Result<(), LeanStreamError>>,
    },
    /// From the scheduler: model `name` dropped `bytes` it had kept (an evicted prompt prefix).
    ShrinkModel { name: String, bytes: u64 },
    /// A released model's memory has been handed back: its placeholder reservation
    /// (`held`, see [`State::release`]) ends and caches may grow into it.
    Released { held: String },
    /// A model load finished.
    Loaded {
        name: String,
        result: Result<Arc<LoadedModel>, LoadError>,
    },
}

/// The scheduler's way to the arbiter: a blocking round trip to the state owner.
#[derive(Clone, Debug)]
pub struct Budget(pub mpsc::UnboundedSender<Internal>);

impl Budget {
    /// Sends the message `make` builds and waits for its reply.
    fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, LeanStreamError>>) -> Internal,
    ) -> Result<T, LeanStreamError> {
        let (reply, rx) = oneshot::channel();
        let gone = || LeanStreamError::Internal("the daemon is shutting down".into());
        self.0.send(make(reply)).map_err(|_| gone())?;
        rx.blocking_recv().map_err(|_| gone())?
    }
}

impl crate::scheduler::SessionBudget for Budget {
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError> {
        self.ask(|reply| Internal::ResizeSession { id, bytes, reply })
    }

    fn grow_model(&self, name: &str, bytes: u64) -> Result<(), LeanStreamError> {
        let name = name.to_string();
        self.ask(|reply| Internal::GrowModel { name, bytes, reply })
    }

    fn shrink_model(&self, name: &str, bytes: u64) {
        let name = name.to_string();
        // At shutdown there is no budget left to correct.
        let _ = self.0.send(Internal::ShrinkModel { name, bytes });
    }
}

#[derive(Debug)]
enum Waiter {
    Load {
        client: String,
        user: u32,
        keep_alive: KeepAlive,
        reply: Reply<()>,
    },
    Open {
        context: u32,
        client: String,
        user: u32,
        reply: Reply<OwnedObjectPath>,
    },
}

#[derive(Debug)]
enum Slot {
    Loading(Vec<Waiter>),
    Ready(Arc<LoadedModel>),
}

#[derive(Debug)]
struct ModelEntry {
    slot: Slot,
    /// The users keeping it loaded beyond its sessions, and for how long.
    holds: Holds,
    /// Its footprint is reserved in the arbiter (from [`Internal::Reserve`] until it unloads).
    reserved: bool,
    /// When its last session closed, while it waits out its `keep_alive`.
    idle_since: Option<Instant>,
}

#[derive(Debug)]
struct SessionEntry {
    model: String,
    client: String,
    /// The client's uid.
    user: u32,
    context: u32,
    busy: bool,
    position: u32,
    generations: u32,
    generated_tokens: u64,
    /// The decode passes of its generations, and the draft tokens they verified and accepted.
    passes: DecodePasses,
}

/// A client (unique bus name) the state owner has seen on the bus, from its first request that
/// holds memory until it leaves. Its sessions are in the session table, its holds on models in
/// theirs.
#[derive(Clone, Copy, Debug)]
struct ClientEntry {
    /// Its uid, from the bus.
    user: u32,
    /// Root, the daemon's user or the admin group ([`crate::access`]).
    admin: bool,
}

/// The state owner.
pub struct State<M> {
    params: Arc<Params>,
    memory: M,
    conn: zbus::Connection,
    /// What each session object it serves gets.
    objects: crate::service::Shared,
    internal: mpsc::UnboundedSender<Internal>,
    engine: crate::scheduler::Commands,
    /// The names of the models loaded and ready, for `ListModels` (answered outside this task).
    loaded_names: watch::Sender<BTreeSet<String>>,
    models: BTreeMap<String, ModelEntry>,
    sessions: BTreeMap<SessionId, SessionEntry>,
    /// Clients known to be on the bus (see [`State::admit_client`]).
    clients: BTreeMap<String, ClientEntry>,
    /// The bus driver, to ask who a client is and whether it is still connected.
    bus: Option<zbus::fdo::DBusProxy<'static>>,
    next_id: SessionId,
    /// Numbers the placeholder reservations of models being dropped.
    next_release: u64,
}

impl<M> std::fmt::Debug for State<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("models", &self.models.len())
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

fn path_of(id: SessionId) -> OwnedObjectPath {
    // SESSION_PATH_PREFIX is a valid path and `/<digits>` keeps it valid.
    #[allow(clippy::expect_used)]
    OwnedObjectPath::try_from(format!("{SESSION_PATH_PREFIX}/{id}"))
        .expect("broken invariant: a session path is always valid")
}

impl<M: Memory> State<M> {
    pub fn new(
        params: Arc<Params>,
        memory: M,
        conn: zbus::Connection,
        objects: crate::service::Shared,
        internal: mpsc::UnboundedSender<Internal>,
        engine: crate::scheduler::Commands,
        loaded_names: watch::Sender<BTreeSet<String>>,
    ) -> State<M> {
        State {
            params,
            memory,
            conn,
            objects,
            internal,
            engine,
            loaded_names,
            models: BTreeMap::new(),
            sessions: BTreeMap::new(),
            clients: BTreeMap::new(),
            bus: None,
            next_id: 1,
            next_release: 1,
        }
    }

    /// Serves requests until `Shutdown` (or every sender is gone). `departures` carries the
    /// unique bus names that left the bus; `internal` what the daemon's own threads ask.
    pub async fn run(
        mut self,
        mut rx: mpsc::Receiver<Request>,
        mut internal: mpsc::UnboundedReceiver<Internal>,
        mut events: mpsc::UnboundedReceiver<Report>,
        mut departures: mpsc::UnboundedReceiver<String>,
    ) {
        match zbus::fdo::DBusProxy::new(&self.conn).await {
            Ok(p) => self.bus = Some(p),
            Err(e) => tracing::error!("no bus driver proxy, clients cannot be checked: {e}"),
        }
        self.preload().await;
        loop {
            // Engine events first: the engine reports a generation's end before the caller can
            // see it (EOF or an error reply), so a caller's next request never finds the session
            // still marked busy. Then the daemon's own threads, which wait on their answers,
            // then the keep-alive deadline, then clients.
            let next_unload = self.next_unload();
            tokio::select! {
                biased;
                Some(ev) = events.recv() => self.engine_event(ev),
                Some(client) = departures.recv() => self.client_gone(&client).await,
                Some(msg) = internal.recv() => self.internal(msg).await,
                () = sleep_until(next_unload) => self.unload_idle(),
                req = rx.recv() => match req {
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

    /// Starts loading every model configured with `preload = true`, pinned (it stays loaded
    /// until `UnloadModel`). A model that cannot be found or loaded is logged; the daemon serves
    /// on without it.
    async fn preload(&mut self) {
        let names: Vec<String> = (self.params.models.iter())
            .filter(|(_, p)| p.preload)
            .map(|(name, _)| name.clone())
            .collect();
        for name in names {
            let file = match crate::models::resolve(&self.params.model_dir, &name) {
                Ok(file) => file,
                Err(e) => {
                    tracing::error!("preloading model {name}: {e}");
                    continue;
                }
            };
            let (reply, outcome) = oneshot::channel();
            self.load(
                file,
                Waiter::Load {
                    client: String::new(),
                    user: nix::unistd::Uid::effective().as_raw(),
                    keep_alive: KeepAlive::Forever,
                    reply,
                },
            )
            .await;
            tokio::spawn(async move {
                match outcome.await {
                    Ok(Ok(())) => tracing::info!("model {name} preloaded"),
                    Ok(Err(e)) => tracing::error!("preloading model {name}: {e}"),
                    Err(_) => {}
                }
            });
        }
    }

    async fn shutdown(&mut self) {
        let _ = self.engine.send(Command::Shutdown);
        for id in std::mem::take(&mut self.sessions).into_keys() {
            self.memory.close_session(id);
            let _ = self
                .conn
                .object_server()
                .remove::<Typed<crate::service::SessionObject>, _>(path_of(id))
                .await;
        }
    }

    fn engine_event(&mut self, ev: Report) {
        let (id, accepted, generated, position, passes) = match ev {
            Report::Finished {
                id,
                accepted,
                generated,
                position,
                passes,
            } => (id, accepted, generated, position, passes),
            // A closed session's memory is free now: caches may grow into it.
            Report::Dropped { id } => {
                tracing::debug!("session {id} dropped by the scheduler");
                return self.apply_cache_grants();
            }
        };
        if let Some(s) = self.sessions.get_mut(&id) {
            s.busy = false;
            s.position = position;
            if accepted {
                s.generations += 1;
                s.generated_tokens += generated;
                s.passes.passes += passes.passes;
                s.passes.drafted += passes.drafted;
                s.passes.accepted += passes.accepted;
            }
        }
    }

    fn owned(&self, id: SessionId, client: &str) -> Result<&SessionEntry, LeanStreamError> {
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

    async fn handle(&mut self, req: Request) {
        match req {
            Request::LoadModel {
                file,
                client,
                keep_alive,
                reply,
            } => {
                // A lifetime holds memory like a pin, so it counts against the same limit
                // until the model unloads.
                let user = match self.admit_pin(&client, &file.name).await {
                    Ok(user) => user,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                let waiter = Waiter::Load {
                    client,
                    user,
                    keep_alive,
                    reply,
                };
                self.load(file, waiter).await;
            }
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
            } => {
                let user = match self.admit_session(&client).await {
                    Ok(user) => user,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                self.load(
                    file,
                    Waiter::Open {
                        context,
                        client,
                        user,
                        reply,
                    },
                )
                .await;
            }
            Request::Memory { reply } => {
                let _ = reply.send(Ok(self.memory_report()));
            }
            Request::Generate {
                id,
                client,
                input,
                spec,
                reply,
            } => self.generate(id, &client, input, spec, reply),
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
                let r = self.owned(id, &client).map(|s| SessionStats {
                    model: s.model.clone(),
                    context_tokens: s.context,
                    position: s.position,
                    generations: s.generations,
                    generated_tokens: s.generated_tokens,
                    decode_passes: s.passes.passes,
                    draft_tokens: s.passes.drafted,
                    accepted_draft_tokens: s.passes.accepted,
                });
                let _ = reply.send(r);
            }
            Request::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    /// Serves a message of the daemon's own threads.
    async fn internal(&mut self, msg: Internal) {
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
                    match self.memory.resize_session(id, bytes) {
                        Ok(()) => {
                            self.apply_cache_grants();
                            Ok(())
                        }
                        Err(e) => Err(LeanStreamError::OverBudget(e.to_string())),
                    }
                };
                let _ = reply.send(r);
            }
            Internal::GrowModel { name, bytes, reply } => {
                let r = match self.memory.grow_model(&name, bytes) {
                    Ok(()) => {
                        self.apply_cache_grants();
                        Ok(())
                    }
                    Err(e) => Err(LeanStreamError::OverBudget(e.to_string())),
                };
                let _ = reply.send(r);
            }
            Internal::ShrinkModel { name, bytes } => {
                self.memory.shrink_model(&name, bytes);
                self.apply_cache_grants();
            }
            Internal::Released { held } => {
                self.memory.unload_model(&held);
                self.apply_cache_grants();
            }
            Internal::Loaded { name, result } => self.loaded(&name, result).await,
        }
    }

    /// Checks that `client` is still on the bus the first time it asks for something that
    /// holds memory, and records who it is. This closes the race between a request and its
    /// client's disconnection: the bus sends NameOwnerChanged after the name is gone, so either
    /// the departure is handled after this request (and releases what it got), or it came first
    /// (forgetting the client) and the bus now answers that the name has no owner (and the
    /// request is refused). A known client needs no new check: its departure is still to come.
    async fn admit_client(&mut self, client: &str) -> Result<ClientEntry, LeanStreamError> {
        if let Some(known) = self.clients.get(client) {
            return Ok(*known);
        }
        let gone = || LeanStreamError::AccessDenied(format!("client {client} has left the bus"));
        let name = zbus::names::BusName::try_from(client).map_err(|_| gone())?;
        let user = match &self.bus {
            // Fails once the name has no owner: the same answer as a departed client.
            Some(bus) => bus
                .get_connection_unix_user(name)
                .await
                .map_err(|_| gone())?,
            None => {
                return Err(LeanStreamError::Internal(
                    "the bus driver cannot be asked who the caller is".into(),
                ));
            }
        };
        let admin_group = self.params.admin_group.clone();
        // User and group lookups may go through NSS (files, LDAP): off the async workers.
        let admin = tokio::task::spawn_blocking(move || {
            crate::access::privileged(user, admin_group.as_deref())
        })
        .await
        .unwrap_or(false);
        let entry = ClientEntry { user, admin };
        self.clients.insert(client.to_string(), entry);
        Ok(entry)
    }

    /// Sessions open or waiting for their model: every user's, or `user`'s only.
    fn sessions_of(&self, user: Option<u32>) -> usize {
        let mine = |u: u32| user.is_none_or(|want| want == u);
        let open = self.sessions.values().filter(|s| mine(s.user)).count();
        let waiting: usize = self
            .models
            .values()
            .map(|m| match &m.slot {
                Slot::Loading(w) => w
                    .iter()
                    .filter(|w| matches!(w, Waiter::Open { user: u, .. } if mine(*u)))
                    .count(),
                Slot::Ready(_) => 0,
            })
            .sum();
        open + waiting
    }

    /// Room for one more session: the daemon's limit and the user's (all its connections
    /// together). Returns the client's uid.
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
    async fn admit_pin(&mut self, client: &str, model: &str) -> Result<u32, LeanStreamError> {
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

    /// Makes `file`'s model available to `waiter`, loading it on a loader thread if needed.
    async fn load(&mut self, file: ModelFile, waiter: Waiter) {
        let name = file.name.clone();
        let hold = match &waiter {
            Waiter::Load {
                user, keep_alive, ..
            } => Some((*user, *keep_alive)),
            Waiter::Open { .. } => None,
        };
        if let Some(entry) = self.models.get_mut(&name) {
            if let Some((user, keep_alive)) = hold {
                entry.holds.add(user, keep_alive);
            }
            match &mut entry.slot {
                Slot::Loading(waiters) => waiters.push(waiter),
                Slot::Ready(model) => {
                    let model = Arc::clone(model);
                    self.serve_waiter(&model, waiter).await;
                    // A lifetime asked of a model without sessions counts from now.
                    if hold.is_some() {
                        self.unload_if_unused(&name);
                    }
                }
            }
            return;
        }
        let mut holds = Holds::default();
        if let Some((user, keep_alive)) = hold {
            holds.add(user, keep_alive);
        }
        tracing::info!(
            "loading model {name} from {} in {} mode",
            file.path.display(),
            self.params.model(&name).mode
        );
        self.models.insert(
            name.clone(),
            ModelEntry {
                slot: Slot::Loading(vec![waiter]),
                holds,
                reserved: false,
                idle_since: None,
            },
        );
        let tx = self.internal.clone();
        let params = Arc::clone(&self.params);
        let spawned = std::thread::Builder::new()
            .name("leanstream-load".into())
            .spawn(move || {
                let result = load_reserved(&file, &params, &tx).map(Arc::new);
                let name = file.name;
                let _ = tx.send(Internal::Loaded { name, result });
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start a loader thread: {e}");
            if let Some(ModelEntry {
                slot: Slot::Loading(waiters),
                ..
            }) = self.models.remove(&name)
            {
                for w in waiters {
                    reply_err(w, LeanStreamError::Internal(format!("loader thread: {e}")));
                }
            }
        }
    }

    /// Reserves the footprint of a model being loaded.
    fn reserve(&mut self, name: &str, footprint: Footprint) -> Result<(), LoadError> {
        let Some(entry) = self.models.get_mut(name) else {
            return Err(LoadError::Failed(format!(
                "model {name} is no longer being loaded"
            )));
        };
        self.memory
            .load_model(
                name,
                footprint.resident_bytes,
                footprint.cache_floor_bytes,
                footprint.cache_bytes,
            )
            .map_err(|e| LoadError::OverBudget(e.to_string()))?;
        entry.reserved = true;
        // Other caches may have shrunk to make room: free that memory before the loader
        // allocates.
        self.apply_cache_grants();
        Ok(())
    }

    /// Makes every loaded model's neuron cache the size the arbiter grants it now: shrinks
    /// first, so that what they free is free before anything grows, then growth. Called after
    /// every change to the arbiter. A model still loading holds only its floor (it is loaded
    /// with it) and is resized once loaded.
    fn apply_cache_grants(&self) {
        let mut grants: Vec<(&Arc<LoadedModel>, u64, u64)> = Vec::new();
        for (name, entry) in &self.models {
            if let Slot::Ready(model) = &entry.slot
                && let (Some(held), Some(grant)) =
                    (model.cache_held(), self.memory.cache_bytes(name))
                && held != grant
            {
                grants.push((model, held, grant));
            }
        }
        if grants.is_empty() {
            return;
        }
        // Shrinks before growth.
        grants.sort_by_key(|&(_, held, grant)| grant > held);
        let resize = || {
            for (model, held, grant) in grants {
                match model.resize_cache(grant) {
                    Some(Ok(now)) => tracing::debug!(
                        "model {}: neuron cache {held} -> {now} bytes (granted {grant})",
                        model.name
                    ),
                    Some(Err(e)) => {
                        tracing::error!("model {}: resizing the neuron cache: {e}", model.name)
                    }
                    None => {}
                }
            }
        };
        // Locking an executor waits for the scheduler's forward pass on it.
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(resize)
            }
            _ => resize(),
        }
    }

    async fn loaded(&mut self, name: &str, result: Result<Arc<LoadedModel>, LoadError>) {
        let Some(entry) = self.models.get_mut(name) else {
            return;
        };
        let waiters = match std::mem::replace(&mut entry.slot, Slot::Loading(Vec::new())) {
            Slot::Loading(w) => w,
            Slot::Ready(m) => {
                entry.slot = Slot::Ready(m);
                return;
            }
        };
        match result {
            Ok(model) => {
                tracing::info!("model {name} loaded");
                entry.slot = Slot::Ready(Arc::clone(&model));
                self.publish_loaded();
                // Loaded with its floor: now its cache grows to what the arbiter grants.
                self.apply_cache_grants();
                for w in waiters {
                    self.serve_waiter(&model, w).await;
                }
                self.unload_if_unused(name);
            }
            Err(e) => {
                tracing::error!("loading model {name}: {e}");
                if self.models.remove(name).is_some_and(|m| m.reserved) {
                    self.memory.unload_model(name);
                }
                for w in waiters {
                    reply_err(w, e.to_wire());
                }
            }
        }
    }

    async fn serve_waiter(&mut self, model: &Arc<LoadedModel>, waiter: Waiter) {
        match waiter {
            Waiter::Load { reply, .. } => {
                let _ = reply.send(Ok(()));
            }
            Waiter::Open {
                context,
                client,
                user,
                reply,
            } => {
                let r = match self.open(model, context, client, user) {
                    // Serve the object before answering, so the client can call it at once, and
                    // before the next request, so a departure can only find it served.
                    Ok((id, ())) => {
                        let obj = Typed::new(crate::service::SessionObject::new(
                            id,
                            self.objects.clone(),
                        ));
                        let path = path_of(id);
                        match self.conn.object_server().at(path.clone(), obj).await {
                            Ok(_) => Ok(path),
                            Err(e) => {
                                self.close(id).await;
                                Err(LeanStreamError::Internal(e.to_string()))
                            }
                        }
                    }
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
        }
    }

    fn open(
        &mut self,
        model: &Arc<LoadedModel>,
        context: u32,
        client: String,
        user: u32,
    ) -> Result<(SessionId, ()), LeanStreamError> {
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
        if self.sessions.len() >= self.params.max_sessions {
            return Err(LeanStreamError::Busy(format!(
                "the daemon already has its maximum of {} sessions",
                self.params.max_sessions
            )));
        }
        let id = self.next_id;
        let p = self.params.model(&model.name);
        // What the engine will allocate for a new session (its scratch; KV blocks come later,
        // each reserved by the scheduler before it is allocated).
        let bytes = session_open_bytes(&model.model, context, p.kv_type);
        self.memory
            .open_session(id, &model.name, &client, bytes, p.priority)
            .map_err(|e| LeanStreamError::OverBudget(e.to_string()))?;
        // Caches may have shrunk to make room: free that before the session allocates.
        self.apply_cache_grants();
        let session = match model.open_session(context, self.params.precision, p.kv_type) {
            Ok(s) => s,
            Err(e) => {
                self.memory.close_session(id);
                return Err(LeanStreamError::Internal(e.to_string()));
            }
        };
        // The session says what it holds; on the GPU that includes device buffers the CPU
        // estimate does not know.
        let held = session.bytes();
        if held != bytes
            && let Err(e) = self.memory.resize_session(id, held)
        {
            self.memory.close_session(id);
            return Err(LeanStreamError::OverBudget(e.to_string()));
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
        self.sessions.insert(
            id,
            SessionEntry {
                model: model.name.clone(),
                client,
                user,
                context: context as u32,
                busy: false,
                position: 0,
                generations: 0,
                generated_tokens: 0,
                passes: DecodePasses::default(),
            },
        );
        Ok((id, ()))
    }

    /// `UnloadModel` from `caller`: gives up its hold ([`holds`]) and unloads the model when
    /// nobody else holds it. Nothing changes while the model loads or has sessions.
    fn unload(&mut self, name: &str, caller: ClientEntry) -> Result<(), LeanStreamError> {
        models::check_name(name)?;
        let Some(entry) = self.models.get(name) else {
            return Err(LeanStreamError::ModelNotFound(format!(
                "model {name:?} is not loaded"
            )));
        };
        if matches!(entry.slot, Slot::Loading(_)) || self.sessions.values().any(|s| s.model == name)
        {
            return Err(LeanStreamError::Busy(format!(
                "model {name:?} is loading or has open sessions"
            )));
        }
        let Some(entry) = self.models.get_mut(name) else {
            return Ok(());
        };
        match entry.holds.give_up(caller.user, caller.admin)? {
            Unload::Now => {
                self.release(name);
                tracing::info!("model {name} unloaded");
            }
            Unload::KeptByOthers => {
                tracing::debug!("model {name}: user {} gave up its hold", caller.user);
            }
        }
        Ok(())
    }

    /// Forgets a loaded model. The model itself is dropped on a blocking thread (in a streaming
    /// mode the last reference joins its I/O threads, which may be finishing a read), and until
    /// it is, a placeholder reservation named `(unloading NAME #N)` holds what it held: the
    /// ledger frees the memory when the process has, so the same model loading again at once,
    /// or a cache growing, never counts on memory that is still in use.
    fn release(&mut self, name: &str) {
        if let Some(entry) = self.models.remove(name) {
            let held_bytes = self
                .memory
                .report()
                .models
                .iter()
                .find(|m| m.name == name)
                .map_or(0, |m| m.resident + m.cache);
            self.memory.unload_model(name);
            let held = format!("(unloading {name} #{})", self.next_release);
            self.next_release += 1;
            if let Err(e) = self.memory.load_model(&held, held_bytes, 0, 0) {
                // Cannot happen: the bytes were just freed and caches are not hard reservations.
                tracing::error!("placeholder for model {name} while it unloads: {e}");
            }
            let internal = self.internal.clone();
            let model = match entry.slot {
                Slot::Ready(model) => Some(model),
                Slot::Loading(_) => None,
            };
            tokio::task::spawn_blocking(move || {
                if let Some(model) = model {
                    drop_last(model);
                }
                let _ = internal.send(Internal::Released { held });
            });
            self.publish_loaded();
        }
    }

    /// Tells `ListModels` which models are loaded now.
    fn publish_loaded(&self) {
        let ready = (self.models.iter())
            .filter(|(_, m)| matches!(m.slot, Slot::Ready(_)))
            .map(|(name, _)| name.clone())
            .collect();
        self.loaded_names.send_replace(ready);
    }

    /// Whether model `name` is loaded, not pinned by a user, and has no session (its
    /// configuration may still keep it forever: its idle time is then reported all the same).
    fn unused(&self, name: &str) -> bool {
        self.models.get(name).is_some_and(|m| {
            m.holds.longest() != KeepAlive::Forever
                && matches!(m.slot, Slot::Ready(_))
                && !self.sessions.values().any(|s| s.model == name)
        })
    }

    /// Called when a model may have lost its last session, or was given a new lifetime:
    /// unloads it at once, or (re)starts its wait of `keep_alive` from now (the owner's loop
    /// wakes at [`State::next_unload`]), or keeps it.
    fn unload_if_unused(&mut self, name: &str) {
        if !self.unused(name) {
            return;
        }
        if self.keep_alive(name) == KeepAlive::UntilLastClose {
            self.release(name);
            tracing::info!("model {name} unloaded (no sessions left)");
            return;
        }
        if let Some(m) = self.models.get_mut(name) {
            m.idle_since = Some(Instant::now());
        }
    }

    /// How long model `name` stays loaded without sessions: its configured `keep_alive`, or
    /// the longest hold a user has on it (a pin is `Forever`), whichever is longer.
    fn keep_alive(&self, name: &str) -> KeepAlive {
        let configured = self.params.model(name).keep_alive;
        self.models
            .get(name)
            .map_or(configured, |m| configured.max(m.holds.longest()))
    }

    /// How long an unused, unpinned model has been without sessions.
    fn idle_for(&self, name: &str) -> Option<std::time::Duration> {
        let since = self.models.get(name)?.idle_since?;
        self.unused(name).then(|| since.elapsed())
    }

    /// Seconds until model `name` unloads on its own; -1 when it will not.
    fn unload_in_seconds(&self, name: &str) -> i64 {
        match (self.keep_alive(name), self.idle_for(name)) {
            (KeepAlive::Idle(after), Some(idle)) => after.saturating_sub(idle).as_secs() as i64,
            _ => -1,
        }
    }

    /// The moment the first unused model's `keep_alive` runs out, if one will.
    fn next_unload(&self) -> Option<Instant> {
        (self.models.iter())
            .filter(|(name, _)| self.unused(name))
            .filter_map(|(name, m)| match self.keep_alive(name) {
                KeepAlive::Idle(after) => m.idle_since.map(|since| since + after),
                _ => None,
            })
            .min()
    }

    /// Unloads every unused model whose `keep_alive` has run out.
    fn unload_idle(&mut self) {
        let now = Instant::now();
        let due: Vec<(String, KeepAlive)> = (self.models.iter())
            .filter(|(name, _)| self.unused(name))
            .map(|(name, m)| (name, m, self.keep_alive(name)))
            .filter(|(_, m, keep_alive)| match keep_alive {
                KeepAlive::Idle(after) => m.idle_since.is_some_and(|since| since + *after <= now),
                _ => false,
            })
            .map(|(name, _, keep_alive)| (name.clone(), keep_alive))
            .collect();
        for (name, keep_alive) in due {
            self.release(&name);
            tracing::info!("model {name} unloaded (idle for its keep_alive, {keep_alive:?})");
        }
    }

    fn generate(
        &mut self,
        id: SessionId,
        client: &str,
        input: Input,
        spec: GenSpec,
        reply: Reply<OwnedFd>,
    ) {
        let session = match self.owned(id, client) {
            Ok(s) => s,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        if session.busy {
            let _ = reply.send(Err(LeanStreamError::Busy(
                "a generation is already running on this session".into(),
            )));
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
        if let Some(s) = self.sessions.get_mut(&id) {
            s.busy = true;
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

    async fn close(&mut self, id: SessionId) {
        let Some(s) = self.sessions.remove(&id) else {
            return;
        };
        let _ = self.engine.send(Command::Close { id });
        self.memory.close_session(id);
        if let Err(e) = self
            .conn
            .object_server()
            .remove::<Typed<crate::service::SessionObject>, _>(path_of(id))
            .await
        {
            tracing::warn!("removing session object {id}: {e}");
        }
        tracing::debug!("session {id} closed");
        self.unload_if_unused(&s.model);
    }

    async fn client_gone(&mut self, client: &str) {
        self.clients.remove(client);
        // Waiting opens of this client will never be used.
        for m in self.models.values_mut() {
            if let Slot::Loading(waiters) = &mut m.slot {
                waiters.retain(|w| match w {
                    Waiter::Open { client: c, .. } | Waiter::Load { client: c, .. } => c != client,
                });
            }
        }
        let ids = self.memory.client_gone(client);
        let mut ids: Vec<SessionId> = ids;
        ids.extend(
            self.sessions
                .iter()
                .filter(|(_, s)| s.client == client)
                .map(|(id, _)| *id),
        );
        ids.sort_unstable();
        ids.dedup();
        if !ids.is_empty() {
            tracing::info!("client {client} is gone: closing sessions {ids:?}");
        }
        for id in ids {
            self.close(id).await;
        }
    }

    /// What the memory planner reads per token for model `name`: dense pieces and, where it
    /// streams FFN layers by neuron, the expected misses (0 when it is not loaded, or keeps every
    /// weight resident).
    fn streamed_bytes_per_token(&self, name: &str) -> u64 {
        match self.models.get(name).map(|e| &e.slot) {
            Some(Slot::Ready(m)) => m.model.plan().map_or(0, |p| p.read_bytes_per_token()),
            _ => 0,
        }
    }

    /// How model `name` runs: its configured mode, or `dense+neuron` for a model whose plan
    /// streams FFN layers by neuron.
    fn mode_name(&self, name: &str) -> String {
        if name.starts_with("(unloading ") {
            return "unloading".into();
        }
        match self.models.get(name).map(|e| &e.slot) {
            Some(Slot::Ready(m)) if m.model.plan().is_some_and(|p| p.is_sparse()) => {
                "dense+neuron".into()
            }
            // Params never change, so this is the mode the model was loaded in.
            _ => self.params.model(name).mode.name().into(),
        }
    }

    /// What model `name` holds by part, and the bytes its plan streams, once it is loaded.
    fn model_parts(&self, name: &str) -> ModelParts {
        match self.models.get(name).map(|e| &e.slot) {
            Some(Slot::Ready(m)) => {
                let f = m.model.footprint();
                let plan = m.model.plan();
                ModelParts {
                    weights: f.weights.image,
                    tokenizer: f.tokenizer,
                    tables: f.weights.heap,
                    ring: f.ring,
                    streamed_whole: plan.map_or(0, |p| p.unit_bytes_per_token()),
                    streamed_sparse: plan.map_or(0, |p| p.sparse_ffn_bytes()),
                }
            }
            _ => ModelParts::default(),
        }
    }

    fn memory_report(&self) -> MemoryReport {
        let f = self.memory.report();
        let mut clients: HashMap<&str, (u32, u64)> = HashMap::new();
        for (_, _, client, bytes) in &f.sessions {
            let c = clients.entry(client.as_str()).or_default();
            c.0 += 1;
            c.1 += bytes;
        }
        let mut clients: Vec<ClientMemory> = clients
            .into_iter()
            .map(|(client, (sessions, bytes))| ClientMemory {
                client: client.to_string(),
                sessions,
                bytes,
            })
            .collect();
        clients.sort_by(|a, b| a.client.cmp(&b.client));
        MemoryReport {
            budget_bytes: f.budget,
            used_bytes: f.used,
            rss_bytes: leanstream_engine::process::rss_bytes(),
            models: f
                .models
                .iter()
                .map(|m| ModelMemory {
                    name: m.name.clone(),
                    resident_bytes: m.resident,
                    cache_bytes: m.cache,
                    cache_floor_bytes: m.cache_floor,
                    cache_wanted_bytes: m.cache_wanted,
                    mode: self.mode_name(&m.name),
                    streamed_bytes_per_token: self.streamed_bytes_per_token(&m.name),
                    idle_seconds: self.idle_for(&m.name).map_or(0, |idle| idle.as_secs()),
                    unload_in_seconds: self.unload_in_seconds(&m.name),
                    parts: self.model_parts(&m.name),
                })
                .collect(),
            sessions: f
                .sessions
                .iter()
                .map(|(id, model, client, bytes)| SessionMemory {
                    path: path_of(*id),
                    model: model.clone(),
                    client: client.clone(),
                    bytes: *bytes,
                })
                .collect(),
            clients,
        }
    }
}

/// On a loader thread: works out the footprint of `file`, has the state owner reserve it, then
/// loads the model.
fn load_reserved(
    file: &ModelFile,
    params: &Params,
    internal: &mpsc::UnboundedSender<Internal>,
) -> Result<LoadedModel, LoadError> {
    let footprint = Footprint::of(file, params.model(&file.name))?.on_backend(params.backend);
    let (reply, rx) = oneshot::channel();
    let gone = || LoadError::Failed("the daemon is shutting down".into());
    internal
        .send(Internal::Reserve {
            name: file.name.clone(),
            footprint,
            reply,
        })
        .map_err(|_| gone())?;
    rx.blocking_recv().map_err(|_| gone())??;
    let model = LoadedModel::load(file, params, footprint.cache_floor_bytes);
    // Parsing a model file frees a lot of small allocations (its metadata, the tokenizer's
    // source): hand them back rather than keep them beside the model.
    leanstream_engine::alloc::trim();
    model
}

/// Drops `model` once it is the last reference (the scheduler drops its own when it handles the
/// sessions' `Close`, within one forward pass), so that its memory is really free on return;
/// gives up waiting after a few seconds (the memory is then freed by whoever holds it last).
fn drop_last(model: Arc<LoadedModel>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while Arc::strong_count(&model) > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(model);
    leanstream_engine::alloc::trim();
}

fn reply_err(waiter: Waiter, e: LeanStreamError) {
    match waiter {
        Waiter::Load { reply, .. } => {
            let _ = reply.send(Err(e));
        }
        Waiter::Open { reply, .. } => {
            let _ = reply.send(Err(e));
        }
    }
}

/// Sleeps until `deadline`; forever when there is none.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
