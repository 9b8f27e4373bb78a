//! The D-Bus objects: thin. Each method enters the caller's bound on calls in flight
//! ([`crate::calls`]), validates its input, sends a [`Request`] to the state owner and awaits the
//! reply (`ListModels` is answered by the [`Catalog`] instead). The caller's identity is the
//! sender's unique name from the message header (set by the bus, so it cannot be forged).

use std::sync::Arc;
use std::time::Duration;

use leanstream::contract::{
    ChatTurn, GenerateParams, LeanStreamError, MemoryReport, ModelInfo, Priority, SessionStats,
};
use leanstream_engine::chat::ChatMessage;
use tokio::sync::mpsc;
use zbus::interface;
use zbus::message::Header;
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

use crate::arbiter::SessionId;
use crate::calls::{Calls, InFlight};
use crate::catalog::Catalog;
use crate::config::{KeepAlive, Params};
use crate::models::{self, ModelFile};
use crate::request::{Request, ask};
use crate::scheduler::{GenSpec, Input};

/// Most stop strings per request, and the longest one in bytes.
const MAX_STOP_STRINGS: usize = 16;
const MAX_STOP_BYTES: usize = 256;
/// Most chat turns per request.
const MAX_TURNS: usize = 1024;
/// The longest JSON Schema, grammar or regex a request may carry (it is compiled per request).
const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// Longest deadline a request may set: a day.
const MAX_DEADLINE_MS: u32 = 24 * 3600 * 1000;

/// The caller's unique name.
fn caller(header: &Header<'_>) -> Result<String, LeanStreamError> {
    header
        .sender()
        .map(|s| s.to_string())
        .ok_or_else(|| LeanStreamError::AccessDenied("the call has no sender".into()))
}

/// What every D-Bus object of the daemon holds: the way to the state owner, the settings and
/// the bound on calls in flight.
#[derive(Clone, Debug)]
pub struct Shared {
    pub tx: mpsc::Sender<Request>,
    pub params: Arc<Params>,
    pub calls: Calls,
}

impl Shared {
    /// The caller's name, once its call has entered its bound on calls in flight.
    fn enter(&self, header: &Header<'_>) -> Result<(String, InFlight), LeanStreamError> {
        let client = caller(header)?;
        let call = self.calls.enter(&client)?;
        Ok((client, call))
    }
}

/// Resolves a model name in the model directory, off the async workers.
async fn resolve(params: &Params, name: &str) -> Result<ModelFile, LeanStreamError> {
    models::check_name(name)?;
    let dir = params.model_dir.clone();
    let name = name.to_string();
    tokio::task::spawn_blocking(move || models::resolve(&dir, &name))
        .await
        .map_err(|e| LeanStreamError::Internal(e.to_string()))?
}

/// Checks sampling and length settings against the limits; `max_tokens` 0 means the limit.
pub fn validate_params(p: &GenerateParams, params: &Params) -> Result<GenSpec, LeanStreamError> {
    let invalid = |m: String| Err(LeanStreamError::InvalidArgument(m));
    let max_tokens = match p.max_tokens as usize {
        0 => params.max_tokens,
        n if n <= params.max_tokens => n,
        n => {
            return invalid(format!(
                "max_tokens {n} is over the limit of {}",
                params.max_tokens
            ));
        }
    };
    if p.top_k > 1_000_000 {
        return invalid(format!("top_k {} is absurd", p.top_k));
    }
    if p.stop.len() > MAX_STOP_STRINGS
        || p.stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return invalid(format!(
            "stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_BYTES} bytes"
        ));
    }
    let sampler = p.sampler_config();
    sampler
        .validate()
        .map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))?;
    let grammar = p.grammar().map_err(LeanStreamError::InvalidArgument)?;
    if p.grammar.len() > MAX_GRAMMAR_BYTES {
        return invalid(format!(
            "the grammar is {} bytes; at most {MAX_GRAMMAR_BYTES}",
            p.grammar.len()
        ));
    }
    let priority = Priority::parse(&p.priority).map_err(LeanStreamError::InvalidArgument)?;
    let deadline = |ms: u32, name: &str| match ms {
        0 => Ok(None),
        ms if ms <= MAX_DEADLINE_MS => Ok(Some(Duration::from_millis(ms.into()))),
        ms => Err(LeanStreamError::InvalidArgument(format!(
            "{name} {ms} ms is over the limit of {MAX_DEADLINE_MS} ms"
        ))),
    };
    Ok(GenSpec {
        max_tokens,
        sampler,
        stop: p.stop.clone(),
        grammar: grammar.map(|(kind, text)| (kind, text.to_string())),
        priority,
        first_token_within: deadline(p.first_token_deadline_ms, "first_token_deadline_ms")?,
        within: deadline(p.deadline_ms, "deadline_ms")?,
    })
}

fn check_prompt(len: usize, params: &Params) -> Result<(), LeanStreamError> {
    if len == 0 {
        return Err(LeanStreamError::InvalidArgument(
            "the prompt is empty".into(),
        ));
    }
    if len > params.max_prompt_bytes {
        return Err(LeanStreamError::InvalidArgument(format!(
            "the prompt is {len} bytes, over the limit of {}",
            params.max_prompt_bytes
        )));
    }
    Ok(())
}

/// `io.github.leanstream.LeanStream1.Manager` at [`leanstream::contract::MANAGER_PATH`].
#[derive(Debug)]
pub struct Manager {
    pub shared: Shared,
    pub catalog: Catalog,
}

#[interface(name = "io.github.leanstream.LeanStream1.Manager")]
impl Manager {
    /// `_header`: zbus checks a call's arguments against the method's only when the method
    /// reads the message; without it, a call with extra arguments would be answered.
    #[zbus(out_args("models"))]
    async fn list_models(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<ModelInfo>, LeanStreamError> {
        let _call = self.shared.enter(&header)?;
        self.catalog.list().await
    }

    /// Loads a model and pins it for the caller's user: it stays loaded until that user (or an
    /// admin) unloads it.
    async fn load_model(
        &self,
        #[zbus(header)] header: Header<'_>,
        name: &str,
    ) -> Result<(), LeanStreamError> {
        let (client, _call) = self.shared.enter(&header)?;
        let file = resolve(&self.shared.params, name).await?;
        ask(&self.shared.tx, |reply| Request::LoadModel {
            file,
            client,
            keep_alive: KeepAlive::Forever,
            reply,
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
        let (client, _call) = self.shared.enter(&header)?;
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
    }

    /// Gives up the caller's user's hold on a model (its pin or lifetime) and unloads it when
    /// no other user holds it. `AccessDenied` when other users hold it and the caller's user
    /// does not (an admin gives up every hold).
    async fn unload_model(
        &self,
        #[zbus(header)] header: Header<'_>,
        name: &str,
    ) -> Result<(), LeanStreamError> {
        let (client, _call) = self.shared.enter(&header)?;
        models::check_name(name)?;
        let name = name.to_string();
        ask(&self.shared.tx, |reply| Request::UnloadModel {
            name,
            client,
            reply,
        })
        .await
    }

    #[zbus(out_args("session"))]
    async fn open_session(
        &self,
        #[zbus(header)] header: Header<'_>,
        model: &str,
        context_tokens: u32,
    ) -> Result<OwnedObjectPath, LeanStreamError> {
        let (client, _call) = self.shared.enter(&header)?;
        let file = resolve(&self.shared.params, model).await?;
        ask(&self.shared.tx, |reply| Request::OpenSession {
            file,
            context: context_tokens,
            client,
            reply,
        })
        .await
    }

    /// The budget and how it is used: the caller's own sessions in full, other clients as one
    /// total unless the caller may see everyone ([`crate::access`]). Replies with one struct
    /// argument (a 1-tuple: zbus would spread a bare struct's fields over as many arguments,
    /// unlike the introspected signature).
    #[zbus(out_args("report"))]
    async fn memory(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(MemoryReport,), LeanStreamError> {
        let (client, _call) = self.shared.enter(&header)?;
        let report = ask(&self.shared.tx, |reply| Request::Memory { client, reply }).await?;
        Ok((report,))
    }

    #[zbus(property)]
    fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_string()
    }

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

    async fn start(
        &self,
        header: &Header<'_>,
        input: Input,
        params: &GenerateParams,
    ) -> Result<OwnedFd, LeanStreamError> {
        let (client, _call) = self.shared.enter(header)?;
        let spec = validate_params(params, &self.shared.params)?;
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
}

#[interface(name = "io.github.leanstream.LeanStream1.Session")]
impl SessionObject {
    #[zbus(out_args("stream"))]
    async fn generate(
        &self,
        #[zbus(header)] header: Header<'_>,
        prompt: &str,
        params: GenerateParams,
    ) -> Result<OwnedFd, LeanStreamError> {
        check_prompt(prompt.len(), &self.shared.params)?;
        self.start(&header, Input::Text(prompt.to_string()), &params)
            .await
    }

    #[zbus(out_args("stream"))]
    async fn generate_chat(
        &self,
        #[zbus(header)] header: Header<'_>,
        messages: Vec<ChatTurn>,
        params: GenerateParams,
    ) -> Result<OwnedFd, LeanStreamError> {
        if messages.is_empty() || messages.len() > MAX_TURNS {
            return Err(LeanStreamError::InvalidArgument(format!(
                "a chat needs 1..={MAX_TURNS} messages"
            )));
        }
        let total: usize = messages
            .iter()
            .map(|m| m.content.len() + m.role.len())
            .sum();
        check_prompt(total, &self.shared.params)?;
        if messages
            .iter()
            .any(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool"))
        {
            return Err(LeanStreamError::InvalidArgument(
                "a message role must be system, user, assistant or tool".into(),
            ));
        }
        let messages = messages
            .into_iter()
            .map(|m| ChatMessage::new(m.role, m.content))
            .collect();
        self.start(&header, Input::Chat(messages), &params).await
    }

    async fn cancel(&self, #[zbus(header)] header: Header<'_>) -> Result<(), LeanStreamError> {
        let (client, _call) = self.shared.enter(&header)?;
        let id = self.id;
        ask(&self.shared.tx, |reply| Request::Cancel {
            id,
            client,
            reply,
        })
        .await
    }

    async fn close(&self, #[zbus(header)] header: Header<'_>) -> Result<(), LeanStreamError> {
        let (client, _call) = self.shared.enter(&header)?;
        let id = self.id;
        ask(&self.shared.tx, |reply| Request::Close {
            id,
            client,
            reply,
        })
        .await
    }

    #[zbus(out_args("stats"))]
    async fn stats(
        &self,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(SessionStats,), LeanStreamError> {
        let (client, _call) = self.shared.enter(&header)?;
        let id = self.id;
        let stats = ask(&self.shared.tx, |reply| Request::Stats {
            id,
            client,
            reply,
        })
        .await?;
        Ok((stats,))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::RawConfig;

    fn params() -> Params {
        let mut raw = RawConfig::default();
        raw.models.dir = Some(std::env::temp_dir());
        Params::validate(raw).unwrap()
    }

    #[test]
    fn absurd_sampling_settings_are_refused() {
        let p = params();
        let ok = GenerateParams::default();
        assert_eq!(validate_params(&ok, &p).unwrap().max_tokens, p.max_tokens);
        let cases: [fn(&mut GenerateParams); 12] = [
            |g| g.priority = "urgent".into(),
            |g| g.deadline_ms = u32::MAX,
            |g| g.temperature = f64::NAN,
            |g| g.temperature = -1.0,
            |g| g.temperature = 1e9,
            |g| g.top_p = 0.0,
            |g| g.top_p = f64::INFINITY,
            // Positive as an f64, zero as the f32 the sampler uses.
            |g| g.top_p = 5e-324,
            |g| g.repetition_penalty = 0.0,
            |g| g.max_tokens = u32::MAX,
            |g| g.stop = vec![String::new()],
            |g| g.top_k = u32::MAX,
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut g = ok.clone();
            f(&mut g);
            assert!(
                matches!(
                    validate_params(&g, &p),
                    Err(LeanStreamError::InvalidArgument(_))
                ),
                "case {i}"
            );
        }
        assert!(check_prompt(0, &p).is_err());
        assert!(check_prompt(p.max_prompt_bytes + 1, &p).is_err());
        assert!(check_prompt(p.max_prompt_bytes, &p).is_ok());
    }
}
