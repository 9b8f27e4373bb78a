//! Unit tests on small synthetic vocabularies (byte-level BPE and SentencePiece), driving the
//! constraint with seeded random logits: whatever the "model" prefers, the text must match.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::sample::argmax;
use crate::tokenizer::fixtures::{IM_END, IM_START, byte_level_vocab, sentencepiece_vocab};

/// 3 control tokens, the 256 bytes, then a few merges a planner's JSON uses.
fn byte_level_tokenizer() -> Tokenizer {
    let merges = [
        ("{", "\""),
        ("p", "i"),
        ("pi", "c"),
        ("pic", "k"),
        (" ", "\""),
    ];
    Tokenizer::from_gguf(&byte_level_vocab("gpt2", &merges))
        .expect("the synthetic byte-level vocabulary builds")
}

/// `<unk>`, `<s>`, `</s>`, the 256 byte-fallback tokens, then a few pieces.
fn sentencepiece_tokenizer() -> Tokenizer {
    let pieces = [
        ("▁", -1.0),
        ("c", -2.0),
        ("u", -2.0),
        ("p", -2.0),
        ("▁cup", -3.0),
    ];
    Tokenizer::from_gguf(&sentencepiece_vocab(&pieces))
        .expect("the synthetic SentencePiece vocabulary builds")
}

const PLANNER: &str = r#"{"type":"object","properties":{"action":{"enum":["pick","place","move","stop"]},"object":{"type":"string","maxLength":8}},"required":["action","object"],"additionalProperties":false}"#;

/// Generates under `grammar` with logits drawn from `rng` (plus `pad` padding ids), argmax
/// after the mask, until eos or `max` tokens; returns the ids without the eos and whether an eos
/// ended it.
fn walk(grammar: &Grammar, rng: &mut ChaCha8Rng, pad: usize, max: usize) -> (Vec<u32>, bool) {
    let vocab = grammar.vocab.vocab_size();
    let mut c = grammar.start();
    let mut ids = Vec::new();
    let mut logits = vec![0.0f32; vocab + pad];
    for _ in 0..max {
        logits
            .iter_mut()
            .for_each(|l| *l = rng.random::<f32>() * 10.0);
        // The padding ids are the model's favourites: the mask must still refuse them.
        logits[vocab..].fill(100.0);
        c.mask(&mut logits).expect("mask");
        let next = argmax(&logits);
        assert!((next as usize) < vocab, "a padding id {next} was sampled");
        c.advance(next).expect("advance a masked-in token");
        if grammar.vocab.eos().contains(&next) {
            assert!(c.is_done());
            return (ids, true);
        }
        ids.push(next);
    }
    (ids, false)
}

#[test]
fn random_logits_under_a_planner_schema_give_valid_json() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    let grammar = Grammar::json_schema(&vocab, PLANNER).expect("schema compiles");
    for seed in 0..8 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (ids, ended) = walk(&grammar, &mut rng, 7, 200);
        assert!(ended, "seed {seed}: no eos within 200 tokens");
        let text = tok.decode(&ids).expect("decode");
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        let action = v["action"].as_str().unwrap_or_default();
        assert!(
            ["pick", "place", "move", "stop"].contains(&action),
            "seed {seed}: {text}"
        );
        let object = v["object"].as_str().expect("object is a string");
        assert!(object.chars().count() <= 8, "seed {seed}: {text}");
        assert_eq!(
            v.as_object().map(|o| o.len()),
            Some(2),
            "seed {seed}: {text}"
        );
    }
}

#[test]
fn the_first_mask_allows_only_an_opening_brace() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    let grammar = Grammar::json_schema(&vocab, PLANNER).expect("schema compiles");
    let mut logits = vec![1.0f32; vocab.vocab_size() + 40];
    grammar.start().mask(&mut logits).expect("mask");
    let allowed: Vec<String> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .map(|i| tok.decode(&[i]).expect("decode"))
        .collect();
    assert_eq!(allowed, ["{", "{\""]);
}

#[test]
fn control_tokens_and_early_eos_are_refused() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    let grammar = Grammar::json_schema(&vocab, PLANNER).expect("schema compiles");
    let mut c = grammar.start();
    let mut logits = vec![0.0f32; vocab.vocab_size()];
    c.mask(&mut logits).expect("mask");
    assert_eq!(logits[IM_START as usize], f32::NEG_INFINITY);
    assert_eq!(logits[IM_END as usize], f32::NEG_INFINITY);
    assert!(!c.is_complete());
    let err = c
        .advance(IM_END)
        .expect_err("eos before the object is refused");
    assert!(matches!(err, Error::Constraint(_)), "{err}");
}

#[test]
fn a_complete_grammar_allows_only_eos() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    let grammar = Grammar::regex(&vocab, "pick|place").expect("regex compiles");
    let mut c = grammar.start();
    let pick = tok.token_to_id("pick").expect("merged token");
    c.advance(pick).expect("advance");
    assert!(c.is_done() && c.is_complete());
    let mut logits = vec![0.0f32; vocab.vocab_size() + 3];
    c.mask(&mut logits).expect("mask");
    let allowed: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    assert_eq!(allowed, [IM_END]);
    c.advance(IM_END).expect("eos ends it");
}

#[test]
fn bad_schemas_and_grammars_are_typed_errors() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    for (schema, needle) in [
        ("{\"type\": ", "not JSON"),
        ("[1, 2]", "object or a boolean"),
        (r#"{"type": "banana"}"#, "banana"),
        (r#"{"type": "string", "pattern": "("}"#, ""),
    ] {
        match Grammar::json_schema(&vocab, schema) {
            Err(Error::InvalidGrammar {
                kind: GrammarKind::JsonSchema,
                reason,
            }) => assert!(reason.contains(needle), "{schema}: {reason}"),
            other => panic!("{schema}: expected InvalidGrammar, got {other:?}"),
        }
    }
    let err = Grammar::lark(&vocab, "start: foo(").expect_err("bad Lark");
    assert!(
        matches!(
            err,
            Error::InvalidGrammar {
                kind: GrammarKind::Lark,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().starts_with("invalid Lark grammar: "),
        "{err}"
    );
}

#[test]
fn a_sentencepiece_vocabulary_matches_by_bytes() {
    let tok = sentencepiece_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    let grammar = Grammar::regex(&vocab, " cup!").expect("regex compiles");
    let mut logits = vec![0.0f32; vocab.vocab_size()];
    grammar.start().mask(&mut logits).expect("mask");
    let allowed: Vec<String> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .map(|i| tok.id_to_token(i).expect("known id"))
        .collect();
    // A space is `▁` or the byte token 0x20; the whole word is one piece.
    assert_eq!(allowed, ["<0x20>", "▁", "▁cup"]);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for _ in 0..4 {
        let (ids, ended) = walk(&grammar, &mut rng, 0, 20);
        assert!(ended);
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| match &tok.token_bytes()[id as usize] {
                TokenBytes::Text(b) => b.clone(),
                other => panic!("id {id} is not text: {other:?}"),
            })
            .collect();
        assert_eq!(bytes, b" cup!");
    }
}

#[test]
fn the_mask_clears_unset_bits_and_everything_past_the_vocabulary() {
    let mut allowed = SimpleVob::alloc(40);
    allowed.allow_token(0);
    allowed.allow_token(33);
    let mut logits = vec![1.0f32; 70];
    apply_mask(&allowed, &mut logits);
    let kept: Vec<usize> = (0..70).filter(|&i| logits[i].is_finite()).collect();
    assert_eq!(kept, [0, 33]);
}

#[test]
fn vocab_grammar_and_constraint_can_cross_threads() {
    fn shared<T: Send + Sync>() {}
    fn sent<T: Send>() {}
    shared::<ConstraintVocab>();
    shared::<Grammar>();
    sent::<Constraint>();
}

/// Whether `text` is one line of at most 300 characters and the cut mark.
fn is_one_short_line(text: &str) -> bool {
    !text.contains(['\n', '\r']) && text.chars().count() <= MAX_REASON_CHARS + 1
}

#[test]
fn a_grammar_no_text_can_match_is_refused_in_one_line() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    for (kind, text) in [
        (GrammarKind::JsonSchema, r##"{"$ref": "#"}"##),
        (GrammarKind::Lark, "start: start"),
        (GrammarKind::Lark, "start: a\na: a \"x\""),
        (GrammarKind::Lark, r"start: /[^\s\S]/"),
    ] {
        match Grammar::new(&vocab, kind, text) {
            Err(Error::InvalidGrammar { reason, .. }) => {
                assert!(
                    reason.starts_with("no text can match it"),
                    "{text}: {reason}"
                );
                assert!(is_one_short_line(&reason), "{text}: {reason}");
            }
            other => panic!("{text}: expected InvalidGrammar, got {other:?}"),
        }
    }
}

#[test]
fn compile_errors_are_one_short_line() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    let long_regex = format!("({}", "a".repeat(5000));
    for (kind, text) in [
        (GrammarKind::Lark, "start: foo(\n"),
        (GrammarKind::Lark, "start: \"a\" & \"b\"\n"),
        (GrammarKind::Regex, long_regex.as_str()),
        (
            GrammarKind::JsonSchema,
            r#"{"type": "string", "pattern": "^[^\\s\\S]$"}"#,
        ),
    ] {
        match Grammar::new(&vocab, kind, text) {
            Err(Error::InvalidGrammar { reason, .. }) => {
                assert!(is_one_short_line(&reason), "{reason}");
            }
            other => panic!("{text}: expected InvalidGrammar, got {other:?}"),
        }
    }
}

#[test]
fn errors_during_generation_are_one_short_line() {
    let tok = byte_level_tokenizer();
    let vocab = ConstraintVocab::new(&tok).expect("vocab");
    let grammar = Grammar::json_schema(&vocab, PLANNER).expect("schema compiles");
    let mut c = grammar.start();
    let brace = tok.token_to_id("{").expect("a byte token");
    c.advance(brace).expect("an opening brace");
    let reason = |e: Error| match e {
        Error::Constraint(reason) => reason,
        other => panic!("expected a constraint error, got {other:?}"),
    };
    let err = c.advance(brace).expect_err("a second brace is refused");
    let why = reason(err);
    assert!(is_one_short_line(&why), "{why}");
    // The parser stays failed: the next mask says so, in one line too.
    let mut logits = vec![0.0f32; vocab.vocab_size()];
    let why = reason(c.mask(&mut logits).expect_err("a failed parser"));
    assert!(is_one_short_line(&why), "{why}");
}

#[test]
fn one_line_keeps_the_first_line_and_marks_what_it_cuts() {
    assert_eq!(one_line("\n  first\nsecond"), "first…");
    assert_eq!(one_line("tab\there\u{1b}[31m"), "tab here [31m");
    assert_eq!(one_line("short"), "short");
    let long = "x".repeat(400);
    let cut = one_line(&long);
    assert_eq!(cut.chars().count(), MAX_REASON_CHARS + 1);
    assert!(cut.ends_with('…'));
    assert_eq!(one_line(""), "");
}
