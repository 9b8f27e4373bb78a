//! Small synthetic GGUF vocabularies for unit tests (here and in `constrain`): byte-level BPE
//! and SentencePiece with byte fallback.

use super::GgufVocab;
use super::bytes::printable;

/// The byte-level vocabularies' control tokens, at ids 0, 1 and 2.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const IM_START: u32 = 1;
pub const IM_END: u32 = 2;

/// GPT-2's byte → char map (the one byte-level vocabularies are written in).
pub fn byte_char(b: u8) -> char {
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('?')
}

/// Byte-level spelling of `s`, e.g. `" the"` → `"Ġthe"`.
pub fn bl(s: &str) -> String {
    s.bytes().map(byte_char).collect()
}

/// Byte-level BPE: the 3 [`SPECIALS`], the 256 single bytes, then each merge's result.
pub fn byte_level_vocab(pre: &str, merges: &[(&str, &str)]) -> GgufVocab {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    let mut merge_strings = Vec::new();
    for (a, b) in merges {
        let (a, b) = (bl(a), bl(b));
        let joined = format!("{a}{b}");
        if !tokens.contains(&joined) {
            tokens.push(joined);
        }
        merge_strings.push(format!("{a} {b}"));
    }
    let mut token_types = vec![1; tokens.len()];
    token_types[..SPECIALS.len()].fill(3);
    GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types,
        merges: merge_strings,
        bos: Some(IM_START),
        eos: Some(IM_END),
        unk: None,
        ..GgufVocab::default()
    }
}

/// SentencePiece: `<unk>`, `<s>`, `</s>`, the 256 byte-fallback tokens, then `pieces` with
/// their scores.
pub fn sentencepiece_vocab(pieces: &[(&str, f32)]) -> GgufVocab {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for &(piece, score) in pieces {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    GgufVocab {
        model: "llama".into(),
        tokens,
        token_types: types,
        scores,
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        add_bos: true,
        ..GgufVocab::default()
    }
}

/// SentencePiece pieces spelling "hello" and " w", with their scores.
pub const HELLO_PIECES: &[(&str, f32)] = &[
    ("▁", -1.0),
    ("h", -2.0),
    ("e", -2.0),
    ("l", -2.0),
    ("o", -2.0),
    ("w", -2.0),
    ("ll", -3.0),
    ("he", -4.0),
    ("hell", -5.0),
    ("hello", -6.0),
    ("▁hello", -7.0),
    ("▁w", -8.0),
];
