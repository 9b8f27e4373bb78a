//! What a model file is, in two words, without loading it: its architecture and how its
//! weights are quantised (what `leanstream models` lists). Reads only the header, through a
//! memory map, so listing a directory of large files is cheap.

use std::collections::BTreeMap;
use std::path::Path;

use super::gguf::{GgufFile, ggml_type_name};
use super::lsm::LsmFile;
use super::{Residency, SourceKind, map_file};
use crate::Result;

/// A model file's architecture and quantisation, for display.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSummary {
    /// `llama`, `qwen2`, `gemma3`, … (GGUF's `general.architecture`, or the `.lsm` config's).
    pub architecture: String,
    /// The file type llama.cpp's quantiser wrote, when known (`Q4_K_M`), then the share of
    /// matrix bytes per stored type, largest first: `Q4_K_M (q8_0 53%, q5_0 26%, q6_k 13%, …)`.
    pub quantization: String,
}

/// Summarises the GGUF or `.lsm` file at `path` (a safetensors directory is `safetensors`).
pub fn summarize(path: &Path) -> Result<ModelSummary> {
    match SourceKind::detect(path)? {
        SourceKind::Gguf => {
            let f = GgufFile::parse(path, map_file(path)?)?;
            let mut bytes = BTreeMap::new();
            for t in f.tensors().iter().filter(|t| t.shape.len() >= 2) {
                let n = t.shape.iter().product::<usize>() as u64;
                let stored = t.dtype().and_then(|d| d.row_bytes(n as usize));
                *bytes
                    .entry(ggml_type_name(t.ggml_type).to_string())
                    .or_default() += stored.map_or(n, |b| b as u64);
            }
            let ftype = f
                .get_uint("general.file_type")?
                .and_then(|v| u32::try_from(v).ok())
                .and_then(file_type_name);
            Ok(ModelSummary {
                architecture: f.require_str("general.architecture")?.to_string(),
                quantization: describe(ftype, &bytes),
            })
        }
        SourceKind::Lsm => {
            let f = LsmFile::open_with(path, Residency::Mapped)?;
            let h = &f.header;
            let mut bytes = BTreeMap::new();
            for t in h.tensors.iter().filter(|t| t.shape.len() >= 2) {
                let n = t.shape.iter().product::<usize>();
                *bytes.entry(t.dtype.name().to_string()).or_default() +=
                    t.dtype.row_bytes(n).unwrap_or(n) as u64;
            }
            let c = &h.config;
            let ffn = &h.ffn;
            for dtype in [ffn.gate_dtype, ffn.up_dtype, ffn.down_dtype] {
                let b = dtype.row_bytes(c.d_model).unwrap_or(c.d_model) * c.n_ff * c.n_layers;
                *bytes.entry(dtype.name().to_string()).or_default() += b as u64;
            }
            Ok(ModelSummary {
                architecture: c.architecture.name().to_string(),
                quantization: describe(None, &bytes),
            })
        }
        SourceKind::SafetensorsDir => Ok(ModelSummary {
            architecture: "safetensors".into(),
            quantization: "float".into(),
        }),
    }
}

/// `FTYPE (type p%, …)` with the types largest first (those under 1 % left out).
fn describe(ftype: Option<&str>, bytes: &BTreeMap<String, u64>) -> String {
    let total: u64 = bytes.values().sum::<u64>().max(1);
    let mut by_size: Vec<(&String, u64)> = bytes.iter().map(|(k, &v)| (k, v)).collect();
    by_size.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mix: Vec<String> = by_size
        .into_iter()
        .map(|(name, b)| (name, (b * 100 + total / 2) / total))
        .filter(|(_, pct)| *pct >= 1)
        .map(|(name, pct)| format!("{name} {pct}%"))
        .collect();
    match ftype {
        Some(f) => format!("{f} ({})", mix.join(", ")),
        None => mix.join(", "),
    }
}

/// llama.cpp's `llama_ftype` values (the `general.file_type` metadata) by name.
fn file_type_name(v: u32) -> Option<&'static str> {
    Some(match v {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        30 => "IQ4_XS",
        32 => "BF16",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_lists_types_by_share_of_bytes() {
        let bytes: BTreeMap<String, u64> = [("q4_k", 30), ("q8_0", 60), ("f32", 10), ("x", 0)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(
            describe(Some("Q4_K_M"), &bytes),
            "Q4_K_M (q8_0 60%, q4_k 30%, f32 10%)"
        );
        assert_eq!(describe(None, &bytes), "q8_0 60%, q4_k 30%, f32 10%");
        assert_eq!(file_type_name(15), Some("Q4_K_M"));
        assert_eq!(file_type_name(4), None);
    }
}
