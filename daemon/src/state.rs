//! The one task that owns the daemon's state: models, sessions, owners, memory accounting. The
//! D-Bus objects send it [`Request`]s over a bounded channel and await a oneshot reply; the
//! scheduler thread reports finished generations; the bus watcher reports vanished clients.
//!
//! Model loads run on their own OS threads; requests that need a model being loaded wait in its
//! slot and are answered when it is ready. A loader thread first works out the model's
//! [`Footprint`] from the file's header and asks the state owner to reserve it
//! ([`Request::Reserve`]); it maps weights and allocates the neuron cache only once that is done,
//! so a load that does not fit is refused before it uses the memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use leanstream::contract::{
    ClientMemory, LeanStreamError, MemoryReport, ModelInfo, ModelMemory, ModelParts,
    SESSION_PATH_PREFIX, SessionMemory, SessionStats,
};
use leanstream_engine::forward::session_open_bytes;
use leanstream_engine::model::summarize;
use tokio::sync::{mpsc, oneshot};
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

use crate::config::{KeepAlive, Params};
use crate::loader::{Footprint, LoadError};
use crate::memory::{Memory, SessionId};
use crate::models::{self, ModelFile};
use crate::scheduler::{Command, GenSpec, Input, LoadedModel, Report};

type Reply<T> = oneshot::Sender<Result<T, LeanStreamError>>;

/// Requests to the state owner.
#[derive(Debug)]
pub enum Request {
    ListModels {
        reply: Reply<Vec<ModelInfo>>,
    },
    /// Loads a model; `keep_alive: None` pins it (`LoadModel`), `Some` gives it at least that
    /// lifetime without sessions, counted from now (`LoadModelFor`).
    LoadModel {
        file: ModelFile,
        client: String,
        keep_alive: Option<KeepAlive>,
        reply: Reply<()>,
    },
    UnloadModel {
        name: String,
        reply: Reply<()>,
    },
    OpenSession {
        file: ModelFile,
        context: u32,
        client: String,
        reply: Reply<OwnedObjectPath>,
    },
    Memory {
        reply: Reply<MemoryReport>,
    },
    Generate {
        id: SessionId,
        client: String,
        input: Input,
        spec: GenSpec,
        reply: Reply<OwnedFd>,
    },
    Cancel {
        id: SessionId,
        client: String,
        reply: Reply<()>,
    },
    Close {
        id: SessionId,
        client: String,
        reply: Reply<()>,
    },
    Stats {
        id: SessionId,
        client: String,
        reply: Reply<SessionStats>,
    },
    /// Internal: a loader thread asks to reserve its model's memory before it loads.
    Reserve {
        name: String,
        footprint: Footprint,
        reply: oneshot::Sender<Result<(), LoadError>>,
    },
    /// Internal, from the scheduler thread: session `id` needs its reservation set to `bytes`
    /// before it allocates more KV blocks. Neuron caches have shrunk by the time the reply is
    /// `Ok`.
    ResizeSession {
        id: SessionId,
        bytes: u64,
        reply: oneshot::Sender<Result<(), LeanStreamError>>,
    },
    /// From the scheduler thread: model `name` keeps `bytes` more for its lifetime (the
    /// grammar parser's token trie, built on its first constrained generation).
    GrowModel {
        name: String,
        bytes: u64,
        reply: oneshot::Sender<Result<(), LeanStreamError>>,
    },
    /// From the scheduler: model `name` dropped `bytes` it had kept (an evicted prompt prefix).
    ShrinkModel {
        name: String,
        bytes: u64,
    },
    /// Internal: a released model's memory has been handed back: its placeholder reservation
    /// (`held`, see [`State::release`]) ends and caches may grow into it.
    Released {
        held: String,
    },
    /// Internal: model `name`'s `keep_alive` may have run out since its last session closed.
    IdleCheck {
        name: String,
    },
    /// Internal: a model load finished.
    Loaded {
        name: String,
        result: Result<Arc<LoadedModel>, LoadError>,
    },
    /// Cancel everything, stop the scheduler, then reply.
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// Sends a request and awaits its reply (what every D-Bus method does).
pub async fn ask<T>(
    tx: &mpsc::Sender<Request>,
    make: impl FnOnce(Reply<T>) -> Request,
) -> Result<T, LeanStreamError> {
    let (reply, rx) = oneshot::channel();
    tx.send(make(reply))
        .await
        .map_err(|_| LeanStreamError::Internal("the daemon is shutting down".into()))?;
    rx.await
        .map_err(|_| LeanStreamError::Internal("the daemon is shutting down".into()))?
}

/// The scheduler's way to the arbiter: a blocking round trip to the state owner.
#[derive(Debug)]
pub struct Budget(pub mpsc::Sender<Request>);

impl crate::scheduler::SessionBudget for Budget {
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError> {
        let (reply, rx) = oneshot::channel();
        let gone = || LeanStreamError::Internal("the daemon is shutting down".into());
        self.0
            .blocking_send(Request::ResizeSession { id, bytes, reply })
            .map_err(|_| gone())?;
        rx.blocking_recv().map_err(|_| gone())?
    }

    fn grow_model(&self, name: &str, bytes: u64) -> Result<(), LeanStreamError> {
        let (reply, rx) = oneshot::channel();
        let gone = || LeanStreamError::Internal("the daemon is shutting down".into());
        let name = name.to_string();
        self.0
            .blocking_send(Request::GrowModel { name, bytes, reply })
            .map_err(|_| gone())?;
        rx.blocking_recv().map_err(|_| gone())?
    }

    fn shrink_model(&self, name: &str, bytes: u64) {
        let name = name.to_string();
        // At shutdown there is no budget left to correct.
        let _ = self.0.blocking_send(Request::ShrinkModel { name, bytes });
    }
}

#[derive(Debug)]
enum Waiter {
    Load {
        client: String,
        keep_alive: Option<KeepAlive>,
        reply: Reply<()>,
    },
    Open {
        context: u32,
        client: String,
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
    /// Loaded through `LoadModel` (stays loaded without sessions).
    pinned: bool,
    /// Its footprint is reserved in the arbiter (from [`Request::Reserve`] until it unloads).
    reserved: bool,
    /// When its last session closed, while it waits out its `keep_alive`.
    idle_since: Option<std::time::Instant>,
    /// The longest lifetime a `LoadModelFor` asked for since it loaded (it only ever lengthens
    /// the configured `keep_alive`; see [`State::keep_alive`]).
    asked_keep_alive: KeepAlive,
}

#[derive(Debug)]
struct SessionEntry {
    model: String,
    client: String,
    context: u32,
    busy: bool,
    position: u32,
    generations: u32,
    generated_tokens: u64,
}

/// A client (unique bus name) the state owner has seen on the bus, from its first session or
/// pin until it leaves. Its sessions are in the session table; this records the rest.
#[derive(Debug, Default)]
struct ClientEntry {
    /// Models this client pinned with `LoadModel` (a pin outlives the client; only the count
    /// against [`Params::max_pins_per_client`] ends with it).
    pins: std::collections::BTreeSet<String>,
}

/// The state owner.
pub struct State<M> {
    params: Arc<Params>,
    memory: M,
    conn: zbus::Connection,
    requests: mpsc::Sender<Request>,
    engine: crate::scheduler::Commands,
    models: BTreeMap<String, ModelEntry>,
    sessions: BTreeMap<SessionId, SessionEntry>,
    /// Clients known to be on the bus (see [`State::admit_client`]).
    clients: BTreeMap<String, ClientEntry>,
    /// The bus driver, to ask whether a client is still connected.
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
        requests: mpsc::Sender<Request>,
        engine: crate::scheduler::Commands,
    ) -> State<M> {
        State {
            params,
            memory,
            conn,
            requests,
            engine,
            models: BTreeMap::new(),
            sessions: BTreeMap::new(),
            clients: BTreeMap::new(),
            bus: None,
            next_id: 1,
            next_release: 1,
        }
    }

    /// Serves requests until `Shutdown` (or every sender is gone). `departures` carries the
    /// unique bus names that left the bus.
    pub async fn run(
        mut self,
        mut rx: mpsc::Receiver<Request>,
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
            // still marked busy.
            tokio::select! {
                biased;
                Some(ev) = events.recv() => self.engine_event(ev),
                Some(client) = departures.recv() => self.client_gone(&client).await,
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
                    keep_alive: None,
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
                .remove::<crate::service::SessionObject, _>(path_of(id))
                .await;
        }
    }

    fn engine_event(&mut self, ev: Report) {
        let (id, accepted, generated, position) = match ev {
            Report::Finished {
                id,
                accepted,
                generated,
                position,
            } => (id, accepted, generated, position),
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
            Request::ListModels { reply } => {
                let _ = reply.send(self.list_models().await);
            }
            Request::LoadModel {
                file,
                client,
                keep_alive,
                reply,
            } => {
                // A lifetime holds memory like a pin, so it counts against the same limit
                // until the model unloads.
                if let Err(e) = self.admit_pin(&client, &file.name).await {
                    let _ = reply.send(Err(e));
                    return;
                }
                let waiter = Waiter::Load {
                    client,
                    keep_alive,
                    reply,
                };
                self.load(file, waiter).await;
            }
            Request::UnloadModel { name, reply } => {
                let _ = reply.send(self.unload(&name));
            }
            Request::OpenSession {
                file,
                context,
                client,
                reply,
            } => {
                if let Err(e) = self.admit_session(&client).await {
                    let _ = reply.send(Err(e));
                    return;
                }
                self.load(
                    file,
                    Waiter::Open {
                        context,
                        client,
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
                });
                let _ = reply.send(r);
            }
            Request::Reserve {
                name,
                footprint,
                reply,
            } => {
                let _ = reply.send(self.reserve(&name, footprint));
            }
            Request::ResizeSession { id, bytes, reply } => {
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
            Request::GrowModel { name, bytes, reply } => {
                let r = match self.memory.grow_model(&name, bytes) {
                    Ok(()) => {
                        self.apply_cache_grants();
                        Ok(())
                    }
                    Err(e) => Err(LeanStreamError::OverBudget(e.to_string())),
                };
                let _ = reply.send(r);
            }
            Request::ShrinkModel { name, bytes } => {
                self.memory.shrink_model(&name, bytes);
                self.apply_cache_grants();
            }
            Request::Released { held } => {
                self.memory.unload_model(&held);
                self.apply_cache_grants();
            }
            Request::Loaded { name, result } => self.loaded(&name, result).await,
            Request::IdleCheck { name } => self.idle_check(&name),
            Request::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    async fn list_models(&self) -> Result<Vec<ModelInfo>, LeanStreamError> {
        let dir = self.params.model_dir.clone();
        let files = tokio::task::spawn_blocking(move || {
            models::list(&dir).map(|files| {
                let summaries = files.iter().map(|f| summarize(&f.path));
                files
                    .iter()
                    .cloned()
                    .zip(summaries.collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            })
        })
        .await
        .map_err(|e| LeanStreamError::Internal(e.to_string()))?
        .map_err(|e| LeanStreamError::Internal(format!("reading the model directory: {e}")))?;
        Ok(files
            .into_iter()
            .map(|(f, summary)| {
                let (architecture, quantization) = match summary {
                    Ok(s) => (s.architecture, s.quantization),
                    Err(e) => ("unknown".to_string(), e.to_string()),
                };
                ModelInfo {
                    loaded: matches!(
                        self.models.get(&f.name).map(|m| &m.slot),
                        Some(Slot::Ready(_))
                    ),
                    name: f.name,
                    format: f.format.to_string(),
                    architecture,
                    quantization,
                    file_bytes: f.bytes,
                }
            })
            .collect())
    }

    /// Checks that `client` is still on the bus the first time it asks for something that
    /// holds memory, and records it. This closes the race between a request and its client's
    /// disconnection: the bus sends NameOwnerChanged after the name is gone, so either the
    /// departure is handled after this request (and releases what it got), or it came first
    /// (forgetting the client) and the bus now answers that the name has no owner (and the
    /// request is refused). A known client needs no new check: its departure is still to come.
    async fn admit_client(&mut self, client: &str) -> Result<&mut ClientEntry, LeanStreamError> {
        if !self.clients.contains_key(client)
            && let Some(bus) = &self.bus
        {
            let alive = match zbus::names::BusName::try_from(client) {
                Ok(name) => bus.name_has_owner(name).await.unwrap_or(false),
                Err(_) => false,
            };
            if !alive {
                return Err(LeanStreamError::AccessDenied(format!(
                    "client {client} has left the bus"
                )));
            }
        }
        Ok(self.clients.entry(client.to_string()).or_default())
    }

    /// Sessions open or waiting for their model: every client's, or `client`'s only.
    fn sessions_of(&self, client: Option<&str>) -> usize {
        let mine = |c: &str| client.is_none_or(|want| want == c);
        let open = self.sessions.values().filter(|s| mine(&s.client)).count();
        let waiting: usize = self
            .models
            .values()
            .map(|m| match &m.slot {
                Slot::Loading(w) => w
                    .iter()
                    .filter(|w| matches!(w, Waiter::Open { client: c, .. } if mine(c)))
                    .count(),
                Slot::Ready(_) => 0,
            })
            .sum();
        open + waiting
    }

    /// Room for one more session: the daemon's limit and the client's.
    async fn admit_session(&mut self, client: &str) -> Result<(), LeanStreamError> {
        self.admit_client(client).await?;
        if self.sessions_of(None) >= self.params.max_sessions {
            return Err(LeanStreamError::Busy(format!(
                "the daemon already has its maximum of {} sessions",
                self.params.max_sessions
            )));
        }
        let limit = self.params.max_sessions_per_client;
        if self.sessions_of(Some(client)) >= limit {
            return Err(LeanStreamError::Busy(format!(
                "this client already has its maximum of {limit} sessions \
                 (`limits.max_sessions_per_client`)"
            )));
        }
        Ok(())
    }

    /// Room for `client` to pin `model` (pinning a model it already pinned is free).
    async fn admit_pin(&mut self, client: &str, model: &str) -> Result<(), LeanStreamError> {
        let limit = self.params.max_pins_per_client;
        let entry = self.admit_client(client).await?;
        if !entry.pins.contains(model) && entry.pins.len() >= limit {
            return Err(LeanStreamError::Busy(format!(
                "this client already pins its maximum of {limit} models \
                 (`limits.max_pins_per_client`): unload one first"
            )));
        }
        entry.pins.insert(model.to_string());
        Ok(())
    }

    /// Makes `file`'s model available to `waiter`, loading it on a loader thread if needed.
    async fn load(&mut self, file: ModelFile, waiter: Waiter) {
        let name = file.name.clone();
        let (pin, asked) = match &waiter {
            Waiter::Load {
                keep_alive: None, ..
            } => (true, KeepAlive::default()),
            Waiter::Load {
                keep_alive: Some(k),
                ..
            } => (false, *k),
            Waiter::Open { .. } => (false, KeepAlive::default()),
        };
        if let Some(entry) = self.models.get_mut(&name) {
            entry.pinned |= pin;
            entry.asked_keep_alive = entry.asked_keep_alive.max(asked);
            match &mut entry.slot {
                Slot::Loading(waiters) => waiters.push(waiter),
                Slot::Ready(model) => {
                    let model = Arc::clone(model);
                    self.serve_waiter(&model, waiter).await;
                    // A lifetime asked of a model without sessions counts from now.
                    if asked != KeepAlive::default() {
                        self.unload_if_unused(&name);
                    }
                }
            }
            return;
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
                pinned: pin,
                reserved: false,
                idle_since: None,
                asked_keep_alive: asked,
            },
        );
        let tx = self.requests.clone();
        let params = Arc::clone(&self.params);
        let spawned = std::thread::Builder::new()
            .name("leanstream-load".into())
            .spawn(move || {
                let result = load_reserved(&file, &params, &tx).map(Arc::new);
                let name = file.name;
                let _ = tx.blocking_send(Request::Loaded { name, result });
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
                reply,
            } => {
                let r = match self.open(model, context, client) {
                    // Serve the object before answering, so the client can call it at once, and
                    // before the next request, so a departure can only find it served.
                    Ok((id, ())) => {
                        let obj = crate::service::SessionObject::new(
                            id,
                            self.requests.clone(),
                            Arc::clone(&self.params),
                        );
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
        });
        tracing::info!(
            "session {id} on {} for {client}: up to {context} tokens, {held} bytes at open",
            model.name
        );
        self.sessions.insert(
            id,
            SessionEntry {
                model: model.name.clone(),
                client,
                context: context as u32,
                busy: false,
                position: 0,
                generations: 0,
                generated_tokens: 0,
            },
        );
        Ok((id, ()))
    }

    fn unload(&mut self, name: &str) -> Result<(), LeanStreamError> {
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
        self.release(name);
        tracing::info!("model {name} unloaded");
        Ok(())
    }

    /// Forgets a loaded model. The model itself is dropped on a blocking thread (in a streaming
    /// mode the last reference joins its I/O threads, which may be finishing a read), and until
    /// it is, a placeholder reservation named `(unloading NAME #N)` holds what it held: the
    /// ledger frees the memory when the process has, so the same model loading again at once,
    /// or a cache growing, never counts on memory that is still in use.
    fn release(&mut self, name: &str) {
        for c in self.clients.values_mut() {
            c.pins.remove(name);
        }
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
            let requests = self.requests.clone();
            let model = match entry.slot {
                Slot::Ready(model) => Some(model),
                Slot::Loading(_) => None,
            };
            tokio::task::spawn_blocking(move || {
                if let Some(model) = model {
                    drop_last(model);
                }
                let _ = requests.blocking_send(Request::Released { held });
            });
        }
    }

    /// Whether model `name` is loaded, not pinned, and has no session.
    fn unused(&self, name: &str) -> bool {
        self.models.get(name).is_some_and(|m| {
            !m.pinned
                && matches!(m.slot, Slot::Ready(_))
                && !self.sessions.values().any(|s| s.model == name)
        })
    }

    /// Called when a model may have lost its last session: unloads it at once, or after its
    /// `keep_alive` of idleness (a timer asks again then), or never.
    fn unload_if_unused(&mut self, name: &str) {
        if !self.unused(name) {
            return;
        }
        let keep_alive = self.keep_alive(name);
        if keep_alive == KeepAlive::UntilLastClose {
            self.release(name);
            tracing::info!("model {name} unloaded (no sessions left)");
            return;
        }
        if let Some(m) = self.models.get_mut(name) {
            m.idle_since = Some(std::time::Instant::now());
        }
        match keep_alive {
            KeepAlive::UntilLastClose | KeepAlive::Forever => {}
            KeepAlive::Idle(after) => {
                let requests = self.requests.clone();
                let name = name.to_string();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = requests.send(Request::IdleCheck { name }).await;
                });
            }
        }
    }

    /// How long model `name` stays loaded without sessions: its configured `keep_alive`, or
    /// the longest lifetime a `LoadModelFor` asked for since it loaded, whichever is longer.
    fn keep_alive(&self, name: &str) -> KeepAlive {
        let configured = self.params.model(name).keep_alive;
        self.models
            .get(name)
            .map_or(configured, |m| configured.max(m.asked_keep_alive))
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

    /// A `keep_alive` timer ran out: unloads the model if it has been unused for that long. A
    /// session that came and went since restarted the wait (its own timer asks later).
    fn idle_check(&mut self, name: &str) {
        let KeepAlive::Idle(after) = self.keep_alive(name) else {
            return;
        };
        let idle_long_enough = self
            .models
            .get(name)
            .and_then(|m| m.idle_since)
            .is_some_and(|since| since.elapsed() >= after);
        if idle_long_enough && self.unused(name) {
            self.release(name);
            tracing::info!(
                "model {name} unloaded (idle for {}s, its keep_alive)",
                after.as_secs()
            );
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
            .remove::<crate::service::SessionObject, _>(path_of(id))
            .await
        {
            tracing::warn!("removing session object {id}: {e}");
        }
        tracing::info!("session {id} closed");
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

    /// What the memory planner reads per token for model `name` (0 when it is not loaded, or
    /// keeps every weight resident).
    fn streamed_bytes_per_token(&self, name: &str) -> u64 {
        match self.models.get(name).map(|e| &e.slot) {
            Some(Slot::Ready(m)) => m.model.plan().map_or(0, |p| p.streamed_bytes_per_token()),
            _ => 0,
        }
    }

    /// What model `name` holds by part, once it is loaded.
    fn model_parts(&self, name: &str) -> ModelParts {
        match self.models.get(name).map(|e| &e.slot) {
            Some(Slot::Ready(m)) => {
                let f = m.model.footprint();
                ModelParts {
                    weights: f.weights.image,
                    tokenizer: f.tokenizer,
                    tables: f.weights.heap,
                    ring: f.ring,
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
            rss_bytes: leanstream_engine::bench::process::rss_bytes(),
            models: f
                .models
                .iter()
                .map(|m| ModelMemory {
                    name: m.name.clone(),
                    resident_bytes: m.resident,
                    cache_bytes: m.cache,
                    cache_floor_bytes: m.cache_floor,
                    cache_wanted_bytes: m.cache_wanted,
                    // Params never change, so this is the mode the model was loaded in.
                    mode: if m.name.starts_with("(unloading ") {
                        "unloading".to_string()
                    } else {
                        self.params.model(&m.name).mode.name().to_string()
                    },
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
    requests: &mpsc::Sender<Request>,
) -> Result<LoadedModel, LoadError> {
    let footprint = Footprint::of(file, params.model(&file.name))?.on_backend(params.backend);
    let (reply, rx) = oneshot::channel();
    let gone = || LoadError::Failed("the daemon is shutting down".into());
    requests
        .blocking_send(Request::Reserve {
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
