//! Unit tests on small synthetic byte-level vocabularies.

use super::fixtures::{IM_END, IM_START, bl, byte_char, byte_level_vocab};
use super::*;

const MERGES: &[(&str, &str)] = &[(" ", "t"), ("h", "e"), (" t", "he"), ("1", "2")];

fn tok(pre: &str) -> Tokenizer {
    match Tokenizer::from_gguf(&byte_level_vocab(pre, MERGES)) {
        Ok(t) => t,
        Err(e) => panic!("synthetic vocabulary must build: {e}"),
    }
}

fn id(t: &Tokenizer, text: &str) -> u32 {
    t.token_to_id(&bl(text))
        .unwrap_or_else(|| panic!("test token {text:?} missing"))
}

fn enc(t: &Tokenizer, text: &str) -> Vec<u32> {
    t.encode(text)
        .unwrap_or_else(|e| panic!("encode {text:?}: {e}"))
}

fn err_of(v: &GgufVocab) -> String {
    match Tokenizer::from_gguf(v) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn merges_apply_in_rank_order() {
    let t = tok("gpt-2");
    assert_eq!(
        enc(&t, "the the"),
        vec![id(&t, "t"), id(&t, "he"), id(&t, " the")]
    );
    assert_eq!(
        t.decode(&enc(&t, "the the")).ok().as_deref(),
        Some("the the")
    );
}

#[test]
fn smollm_splits_digits_one_by_one() {
    let smol = tok("smollm");
    let digits = |t: &Tokenizer| enc(t, "12345");
    let single: Vec<u32> = "12345".chars().map(|c| id(&smol, &c.to_string())).collect();
    assert_eq!(digits(&smol), single);
    // The same vocabulary with the plain GPT-2 split merges "12".
    let gpt2 = tok("gpt-2");
    assert_eq!(digits(&gpt2)[0], id(&gpt2, "12"));
    // Qwen2 also splits single digits; Llama 3 groups up to three, then merges within a group.
    assert_eq!(digits(&tok("qwen2")), single);
    let l3 = tok("llama-bpe");
    assert_eq!(
        digits(&l3),
        vec![id(&l3, "12"), id(&l3, "3"), id(&l3, "4"), id(&l3, "5")]
    );
    // llama.cpp's default splits groups of three digits as well.
    let def = tok("default");
    assert_eq!(
        digits(&def),
        vec![id(&def, "12"), id(&def, "3"), id(&def, "4"), id(&def, "5")]
    );
}

#[test]
fn llama3_splits_newlines_and_contractions() {
    let t = tok("llama3");
    // "'S" is one pre-token under Llama 3 (case-insensitive), so no merge crosses it.
    let ids = enc(&t, "it'S\n\nthe");
    let text: Vec<String> = ids.iter().filter_map(|&i| t.id_to_token(i)).collect();
    assert_eq!(text, ["i", "t", "'", "S", "Ċ", "Ċ", "t", "he"]);
}

#[test]
fn special_tokens_in_text_are_single_ids() {
    let t = tok("smollm");
    let ids = enc(&t, "<|im_start|>the<|im_end|>");
    assert_eq!(ids, vec![IM_START, id(&t, "t"), id(&t, "he"), IM_END]);
    assert!(t.is_special(IM_START) && t.is_special(IM_END) && t.is_special(0));
    assert!(!t.is_special(id(&t, "he")));
    assert!(t.is_eos(IM_END) && !t.is_eos(IM_START));
    assert_eq!(
        t.decode(&ids).ok().as_deref(),
        Some("<|im_start|>the<|im_end|>")
    );
}

#[test]
fn user_defined_tokens_are_matched_but_not_special() {
    let mut v = byte_level_vocab("smollm", MERGES);
    v.tokens.push("<think>".into());
    v.token_types.push(4);
    let t = Tokenizer::from_gguf(&v).unwrap_or_else(|e| panic!("{e}"));
    let think = (v.tokens.len() - 1) as u32;
    assert_eq!(enc(&t, "<think>he"), vec![think, id(&t, "he")]);
    assert!(!t.is_special(think));
}

#[test]
fn add_bos_prepends_bos() {
    let mut v = byte_level_vocab("smollm", MERGES);
    v.add_bos = true;
    let t = Tokenizer::from_gguf(&v).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(enc(&t, "he"), vec![IM_START, id(&t, "he")]);
    assert_eq!(
        t.specials(),
        &SpecialTokens {
            bos: Some(IM_START),
            eos: vec![IM_END],
            add_bos: true
        }
    );
}

#[test]
fn sizes_and_lookups() {
    let v = byte_level_vocab("smollm", MERGES);
    let t = tok("smollm");
    assert_eq!(t.vocab_size(), v.tokens.len());
    assert_eq!(t.id_to_token(IM_END).as_deref(), Some("<|im_end|>"));
    assert_eq!(t.id_to_token(u32::MAX), None);
    assert!(t.decode(&[u32::MAX]).is_err());
}

#[test]
fn multibyte_text_round_trips() {
    let t = tok("smollm");
    let text = "héllo → 世界 🦀 12";
    assert_eq!(t.decode(&enc(&t, text)).ok().as_deref(), Some(text));
}

#[test]
fn stream_holds_back_split_characters() {
    let t = tok("smollm");
    // "é" is C3 A9: two byte tokens, neither valid alone.
    let ids = enc(&t, "é");
    assert_eq!(ids.len(), 2);
    let mut s = TextStream::default();
    assert_eq!(s.push(&t, ids[0]).ok(), Some(None));
    assert_eq!(s.push(&t, ids[1]).ok(), Some(Some("é".to_string())));
    assert_eq!(s.finish(&t).ok(), Some(None));
}

#[test]
fn stream_output_concatenates_to_decode() {
    let t = tok("smollm");
    let text = "<|im_start|>the 🦀 crab, the 世界<|im_end|>";
    let ids = enc(&t, text);
    let mut s = TextStream::default();
    let mut out = String::new();
    let mut pieces = 0;
    for &i in &ids {
        if let Some(piece) = s.push(&t, i).unwrap_or_else(|e| panic!("{e}")) {
            assert!(!piece.contains('\u{FFFD}'), "piece {piece:?} was cut");
            out.push_str(&piece);
            pieces += 1;
        }
    }
    if let Some(rest) = s.finish(&t).unwrap_or_else(|e| panic!("{e}")) {
        out.push_str(&rest);
    }
    assert_eq!(out, text);
    assert!(
        pieces > 5,
        "text should stream in many pieces, got {pieces}"
    );
}

#[test]
fn stream_flushes_invalid_bytes_instead_of_growing() {
    let t = tok("smollm");
    // Byte 0x80 alone is never valid UTF-8.
    let cont = t
        .token_to_id(&byte_char(0x80).to_string())
        .unwrap_or_else(|| panic!("byte token 0x80 missing"));
    let mut s = TextStream::default();
    let mut emitted = String::new();
    for _ in 0..100 {
        if let Some(p) = s.push(&t, cont).unwrap_or_else(|e| panic!("{e}")) {
            emitted.push_str(&p);
        }
        assert!(s.window_len() <= 16, "window grew to {}", s.window_len());
    }
    if let Some(p) = s.finish(&t).unwrap_or_else(|e| panic!("{e}")) {
        emitted.push_str(&p);
    }
    assert_eq!(emitted.chars().count(), 100);
    assert!(emitted.chars().all(|c| c == '\u{FFFD}'));
}

#[test]
fn stream_rejects_unknown_ids() {
    let t = tok("smollm");
    let mut s = TextStream::default();
    assert!(s.push(&t, u32::MAX).is_err());
    assert_eq!(s.push(&t, id(&t, "he")).ok(), Some(Some("he".to_string())));
}

#[test]
fn json_round_trip_encodes_identically() {
    let t = tok("smollm");
    let json = t.to_json().unwrap_or_else(|e| panic!("{e}"));
    let back = Tokenizer::from_json(&json, t.specials().clone()).unwrap_or_else(|e| panic!("{e}"));
    for text in ["the the 12345", "<|im_start|>héllo<|im_end|>", "x\n\n  y"] {
        assert_eq!(enc(&back, text), enc(&t, text), "{text:?}");
    }
    assert_eq!(back.vocab_size(), t.vocab_size());
    assert!(back.is_special(0));
}

#[test]
fn from_json_rejects_bad_merges_without_panicking() {
    let t = tok("smollm");
    let json = t.to_json().unwrap_or_else(|e| panic!("{e}"));
    let mut value: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}"));
    // A merge whose result is longer than every token made `tokenizers` panic.
    value["model"]["merges"] = serde_json::json!([["thisisverylongtoken", "andmore"]]);
    let bad = value.to_string();
    assert!(Tokenizer::from_json(&bad, SpecialTokens::default()).is_err());
    value["model"]["merges"] = serde_json::json!(["h e", "he t"]);
    assert!(Tokenizer::from_json(&value.to_string(), SpecialTokens::default()).is_err());
    assert!(Tokenizer::from_json("{not json", SpecialTokens::default()).is_err());
    // Special ids are checked against the vocabulary.
    let specials = SpecialTokens {
        bos: Some(1 << 30),
        eos: vec![],
        add_bos: false,
    };
    assert!(Tokenizer::from_json(&json, specials).is_err());
}

#[test]
fn bad_metadata_is_an_error() {
    let good = byte_level_vocab("smollm", MERGES);

    let mut v = good.clone();
    v.merges.push(format!("{} {}", bl("x"), bl("yz")));
    assert!(err_of(&v).contains("not in the vocabulary"));

    let mut v = good.clone();
    v.merges.push(format!("{} {}", bl("he"), bl("he")));
    assert!(err_of(&v).contains("produces"));

    let mut v = good.clone();
    v.merges.push("nospace".into());
    assert!(err_of(&v).contains("separated by a space"));

    let mut v = good.clone();
    v.eos = Some(v.tokens.len() as u32);
    assert!(err_of(&v).contains("eos token id"));

    let mut v = good.clone();
    v.token_types.pop();
    assert!(err_of(&v).contains("token types"));

    let mut v = good.clone();
    v.pre = Some("klingon".into());
    assert!(err_of(&v).contains("klingon"));

    let mut v = good.clone();
    v.model = "bert".into();
    assert!(err_of(&v).contains("bert"));

    let mut v = good.clone();
    v.tokens.clear();
    v.token_types.clear();
    assert!(err_of(&v).contains("no tokens"));

    let mut v = good;
    v.bos = None;
    v.add_bos = true;
    assert!(err_of(&v).contains("bos"));
}
