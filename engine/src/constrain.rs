//! Constrained decoding: a generation whose text always matches a JSON Schema, a Lark grammar or
//! a regex.
//!
//! Built on `llguidance` (the parser llama.cpp and vLLM use): pure Rust, builds here, takes JSON
//! Schema, Lark and regex, and computes each mask lazily (an Earley parser over a token trie:
//! 0.13 ms/token on SmolLM2's 49k vocabulary, 0.3 ms on Gemma's 262k), no per-schema index.
//! `outlines-core` precompiles a regex×vocabulary index per schema (slow to build, no recursion)
//! and pins `tokenizers` 0.22 with C `onig`; `kbnf` has no JSON Schema. `toktrie_hf_tokenizers`
//! pins `tokenizers` 0.21, so the trie is built from [`Tokenizer::token_bytes`] instead.
//!
//! Life cycle (what is built how often):
//!
//! 1. [`ConstraintVocab::new`] — once per model: the token trie and the parser factory, shared
//!    (`Arc`) by every session of the model.
//! 2. [`Grammar::new`] (or [`Grammar::json_schema`] / [`Grammar::lark`] / [`Grammar::regex`]) —
//!    once per schema: the text checked against the limits that keep llguidance's recursion
//!    within a thread's stack ([`MAX_LARK_DEPTH`], [`MAX_SCHEMA_DEPTH`], ...), then the compiled
//!    grammar. A bad or over-limit schema, or one no text matches, is an
//!    [`Error::InvalidGrammar`] with a one-line reason.
//! 3. [`Grammar::start`] — once per generation: a [`Constraint`], the parser's state.
//! 4. Per token: [`Constraint::mask`] on the logits before sampling, [`Constraint::advance`]
//!    with the sampled id after. Once the grammar is complete ([`Constraint::is_done`]) the mask
//!    allows only the end-of-sequence ids, so a loop that stops at eos ends there.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

pub use crate::error::GrammarKind;
use crate::tokenizer::{TokenBytes, Tokenizer};
use crate::{Error, Result};

mod limits;

pub use limits::{
    MAX_LARK_DEPTH, MAX_LARK_RULES, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NESTING, MAX_SCHEMA_REFS,
};

/// The token trie llguidance walks: every id's bytes, control tokens under the 0xFF marker so
/// that no text grammar can produce them.
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy longest-match tokenisation; only grammars that force literal text use it.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }

    /// Greedy tokenisation is not the model's: forced tokens are not taken from it.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// A model's vocabulary as constrained decoding sees it. Build once per model and share.
pub struct ConstraintVocab {
    factory: ParserFactory,
    /// The end-of-sequence ids (the tokenizer's eos list), allowed once a grammar is complete.
    eos: Vec<u32>,
    vocab_size: usize,
}

/// A summary: the trie is megabytes.
impl std::fmt::Debug for ConstraintVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintVocab")
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl ConstraintVocab {
    /// Builds the token trie of `tokenizer` (about 0.2 s for SmolLM2's 49k vocabulary, 1.7 s
    /// for Gemma's 262k, on 2 cores). Errors if the tokenizer has no end-of-sequence id: a
    /// constrained generation ends with one.
    pub fn new(tokenizer: &Tokenizer) -> Result<Arc<ConstraintVocab>> {
        let eos = tokenizer.specials().eos.clone();
        let Some(&first_eos) = eos.first() else {
            return Err(Error::Tokenizer(
                "constrained decoding needs an end-of-sequence token; the tokenizer has none"
                    .into(),
            ));
        };
        let words: Vec<Vec<u8>> = tokenizer
            .token_bytes()
            .into_iter()
            .map(|t| match t {
                TokenBytes::Text(bytes) => bytes,
                TokenBytes::Control(name) => {
                    let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    b.extend_from_slice(name.as_bytes());
                    b
                }
                TokenBytes::Unknown => Vec::new(),
            })
            .collect();
        let vocab_size = words.len();
        let info = TokRxInfo {
            vocab_size: vocab_size as u32,
            tok_eos: first_eos,
            tok_bos: tokenizer.specials().bos,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TrieEnv { trie });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| Error::Tokenizer(e.to_string()))?;
        // Errors come back as values; nothing is printed to stderr from the daemon's threads, and
        // no parser state dump rides along in them.
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(Arc::new(ConstraintVocab {
            factory,
            eos,
            vocab_size,
        }))
    }

    /// Ids the trie knows (the tokenizer's vocabulary); logits past it are always masked.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The ids a complete grammar allows.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }
}

/// A compiled grammar. Compile once per schema; [`Grammar::start`] each generation.
pub struct Grammar {
    vocab: Arc<ConstraintVocab>,
    kind: GrammarKind,
    /// The parser at the start of the text; each generation runs a deep copy of it.
    start: Matcher,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Grammar {
    /// Compiles `text` as a grammar of `kind`: [`Grammar::json_schema`], [`Grammar::lark`] or
    /// [`Grammar::regex`]. The text is measured first and refused past this module's limits
    /// ([`MAX_LARK_DEPTH`] and the others, which keep llguidance's recursion within a 2 MiB
    /// stack), then compiled, then refused if no text at all can match it.
    pub fn new(vocab: &Arc<ConstraintVocab>, kind: GrammarKind, text: &str) -> Result<Grammar> {
        let grammar =
            top_level(kind, text, true).map_err(|reason| Error::InvalidGrammar { kind, reason })?;
        Grammar::compile(vocab, kind, grammar)
    }

    /// Compiles a JSON Schema (draft 2020-12 subset: types, `enum`, `const`, `properties`,
    /// `required`, `additionalProperties`, `items`, `minLength`/`maxLength`, `pattern`,
    /// numeric bounds, `anyOf`, `$ref`/`$defs`). The text is one line of JSON with `", "` and
    /// `": "` separators unless the schema sets llguidance's own `x-guidance` options.
    pub fn json_schema(vocab: &Arc<ConstraintVocab>, schema: &str) -> Result<Grammar> {
        Grammar::new(vocab, GrammarKind::JsonSchema, schema)
    }

    /// Compiles a grammar in llguidance's Lark dialect (`start: ...` rules, `/regex/` lexemes,
    /// `%json {...}` for an embedded JSON Schema).
    pub fn lark(vocab: &Arc<ConstraintVocab>, grammar: &str) -> Result<Grammar> {
        Grammar::new(vocab, GrammarKind::Lark, grammar)
    }

    /// Compiles a regex (Rust `regex` syntax) the whole text must match.
    pub fn regex(vocab: &Arc<ConstraintVocab>, regex: &str) -> Result<Grammar> {
        Grammar::new(vocab, GrammarKind::Regex, regex)
    }

    /// [`Grammar::new`] without the limits: for the tests that show what they prevent.
    #[cfg(test)]
    pub(crate) fn without_limits(
        vocab: &Arc<ConstraintVocab>,
        kind: GrammarKind,
        text: &str,
    ) -> Result<Grammar> {
        let grammar = top_level(kind, text, false)
            .map_err(|reason| Error::InvalidGrammar { kind, reason })?;
        Grammar::compile(vocab, kind, grammar)
    }

    fn compile(
        vocab: &Arc<ConstraintVocab>,
        kind: GrammarKind,
        grammar: TopLevelGrammar,
    ) -> Result<Grammar> {
        let invalid = |reason: String| Error::InvalidGrammar {
            kind,
            reason: one_line(&reason),
        };
        let parser = vocab
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(format!("{e:#}")))?;
        let mut start = Matcher::new(Ok(parser));
        if let Some(e) = start.get_error() {
            return Err(invalid(e));
        }
        for warning in start.grammar_warnings() {
            tracing::warn!(%kind, "grammar: {}", one_line(&warning));
        }
        // A grammar no text matches (a rule that only refers to itself, an empty regex) is
        // refused here rather than failing the first step of every generation.
        match start.deep_clone().compute_mask_or_eos() {
            Ok(first) if !first.is_zero() => {}
            Ok(_) => return Err(invalid("no text can match it".into())),
            Err(e) => {
                let e = e.to_string();
                let why = e.lines().next().unwrap_or_default();
                return Err(invalid(format!("no text can match it ({why})")));
            }
        }
        Ok(Grammar {
            vocab: vocab.clone(),
            kind,
            start,
        })
    }

    /// What the grammar was compiled from.
    pub fn kind(&self) -> GrammarKind {
        self.kind
    }

    /// A fresh parser state for one generation.
    pub fn start(&self) -> Constraint {
        Constraint {
            matcher: self.start.deep_clone(),
            vocab: self.vocab.clone(),
        }
    }
}

/// What llguidance compiles from `text`, after the checks of `limits` when `checked`. The
/// error is a one-line reason.
fn top_level(kind: GrammarKind, text: &str, checked: bool) -> Result<TopLevelGrammar, String> {
    match kind {
        GrammarKind::JsonSchema => {
            if checked {
                limits::check_schema_text(text)?;
            }
            let mut value: serde_json::Value =
                serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
            if checked {
                limits::check_schema(&value)?;
            }
            match &mut value {
                serde_json::Value::Object(obj) => {
                    // Flexible whitespace lets a small model pad forever; one line reads the same.
                    obj.entry("x-guidance").or_insert_with(|| {
                        serde_json::json!({
                            "whitespace_flexible": false,
                            "item_separator": ", ",
                            "key_separator": ": ",
                        })
                    });
                }
                serde_json::Value::Bool(_) => {}
                _ => return Err("a schema is a JSON object or a boolean".into()),
            }
            Ok(TopLevelGrammar::from_json_schema(value))
        }
        GrammarKind::Lark => {
            if checked {
                limits::check_lark(text)?;
            }
            Ok(TopLevelGrammar::from_lark(text.to_string()))
        }
        GrammarKind::Regex => Ok(TopLevelGrammar::from_regex(text)),
    }
}

/// Most characters of a message from llguidance that an error keeps.
const MAX_REASON_CHARS: usize = 300;

/// `text` as one line of at most [`MAX_REASON_CHARS`] characters, with "…" where anything was
/// cut: its first non-blank line, control characters as spaces. llguidance's messages can carry
/// a source excerpt, a parser state dump or a whole regex; errors reach clients and the journal.
fn one_line(text: &str) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default();
    let mut chars = first.chars().map(|c| {
        if c.is_control() || c == '\u{2028}' || c == '\u{2029}' {
            ' '
        } else {
            c
        }
    });
    let mut out: String = chars.by_ref().take(MAX_REASON_CHARS).collect();
    if chars.next().is_some() || lines.next().is_some() {
        out.push('…');
    }
    out
}

/// One generation's parser state. Per token: [`Constraint::mask`], sample, then
/// [`Constraint::advance`] with the sampled id.
pub struct Constraint {
    matcher: Matcher,
    vocab: Arc<ConstraintVocab>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("done", &self.is_done())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Sets the logit of every id the grammar does not allow next to `-inf`: ids past the
    /// vocabulary (padding rows of the output matrix) included, and everything but the eos ids
    /// once the grammar is complete. Errors if the parser failed or no id can continue.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(constraint_err)?;
        if allowed.is_zero() {
            return Err(Error::Constraint(
                "no token can continue the grammar".into(),
            ));
        }
        apply_mask(&allowed, logits);
        Ok(())
    }

    /// Moves the parser past `token` (the id sampled from masked logits). An eos after the
    /// grammar completed is accepted and changes nothing. Errors if the grammar does not allow
    /// `token` here.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() && self.vocab.eos.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(constraint_err)
    }

    /// The tokens that spell the text the grammar allows as the only continuation here (its
    /// forced bytes, tokenised by greedy longest match), without moving the parser: a draft for
    /// speculative decoding, which the model's own samples then accept or not. Empty when
    /// nothing is forced.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        let bytes = self.matcher.compute_ff_bytes();
        if bytes.is_empty() {
            return Vec::new();
        }
        self.vocab
            .factory
            .tok_env()
            .tok_trie()
            .greedy_tokenize(&bytes)
    }

    /// Whether the grammar is complete and cannot go on: the next mask allows only eos.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the text so far is a complete match (it may still go on, e.g. more digits of a
    /// number). `false` at a `max_tokens` stop means the output is cut short.
    pub fn is_complete(&mut self) -> bool {
        self.is_done() || self.matcher.is_accepting().unwrap_or(false)
    }
}

fn constraint_err(e: impl std::fmt::Display) -> Error {
    Error::Constraint(one_line(&e.to_string()))
}

/// Sets `logits[i]` to `-inf` where bit `i` of `allowed` is clear or past its end.
fn apply_mask(allowed: &SimpleVob, logits: &mut [f32]) {
    let words = allowed.as_slice();
    for (i, chunk) in logits.chunks_mut(32).enumerate() {
        let word = words.get(i).copied().unwrap_or(0);
        if word == u32::MAX {
            continue;
        }
        for (bit, logit) in chunk.iter_mut().enumerate() {
            if word & (1 << bit) == 0 {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests;
