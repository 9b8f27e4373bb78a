//! Messages from the daemon's own threads (loaders, the scheduler, model drops) to the state
//! owner, and the two ways they are sent: [`Budget`], the scheduler's blocking round trip to
//! the ledger, and [`load_reserved`], a loader thread's.

use std::sync::Arc;

use leanstream::contract::LeanStreamError;
use tokio::sync::{mpsc, oneshot};

use crate::arbiter::{DropTicket, SessionId};
use crate::config::Params;
use crate::loader::{Footprint, LoadError};
use crate::models::ModelFile;
use crate::scheduler::{LoadedModel, SessionBudget};

/// What the daemon's own threads tell or ask the state owner. They travel on their own
/// unbounded channel, served before client requests, so that a flood of D-Bus calls never
/// delays a KV reservation the scheduler waits on. Each sender waits for its reply or sends
/// once per event, so the channel holds a handful at most.
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
    /// A model being dropped has handed its memory back ([`crate::arbiter::Arbiter::dropped`]).
    Dropped { ticket: DropTicket },
    /// A model load finished.
    Loaded {
        name: String,
        result: Result<Arc<LoadedModel>, LoadError>,
    },
}

/// The scheduler's way to the ledger: a blocking round trip to the state owner.
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

impl SessionBudget for Budget {
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

/// On a loader thread: works out the footprint of `file`, has the state owner reserve it, then
/// loads the model.
pub fn load_reserved(
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
