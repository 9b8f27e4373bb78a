//! What a loaded [`Model`] holds in memory, measured from its parts ([`Model::bytes`]), and an
//! upper bound of it computed from a file's header alone ([`load_bytes_estimate`]), so that a
//! caller can reserve memory before it loads.
//!
//! Each part reports its own bytes next to where it allocates them: the weights
//! ([`Weights::bytes`]: the owned file image, less any skipped streamed section, and the f32
//! tables derived from it), the tokenizer ([`Tokenizer::heap_bytes`]), and the model's own
//! strings here. The estimate lives beside [`Model`], not in [`crate::model`], because it counts
//! the loaded model's own struct.

use std::path::Path;

use super::Model;
use crate::model::{
    LayerWeights, ModelConfig, OwnedBytes, SourceKind, Weights, gguf, lsm, map_file, safetensors,
};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// A loaded model's bytes, by part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelBytes {
    /// Weight bytes: the file image read into owned memory (not heap) and the derived tables
    /// (heap).
    pub weights: OwnedBytes,
    /// The tokenizer's heap (an estimate: see [`Tokenizer::heap_bytes`]).
    pub tokenizer: u64,
    /// Under a memory plan, the weight stream's ring (page-aligned buffers, not heap).
    pub ring: u64,
    /// The path, the chat template and the model's own struct.
    pub other: u64,
}

impl ModelBytes {
    /// Bytes on the heap: everything but the file image and the ring.
    pub fn heap(&self) -> u64 {
        self.weights.heap + self.tokenizer + self.other
    }

    /// Every byte.
    pub fn total(&self) -> u64 {
        self.weights.image + self.ring + self.heap()
    }
}

impl Model {
    /// Bytes this model holds in memory the process owns (see [`Model::footprint`]).
    pub fn bytes(&self) -> u64 {
        self.footprint().total()
    }

    /// [`Model::bytes`] by part. Weights that are a memory map of the file (`mmap` mode, and the
    /// streamed section's views of a streaming model) count nothing: their pages are the page
    /// cache's.
    pub fn footprint(&self) -> ModelBytes {
        ModelBytes {
            weights: self.weights.bytes(),
            tokenizer: self.tokenizer.heap_bytes(),
            ring: self.planned.as_ref().map_or(0, |p| p.stream.ring_bytes()),
            other: (std::mem::size_of::<Model>()
                + self.path.capacity()
                + self.chat_template.as_ref().map_or(0, String::capacity))
                as u64,
        }
    }
}

/// An upper bound of [`Model::bytes`] after loading `path` (GGUF, `.lsm` or a safetensors
/// directory), computed from its header and metadata without loading its weights. With
/// `skip_streamed`, a `.lsm` file's streamed FFN section is left out, as
/// [`Residency::OwnedExceptStreamed`](crate::model::Residency::OwnedExceptStreamed) leaves
/// it. Header reads go through a map of the file (nothing past the metadata is touched).
pub fn load_bytes_estimate(path: &Path, skip_streamed: bool) -> Result<u64> {
    let file_len = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.len())
            .map_err(|e| Error::io(p, e))
    };
    match SourceKind::detect(path)? {
        SourceKind::Lsm => {
            let f = lsm::LsmFile::parse(path, map_file(path)?)?;
            let h = &f.header;
            let streamed = if skip_streamed { h.streamed.len } else { 0 };
            let tokenizer = match &h.tokenizer_vocab {
                Some(v) => Tokenizer::gguf_heap_bytes_bound(v),
                None => {
                    let vocab = tokenizer_json_counts(&h.tokenizer_json);
                    tokenizer_bound(vocab.0, vocab.1, vocab.2, vocab.3)
                }
            };
            let template = h.chat_template.as_ref().map_or(0, String::len);
            Ok(file_len(path)? - streamed
                + tables_bound(&h.config)
                + tokenizer
                + other_bound(path, template))
        }
        SourceKind::Gguf => {
            let m = gguf::GgufModel::from_file(&gguf::GgufFile::parse(path, map_file(path)?)?)?;
            let template = m.chat_template.as_ref().map_or(0, String::len);
            Ok(file_len(path)?
                + tables_bound(&m.config)
                + Tokenizer::gguf_heap_bytes_bound(&m.vocab)
                + other_bound(path, template))
        }
        SourceKind::SafetensorsDir => {
            let mut total = 0;
            let entries = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
            for e in entries {
                let e = e.map_err(|e| Error::io(path, e))?;
                total += file_len(&e.path())?;
            }
            let json = std::fs::read_to_string(path.join("tokenizer.json"))
                .map_err(|e| Error::io(path.join("tokenizer.json"), e))?;
            let vocab = tokenizer_json_counts(&json);
            let config = safetensors::read_config(path)?;
            // Every file of the directory (weights, tokenizer, config) bounds the image.
            Ok(total
                + tables_bound(&config)
                + tokenizer_bound(vocab.0, vocab.1, vocab.2, vocab.3)
                + other_bound(path, 0))
        }
    }
}

/// [`Tokenizer::heap_bytes`] as a `tokenizer.json` tokenizer of these counts will report it
/// (`strings`: the malloc blocks of its token texts), with its special ids.
fn tokenizer_bound(tokens: usize, strings: usize, merges: usize, added: usize) -> u64 {
    Tokenizer::heap_bytes_bound(tokens, strings, merges, added) + 4 * tokens as u64
}

/// Tokens, malloc blocks of token text ([`Tokenizer::malloc_block`]), merges and added tokens
/// of a `tokenizer.json`; zeros where it does not parse (the load would then fail anyway).
fn tokenizer_json_counts(json: &str) -> (usize, usize, usize, usize) {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
        return (0, 0, 0, 0);
    };
    let model = &v["model"];
    let block = |t: &str| Tokenizer::malloc_block(t.len());
    let (mut tokens, mut strings) = (0, 0);
    if let Some(vocab) = model["vocab"].as_object() {
        tokens += vocab.len();
        strings += vocab.keys().map(|t| block(t)).sum::<usize>();
    } else if let Some(vocab) = model["vocab"].as_array() {
        tokens += vocab.len(); // unigram: [token, score] pairs
        strings += vocab
            .iter()
            .filter_map(|e| e[0].as_str())
            .map(block)
            .sum::<usize>();
    }
    if let Some(added) = v["added_tokens"].as_array() {
        tokens += added.len();
        strings += added
            .iter()
            .filter_map(|t| t["content"].as_str())
            .map(block)
            .sum::<usize>();
    }
    let merges = model["merges"].as_array().map_or(0, Vec::len);
    let added = v["added_tokens"].as_array().map_or(0, Vec::len);
    (tokens, strings, merges, added)
}

/// The f32 tables [`Weights`] derives (norms, biases), per the config's shapes, and the
/// layer table itself.
fn tables_bound(c: &ModelConfig) -> u64 {
    let (d, q, kv) = (c.d_model, c.q_dim(), c.kv_dim());
    let per_layer = 4 * (2 * d + q + 2 * kv) + std::mem::size_of::<LayerWeights>();
    (c.n_layers * per_layer + 4 * d + std::mem::size_of::<Weights>()) as u64
}

fn other_bound(path: &Path, template: usize) -> u64 {
    (std::mem::size_of::<Model>() + path.as_os_str().len() + template) as u64
}
