//! A blocking client for apps without an async runtime. It runs the async client on a private
//! one-worker tokio runtime; do not call it from inside an async runtime (block_on would panic).

use std::sync::Arc;

use crate::bus::Bus;
use crate::contract::{
    ChatTurn, GenerateParams, MemoryReport, ModelInfo, SessionStats, StreamEvent,
};
use crate::error::{Error, Result};
use crate::stream::Generation;

/// Blocking counterpart of [`crate::Client`].
#[derive(Clone, Debug)]
pub struct Client {
    rt: Arc<tokio::runtime::Runtime>,
    inner: crate::Client,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("leanstream-client")
        .enable_all()
        .build()
        .map_err(Error::Runtime)
}

impl Client {
    /// Connects to the bus; see [`crate::Client::connect`].
    pub fn connect(bus: &Bus) -> Result<Client> {
        let rt = runtime()?;
        let inner = rt.block_on(crate::Client::connect(bus))?;
        Ok(Client {
            rt: Arc::new(rt),
            inner,
        })
    }

    pub fn list_models(&self) -> Result<Vec<ModelInfo>> {
        self.rt.block_on(self.inner.list_models())
    }

    pub fn load(&self, name: &str) -> Result<()> {
        self.rt.block_on(self.inner.load(name))
    }

    pub fn load_for(&self, name: &str, keep_alive_seconds: i64) -> Result<()> {
        self.rt
            .block_on(self.inner.load_for(name, keep_alive_seconds))
    }

    pub fn unload(&self, name: &str) -> Result<()> {
        self.rt.block_on(self.inner.unload(name))
    }

    /// Opens a session; `context_tokens` 0 means the daemon's default.
    pub fn open_session(&self, model: &str, context_tokens: u32) -> Result<SessionHandle> {
        let inner = self
            .rt
            .block_on(self.inner.open_session(model, context_tokens))?;
        Ok(SessionHandle {
            rt: Arc::clone(&self.rt),
            inner,
        })
    }

    pub fn memory(&self) -> Result<MemoryReport> {
        self.rt.block_on(self.inner.memory())
    }

    pub fn counters(&self) -> Result<std::collections::HashMap<String, u64>> {
        self.rt.block_on(self.inner.counters())
    }

    pub fn version(&self) -> Result<String> {
        self.rt.block_on(self.inner.version())
    }

    pub fn backend(&self) -> Result<String> {
        self.rt.block_on(self.inner.backend())
    }
}

/// Blocking counterpart of [`crate::SessionHandle`].
#[derive(Clone, Debug)]
pub struct SessionHandle {
    rt: Arc<tokio::runtime::Runtime>,
    inner: crate::SessionHandle,
}

impl SessionHandle {
    /// The session's object path, as a string.
    pub fn path(&self) -> String {
        self.inner.path().to_string()
    }

    /// Starts a generation; iterate the returned stream for its events.
    pub fn generate(&self, prompt: &str, params: &GenerateParams) -> Result<TokenStream> {
        let inner = self.rt.block_on(async {
            // The fd is registered with the reactor of the runtime that reads it.
            self.inner.generate(prompt, params).await
        })?;
        Ok(TokenStream {
            rt: Arc::clone(&self.rt),
            inner,
        })
    }

    pub fn generate_chat(
        &self,
        messages: &[ChatTurn],
        params: &GenerateParams,
    ) -> Result<TokenStream> {
        let inner = self
            .rt
            .block_on(self.inner.generate_chat(messages, params))?;
        Ok(TokenStream {
            rt: Arc::clone(&self.rt),
            inner,
        })
    }

    pub fn cancel(&self) -> Result<()> {
        self.rt.block_on(self.inner.cancel())
    }

    pub fn stats(&self) -> Result<SessionStats> {
        self.rt.block_on(self.inner.stats())
    }

    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        self.rt.block_on(self.inner.tokenize(text))
    }

    pub fn apply_template(&self, messages: &[ChatTurn]) -> Result<String> {
        self.rt.block_on(self.inner.apply_template(messages))
    }

    pub fn close(self) -> Result<()> {
        self.rt.block_on(self.inner.close())
    }
}

/// Blocking token stream: an iterator with the semantics of [`crate::TokenStream`].
#[derive(Debug)]
pub struct TokenStream {
    rt: Arc<tokio::runtime::Runtime>,
    inner: crate::TokenStream,
}

impl TokenStream {
    /// Reads to the end, calling `on_token` for each token's text as it arrives.
    pub fn finish_with(self, on_token: impl FnMut(&str)) -> Result<Generation> {
        self.rt.block_on(self.inner.finish_with(on_token))
    }

    /// Reads to the end and collects the tokens.
    pub fn finish(self) -> Result<Generation> {
        self.finish_with(|_| {})
    }
}

impl Iterator for TokenStream {
    type Item = Result<StreamEvent>;

    fn next(&mut self) -> Option<Self::Item> {
        self.rt.block_on(self.inner.next_event())
    }
}
