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
    let plan = Plan::new(src, &header)?;
    let (vocab, fit) = gguf_vocab(
        header.stored_tokenizer(),
        &header.special_tokens,
        header.config.vocab_size,
    )
    .map_err(|reason| Error::invalid_file(src, format!("tokenizer: {reason}")))?;
    let mut writer = GgufWriter::new();
    metadata(&mut writer, &header, &vocab);
    let mut parts = Vec::new();
    for (entry, part) in plan.resident.iter().map(|&(e, p)| (&header.tensors[e], p)) {
        writer.add_streamed_tensor(&entry.name, entry.dtype, &entry.shape)?;
        parts.push(part);
    }
    let c = &header.config;
    if let Some(factors) = &c.rope_freq_factors
        && !header.tensors.iter().any(|t| t.name == "rope_freqs.weight")
    {
        writer.add_f32_tensor("rope_freqs.weight", DType::F32, &[factors.len()], factors);
        parts.push(Part::Held);
    }
    let ffn = &header.ffn;
    for l in 0..c.n_layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        writer.add_streamed_tensor(&n("ffn_gate"), ffn.gate_dtype, &[c.n_ff, c.d_model])?;
        writer.add_streamed_tensor(&n("ffn_up"), ffn.up_dtype, &[c.n_ff, c.d_model])?;
        writer.add_streamed_tensor(&n("ffn_down"), ffn.down_dtype, &[c.d_model, c.n_ff])?;
        parts.extend([Part::Gate(l), Part::Up(l), Part::Down(l)]);
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
        plan: &plan,
        layer: None,
        buf: Vec::new(),
        resident_crc: crc32fast::Hasher::new(),
        resident_pos: 0,
        down: DownStats::default(),
    };
    let file_bytes = writer.write_file(dst, &mut |i, _name, sink| {
        reader.write(parts[i], sink)?;
        progress(ends[i], total);
        Ok(())
    })?;
    Ok(ExportReport {
        file_bytes,
        tensors: parts.len(),
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
        permuted_qk: plan.permute_qk,
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
enum Part {
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
struct Plan {
    /// Resident tensors in file order (what lets their section's checksum be computed as they
    /// are copied): directory index and part.
    resident: Vec<(usize, Part)>,
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

impl Plan {
    fn new(src: &Path, h: &Header) -> Result<Plan> {
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
            resident.push((e, Part::Resident { entry: e, permute }));
        }
        let tile = 32usize.max(dd.block_len()).next_multiple_of(dd.block_len());
        Ok(Plan {
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

/// Reads the input as the writer asks for each tensor.
struct Reader<'a> {
    src: &'a Path,
    file: &'a File,
    header: &'a Header,
    plan: &'a Plan,
    /// The FFN layer `buf` holds.
    layer: Option<usize>,
    buf: Vec<u8>,
    /// Checksum of the resident section up to `resident_pos` (from its start).
    resident_crc: crc32fast::Hasher,
    resident_pos: u64,
    down: DownStats,
}

#[derive(Default)]
struct DownStats {
    max_abs: f32,
    sq_err: f64,
    sq_src: f64,
}

impl Reader<'_> {
    fn write(&mut self, part: Part, sink: &mut TensorSink) -> Result<()> {
        match part {
            Part::Held => Ok(()),
            Part::Resident { entry, permute } => self.resident(entry, permute, sink),
            Part::Gate(l) => self.rows(l, 0, self.plan.gate_row, sink),
            Part::Up(l) => self.rows(l, self.plan.up_at, self.plan.up_row, sink),
            Part::Down(l) => self.down(l, sink),
        }
    }

    /// Feeds the resident section's bytes `[resident_pos, to)` to its checksum.
    fn checksum_to(&mut self, to: u64) -> Result<()> {
        let start = self.header.resident.offset;
        let mut piece = vec![0u8; COPY_PIECE.min(to.saturating_sub(self.resident_pos) as usize)];
        while self.resident_pos < to {
            let n = piece.len().min((to - self.resident_pos) as usize);
            read_at(
                self.src,
                self.file,
                start + self.resident_pos,
                &mut piece[..n],
            )?;
            self.resident_crc.update(&piece[..n]);
            self.resident_pos += n as u64;
        }
        Ok(())
    }

    fn resident(&mut self, e: usize, permute: Option<usize>, sink: &mut TensorSink) -> Result<()> {
        let h = self.header;
        let t = &h.tensors[e];
        // Padding before it (tensors are copied in file order).
        self.checksum_to(t.offset)?;
        let at = h.resident.offset + t.offset;
        if let Some(heads) = permute {
            let mut bytes = vec![0u8; t.len as usize];
            read_at(self.src, self.file, at, &mut bytes)?;
            self.resident_crc.update(&bytes);
            let rb = row_bytes_of(t.dtype, &t.shape).unwrap_or(bytes.len());
            sink.write(&permute_rows(&bytes, rb, heads))?;
        } else {
            let mut piece = vec![0u8; COPY_PIECE.min(t.len as usize)];
            let mut done = 0u64;
            while done < t.len {
                let n = piece.len().min((t.len - done) as usize);
                read_at(self.src, self.file, at + done, &mut piece[..n])?;
                self.resident_crc.update(&piece[..n]);
                sink.write(&piece[..n])?;
                done += n as u64;
            }
        }
        self.resident_pos = t.offset + t.len;
        if self
            .plan
            .resident
            .last()
            .is_some_and(|&(last, _)| last == e)
        {
            self.checksum_to(h.resident.len)?;
            let crc = std::mem::take(&mut self.resident_crc).finalize();
            if crc != h.resident.crc32 {
                return Err(Error::invalid_file(
                    self.src,
                    "resident section checksum mismatch: the file is corrupted",
                ));
            }
        }
        Ok(())
    }

    /// Reads FFN layer `l`'s chunks into `buf` (once for its three tensors), checking each
    /// chunk's checksum.
    fn load_layer(&mut self, l: usize) -> Result<()> {
        if self.layer == Some(l) {
            return Ok(());
        }
        let h = self.header;
        let ffn = &h.ffn;
        let chunks = ffn.chunks_per_layer(h.config.n_ff);
        self.layer = None;
        self.buf.resize(chunks * ffn.chunk_bytes, 0);
        let at = h.streamed.offset + ffn.layer_offsets[l];
        read_at(self.src, self.file, at, &mut self.buf)?;
        let bad = self
            .buf
            .par_chunks(ffn.chunk_bytes)
            .zip(&ffn.chunk_crc32[l])
            .position_first(|(chunk, &crc)| crc32fast::hash(chunk) != crc);
        if let Some(k) = bad {
            return Err(Error::invalid_file(
                self.src,
                format!("FFN layer {l} chunk {k} checksum mismatch: the file is corrupted"),
            ));
        }
        self.layer = Some(l);
        Ok(())
    }

    /// Byte offset in `buf` of neuron `i`'s bundle.
    fn bundle(&self, i: usize) -> usize {
        let ffn = &self.header.ffn;
        (i / ffn.chunk_neurons) * ffn.chunk_bytes + (i % ffn.chunk_neurons) * ffn.bundle_bytes
    }

    /// Writes the `len`-byte row at `offset` of every neuron's bundle of layer `l`.
    fn rows(&mut self, l: usize, offset: usize, len: usize, sink: &mut TensorSink) -> Result<()> {
        self.load_layer(l)?;
        for i in 0..self.header.config.n_ff {
            let at = self.bundle(i) + offset;
            sink.write(&self.buf[at..at + len])?;
        }
        Ok(())
    }

    /// Writes layer `l`'s down matrix as `d_model` rows of `n_ff` values: `tile` rows at a time,
    /// every column's segment dequantised, then each row re-encoded in the same type.
    fn down(&mut self, l: usize, sink: &mut TensorSink) -> Result<()> {
        self.load_layer(l)?;
        let (d, n_ff) = (self.header.config.d_model, self.header.config.n_ff);
        let dtype = self.header.ffn.down_dtype;
        let p = self.plan;
        let (bl, bb, tile) = (dtype.block_len(), dtype.block_bytes(), p.tile);
        let mut segments = vec![0f32; n_ff * tile];
        let mut rows = vec![0u8; tile * p.down_row];
        let this = &*self;
        let mut stats = DownStats::default();
        for r0 in (0..d).step_by(tile) {
            let t = tile.min(d - r0);
            // Neuron i's values of rows r0..r0 + t (whole blocks: r0 and d are).
            let (from, to) = (r0 / bl * bb, (r0 + t) / bl * bb);
            segments
                .par_chunks_mut(tile)
                .enumerate()
                .for_each(|(i, seg)| {
                    let col = this.bundle(i) + p.down_at;
                    let col = &this.buf[col..col + p.down_col];
                    dequantize_row(dtype, &col[from..to], &mut seg[..t]);
                });
            let part = rows[..t * p.down_row]
                .par_chunks_mut(p.down_row)
                .enumerate()
                .map_init(
                    || (vec![0f32; n_ff], vec![0f32; n_ff]),
                    |(row, back), (r, out)| {
                        for (i, x) in row.iter_mut().enumerate() {
                            *x = segments[i * tile + r];
                        }
                        quantize_row_into(dtype, row, out);
                        dequantize_row(dtype, out, back);
                        let mut s = DownStats::default();
                        for (a, b) in row.iter().zip(back.iter()) {
                            s.max_abs = s.max_abs.max((a - b).abs());
                            s.sq_err += f64::from(a - b).powi(2);
                            s.sq_src += f64::from(*a).powi(2);
                        }
                        s
                    },
                )
                .reduce(DownStats::default, DownStats::merge);
            stats = stats.merge(part);
            sink.write(&rows[..t * p.down_row])?;
        }
        self.down = std::mem::take(&mut self.down).merge(stats);
        Ok(())
    }
}

impl DownStats {
    fn merge(self, o: DownStats) -> DownStats {
        DownStats {
            max_abs: self.max_abs.max(o.max_abs),
            sq_err: self.sq_err + o.sq_err,
            sq_src: self.sq_src + o.sq_src,
        }
    }
}

/// Rows of `bytes` (`row` bytes each) reordered per head as llama.cpp's converter does for Q/K
/// (`permute` in `convert_hf_to_gguf.py`): within each head of `rows / heads` rows, row
/// `j·half + i` moves to `2i + j`.
fn permute_rows(bytes: &[u8], row: usize, heads: usize) -> Vec<u8> {
    let rows = bytes.len() / row;
    let hd = rows / heads;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let (src, dst) = (h * hd + j * (hd / 2) + i, h * hd + 2 * i + j);
                out[dst * row..(dst + 1) * row].copy_from_slice(&bytes[src * row..(src + 1) * row]);
            }
        }
    }
    out
}

/// llama.cpp's `general.file_type` (`llama_ftype`) for a model mostly of `dtype`, where one
/// type says it.
fn file_type(dtype: DType) -> Option<u32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Bf16 => 32,
        _ => return None,
    })
}

/// The metadata llama.cpp reads for the architecture, and the tokenizer.
fn metadata(w: &mut GgufWriter, h: &Header, v: &GgufVocab) {
    let c = &h.config;
    let a = c.architecture.name();
    let u = |n: usize| Value::U32(n as u32);
    let k = |s: &str| format!("{a}.{s}");
    w.add("general.architecture", Value::String(a.into()))
        .add("general.name", Value::String(h.source.clone()))
        .add(&k("block_count"), u(c.n_layers))
        .add(&k("context_length"), u(c.context_length))
        .add(&k("embedding_length"), u(c.d_model))
        .add(&k("feed_forward_length"), u(c.n_ff))
        .add(&k("attention.head_count"), u(c.n_heads))
        .add(&k("attention.head_count_kv"), u(c.n_kv_heads))
        .add(&k("rope.dimension_count"), u(c.head_dim))
        .add(&k("rope.freq_base"), Value::F32(c.rope_base))
        .add(
            &k("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_eps),
        )
        .add(&k("vocab_size"), u(c.vocab_size));
    if c.head_dim * c.n_heads != c.d_model {
        w.add(&k("attention.key_length"), u(c.head_dim))
            .add(&k("attention.value_length"), u(c.head_dim));
    }
    if let Some(ft) = file_type(h.ffn.gate_dtype) {
        w.add("general.file_type", Value::U32(ft));
    }
    w.add("tokenizer.ggml.model", Value::String(v.model.clone()));
    if let Some(pre) = &v.pre {
        w.add("tokenizer.ggml.pre", Value::String(pre.clone()));
    }
    w.add(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(v.tokens.clone())),
    );
    if !v.token_types.is_empty() {
        w.add(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(v.token_types.clone())),
        );
    }
    if !v.scores.is_empty() {
        w.add(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(v.scores.clone())),
        );
    }
    if !v.merges.is_empty() {
        w.add(
            "tokenizer.ggml.merges",
            Value::Array(Array::String(v.merges.clone())),
        );
    }
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", v.bos),
        ("tokenizer.ggml.eos_token_id", v.eos),
        ("tokenizer.ggml.unknown_token_id", v.unk),
    ] {
        if let Some(id) = id {
            w.add(key, Value::U32(id));
        }
    }
    w.add("tokenizer.ggml.add_bos_token", Value::Bool(v.add_bos));
    if let Some(p) = v.add_space_prefix {
        w.add("tokenizer.ggml.add_space_prefix", Value::Bool(p));
    }
    if let Some(t) = &h.chat_template {
        w.add("tokenizer.chat_template", Value::String(t.clone()));
    }
}

/// How the tokenizer was fitted to the embedding's rows.
#[derive(Default)]
struct VocabFit {
    dropped: usize,
    padded: usize,
    merges_dropped: usize,
}

/// GGUF token type of an id no stored token has.
const TYPE_UNUSED: i32 = 5;

/// The GGUF vocabulary of the stored tokenizer with exactly `n` tokens (the embedding's rows):
/// ids beyond it left out (with the merges that need them), missing ones filled with
/// placeholders; the special ids are `specials`. Checked by building the engine's tokenizer from
/// it, so that the exported file imports.
fn gguf_vocab(
    stored: StoredTokenizer,
    specials: &SpecialTokens,
    n: usize,
) -> std::result::Result<(GgufVocab, VocabFit), String> {
    let mut v = match stored {
        StoredTokenizer::Vocab(v) => v,
        StoredTokenizer::Json(json) => vocab_from_json(&json)?,
    };
    v.bos = specials.bos;
    v.eos = specials.eos.first().copied();
    v.add_bos = specials.add_bos;
    let mut fit = VocabFit::default();
    if v.token_types.is_empty() {
        v.token_types = vec![1; v.tokens.len()];
    }
    if v.tokens.len() > n {
        fit.dropped = v.tokens.len() - n;
        v.tokens.truncate(n);
        v.token_types.truncate(n);
        v.scores.truncate(n);
        let kept: std::collections::HashSet<&str> = v.tokens.iter().map(String::as_str).collect();
        let before = v.merges.len();
        let keep = |m: &String| {
            split_merge(m).is_some_and(|(a, b)| {
                kept.contains(a) && kept.contains(b) && kept.contains(format!("{a}{b}").as_str())
            })
        };
        let merges: Vec<String> = v.merges.iter().filter(|m| keep(m)).cloned().collect();
        fit.merges_dropped = before - merges.len();
        v.merges = merges;
        for id in [&mut v.bos, &mut v.eos, &mut v.unk] {
            if id.is_some_and(|i| i as usize >= n) {
                *id = None;
            }
        }
    }
    while v.tokens.len() < n {
        fit.padded += 1;
        v.tokens.push(format!("[PAD{}]", v.tokens.len()));
        v.token_types.push(TYPE_UNUSED);
        if !v.scores.is_empty() {
            v.scores.push(f32::MIN);
        }
    }
    Tokenizer::from_gguf(&v).map_err(|e| format!("the exported vocabulary is not valid: {e}"))?;
    Ok((v, fit))
}

/// A merge's two parts, split as llama.cpp does: at the first space after the first character.
fn split_merge(m: &str) -> Option<(&str, &str)> {
    let first = m.chars().next()?.len_utf8();
    let pos = m[first..].find(' ')? + first;
    Some((&m[..pos], &m[pos + 1..]))
}

/// `tokenizer.ggml.pre` values, one for each pre-tokenizer the engine builds for a `gpt2`
/// vocabulary; a `tokenizer.json` whose pre-tokenizer is one of them exports under its name.
const PRE_NAMES: [&str; 5] = ["smollm", "gpt-2", "llama-bpe", "qwen2", "default"];

/// The GGUF vocabulary of a byte-level BPE `tokenizer.json` (the form `leanstream synth` and
/// safetensors imports store): tokens by id, added tokens typed control (special) or
/// user-defined, merges as `"left right"`, and the `pre` whose pre-tokenizer it uses. Special
/// ids are left to the caller.
fn vocab_from_json(json: &str) -> std::result::Result<GgufVocab, String> {
    use serde_json::Value as J;
    let v: J = serde_json::from_str(json).map_err(|e| format!("tokenizer.json: {e}"))?;
    let model = &v["model"];
    if model["type"].as_str() != Some("BPE")
        || !matches!(v["decoder"]["type"].as_str(), Some("ByteLevel"))
    {
        return Err(format!(
            "only byte-level BPE tokenizers can be exported (this one is model {}, decoder {})",
            model["type"], v["decoder"]["type"]
        ));
    }
    let mut tokens: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: u64, text: &str, ty: i32| -> std::result::Result<(), String> {
        let id = usize::try_from(id)
            .ok()
            .filter(|&i| i < crate::tokenizer::MAX_VOCAB)
            .ok_or_else(|| format!("token id {id} is too large"))?;
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some((text.to_string(), ty));
        Ok(())
    };
    for (text, id) in model["vocab"]
        .as_object()
        .ok_or("tokenizer.json has no model.vocab")?
    {
        put(
            id.as_u64().ok_or("a vocabulary id is not a number")?,
            text,
            1,
        )?;
    }
    for t in v["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (t["id"].as_u64(), t["content"].as_str()) else {
            return Err("an added token has no id or content".into());
        };
        let ty = if t["special"].as_bool() == Some(true) {
            3
        } else {
            4
        };
        put(id, text, ty)?;
    }
    let (tokens, token_types) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), TYPE_UNUSED)))
        .unzip();
    let merges = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            J::String(s) => Ok(s.clone()),
            J::Array(p) => match (p.first().and_then(J::as_str), p.get(1).and_then(J::as_str)) {
                (Some(a), Some(b)) if p.len() == 2 => Ok(format!("{a} {b}")),
                _ => Err("a merge is not a pair of strings".to_string()),
            },
            _ => Err("a merge is neither a string nor a pair".to_string()),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let unk = model["unk_token"]
        .as_str()
        .and_then(|u| model["vocab"][u].as_u64())
        .map(|id| id as u32);
    Ok(GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre_of(&v)?.to_string()),
        tokens,
        token_types,
        merges,
        unk,
        ..GgufVocab::default()
    })
}

/// The `pre` name whose pre-tokenizer (as the engine builds it for a GGUF vocabulary) is the
/// one of `tokenizer` (parsed `tokenizer.json`), compared as written and, failing that, as the
/// `tokenizers` crate writes it back.
fn pre_of(tokenizer: &serde_json::Value) -> std::result::Result<&'static str, String> {
    let candidates: Vec<(&str, serde_json::Value)> = PRE_NAMES
        .iter()
        .filter_map(|&pre| {
            let probe = GgufVocab {
                model: "gpt2".into(),
                pre: Some(pre.into()),
                tokens: vec!["a".into(), "b".into(), "ab".into()],
                token_types: vec![1; 3],
                merges: vec!["a b".into()],
                ..GgufVocab::default()
            };
            let json = Tokenizer::from_gguf(&probe).ok()?.to_json().ok()?;
            let v: serde_json::Value = serde_json::from_str(&json).ok()?;
            Some((pre, v["pre_tokenizer"].clone()))
        })
        .collect();
    let find = |pt: &serde_json::Value| candidates.iter().find(|(_, c)| c == pt).map(|(p, _)| *p);
    if let Some(pre) = find(&tokenizer["pre_tokenizer"]) {
        return Ok(pre);
    }
    let rewritten = Tokenizer::from_json(&tokenizer.to_string(), Default::default())
        .and_then(|t| t.to_json())
        .ok()
        .and_then(|j| serde_json::from_str::<serde_json::Value>(&j).ok());
    rewritten
        .and_then(|r| find(&r["pre_tokenizer"]))
        .ok_or_else(|| {
            format!(
                "its pre-tokenizer matches none of GGUF's {}: {}",
                PRE_NAMES.join(", "),
                tokenizer["pre_tokenizer"]
            )
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly on purpose
mod tests {
    use super::*;
    use crate::model::TensorBytes;
    use crate::model::gguf::writer::TinyLlama;
    use crate::model::gguf::{GgufFile, GgufModel};

    /// The tiny models' GGUF vocabulary (128 tokens, 29 merges, `pre` smollm).
    fn tiny_vocab() -> GgufVocab {
        let bytes = TinyLlama::new(0).gguf_writer(DType::F32).to_bytes();
        let f = GgufFile::parse(Path::new("tiny.gguf"), TensorBytes::from_vec(bytes)).unwrap();
        GgufModel::from_file(&f).unwrap().vocab
    }

    fn eos(id: u32) -> SpecialTokens {
        SpecialTokens {
            bos: None,
            eos: vec![id],
            add_bos: false,
        }
    }

    #[test]
    fn a_tokenizer_json_gives_back_the_gguf_vocabulary() {
        let want = tiny_vocab();
        // Written by hand (the tiny models' tokenizer.json) and by the tokenizers crate from the
        // GGUF vocabulary (what `synth --tokenizer-from` stores).
        let crate_json = Tokenizer::from_gguf(&want).unwrap().to_json().unwrap();
        for json in [TinyLlama::new(0).tokenizer_json(), crate_json] {
            let v = vocab_from_json(&json).unwrap();
            assert_eq!(v.tokens, want.tokens);
            assert_eq!(v.token_types, want.token_types);
            assert_eq!(v.merges, want.merges);
            assert_eq!(
                (v.model.as_str(), v.pre.as_deref()),
                ("gpt2", Some("smollm"))
            );
        }
        // Each pre-tokenizer maps back to its name.
        for pre in ["gpt-2", "llama-bpe", "qwen2", "default"] {
            let mut v = tiny_vocab();
            v.pre = Some(pre.into());
            let json = Tokenizer::from_gguf(&v).unwrap().to_json().unwrap();
            assert_eq!(vocab_from_json(&json).unwrap().pre.as_deref(), Some(pre));
        }
    }

    #[test]
    fn what_cannot_be_a_gguf_vocabulary_is_named() {
        let mut v: serde_json::Value =
            serde_json::from_str(&TinyLlama::new(0).tokenizer_json()).unwrap();
        v["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
        let e = vocab_from_json(&v.to_string()).unwrap_err();
        assert!(
            e.contains("pre-tokenizer matches none") && e.contains("Whitespace"),
            "{e}"
        );
        v["decoder"] = serde_json::json!({"type": "Metaspace", "replacement": "▁",
            "prepend_scheme": "always", "split": true});
        let e = vocab_from_json(&v.to_string()).unwrap_err();
        assert!(e.contains("only byte-level BPE"), "{e}");
    }

    #[test]
    fn the_vocabulary_is_cut_or_padded_to_the_embedding_rows() {
        let stored = StoredTokenizer::Vocab(tiny_vocab());
        let (v, fit) = gguf_vocab(stored.clone(), &eos(2), 110).unwrap();
        assert_eq!((v.tokens.len(), v.token_types.len()), (110, 110));
        assert_eq!((fit.dropped, fit.padded), (18, 0));
        // Merge results are ids 99.. in merge order: the first 11 merges stay.
        assert_eq!(v.merges, tiny_vocab().merges[..11]);
        assert_eq!(fit.merges_dropped, 18);
        assert_eq!(v.eos, Some(2));
        let t = Tokenizer::from_gguf(&v).unwrap();
        let ids = t.encode("the cat sat").unwrap();
        assert!(ids.iter().all(|&i| i < 110), "{ids:?}");
        assert_eq!(t.decode(&ids).unwrap(), "the cat sat");

        let (v, fit) = gguf_vocab(stored.clone(), &eos(2), 140).unwrap();
        assert_eq!((v.tokens.len(), fit.padded, fit.dropped), (140, 12, 0));
        assert_eq!(
            (v.tokens[139].as_str(), v.token_types[139]),
            ("[PAD139]", 5)
        );
        assert_eq!(v.merges.len(), 29);

        // A special id beyond the cut is left out rather than pointing nowhere.
        let (v, _) = gguf_vocab(stored, &eos(120), 110).unwrap();
        assert_eq!(v.eos, None);
    }
}
