//! One generation's life: open a daemon session, start the generation, hand its events to the
//! HTTP side, close the session.
//!
//! The HTTP side polls the daemon's token stream itself (no task or channel in between: a token
//! costs one wake-up of the endpoint, which matters on a small machine whose cores the daemon's
//! compute threads keep busy). The session belongs to a guard that closes it however the
//! request ends — the stream done or failed, or the HTTP client gone, which drops the response
//! body or the handler, and with it the guard: it then cancels the generation (dropping the
//! stream's fd stops it too) and closes the session, in a task of its own.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use leanstream::contract::{LeanStreamError, StreamEvent, StreamStats};
use leanstream::{Client, SessionHandle, TokenStream};

use crate::error::ApiError;
use crate::request::{Input, Job};

/// What the HTTP side receives.
#[derive(Debug)]
pub enum Event {
    /// A token's text (never empty: pieces of a split UTF-8 character are skipped).
    Token(String),
    /// The end: the daemon's reason and statistics.
    Done { reason: String, stats: StreamStats },
    /// The generation failed after it started.
    Failed(ApiError),
}

/// A daemon session that closes when dropped: cancelled first unless its generation ended.
#[derive(Debug)]
struct SessionGuard {
    session: Option<SessionHandle>,
    ended: bool,
}

impl SessionGuard {
    /// Closes the session now, in a task of its own (cancelling its generation first unless it
    /// ended).
    fn release(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let cancel = !self.ended;
        let closing = async move {
            if cancel && let Err(e) = session.cancel().await {
                tracing::debug!("cancelling {}: {e}", session.path());
            }
            let path = session.path().to_string();
            match session.close().await {
                Ok(()) => tracing::debug!("closed {path}"),
                Err(e) => tracing::warn!("closing {path}: {e}"),
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(closing);
            }
            // No runtime (the endpoint is exiting): its bus connections close with it, and
            // the daemon closes their sessions.
            Err(_) => tracing::debug!("no runtime to close a session on"),
        }
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// A running generation: its events, then `None`. Dropping it before the end cancels the
/// generation; either way its session is closed.
#[derive(Debug)]
pub struct Generation {
    // Field order is drop order: the stream's fd closes before the session is closed.
    stream: TokenStream,
    guard: SessionGuard,
}

/// Opens a session on `job.model` and starts the generation. Errors before the first event
/// (unknown model, a refused argument, limits) come back here, while an HTTP status can still
/// say so.
pub async fn start(client: &Client, job: &Job) -> Result<Generation, ApiError> {
    let session = client.open_session(&job.model, 0).await?;
    // Guarded from here: should the request go away during the call below, the guard closes it.
    let mut guard = SessionGuard {
        session: Some(session.clone()),
        ended: false,
    };
    let started = match &job.input {
        Input::Chat(turns) => session.generate_chat(turns, &job.params).await,
        Input::Prompt(prompt) => session.generate(prompt, &job.params).await,
    };
    match started {
        Ok(stream) => Ok(Generation { stream, guard }),
        Err(e) => {
            // Nothing runs: close without cancelling.
            guard.ended = true;
            Err(e.into())
        }
    }
}

impl Generation {
    /// The next event; `None` after `Done` or `Failed`.
    pub fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        loop {
            if self.guard.ended {
                return Poll::Ready(None);
            }
            let polled = ready!(futures_core::Stream::poll_next(
                Pin::new(&mut self.stream),
                cx
            ));
            let event = match polled {
                Some(Ok(StreamEvent::Token { text, .. })) if text.is_empty() => continue,
                Some(Ok(StreamEvent::Token { text, .. })) => {
                    return Poll::Ready(Some(Event::Token(text)));
                }
                Some(Ok(StreamEvent::Done { reason, stats })) => Event::Done { reason, stats },
                // `TokenStream` yields error events as `Err`; this is for completeness.
                Some(Ok(StreamEvent::Error { name, message })) => {
                    Event::Failed(ApiError::from(leanstream::Error::Daemon(
                        LeanStreamError::Internal(format!("{name}: {message}")),
                    )))
                }
                Some(Err(e)) => Event::Failed(e.into()),
                // Events this endpoint does not ask for (sentence marks).
                Some(Ok(_)) => continue,
                // The stream yields `Truncated` before it ends without `done`.
                None => Event::Failed(ApiError::from(leanstream::Error::Truncated { tokens: 0 })),
            };
            // The generation is over: close its session now, not when the response is dropped.
            self.guard.ended = true;
            self.guard.release();
            return Poll::Ready(Some(event));
        }
    }

    /// The next event; `None` after `Done` or `Failed`.
    pub async fn next_event(&mut self) -> Option<Event> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }
}
