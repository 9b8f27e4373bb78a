//! Text ↔ token ids.
//!
//! - [`Tokenizer::from_gguf`] builds the tokenizer a GGUF file describes (`tokenizer.ggml.*`):
//!   byte-level BPE (`gpt2`) with llama.cpp's per-`pre` split rules, or SentencePiece BPE
//!   (`llama`) from scores. See [`gguf`] for the supported `pre` values. It is the engine's own
//!   compact BPE ([`bpe`]: a tenth of the `tokenizers` crate's memory, which matters on a device
//!   whose budget is smaller than the model); the crate's tokenizer built from the same
//!   metadata is its test oracle.
//! - [`Tokenizer::stored`] gives what a `.lsm` file keeps ([`StoredTokenizer`]: the GGUF
//!   vocabulary, or `tokenizer.json` text), [`Tokenizer::from_stored`] rebuilds it; the special
//!   ids travel separately as [`SpecialTokens`].
//! - [`Tokenizer::from_json`] loads a Hugging Face `tokenizer.json` (safetensors directories)
//!   through the `tokenizers` crate (pure-Rust features only); [`Tokenizer::to_json`] writes
//!   any tokenizer in that form.
//! - [`TextStream`] decodes for the generation loop: one id in, the newly
//!   completed text out, with split multi-byte characters held back until they are whole.
//! - [`Tokenizer::token_bytes`] gives the raw bytes each id stands for ([`TokenBytes`]), which
//!   constrained decoding matches against a grammar.

mod added;
mod bpe;
mod bytes;
mod gguf;
mod spm;
mod stream;

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub use bytes::TokenBytes;
pub use gguf::{MAX_VOCAB, SUPPORTED_PRE};
pub use stream::TextStream;

/// The tokenizer fields of a GGUF file's metadata (`tokenizer.ggml.*`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`, e.g. `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `smollm`, `llama-bpe`, `qwen2`. Absent means `default`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token text by id (byte-level tokens use GPT-2's byte↔char map).
    pub tokens: Vec<String>,
    /// GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    /// Empty means "all normal"; otherwise exactly one per token.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: `"left right"`, highest priority first (`gpt2` only).
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores`: one per token (`llama` only; higher merges first). Empty when
    /// the file has none.
    pub scores: Vec<f32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    /// `tokenizer.ggml.add_space_prefix` (`llama` only; llama.cpp's default is `true`).
    pub add_space_prefix: Option<bool>,
}

/// Ids with a special meaning to generation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    /// Generation stops at any of these.
    pub eos: Vec<u32>,
    /// Prepend `bos` when encoding a prompt.
    pub add_bos: bool,
}

/// A tokenizer as a `.lsm` header stores it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StoredTokenizer {
    /// A GGUF vocabulary (rebuilt with the engine's own BPE).
    Vocab(GgufVocab),
    /// `tokenizer.json` text (rebuilt with the `tokenizers` crate).
    Json(String),
}

/// Which implementation encodes and decodes.
#[derive(Clone)]
enum Backend {
    /// The engine's compact BPE over a GGUF vocabulary.
    Gguf(std::sync::Arc<bpe::Bpe>),
    /// The `tokenizers` crate over a `tokenizer.json`.
    Json(Box<tokenizers::Tokenizer>),
}

/// A model's tokenizer.
///
/// Invariants: every id in `specials` is `< vocab_size`; `special_ids` is sorted.
#[derive(Clone)]
pub struct Tokenizer {
    backend: Backend,
    specials: SpecialTokens,
    /// One past the largest id the tokenizer knows (model vocabulary and added tokens).
    vocab_size: usize,
    /// Ids of control tokens (added tokens marked special) and of `specials`, sorted.
    special_ids: Vec<u32>,
    /// [`Tokenizer::heap_bytes`], computed once from the vocabulary.
    heap_bytes: u64,
}

/// A summary: the derived form would print the whole vocabulary.
impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("specials", &self.specials)
            .field("special_ids", &self.special_ids.len())
            .finish_non_exhaustive()
    }
}

/// Texts of the end-of-turn control tokens that stop generation besides the eos id.
const END_OF_TURN: [&str; 4] = ["<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|eom_id|>"];

/// Heap an added token costs in the tokenizers crate's added vocabulary: its `AddedToken`, its
/// entries in two maps and a set, and its share of the two Aho-Corasick automata that find
/// added tokens in text. Measured on Gemma 3 (6 414 added tokens: about 250 bytes each), with
/// a margin.
const ADDED_TOKEN_BYTES: usize = 320;

impl Tokenizer {
    /// Builds the tokenizer described by GGUF metadata. Bad metadata (too many tokens, merges
    /// naming missing tokens, ids out of range, an unknown `pre`) is an [`Error::Tokenizer`]
    /// naming what is wrong; it never panics.
    pub fn from_gguf(v: &GgufVocab) -> Result<Tokenizer> {
        Tokenizer::from_vocab(v, Tokenizer::gguf_specials(v))
    }

    /// The special ids [`Tokenizer::from_gguf`] gives `v`: its bos, its eos and every control
    /// token spelled like an end-of-turn marker.
    fn gguf_specials(v: &GgufVocab) -> SpecialTokens {
        // Chat models end a turn with their own marker, which the metadata's one eos id often is
        // not (Gemma: `<eos>` is 1, a turn ends with `<end_of_turn>`): as llama.cpp does, a
        // control token spelled like a known end-of-turn marker stops generation too.
        let end_of_turn = v.tokens.iter().enumerate().filter(|&(i, t)| {
            END_OF_TURN.contains(&t.as_str()) && v.token_types.get(i).is_none_or(|&ty| ty == 3)
        });
        let mut eos: Vec<u32> = v.eos.into_iter().collect();
        for (i, _) in end_of_turn {
            if !eos.contains(&(i as u32)) {
                eos.push(i as u32);
            }
        }
        SpecialTokens {
            bos: v.bos,
            eos,
            add_bos: v.add_bos,
        }
    }

    /// Builds the engine's BPE for `v` with the given special ids (a `.lsm` header stores
    /// them next to the vocabulary).
    fn from_vocab(v: &GgufVocab, specials: SpecialTokens) -> Result<Tokenizer> {
        gguf::check_common(v)?;
        let bpe = bpe::Bpe::new(v)?;
        let vocab_size = bpe.vocab_size();
        let control = (0..vocab_size as u32).filter(|&id| bpe.is_control(id));
        let control: Vec<u32> = control
            .filter_map(|id| bpe.id_to_token(id).and_then(|t| bpe.token_to_id(&t)))
            .collect();
        let heap = bpe.heap_bytes();
        Tokenizer::assemble(
            Backend::Gguf(std::sync::Arc::new(bpe)),
            vocab_size,
            control,
            specials,
            heap,
        )
    }

    /// Rebuilds a tokenizer from what [`Tokenizer::stored`] gave.
    pub fn from_stored(stored: &StoredTokenizer, specials: SpecialTokens) -> Result<Tokenizer> {
        match stored {
            StoredTokenizer::Vocab(v) => Tokenizer::from_vocab(v, specials),
            StoredTokenizer::Json(json) => Tokenizer::from_json(json, specials),
        }
    }

    /// What a `.lsm` header keeps of this tokenizer (with [`Tokenizer::specials`] beside it).
    pub fn stored(&self) -> Result<StoredTokenizer> {
        Ok(match &self.backend {
            Backend::Gguf(bpe) => StoredTokenizer::Vocab(bpe.to_vocab(&self.specials, bpe.unk())),
            Backend::Json(_) => StoredTokenizer::Json(self.to_json()?),
        })
    }

    /// Heap bytes [`Tokenizer::from_gguf`] would report for `v`, at most (memory estimates
    /// that read only a file's header).
    pub fn gguf_heap_bytes_bound(v: &GgufVocab) -> u64 {
        // Special ids: the control tokens and bos/eos, 4 bytes each.
        bpe::Bpe::heap_bytes_bound(v) + 4 * (gguf::added_tokens(v).count() as u64 + 8)
    }

    /// Loads `tokenizer.json` text (with special tokens given by the caller, from config files
    /// or the `.lsm` header). A malformed file is an [`Error::Tokenizer`], never a panic.
    pub fn from_json(json: &str, specials: SpecialTokens) -> Result<Tokenizer> {
        let merges = gguf::check_json_merges(json)?;
        let parsed = catch_unwind(AssertUnwindSafe(|| {
            tokenizers::Tokenizer::from_bytes(json.as_bytes())
        }))
        .map_err(|_| {
            Error::Tokenizer("tokenizer.json could not be loaded (parser panicked)".into())
        })?;
        let inner = parsed.map_err(|e| Error::Tokenizer(format!("tokenizer.json: {e}")))?;
        Tokenizer::from_crate(inner, specials, merges)
    }

    /// Wraps a `tokenizers` tokenizer holding `merges` BPE merges (the crate keeps its table
    /// private, so its heap is estimated from its vocabulary).
    fn from_crate(
        inner: tokenizers::Tokenizer,
        specials: SpecialTokens,
        merges: usize,
    ) -> Result<Tokenizer> {
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let strings = vocab.keys().map(|t| Tokenizer::malloc_block(t.len())).sum();
        let added = inner.get_added_vocabulary().len();
        let heap_bytes = Tokenizer::heap_bytes_bound(vocab.len(), strings, merges, added);
        drop(vocab);
        let control: Vec<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        Tokenizer::assemble(
            Backend::Json(Box::new(inner)),
            vocab_size,
            control,
            specials,
            heap_bytes,
        )
    }

    /// The `tokenizers` crate's tokenizer for a GGUF vocabulary: the reference the engine's
    /// own BPE ([`Tokenizer::from_gguf`]) is tested against, id for id. Not for serving: it
    /// holds several times the memory.
    pub fn from_gguf_with_crate(v: &GgufVocab) -> Result<Tokenizer> {
        gguf::check_common(v)?;
        let (inner, merges) = build_oracle(v)?;
        Tokenizer::from_crate(inner, Tokenizer::gguf_specials(v), merges)
    }

    /// Checks `specials` against the vocabulary and caches the lookups `is_special` needs
    /// (`control`: the control tokens' ids).
    fn assemble(
        backend: Backend,
        vocab_size: usize,
        control: Vec<u32>,
        specials: SpecialTokens,
        heap_bytes: u64,
    ) -> Result<Tokenizer> {
        let ids = specials.bos.iter().chain(specials.eos.iter());
        for &id in ids.clone() {
            if id as usize >= vocab_size {
                return Err(Error::Tokenizer(format!(
                    "special token id {id} is out of range (vocabulary size {vocab_size})"
                )));
            }
        }
        if specials.add_bos && specials.bos.is_none() {
            return Err(Error::Tokenizer(
                "add_bos is set but there is no bos token".into(),
            ));
        }
        let mut special_ids: Vec<u32> = control.into_iter().chain(ids.copied()).collect();
        special_ids.sort_unstable();
        special_ids.dedup();
        special_ids.shrink_to_fit();
        Ok(Tokenizer {
            backend,
            specials,
            vocab_size,
            heap_bytes: heap_bytes + (special_ids.capacity() * 4) as u64,
            special_ids,
        })
    }

    /// Heap bytes this tokenizer holds: for a GGUF vocabulary the sizes of the engine's BPE
    /// tables; for a `tokenizer.json`, estimated (the tokenizers crate does not report its
    /// size) as [`Tokenizer::heap_bytes_bound`] of its vocabulary. Both are checked against a
    /// counting allocator that counts what malloc holds for each block (`tests/model_bytes.rs`).
    /// Not counted: the crate's encode cache, which grows with use (bounded by the crate,
    /// 10 000 words).
    pub fn heap_bytes(&self) -> u64 {
        self.heap_bytes
    }

    /// What glibc's malloc holds for a block of `len` bytes on a 64-bit target: the block and
    /// its 8-byte header rounded up to 16, at least 32. A vocabulary is hundreds of thousands of
    /// short strings, so this, not their length, is what they cost (Gemma 3: 262 144 tokens of 9
    /// bytes on average take 32 bytes each, twice).
    pub fn malloc_block(len: usize) -> usize {
        (len + 8).next_multiple_of(16).max(32)
    }

    /// The heap a tokenizer of `tokens` tokens whose texts take `strings` bytes of malloc blocks
    /// ([`Tokenizer::malloc_block`] of each length, summed), `merges` BPE merges and `added`
    /// added tokens holds, as the tokenizers crate lays it out: per token, its text twice (the
    /// vocabulary and its reverse map) and a slot in each of the two hash maps; per merge, a
    /// slot of the merge map; a hash map of n entries has the power of two of slots above
    /// n · 8/7; per added token, its entries in the added vocabulary's maps, sets and
    /// Aho-Corasick automata ([`ADDED_TOKEN_BYTES`]).
    pub fn heap_bytes_bound(tokens: usize, strings: usize, merges: usize, added: usize) -> u64 {
        /// One hash slot of `String → u32` or `u32 → String`, with its control byte.
        const TOKEN_SLOT: usize = 33;
        /// One hash slot of `(u32, u32) → (u32, u32)`, with its control byte.
        const MERGE_SLOT: usize = 17;
        let slots = |n: usize| (n * 8 / 7).next_power_of_two().max(4);
        (2 * strings
            + 2 * slots(tokens) * TOKEN_SLOT
            + slots(merges) * MERGE_SLOT
            + added * ADDED_TOKEN_BYTES
            + (64 << 10)) as u64
    }

    /// Serialises to `tokenizer.json` form. The special ids are not part of it: store
    /// [`Tokenizer::specials`] alongside. A GGUF vocabulary goes through the `tokenizers`
    /// crate's tokenizer built from it (a transient of several times the engine's tables).
    pub fn to_json(&self) -> Result<String> {
        let json = |t: &tokenizers::Tokenizer| {
            t.to_string(false)
                .map_err(|e| Error::Tokenizer(e.to_string()))
        };
        match &self.backend {
            Backend::Gguf(bpe) => json(&build_oracle(&bpe.to_vocab(&self.specials, bpe.unk()))?.0),
            Backend::Json(inner) => json(inner),
        }
    }

    /// Whether token texts are byte-level (GPT-2's byte chars) rather than SentencePiece's.
    fn is_byte_level(&self) -> bool {
        match &self.backend {
            Backend::Gguf(bpe) => bpe.is_byte_level(),
            Backend::Json(inner) => matches!(
                inner.get_decoder(),
                Some(tokenizers::DecoderWrapper::ByteLevel(_))
            ),
        }
    }

    /// The ids with a meaning to generation.
    pub fn specials(&self) -> &SpecialTokens {
        &self.specials
    }

    /// Number of ids: one past the largest id the tokenizer knows. For a GGUF vocabulary this is
    /// the number of tokens (the rows of the embedding matrix).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token text of `id` as stored in the vocabulary (byte-level tokens in their mapped
    /// form, e.g. `Ġthe`), or `None` for an unknown id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Gguf(bpe) => bpe.id_to_token(id),
            Backend::Json(inner) => inner.id_to_token(id),
        }
    }

    /// The id of a token text exactly as stored in the vocabulary (e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Gguf(bpe) => bpe.token_to_id(token),
            Backend::Json(inner) => inner.token_to_id(token),
        }
    }

    /// Whether `id` is a control token (GGUF type 3, or an added token marked special) or one
    /// of the bos/eos ids.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.binary_search(&id).is_ok()
    }

    /// Whether generation stops at `id`.
    pub fn is_eos(&self, id: u32) -> bool {
        self.specials.eos.contains(&id)
    }

    /// Encodes text, prepending `bos` when [`SpecialTokens::add_bos`] is set. Special tokens
    /// written in the text (e.g. `<|im_start|>`) are recognised as single ids, so text from an
    /// untrusted user should not be put into a prompt that goes through here: a chat goes
    /// through [`crate::chat::ChatTemplate::render_ids`], which keeps its messages plain.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with_plain(text, &[])
    }

    /// [`Tokenizer::encode`], except that no control token is taken from where it would overlap
    /// a byte range of `plain` (sorted, not overlapping, on character boundaries): text there
    /// is encoded as ordinary text whatever it spells. With a GGUF vocabulary the ids are those
    /// of the whole text with those control tokens unknown; with a `tokenizer.json` each plain
    /// range is encoded a character at a time (the crate cannot switch special tokens off for
    /// a call), which only text that spells a control token ever needs.
    pub(crate) fn encode_with_plain(&self, text: &str, plain: &[Range<usize>]) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if self.specials.add_bos {
            out.extend(self.specials.bos);
        }
        match &self.backend {
            Backend::Gguf(bpe) => out.extend(bpe.encode(text, plain)?),
            Backend::Json(inner) => {
                let mut encode = |piece: &str| -> Result<()> {
                    let enc = inner
                        .encode(piece, false)
                        .map_err(|e| Error::Tokenizer(e.to_string()))?;
                    out.extend_from_slice(enc.get_ids());
                    Ok(())
                };
                let bad_range = || Error::Tokenizer("a plain range lies outside the text".into());
                let mut from = 0;
                for range in plain {
                    encode(text.get(from..range.start).ok_or_else(bad_range)?)?;
                    let inside = text.get(range.clone()).ok_or_else(bad_range)?;
                    for (i, c) in inside.char_indices() {
                        encode(&inside[i..i + c.len_utf8()])?;
                    }
                    from = range.end;
                }
                if plain.is_empty() || from < text.len() {
                    encode(text.get(from..).ok_or_else(bad_range)?)?;
                }
            }
        }
        Ok(out)
    }

    /// Byte ranges of the control tokens [`Tokenizer::encode`] recognises in `text`, leftmost
    /// first.
    pub(crate) fn control_spans(&self, text: &str) -> Vec<Range<usize>> {
        match &self.backend {
            Backend::Gguf(bpe) => bpe.control_spans(text),
            Backend::Json(inner) => {
                let decoder = inner.get_added_tokens_decoder();
                let special = decoder.into_iter().filter(|(_, t)| t.special);
                added::AddedSet::new(special.map(|(id, t)| (t.content, id))).spans(text)
            }
        }
    }

    /// Decodes ids to text, special tokens included. Unknown ids are an error; bytes that do not
    /// form UTF-8 come out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::Tokenizer(format!(
                "token id {bad} is out of range (vocabulary size {})",
                self.vocab_size
            )));
        }
        match &self.backend {
            Backend::Gguf(bpe) => Ok(bpe.decode(ids)),
            Backend::Json(inner) => inner
                .decode(ids, false)
                .map_err(|e| Error::Tokenizer(e.to_string())),
        }
    }
}

/// Builds the `tokenizers` tokenizer of `v` (the oracle the engine's own BPE is tested against),
/// and says how many BPE merges it holds (its largest table). `gguf` holds what every vocabulary
/// needs and the byte-level builder; `spm` the SentencePiece one, built on `gguf`'s parts.
fn build_oracle(v: &GgufVocab) -> Result<(tokenizers::Tokenizer, usize)> {
    gguf::check_common(v)?;
    match v.model.as_str() {
        "gpt2" => gguf::build_byte_level(v),
        "llama" => spm::build(v),
        other => Err(Error::Tokenizer(format!(
            "unsupported tokenizer model `tokenizer.ggml.model = {other}` (supported: gpt2, llama)"
        ))),
    }
}

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod oracle_tests;
#[cfg(test)]
mod tests;
