//! Building a `tokenizers` tokenizer from GGUF vocabulary metadata.
//!
//! `gpt2` (byte-level BPE): the pre-tokenizer follows llama.cpp's regexes for each
//! `tokenizer.ggml.pre` value (`llama-vocab.cpp`), expressed as `tokenizers` pre-tokenizers:
//!
//! | `pre` | split rules |
//! |---|---|
//! | `gpt-2`, `gpt2`, `mpt`, `olmo`, `jais` | the GPT-2 regex |
//! | `smollm`, `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`, `minerva` | digits one by one, then the GPT-2 regex |
//! | `llama-bpe`, `llama3`, `llama-v3`, `falcon3`, `pixtral`, `smaug-bpe`, `dbrx` | the Llama 3 regex (digits in runs of up to 3), whole-word vocabulary hits skip merging |
//! | `qwen2`, `stablelm2`, `deepseek-r1-qwen` | the Llama 3 regex with single digits |
//! | `default` or absent | llama.cpp's fallback: punctuation runs, the GPT-2 regex, digit runs, groups of 3 digits |
//!
//! Any other `pre` is an error naming it rather than a silent GPT-2 fallback: a wrong split
//! gives plausible-looking but wrong ids, and the model then answers worse with no sign why.
//!
//! `llama` (SentencePiece BPE): merges are derived from the token scores the way Hugging Face's
//! converter does, with byte fallback (`<0xNN>` tokens) and `▁` for spaces.

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::GgufVocab;
use crate::{Error, Result};

/// Largest vocabulary accepted (2^24 ids), far above any real model; it bounds what a corrupt
/// file can make us allocate.
pub const MAX_VOCAB: usize = 1 << 24;

/// The `tokenizer.ggml.pre` values [`super::Tokenizer::from_gguf`] accepts for `gpt2` models.
pub const SUPPORTED_PRE: &[&str] = &[
    "default",
    "gpt-2",
    "gpt2",
    "mpt",
    "olmo",
    "jais",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva",
    "llama-bpe",
    "llama3",
    "llama-v3",
    "falcon3",
    "pixtral",
    "smaug-bpe",
    "dbrx",
    "qwen2",
    "stablelm2",
    "deepseek-r1-qwen",
];

/// GGUF token types.
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// The GPT-2 split regex (as `tokenizers`' ByteLevel uses it; llama.cpp's lacks the final
/// `|\s+`, which changes nothing because llama.cpp keeps unmatched text as its own piece).
const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split regex (llama.cpp's case-insensitive-contraction form).
const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: Llama 3's with single digits.
const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `pre` value splits text before BPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PreKind {
    Gpt2,
    DigitsThenGpt2,
    Llama3,
    Qwen2,
    Default,
}

pub(super) fn pre_kind(pre: Option<&str>) -> Result<PreKind> {
    Ok(match pre.unwrap_or("default") {
        "default" => PreKind::Default,
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" => PreKind::Gpt2,
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            PreKind::DigitsThenGpt2
        }
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "pixtral" | "smaug-bpe" | "dbrx" => {
            PreKind::Llama3
        }
        "qwen2" | "stablelm2" | "deepseek-r1-qwen" => PreKind::Qwen2,
        other => {
            return Err(Error::Tokenizer(format!(
                "unsupported pre-tokenizer `tokenizer.ggml.pre = {other}`; supported: {}",
                SUPPORTED_PRE.join(", ")
            )));
        }
    })
}

fn split(re: &str) -> Result<PreTokenizerWrapper> {
    Split::new(
        SplitPattern::Regex(re.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map(PreTokenizerWrapper::from)
    .map_err(|e| Error::Tokenizer(format!("split regex `{re}`: {e}")))
}

pub(super) fn pre_tokenizer(kind: PreKind) -> Result<PreTokenizerWrapper> {
    // With the GPT-2 regex built in, ByteLevel splits and maps bytes in one step.
    let byte_level_regex = PreTokenizerWrapper::from(ByteLevel::new(false, true, true));
    let byte_level_plain = PreTokenizerWrapper::from(ByteLevel::new(false, true, false));
    let steps = match kind {
        PreKind::Gpt2 => return Ok(byte_level_regex),
        PreKind::DigitsThenGpt2 => vec![Digits::new(true).into(), byte_level_regex],
        PreKind::Llama3 => vec![split(LLAMA3_RE)?, byte_level_plain],
        PreKind::Qwen2 => vec![split(QWEN2_RE)?, byte_level_plain],
        PreKind::Default => vec![
            split(r"[\p{P}\$\+<=>\^~\|]+")?,
            split(GPT2_RE)?,
            split(r"\p{N}+")?,
            split(r"[0-9][0-9][0-9]")?,
            byte_level_plain,
        ],
    };
    Ok(Sequence::new(steps).into())
}

/// Checks the parts of `v` every model type relies on: sizes, ids in range.
pub(super) fn check_common(v: &GgufVocab) -> Result<()> {
    let n = v.tokens.len();
    if n == 0 {
        return Err(Error::Tokenizer("the vocabulary has no tokens".into()));
    }
    if n > MAX_VOCAB {
        return Err(Error::Tokenizer(format!(
            "the vocabulary has {n} tokens, more than the {MAX_VOCAB} accepted"
        )));
    }
    if !v.token_types.is_empty() && v.token_types.len() != n {
        return Err(Error::Tokenizer(format!(
            "{} token types for {n} tokens",
            v.token_types.len()
        )));
    }
    for (name, id) in [("bos", v.bos), ("eos", v.eos), ("unk", v.unk)] {
        if let Some(id) = id
            && id as usize >= n
        {
            return Err(Error::Tokenizer(format!(
                "{name} token id {id} is out of range ({n} tokens)"
            )));
        }
    }
    if v.add_bos && v.bos.is_none() {
        return Err(Error::Tokenizer(
            "add_bos_token is set but there is no bos token id".into(),
        ));
    }
    Ok(())
}

/// Token text → id; the first occurrence wins when a (broken) vocabulary repeats a text.
pub(super) fn vocab_map(tokens: &[String]) -> Vocab {
    let mut map = Vocab::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        // `check_common` bounds the count by MAX_VOCAB, so the id fits in u32.
        map.entry(t.clone()).or_insert(id as u32);
    }
    map
}

/// Splits a GGUF merge `"left right"` at the first space after the first byte (llama.cpp's
/// rule, so that a left part that is itself a space still parses).
pub(super) fn split_merge(m: &str) -> Option<(&str, &str)> {
    let first = m.chars().next()?.len_utf8();
    let pos = m[first..].find(' ')? + first;
    Some((&m[..pos], &m[pos + 1..]))
}

/// Checks one merge against the vocabulary: both parts and their concatenation must be tokens.
/// (`tokenizers` would panic on a merge whose result is longer than every token.)
pub(super) fn check_merge<F: Fn(&str) -> bool>(i: usize, a: &str, b: &str, has: F) -> Result<()> {
    for part in [a, b] {
        if !has(part) {
            return Err(Error::Tokenizer(format!(
                "merge {i} (`{a} {b}`) refers to `{part}`, which is not in the vocabulary"
            )));
        }
    }
    let joined = format!("{a}{b}");
    if !has(&joined) {
        return Err(Error::Tokenizer(format!(
            "merge {i} (`{a} {b}`) produces `{joined}`, which is not in the vocabulary"
        )));
    }
    Ok(())
}

/// The `tokenizers` tokenizer of a `gpt2` (byte-level BPE) vocabulary, and how many merges it
/// holds.
pub(super) fn build_byte_level(v: &GgufVocab) -> Result<(tokenizers::Tokenizer, usize)> {
    let kind = pre_kind(v.pre.as_deref())?;
    let vocab = vocab_map(&v.tokens);
    let mut merges = Vec::with_capacity(v.merges.len());
    for (i, m) in v.merges.iter().enumerate() {
        let (a, b) = split_merge(m).ok_or_else(|| {
            Error::Tokenizer(format!(
                "merge {i} (`{m}`) is not two tokens separated by a space"
            ))
        })?;
        check_merge(i, a, b, |t| vocab.contains_key(t))?;
        merges.push((a.to_string(), b.to_string()));
    }
    let n_merges = merges.len();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        // llama.cpp takes a whole pre-token found in the vocabulary as is for Llama 3.
        .ignore_merges(kind == PreKind::Llama3)
        .build()
        .map_err(|e| Error::Tokenizer(format!("byte-level BPE: {e}")))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer(kind)?));
    // ByteLevel is also the decoder (bytes back to text) and a post-processor that adds no ids.
    tok.with_decoder(Some(ByteLevel::new(false, true, true)));
    tok.with_post_processor(Some(ByteLevel::new(false, false, true)));
    add_special(&mut tok, v)?;
    Ok((tok, n_merges))
}

/// The control (special) and user-defined tokens of `v`, with their types: those
/// [`add_special`] adds.
pub(super) fn added_tokens(v: &GgufVocab) -> impl Iterator<Item = (i32, &String)> {
    v.token_types
        .iter()
        .zip(&v.tokens)
        .filter(|(ty, text)| {
            (**ty == TYPE_CONTROL || **ty == TYPE_USER_DEFINED) && !text.is_empty()
        })
        .map(|(ty, text)| (*ty, text))
}

/// Adds control (special) and user-defined tokens so that they are matched as single ids when
/// written in text.
pub(super) fn add_special(tok: &mut tokenizers::Tokenizer, v: &GgufVocab) -> Result<()> {
    let added: Vec<AddedToken> = added_tokens(v)
        .map(|(ty, text)| AddedToken::from(text.clone(), ty == TYPE_CONTROL))
        .collect();
    if !added.is_empty() {
        tok.add_tokens(added)
            .map_err(|e| Error::Tokenizer(format!("adding special tokens: {e}")))?;
    }
    Ok(())
}

/// Checks the merges of a `tokenizer.json` BPE model before `tokenizers` sees them (it panics on
/// some malformed merges), and returns how many there are (0 for other models). Other models
/// and malformed JSON are left to `tokenizers`' own errors.
pub(super) fn check_json_merges(json: &str) -> Result<usize> {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(json) else {
        return Ok(0); // `tokenizers` reports the syntax error with its position.
    };
    let model = &value["model"];
    if model["type"].as_str() != Some("BPE") {
        return Ok(0);
    }
    let (Some(vocab), Some(merges)) = (model["vocab"].as_object(), model["merges"].as_array())
    else {
        return Ok(0);
    };
    let prefix_len = model["continuing_subword_prefix"]
        .as_str()
        .map_or(0, str::len);
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = match m {
            serde_json::Value::String(s) => match s.split_once(' ') {
                Some(p) => p,
                None => {
                    return Err(Error::Tokenizer(format!(
                        "tokenizer.json: merge {i} (`{s}`) is not two tokens separated by a space"
                    )));
                }
            },
            serde_json::Value::Array(pair) => match (pair.first(), pair.get(1), pair.len()) {
                (Some(serde_json::Value::String(a)), Some(serde_json::Value::String(b)), 2) => {
                    (a.as_str(), b.as_str())
                }
                _ => {
                    return Err(Error::Tokenizer(format!(
                        "tokenizer.json: merge {i} is not a pair of strings"
                    )));
                }
            },
            _ => {
                return Err(Error::Tokenizer(format!(
                    "tokenizer.json: merge {i} is neither a string nor a pair"
                )));
            }
        };
        let b_joined = b.get(prefix_len..).ok_or_else(|| {
            Error::Tokenizer(format!(
                "tokenizer.json: merge {i}: `{b}` is shorter than the subword prefix"
            ))
        })?;
        for part in [a, b] {
            if !vocab.contains_key(part) {
                return Err(Error::Tokenizer(format!(
                    "tokenizer.json: merge {i} refers to `{part}`, which is not in the vocabulary"
                )));
            }
        }
        let joined = format!("{a}{b_joined}");
        if !vocab.contains_key(&joined) {
            return Err(Error::Tokenizer(format!(
                "tokenizer.json: merge {i} produces `{joined}`, which is not in the vocabulary"
            )));
        }
    }
    Ok(merges.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_merge_follows_llama_cpp() {
        assert_eq!(split_merge("a b"), Some(("a", "b")));
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("  x"), Some((" ", "x")));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
        assert_eq!(split_merge("é b"), Some(("é", "b")));
    }

    #[test]
    fn pre_kinds() {
        assert_eq!(pre_kind(None).ok(), Some(PreKind::Default));
        assert_eq!(pre_kind(Some("smollm")).ok(), Some(PreKind::DigitsThenGpt2));
        assert_eq!(pre_kind(Some("llama-bpe")).ok(), Some(PreKind::Llama3));
        assert_eq!(pre_kind(Some("qwen2")).ok(), Some(PreKind::Qwen2));
        for p in SUPPORTED_PRE {
            assert!(pre_kind(Some(p)).is_ok(), "{p}");
        }
        let err = pre_kind(Some("klingon")).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("klingon")));
    }

    #[test]
    fn every_split_regex_compiles() {
        for kind in [
            PreKind::Gpt2,
            PreKind::DigitsThenGpt2,
            PreKind::Llama3,
            PreKind::Qwen2,
            PreKind::Default,
        ] {
            assert!(pre_tokenizer(kind).is_ok(), "{kind:?}");
        }
    }
}
