//! The LeanStream model file (`.lsm`), version 1.
//!
//! ```text
//! offset 0      preamble, 64 bytes, little-endian:
//!                 magic "LEANSTRM" | version u32 | flags u32 | header_len u64 | header_crc32 u32 | zeros
//! offset 64     header: UTF-8 JSON (`Header`): config, tokenizer.json, special tokens, chat template,
//!               the section table, the resident tensor directory and the FFN layout.
//! 4 KiB-aligned sections, each with its CRC-32 in the table:
//!   resident    every tensor except the FFN, in its source type, each 64-byte aligned;
//!               read once into owned memory (see [`Residency`]).
//!   streamed    per layer, the FFN as neuron bundles: for neuron i, its gate row, up row and down
//!               column stored back to back; `chunk_neurons` bundles make a chunk, every chunk
//!               starts on a 4 KiB boundary so that one O_DIRECT read lands it in a cache slot.
//!               Each chunk has its own CRC-32, so a streamed read can be verified on arrival.
//!   calibration optional (written by `leanstream calibrate`): per-neuron statistics and
//!               predictor tables as binary tensors, 64-byte aligned; see [`Calibration`].
//! ```
//!
//! Gate and up rows keep the source's storage type (no re-quantisation). The down matrix has to be
//! transposed to be stored per neuron; its GGML blocks run along the neuron axis, so its columns
//! cannot keep them. Columns are re-encoded in `down_dtype`: `q8_0` by default (relative RMS error
//! ~4e-3, about half the bytes of f16), or `f16` (the Q4_1 values of SmolLM2 survive with ~1e-4).
//! The error measured at conversion is recorded in the header (`down_error`).
//!
//! Dependencies point one way: backends, predictors, pipelines and tools read this format; it
//! imports none of them (its [`synth`] generator simulates a predictor with the leaf
//! [`crate::sparsity`] alone; only its tests drive the engine on top).

mod calibration;
pub mod export;
mod layout;
mod rewrite;
pub mod synth;
mod write;

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::bytes::FileImage;
use super::{
    Down, FfnWeights, ImportedModel, ModelConfig, QRows, Residency, TensorBytes, TensorRef, Weights,
};
use crate::quant::DType;
use crate::tokenizer::{GgufVocab, SpecialTokens, StoredTokenizer, Tokenizer};
use crate::{Error, Result};

pub use calibration::{
    CalDType, CalTensor, CalTensorEntry, CalTensorView, Calibration, CalibrationData,
    PredictorKind, PredictorMeta,
};
pub use layout::{ChunkId, ChunkLayout};
pub use rewrite::write_calibrated;
pub use write::{ConvertOptions, ConvertReport, DOWN_DTYPES, convert, default_down_dtype};

/// File magic.
pub const MAGIC: [u8; 8] = *b"LEANSTRM";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;
/// Section and chunk alignment (the O_DIRECT unit).
pub const ALIGN: usize = 4096;
/// Bytes of the fixed preamble before the JSON header.
pub const PREAMBLE_LEN: usize = 64;
/// Largest header we accept (a 49k-token tokenizer.json is ~2 MiB).
const MAX_HEADER_LEN: u64 = 256 << 20;

/// A byte range of the file, with its checksum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    pub offset: u64,
    pub len: u64,
    pub crc32: u32,
}

/// Where a resident tensor lives inside the resident section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Offset from the start of the resident section.
    pub offset: u64,
    pub len: u64,
}

/// Measured error of re-encoding the down columns, over all layers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DownError {
    pub max_abs: f32,
    /// sqrt(Σ(stored − source)²) / sqrt(Σ source²).
    pub rms_rel: f32,
}

/// Layout of the streamed FFN section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FfnLayout {
    /// Neurons per chunk (the unit of reading and caching).
    pub chunk_neurons: usize,
    pub gate_dtype: DType,
    pub up_dtype: DType,
    pub down_dtype: DType,
    /// Bytes of one bundle: gate row + up row + down column.
    pub bundle_bytes: usize,
    /// Bytes of one chunk including padding to [`ALIGN`].
    pub chunk_bytes: usize,
    /// Per layer: offset of its first chunk from the start of the streamed section.
    pub layer_offsets: Vec<u64>,
    /// Per layer, per chunk: CRC-32 of the chunk's bytes (padding included).
    pub chunk_crc32: Vec<Vec<u32>>,
    /// Per layer: `stored neuron k` is source neuron `permutation[l][k]`; empty when identity.
    pub permutation: Vec<Vec<u32>>,
    pub down_error: DownError,
}

impl FfnLayout {
    /// Chunks per layer for `n_ff` neurons.
    pub fn chunks_per_layer(&self, n_ff: usize) -> usize {
        n_ff.div_ceil(self.chunk_neurons)
    }

    /// Byte offsets of gate, up and down inside a bundle.
    pub fn bundle_offsets(&self, d_model: usize) -> Option<(usize, usize)> {
        let g = self.gate_dtype.row_bytes(d_model)?;
        let u = self.up_dtype.row_bytes(d_model)?;
        Some((g, g + u))
    }
}

/// The JSON header.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Header {
    pub config: ModelConfig,
    /// The tokenizer as `tokenizer.json` text; empty when `tokenizer_vocab` holds it.
    #[serde(default)]
    pub tokenizer_json: String,
    /// The tokenizer as the GGUF vocabulary it was built from (files converted from a GGUF;
    /// absent in files written before the engine had its own BPE, which keep the JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_vocab: Option<GgufVocab>,
    pub special_tokens: SpecialTokens,
    pub chat_template: Option<String>,
    /// File name of the model this was converted from.
    pub source: String,
    pub resident: Section,
    pub streamed: Section,
    pub tensors: Vec<TensorEntry>,
    pub ffn: FfnLayout,
    /// Calibration results (thresholds, statistics, predictors); written by `leanstream calibrate`,
    /// read with [`LsmFile::calibration`].
    #[serde(default)]
    pub calibration: Option<Calibration>,
}

impl Header {
    /// The tokenizer as stored: the vocabulary when there is one, else the JSON text.
    pub fn stored_tokenizer(&self) -> StoredTokenizer {
        match &self.tokenizer_vocab {
            Some(v) => StoredTokenizer::Vocab(v.clone()),
            None => StoredTokenizer::Json(self.tokenizer_json.clone()),
        }
    }

    /// The two tokenizer fields for `stored`: `(tokenizer_json, tokenizer_vocab)`.
    pub fn tokenizer_fields(stored: StoredTokenizer) -> (String, Option<GgufVocab>) {
        match stored {
            StoredTokenizer::Vocab(v) => (String::new(), Some(v)),
            StoredTokenizer::Json(json) => (json, None),
        }
    }
}

/// An opened `.lsm` file: its header and its bytes.
#[derive(Debug)]
pub struct LsmFile {
    pub header: Header,
    /// The whole file, held as the [`Residency`] it was opened with says; with
    /// [`Residency::OwnedExceptStreamed`] its streamed range reads as zeros.
    pub data: TensorBytes,
    /// The streamed FFN section: a view of `data`, or with [`Residency::OwnedExceptStreamed`] a
    /// memory map of just that section, which only recall measurement and dense compute touch
    /// (the streaming modes read chunks with the I/O workers instead).
    pub streamed: TensorBytes,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Parses the preamble and the JSON header at the start of `b` (the whole file, or at least its
/// first bytes up to the header's end; `b.len()` is taken as the file's length).
fn parse_header(path: &Path, b: &[u8]) -> Result<Header> {
    let bad = |reason: String| Error::invalid_file(path, reason);
    if b.len() < PREAMBLE_LEN {
        return Err(bad(format!(
            "{} bytes is too short for the preamble",
            b.len()
        )));
    }
    if b[..8] != MAGIC {
        return Err(bad("wrong magic bytes: not a LeanStream .lsm file".into()));
    }
    let version = u32_at(b, 8);
    if version != VERSION {
        return Err(Error::unsupported(
            path,
            format!("format version {version}; this build reads version {VERSION}"),
        ));
    }
    let header_len = u64_at(b, 16);
    let header_crc = u32_at(b, 24);
    if header_len > MAX_HEADER_LEN || PREAMBLE_LEN as u64 + header_len > b.len() as u64 {
        return Err(bad(format!(
            "header length {header_len} runs past the end of the file ({} bytes): truncated?",
            b.len()
        )));
    }
    let raw = &b[PREAMBLE_LEN..PREAMBLE_LEN + header_len as usize];
    if crc32fast::hash(raw) != header_crc {
        return Err(bad("header checksum mismatch: the file is corrupted".into()));
    }
    let header: Header =
        serde_json::from_slice(raw).map_err(|e| bad(format!("header is not valid: {e}")))?;
    Ok(header)
}

/// `data`'s view of section `s` (checked against the file's length by [`check_layout`]).
fn section(path: &Path, data: &TensorBytes, s: &Section) -> Result<TensorBytes> {
    let range = usize::try_from(s.offset)
        .ok()
        .zip(usize::try_from(s.len).ok());
    range
        .and_then(|(offset, len)| data.slice(offset, len))
        .ok_or_else(|| Error::invalid_file(path, "section out of range"))
}

/// Checks every offset of a parsed header against the file's length.
fn check_layout(path: &Path, h: &Header, file_len: u64) -> Result<()> {
    let bad = |reason: String| Err(Error::invalid_file(path, reason));
    let c = &h.config;
    c.validate().map_err(|r| Error::invalid_file(path, r))?;
    for (name, s) in [("resident", &h.resident), ("streamed", &h.streamed)] {
        match s.offset.checked_add(s.len) {
            Some(end) if end <= file_len => {}
            _ => {
                return bad(format!(
                    "{name} section ({} bytes at {}) runs past the end of the file ({file_len} bytes): truncated?",
                    s.len, s.offset
                ));
            }
        }
    }
    for t in &h.tensors {
        if t.offset
            .checked_add(t.len)
            .is_none_or(|end| end > h.resident.len)
        {
            return bad(format!(
                "tensor `{}` lies outside the resident section",
                t.name
            ));
        }
    }
    let ffn = &h.ffn;
    let Some((_, down_at)) = ffn.bundle_offsets(c.d_model) else {
        return bad("FFN row types do not fit d_model".into());
    };
    let down_bytes = ffn.down_dtype.row_bytes(c.d_model).unwrap_or(usize::MAX);
    if ffn.chunk_neurons == 0
        || down_at.checked_add(down_bytes) != Some(ffn.bundle_bytes)
        || ffn
            .chunk_neurons
            .checked_mul(ffn.bundle_bytes)
            .is_none_or(|b| b > ffn.chunk_bytes)
        || !ffn.chunk_bytes.is_multiple_of(ALIGN)
    {
        return bad("inconsistent FFN chunk layout".into());
    }
    let chunks = ffn.chunks_per_layer(c.n_ff) as u64;
    if ffn.layer_offsets.len() != c.n_layers || ffn.chunk_crc32.len() != c.n_layers {
        return bad(format!(
            "FFN layout lists {} layers, the model has {}",
            ffn.layer_offsets.len(),
            c.n_layers
        ));
    }
    for (l, (&off, crcs)) in ffn.layer_offsets.iter().zip(&ffn.chunk_crc32).enumerate() {
        let end = (ffn.chunk_bytes as u64)
            .checked_mul(chunks)
            .and_then(|n| n.checked_add(off));
        if end.is_none_or(|e| e > h.streamed.len) || off % ALIGN as u64 != 0 {
            return bad(format!("FFN layer {l} lies outside the streamed section"));
        }
        if crcs.len() as u64 != chunks {
            return bad(format!(
                "FFN layer {l} has {} chunk checksums, expected {chunks}",
                crcs.len()
            ));
        }
    }
    if !ffn.permutation.is_empty() {
        for (l, p) in ffn.permutation.iter().enumerate() {
            let mut seen = vec![false; c.n_ff];
            let ok = p.len() == c.n_ff
                && p.iter().all(|&i| {
                    (i as usize) < c.n_ff && !std::mem::replace(&mut seen[i as usize], true)
                });
            if !ok || ffn.permutation.len() != c.n_layers {
                return bad(format!(
                    "FFN layer {l}: neuron permutation is not a permutation"
                ));
            }
        }
    }
    Ok(())
}

impl LsmFile {
    /// Opens and validates a `.lsm` file read whole into owned memory ([`Residency::Owned`]).
    pub fn open(path: &Path) -> Result<LsmFile> {
        Self::open_with(path, Residency::Owned)
    }

    /// Opens and validates a `.lsm` file held as `residency` says (checksums of the resident
    /// section included; streamed chunks are verified when read, see
    /// [`LsmFile::verify_streamed`] and the I/O pool's checks).
    pub fn open_with(path: &Path, residency: Residency) -> Result<LsmFile> {
        let f = match residency {
            Residency::Mapped => LsmFile::parse(path, super::map_file(path)?)?,
            Residency::Owned | Residency::OwnedExceptStreamed => {
                let skip = residency == Residency::OwnedExceptStreamed;
                let mut image = FileImage::open(path)?;
                image.fill(0..PREAMBLE_LEN as u64)?;
                let header_len = match image.bytes() {
                    b if b.len() >= PREAMBLE_LEN => u64_at(b, 16).min(MAX_HEADER_LEN),
                    _ => 0,
                };
                image.fill(PREAMBLE_LEN as u64..PREAMBLE_LEN as u64 + header_len)?;
                let header = parse_header(path, image.bytes())?;
                check_layout(path, &header, image.len())?;
                let rest = PREAMBLE_LEN as u64 + header_len..image.len();
                let s = &header.streamed;
                if skip {
                    image.fill(rest.start..s.offset)?;
                    image.fill(s.offset + s.len..rest.end)?;
                } else {
                    image.fill(rest)?;
                }
                let data = image.finish()?;
                let streamed = if skip {
                    super::map_range(path, s.offset, s.len)?
                } else {
                    section(path, &data, s)?
                };
                LsmFile {
                    header,
                    data,
                    streamed,
                }
            }
        };
        f.verify_section(path, "resident", &f.header.resident)?;
        Ok(f)
    }

    /// Parses the preamble and header from bytes and checks every offset against the file size.
    /// Never panics on any input (this is the fuzz target).
    pub fn parse(path: &Path, data: TensorBytes) -> Result<LsmFile> {
        let header = parse_header(path, data.as_slice())?;
        check_layout(path, &header, data.len() as u64)?;
        let streamed = section(path, &data, &header.streamed)?;
        Ok(LsmFile {
            header,
            data,
            streamed,
        })
    }

    fn section_bytes(&self, s: &Section) -> &[u8] {
        &self.data.as_slice()[s.offset as usize..(s.offset + s.len) as usize]
    }

    fn verify_section(&self, path: &Path, name: &str, s: &Section) -> Result<()> {
        if crc32fast::hash(self.section_bytes(s)) != s.crc32 {
            return Err(Error::invalid_file(
                path,
                format!("{name} section checksum mismatch: the file is corrupted"),
            ));
        }
        Ok(())
    }

    /// Verifies every streamed chunk's checksum (the dense loader does this once at load).
    pub fn verify_streamed(&self, path: &Path) -> Result<()> {
        let ffn = &self.header.ffn;
        let streamed = self.streamed.as_slice();
        for (l, (&off, crcs)) in ffn.layer_offsets.iter().zip(&ffn.chunk_crc32).enumerate() {
            for (k, &crc) in crcs.iter().enumerate() {
                let at = off as usize + k * ffn.chunk_bytes;
                if crc32fast::hash(&streamed[at..at + ffn.chunk_bytes]) != crc {
                    return Err(Error::invalid_file(
                        path,
                        format!("FFN layer {l} chunk {k} checksum mismatch: the file is corrupted"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Builds the tokenizer stored in the header.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        Tokenizer::from_stored(
            &self.header.stored_tokenizer(),
            self.header.special_tokens.clone(),
        )
    }

    /// Builds compute-ready weights: resident tensors in place, the FFN as strided views of the
    /// neuron bundles.
    pub fn weights(&self, path: &Path, tokenizer: Tokenizer) -> Result<Weights> {
        let h = &self.header;
        let resident = self
            .data
            .slice(h.resident.offset as usize, h.resident.len as usize)
            .ok_or_else(|| Error::invalid_file(path, "resident section out of range"))?;
        let streamed = self.streamed.clone();
        let mut tensors = std::collections::BTreeMap::new();
        for t in &h.tensors {
            let data = resident
                .slice(t.offset as usize, t.len as usize)
                .ok_or_else(|| {
                    Error::invalid_file(path, format!("tensor `{}` out of range", t.name))
                })?;
            tensors.insert(
                t.name.clone(),
                TensorRef {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data,
                },
            );
        }
        let m = ImportedModel {
            path: path.to_path_buf(),
            config: h.config.clone(),
            tensors,
            tokenizer,
            chat_template: h.chat_template.clone(),
        };
        let c = &h.config;
        let ffn = &h.ffn;
        let (up_at, down_at) = ffn
            .bundle_offsets(c.d_model)
            .ok_or_else(|| Error::invalid_file(path, "FFN row types do not fit d_model"))?;
        Weights::build(&m, &mut |l| {
            let bad =
                || Error::invalid_file(path, format!("FFN layer {l} does not fit its section"));
            let first = ffn.layer_offsets[l] as usize;
            let rows = |dtype: DType, at: usize| {
                QRows::strided(
                    dtype,
                    c.n_ff,
                    c.d_model,
                    streamed.clone(),
                    first + at,
                    ffn.bundle_bytes,
                    ffn.chunk_neurons,
                    ffn.chunk_bytes,
                )
                .ok_or_else(bad)
            };
            Ok(FfnWeights {
                gate: rows(ffn.gate_dtype, 0)?,
                up: rows(ffn.up_dtype, up_at)?,
                down: Down::Neurons(rows(ffn.down_dtype, down_at)?),
            })
        })
    }
}

/// Loads a `.lsm` file for dense compute: all checksums verified, weights ready.
pub fn load(path: &Path) -> Result<(Weights, Tokenizer, Option<String>)> {
    let f = LsmFile::open(path)?;
    f.verify_streamed(path)?;
    let tokenizer = f.tokenizer()?;
    let weights = f.weights(path, tokenizer.clone())?;
    Ok((weights, tokenizer, f.header.chat_template.clone()))
}
