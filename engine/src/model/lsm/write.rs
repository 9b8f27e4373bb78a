//! `leanstream convert`: writes a `.lsm` file from any imported model.
//!
//! Sections are written first, after a gap reserved for the header (its size is bounded by
//! serialising it with the widest possible numbers); the header goes in last. Output goes to
//! `DST.partial` and is renamed into place only when complete, so a failed conversion never leaves
//! a half-written model behind.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::{
    ALIGN, DownError, FfnLayout, Header, MAGIC, PREAMBLE_LEN, Section, TensorEntry, VERSION,
};
use crate::model::{Down, ImportedModel, QRows, Weights};
use crate::quant::{DType, quantize_row};
use crate::{Error, Result};

/// Conversion settings.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Neurons per chunk (the unit of reading and caching). `None` (the default): as many whole
    /// neuron bundles as fit one [`ALIGN`] page, at least one — the smallest read the storage
    /// serves, so a chunk is needed only when one of a few neurons is active.
    pub chunk_neurons: Option<usize>,
    /// Storage type of the transposed down columns, one of [`DOWN_DTYPES`]: `Q8_0` (the
    /// default: 1.06 bytes a value, relative RMS error ~4e-3, below the sparse path's own
    /// approximation); `Q5_0` (0.69 bytes) and `Q4_0` (0.56) make a neuron's bundle smaller,
    /// so more of them fit a read; `F16`, `F32` for reference.
    pub down_dtype: DType,
}

/// The types a down column may be stored in.
pub const DOWN_DTYPES: [DType; 5] = [
    DType::Q8_0,
    DType::Q5_0,
    DType::Q4_0,
    DType::F16,
    DType::F32,
];

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            chunk_neurons: None,
            down_dtype: DType::Q8_0,
        }
    }
}

/// What a conversion wrote.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    pub file_bytes: u64,
    pub resident_bytes: u64,
    pub streamed_bytes: u64,
    /// Bytes of chunk padding inside the streamed section.
    pub padding_bytes: u64,
    pub chunk_bytes: usize,
    /// Neurons per chunk, as chosen (see [`ConvertOptions::chunk_neurons`]).
    pub chunk_neurons: usize,
    pub down_error: DownError,
}

pub(super) fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

fn is_ffn_tensor(name: &str) -> bool {
    name.starts_with("blk.")
        && [".ffn_gate.weight", ".ffn_up.weight", ".ffn_down.weight"]
            .iter()
            .any(|s| name.ends_with(s))
}

/// A sequential writer that knows its position.
pub(super) struct Out {
    w: BufWriter<File>,
    path: PathBuf,
    pub(super) pos: u64,
}

impl Out {
    /// Creates (truncates) `path`.
    pub(super) fn create(path: &Path) -> Result<Out> {
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(Out {
            w: BufWriter::with_capacity(1 << 20, file),
            path: path.to_path_buf(),
            pos: 0,
        })
    }

    /// Writes the preamble and `json` at the start of the file (into the gap reserved for them)
    /// and syncs the file.
    pub(super) fn finish(mut self, json: &[u8]) -> Result<()> {
        let mut pre = [0u8; PREAMBLE_LEN];
        pre[..8].copy_from_slice(&MAGIC);
        pre[8..12].copy_from_slice(&VERSION.to_le_bytes());
        pre[16..24].copy_from_slice(&(json.len() as u64).to_le_bytes());
        pre[24..28].copy_from_slice(&crc32fast::hash(json).to_le_bytes());
        let path = self.path.clone();
        self.w.flush().map_err(|e| Error::io(&path, e))?;
        let file = self.w.get_mut();
        file.seek(SeekFrom::Start(0))
            .map_err(|e| Error::io(&path, e))?;
        file.write_all(&pre)
            .and_then(|_| file.write_all(json))
            .map_err(|e| Error::io(&path, e))?;
        file.sync_all().map_err(|e| Error::io(&path, e))
    }

    pub(super) fn write(&mut self, b: &[u8]) -> Result<()> {
        self.w.write_all(b).map_err(|e| Error::io(&self.path, e))?;
        self.pos += b.len() as u64;
        Ok(())
    }

    /// Writes one tensor of a CRC-checked section at the next 64-byte boundary, feeding the zero
    /// padding and `bytes` to the section's `crc`. Returns its offset from `section_start` and
    /// its length, as the tensor directory records them.
    pub(super) fn write_tensor(
        &mut self,
        section_start: u64,
        bytes: &[u8],
        crc: &mut crc32fast::Hasher,
    ) -> Result<(u64, u64)> {
        let at = self.pos.div_ceil(64) * 64;
        crc.update(&[0u8; 64][..(at - self.pos) as usize]);
        self.pad_to(at)?;
        crc.update(bytes);
        self.write(bytes)?;
        Ok((at - section_start, bytes.len() as u64))
    }

    /// The section that started at `start` and ends here, with the CRC of what was written.
    pub(super) fn section_since(&self, start: u64, crc: crc32fast::Hasher) -> Section {
        Section {
            offset: start,
            len: self.pos - start,
            crc32: crc.finalize(),
        }
    }

    pub(super) fn pad_to(&mut self, at: u64) -> Result<()> {
        const ZEROS: [u8; ALIGN] = [0; ALIGN];
        while self.pos < at {
            let n = ((at - self.pos) as usize).min(ALIGN);
            self.write(&ZEROS[..n])?;
        }
        Ok(())
    }
}

/// The down type a conversion should use where none is asked for: `Q8_0`, unless `Q5_0` makes a
/// chunk cost fewer bytes per neuron. A read moves whole pages, so the precision is only given up
/// where it saves reads: at SmolLM2's shape a page holds three bundles either way (Q8_0 kept);
/// at a 7B shape a one-neuron bundle is 8960 B with Q8_0 (three pages) and 7424 B with Q5_0 (two).
pub fn default_down_dtype(src: &ImportedModel, chunk_neurons: Option<usize>) -> Result<DType> {
    let weights = Weights::from_imported(src)?;
    Ok(match weights.layers.first().map(|l| &l.ffn) {
        Some(f) => down_dtype_for(
            f.gate.row_bytes() + f.up.row_bytes(),
            weights.config.d_model,
            chunk_neurons,
        ),
        None => DType::Q8_0,
    })
}

/// [`default_down_dtype`] for a bundle whose gate and up rows take `gate_up` bytes, at width `d`.
fn down_dtype_for(gate_up: usize, d: usize, chunk_neurons: Option<usize>) -> DType {
    let per_neuron = |t: DType| {
        let bundle = gate_up + t.row_bytes(d)?;
        let k = chunk_neurons.unwrap_or((ALIGN / bundle).max(1));
        Some(align_up((k * bundle) as u64) as f64 / k as f64)
    };
    match (per_neuron(DType::Q8_0), per_neuron(DType::Q5_0)) {
        (Some(q8), Some(q5)) if q5 < q8 => DType::Q5_0,
        (None, Some(_)) => DType::Q5_0,
        _ => DType::Q8_0,
    }
}

/// Converts `src` into a `.lsm` file at `dst`, calling `progress(done, total)` per FFN layer.
pub fn convert(
    src: &ImportedModel,
    dst: &Path,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ConvertReport> {
    if let Some(k @ (0 | 4097..)) = opts.chunk_neurons {
        return Err(Error::InvalidArgument {
            arg: "chunk_neurons",
            reason: format!("{k} is outside 1..=4096"),
        });
    }
    if !DOWN_DTYPES.contains(&opts.down_dtype) {
        let names: Vec<String> = DOWN_DTYPES.iter().map(ToString::to_string).collect();
        return Err(Error::InvalidArgument {
            arg: "down_dtype",
            reason: format!("{} is not one of {}", opts.down_dtype, names.join(", ")),
        });
    }
    let weights = Weights::from_imported(src)?;
    let c = &weights.config;
    let (d, n_ff) = (c.d_model, c.n_ff);
    let first = &weights.layers[0].ffn;
    let (gate_dtype, up_dtype) = (first.gate.dtype, first.up.dtype);
    let down_row = opts
        .down_dtype
        .row_bytes(d)
        .ok_or_else(|| Error::InvalidArgument {
            arg: "down_dtype",
            reason: format!(
                "d_model {d} is not a whole number of {} blocks",
                opts.down_dtype
            ),
        })?;
    let bundle_bytes = first.gate.row_bytes() + first.up.row_bytes() + down_row;
    let k = opts
        .chunk_neurons
        .unwrap_or_else(|| (ALIGN / bundle_bytes).clamp(1, n_ff.max(1)));
    let chunk_bytes = align_up((k * bundle_bytes) as u64) as usize;
    let chunks = n_ff.div_ceil(k);

    // The header with the widest numbers bounds the real one: reserve that much.
    let (tokenizer_json, tokenizer_vocab) = Header::tokenizer_fields(src.tokenizer.stored()?);
    let mut header = Header {
        config: c.clone(),
        tokenizer_json,
        tokenizer_vocab,
        special_tokens: src.tokenizer.specials().clone(),
        chat_template: src.chat_template.clone(),
        source: src
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        resident: Section {
            offset: u64::MAX,
            len: u64::MAX,
            crc32: u32::MAX,
        },
        streamed: Section {
            offset: u64::MAX,
            len: u64::MAX,
            crc32: u32::MAX,
        },
        tensors: Vec::new(),
        ffn: FfnLayout {
            chunk_neurons: k,
            gate_dtype,
            up_dtype,
            down_dtype: opts.down_dtype,
            bundle_bytes,
            chunk_bytes,
            layer_offsets: vec![u64::MAX; c.n_layers],
            chunk_crc32: vec![vec![u32::MAX; chunks]; c.n_layers],
            permutation: Vec::new(),
            down_error: DownError {
                max_abs: f32::MAX,
                rms_rel: f32::MAX,
            },
        },
        calibration: None,
    };
    let resident: Vec<_> = src
        .tensors
        .iter()
        .filter(|(n, _)| !is_ffn_tensor(n))
        .collect();
    header.tensors = resident
        .iter()
        .map(|(n, t)| TensorEntry {
            name: n.to_string(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            offset: u64::MAX,
            len: u64::MAX,
        })
        .collect();
    let reserve = serde_json::to_vec(&header)
        .map_err(|e| Error::invalid_file(dst, e.to_string()))?
        .len();

    let partial = dst.with_extension("lsm.partial");
    let mut out = Out::create(&partial)?;
    let result = (|| {
        out.pad_to(align_up((PREAMBLE_LEN + reserve) as u64))?;

        // Resident section: tensors in their source type, 64-byte aligned.
        let res_start = out.pos;
        let mut crc = crc32fast::Hasher::new();
        for (entry, (_, t)) in header.tensors.iter_mut().zip(&resident) {
            (entry.offset, entry.len) = out.write_tensor(res_start, &t.data, &mut crc)?;
        }
        header.resident = out.section_since(res_start, crc);

        // Streamed section: per layer, chunks of neuron bundles.
        out.pad_to(align_up(out.pos))?;
        let str_start = out.pos;
        let mut section_crc = crc32fast::Hasher::new();
        let mut err = ErrorStats::default();
        let mut chunk = Vec::with_capacity(chunk_bytes);
        for (l, layer) in weights.layers.iter().enumerate() {
            let Down::Rows(down) = &layer.ffn.down else {
                return Err(Error::invalid_file(
                    &src.path,
                    "source FFN down must be a plain matrix",
                ));
            };
            let columns = down_columns(down, opts.down_dtype, &mut err);
            header.ffn.layer_offsets[l] = out.pos - str_start;
            for ci in 0..chunks {
                chunk.clear();
                for i in ci * k..((ci + 1) * k).min(n_ff) {
                    chunk.extend_from_slice(layer.ffn.gate.row(i));
                    chunk.extend_from_slice(layer.ffn.up.row(i));
                    chunk.extend_from_slice(&columns[i * down_row..(i + 1) * down_row]);
                }
                chunk.resize(chunk_bytes, 0);
                header.ffn.chunk_crc32[l][ci] = crc32fast::hash(&chunk);
                section_crc.update(&chunk);
                out.write(&chunk)?;
            }
            progress(l + 1, c.n_layers);
        }
        header.streamed = out.section_since(str_start, section_crc);
        header.ffn.down_error = err.finish();

        // Header and preamble, into the reserved gap.
        let json =
            serde_json::to_vec(&header).map_err(|e| Error::invalid_file(dst, e.to_string()))?;
        assert!(json.len() <= reserve, "header outgrew its reservation");
        let file_bytes = out.pos;
        out.finish(&json)?;
        Ok(ConvertReport {
            file_bytes,
            resident_bytes: header.resident.len,
            streamed_bytes: header.streamed.len,
            padding_bytes: (chunk_bytes * chunks * c.n_layers - bundle_bytes * n_ff * c.n_layers)
                as u64,
            chunk_bytes,
            chunk_neurons: k,
            down_error: header.ffn.down_error.clone(),
        })
    })();
    commit(&partial, dst, result)
}

/// Renames `partial` onto `dst` when `result` is a success; removes it otherwise.
pub(super) fn commit<T>(partial: &Path, dst: &Path, result: Result<T>) -> Result<T> {
    match result {
        Ok(report) => {
            std::fs::rename(partial, dst).map_err(|e| Error::io(dst, e))?;
            Ok(report)
        }
        Err(e) => {
            let _ = std::fs::remove_file(partial);
            Err(e)
        }
    }
}

#[derive(Default)]
struct ErrorStats {
    max_abs: f32,
    sq_err: f64,
    sq_src: f64,
}

impl ErrorStats {
    fn finish(&self) -> DownError {
        DownError {
            max_abs: self.max_abs,
            rms_rel: if self.sq_src > 0.0 {
                (self.sq_err / self.sq_src).sqrt() as f32
            } else {
                0.0
            },
        }
    }
}

/// Transposes the down matrix `(d_model, n_ff)` into neuron-major columns encoded in `dtype`,
/// accumulating the re-encoding error.
fn down_columns(down: &QRows, dtype: DType, err: &mut ErrorStats) -> Vec<u8> {
    let (d, n_ff) = (down.rows, down.cols);
    let mut dense = vec![0f32; d * n_ff];
    for (j, row) in dense.chunks_exact_mut(n_ff).enumerate() {
        down.dequantize_row(j, row);
    }
    let mut out = Vec::with_capacity(n_ff * dtype.row_bytes(d).unwrap_or(0));
    let mut col = vec![0f32; d];
    let mut back = vec![0f32; d];
    for i in 0..n_ff {
        for (j, v) in col.iter_mut().enumerate() {
            *v = dense[j * n_ff + i];
        }
        let start = out.len();
        quantize_row(dtype, &col, &mut out);
        crate::quant::dequantize_row(dtype, &out[start..], &mut back);
        for (a, b) in col.iter().zip(&back) {
            err.max_abs = err.max_abs.max((a - b).abs());
            err.sq_err += f64::from(a - b).powi(2);
            err.sq_src += f64::from(*a).powi(2);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_down_type_drops_to_q5_0_only_where_that_saves_pages() {
        // Llama-2-7B: Q4_0 gate and up rows of 4096 values, 2304 B each.
        assert_eq!(down_dtype_for(2 * 2304, 4096, None), DType::Q5_0);
        // SmolLM2-135M: Q4_1 rows of 576 values, 360 B each; three bundles a page either way.
        assert_eq!(down_dtype_for(2 * 360, 576, None), DType::Q8_0);
        // Eight 7B neurons a chunk: 18 pages against 15.
        assert_eq!(down_dtype_for(2 * 2304, 4096, Some(8)), DType::Q5_0);
        // A width that is no whole number of 32-value blocks keeps Q8_0 (refused later).
        assert_eq!(down_dtype_for(100, 100, None), DType::Q8_0);
    }
}
