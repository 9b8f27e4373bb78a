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
    ClientMemory, LeanStreamError, MemoryReport, ModelInfo, ModelMemory, SESSION_PATH_PREFIX,
    SessionMemory, SessionStats,
};
use leanstream_engine::forward::kv_cache_bytes;
use tokio::sync::{mpsc, oneshot};
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

use crate::config::Params;
use crate::engine::{EngineCmd, EngineEvent, GenSpec, Input, LoadedModel};
use crate::loader::{Footprint, LoadError};
use crate::memory::{Memory, SessionId};
use crate::models::{self, ModelFile};

type Reply<T> = oneshot::Sender<Result<T, LeanStreamError>>;

/// Requests to the state owner.
#[derive(Debug)]
pub enum Request {
    ListModels {
        reply: Reply<Vec<ModelInfo>>,
    },
    LoadModel {
        file: ModelFile,
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
    /// A unique bus name disappeared.
    ClientGone {
        client: String,
    },
    /// Internal: a loader thread asks to reserve its model's memory before it loads.
    Reserve {
        name: String,
        footprint: Footprint,
        reply: oneshot::Sender<Result<(), LoadError>>,
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

#[derive(Debug)]
enum Waiter {
    Load(Reply<()>),
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

/// The state owner.
pub struct State<M> {
    params: Arc<Params>,
    memory: M,
    conn: zbus::Connection,
    requests: mpsc::Sender<Request>,
    engine: std::sync::mpsc::Sender<EngineCmd>,
    models: BTreeMap<String, ModelEntry>,
    sessions: BTreeMap<SessionId, SessionEntry>,
    next_id: SessionId,
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

/// Bytes a session holds: its KV cache plus the per-token scratch of `Session`.
pub fn session_bytes(model: &LoadedModel, context: usize, threads: usize) -> u64 {
    let c = &model.model.weights.config;
    let floats = 2 * c.d_model
        + 2 * c.q_dim()
        + 2 * c.kv_dim()
        + c.n_heads * context
        + c.d_model
        + 2 * c.n_ff
        + threads * c.d_model
        + c.vocab_size
        + c.head_dim / 2;
    let acts = c.d_model.max(c.n_ff).max(c.q_dim()) * 2;
    (kv_cache_bytes(&model.model.weights, context) + floats * 4 + acts) as u64
}

/// Threads of the rayon pool (the engine keeps one partial sum per thread).
fn compute_threads(params: &Params) -> usize {
    match params.compute_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

impl<M: Memory> State<M> {
    pub fn new(
        params: Arc<Params>,
        memory: M,
        conn: zbus::Connection,
        requests: mpsc::Sender<Request>,
        engine: std::sync::mpsc::Sender<EngineCmd>,
    ) -> State<M> {
        State {
            params,
            memory,
            conn,
            requests,
            engine,
            models: BTreeMap::new(),
            sessions: BTreeMap::new(),
            next_id: 1,
        }
    }

    /// Serves requests until `Shutdown` (or every sender is gone).
    pub async fn run(
        mut self,
        mut rx: mpsc::Receiver<Request>,
        mut events: mpsc::UnboundedReceiver<EngineEvent>,
    ) {
        loop {
            // Engine events first: the engine reports a generation's end before the caller can
            // see it (EOF or an error reply), so a caller's next request never finds the session
            // still marked busy.
            tokio::select! {
                biased;
                Some(ev) = events.recv() => self.engine_event(ev),
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

    async fn shutdown(&mut self) {
        let _ = self.engine.send(EngineCmd::Shutdown);
        for id in std::mem::take(&mut self.sessions).into_keys() {
            self.memory.close_session(id);
            let _ = self
                .conn
                .object_server()
                .remove::<crate::service::SessionObject, _>(path_of(id))
                .await;
        }
    }

    fn engine_event(&mut self, ev: EngineEvent) {
        let EngineEvent::Finished {
            id,
            accepted,
            generated,
            position,
        } = ev;
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
            Request::LoadModel { file, reply } => self.load(file, Waiter::Load(reply), true),
            Request::UnloadModel { name, reply } => {
                let _ = reply.send(self.unload(&name));
            }
            Request::OpenSession {
                file,
                context,
                client,
                reply,
            } => {
                if let Err(e) = self.check_session_room() {
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
                    false,
                );
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
                    let _ = self.engine.send(EngineCmd::Cancel { id });
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
            Request::ClientGone { client } => self.client_gone(&client).await,
            Request::Reserve {
                name,
                footprint,
                reply,
            } => {
                let _ = reply.send(self.reserve(&name, footprint));
            }
            Request::Loaded { name, result } => self.loaded(&name, result).await,
            Request::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    async fn list_models(&self) -> Result<Vec<ModelInfo>, LeanStreamError> {
        let dir = self.params.model_dir.clone();
        let files = tokio::task::spawn_blocking(move || models::list(&dir))
            .await
            .map_err(|e| LeanStreamError::Internal(e.to_string()))?
            .map_err(|e| LeanStreamError::Internal(format!("reading the model directory: {e}")))?;
        Ok(files
            .into_iter()
            .map(|f| ModelInfo {
                loaded: matches!(
                    self.models.get(&f.name).map(|m| &m.slot),
                    Some(Slot::Ready(_))
                ),
                name: f.name,
                format: f.format.to_string(),
                file_bytes: f.bytes,
            })
            .collect())
    }

    fn check_session_room(&self) -> Result<(), LeanStreamError> {
        let pending: usize = self
            .models
            .values()
            .map(|m| match &m.slot {
                Slot::Loading(w) => w
                    .iter()
                    .filter(|w| matches!(w, Waiter::Open { .. }))
                    .count(),
                Slot::Ready(_) => 0,
            })
            .sum();
        if self.sessions.len() + pending >= self.params.max_sessions {
            return Err(LeanStreamError::Busy(format!(
                "the daemon already has its maximum of {} sessions",
                self.params.max_sessions
            )));
        }
        Ok(())
    }

    /// Makes `file`'s model available to `waiter`, loading it on a loader thread if needed.
    fn load(&mut self, file: ModelFile, waiter: Waiter, pin: bool) {
        let name = file.name.clone();
        if let Some(entry) = self.models.get_mut(&name) {
            entry.pinned |= pin;
            match &mut entry.slot {
                Slot::Loading(waiters) => waiters.push(waiter),
                Slot::Ready(model) => {
                    let model = Arc::clone(model);
                    self.serve_waiter(&model, waiter);
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
            .load_model(name, footprint.resident_bytes, footprint.cache_bytes)
            .map_err(|e| LoadError::OverBudget(e.to_string()))?;
        entry.reserved = true;
        Ok(())
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
                for w in waiters {
                    self.serve_waiter(&model, w);
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

    fn serve_waiter(&mut self, model: &Arc<LoadedModel>, waiter: Waiter) {
        match waiter {
            Waiter::Load(reply) => {
                let _ = reply.send(Ok(()));
            }
            Waiter::Open {
                context,
                client,
                reply,
            } => {
                let r = self.open(model, context, client);
                if let Ok((id, _)) = &r {
                    // Serve the object before answering, so the client can call it at once.
                    let conn = self.conn.clone();
                    let obj = crate::service::SessionObject::new(
                        *id,
                        self.requests.clone(),
                        Arc::clone(&self.params),
                    );
                    let path = path_of(*id);
                    tokio::spawn(async move {
                        let r = match conn.object_server().at(path.clone(), obj).await {
                            Ok(_) => Ok(path),
                            Err(e) => Err(LeanStreamError::Internal(e.to_string())),
                        };
                        let _ = reply.send(r);
                    });
                } else if let Err(e) = r {
                    let _ = reply.send(Err(e));
                }
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
        let bytes = session_bytes(model, context, compute_threads(&self.params));
        self.memory
            .open_session(id, &model.name, &client, bytes)
            .map_err(|e| LeanStreamError::OverBudget(e.to_string()))?;
        let session = match model.open_session(context, self.params.precision) {
            Ok(s) => s,
            Err(e) => {
                self.memory.close_session(id);
                return Err(LeanStreamError::Internal(e.to_string()));
            }
        };
        self.next_id += 1;
        let _ = self.engine.send(EngineCmd::Open {
            id,
            model: Arc::clone(model),
            session,
        });
        tracing::info!(
            "session {id} on {} for {client}: {context} tokens, {bytes} bytes",
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

    /// Forgets a loaded model and its memory. The model itself is dropped on a blocking thread:
    /// in a streaming mode the last reference joins its I/O threads, which may be finishing a
    /// read. (The scheduler may still hold a reference for a moment; it then drops it there.)
    fn release(&mut self, name: &str) {
        if let Some(entry) = self.models.remove(name) {
            self.memory.unload_model(name);
            if let Slot::Ready(model) = entry.slot {
                tokio::task::spawn_blocking(move || drop(model));
            }
        }
    }

    /// Unloads a model loaded only for sessions once none is left.
    fn unload_if_unused(&mut self, name: &str) {
        let unused = self.models.get(name).is_some_and(|m| {
            !m.pinned
                && matches!(m.slot, Slot::Ready(_))
                && !self.sessions.values().any(|s| s.model == name)
        });
        if unused {
            self.release(name);
            tracing::info!("model {name} unloaded (no sessions left)");
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
        let sent = self.engine.send(EngineCmd::Generate {
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
        let _ = self.engine.send(EngineCmd::Close { id });
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
        // Waiting opens of this client will never be used.
        for m in self.models.values_mut() {
            if let Slot::Loading(waiters) = &mut m.slot {
                waiters.retain(|w| !matches!(w, Waiter::Open { client: c, .. } if c == client));
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
            models: f
                .models
                .iter()
                .map(|(name, resident, cache)| ModelMemory {
                    name: name.clone(),
                    resident_bytes: *resident,
                    cache_bytes: *cache,
                    // Params never change, so this is the mode the model was loaded in.
                    mode: self.params.model(name).mode.name().to_string(),
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
    LoadedModel::load(file, params, footprint.cache_bytes)
}

fn reply_err(waiter: Waiter, e: LeanStreamError) {
    match waiter {
        Waiter::Load(reply) => {
            let _ = reply.send(Err(e));
        }
        Waiter::Open { reply, .. } => {
            let _ = reply.send(Err(e));
        }
    }
}
