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
        let mut stream = leanstream_engine::tokenizer::TextStream::default();
        let mut out = String::new();
        for &id in &enc(text) {
            if let Some(piece) = stream.push(t, id).unwrap_or_else(|e| panic!("{e}")) {
                assert!(!piece.contains('\u{FFFD}'), "cut character in {piece:?}");
                out.push_str(&piece);
            }
        }
        if let Some(rest) = stream.finish(t).unwrap_or_else(|e| panic!("{e}")) {
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

/// The engine's BPE against the `tokenizers` crate built from the same metadata, on a real
/// vocabulary: every id's text and bytes, and the ids of the calibration and held-out texts,
/// line by line, and of the chat-formatted prompt.
fn engine_bpe_matches_the_crate(path: &std::path::Path, chat: &str) {
    let file = gguf::GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let vocab = gguf::GgufModel::from_file(&file)
        .unwrap_or_else(|e| panic!("{e}"))
        .vocab;
    let ours = Tokenizer::from_gguf(&vocab).unwrap_or_else(|e| panic!("{e}"));
    let theirs = Tokenizer::from_gguf_with_crate(&vocab).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ours.vocab_size(), theirs.vocab_size());
    assert_eq!(ours.specials(), theirs.specials());
    for id in 0..ours.vocab_size() as u32 {
        assert_eq!(ours.id_to_token(id), theirs.id_to_token(id), "id {id}");
        assert_eq!(ours.is_special(id), theirs.is_special(id), "id {id}");
    }
    assert!(
        ours.token_bytes() == theirs.token_bytes(),
        "token bytes differ"
    );
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/text");
    let mut checked = 0;
    for name in ["calibration.txt", "heldout-eval.txt"] {
        let text = std::fs::read_to_string(root.join(name)).unwrap_or_else(|e| panic!("{e}"));
        for line in text.lines().chain([text.as_str(), chat]) {
            let (a, b) = (ours.encode(line), theirs.encode(line));
            let (a, b) = (
                a.unwrap_or_else(|e| panic!("{e}")),
                b.unwrap_or_else(|e| panic!("{e}")),
            );
            assert_eq!(a, b, "{name}: {line:?}");
            assert_eq!(
                ours.decode(&a).ok(),
                theirs.decode(&b).ok(),
                "{name}: {line:?}"
            );
            checked += a.len();
        }
    }
    assert!(checked > 10_000, "only {checked} ids compared");
    assert!(
        ours.heap_bytes() * 4 < theirs.heap_bytes(),
        "the engine's BPE holds {} bytes, the crate about {}",
        ours.heap_bytes(),
        theirs.heap_bytes()
    );
}

#[test]
fn smollm2_engine_bpe_gives_the_crates_ids_on_real_text() {
    engine_bpe_matches_the_crate(&model_path(), CHAT);
}

#[test]
fn gemma3_engine_bpe_gives_the_crates_ids_on_real_text() {
    let path = leanstream_engine::testing::gemma_model();
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-model",
        path.display()
    );
    engine_bpe_matches_the_crate(
        &path,
        "<start_of_turn>user\nWhat is  the capital\tof France?<end_of_turn>\n<start_of_turn>model\n",
    );
}
