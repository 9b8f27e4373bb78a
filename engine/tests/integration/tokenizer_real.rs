//! The tokenizer and chat template of the real SmolLM2-135M-Instruct GGUF file against the ids
//! of an independent reference (a numpy implementation; the ids are inlined here).
//!
//! The model path comes from `LEANSTREAM_TEST_MODEL`, by default
//! `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`; `scripts/fetch-model` puts it there.

use std::path::PathBuf;

use leanstream_engine::chat::{ChatMessage, ChatTemplate};
use leanstream_engine::model::{ImportedModel, gguf};
use leanstream_engine::tokenizer::Tokenizer;

const STORY: &str = "Once upon a time, there was a little";
const STORY_IDS: [u32; 9] = [6403, 1980, 253, 655, 28, 665, 436, 253, 1838];
const CHAT: &str =
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
const CHAT_IDS: [u32; 16] = [
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
];
const GREEDY_IDS: [u32; 16] = [
    8180, 3365, 20391, 617, 5732, 288, 1238, 281, 260, 2388, 30, 2306, 736, 1129, 685, 288,
];
const GREEDY_TEXT: &str = " girl named Emma who loved to play in the sun. She would often go to";

fn model_path() -> PathBuf {
    leanstream_engine::testing::real_model()
}

fn import() -> ImportedModel {
    let path = model_path();
    assert!(
        path.is_file(),
        "test model {} is missing: run scripts/fetch-model (or set LEANSTREAM_TEST_MODEL)",
        path.display()
    );
    gguf::import(&path).unwrap_or_else(|e| panic!("importing {}: {e}", path.display()))
}

fn check(t: &Tokenizer) {
    let enc = |s: &str| t.encode(s).unwrap_or_else(|e| panic!("encode {s:?}: {e}"));
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.specials().bos, Some(1));
    assert_eq!(t.specials().eos, [2]);
    assert!(!t.specials().add_bos);
    assert_eq!(enc(STORY), STORY_IDS);
    assert_eq!(enc(CHAT), CHAT_IDS);
    assert_eq!(t.decode(&GREEDY_IDS).ok().as_deref(), Some(GREEDY_TEXT));

    // The smollm pre-tokenizer splits digits one by one.
    let digits = enc("12345");
    assert_eq!(digits.len(), 5, "{digits:?}");
    for (id, d) in digits.iter().zip("12345".chars()) {
        assert_eq!(t.id_to_token(*id), Some(d.to_string()));
    }

    // Streaming gives the same text, and multi-byte characters come out whole.
    for text in [GREEDY_TEXT, "Ünïcödé 🦀 日本語 — “quotes”"] {
        let mut stream = t.stream();
        let mut out = String::new();
        for &id in &enc(text) {
            if let Some(piece) = stream.push(id).unwrap_or_else(|e| panic!("{e}")) {
                assert!(!piece.contains('\u{FFFD}'), "cut character in {piece:?}");
                out.push_str(&piece);
            }
        }
        if let Some(rest) = stream.finish().unwrap_or_else(|e| panic!("{e}")) {
            out.push_str(&rest);
        }
        assert_eq!(out, text);
    }
}

#[test]
fn smollm2_tokenizer_matches_the_reference_ids() {
    let m = import();
    check(&m.tokenizer);

    // Stored as tokenizer.json (as in a .lsm file) and reloaded, it encodes identically.
    let json = m.tokenizer.to_json().unwrap_or_else(|e| panic!("{e}"));
    let back = Tokenizer::from_json(&json, m.tokenizer.specials().clone())
        .unwrap_or_else(|e| panic!("reloading tokenizer.json: {e}"));
    check(&back);
}

#[test]
fn smollm2_chat_template_renders_chatml() {
    let m = import();
    let source = m
        .chat_template
        .unwrap_or_else(|| panic!("the SmolLM2 file has a chat template"));
    let tmpl =
        ChatTemplate::new(&source, "<|im_start|>", "<|im_end|>").unwrap_or_else(|e| panic!("{e}"));
    let prompt = tmpl
        .render(
            &[ChatMessage::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        prompt.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"),
        "{prompt:?}"
    );
    assert!(prompt.ends_with(CHAT), "{prompt:?}");
    let ids = m
        .tokenizer
        .encode(&prompt)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(ids.ends_with(&CHAT_IDS), "{ids:?}");
}
