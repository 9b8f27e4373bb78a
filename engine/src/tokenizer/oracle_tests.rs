//! The engine's BPE against the `tokenizers` crate built from the same GGUF metadata: equal ids,
//! equal decoded text, on every `pre` kind and SentencePiece setting, for chosen and random
//! text. (The real vocabularies are held to the same in `tests/integration/tokenizer_real.rs`.)

use proptest::prelude::*;

use super::fixtures::{HELLO_PIECES, byte_level_vocab, sentencepiece_vocab};
use super::{GgufVocab, SUPPORTED_PRE, StoredTokenizer, Tokenizer};

const MERGES: &[(&str, &str)] = &[
    (" ", "t"),
    ("h", "e"),
    (" t", "he"),
    ("1", "2"),
    ("12", "3"),
    ("a", "b"),
    ("ab", "c"),
    ("b", "c"),
    (" ", "a"),
    ("\n", "\n"),
    ("'", "s"),
];

/// Byte-level vocabularies for one `pre`, with a user-defined token that overlaps a control one.
fn byte_level(pre: &str) -> GgufVocab {
    let mut v = byte_level_vocab(pre, MERGES);
    for (text, ty) in [("<think>", 4), ("<|im", 4), ("  ", 4)] {
        v.tokens.push(text.into());
        v.token_types.push(ty);
    }
    v
}

/// SentencePiece vocabularies: pieces with ties in score, a user-defined token, an unknown
/// token and, when `add_space_prefix`, the leading `▁`.
fn sentencepiece(add_space_prefix: bool, byte_fallback: bool) -> GgufVocab {
    let extra = [
        ("a", -2.0),
        ("b", -2.0),
        ("ab", -4.0),
        ("ba", -4.0),
        ("▁▁", -8.0),
        ("<b>", -9.0),
    ];
    let pieces: Vec<(&str, f32)> = HELLO_PIECES.iter().copied().chain(extra).collect();
    let mut v = sentencepiece_vocab(&pieces);
    let n = v.tokens.len();
    v.token_types[n - 1] = 4;
    v.add_space_prefix = Some(add_space_prefix);
    if !byte_fallback {
        // Drop the byte tokens' meaning: unknown characters become `<unk>`.
        for t in v.tokens.iter_mut().filter(|t| t.starts_with("<0x")) {
            t.insert(0, '#');
        }
    }
    v
}

fn vocabularies() -> Vec<(String, GgufVocab)> {
    let mut out: Vec<(String, GgufVocab)> = SUPPORTED_PRE
        .iter()
        .map(|p| (format!("gpt2/{p}"), byte_level(p)))
        .collect();
    for (prefix, fallback) in [(true, true), (false, true), (true, false)] {
        out.push((
            format!("spm prefix={prefix} byte_fallback={fallback}"),
            sentencepiece(prefix, fallback),
        ));
    }
    out
}

fn build(v: &GgufVocab) -> (Tokenizer, Tokenizer) {
    let ours = Tokenizer::from_gguf(v).unwrap_or_else(|e| panic!("engine BPE: {e}"));
    let theirs = Tokenizer::from_gguf_with_crate(v).unwrap_or_else(|e| panic!("crate: {e}"));
    (ours, theirs)
}

fn same(name: &str, ours: &Tokenizer, theirs: &Tokenizer, text: &str) -> Result<(), String> {
    let a = ours.encode(text).map_err(|e| e.to_string())?;
    let b = theirs.encode(text).map_err(|e| e.to_string())?;
    if a != b {
        return Err(format!(
            "{name}: {text:?} encodes to {a:?}, the crate to {b:?}"
        ));
    }
    let (da, db) = (ours.decode(&a), theirs.decode(&b));
    if da.as_ref().ok() != db.as_ref().ok() {
        return Err(format!(
            "{name}: {text:?} decodes to {da:?}, the crate to {db:?}"
        ));
    }
    Ok(())
}

const TEXTS: &[&str] = &[
    "",
    " ",
    "the the",
    "hello hello world",
    "  hello",
    "abcabc bcab",
    "12345 123 1234567",
    "it's the 'S \n\n\nthe",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<think>he</think><think><|im",
    "<|im_end|><|im_end|>x<|im",
    "été ét é",
    "a\u{1F600}b 𝄞 ∑",
    "<b>hello<b> <b>",
    "wwwhellohello▁hello",
    "tab\tand\r\nnewlines  \n ",
];

#[test]
fn the_engine_bpe_gives_the_crates_ids_on_every_vocabulary_kind() {
    for (name, v) in vocabularies() {
        let (ours, theirs) = build(&v);
        assert_eq!(ours.vocab_size(), theirs.vocab_size(), "{name}");
        for text in TEXTS {
            same(&name, &ours, &theirs, text).unwrap_or_else(|e| panic!("{e}"));
        }
        for id in 0..ours.vocab_size() as u32 {
            assert_eq!(
                ours.id_to_token(id),
                theirs.id_to_token(id),
                "{name}: id {id}"
            );
            assert_eq!(
                ours.is_special(id),
                theirs.is_special(id),
                "{name}: id {id}"
            );
            assert_eq!(
                ours.decode(&[id]).ok(),
                theirs.decode(&[id]).ok(),
                "{name}: {id}"
            );
        }
        assert_eq!(ours.token_bytes(), theirs.token_bytes(), "{name}");
    }
}

#[test]
fn a_stored_vocabulary_rebuilds_the_same_tokenizer() {
    for (name, v) in vocabularies() {
        let t = Tokenizer::from_gguf(&v).unwrap_or_else(|e| panic!("{e}"));
        let stored = t.stored().unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(stored, StoredTokenizer::Vocab(_)), "{name}");
        let back =
            Tokenizer::from_stored(&stored, t.specials().clone()).unwrap_or_else(|e| panic!("{e}"));
        // Through JSON too (the crate's form of the same vocabulary).
        let json = Tokenizer::from_json(
            &t.to_json().unwrap_or_else(|e| panic!("{e}")),
            t.specials().clone(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        for text in TEXTS {
            same(&name, &t, &back, text).unwrap_or_else(|e| panic!("{e}"));
            same(&name, &t, &json, text).unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(back.specials(), t.specials(), "{name}");
    }
}

#[test]
fn the_engine_bpe_holds_less_than_the_crates_estimate() {
    for (name, v) in vocabularies() {
        let (ours, theirs) = build(&v);
        assert!(ours.heap_bytes() < theirs.heap_bytes(), "{name}");
        assert!(
            ours.heap_bytes() <= Tokenizer::gguf_heap_bytes_bound(&v),
            "{name}"
        );
    }
}

/// Text from pieces that meet the vocabularies' merges, specials and odd characters.
fn text() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "a",
        "b",
        "c",
        "h",
        "e",
        "l",
        "o",
        "w",
        "t",
        " ",
        "  ",
        "\n",
        "1",
        "2",
        "3",
        "'",
        "s",
        "é",
        "☃",
        "<",
        ">",
        "<b>",
        "<think>",
        "<|im",
        "<|im_end|>",
        "hello",
        "▁",
        "\t",
    ]);
    prop::collection::vec(piece, 0..24).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_text_encodes_as_the_crate_encodes_it(text in text()) {
        for (name, v) in vocabularies() {
            let (ours, theirs) = build(&v);
            if let Err(e) = same(&name, &ours, &theirs, &text) {
                prop_assert!(false, "{}", e);
            }
        }
    }
}
