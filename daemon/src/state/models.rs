//! Models and their memory: loading on loader threads (requests that need a model being loaded
//! wait in its slot and are answered when it is ready), reserving a footprint before anything
//! is allocated, the neuron caches' grants, `UnloadModel`, and dropping a model in two steps.
//!
//! A loader thread first works out the model's [`Footprint`] from the file's header and asks
//! the state owner to reserve it ([`Internal::Reserve`]); it maps weights and allocates the
//! neuron cache only once that is done, so a load that does not fit is refused before it uses
//! the memory.

use std::sync::Arc;

use leanstream::contract::LeanStreamError;
use tokio::sync::oneshot;
use zbus::zvariant::OwnedObjectPath;

use super::holds::{Holds, Unload};
use super::internal::{Internal, load_reserved};
use super::{Caller, Port, State};
use crate::config::KeepAlive;
use crate::loader::{Footprint, LoadError};
use crate::models::{self, ModelFile};
use crate::request::Reply;
use crate::scheduler::LoadedModel;

/// A request waiting for its model to be loaded.
#[derive(Debug)]
pub(super) enum Waiter {
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

impl Waiter {
    fn client(&self) -> &str {
        match self {
            Waiter::Load { client, .. } | Waiter::Open { client, .. } => client,
        }
    }

    fn refuse(self, e: LeanStreamError) {
        match self {
            Waiter::Load { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Waiter::Open { reply, .. } => {
                let _ = reply.send(Err(e));
            }
        }
    }
}

#[derive(Debug)]
pub(super) enum Slot {
    Loading(Vec<Waiter>),
    Ready(Arc<LoadedModel>),
}

#[derive(Debug)]
pub(super) struct ModelEntry {
    pub slot: Slot,
    /// The users keeping it loaded beyond its sessions, and for how long.
    pub holds: Holds,
    /// Its footprint is reserved in the ledger (from [`Internal::Reserve`] until it is dropped).
    pub reserved: bool,
    /// When its last session closed, while it waits out its `keep_alive`.
    pub idle_since: Option<std::time::Instant>,
    /// When its load started.
    pub asked: std::time::Instant,
}

impl ModelEntry {
    pub fn ready(&self) -> Option<&Arc<LoadedModel>> {
        match &self.slot {
            Slot::Ready(model) => Some(model),
            Slot::Loading(_) => None,
        }
    }
}

impl<P: Port> State<P> {
    /// `LoadModel`/`LoadModelFor`: a lifetime holds memory like a pin, so it counts against the
    /// same limit until the model unloads.
    pub(super) async fn load_for(
        &mut self,
        file: ModelFile,
        client: String,
        keep_alive: KeepAlive,
        reply: Reply<()>,
    ) {
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

    /// Starts loading every model configured with `preload = true`, pinned (it stays loaded
    /// until `UnloadModel`). A model that cannot be found or loaded is logged; the daemon serves
    /// on without it.
    pub(super) async fn preload(&mut self) {
        let names: Vec<String> = (self.params.models.iter())
            .filter(|(_, p)| p.preload)
            .map(|(name, _)| name.clone())
            .collect();
        for name in names {
            let file = match models::resolve(&self.params.model_dir, &name) {
                Ok(file) => file,
                Err(e) => {
                    tracing::error!("preloading model {name}: {e}");
                    continue;
                }
            };
            let (reply, outcome) = oneshot::channel();
            let user = nix::unistd::Uid::effective().as_raw();
            let keep_alive = KeepAlive::Forever;
            let client = String::new();
            let waiter = Waiter::Load {
                client,
                user,
                keep_alive,
                reply,
            };
            self.load(file, waiter).await;
            tokio::spawn(async move {
                match outcome.await {
                    Ok(Ok(())) => tracing::info!("model {name} preloaded"),
                    Ok(Err(e)) => tracing::error!("preloading model {name}: {e}"),
                    Err(_) => {}
                }
            });
        }
    }

    /// Makes `file`'s model available to `waiter`, loading it on a loader thread if needed.
    pub(super) async fn load(&mut self, file: ModelFile, waiter: Waiter) {
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
        let entry = ModelEntry {
            slot: Slot::Loading(vec![waiter]),
            holds,
            reserved: false,
            idle_since: None,
            asked: std::time::Instant::now(),
        };
        self.models.insert(name.clone(), entry);
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
                    w.refuse(LeanStreamError::Internal(format!("loader thread: {e}")));
                }
            }
        }
    }

    /// Reserves the footprint of a model being loaded.
    pub(super) fn reserve(&mut self, name: &str, footprint: Footprint) -> Result<(), LoadError> {
        let Some(entry) = self.models.get_mut(name) else {
            return Err(LoadError::Failed(format!(
                "model {name} is no longer being loaded"
            )));
        };
        self.ledger
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

    /// Makes every loaded model's neuron cache the size the ledger grants it now: shrinks
    /// first, so that what they free is free before anything grows, then growth. Called after
    /// every change to the ledger. A model still loading holds only its floor (it is loaded
    /// with it) and is resized once loaded.
    pub(super) fn apply_cache_grants(&self) {
        let mut grants: Vec<(&Arc<LoadedModel>, u64, u64)> = Vec::new();
        for (name, entry) in &self.models {
            if let Some(model) = entry.ready()
                && let (Some(held), Some(grant)) =
                    (model.cache_held(), self.ledger.cache_bytes(name))
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

    pub(super) async fn loaded(&mut self, name: &str, result: Result<Arc<LoadedModel>, LoadError>) {
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
                let took = entry.asked.elapsed();
                tracing::info!("model {name} loaded in {:.2} s", took.as_secs_f64());
                self.counters.model_loaded(name, took);
                entry.slot = Slot::Ready(Arc::clone(&model));
                self.publish_loaded();
                // Loaded with its floor: now its cache grows to what the ledger grants.
                self.apply_cache_grants();
                for w in waiters {
                    self.serve_waiter(&model, w).await;
                }
                self.unload_if_unused(name);
            }
            Err(e) => {
                tracing::error!("loading model {name}: {e}");
                // Nothing of it is left: its reservation ends at once.
                if self.models.remove(name).is_some_and(|m| m.reserved)
                    && let Ok(ticket) = self.ledger.drop_model(name)
                {
                    self.ledger.dropped(ticket);
                }
                for w in waiters {
                    w.refuse(e.to_wire());
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
                    Ok(id) => match self.port.serve_session(id).await {
                        Ok(path) => Ok(path),
                        Err(e) => {
                            self.close(id).await;
                            Err(e)
                        }
                    },
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
        }
    }

    /// Forgets the requests of `client` waiting for a model: they will never be used.
    pub(super) fn forget_waiters(&mut self, client: &str) {
        for m in self.models.values_mut() {
            if let Slot::Loading(waiters) = &mut m.slot {
                waiters.retain(|w| w.client() != client);
            }
        }
    }

    /// `UnloadModel` from `caller`: gives up its hold ([`super::holds`]) and unloads the model
    /// when nobody else holds it. Nothing changes while the model loads or has sessions.
    pub(super) fn unload(&mut self, name: &str, caller: Caller) -> Result<(), LeanStreamError> {
        models::check_name(name)?;
        let Some(entry) = self.models.get(name) else {
            return Err(LeanStreamError::ModelNotFound(format!(
                "model {name:?} is not loaded"
            )));
        };
        if entry.ready().is_none() || self.sessions.values().any(|s| s.model == name) {
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
    /// it is, the ledger keeps what it held under a drop ticket: the memory is free in the
    /// ledger when it is free in the process, so the same model loading again at once, or a
    /// cache growing, never counts on memory that is still in use.
    pub(super) fn release(&mut self, name: &str) {
        let Some(entry) = self.models.remove(name) else {
            return;
        };
        let ticket = if entry.reserved {
            match self.ledger.drop_model(name) {
                Ok(ticket) => Some(ticket),
                Err(e) => {
                    // Cannot happen: a model is released only without sessions.
                    tracing::error!("dropping model {name} from the ledger: {e}");
                    None
                }
            }
        } else {
            None
        };
        let internal = self.internal.clone();
        let model = entry.ready().cloned();
        drop(entry);
        tokio::task::spawn_blocking(move || {
            if let Some(model) = model {
                drop_last(model);
            }
            if let Some(ticket) = ticket {
                let _ = internal.send(Internal::Dropped { ticket });
            }
        });
        self.publish_loaded();
    }

    /// Tells `ListModels` which models are loaded now.
    pub(super) fn publish_loaded(&self) {
        let ready = (self.models.iter())
            .filter(|(_, m)| m.ready().is_some())
            .map(|(name, _)| name.clone())
            .collect();
        self.loaded_names.send_replace(ready);
    }
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
