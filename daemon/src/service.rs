//! The D-Bus objects: thin. Each method is served through [`Shared::serve`], which enters the
//! caller's bound on calls in flight ([`crate::calls`]) and counts the call and its refusal
//! ([`Counters`]); it validates its input, sends a [`Request`] to the state owner and awaits the
//! reply (`ListModels` is answered by the [`Catalog`] instead, `Counters` by the counters). The caller's identity is the
//! sender's unique name from the message header (set by the bus, so it cannot be forged).

use std::collections::HashMap;
use std::sync::Arc;

use leanstream::contract::{
    ChatTurn, GenerateParams, LeanStreamError, MemoryReport, ModelInfo, SessionStats,
};
use tokio::sync::mpsc;
use zbus::interface;
use zbus::message::Header;
use zbus::zvariant::{OwnedFd, OwnedObjectPath, OwnedValue};

use crate::arbiter::SessionId;
use crate::calls::{Calls, InFlight};
use crate::catalog::Catalog;
use crate::checks::{chat_messages, check_prompt, validate_params};
use crate::config::{KeepAlive, Params};
use crate::counters::Counters;
use crate::models::{self, ModelFile};
use crate::request::{Request, ask};
use crate::scheduler::{Input, LoadedModel, prompt_ids};

/// The caller's unique name.
fn caller(header: &Header<'_>) -> Result<String, LeanStreamError> {
    header
        .sender()
        .map(|s| s.to_string())
        .ok_or_else(|| LeanStreamError::AccessDenied("the call has no sender".into()))
}

/// What every D-Bus object of the daemon holds: the way to the state owner, the settings, the
/// bound on calls in flight and the operators' counters.
#[derive(Clone, Debug)]
pub struct Shared {
    pub tx: mpsc::Sender<Request>,
    pub params: Arc<Params>,
    pub calls: Calls,
    pub counters: Counters,
}

impl Shared {
    /// The caller's name, once its call has entered its bound on calls in flight.
    fn enter(&self, header: &Header<'_>) -> Result<(String, InFlight), LeanStreamError> {
        let client = caller(header)?;
        let call = self.calls.enter(&client)?;
        Ok((client, call))
    }

    /// Serves one call: `work(caller)` runs once the call has entered the caller's bound on
    /// calls in flight, and stays in it until done; the call, and its error if any, is counted
    /// under the method's name.
    async fn serve<T, F>(
        &self,
        header: &Header<'_>,
        work: impl FnOnce(String) -> F,
    ) -> Result<T, LeanStreamError>
    where
        F: Future<Output = Result<T, LeanStreamError>>,
    {
        let result = match self.enter(header) {
            Ok((client, _call)) => work(client).await,
            Err(e) => Err(e),
        };
        let method = header.member().map_or("", |m| m.as_str());
        self.counters.call(method, result.as_ref().err());
        result
    }
}

/// Generation options as they arrive: an `a{sv}` dictionary (`GenerateParams::from_options`).
type Options = HashMap<String, OwnedValue>;

/// Resolves a model name in the model directory, off the async workers.
async fn resolve(params: &Params, name: &str) -> Result<ModelFile, LeanStreamError> {
    models::check_name(name)?;
    let dir = params.model_dir.clone();
    let name = name.to_string();
    tokio::task::spawn_blocking(move || models::resolve(&dir, &name))
        .await
        .map_err(|e| LeanStreamError::Internal(e.to_string()))?
}

/// `io.github.leanstream.LeanStream1.Manager` at [`leanstream::contract::MANAGER_PATH`].
#[derive(Debug)]
pub struct Manager {
    pub shared: Shared,
    pub catalog: Catalog,
}

#[interface(name = "io.github.leanstream.LeanStream1.Manager")]
impl Manager {
    /// The models in the daemon's model directory: name, format (lsm or gguf), architecture,
    /// quantization, file bytes, and whether it is loaded.
    // `_header`: zbus checks a call's arguments against the method's only when the method
    // reads the message; without it, a call with extra arguments would be answered.
    #[zbus(out_args("models"))]
    async fn list_models(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<ModelInfo>, LeanStreamError> {
        self.shared.serve(&header, |_| self.catalog.list()).await
    }

    /// Loads a model and pins it for the caller's user: it stays loaded until that user (or an
    /// admin) unloads it.
    async fn load_model(
        &self,
        #[zbus(header)] header: Header<'_>,
        name: &str,
    ) -> Result<(), LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let file = resolve(&self.shared.params, name).await?;
                ask(&self.shared.tx, |reply| Request::LoadModel {
                    file,
                    client,
                    keep_alive: KeepAlive::Forever,
                    reply,
                })
                .await
            })
            .await
    }

    /// Loads a model with a lifetime instead of a pin: it stays loaded while it has sessions
    /// and `keep_alive_seconds` after the last one closes (or after this call, when it has
    /// none), or longer if its configuration says so; `-1` pins it as `LoadModel` does.
    async fn load_model_for(
        &self,
        #[zbus(header)] header: Header<'_>,
        name: &str,
        keep_alive_seconds: i64,
    ) -> Result<(), LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let keep_alive = match KeepAlive::from_seconds(keep_alive_seconds) {
                    Ok(KeepAlive::UntilLastClose) => {
                        return Err(LeanStreamError::InvalidArgument(
                            "keep_alive_seconds 0 would unload the model at once: \
                             open a session instead"
                                .into(),
                        ));
                    }
                    Ok(k) => k,
                    Err(reason) => return Err(LeanStreamError::InvalidArgument(reason)),
                };
                let file = resolve(&self.shared.params, name).await?;
                ask(&self.shared.tx, |reply| Request::LoadModel {
                    file,
                    client,
                    keep_alive,
                    reply,
                })
                .await
            })
            .await
    }

    /// Gives up the caller's user's hold on a model (its pin or lifetime) and unloads it when
    /// no other user holds it. `AccessDenied` when other users hold it and the caller's user
    /// does not (an admin gives up every hold).
    async fn unload_model(
        &self,
        #[zbus(header)] header: Header<'_>,
        name: &str,
    ) -> Result<(), LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                models::check_name(name)?;
                let name = name.to_string();
                ask(&self.shared.tx, |reply| Request::UnloadModel {
                    name,
                    client,
                    reply,
                })
                .await
            })
            .await
    }

    /// Opens a session on a model, loading the model if needed, with room for
    /// `context_tokens` tokens (0: the daemon's default). Only the calling connection may use
    /// the returned object.
    #[zbus(out_args("session"))]
    async fn open_session(
        &self,
        #[zbus(header)] header: Header<'_>,
        model: &str,
        context_tokens: u32,
    ) -> Result<OwnedObjectPath, LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let file = resolve(&self.shared.params, model).await?;
                ask(&self.shared.tx, |reply| Request::OpenSession {
                    file,
                    context: context_tokens,
                    client,
                    reply,
                })
                .await
            })
            .await
    }

    /// The budget and how it is used: the caller's own sessions in full, and other clients as
    /// one total unless the caller is root, the daemon's user or in the admin group.
    // Replies with one struct argument (a 1-tuple: zbus would spread a bare struct's fields
    // over as many arguments, unlike the introspected signature). Redacted by the state owner
    // (`crate::access`).
    #[zbus(out_args("report"))]
    async fn memory(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(MemoryReport,), LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let report =
                    ask(&self.shared.tx, |reply| Request::Memory { client, reply }).await?;
                Ok((report,))
            })
            .await
    }

    /// Counters for operators since the daemon started, by name: calls per method, refusals per
    /// error, generations per class and how they ended, prompt and generated tokens, time to
    /// first token per class, model loads and their durations (`leanstreamd` docs list them).
    #[zbus(out_args("counters"))]
    async fn counters(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<HashMap<String, u64>, LeanStreamError> {
        self.shared
            .serve(&header, async |_| Ok(self.shared.counters.snapshot()))
            .await
    }

    /// The daemon's version.
    #[zbus(property)]
    fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_string()
    }

    /// Where it computes: `cpu` or `cuda`.
    #[zbus(property)]
    fn backend(&self) -> String {
        self.shared.params.backend.name().to_string()
    }
}

/// `io.github.leanstream.LeanStream1.Session`, one object per session.
#[derive(Debug)]
pub struct SessionObject {
    id: SessionId,
    shared: Shared,
}

impl SessionObject {
    pub fn new(id: SessionId, shared: Shared) -> SessionObject {
        SessionObject { id, shared }
    }

    /// Starts a generation of `input` for `client` with `options`.
    async fn start(
        &self,
        client: String,
        input: Input,
        options: &Options,
    ) -> Result<OwnedFd, LeanStreamError> {
        let params =
            GenerateParams::from_options(options).map_err(LeanStreamError::InvalidArgument)?;
        let spec = validate_params(&params, &self.shared.params)?;
        let id = self.id;
        ask(&self.shared.tx, |reply| Request::Generate {
            id,
            client,
            input,
            spec,
            reply,
        })
        .await
    }

    /// The session's model, for `client` if it owns the session.
    async fn model(&self, client: String) -> Result<Arc<LoadedModel>, LeanStreamError> {
        let id = self.id;
        ask(&self.shared.tx, |reply| Request::Model {
            id,
            client,
            reply,
        })
        .await
    }
}

/// Runs `work` (tokenising, rendering a template) on a blocking thread, off the async workers.
async fn off_workers<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, LeanStreamError> + Send + 'static,
) -> Result<T, LeanStreamError> {
    (tokio::task::spawn_blocking(work).await)
        .map_err(|e| LeanStreamError::Internal(e.to_string()))?
}

#[interface(name = "io.github.leanstream.LeanStream1.Session")]
impl SessionObject {
    /// Generates from `prompt` (special tokens written in it are recognised) with `options`
    /// (an a{sv} dictionary: max_tokens u, temperature d, top_k u, top_p d,
    /// repetition_penalty d, seed t, stop as, json_schema s or lark s or regex s, priority s,
    /// first_token_deadline_ms u, deadline_ms u, sentences b). Returns the read end of the token
    /// stream: one JSON event per line, ending with done or error.
    #[zbus(out_args("stream"))]
    async fn generate(
        &self,
        #[zbus(header)] header: Header<'_>,
        prompt: &str,
        options: Options,
    ) -> Result<OwnedFd, LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                check_prompt(prompt.len(), &self.shared.params)?;
                (self.start(client, Input::Text(prompt.to_string()), &options)).await
            })
            .await
    }

    /// Continues a conversation: `messages` are (role, content) pairs, role system, user,
    /// assistant or tool, rendered with the model's chat template. Options and stream as
    /// Generate.
    #[zbus(out_args("stream"))]
    async fn generate_chat(
        &self,
        #[zbus(header)] header: Header<'_>,
        messages: Vec<ChatTurn>,
        options: Options,
    ) -> Result<OwnedFd, LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let messages = chat_messages(messages, &self.shared.params)?;
                self.start(client, Input::Chat(messages), &options).await
            })
            .await
    }

    /// The token ids `text` encodes to on the session's model, as `Generate` would encode it
    /// (special tokens written in it are recognised).
    #[zbus(out_args("ids"))]
    async fn tokenize(
        &self,
        #[zbus(header)] header: Header<'_>,
        text: &str,
    ) -> Result<Vec<u32>, LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                check_prompt(text.len(), &self.shared.params)?;
                let input = Input::Text(text.to_string());
                let model = self.model(client).await?;
                off_workers(move || prompt_ids(&model, input)).await
            })
            .await
    }

    /// The prompt text `GenerateChat` would run for `messages`: the model's chat template
    /// applied, with the assistant's turn opened.
    #[zbus(out_args("prompt"))]
    async fn apply_template(
        &self,
        #[zbus(header)] header: Header<'_>,
        messages: Vec<ChatTurn>,
    ) -> Result<String, LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let messages = chat_messages(messages, &self.shared.params)?;
                let model = self.model(client).await?;
                off_workers(move || {
                    (model.template.render(&messages, true))
                        .map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))
                })
                .await
            })
            .await
    }

    /// Cancels the session's generation: its stream ends with a Cancelled error.
    async fn cancel(&self, #[zbus(header)] header: Header<'_>) -> Result<(), LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let id = self.id;
                ask(&self.shared.tx, |reply| Request::Cancel {
                    id,
                    client,
                    reply,
                })
                .await
            })
            .await
    }

    /// Closes the session and frees its memory.
    async fn close(&self, #[zbus(header)] header: Header<'_>) -> Result<(), LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let id = self.id;
                ask(&self.shared.tx, |reply| Request::Close {
                    id,
                    client,
                    reply,
                })
                .await
            })
            .await
    }

    /// What the session has done: model, context tokens, position, generations, generated
    /// tokens, decode passes, draft tokens verified and draft tokens accepted.
    #[zbus(out_args("stats"))]
    async fn stats(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(SessionStats,), LeanStreamError> {
        self.shared
            .serve(&header, async |client| {
                let id = self.id;
                let stats = ask(&self.shared.tx, |reply| Request::Stats {
                    id,
                    client,
                    reply,
                })
                .await?;
                Ok((stats,))
            })
            .await
    }
}
