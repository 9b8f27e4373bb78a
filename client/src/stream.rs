//! The token stream of one generation: the pipe fd `Generate` returns, read as JSON lines of
//! [`StreamEvent`] (see [`crate::contract`]).

use std::fmt;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader, Lines};

use crate::contract::{StreamEvent, StreamStats};
use crate::error::{Error, Result, stream_error};

type Reader = Pin<Box<dyn AsyncRead + Send>>;

/// An async stream of the events of one generation, ending after `done`.
///
/// Yields `Ok(StreamEvent::Token)` for each token, then `Ok(StreamEvent::Done)`, then `None`.
/// An `error` event is yielded as `Err(Error::Daemon(..))` (e.g. `Cancelled`); EOF before `done`
/// as `Err(Error::Truncated)`; a malformed line as `Err(Error::Protocol)`. After any error the
/// stream yields `None`. Dropping it closes the fd, which cancels the generation in the daemon.
///
/// Implements [`futures_core::Stream`]; [`TokenStream::next_event`] and [`TokenStream::finish`]
/// need no futures helpers.
pub struct TokenStream {
    lines: Lines<BufReader<Reader>>,
    tokens: usize,
    ended: bool,
}

impl fmt::Debug for TokenStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenStream")
            .field("tokens", &self.tokens)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

/// A finished generation.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Generation {
    /// Generated token ids, in order.
    pub ids: Vec<u32>,
    /// The generated text (the concatenated token texts).
    pub text: String,
    /// The text cut at sentence and phrase ends, with the `sentences` option (else empty).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sentences: Vec<String>,
    /// Why it stopped: `eos`, `max_tokens`, `stop_string` or `context_full`.
    pub reason: String,
    pub stats: StreamStats,
}

impl TokenStream {
    /// Reads the stream from the fd `Generate` returned. Must be called inside a tokio runtime
    /// with I/O enabled. A pipe is read through tokio's pipe reactor; any other stream fd (a
    /// socket) through a Unix stream.
    pub fn from_fd(fd: OwnedFd) -> Result<TokenStream> {
        use std::os::unix::fs::FileTypeExt;
        let file = std::fs::File::from(fd);
        let kind = file.metadata().map_err(Error::StreamIo)?.file_type();
        let reader: Reader = if kind.is_fifo() {
            Box::pin(tokio::net::unix::pipe::Receiver::from_file(file).map_err(Error::StreamIo)?)
        } else if kind.is_socket() {
            let socket = std::os::unix::net::UnixStream::from(OwnedFd::from(file));
            socket.set_nonblocking(true).map_err(Error::StreamIo)?;
            Box::pin(tokio::net::UnixStream::from_std(socket).map_err(Error::StreamIo)?)
        } else {
            return Err(Error::StreamIo(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the token-stream fd is neither a pipe nor a socket",
            )));
        };
        Ok(TokenStream::with_reader(reader))
    }

    /// Reads the stream from any byte source (tests, or a transport other than a pipe).
    pub fn from_reader(reader: impl AsyncRead + Send + 'static) -> TokenStream {
        TokenStream::with_reader(Box::pin(reader))
    }

    fn with_reader(reader: Reader) -> TokenStream {
        TokenStream {
            lines: BufReader::new(reader).lines(),
            tokens: 0,
            ended: false,
        }
    }

    /// The next event, `None` after `done` or an error.
    pub async fn next_event(&mut self) -> Option<Result<StreamEvent>> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    /// Reads to the end and collects the tokens; calls `on_token(text)` for each token as it
    /// arrives (to stream it to a terminal). Fails on the first error.
    pub async fn finish_with(mut self, mut on_token: impl FnMut(&str)) -> Result<Generation> {
        let mut generation = Generation::default();
        while let Some(event) = self.next_event().await {
            match event? {
                StreamEvent::Token { id, text } => {
                    on_token(&text);
                    generation.ids.push(id);
                    generation.text.push_str(&text);
                }
                StreamEvent::Sentence { text } => generation.sentences.push(text),
                StreamEvent::Done { reason, stats } => {
                    generation.reason = reason;
                    generation.stats = stats;
                    return Ok(generation);
                }
                // `poll_event` turns error events into `Err`.
                StreamEvent::Error { name, message } => {
                    return Err(Error::Daemon(stream_error(&name, &message)));
                }
            }
        }
        // `poll_event` yields `Truncated` before `None` unless `done` came.
        Err(Error::Truncated {
            tokens: generation.ids.len(),
        })
    }

    /// Reads to the end and collects the tokens.
    pub async fn finish(self) -> Result<Generation> {
        self.finish_with(|_| {}).await
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<StreamEvent>>> {
        while !self.ended {
            let line = match ready!(Pin::new(&mut self.lines).poll_next_line(cx)) {
                Ok(Some(line)) => line,
                Ok(None) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(Error::Truncated {
                        tokens: self.tokens,
                    })));
                }
                Err(e) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(Error::StreamIo(e))));
                }
            };
            if let Some(event) = self.decode(&line) {
                return Poll::Ready(Some(event));
            }
        }
        Poll::Ready(None)
    }

    /// One line to one item; `None` for a blank line.
    fn decode(&mut self, line: &str) -> Option<Result<StreamEvent>> {
        if line.trim().is_empty() {
            return None;
        }
        let event = match serde_json::from_str::<StreamEvent>(line) {
            Ok(event) => event,
            Err(source) => {
                self.ended = true;
                return Some(Err(Error::Protocol {
                    line: line.to_owned(),
                    source,
                }));
            }
        };
        Some(match event {
            StreamEvent::Token { .. } => {
                self.tokens += 1;
                Ok(event)
            }
            StreamEvent::Sentence { .. } => Ok(event),
            StreamEvent::Done { .. } => {
                self.ended = true;
                Ok(event)
            }
            StreamEvent::Error { name, message } => {
                self.ended = true;
                Err(Error::Daemon(stream_error(&name, &message)))
            }
        })
    }
}

impl futures_core::Stream for TokenStream {
    type Item = Result<StreamEvent>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_event(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::contract::LeanStreamError;

    const DONE: &str = r#"{"done":{"reason":"eos","stats":{"prompt_tokens":3,"generated_tokens":2,"time_to_first_token_s":0.1,"prefill_tokens_per_s":30.0,"decode_tokens_per_s":20.0}}}"#;

    fn stream_of(bytes: &str) -> TokenStream {
        TokenStream::from_reader(std::io::Cursor::new(bytes.as_bytes().to_vec()))
    }

    #[tokio::test]
    async fn collects_tokens_until_done() {
        let text = format!(
            "{{\"token\":{{\"id\":7,\"text\":\"Hel\"}}}}\n\n{{\"token\":{{\"id\":8,\"text\":\"lo é\"}}}}\n{DONE}\n"
        );
        let generation = stream_of(&text).finish().await.expect("a complete stream");
        assert_eq!(generation.ids, vec![7, 8]);
        assert_eq!(generation.text, "Hello é");
        assert_eq!(generation.reason, "eos");
        assert_eq!(generation.stats.generated_tokens, 2);
    }

    #[tokio::test]
    async fn ends_after_done_even_if_bytes_follow() {
        let mut s = stream_of(&format!("{DONE}\ngarbage\n"));
        assert!(matches!(
            s.next_event().await,
            Some(Ok(StreamEvent::Done { .. }))
        ));
        assert!(s.next_event().await.is_none());
    }

    #[tokio::test]
    async fn partial_lines_wait_for_their_newline() {
        let (mut tx, rx) = tokio::io::duplex(4096);
        let mut s = TokenStream::from_reader(rx);
        // Split inside the JSON and inside the two-byte UTF-8 character 'é' (0xC3 0xA9).
        let line = "{\"token\":{\"id\":1,\"text\":\"é\"}}\n".as_bytes();
        let cut = line
            .iter()
            .position(|&b| b == 0xC3)
            .expect("é is in the line")
            + 1;
        tx.write_all(&line[..cut]).await.expect("write");
        let pending = std::future::poll_fn(|cx| Poll::Ready(s.poll_event(cx).is_pending())).await;
        assert!(pending, "an event came out of half a line");
        tx.write_all(&line[cut..]).await.expect("write");
        match s.next_event().await {
            Some(Ok(StreamEvent::Token { id: 1, text })) => assert_eq!(text, "é"),
            other => panic!("expected the token, got {other:?}"),
        }
        tx.write_all(DONE.as_bytes()).await.expect("write");
        tx.write_all(b"\n").await.expect("write");
        drop(tx);
        assert!(matches!(
            s.next_event().await,
            Some(Ok(StreamEvent::Done { .. }))
        ));
        assert!(s.next_event().await.is_none());
    }

    #[tokio::test]
    async fn a_final_line_without_newline_still_counts() {
        let generation = stream_of(DONE)
            .finish()
            .await
            .expect("done without newline");
        assert_eq!(generation.reason, "eos");
    }

    #[tokio::test]
    async fn error_event_is_a_typed_error() {
        let text = "{\"token\":{\"id\":1,\"text\":\"a\"}}\n{\"error\":{\"name\":\"Cancelled\",\"message\":\"client asked\"}}\n";
        let mut s = stream_of(text);
        assert!(matches!(
            s.next_event().await,
            Some(Ok(StreamEvent::Token { .. }))
        ));
        match s.next_event().await {
            Some(Err(Error::Daemon(LeanStreamError::Cancelled(m)))) => {
                assert_eq!(m, "client asked")
            }
            other => panic!("expected Cancelled, got {other:?}"),
        }
        assert!(s.next_event().await.is_none());
        match stream_of(text).finish().await {
            Err(Error::Daemon(LeanStreamError::Cancelled(_))) => {}
            other => panic!("expected Cancelled, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn eof_without_done_is_truncated() {
        let text = "{\"token\":{\"id\":1,\"text\":\"a\"}}\n{\"token\":{\"id\":2,\"text\":\"b\"}}\n";
        let mut s = stream_of(text);
        s.next_event().await;
        s.next_event().await;
        assert!(matches!(
            s.next_event().await,
            Some(Err(Error::Truncated { tokens: 2 }))
        ));
        assert!(s.next_event().await.is_none());
        assert!(matches!(
            stream_of("").finish().await,
            Err(Error::Truncated { tokens: 0 })
        ));
    }

    #[tokio::test]
    async fn malformed_line_is_a_protocol_error() {
        for bad in [
            "{\"token\":{\"id\":-1,\"text\":\"a\"}}\n",
            "not json\n",
            "{\"tok\":{}}\n",
        ] {
            match stream_of(bad).finish().await {
                Err(Error::Protocol { line, .. }) => assert_eq!(line, bad.trim_end()),
                other => panic!("{bad:?}: expected a protocol error, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn invalid_utf8_is_an_io_error_not_a_panic() {
        let s = TokenStream::from_reader(std::io::Cursor::new(b"\xff\xfe\n".to_vec()));
        assert!(matches!(s.finish().await, Err(Error::StreamIo(_))));
    }

    #[tokio::test]
    async fn reads_a_real_pipe_fd() {
        let (rx, mut tx) = std::io::pipe().expect("pipe");
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            tx.write_all(b"{\"token\":{\"id\":5,\"text\":\"x\"}}\n")?;
            tx.write_all(DONE.as_bytes())
        });
        let s = TokenStream::from_fd(OwnedFd::from(rx)).expect("a pipe fd");
        let generation = s.finish().await.expect("complete");
        assert_eq!(generation.ids, vec![5]);
        writer.join().expect("writer thread").expect("writes");
    }
}
