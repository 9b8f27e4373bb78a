//! Text ↔ token ids through the `tokenizers` crate (pure-Rust features only).
//! STUB: being written (GGUF vocab → BPE, tokenizer.json, special tokens, streaming decode).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The tokenizer fields of a GGUF file's metadata (`tokenizer.ggml.*`).
#[derive(Clone, Debug, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`, e.g. `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `smollm`, `llama-bpe`, `qwen2`.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
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

/// A model's tokenizer.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    specials: SpecialTokens,
}

impl Tokenizer {
    /// Builds the tokenizer described by GGUF metadata.
    pub fn from_gguf(_v: &GgufVocab) -> Result<Tokenizer> {
        Err(Error::Tokenizer("not yet built".into()))
    }

    /// Loads `tokenizer.json` (with special tokens given by the caller, from config files).
    pub fn from_json(json: &str, specials: SpecialTokens) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(json.as_bytes())
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Tokenizer { inner, specials })
    }

    /// Serialises to `tokenizer.json` form (stored inside `.lsm` files).
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn specials(&self) -> &SpecialTokens {
        &self.specials
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }
}

/// TEMP stub of the streaming decoder (replaced on merge).
#[derive(Debug)]
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    emitted: usize,
}

impl Tokenizer {
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tok: self,
            ids: Vec::new(),
            emitted: 0,
        }
    }
}

impl TextStream<'_> {
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids)?;
        if text.ends_with('\u{fffd}') || text.len() <= self.emitted {
            return Ok(None);
        }
        let out = text[self.emitted..].to_string();
        self.emitted = text.len();
        Ok(Some(out))
    }
    pub fn finish(&mut self) -> Result<Option<String>> {
        Ok(None)
    }
}
