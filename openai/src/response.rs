//! Response bodies in OpenAI's shapes: `chat.completion`, `chat.completion.chunk`,
//! `text_completion` (whole and streamed), the model list, and `usage`.

use leanstream::contract::{ModelInfo, StreamStats};
use serde_json::{Value, json};

/// Which route a response is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// What identifies one response: its id, creation time and model, shared by all its chunks.
#[derive(Clone, Debug)]
pub struct Header {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Header {
    pub fn new(kind: Kind, model: &str) -> Header {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Header {
            kind,
            id: format!(
                "{prefix}-{:016x}{:016x}",
                fastrand::u64(..),
                fastrand::u64(..)
            ),
            created,
            model: model.to_owned(),
        }
    }

    fn object(&self, streamed: bool) -> &'static str {
        match (self.kind, streamed) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, streamed: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(streamed),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// The whole answer of a non-streamed request.
    pub fn complete(&self, text: &str, reason: &str, stats: &StreamStats) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": null,
                "finish_reason": finish_reason(reason),
            }),
            Kind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish_reason(reason),
            }),
        };
        let mut body = self.envelope(false, json!([choice]));
        body["usage"] = usage(stats);
        body
    }

    /// A streamed chunk: the first (`role` only, for chat), a piece of text, or the last (with
    /// `reason`). With `include_usage`, every chunk but the usage chunk has `"usage": null`.
    pub fn chunk(
        &self,
        text: Option<&str>,
        reason: Option<&str>,
        include_usage: bool,
        first: bool,
    ) -> Value {
        let finish = reason.map(finish_reason);
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Completion => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        let mut body = self.envelope(true, json!([choice]));
        if include_usage {
            body["usage"] = Value::Null;
        }
        body
    }

    /// A writer of this response's token chunks: the JSON around the text is rendered once, so
    /// that a token costs only the escaping of its text.
    pub fn token_chunks(&self, include_usage: bool) -> TokenChunks {
        const MARK: &str = "\u{0}TOKEN\u{0}";
        let template = self
            .chunk(Some(MARK), None, include_usage, false)
            .to_string();
        let marked = serde_json::to_string(MARK).unwrap_or_default();
        let (prefix, suffix) = template
            .split_once(&marked)
            .map(|(p, s)| (p.to_owned(), s.to_owned()))
            .unwrap_or_default();
        TokenChunks { prefix, suffix }
    }

    /// The chunk `stream_options.include_usage` asks for: no choices, the usage.
    pub fn usage_chunk(&self, stats: &StreamStats) -> Value {
        let mut body = self.envelope(true, json!([]));
        body["usage"] = usage(stats);
        body
    }
}

/// Token chunks of one response, pre-rendered around the text (see [`Header::token_chunks`]).
#[derive(Clone, Debug)]
pub struct TokenChunks {
    prefix: String,
    suffix: String,
}

impl TokenChunks {
    /// Appends the chunk of `text` (its JSON, without SSE framing) to `out`.
    pub fn write(&self, text: &str, out: &mut Vec<u8>) {
        out.extend_from_slice(self.prefix.as_bytes());
        // Serializing a string into a `Vec` cannot fail.
        let _ = serde_json::to_writer(&mut *out, text);
        out.extend_from_slice(self.suffix.as_bytes());
    }
}

/// OpenAI's finish reason for the daemon's `done` reason: `stop` when the model ended or a
/// stop string matched, `length` when the token or context limit cut it.
pub fn finish_reason(reason: &str) -> &'static str {
    match reason {
        "max_tokens" | "context_full" => "length",
        _ => "stop",
    }
}

/// `usage` from the `done` event's statistics.
pub fn usage(stats: &StreamStats) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    })
}

/// One entry of `/v1/models`: OpenAI's fields, then the daemon's.
pub fn model(m: &ModelInfo) -> Value {
    json!({
        "id": m.name,
        "object": "model",
        "created": 0,
        "owned_by": "leanstream",
        "format": m.format,
        "architecture": m.architecture,
        "quantization": m.quantization,
        "file_bytes": m.file_bytes,
        "loaded": m.loaded,
    })
}

/// The `/v1/models` list.
pub fn models(list: &[ModelInfo]) -> Value {
    json!({"object": "list", "data": list.iter().map(model).collect::<Vec<_>>()})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats() -> StreamStats {
        StreamStats {
            prompt_tokens: 7,
            generated_tokens: 3,
            ..StreamStats::default()
        }
    }

    #[test]
    fn finish_reasons() {
        assert_eq!(finish_reason("eos"), "stop");
        assert_eq!(finish_reason("stop_string"), "stop");
        assert_eq!(finish_reason("max_tokens"), "length");
        assert_eq!(finish_reason("context_full"), "length");
    }

    #[test]
    fn chat_shapes() {
        let h = Header::new(Kind::Chat, "smollm2");
        assert!(h.id.starts_with("chatcmpl-"));
        let whole = h.complete("Hi", "eos", &stats());
        assert_eq!(whole["object"], "chat.completion");
        assert_eq!(whole["choices"][0]["message"]["content"], "Hi");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop");
        assert_eq!(whole["usage"]["total_tokens"], 10);
        let first = h.chunk(Some(""), None, false, true);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(
            first["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert!(first.get("usage").is_none());
        let last = h.chunk(None, Some("max_tokens"), true, false);
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last["usage"].is_null());
        let u = h.usage_chunk(&stats());
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["completion_tokens"], 3);
    }

    #[test]
    fn pre_rendered_token_chunks_equal_the_built_ones() {
        for kind in [Kind::Chat, Kind::Completion] {
            let h = Header::new(kind, "m\"odel");
            for include_usage in [false, true] {
                let chunks = h.token_chunks(include_usage);
                for text in ["Hello", " \"quoted\"\n", "é\u{1}", ""] {
                    let mut out = Vec::new();
                    chunks.write(text, &mut out);
                    let fast: Value = serde_json::from_slice(&out).expect("valid JSON");
                    assert_eq!(fast, h.chunk(Some(text), None, include_usage, false));
                }
            }
        }
    }

    #[test]
    fn completion_shapes() {
        let h = Header::new(Kind::Completion, "m");
        let whole = h.complete("abc", "max_tokens", &stats());
        assert_eq!(whole["object"], "text_completion");
        assert_eq!(whole["choices"][0]["text"], "abc");
        assert_eq!(whole["choices"][0]["finish_reason"], "length");
        let chunk = h.chunk(Some("a"), None, false, false);
        assert_eq!(chunk["object"], "text_completion");
        assert_eq!(chunk["choices"][0]["text"], "a");
        assert!(chunk["choices"][0]["finish_reason"].is_null());
    }
}
