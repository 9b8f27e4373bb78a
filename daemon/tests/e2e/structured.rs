//! Structured output through the daemon: a request carrying a JSON Schema gets JSON that
//! parses and validates, on the real model, greedy; bad grammars are refused at the call.

use leanstream::contract::{ChatTurn, GenerateParams, StreamEvent};
use leanstream_e2e::*;
use serde_json::Value;

/// What a robot's planner sends: one action from a fixed set, the object it acts on, and an
/// optional position.
const ACTION_SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "action": {"enum": ["pick", "place", "move", "stop"]},
    "object": {"type": "string", "maxLength": 20},
    "x": {"type": "number"}
  },
  "required": ["action", "object"],
  "additionalProperties": false
}"#;

fn constrained(kind: &str, grammar: &str, max_tokens: u32) -> GenerateParams {
    GenerateParams {
        grammar_kind: kind.into(),
        grammar: grammar.into(),
        ..greedy(max_tokens)
    }
}

fn chat(content: &str) -> Vec<ChatTurn> {
    vec![ChatTurn {
        role: "user".into(),
        content: content.into(),
    }]
}

#[test]
fn a_json_schema_request_gets_json_that_validates_and_the_next_request_is_free()
-> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(256).await?;
        let resident = |r: &leanstream::contract::MemoryReport| {
            r.models
                .iter()
                .find(|m| m.name == MODEL)
                .map(|m| m.resident_bytes)
        };
        let before = resident(&c.manager.memory().await?);
        for request in [
            "Pick up the red cup from the table.",
            "Stop moving now.",
            "Put the box on the shelf at x = 2.5.",
        ] {
            let params = constrained("json_schema", ACTION_SCHEMA, 64);
            let out = read_stream(s.generate_chat(&chat(request), &params).await?).await?;
            let Some(StreamEvent::Done { reason, .. }) = &out.end else {
                anyhow::bail!("{request}: {:?}", out.end);
            };
            assert_eq!(reason, "eos", "{request}: cut short: {:?}", out.text);
            let v: Value = serde_json::from_str(&out.text)
                .map_err(|e| anyhow::anyhow!("{request}: {:?} is not JSON: {e}", out.text))?;
            let obj = v.as_object().expect("an object");
            assert!(
                ["pick", "place", "move", "stop"].contains(&obj["action"].as_str().unwrap_or("")),
                "{request}: {v}"
            );
            assert!(
                obj["object"]
                    .as_str()
                    .is_some_and(|o| o.chars().count() <= 20),
                "{request}: {v}"
            );
            assert!(
                obj.keys()
                    .all(|k| ["action", "object", "x"].contains(&k.as_str())),
                "{request}: {v}"
            );
            assert!(obj.get("x").is_none_or(Value::is_number), "{request}: {v}");
        }
        // The model's token trie, built by the first request, is in the model's reservation.
        let after = resident(&c.manager.memory().await?);
        let grown = after.zip(before).map(|(a, b)| a.saturating_sub(b));
        assert!(
            grown.is_some_and(|g| g >= 1 << 20),
            "the trie was not reserved: {before:?} -> {after:?}"
        );
        // A regex, then no grammar at all on the same session: the constraint ended with its
        // generation.
        let out = read_stream(
            s.generate(STORY_PROMPT, &constrained("regex", "[0-9]{3}", 8))
                .await?,
        )
        .await?;
        assert!(
            out.text.len() == 3 && out.text.bytes().all(|b| b.is_ascii_digit()),
            "{:?}",
            out.text
        );
        let out = read_stream(s.generate(STORY_PROMPT, &greedy(16)).await?).await?;
        assert_eq!(
            out.ids, STORY_GREEDY,
            "a free generation after a constrained one"
        );
        Ok(())
    })
}

#[test]
fn bad_grammars_are_refused_at_the_call() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(128).await?;
        for (kind, grammar) in [
            ("json_schema", r#"{"type": "strnig"}"#),
            ("json_schema", "not json"),
            ("yaml", "a: b"),
            ("json_schema", ""),
            ("", r#"{"type":"object"}"#),
            ("regex", "[unclosed"),
        ] {
            let r = s.generate("hi", &constrained(kind, grammar, 8)).await;
            assert_eq!(error_name(r), "InvalidArgument", "{kind:?} {grammar:?}");
        }
        // The session is still usable.
        let out = read_stream(s.generate(STORY_PROMPT, &greedy(4)).await?).await?;
        assert_eq!(out.ids, STORY_GREEDY[..4]);
        Ok(())
    })
}
