//! The endpoint against the real daemon and model: the routes' answers, streamed and not,
//! compared with what the Rust client library gets from the daemon directly.

mod common;

use anyhow::Result;
use common::*;
use leanstream::contract::{ChatTurn, GenerateParams};
use serde_json::{Value, json};

const PROMPT: &str = "Tell me a short story about a robot.";

/// What the client library gets for the same greedy chat, straight from the daemon.
async fn direct_chat(bus: &Bus, content: &str, max_tokens: u32) -> Result<leanstream::Generation> {
    let client =
        leanstream::Client::connect(&leanstream::Bus::Address(bus.address.clone())).await?;
    let session = client.open_session(MODEL, 0).await?;
    let turns = [ChatTurn {
        role: "user".into(),
        content: content.into(),
    }];
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    let generation = session
        .generate_chat(&turns, &params)
        .await?
        .finish()
        .await?;
    session.close().await?;
    Ok(generation)
}

async fn direct_completion(
    bus: &Bus,
    prompt: &str,
    max_tokens: u32,
) -> Result<leanstream::Generation> {
    let client =
        leanstream::Client::connect(&leanstream::Bus::Address(bus.address.clone())).await?;
    let session = client.open_session(MODEL, 0).await?;
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    let generation = session.generate(prompt, &params).await?.finish().await?;
    session.close().await?;
    Ok(generation)
}

fn usage_of(v: &Value) -> (u64, u64, u64) {
    let u = &v["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap_or(u64::MAX),
        u["completion_tokens"].as_u64().unwrap_or(u64::MAX),
        u["total_tokens"].as_u64().unwrap_or(u64::MAX),
    )
}

#[test]
fn chat_and_completions_streamed_and_whole_agree_with_the_daemon() -> Result<()> {
    let bus = Bus::start()?;
    let rt = runtime();
    let cfg = DaemonConfig {
        max_tokens: 128,
        ..DaemonConfig::default()
    };
    let _daemon = rt.block_on(Daemon::start(&bus, &cfg))?;
    let endpoint = Endpoint::tcp(&bus)?;
    let t = &endpoint.target;
    rt.block_on(async {
        let (status, health) = get(t, "/health").await?;
        assert_eq!(
            (status, health["status"].as_str()),
            (200, Some("ok")),
            "{health}"
        );

        // Models, from ListModels.
        let (status, models) = get(t, "/v1/models").await?;
        assert_eq!(status, 200, "{models}");
        assert_eq!(models["object"], "list");
        let ids: Vec<&str> = models["data"]
            .as_array()
            .map(|d| d.iter().filter_map(|m| m["id"].as_str()).collect())
            .unwrap_or_default();
        assert!(ids.contains(&MODEL), "{models}");
        let (status, one) = get(t, &format!("/v1/models/{MODEL}")).await?;
        assert_eq!((status, one["id"].as_str()), (200, Some(MODEL)), "{one}");
        assert_eq!(one["object"], "model");
        let (status, none) = get(t, "/v1/models/no-such-model").await?;
        assert_eq!(status, 404, "{none}");
        assert_eq!(none["error"]["code"], "model_not_found");

        // A whole greedy chat: the daemon's own greedy answer, with its token counts.
        let direct = direct_chat(&bus, PROMPT, 40).await?;
        let (status, whole) = post(t, "/v1/chat/completions", &chat_body(PROMPT, 40)).await?;
        assert_eq!(status, 200, "{whole}");
        assert_eq!(whole["object"], "chat.completion");
        assert_eq!(whole["model"], MODEL);
        assert!(
            whole["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("chatcmpl-"))
        );
        let choice = &whole["choices"][0];
        assert_eq!(choice["message"]["role"], "assistant");
        let text = choice["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(!text.is_empty());
        assert_eq!(
            text, direct.text,
            "the endpoint's greedy chat differs from the daemon's"
        );
        let expected_finish = if direct.reason == "max_tokens" {
            "length"
        } else {
            "stop"
        };
        assert_eq!(choice["finish_reason"], expected_finish);
        let (prompt_tokens, completion_tokens, total) = usage_of(&whole);
        assert_eq!(completion_tokens, direct.ids.len() as u64);
        assert_eq!(prompt_tokens, direct.stats.prompt_tokens as u64);
        assert_eq!(total, prompt_tokens + completion_tokens);

        // The same chat streamed: the chunks concatenate to the same text.
        let mut body = chat_body(PROMPT, 40);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (chunks, done) = post_stream(t, "/v1/chat/completions", &body).await?;
        assert!(done, "no [DONE] at the end");
        assert_eq!(chat_text(&chunks), text);
        let id = chunks[0]["id"].clone();
        for c in &chunks {
            assert_eq!(c["object"], "chat.completion.chunk", "{c}");
            assert_eq!(c["id"], id, "every chunk carries the response's id");
        }
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        // The last chunk with a choice has the finish reason; the usage chunk has no choice.
        let (usage_chunk, with_choices) = chunks.split_last().expect("chunks");
        assert_eq!(usage_chunk["choices"], json!([]));
        assert_eq!(usage_of(usage_chunk), usage_of(&whole));
        let (last, tokens) = with_choices.split_last().expect("a last chunk");
        assert_eq!(last["choices"][0]["finish_reason"], expected_finish);
        for c in tokens {
            assert!(c["choices"][0]["finish_reason"].is_null(), "{c}");
            assert!(
                c["usage"].is_null(),
                "include_usage: usage is null until the end"
            );
        }

        // Without include_usage: no usage chunk, no usage keys.
        body["stream_options"] = Value::Null;
        let (chunks, done) = post_stream(t, "/v1/chat/completions", &body).await?;
        assert!(done);
        assert_eq!(chat_text(&chunks), text);
        assert!(chunks.iter().all(|c| c.get("usage").is_none()));

        // max_tokens cuts it: finish_reason length; max_completion_tokens wins over max_tokens.
        let mut short = chat_body(PROMPT, 40);
        short["max_completion_tokens"] = json!(4);
        let (status, cut) = post(t, "/v1/chat/completions", &short).await?;
        assert_eq!(status, 200, "{cut}");
        assert_eq!(cut["choices"][0]["finish_reason"], "length");
        assert_eq!(usage_of(&cut).1, 4);
        assert!(
            text.starts_with(
                cut["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or("?")
            )
        );

        // A stop string from the middle of the greedy answer ends it there: finish_reason stop.
        let words: Vec<&str> = text.split_whitespace().collect();
        let stop_word = words[words.len() / 2];
        let mut stopped = chat_body(PROMPT, 40);
        stopped["stop"] = json!([stop_word]);
        let (status, s) = post(t, "/v1/chat/completions", &stopped).await?;
        assert_eq!(status, 200, "{s}");
        assert_eq!(s["choices"][0]["finish_reason"], "stop", "{s}");
        let s_text = s["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default();
        assert!(s_text.len() < text.len(), "{s_text:?} vs {text:?}");
        assert!(
            text.starts_with(s_text.trim_end_matches(stop_word)),
            "{s_text:?}"
        );

        // Content given as text parts is joined.
        let parts = json!({"model": MODEL, "temperature": 0, "max_tokens": 40, "messages": [
            {"role": "user", "content": [{"type": "text", "text": PROMPT}]}]});
        let (status, p) = post(t, "/v1/chat/completions", &parts).await?;
        assert_eq!(status, 200, "{p}");
        assert_eq!(p["choices"][0]["message"]["content"], text.as_str());

        // Text completion, whole and streamed, against the daemon's Generate.
        let prompt = leanstream_e2e::STORY_PROMPT;
        let direct = direct_completion(&bus, prompt, 16).await?;
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0});
        let (status, whole) = post(t, "/v1/completions", &body).await?;
        assert_eq!(status, 200, "{whole}");
        assert_eq!(whole["object"], "text_completion");
        assert_eq!(whole["choices"][0]["text"], direct.text.as_str());
        assert_eq!(whole["choices"][0]["finish_reason"], "length");
        assert_eq!(usage_of(&whole).1, 16);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (chunks, done) = post_stream(t, "/v1/completions", &streamed).await?;
        assert!(done);
        let joined: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(joined, direct.text);
        assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
        assert_eq!(
            chunks
                .last()
                .map(|c| c["choices"][0]["finish_reason"].clone()),
            Some(json!("length"))
        );
        Ok(())
    })
}

#[test]
fn response_format_constrains_the_answer_to_the_schema() -> Result<()> {
    let bus = Bus::start()?;
    let rt = runtime();
    let cfg = DaemonConfig {
        max_tokens: 128,
        ..DaemonConfig::default()
    };
    let _daemon = rt.block_on(Daemon::start(&bus, &cfg))?;
    let endpoint = Endpoint::tcp(&bus)?;
    let t = &endpoint.target;
    rt.block_on(async {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 150}
            },
            "required": ["name", "age"],
            "additionalProperties": false
        });
        let mut body = chat_body("Give me a person as JSON with a name and an age.", 128);
        body["response_format"] =
            json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema}});
        let (status, whole) = post(t, "/v1/chat/completions", &body).await?;
        assert_eq!(status, 200, "{whole}");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
        let content = whole["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("");
        let person: Value = serde_json::from_str(content)?;
        assert!(person["name"].is_string(), "{person}");
        assert!(person["age"].is_u64(), "{person}");
        assert_eq!(person.as_object().map(|o| o.len()), Some(2), "{person}");

        // Streamed, the chunks join to the same JSON.
        body["stream"] = json!(true);
        let (chunks, done) = post_stream(t, "/v1/chat/completions", &body).await?;
        assert!(done);
        assert_eq!(chat_text(&chunks), content);

        // json_object: some JSON object.
        let mut body = chat_body("Describe a cat as JSON.", 128);
        body["response_format"] = json!({"type": "json_object"});
        let (status, whole) = post(t, "/v1/chat/completions", &body).await?;
        assert_eq!(status, 200, "{whole}");
        if whole["choices"][0]["finish_reason"] == "stop" {
            let content = whole["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or("");
            let value: Value = serde_json::from_str(content)?;
            assert!(value.is_object(), "{value}");
        } else {
            // Cut by max_tokens: still the start of an object.
            let content = whole["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or("");
            assert!(content.trim_start().starts_with('{'), "{content:?}");
        }
        Ok(())
    })
}

#[test]
fn bad_requests_get_openai_shaped_errors() -> Result<()> {
    let bus = Bus::start()?;
    let rt = runtime();
    let _daemon = rt.block_on(Daemon::start(&bus, &DaemonConfig::default()))?;
    let endpoint = Endpoint::tcp(&bus)?;
    let t = &endpoint.target;
    rt.block_on(async {
        let check =
            |(status, body): (u16, Value), want: u16, param: Option<&str>, code: Option<&str>| {
                assert_eq!(status, want, "{body}");
                let e = &body["error"];
                assert!(
                    e["message"].as_str().is_some_and(|m| !m.is_empty()),
                    "{body}"
                );
                assert!(e["type"].is_string(), "{body}");
                assert!(
                    e.get("param").is_some() && e.get("code").is_some(),
                    "{body}"
                );
                if let Some(p) = param {
                    assert_eq!(e["param"], p, "{body}");
                }
                if let Some(c) = code {
                    assert_eq!(e["code"], c, "{body}");
                }
                if want == 400 {
                    assert_eq!(e["type"], "invalid_request_error", "{body}");
                }
            };
        // Not JSON.
        let response = send(t, "POST", "/v1/chat/completions", None).await?;
        let status = response.status;
        check((status, response.json().await?), 400, None, None);
        // Missing or invalid fields.
        let r = post(t, "/v1/chat/completions", &json!({"model": MODEL})).await?;
        check(r, 400, Some("messages"), None);
        let mut n2 = chat_body("Hi", 4);
        n2["n"] = json!(2);
        check(
            post(t, "/v1/chat/completions", &n2).await?,
            400,
            Some("n"),
            None,
        );
        let mut hot = chat_body("Hi", 4);
        hot["temperature"] = json!("hot");
        check(
            post(t, "/v1/chat/completions", &hot).await?,
            400,
            Some("temperature"),
            None,
        );
        let r = post(
            t,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": [1, 2]}),
        )
        .await?;
        check(r, 400, Some("prompt"), None);
        // Refused by the daemon (InvalidArgument): temperature out of its range.
        let mut cold = chat_body("Hi", 4);
        cold["temperature"] = json!(-1);
        check(
            post(t, "/v1/chat/completions", &cold).await?,
            400,
            None,
            Some("invalid_argument"),
        );
        // An unknown model, streamed or not: 404 before any event.
        let mut unknown = chat_body("Hi", 4);
        unknown["model"] = json!("no-such-model");
        let r = post(t, "/v1/chat/completions", &unknown).await?;
        check(r, 404, Some("model"), Some("model_not_found"));
        unknown["stream"] = json!(true);
        let r = post(t, "/v1/chat/completions", &unknown).await?;
        check(r, 404, Some("model"), Some("model_not_found"));
        // Over the body limit: 413, in the same shape.
        let big = json!({"model": MODEL, "prompt": "x".repeat(3 << 20)});
        check(post(t, "/v1/completions", &big).await?, 413, None, None);
        // No such route.
        check(
            get(t, "/v1/embeddings").await?,
            404,
            None,
            Some("unknown_url"),
        );
        // Nothing was left open.
        no_sessions_within(&bus, std::time::Duration::from_secs(5)).await?;
        Ok(())
    })
}
