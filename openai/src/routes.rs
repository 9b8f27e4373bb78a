//! The HTTP routes: `/health`, `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::generate::{self, Event, Generation};
use crate::identity::Identities;
use crate::listen::Peer;
use crate::request::{self, Job};
use crate::response::{self, Header, Kind, TokenChunks};

/// What every handler shares.
#[derive(Debug)]
pub struct App {
    pub identities: Identities,
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
        .with_state(app)
}

/// 200 when the daemon answers on the bus (with its version), else 503.
async fn health(State(app): State<Arc<App>>) -> Response {
    let version = tokio::time::timeout(Duration::from_secs(5), app.identities.own().version());
    match version.await {
        Ok(Ok(v)) => Json(json!({"status": "ok", "daemon_version": v})).into_response(),
        Ok(Err(e)) => ApiError::unavailable(e.to_string()).into_response(),
        Err(_) => ApiError::unavailable("the daemon did not answer within 5 s").into_response(),
    }
}

async fn list_models(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
) -> Result<Json<Value>, ApiError> {
    let client = app.identities.client_for(&peer).await?;
    let models = client.list_models().await?;
    Ok(Json(response::models(&models)))
}

async fn get_model(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let client = app.identities.client_for(&peer).await?;
    let models = client.list_models().await?;
    match models.iter().find(|m| m.name == id) {
        Some(m) => Ok(Json(response::model(m))),
        None => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::invalid_param("model", format!("the model '{id}' does not exist"))
                .with_code("model_not_found")
        }),
    }
}

async fn chat(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body.map_err(rejected).and_then(|b| request::chat(&b)) {
        Ok(job) => generate(&app, &peer, job, Kind::Chat).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body.map_err(rejected).and_then(|b| request::completion(&b)) {
        Ok(job) => generate(&app, &peer, job, Kind::Completion).await,
        Err(e) => e.into_response(),
    }
}

/// A body that could not be read (over the 2 MiB limit: 413), in OpenAI's error shape.
fn rejected(rejection: BytesRejection) -> ApiError {
    ApiError {
        status: rejection.status(),
        ..ApiError::invalid(rejection.body_text())
    }
}

/// Runs `job` for `peer`: the whole answer, or an event stream when it asked for one. Errors
/// until the generation has started get their own status; later ones end the stream (or,
/// not streamed, become the answer).
async fn generate(app: &App, peer: &Peer, job: Job, kind: Kind) -> Response {
    let started = async {
        let client = app.identities.client_for(peer).await?;
        generate::start(&client, &job).await
    };
    let generation = match started.await {
        Ok(generation) => generation,
        Err(e) => return e.into_response(),
    };
    let header = Header::new(kind, &job.model);
    if job.stream {
        let sse = Sse {
            generation,
            tokens: header.token_chunks(job.include_usage),
            header,
            include_usage: job.include_usage,
            // Chat streams open with the assistant's role; completions have no such chunk.
            first: kind == Kind::Chat,
            ended: false,
        };
        return (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
                (header::HeaderName::from_static("x-accel-buffering"), "no"),
            ],
            Body::from_stream(sse),
        )
            .into_response();
    }
    collect(generation, &header).await.into_response()
}

/// The whole answer of a non-streamed request. Dropped before the end (the HTTP client left),
/// the generation is cancelled.
async fn collect(mut generation: Generation, header: &Header) -> Result<Json<Value>, ApiError> {
    let mut text = String::new();
    while let Some(event) = generation.next_event().await {
        match event {
            Event::Token(t) => text.push_str(&t),
            Event::Done { reason, stats } => {
                return Ok(Json(header.complete(&text, &reason, &stats)));
            }
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::from(leanstream::Error::Truncated { tokens: 0 }))
}

/// The streamed answer as server-sent events: `data: {chunk}\n\n` per chunk, then
/// `data: [DONE]\n\n`; a failure after the start is one `data: {"error":...}` event, and the
/// stream ends without `[DONE]`. Dropping it (the HTTP client left) cancels the generation and
/// closes its session.
struct Sse {
    generation: Generation,
    tokens: TokenChunks,
    header: Header,
    include_usage: bool,
    first: bool,
    ended: bool,
}

fn sse_data(out: &mut Vec<u8>, value: &Value) {
    out.extend_from_slice(b"data: ");
    // Serializing a `Value` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
    out.extend_from_slice(b"\n\n");
}

impl futures_core::Stream for Sse {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let mut out = Vec::with_capacity(256);
        if this.first {
            // The opening chunk, with the assistant's role, goes out at once.
            this.first = false;
            sse_data(
                &mut out,
                &this.header.chunk(Some(""), None, this.include_usage, true),
            );
            return Poll::Ready(Some(Ok(out.into())));
        }
        let Some(event) = std::task::ready!(this.generation.poll_event(cx)) else {
            this.ended = true;
            return Poll::Ready(None);
        };
        match event {
            Event::Token(text) => {
                out.extend_from_slice(b"data: ");
                this.tokens.write(&text, &mut out);
                out.extend_from_slice(b"\n\n");
            }
            Event::Done { reason, stats } => {
                this.ended = true;
                let last = match this.header.kind {
                    Kind::Chat => this
                        .header
                        .chunk(None, Some(&reason), this.include_usage, false),
                    Kind::Completion => {
                        this.header
                            .chunk(Some(""), Some(&reason), this.include_usage, false)
                    }
                };
                sse_data(&mut out, &last);
                if this.include_usage {
                    sse_data(&mut out, &this.header.usage_chunk(&stats));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
            }
            Event::Failed(e) => {
                this.ended = true;
                sse_data(&mut out, &e.body());
            }
        }
        Poll::Ready(Some(Ok(out.into())))
    }
}
