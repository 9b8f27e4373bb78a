//! The async client: [`Client`] over the Manager interface, [`SessionHandle`] over one Session.

use std::collections::HashMap;

use zbus::proxy::CacheProperties;
use zbus::zvariant::{ObjectPath, OwnedObjectPath};

use crate::bus::Bus;
use crate::contract::{
    ChatTurn, GenerateParams, ManagerProxy, MemoryReport, ModelInfo, SessionProxy, SessionStats,
};
use crate::error::Result;
use crate::stream::TokenStream;

/// A connection to `leanstreamd`. Cheap to clone (the D-Bus connection is shared).
///
/// Sessions the client opens belong to its connection: when the connection closes (the process
/// exits), the daemon closes them and releases their memory.
#[derive(Clone, Debug)]
pub struct Client {
    manager: ManagerProxy<'static>,
}

impl Client {
    /// Connects to the bus. Does not call the daemon yet: a daemon that is not running shows up
    /// as [`crate::Error::NotRunning`] at the first call.
    pub async fn connect(bus: &Bus) -> Result<Client> {
        Client::from_connection(bus.connect().await?).await
    }

    /// Uses an existing connection (to share it with the app's other D-Bus objects).
    pub async fn from_connection(connection: zbus::Connection) -> Result<Client> {
        let manager = ManagerProxy::builder(&connection)
            .cache_properties(CacheProperties::No)
            .build()
            .await?;
        Ok(Client { manager })
    }

    /// The underlying D-Bus connection.
    pub fn connection(&self) -> &zbus::Connection {
        self.manager.inner().connection()
    }

    /// Models in the daemon's model directory.
    pub async fn list_models(&self) -> Result<Vec<ModelInfo>> {
        Ok(self.manager.list_models().await?)
    }

    /// Loads a model by name and pins it (idempotent).
    pub async fn load(&self, name: &str) -> Result<()> {
        Ok(self.manager.load_model(name).await?)
    }

    /// Loads a model by name for `keep_alive_seconds` without sessions instead of pinning it
    /// (see [`crate::contract::ManagerProxy::load_model_for`]).
    pub async fn load_for(&self, name: &str, keep_alive_seconds: i64) -> Result<()> {
        Ok(self
            .manager
            .load_model_for(name, keep_alive_seconds)
            .await?)
    }

    /// Unloads a model; `Busy` while it has sessions.
    pub async fn unload(&self, name: &str) -> Result<()> {
        Ok(self.manager.unload_model(name).await?)
    }

    /// Opens a session on `model` (loading it if needed) with room for `context_tokens` tokens;
    /// 0 means the daemon's default.
    pub async fn open_session(&self, model: &str, context_tokens: u32) -> Result<SessionHandle> {
        let path = self.manager.open_session(model, context_tokens).await?;
        SessionHandle::attach(self.connection(), path).await
    }

    /// The memory budget and how models, sessions and clients use it.
    pub async fn memory(&self) -> Result<MemoryReport> {
        Ok(self.manager.memory().await?)
    }

    /// Counters for operators since the daemon started, by name (docs/clients.md lists them).
    pub async fn counters(&self) -> Result<HashMap<String, u64>> {
        Ok(self.manager.counters().await?)
    }

    /// The daemon's version.
    pub async fn version(&self) -> Result<String> {
        Ok(self.manager.version().await?)
    }

    /// The compute backend in use: `cpu` or `cuda`.
    pub async fn backend(&self) -> Result<String> {
        Ok(self.manager.backend().await?)
    }
}

/// One session of the daemon: a model plus its own KV cache. Only the connection that opened
/// it may use it. Dropping the handle does not close the session (closing takes a call): use
/// [`SessionHandle::close`], or let the daemon close it when the connection ends.
#[derive(Clone, Debug)]
pub struct SessionHandle {
    proxy: SessionProxy<'static>,
}

impl SessionHandle {
    /// A handle on an existing session object (opened by this connection).
    pub async fn attach(connection: &zbus::Connection, path: OwnedObjectPath) -> Result<Self> {
        let proxy = SessionProxy::builder(connection)
            .path(path)?
            .cache_properties(CacheProperties::No)
            .build()
            .await?;
        Ok(SessionHandle { proxy })
    }

    /// The session's object path.
    pub fn path(&self) -> &ObjectPath<'_> {
        self.proxy.inner().path()
    }

    /// Starts generating from `prompt`; the returned stream yields tokens as the daemon makes
    /// them. One generation at a time per session (a second one is `Busy`).
    pub async fn generate(&self, prompt: &str, params: &GenerateParams) -> Result<TokenStream> {
        let fd = self.proxy.generate(prompt, params).await?;
        TokenStream::from_fd(fd.into())
    }

    /// Generates the next assistant turn of `messages`, rendered by the model's chat template.
    /// Pass the whole conversation each time.
    pub async fn generate_chat(
        &self,
        messages: &[ChatTurn],
        params: &GenerateParams,
    ) -> Result<TokenStream> {
        let fd = self.proxy.generate_chat(messages, params).await?;
        TokenStream::from_fd(fd.into())
    }

    /// Cancels the running generation, if any; its stream ends with `Cancelled`.
    pub async fn cancel(&self) -> Result<()> {
        Ok(self.proxy.cancel().await?)
    }

    /// The session's counters.
    pub async fn stats(&self) -> Result<SessionStats> {
        Ok(self.proxy.stats().await?)
    }

    /// The token ids `text` encodes to on the session's model (its length counts what a
    /// prompt costs in context).
    pub async fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.proxy.tokenize(text).await?)
    }

    /// The prompt text the model's chat template makes of `messages`.
    pub async fn apply_template(&self, messages: &[ChatTurn]) -> Result<String> {
        Ok(self.proxy.apply_template(messages).await?)
    }

    /// Closes the session and releases its memory.
    pub async fn close(self) -> Result<()> {
        Ok(self.proxy.close().await?)
    }
}
