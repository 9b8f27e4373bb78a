//! What the D-Bus objects ask of the state owner: [`Request`]s over a bounded channel, each with
//! a oneshot for its reply ([`ask`]). Its own module, so that the bus face and the state owner
//! both depend on it and not on each other.

use std::sync::Arc;

use leanstream::contract::{LeanStreamError, MemoryReport, SessionStats};
use tokio::sync::{mpsc, oneshot};
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

use crate::arbiter::SessionId;
use crate::config::KeepAlive;
use crate::models::ModelFile;
use crate::scheduler::{GenSpec, Input, LoadedModel};

/// Where a request's answer goes.
pub type Reply<T> = oneshot::Sender<Result<T, LeanStreamError>>;

/// Requests to the state owner.
#[derive(Debug)]
pub enum Request {
    /// Loads a model and holds it for the caller's user: `Forever` pins it (`LoadModel`), `Idle`
    /// gives it at least that lifetime without sessions, counted from now (`LoadModelFor`).
    LoadModel {
        file: ModelFile,
        client: String,
        keep_alive: KeepAlive,
        reply: Reply<()>,
    },
    /// Gives up the caller's hold on a model, and unloads it when nobody else holds it.
    UnloadModel {
        name: String,
        client: String,
        reply: Reply<()>,
    },
    OpenSession {
        file: ModelFile,
        context: u32,
        client: String,
        reply: Reply<OwnedObjectPath>,
    },
    /// The memory report as `client` may see it.
    Memory {
        client: String,
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
    /// The model of session `id`, for work on it outside the state owner (tokenising).
    Model {
        id: SessionId,
        client: String,
        reply: Reply<Arc<LoadedModel>>,
    },
    /// Answered once the state owner and both scheduler threads have taken it: the daemon is
    /// alive (the systemd watchdog's check).
    Ping { reply: Reply<()> },
    /// Cancel everything, stop the scheduler, then reply.
    Shutdown { reply: oneshot::Sender<()> },
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
