//! Request bodies of `/v1/chat/completions` and `/v1/completions`, read field by field (so that
//! an error names its field, and the many fields OpenAI SDKs send that mean nothing here are
//! ignored), into one [`Job`] for the daemon.

use leanstream::contract::{ChatTurn, GenerateParams, Priority};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A conversation, rendered by the model's chat template (`GenerateChat`).
    Chat(Vec<ChatTurn>),
    /// A raw prompt (`Generate`).
    Prompt(String),
}

/// One request, checked and translated.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub model: String,
    pub input: Input,
    pub params: GenerateParams,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with `usage` before `[DONE]`.
    pub include_usage: bool,
}

/// OpenAI's default temperature, used when a request names none.
pub const DEFAULT_TEMPERATURE: f64 = 1.0;

/// The JSON object of a request body.
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid("the request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// Field `name` as a `T`; `None` when absent or null.
fn field<T: DeserializeOwned>(map: &Map<String, Value>, name: &str) -> Result<Option<T>, ApiError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid_param(name, format!("invalid '{name}': {e}"))),
    }
}

fn required<T: DeserializeOwned>(map: &Map<String, Value>, name: &str) -> Result<T, ApiError> {
    field(map, name)?.ok_or_else(|| {
        ApiError::invalid_param(name, format!("missing required parameter: '{name}'"))
    })
}

/// A `/v1/chat/completions` body.
pub fn chat(body: &[u8]) -> Result<Job, ApiError> {
    let map = object(body)?;
    let messages: Vec<Value> = required(&map, "messages")?;
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "'messages' must hold at least one message",
        ));
    }
    let turns = messages
        .iter()
        .enumerate()
        .map(|(i, m)| turn(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    job(&map, Input::Chat(turns))
}

/// A `/v1/completions` body.
pub fn completion(body: &[u8]) -> Result<Job, ApiError> {
    let map = object(body)?;
    let prompt = match map.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => s.clone(),
            _ => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "'prompt' must be a string or a list of one string (token ids and \
                     batches are not supported)",
                ));
            }
        },
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "missing required parameter: 'prompt'",
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "'prompt' must be a string",
            ));
        }
    };
    job(&map, Input::Prompt(prompt))
}

/// One chat message: `role` and `content` (a string, a list of text parts, or null).
fn turn(i: usize, message: &Value) -> Result<ChatTurn, ApiError> {
    let param = format!("messages[{i}]");
    let bad = |what: &str| ApiError::invalid_param(&param, format!("{param}: {what}"));
    let Value::Object(m) = message else {
        return Err(bad("a message must be an object with 'role' and 'content'"));
    };
    let role = match m.get("role") {
        Some(Value::String(r)) => r.as_str(),
        _ => return Err(bad("'role' must be a string")),
    };
    // OpenAI's newer name for the system role.
    let role = if role == "developer" { "system" } else { role };
    let content = match m.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                    (Some("text"), _) => return Err(bad("a text part needs a string 'text'")),
                    (Some(other), _) => {
                        return Err(bad(&format!(
                            "content parts of type {other:?} are not supported (only text)"
                        )));
                    }
                    (None, _) => return Err(bad("a content part needs a 'type'")),
                }
            }
            texts.join("\n")
        }
        Some(_) => return Err(bad("'content' must be a string or a list of text parts")),
    };
    Ok(ChatTurn {
        role: role.to_owned(),
        content,
    })
}

/// The fields both routes share.
fn job(map: &Map<String, Value>, input: Input) -> Result<Job, ApiError> {
    let model: String = required(map, "model")?;
    if let Some(n) = field::<u64>(map, "n")?
        && n != 1
    {
        return Err(ApiError::invalid_param(
            "n",
            format!("'n' must be 1 (one choice per request), got {n}"),
        ));
    }
    let max_tokens = match field::<u32>(map, "max_completion_tokens")? {
        Some(n) => Some(("max_completion_tokens", n)),
        None => field::<u32>(map, "max_tokens")?.map(|n| ("max_tokens", n)),
    };
    if let Some((name, 0)) = max_tokens {
        return Err(ApiError::invalid_param(
            name,
            format!("'{name}' must be at least 1"),
        ));
    }
    let priority = match field::<String>(map, "priority")? {
        None => String::new(),
        Some(p) => Priority::parse(&p)
            .map_err(|e| ApiError::invalid_param("priority", e))?
            .name()
            .to_owned(),
    };
    let (grammar_kind, grammar) = response_format(map)?;
    let stream = field::<bool>(map, "stream")?.unwrap_or(false);
    let include_usage = match map.get("stream_options") {
        Some(Value::Object(o)) => field::<bool>(o, "include_usage")?.unwrap_or(false),
        None | Some(Value::Null) => false,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "stream_options",
                "'stream_options' must be an object",
            ));
        }
    };
    let params = GenerateParams {
        max_tokens: max_tokens.map_or(0, |(_, n)| n),
        temperature: field(map, "temperature")?.unwrap_or(DEFAULT_TEMPERATURE),
        top_k: field(map, "top_k")?.unwrap_or(0),
        top_p: field(map, "top_p")?.unwrap_or(1.0),
        repetition_penalty: field(map, "repetition_penalty")?.unwrap_or(1.0),
        seed: seed(map)?,
        stop: stop(map)?,
        grammar_kind,
        grammar,
        priority,
        deadline_ms: field(map, "deadline_ms")?.unwrap_or(0),
        ..GenerateParams::default()
    };
    Ok(Job {
        model,
        input,
        params,
        stream,
        include_usage,
    })
}

/// `seed`: any integer (a negative one by its two's complement); a fresh random one when
/// absent, so that sampled answers vary between requests as OpenAI's do.
fn seed(map: &Map<String, Value>) -> Result<u64, ApiError> {
    let Some(n) = field::<serde_json::Number>(map, "seed")? else {
        return Ok(fastrand::u64(..));
    };
    n.as_u64()
        .or_else(|| n.as_i64().map(|i| i as u64))
        .ok_or_else(|| ApiError::invalid_param("seed", "'seed' must be an integer"))
}

/// `stop`: a string or a list of strings.
fn stop(map: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    match map.get("stop") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(v @ Value::Array(_)) => serde_json::from_value(v.clone()).map_err(|_| {
            ApiError::invalid_param("stop", "'stop' must be a string or a list of strings")
        }),
        Some(_) => Err(ApiError::invalid_param(
            "stop",
            "'stop' must be a string or a list of strings",
        )),
    }
}

/// `response_format` as the daemon's grammar kind and grammar: `json_schema` with the given
/// schema, `json_object` as the schema `{"type":"object"}`, `text` (or none) unconstrained.
fn response_format(map: &Map<String, Value>) -> Result<(String, String), ApiError> {
    let Some(format) = map.get("response_format").filter(|v| !v.is_null()) else {
        return Ok((String::new(), String::new()));
    };
    let bad = |param: &str, what: &str| ApiError::invalid_param(param, what.to_owned());
    let kind = format
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("response_format", "'response_format' needs a string 'type'"))?;
    let schema = match kind {
        "text" => return Ok((String::new(), String::new())),
        "json_object" => serde_json::json!({"type": "object"}),
        "json_schema" => match format.get("json_schema").and_then(|j| j.get("schema")) {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => schema.clone(),
            _ => {
                return Err(bad(
                    "response_format.json_schema.schema",
                    "'response_format' of type json_schema needs 'json_schema.schema', a JSON \
                     Schema object",
                ));
            }
        },
        other => {
            return Err(bad(
                "response_format.type",
                &format!(
                    "'response_format.type' {other:?} is not one of text, json_object, json_schema"
                ),
            ));
        }
    };
    Ok(("json_schema".to_owned(), schema.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat_of(v: Value) -> Result<Job, ApiError> {
        chat(v.to_string().as_bytes())
    }

    #[test]
    fn a_full_chat_request_translates() {
        let job = chat_of(json!({
            "model": "smollm2",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": null, "tool_calls": []}
            ],
            "max_completion_tokens": 9, "max_tokens": 3, "temperature": 0, "top_p": 0.5,
            "seed": -1, "stop": "\n", "stream": true, "stream_options": {"include_usage": true},
            "priority": "background", "deadline_ms": 1500, "n": 1,
            "logprobs": false, "user": "someone", "frequency_penalty": 0
        }))
        .expect("valid");
        assert_eq!(job.model, "smollm2");
        let Input::Chat(turns) = &job.input else {
            panic!("not a chat")
        };
        assert_eq!(turns[0].role, "system");
        assert_eq!(turns[1].content, "Hi\nthere");
        assert_eq!(turns[2].content, "");
        assert_eq!(job.params.max_tokens, 9);
        assert_eq!(job.params.temperature, 0.0);
        assert_eq!(job.params.top_p, 0.5);
        assert_eq!(job.params.seed, u64::MAX);
        assert_eq!(job.params.stop, vec!["\n".to_string()]);
        assert_eq!(job.params.priority, "background");
        assert_eq!(job.params.deadline_ms, 1500);
        assert!(job.stream && job.include_usage);
    }

    #[test]
    fn response_formats_become_json_schemas() {
        let base = |rf: Value| {
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "response_format": rf})
        };
        let schema = json!({"type": "object", "required": ["a"]});
        let job = chat_of(base(
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
        ))
        .expect("valid");
        assert_eq!(job.params.grammar_kind, "json_schema");
        assert_eq!(
            serde_json::from_str::<Value>(&job.params.grammar).expect("json"),
            schema
        );
        let job = chat_of(base(json!({"type": "json_object"}))).expect("valid");
        assert_eq!(job.params.grammar, r#"{"type":"object"}"#);
        let job = chat_of(base(json!({"type": "text"}))).expect("valid");
        assert_eq!(job.params.grammar_kind, "");
        for bad in [
            json!({"type": "json_schema"}),
            json!({"type": "xml"}),
            json!("json"),
        ] {
            let e = chat_of(base(bad.clone())).expect_err("invalid");
            assert_eq!(e.status.as_u16(), 400, "{bad}");
            assert!(
                e.param
                    .as_deref()
                    .is_some_and(|p| p.starts_with("response_format"))
            );
        }
    }

    #[test]
    fn bad_requests_name_their_field() {
        let cases = [
            (
                json!({"messages": [{"role": "user", "content": "x"}]}),
                "model",
            ),
            (json!({"model": "m"}), "messages"),
            (json!({"model": "m", "messages": []}), "messages"),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": 5}]}),
                "messages[0]",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content":
                    [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
                "messages[0]",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}),
                "n",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "priority": "urgent"}),
                "priority",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "stop": [1]}),
                "stop",
            ),
        ];
        for (body, param) in cases {
            let e = chat_of(body.clone()).expect_err("invalid");
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
        assert!(chat(b"{not json").is_err());
        assert!(chat(b"[1]").is_err());
    }

    #[test]
    fn completion_prompts() {
        let job = completion(br#"{"model":"m","prompt":["Once"]}"#).expect("valid");
        assert_eq!(job.input, Input::Prompt("Once".into()));
        assert_eq!(job.params.temperature, DEFAULT_TEMPERATURE);
        for bad in [
            r#"{"model":"m"}"#,
            r#"{"model":"m","prompt":["a","b"]}"#,
            r#"{"model":"m","prompt":[1,2]}"#,
        ] {
            let e = completion(bad.as_bytes()).expect_err(bad);
            assert_eq!(e.param.as_deref(), Some("prompt"));
        }
    }
}
