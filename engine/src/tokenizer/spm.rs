//! SentencePiece BPE vocabularies (`tokenizer.ggml.model = llama`), as Hugging Face's
//! `LlamaConverter` turns them into a `tokenizers` BPE: merges derived from the token scores,
//! byte fallback through the `<0xNN>` tokens, spaces written as `▁`, and a leading `▁` added to
//! text when `add_space_prefix` is on (llama.cpp's default).

use std::cmp::Ordering;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence};

use super::GgufVocab;
use super::gguf::{add_special, vocab_map};
use crate::{Error, Result};

const SPACE: &str = "\u{2581}";

fn tok_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(format!("SentencePiece {what}: {e}"))
}

/// Every split of `token` into two vocabulary tokens — each is a merge of the BPE: the ids
/// and texts of the left and right parts.
fn splits<'a>(
    token: &'a str,
    vocab: &'a Vocab,
) -> impl Iterator<Item = (u32, u32, &'a str, &'a str)> {
    token.char_indices().skip(1).filter_map(move |(i, _)| {
        let (l, r) = token.split_at(i);
        Some((*vocab.get(l)?, *vocab.get(r)?, l, r))
    })
}

/// Builds the tokenizer and counts its merges; `check_common` has already run on `v`.
pub(super) fn build(v: &GgufVocab) -> Result<(tokenizers::Tokenizer, usize)> {
    let n = v.tokens.len();
    if v.scores.len() != n {
        return Err(Error::Tokenizer(format!(
            "SentencePiece vocabulary has {} scores for {n} tokens",
            v.scores.len()
        )));
    }
    let vocab = vocab_map(&v.tokens);
    // A merge producing a higher-scored token ranks first (ties: by the ids of the parts, as
    // the HF converter orders them).
    let mut merges: Vec<(f32, u32, u32, &str, &str)> = Vec::new();
    for (t, &score) in v.tokens.iter().zip(&v.scores) {
        merges.extend(splits(t, &vocab).map(|(li, ri, l, r)| (score, li, ri, l, r)));
    }
    merges.sort_by(|a, b| match b.0.total_cmp(&a.0) {
        Ordering::Equal => (a.1, a.2).cmp(&(b.1, b.2)),
        o => o,
    });
    // About two merges per token (Gemma 3: 514 847 for 262 144 tokens).
    let n_merges = merges.len();
    let merges = merges
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = v.unk.and_then(|id| v.tokens.get(id as usize)) {
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder.build().map_err(|e| tok_err("BPE", e))?;

    let add_prefix = v.add_space_prefix.unwrap_or(true);
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_prefix {
        normalizers.push(Prepend::new(SPACE.into()).into());
    }
    normalizers.push(
        Replace::new(" ", SPACE)
            .map_err(|e| tok_err("normalizer", e))?
            .into(),
    );
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE, " ")
            .map_err(|e| tok_err("decoder", e))?
            .into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(Some(Sequence::new(normalizers)))
        .map_err(|e| tok_err("normalizer", e))?;
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    add_special(&mut tok, v)?;
    Ok((tok, n_merges))
}

#[cfg(test)]
mod tests {
    use crate::tokenizer::fixtures::{HELLO_PIECES, sentencepiece_vocab};
    use crate::tokenizer::{GgufVocab, Tokenizer};

    /// The synthetic SentencePiece vocabulary with the pieces of "hello" and " w".
    fn vocab() -> GgufVocab {
        sentencepiece_vocab(HELLO_PIECES)
    }

    fn tok() -> Tokenizer {
        Tokenizer::from_gguf(&vocab()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn id(t: &Tokenizer, s: &str) -> u32 {
        t.token_to_id(s).unwrap_or_else(|| panic!("{s} missing"))
    }

    #[test]
    fn merges_follow_scores_and_bos_is_added() {
        let t = tok();
        let ids = t.encode("hello hello").unwrap_or_else(|e| panic!("{e}"));
        let hello = id(&t, "▁hello");
        assert_eq!(ids, vec![1, hello, hello]);
        assert_eq!(t.decode(&ids[1..]).ok().as_deref(), Some("hello hello"));
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let t = tok();
        let ids = t.encode("é").unwrap_or_else(|e| panic!("{e}"));
        // bos, ▁, then C3 A9 as byte tokens.
        assert_eq!(
            ids,
            vec![1, id(&t, "▁"), id(&t, "<0xC3>"), id(&t, "<0xA9>")]
        );
        assert_eq!(t.decode(&ids[1..]).ok().as_deref(), Some("é"));
    }

    #[test]
    fn stream_keeps_spaces_and_whole_characters() {
        let t = tok();
        let ids = t
            .encode("hello hello é w")
            .unwrap_or_else(|e| panic!("{e}"));
        let mut s = crate::tokenizer::TextStream::default();
        let mut out = String::new();
        for &i in &ids[1..] {
            if let Some(p) = s.push(&t, i).unwrap_or_else(|e| panic!("{e}")) {
                assert!(!p.contains('\u{FFFD}'), "{p:?}");
                out.push_str(&p);
            }
        }
        if let Some(p) = s.finish(&t).unwrap_or_else(|e| panic!("{e}")) {
            out.push_str(&p);
        }
        assert_eq!(out, "hello hello é w");
    }

    #[test]
    fn scores_must_match_tokens() {
        let mut v = vocab();
        v.scores.pop();
        assert!(Tokenizer::from_gguf(&v).is_err());
    }
}
