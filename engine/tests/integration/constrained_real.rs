//! Constrained decoding on the real models: greedy generations under the JSON Schemas a robot
//! planner sends parse and validate, on SmolLM2's byte-level BPE vocabulary and on Gemma 3's
//! SentencePiece one; a bad schema is the typed error.

use std::sync::{Arc, OnceLock};

use leanstream_engine::Error;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::chat::{ChatMessage, ChatTemplate};
use leanstream_engine::constrain::{ConstraintVocab, Grammar, GrammarKind};
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::speculate::MAX_DRAFT;
use leanstream_engine::generate::{DraftKind, Speculation, StopReason, generate_constrained};
use leanstream_engine::kv::KvType;
use leanstream_engine::sample::SamplerConfig;
use leanstream_engine::testing;
use serde_json::Value;

const ACTIONS: [&str; 4] = ["pick", "place", "move", "stop"];

/// One command: which action, on what, optionally where.
const COMMAND: &str = r#"{"type":"object","properties":{"action":{"enum":["pick","place","move","stop"]},"object":{"type":"string","maxLength":20},"x":{"type":"number"}},"required":["action","object"],"additionalProperties":false}"#;

/// A short plan: one to three steps, each an action on a target.
const PLAN: &str = r#"{"type":"object","properties":{"steps":{"type":"array","minItems":1,"maxItems":3,"items":{"type":"object","properties":{"action":{"enum":["pick","place","move","stop"]},"target":{"type":"string","maxLength":16}},"required":["action","target"],"additionalProperties":false}}},"required":["steps"],"additionalProperties":false}"#;

/// A gripper pose with bounded coordinates.
const POSE: &str = r#"{"type":"object","properties":{"x":{"type":"integer","minimum":-100,"maximum":100},"y":{"type":"integer","minimum":-100,"maximum":100},"gripper":{"type":"boolean"}},"required":["x","y","gripper"],"additionalProperties":false}"#;

struct Loaded {
    model: Arc<Model>,
    vocab: Arc<ConstraintVocab>,
}

fn smollm2() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| load(&testing::real_model()))
}

fn gemma() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| load(&testing::gemma_model()))
}

fn load(path: &std::path::Path) -> Loaded {
    let model = Model::load(path).expect("load model");
    let vocab = ConstraintVocab::new(&model.tokenizer).expect("constraint vocabulary");
    Loaded { model, vocab }
}

/// Greedy chat reply to `request` under `schema`; returns the text (eos excluded) after
/// checking that the grammar ended it.
fn reply(l: &Loaded, request: &str, schema: &str) -> String {
    let grammar = Grammar::json_schema(&l.vocab, schema).expect("schema compiles");
    let tok = &l.model.tokenizer;
    let template = ChatTemplate::for_model(l.model.chat_template.as_deref(), tok).expect("tmpl");
    let prompt = template
        .render(
            &[ChatMessage {
                role: "user".into(),
                content: format!("Reply with JSON only. {request}"),
            }],
            true,
        )
        .expect("render");
    let ids = tok.encode(&prompt).expect("encode");
    let eos = tok.specials().eos.clone();
    let run = |speculation: Option<Speculation>| {
        let mut session =
            Session::new(l.model.clone(), 512, Precision::Exact, KvType::F32).expect("session");
        let mut constraint = grammar.start();
        let g = generate_constrained(
            &mut session,
            &ids,
            120,
            &SamplerConfig::default(),
            &eos,
            Some(&mut constraint),
            speculation,
            |_| true,
        )
        .expect("generate");
        (g, constraint.is_done(), session.position())
    };
    let (g, done, position) = run(None);
    // The grammar's forced text drafted and verified in one pass gives the same tokens, leaves
    // the grammar and the session where plain decoding does, and was accepted.
    let (fast, fast_done, fast_position) = run(Some(Speculation::new(MAX_DRAFT)));
    assert_eq!(fast.ids, g.ids, "{schema}: speculation changed the output");
    assert_eq!((fast_done, fast_position), (done, position));
    let spec = fast.stats.speculation.expect("speculation stats");
    assert!(
        spec.accepted[DraftKind::Forced as usize] > 0 && spec.tokens_per_pass() > 1.0,
        "{schema}: no forced token was accepted: {spec:?}"
    );
    let (last, text_ids) = g.ids.split_last().expect("at least one token");
    let text = tok.decode(text_ids).expect("decode");
    assert_eq!(g.stop, StopReason::Eos, "{schema}: cut short: {text:?}");
    assert!(eos.contains(last) && done, "{text:?}");
    eprintln!(
        "{request} -> {text} ({:.2} tokens a pass with forced drafts)",
        spec.tokens_per_pass()
    );
    text
}

fn parse(text: &str) -> serde_json::Map<String, Value> {
    match serde_json::from_str(text) {
        Ok(Value::Object(o)) => o,
        other => panic!("not a JSON object: {text:?}: {other:?}"),
    }
}

/// `keys` are exactly the object's keys or a superset of them, and `required` are all there.
fn check_keys(o: &serde_json::Map<String, Value>, allowed: &[&str], required: &[&str]) {
    for k in o.keys() {
        assert!(allowed.contains(&k.as_str()), "unexpected key {k}: {o:?}");
    }
    for k in required {
        assert!(o.contains_key(*k), "missing {k}: {o:?}");
    }
}

fn check_action(v: &Value) {
    let a = v
        .as_str()
        .unwrap_or_else(|| panic!("action {v} is not a string"));
    assert!(ACTIONS.contains(&a), "action {a} is not in the enum");
}

fn check_string(v: &Value, max_chars: usize) {
    let s = v.as_str().unwrap_or_else(|| panic!("{v} is not a string"));
    assert!(s.chars().count() <= max_chars, "{s:?} is over {max_chars}");
}

fn check_command(text: &str) {
    let o = parse(text);
    check_keys(&o, &["action", "object", "x"], &["action", "object"]);
    check_action(&o["action"]);
    check_string(&o["object"], 20);
    if let Some(x) = o.get("x") {
        assert!(x.is_number(), "x {x} is not a number");
    }
}

fn check_plan(text: &str) {
    let o = parse(text);
    check_keys(&o, &["steps"], &["steps"]);
    let steps = o["steps"].as_array().expect("steps is an array");
    assert!((1..=3).contains(&steps.len()), "{} steps", steps.len());
    for step in steps {
        let s = step.as_object().expect("a step is an object");
        check_keys(s, &["action", "target"], &["action", "target"]);
        check_action(&s["action"]);
        check_string(&s["target"], 16);
    }
}

fn check_pose(text: &str) {
    let o = parse(text);
    check_keys(&o, &["x", "y", "gripper"], &["x", "y", "gripper"]);
    for k in ["x", "y"] {
        let n = o[k]
            .as_i64()
            .unwrap_or_else(|| panic!("{k} is not an integer"));
        assert!((-100..=100).contains(&n), "{k} = {n}");
    }
    assert!(o["gripper"].is_boolean());
}

#[test]
fn smollm2_greedy_replies_validate_against_planner_schemas() {
    let l = smollm2();
    check_command(&reply(l, "Pick up the red cup.", COMMAND));
    check_plan(&reply(l, "Plan: pick the cup, move it to the table.", PLAN));
    check_pose(&reply(l, "Move the gripper to x 10, y -5, closed.", POSE));
}

#[test]
fn gemma_sentencepiece_replies_validate_against_planner_schemas() {
    let l = gemma();
    check_command(&reply(l, "Pick up the red cup.", COMMAND));
    check_plan(&reply(l, "Plan: pick the cup, move it to the table.", PLAN));
}

#[test]
fn an_invalid_schema_is_the_typed_error_on_the_real_vocabulary() {
    let l = smollm2();
    for schema in [
        r#"{"type":"object","properties":{"action":{"type":"strnig"}}}"#,
        r#"{"type":"object","properties":{"action":{"enum":"pick"}}}"#,
        r#"{"type":"object""#,
    ] {
        match Grammar::json_schema(&l.vocab, schema) {
            Err(Error::InvalidGrammar {
                kind: GrammarKind::JsonSchema,
                reason,
            }) => assert!(!reason.is_empty()),
            other => panic!("{schema}: expected InvalidGrammar, got {other:?}"),
        }
    }
}
