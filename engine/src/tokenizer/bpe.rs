//! The engine's own BPE tokenizer for GGUF vocabularies: the same ids as the `tokenizers` crate
//! built from the same metadata (`super::build_oracle`, kept as the test oracle), in a tenth of
//! its memory.
//!
//! # Why not the `tokenizers` crate here
//! Memory is the product: a device whose budget is smaller than the model reads from storage,
//! every token, each byte the process holds besides weights. The crate keeps every token text
//! twice as its own heap string, hash maps around them and, for a SentencePiece vocabulary, a
//! merge table derived from the scores (Gemma 3: 514 847 merges): 71 MiB of heap for Gemma 3's
//! 262 144 tokens and 8.7 MiB for SmolLM2's 49 152, and about twice that while it builds. This
//! tokenizer holds the texts once, back to back, with a hash index of ids ([`Strings`]), and
//! needs no merge table for SentencePiece: the rank of a merge is the score of the token it
//! makes, looked up when the pair meets. Gemma 3: 7 MiB; SmolLM2: 1.8 MiB.
//!
//! The `tokenizers` crate still does what it does well here: the byte-level pre-tokenizer
//! regexes of [`super::gguf`] (small, and the part that is easiest to get subtly wrong).
//!
//! # What it reproduces, step by step (the crate's pipeline with the settings `gguf` gives it)
//! 1. Control tokens (GGUF type 3) written in the text are cut out as single ids, leftmost
//!    longest first.
//! 2. Each remaining piece is normalised (SentencePiece: `▁` prepended when `add_space_prefix`,
//!    spaces written as `▁`), then user-defined tokens (type 4, matched in their normalised
//!    form) are cut out the same way.
//! 3. Byte-level: each piece is split by the `pre` regexes and mapped to GPT-2's byte chars.
//!    SentencePiece: each piece is one word.
//! 4. Each word starts as one symbol per character (SentencePiece: a character not in the
//!    vocabulary becomes its `<0xNN>` byte tokens, else the unknown token, runs fused), then
//!    the best-ranked adjacent pair is merged until none is left (ties: the leftmost). Rank:
//!    byte-level, the merge's position in `tokenizer.ggml.merges` (the last one listed wins
//!    for a repeated pair); SentencePiece, the score of the token the pair makes (higher
//!    first), then the pair's ids. Llama 3's `pre` takes a word found whole in the vocabulary
//!    as one token.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use super::GgufVocab;
use super::added::AddedSet;
use crate::{Error, Result};

const SPACE: char = '\u{2581}';

/// GGUF token types this tokenizer treats specially.
const TYPE_NORMAL: u8 = 1;
const TYPE_CONTROL: u8 = 3;
const TYPE_USER_DEFINED: u8 = 4;

/// Token texts stored once, back to back, with an open-addressing index from text to id.
///
/// Invariant: `ends.len()` is the number of tokens; token `i` is `bytes[start(i)..ends[i]]`;
/// `index` has a power-of-two length at least twice the number of tokens, and holds `id + 1`
/// of the first token with each text (0: empty slot).
pub(super) struct Strings {
    bytes: Box<[u8]>,
    ends: Box<[u32]>,
    index: Box<[u32]>,
}

/// FNV-1a: token texts are short, and the index only needs a spread, not resistance to
/// adversarial input (the texts come from the model file, not from clients).
fn hash(s: &[u8]) -> u64 {
    s.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Strings {
    /// Fails when the texts do not fit 32-bit offsets (4 GiB of token text).
    fn new(tokens: &[String]) -> Result<Strings> {
        let total: usize = tokens.iter().map(String::len).sum();
        if u32::try_from(total).is_err() {
            return Err(Error::Tokenizer(format!(
                "the vocabulary's texts take {total} bytes, more than 4 GiB"
            )));
        }
        let mut bytes = Vec::with_capacity(total);
        let mut ends = Vec::with_capacity(tokens.len());
        for t in tokens {
            bytes.extend_from_slice(t.as_bytes());
            ends.push(bytes.len() as u32);
        }
        let mut s = Strings {
            bytes: bytes.into_boxed_slice(),
            ends: ends.into_boxed_slice(),
            index: vec![0; Strings::index_len(tokens.len())].into_boxed_slice(),
        };
        let mask = s.index.len() - 1;
        for id in 0..tokens.len() {
            let text = s.get(id as u32).as_bytes();
            let mut slot = hash(text) as usize & mask;
            loop {
                match s.index[slot] {
                    0 => {
                        s.index[slot] = id as u32 + 1;
                        break;
                    }
                    // A repeated text keeps its first id, as a vocabulary map would.
                    other if s.get(other - 1).as_bytes() == text => break,
                    _ => slot = (slot + 1) & mask,
                }
            }
        }
        Ok(s)
    }

    /// Index slots for `n` tokens: at most half full, so probes stay short.
    fn index_len(n: usize) -> usize {
        (2 * n).next_power_of_two().max(4)
    }

    /// Heap bytes of the strings of `tokens` (total text length `text`), as [`Strings::new`]
    /// allocates them.
    fn heap_bytes(tokens: usize, text: usize) -> u64 {
        (text + 4 * tokens + 4 * Strings::index_len(tokens)) as u64
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    /// The text of `id`. Panics on an id out of range (callers check against `len`).
    fn get(&self, id: u32) -> &str {
        let i = id as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        // Built from `String`s cut at their own boundaries, so every range is UTF-8.
        std::str::from_utf8(&self.bytes[start..self.ends[i] as usize])
            .unwrap_or_else(|_| unreachable!("token texts are stored whole"))
    }

    /// The first id whose text is `text`.
    fn id(&self, text: &str) -> Option<u32> {
        let mask = self.index.len() - 1;
        let mut slot = hash(text.as_bytes()) as usize & mask;
        loop {
            match self.index[slot] {
                0 => return None,
                id if self.get(id - 1) == text => return Some(id - 1),
                _ => slot = (slot + 1) & mask,
            }
        }
    }
}

/// How words are made and merged: the two GGUF tokenizer models.
enum Model {
    /// `gpt2`: byte-level BPE with a ranked merge list.
    ByteLevel {
        pre: PreTokenizerWrapper,
        /// Llama 3: a word found whole in the vocabulary is one token.
        ignore_merges: bool,
        /// `(left << 32 | right, rank, merged id)`, sorted by pair.
        merges: Box<[(u64, u32, u32)]>,
    },
    /// `llama`: SentencePiece BPE ranked by the scores, with byte fallback.
    SentencePiece {
        add_space_prefix: bool,
        scores: Box<[f32]>,
        /// The `<0xNN>` token of each byte, where the vocabulary has it.
        byte_ids: Box<[Option<u32>; 256]>,
        unk: Option<u32>,
    },
}

/// The tokenizer: the texts, the token types, the model, and the two added-token passes.
pub(super) struct Bpe {
    strings: Strings,
    /// GGUF token type per id (1 where the file gives none).
    types: Box<[u8]>,
    model: Model,
    /// Step 1: control tokens, matched in the raw text.
    control: AddedSet,
    /// Step 2: user-defined tokens, matched in their normalised form.
    user: AddedSet,
    /// What the file said, kept only to write the vocabulary back ([`Bpe::to_vocab`]).
    pre: Option<String>,
}

/// One symbol of a word being merged: a token id and its neighbours (a linked list over the
/// symbol vector; `removed` once merged into its left neighbour).
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: Option<usize>,
    next: Option<usize>,
    removed: bool,
}

/// A merge's rank: lower merges first. Byte-level: `(rank, 0, 0)`; SentencePiece: the merged
/// token's score (higher first, as ordered bits), then the pair's ids.
type Rank = (u32, u32, u32);

/// `f32::total_cmp` order, descending, as an unsigned integer.
fn descending(score: f32) -> u32 {
    let bits = score.to_bits();
    let ascending = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    !ascending
}

impl Bpe {
    /// Builds the tokenizer for `v`; `super::gguf::check_common` has already checked it.
    pub(super) fn new(v: &GgufVocab) -> Result<Bpe> {
        let strings = Strings::new(&v.tokens)?;
        let types: Box<[u8]> = if v.token_types.is_empty() {
            vec![TYPE_NORMAL; v.tokens.len()].into()
        } else {
            v.token_types
                .iter()
                .map(|&t| u8::try_from(t).unwrap_or(0))
                .collect()
        };
        let model = match v.model.as_str() {
            "gpt2" => Bpe::byte_level(v, &strings)?,
            "llama" => Bpe::sentencepiece(v, &strings)?,
            other => {
                return Err(Error::Tokenizer(format!(
                    "unsupported tokenizer model `tokenizer.ggml.model = {other}` \
                     (supported: gpt2, llama)"
                )));
            }
        };
        let mut bpe = Bpe {
            strings,
            types,
            model,
            control: AddedSet::new(std::iter::empty()),
            user: AddedSet::new(std::iter::empty()),
            pre: v.pre.clone(),
        };
        let added = |ty: u8| {
            let bpe = &bpe;
            (0..bpe.strings.len() as u32).filter_map(move |id| {
                let text = bpe.strings.get(id);
                (bpe.types[id as usize] == ty && !text.is_empty())
                    .then(|| (text, bpe.strings.id(text).unwrap_or(id)))
            })
        };
        let control = AddedSet::new(added(TYPE_CONTROL).map(|(t, id)| (t.to_string(), id)));
        let user = AddedSet::new(added(TYPE_USER_DEFINED).map(|(t, id)| (bpe.normalize(t), id)));
        bpe.control = control;
        bpe.user = user;
        Ok(bpe)
    }

    fn byte_level(v: &GgufVocab, strings: &Strings) -> Result<Model> {
        let kind = super::gguf::pre_kind(v.pre.as_deref())?;
        let mut merges = Vec::with_capacity(v.merges.len());
        for (rank, m) in v.merges.iter().enumerate() {
            let (a, b) = super::gguf::split_merge(m).ok_or_else(|| {
                Error::Tokenizer(format!(
                    "merge {rank} (`{m}`) is not two tokens separated by a space"
                ))
            })?;
            super::gguf::check_merge(rank, a, b, |t| strings.id(t).is_some())?;
            let id = |t: &str| {
                strings
                    .id(t)
                    .unwrap_or_else(|| unreachable!("checked above"))
            };
            let key = u64::from(id(a)) << 32 | u64::from(id(b));
            merges.push((key, rank as u32, id(&format!("{a}{b}"))));
        }
        // A pair listed twice keeps its last rank: stable sort, then keep the last of each run.
        merges.sort_by_key(|m| m.0);
        let mut kept: Vec<(u64, u32, u32)> = Vec::with_capacity(merges.len());
        for m in merges {
            match kept.last_mut() {
                Some(last) if last.0 == m.0 => *last = m,
                _ => kept.push(m),
            }
        }
        Ok(Model::ByteLevel {
            pre: super::gguf::pre_tokenizer(kind)?,
            ignore_merges: kind == super::gguf::PreKind::Llama3,
            merges: kept.into_boxed_slice(),
        })
    }

    fn sentencepiece(v: &GgufVocab, strings: &Strings) -> Result<Model> {
        let n = v.tokens.len();
        if v.scores.len() != n {
            return Err(Error::Tokenizer(format!(
                "SentencePiece vocabulary has {} scores for {n} tokens",
                v.scores.len()
            )));
        }
        let mut byte_ids = Box::new([None; 256]);
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = strings.id(&format!("<0x{b:02X}>"));
        }
        Ok(Model::SentencePiece {
            add_space_prefix: v.add_space_prefix.unwrap_or(true),
            scores: v.scores.clone().into_boxed_slice(),
            byte_ids,
            unk: v.unk.and_then(|id| strings.id(strings.get(id))),
        })
    }

    /// Heap bytes, from the sizes of its tables (exact for the tables; the added-token maps are
    /// counted block by block).
    pub(super) fn heap_bytes(&self) -> u64 {
        let model = match &self.model {
            Model::ByteLevel { merges, .. } => (merges.len() * 16) as u64 + (16 << 10),
            Model::SentencePiece { scores, .. } => (scores.len() * 4 + 256 * 8) as u64,
        };
        // The struct itself lives in an `Arc` (two counters beside it); each of its dozen
        // tables is one allocation, which malloc rounds up to whole pages when it is large.
        (std::mem::size_of::<Bpe>() + 16 + 12 * 4096) as u64
            + Strings::heap_bytes(self.strings.len(), self.strings.bytes.len())
            + self.types.len() as u64
            + model
            + self.control.heap_bytes()
            + self.user.heap_bytes()
    }

    /// A bound of [`Bpe::heap_bytes`] for `v` without building it: for estimates from a file's
    /// header. Each added token is counted at [`ADDED_BOUND`] bytes.
    pub(super) fn heap_bytes_bound(v: &GgufVocab) -> u64 {
        /// One added token: its boxed text (up to 64 bytes of malloc block), its share of a
        /// hash map's buckets (at least 7/16 full: 25 bytes each) and its length entry.
        const ADDED_BOUND: u64 = 64 + 64 + 8;
        let text: usize = v.tokens.iter().map(String::len).sum();
        let n = v.tokens.len();
        let model = match v.model.as_str() {
            "llama" => (n * 4 + 256 * 8) as u64,
            _ => (v.merges.len() * 16) as u64 + (16 << 10),
        };
        let added = super::gguf::added_tokens(v).count() as u64;
        Strings::heap_bytes(n, text) + n as u64 + model + added * ADDED_BOUND + (64 << 10)
    }

    pub(super) fn vocab_size(&self) -> usize {
        self.strings.len()
    }

    pub(super) fn is_control(&self, id: u32) -> bool {
        self.types.get(id as usize) == Some(&TYPE_CONTROL)
    }

    pub(super) fn token_to_id(&self, text: &str) -> Option<u32> {
        self.strings.id(text)
    }

    /// The text a token stands for in decoding: its vocabulary text, or for a user-defined
    /// token its normalised form (the crate's added vocabulary decodes it so).
    pub(super) fn id_to_token(&self, id: u32) -> Option<String> {
        self.token_text(id).map(std::borrow::Cow::into_owned)
    }

    /// [`Bpe::id_to_token`] without a copy for the tokens whose text is stored as is (decoding
    /// runs per generated token).
    fn token_text(&self, id: u32) -> Option<std::borrow::Cow<'_, str>> {
        if id as usize >= self.strings.len() {
            return None;
        }
        let text = self.strings.get(id);
        Some(if self.types[id as usize] == TYPE_USER_DEFINED {
            self.normalize(text).into()
        } else {
            text.into()
        })
    }

    /// Whether the vocabulary is byte-level (GPT-2's byte chars) rather than SentencePiece.
    pub(super) fn is_byte_level(&self) -> bool {
        matches!(self.model, Model::ByteLevel { .. })
    }

    /// SentencePiece's normaliser (a leading `▁` when `add_space_prefix`, spaces as `▁`);
    /// byte-level vocabularies have none.
    fn normalize(&self, text: &str) -> String {
        match &self.model {
            Model::SentencePiece {
                add_space_prefix, ..
            } => {
                let mut out = String::with_capacity(text.len() + 3);
                if *add_space_prefix && !text.is_empty() {
                    out.push(SPACE);
                }
                out.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
                out
            }
            Model::ByteLevel { .. } => text.to_string(),
        }
    }

    /// Encodes `text` (no bos: the caller adds it), steps 1–4 of the module doc, with no
    /// control token taken from where it would overlap a byte range of `plain` (sorted, not
    /// overlapping; see [`AddedSet::split`]).
    pub(super) fn encode(&self, text: &str, plain: &[Range<usize>]) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        let mut pieces = Vec::new();
        self.control.split(text, plain, &mut pieces);
        for (added, piece) in pieces {
            if let Some(id) = added {
                ids.push(id);
                continue;
            }
            let normalized = self.normalize(piece);
            let mut inner = Vec::new();
            self.user.split(&normalized, &[], &mut inner);
            for &(added, piece) in &inner {
                match added {
                    Some(id) => ids.push(id),
                    None => self.encode_piece(piece, &mut ids)?,
                }
            }
        }
        Ok(ids)
    }

    /// Byte ranges of the control tokens [`Bpe::encode`] cuts out of `text` (step 1).
    pub(super) fn control_spans(&self, text: &str) -> Vec<Range<usize>> {
        self.control.spans(text)
    }

    /// Step 3 and 4 for one normalised piece of plain text.
    fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) -> Result<()> {
        match &self.model {
            Model::ByteLevel {
                pre, ignore_merges, ..
            } => {
                let mut pts = PreTokenizedString::from(piece);
                pre.pre_tokenize(&mut pts)
                    .map_err(|e| Error::Tokenizer(format!("pre-tokenizer: {e}")))?;
                for (word, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
                    match self.strings.id(word) {
                        Some(id) if *ignore_merges => ids.push(id),
                        _ => self.merge_word(word, ids),
                    }
                }
            }
            Model::SentencePiece { .. } => self.merge_word(piece, ids),
        }
        Ok(())
    }

    /// The first symbols of `word`: one per character (module doc, step 4).
    fn symbols(&self, word: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(word.len());
        let mut unk: Option<u32> = None;
        for c in word.chars() {
            let mut utf8 = [0; 4];
            let s: &str = c.encode_utf8(&mut utf8);
            if let Some(id) = self.strings.id(s) {
                out.extend(unk.take());
                out.push(id);
                continue;
            }
            if let Model::SentencePiece {
                byte_ids, unk: u, ..
            } = &self.model
            {
                let bytes: Option<Vec<u32>> = s.bytes().map(|b| byte_ids[usize::from(b)]).collect();
                if let Some(bytes) = bytes {
                    // As the crate does, a pending unknown token waits until the next known
                    // character: it may land after these byte tokens.
                    out.extend(bytes);
                    continue;
                }
                // Runs of unknown characters become one unknown token; without one the
                // character is dropped.
                if u.is_some() && unk.is_none() {
                    unk = *u;
                }
            }
        }
        out.extend(unk);
        out
    }

    /// The rank of merging `left` and `right`, and the merged id, if the pair merges.
    fn rank(&self, left: u32, right: u32, buf: &mut String) -> Option<(Rank, u32)> {
        match &self.model {
            Model::ByteLevel { merges, .. } => {
                let key = u64::from(left) << 32 | u64::from(right);
                let i = merges.binary_search_by_key(&key, |m| m.0).ok()?;
                Some(((merges[i].1, 0, 0), merges[i].2))
            }
            Model::SentencePiece { scores, .. } => {
                buf.clear();
                buf.push_str(self.strings.get(left));
                buf.push_str(self.strings.get(right));
                let id = self.strings.id(buf)?;
                Some(((descending(scores[id as usize]), left, right), id))
            }
        }
    }

    /// Merges the symbols of `word` (step 4) and appends the resulting ids.
    fn merge_word(&self, word: &str, ids: &mut Vec<u32>) {
        let first = self.symbols(word);
        let n = first.len();
        let mut sym: Vec<Symbol> = first
            .iter()
            .enumerate()
            .map(|(i, &id)| Symbol {
                id,
                prev: i.checked_sub(1),
                next: (i + 1 < n).then_some(i + 1),
                removed: false,
            })
            .collect();
        let mut buf = String::new();
        let mut queue = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some((rank, new)) = self.rank(sym[i].id, sym[i + 1].id, &mut buf) {
                queue.push(Reverse((rank, i, new)));
            }
        }
        while let Some(Reverse((_, pos, new))) = queue.pop() {
            let Some(next) = sym[pos].next else { continue };
            if sym[pos].removed {
                continue;
            }
            // The pair may have changed since this entry was queued.
            if self.rank(sym[pos].id, sym[next].id, &mut buf).map(|r| r.1) != Some(new) {
                continue;
            }
            sym[pos].id = new;
            sym[next].removed = true;
            sym[pos].next = sym[next].next;
            if let Some(after) = sym[next].next {
                sym[after].prev = Some(pos);
            }
            if let Some(prev) = sym[pos].prev
                && let Some((rank, new)) = self.rank(sym[prev].id, new, &mut buf)
            {
                queue.push(Reverse((rank, prev, new)));
            }
            if let Some(after) = sym[pos].next
                && let Some((rank, merged)) = self.rank(new, sym[after].id, &mut buf)
            {
                queue.push(Reverse((rank, pos, merged)));
            }
        }
        ids.extend(sym.iter().filter(|s| !s.removed).map(|s| s.id));
    }

    /// Decodes ids (all in range: the caller checks) to text, as the crate's decoders do:
    /// byte-level, each token's chars through GPT-2's table (a token with a char outside it as
    /// its own UTF-8), the whole lossily as UTF-8; SentencePiece, `▁` as a space, runs of
    /// `<0xNN>` tokens as their bytes (one U+FFFD per byte when a run is not UTF-8), then one
    /// leading space dropped when `add_space_prefix`.
    pub(super) fn decode(&self, ids: &[u32]) -> String {
        match &self.model {
            Model::ByteLevel { .. } => {
                let mut bytes = Vec::with_capacity(ids.len() * 4);
                for &id in ids {
                    let text = self.token_text(id).unwrap_or_default();
                    super::bytes::byte_level_token(&text, &mut bytes);
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Model::SentencePiece {
                add_space_prefix, ..
            } => {
                let mut out = String::with_capacity(ids.len() * 4);
                let mut run: Vec<u8> = Vec::new();
                let flush = |run: &mut Vec<u8>, out: &mut String| {
                    if run.is_empty() {
                        return;
                    }
                    match std::str::from_utf8(run) {
                        Ok(s) => out.push_str(s),
                        Err(_) => out.extend(std::iter::repeat_n('\u{FFFD}', run.len())),
                    }
                    run.clear();
                };
                for &id in ids {
                    let text = self.token_text(id).unwrap_or_default();
                    match super::bytes::byte_token(&text) {
                        Some(b) => run.push(b),
                        None => {
                            flush(&mut run, &mut out);
                            out.extend(text.chars().map(|c| if c == SPACE { ' ' } else { c }));
                        }
                    }
                }
                flush(&mut run, &mut out);
                if *add_space_prefix && out.starts_with(' ') {
                    out.remove(0);
                }
                out
            }
        }
    }

    /// The vocabulary back in GGUF form, to store it (`.lsm` headers) or to build the crate's
    /// tokenizer from it. Merges are written in rank order.
    pub(super) fn to_vocab(&self, specials: &super::SpecialTokens, unk: Option<u32>) -> GgufVocab {
        let tokens: Vec<String> = (0..self.strings.len() as u32)
            .map(|id| self.strings.get(id).to_string())
            .collect();
        let token_types = self.types.iter().map(|&t| i32::from(t)).collect();
        let (model, merges, scores, add_space_prefix) = match &self.model {
            Model::ByteLevel { merges, .. } => {
                let mut ranked: Vec<&(u64, u32, u32)> = merges.iter().collect();
                ranked.sort_by_key(|m| m.1);
                let text = |id: u64| self.strings.get(id as u32);
                let merges = ranked
                    .iter()
                    .map(|m| format!("{} {}", text(m.0 >> 32), text(m.0 & 0xffff_ffff)))
                    .collect();
                ("gpt2", merges, Vec::new(), None)
            }
            Model::SentencePiece {
                add_space_prefix,
                scores,
                ..
            } => (
                "llama",
                Vec::new(),
                scores.to_vec(),
                Some(*add_space_prefix),
            ),
        };
        GgufVocab {
            model: model.into(),
            pre: self.pre.clone(),
            tokens,
            token_types,
            merges,
            scores,
            bos: specials.bos,
            eos: specials.eos.first().copied(),
            unk,
            add_bos: specials.add_bos,
            add_space_prefix,
        }
    }

    /// The unknown token id (SentencePiece), for [`Bpe::to_vocab`].
    pub(super) fn unk(&self) -> Option<u32> {
        match &self.model {
            Model::SentencePiece { unk, .. } => *unk,
            Model::ByteLevel { .. } => None,
        }
    }
}
