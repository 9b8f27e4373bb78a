//! A minimal HTTP/1 client (hyper's) for the endpoint over TCP or a Unix socket, and the
//! daemon-side checks the tests make (shared with the bench example).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use leanstream_e2e::{Bus, MODEL};
use serde_json::Value;
use tokio::task::JoinHandle;

/// Where the endpoint listens.
#[derive(Clone, Debug)]
pub enum Target {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// A response whose body is still coming; dropping it closes the connection.
pub struct Response {
    pub status: u16,
    pub content_type: String,
    body: Incoming,
    conn: JoinHandle<()>,
}

impl Drop for Response {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl Response {
    /// The next piece of the body, `None` at its end.
    pub async fn next_bytes(&mut self) -> Result<Option<Bytes>> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// The whole body as JSON.
    pub async fn json(mut self) -> Result<Value> {
        let mut all = Vec::new();
        while let Some(b) = self.next_bytes().await? {
            all.extend_from_slice(&b);
        }
        serde_json::from_slice(&all)
            .with_context(|| format!("not JSON: {:?}", String::from_utf8_lossy(&all)))
    }

    /// Reads server-sent events until the body ends: the `data:` payloads, in order.
    pub async fn sse(mut self) -> Result<Vec<String>> {
        let mut reader = SseReader::default();
        let mut events = Vec::new();
        while let Some(b) = self.next_bytes().await? {
            events.extend(reader.push(&b)?);
        }
        if !reader.pending.is_empty() {
            bail!(
                "the event stream ended inside an event: {:?}",
                reader.pending
            );
        }
        Ok(events)
    }
}

/// Splits a byte stream into the `data:` payloads of server-sent events.
#[derive(Default)]
pub struct SseReader {
    pending: String,
}

impl SseReader {
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>> {
        self.pending.push_str(std::str::from_utf8(bytes)?);
        let mut out = Vec::new();
        while let Some(end) = self.pending.find("\n\n") {
            let event: String = self.pending.drain(..end + 2).collect();
            let data = event
                .trim_end()
                .strip_prefix("data: ")
                .with_context(|| format!("an event that is not `data: `: {event:?}"))?;
            out.push(data.to_owned());
        }
        Ok(out)
    }
}

/// Sends one request on a new connection over `io`.
pub async fn send_on<I>(io: I, method: &str, path: &str, body: Option<&Value>) -> Result<Response>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost");
    let payload = match body {
        Some(v) => {
            request = request.header("content-type", "application/json");
            Bytes::from(serde_json::to_vec(v)?)
        }
        None => Bytes::new(),
    };
    let response = sender
        .send_request(request.body(Full::new(payload))?)
        .await?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    Ok(Response {
        status,
        content_type,
        body: response.into_body(),
        conn,
    })
}

/// Sends one request to `target` on a new connection.
pub async fn send(
    target: &Target,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Response> {
    match target {
        Target::Tcp(addr) => {
            let io = tokio::net::TcpStream::connect(addr).await?;
            io.set_nodelay(true)?;
            send_on(io, method, path, body).await
        }
        Target::Unix(path_) => {
            let io = tokio::net::UnixStream::connect(path_).await?;
            send_on(io, method, path, body).await
        }
    }
}

/// `POST path` with a JSON body; the status and the JSON answer.
pub async fn post(target: &Target, path: &str, body: &Value) -> Result<(u16, Value)> {
    let response = send(target, "POST", path, Some(body)).await?;
    let status = response.status;
    Ok((status, response.json().await?))
}

/// `GET path`; the status and the JSON answer.
pub async fn get(target: &Target, path: &str) -> Result<(u16, Value)> {
    let response = send(target, "GET", path, None).await?;
    let status = response.status;
    Ok((status, response.json().await?))
}

/// A streamed request's chunks (parsed) and whether it ended with `[DONE]`.
pub async fn post_stream(target: &Target, path: &str, body: &Value) -> Result<(Vec<Value>, bool)> {
    let response = send(target, "POST", path, Some(body)).await?;
    if response.status != 200 {
        let status = response.status;
        bail!("status {status}: {}", response.json().await?);
    }
    if !response.content_type.starts_with("text/event-stream") {
        bail!("content type {:?}", response.content_type);
    }
    let events = response.sse().await?;
    let done = events.last().is_some_and(|e| e == "[DONE]");
    let chunks = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).with_context(|| format!("chunk {e:?}")))
        .collect::<Result<Vec<Value>>>()?;
    Ok((chunks, done))
}

/// The concatenated `delta.content` of chat chunks.
pub fn chat_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// The daemon's sessions now, as root sees them (every client's, unredacted).
pub async fn daemon_sessions(bus: &Bus) -> Result<Vec<leanstream::contract::SessionMemory>> {
    let client =
        leanstream::Client::connect(&leanstream::Bus::Address(bus.address.clone())).await?;
    Ok(client.memory().await?.sessions)
}

/// Waits until the daemon has no session (at most `limit`).
pub async fn no_sessions_within(bus: &Bus, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let sessions = daemon_sessions(bus).await?;
        if sessions.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("sessions still open after {limit:?}: {sessions:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A chat request body for the test model.
pub fn chat_body(content: &str, max_tokens: u32) -> Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}
