//! `leanstream export-gguf`: writes the weights of a `.lsm` file as a GGUF file llama.cpp loads,
//! so that llama.cpp can be run on exactly the same weights.
//!
//! - Resident tensors (embeddings, norms, attention, output head) already have GGUF names and
//!   types: their bytes are copied as they are. A Llama whose Q/K rows are in Hugging Face order
//!   (a converted safetensors directory, [`RopeStyle::HalfSplit`]) gets them permuted to the
//!   order llama.cpp's converter writes (whole quantised rows move, nothing is re-encoded).
//! - `ffn_gate` and `ffn_up` rows are gathered from the neuron bundles byte for byte, in the
//!   stored neuron order (a calibrated file's hot-first order is harmless: gate row, up row and
//!   down column `i` stay neuron `i`).
//! - `ffn_down` is stored as columns (blocks along `d_model`); GGUF wants `d_model` rows of
//!   `n_ff` values (blocks along `n_ff`). Columns are dequantised 32 rows at a time and the rows
//!   re-encoded in the same type, so q8_0, q5_0 and q4_0 columns change slightly (measured and
//!   reported; zero for `leanstream synth`'s down values, which are planted to survive it) and
//!   f16/f32 columns not at all.
//! - Metadata: llama.cpp's keys for the architecture and the tokenizer (`tokenizer.ggml.*`,
//!   derived from the stored GGUF vocabulary or `tokenizer.json`), with exactly as many tokens
//!   as the embedding has rows.
//!
//! Memory stays small whatever the model's size: the header and the tensor directory are written
//! first ([`GgufWriter`] derives every offset from the declared shapes), then one tensor at a
//! time is read and written: a resident tensor in pieces, one FFN layer's chunks (read once for
//! its gate, up and down tensors). Checksums are verified as the bytes go through (every chunk's
//! and the resident section's); the output is written to `OUT.partial` and renamed into place
//! only when complete.

mod read;
mod vocab;

use read::{DownStats, Reader};
use vocab::{gguf_vocab, metadata};

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rayon::prelude::*;

use super::{Header, MAX_HEADER_LEN, PREAMBLE_LEN, check_layout, parse_header, u64_at};
use crate::model::gguf::writer::{GgufWriter, TensorSink};
use crate::model::gguf::{Array, Value};
use crate::model::{Architecture, RopeStyle};
use crate::quant::{DType, dequantize_row, quantize_row_into};
use crate::tokenizer::{GgufVocab, SpecialTokens, StoredTokenizer, Tokenizer};
use crate::{Error, Result};

/// Architectures [`export_gguf`] writes.
pub const EXPORT_ARCHITECTURES: &str = "llama, qwen2, qwen3";

/// What [`export_gguf`] wrote.
#[derive(Clone, Debug)]
pub struct ExportReport {
    pub file_bytes: u64,
    pub tensors: usize,
    /// `general.architecture`.
    pub architecture: &'static str,
    /// Type of the `ffn_down` tensors (that of the `.lsm` down columns).
    pub down_dtype: DType,
    /// Largest change of a down value by re-encoding the columns as rows (0: lossless).
    pub down_max_abs_change: f32,
    /// sqrt(Σ change²) / sqrt(Σ value²) over every down value.
    pub down_rms_rel_change: f32,
    /// Tokens written (= rows of the token embedding).
    pub vocab: usize,
    /// Tokens of the stored tokenizer beyond the embedding's rows, left out.
    pub tokens_dropped: usize,
    /// Placeholder tokens added where the stored tokenizer had no token for an embedding row.
    pub tokens_padded: usize,
    /// BPE merges left out because a part or the result was left out.
    pub merges_dropped: usize,
    /// Whether the Q/K rows were permuted (a Llama in Hugging Face order).
    pub permuted_qk: bool,
}

/// Bytes read from the input at a time when copying a resident tensor.
const COPY_PIECE: usize = 4 << 20;

/// Writes the weights of the `.lsm` file `src` as a GGUF file at `dst` (through
/// `DST.partial`), calling `progress(bytes_done, bytes_total)` after each tensor.
pub fn export_gguf(
    src: &Path,
    dst: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ExportReport> {
    let file = File::open(src).map_err(|e| Error::io(src, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(src, e))?.len();
    let header = read_header(src, &file, file_len)?;
    let recipe = Recipe::new(src, &header)?;
    let (vocab, fit) = gguf_vocab(
        header.stored_tokenizer(),
        &header.special_tokens,
        header.config.vocab_size,
    )
    .map_err(|reason| Error::invalid_file(src, format!("tokenizer: {reason}")))?;
    let mut writer = GgufWriter::new();
    metadata(&mut writer, &header, &vocab);
    let mut origins = Vec::new();
    for (entry, origin) in recipe
        .resident
        .iter()
        .map(|&(e, p)| (&header.tensors[e], p))
    {
        writer.add_streamed_tensor(&entry.name, entry.dtype, &entry.shape)?;
        origins.push(origin);
    }
    let c = &header.config;
    if let Some(factors) = &c.rope_freq_factors
        && !header.tensors.iter().any(|t| t.name == "rope_freqs.weight")
    {
        writer.add_f32_tensor("rope_freqs.weight", DType::F32, &[factors.len()], factors);
        origins.push(Origin::Held);
    }
    let ffn = &header.ffn;
    for l in 0..c.n_layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        writer.add_streamed_tensor(&n("ffn_gate"), ffn.gate_dtype, &[c.n_ff, c.d_model])?;
        writer.add_streamed_tensor(&n("ffn_up"), ffn.up_dtype, &[c.n_ff, c.d_model])?;
        writer.add_streamed_tensor(&n("ffn_down"), ffn.down_dtype, &[c.d_model, c.n_ff])?;
        origins.extend([Origin::Gate(l), Origin::Up(l), Origin::Down(l)]);
    }

    // Progress: where each tensor's data ends, padding included.
    let total = writer.data_len();
    let mut ends = writer.tensor_offsets();
    ends.remove(0);
    ends.push(total);
    let mut reader = Reader {
        src,
        file: &file,
        header: &header,
        recipe: &recipe,
        layer: None,
        buf: Vec::new(),
        resident_crc: crc32fast::Hasher::new(),
        resident_pos: 0,
        down: DownStats::default(),
    };
    let file_bytes = writer.write_file(dst, &mut |i, _name, sink| {
        reader.write(origins[i], sink)?;
        progress(ends[i], total);
        Ok(())
    })?;
    Ok(ExportReport {
        file_bytes,
        tensors: origins.len(),
        architecture: c.architecture.name(),
        down_dtype: ffn.down_dtype,
        down_max_abs_change: reader.down.max_abs,
        down_rms_rel_change: if reader.down.sq_src > 0.0 {
            (reader.down.sq_err / reader.down.sq_src).sqrt() as f32
        } else {
            0.0
        },
        vocab: vocab.tokens.len(),
        tokens_dropped: fit.dropped,
        tokens_padded: fit.padded,
        merges_dropped: fit.merges_dropped,
        permuted_qk: recipe.permute_qk,
    })
}

/// Reads and checks the preamble and the JSON header (the rest of the file is read as it is
/// exported).
fn read_header(src: &Path, file: &File, file_len: u64) -> Result<Header> {
    let mut pre = vec![0u8; (PREAMBLE_LEN as u64).min(file_len) as usize];
    read_at(src, file, 0, &mut pre)?;
    let header_len = match pre.len() {
        PREAMBLE_LEN => u64_at(&pre, 16).min(MAX_HEADER_LEN),
        _ => 0,
    };
    // `parse_header` takes the slice's length as the file's: a header running past the end of
    // the file is read cut short and refused there.
    let want = (PREAMBLE_LEN as u64 + header_len).min(file_len);
    let mut bytes = vec![0u8; want as usize];
    read_at(src, file, 0, &mut bytes)?;
    let header = parse_header(src, &bytes)?;
    check_layout(src, &header, file_len)?;
    Ok(header)
}

fn read_at(src: &Path, file: &File, offset: u64, buf: &mut [u8]) -> Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::invalid_file(
                src,
                format!(
                    "{} bytes at offset {offset} run past the end of the file: truncated?",
                    buf.len()
                ),
            )
        } else {
            Error::io(src, e)
        }
    })
}

/// Where a tensor of the output comes from.
#[derive(Clone, Copy, Debug)]
enum Origin {
    /// Resident tensor `entry` of the header's directory; `Some(heads)`: its rows are permuted
    /// per head from Hugging Face's order to llama.cpp's.
    Resident {
        entry: usize,
        permute: Option<usize>,
    },
    /// Held by the writer (nothing to read).
    Held,
    Gate(usize),
    Up(usize),
    Down(usize),
}

/// What is exported and how, checked before anything is written.
struct Recipe {
    /// Resident tensors in file order (what lets their section's checksum be computed as they
    /// are copied): directory index and origin.
    resident: Vec<(usize, Origin)>,
    permute_qk: bool,
    /// Offsets inside a bundle: up row, down column; bytes of a gate row, an up row, a down
    /// column and a down row.
    up_at: usize,
    down_at: usize,
    gate_row: usize,
    up_row: usize,
    down_col: usize,
    down_row: usize,
    /// Rows of `ffn_down` converted at a time: a whole number of blocks of the down type.
    tile: usize,
}

impl Recipe {
    fn new(src: &Path, h: &Header) -> Result<Recipe> {
        let c = &h.config;
        let arch = c.architecture;
        if !matches!(
            arch,
            Architecture::Llama | Architecture::Qwen2 | Architecture::Qwen3
        ) {
            return Err(Error::unsupported(
                src,
                format!(
                    "architecture `{}` cannot be exported to GGUF; supported: \
                     {EXPORT_ARCHITECTURES}",
                    arch.name()
                ),
            ));
        }
        // The engine runs Qwen with half-split RoPE whatever the source; llama.cpp's llama wants
        // adjacent pairs.
        let permute_qk = arch == Architecture::Llama && c.rope_style == RopeStyle::HalfSplit;
        if arch != Architecture::Llama && c.rope_style != RopeStyle::HalfSplit {
            return Err(Error::unsupported(
                src,
                format!("{} with adjacent-pair RoPE", arch.name()),
            ));
        }
        let ffn = &h.ffn;
        let (d, n_ff) = (c.d_model, c.n_ff);
        let dd = ffn.down_dtype;
        let down_row = dd.row_bytes(n_ff).ok_or_else(|| {
            Error::unsupported(
                src,
                format!(
                    "n_ff = {n_ff} is not a multiple of {}: the ffn_down rows cannot be stored \
                     as {dd} blocks",
                    dd.block_len()
                ),
            )
        })?;
        let (up_at, down_at) = ffn
            .bundle_offsets(d)
            .ok_or_else(|| Error::invalid_file(src, "FFN row types do not fit d_model"))?;
        let down_col = dd
            .row_bytes(d)
            .ok_or_else(|| Error::invalid_file(src, "down columns are not whole blocks"))?;
        let embd_rows = h
            .tensors
            .iter()
            .find(|t| t.name == "token_embd.weight")
            .map(|t| t.shape.first().copied().unwrap_or(0));
        if embd_rows != Some(c.vocab_size) {
            return Err(Error::invalid_file(
                src,
                format!(
                    "token_embd.weight has {embd_rows:?} rows; the vocabulary size is {}",
                    c.vocab_size
                ),
            ));
        }
        let mut order: Vec<usize> = (0..h.tensors.len()).collect();
        order.sort_by_key(|&e| h.tensors[e].offset);
        for pair in order.windows(2) {
            let (a, b) = (&h.tensors[pair[0]], &h.tensors[pair[1]]);
            if a.offset + a.len > b.offset {
                return Err(Error::invalid_file(
                    src,
                    format!("resident tensors `{}` and `{}` overlap", a.name, b.name),
                ));
            }
        }
        let mut resident = Vec::with_capacity(order.len());
        for e in order {
            let t = &h.tensors[e];
            let expect = t
                .shape
                .split_last()
                .and_then(|(&cols, rows)| {
                    t.dtype
                        .row_bytes(cols)
                        .map(|rb| rb * rows.iter().product::<usize>())
                })
                .filter(|&n| n as u64 == t.len);
            if expect.is_none() {
                return Err(Error::invalid_file(
                    src,
                    format!(
                        "resident tensor `{}` ({} {:?}) has {} bytes",
                        t.name, t.dtype, t.shape, t.len
                    ),
                ));
            }
            let heads = match t.name.strip_prefix("blk.").and_then(|n| n.split_once('.')) {
                Some((_, "attn_q.weight" | "attn_q.bias")) => Some(c.n_heads),
                Some((_, "attn_k.weight" | "attn_k.bias")) => Some(c.n_kv_heads),
                _ => None,
            };
            let permute = heads.filter(|_| permute_qk);
            if let Some(heads) = permute {
                let rows = t.shape.first().copied().unwrap_or(0);
                let rb = row_bytes_of(t.dtype, &t.shape);
                if rb.is_none() || rows % heads != 0 || (rows / heads) % 2 != 0 {
                    return Err(Error::unsupported(
                        src,
                        format!(
                            "cannot permute the rows of `{}` ({} {:?}) for {heads} heads",
                            t.name, t.dtype, t.shape
                        ),
                    ));
                }
            }
            resident.push((e, Origin::Resident { entry: e, permute }));
        }
        let tile = 32usize.max(dd.block_len()).next_multiple_of(dd.block_len());
        Ok(Recipe {
            resident,
            permute_qk,
            up_at,
            down_at,
            gate_row: ffn.gate_dtype.row_bytes(d).unwrap_or(0),
            up_row: ffn.up_dtype.row_bytes(d).unwrap_or(0),
            down_col,
            down_row,
            tile,
        })
    }
}

/// Bytes of one row of a tensor whose rows are permuted: a matrix's rows, or a vector's values.
fn row_bytes_of(dtype: DType, shape: &[usize]) -> Option<usize> {
    match shape {
        [_] => dtype.row_bytes(1),
        [_, cols] => dtype.row_bytes(*cols),
        _ => None,
    }
}
