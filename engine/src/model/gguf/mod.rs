//! GGUF import: the parser ([`GgufFile`]), the mapping of llama-family metadata to
//! [`ModelConfig`] ([`GgufModel`]), and a small writer for tests ([`writer`]).
//!
//! Supported: GGUF v2 and v3; architectures `llama`, `mistral` (adjacent-pair RoPE: llama.cpp's
//! converter permuted Q/K; Llama 3.x frequency scaling from `rope_freqs.weight`), `qwen2`
//! (half-split RoPE, Q/K/V biases), `qwen3` (half-split RoPE, QK-norm) and `gemma3` (see
//! [`Architecture::Gemma3`]); the tensor types of [`crate::quant::DType`].

mod reader;
mod tiny;
mod value;
pub mod writer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use reader::{DEFAULT_ALIGNMENT, GgufFile, GgufTensorInfo, MAGIC, MAX_DIMS};
pub use tiny::{TinyArch, TinyLlama, TinyShape, permute_qk, tiny_llama};
pub use value::{Array, Value, dtype_from_ggml, ggml_type_name, ggml_type_of};

use super::{
    Architecture, FfnActivation, ImportedModel, ModelConfig, RopeStyle, SlidingWindow, TensorRef,
};
use crate::tokenizer::{GgufVocab, Tokenizer};
use crate::{Error, Result};

/// Architectures (`general.architecture`) this importer maps.
pub const SUPPORTED_ARCHITECTURES: &str = "llama, mistral, qwen2, qwen3, gemma3";

/// Everything a GGUF file yields except the built tokenizer: config, tensors under their GGUF
/// (canonical) names, the raw vocabulary and the chat template.
#[derive(Debug)]
pub struct GgufModel {
    /// The file it was read from.
    pub path: PathBuf,
    /// Validated hyper-parameters.
    pub config: ModelConfig,
    /// Every tensor of the file under its GGUF name (the canonical names of [`ImportedModel`]).
    pub tensors: BTreeMap<String, TensorRef>,
    /// The `tokenizer.ggml.*` metadata (`add_bos` defaults to true only for `llama` vocabularies).
    pub vocab: GgufVocab,
    /// `tokenizer.chat_template`, if present.
    pub chat_template: Option<String>,
}

/// Imports a GGUF file: parse, map the config, collect tensors, build the tokenizer.
pub fn import(path: &Path) -> Result<ImportedModel> {
    GgufModel::read(path)?.into_imported()
}

impl GgufModel {
    /// Opens and maps `path` (no tokenizer is built).
    pub fn read(path: &Path) -> Result<GgufModel> {
        GgufModel::from_file(&GgufFile::open(path)?)
    }

    /// Maps a parsed file.
    pub fn from_file(f: &GgufFile) -> Result<GgufModel> {
        let vocab = read_vocab(f)?;
        let tensors = f
            .tensors()
            .iter()
            .map(|t| Ok((t.name.clone(), f.tensor_ref(t)?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let config = read_config(f, &vocab, &tensors)?;
        Ok(GgufModel {
            path: f.path().to_path_buf(),
            config,
            tensors,
            vocab,
            chat_template: f.get_str("tokenizer.chat_template")?.map(str::to_string),
        })
    }

    /// Builds the tokenizer from the vocabulary and returns the full model.
    pub fn into_imported(self) -> Result<ImportedModel> {
        let tokenizer = Tokenizer::from_gguf(&self.vocab).map_err(|e| match e {
            Error::Tokenizer(reason) => {
                Error::invalid_file(&self.path, format!("tokenizer.ggml.*: {reason}"))
            }
            other => other,
        })?;
        Ok(self.with_tokenizer(tokenizer))
    }

    /// The full model with a tokenizer supplied by the caller (tests, or a tokenizer.json that
    /// overrides the GGUF one).
    pub fn with_tokenizer(self, tokenizer: Tokenizer) -> ImportedModel {
        ImportedModel {
            path: self.path,
            config: self.config,
            tensors: self.tensors,
            tokenizer,
            chat_template: self.chat_template,
        }
    }
}

fn to_usize(f: &GgufFile, key: &str, v: u64) -> Result<usize> {
    usize::try_from(v)
        .map_err(|_| Error::invalid_file(f.path(), format!("metadata `{key}` = {v} is too large")))
}

fn read_config(
    f: &GgufFile,
    vocab: &GgufVocab,
    tensors: &BTreeMap<String, TensorRef>,
) -> Result<ModelConfig> {
    let arch = f.require_str("general.architecture")?;
    let (architecture, rope_style) = match arch {
        "llama" | "mistral" => (Architecture::Llama, RopeStyle::AdjacentPairs),
        "qwen2" => (Architecture::Qwen2, RopeStyle::HalfSplit),
        "qwen3" => (Architecture::Qwen3, RopeStyle::HalfSplit),
        "gemma3" => (Architecture::Gemma3, RopeStyle::HalfSplit),
        other => {
            return Err(Error::unsupported(
                f.path(),
                format!(
                    "architecture `{other}` is not supported; supported: {SUPPORTED_ARCHITECTURES}"
                ),
            ));
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let req = |k: &str| {
        let k = key(k);
        to_usize(f, &k, f.require_uint(&k)?)
    };
    let opt = |k: &str| -> Result<Option<usize>> {
        let k = key(k);
        f.get_uint(&k)?.map(|v| to_usize(f, &k, v)).transpose()
    };
    let n_heads = req("attention.head_count")?;
    let d_model = req("embedding_length")?;
    let head_dim = match opt("attention.key_length")? {
        Some(h) => h,
        None if n_heads > 0 => d_model / n_heads,
        None => 0,
    };
    if let Some(v) = opt("attention.value_length")?
        && v != head_dim
    {
        return Err(Error::unsupported(
            f.path(),
            format!("value head width {v} differs from key head width {head_dim}"),
        ));
    }
    if let Some(r) = opt("rope.dimension_count")?
        && r != head_dim
    {
        return Err(Error::unsupported(
            f.path(),
            format!("partial RoPE ({r} of {head_dim} dimensions per head) is not supported"),
        ));
    }
    let float = |k: &str, default: Option<f32>| -> Result<f32> {
        let k = key(k);
        match (f.get_float(&k)?, default) {
            (Some(v), _) => Ok(v as f32),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(Error::invalid_file(
                f.path(),
                format!("metadata key `{k}` is missing"),
            )),
        }
    };
    let rope_freq_factors = rope_freq_factors(f, &key, tensors, head_dim)?;
    let gemma = architecture == Architecture::Gemma3;
    let sliding_window = match opt("attention.sliding_window")? {
        // llama.cpp's Gemma 3: five local layers, then a global one; local RoPE base 10000.
        Some(window) if gemma => Some(SlidingWindow {
            window,
            global_every: opt("attention.sliding_window_pattern")?.unwrap_or(6),
            rope_base: float("rope.freq_base_swa", Some(10_000.0))?,
        }),
        Some(_) => {
            return Err(Error::unsupported(
                f.path(),
                format!("sliding-window attention is supported for gemma3 only, not `{arch}`"),
            ));
        }
        None => None,
    };
    let config = ModelConfig {
        architecture,
        n_layers: req("block_count")?,
        d_model,
        n_ff: req("feed_forward_length")?,
        n_heads,
        n_kv_heads: opt("attention.head_count_kv")?.unwrap_or(n_heads),
        head_dim,
        vocab_size: opt("vocab_size")?.unwrap_or(vocab.tokens.len()),
        context_length: req("context_length")?,
        rope_base: float("rope.freq_base", Some(10000.0))?,
        rope_style,
        rms_eps: float("attention.layer_norm_rms_epsilon", None)?,
        activation: if gemma {
            FfnActivation::GeluTanh
        } else {
            FfnActivation::Silu
        },
        tied_embeddings: !tensors.contains_key("output.weight"),
        qk_norm: tensors.contains_key("blk.0.attn_q_norm.weight"),
        post_norms: gemma,
        embedding_scale: if gemma { (d_model as f32).sqrt() } else { 1.0 },
        sliding_window,
        rope_freq_factors,
    };
    config
        .validate()
        .map_err(|reason| Error::invalid_file(f.path(), reason))?;
    if !vocab.tokens.is_empty() && vocab.tokens.len() != config.vocab_size {
        return Err(Error::invalid_file(
            f.path(),
            format!(
                "tokenizer.ggml.tokens has {} entries but the vocabulary size is {}",
                vocab.tokens.len(),
                config.vocab_size
            ),
        ));
    }
    Ok(config)
}

/// The divisors of the RoPE frequencies: `rope_freqs.weight` (Llama 3.x, `head_dim / 2` f32
/// values), or a linear scaling factor; an error for other scaling types.
fn rope_freq_factors(
    f: &GgufFile,
    key: &dyn Fn(&str) -> String,
    tensors: &BTreeMap<String, TensorRef>,
    head_dim: usize,
) -> Result<Option<Vec<f32>>> {
    if let Some(t) = tensors.get("rope_freqs.weight") {
        let n = head_dim / 2;
        if t.shape != [n] || t.dtype.block_len() != 1 || t.dtype.row_bytes(n) != Some(t.data.len())
        {
            return Err(Error::invalid_file(
                f.path(),
                format!(
                    "rope_freqs.weight is {} {:?}; expected {n} float values",
                    t.dtype, t.shape
                ),
            ));
        }
        let mut v = vec![0f32; n];
        crate::quant::dequantize_row(t.dtype, &t.data, &mut v);
        return Ok(Some(v));
    }
    let scaling = f.get_str(&key("rope.scaling.type"))?;
    match scaling {
        None | Some("none") => Ok(None),
        Some("linear") => {
            let k = key("rope.scaling.factor");
            let factor = f.get_float(&k)?.unwrap_or(1.0) as f32;
            Ok((factor != 1.0).then(|| vec![factor; head_dim / 2]))
        }
        Some(other) => Err(Error::unsupported(
            f.path(),
            format!(
                "RoPE scaling `{}={other}` is not supported (supported: none, linear, and \
                 Llama 3's rope_freqs.weight)",
                key("rope.scaling.type")
            ),
        )),
    }
}

fn read_vocab(f: &GgufFile) -> Result<GgufVocab> {
    let model = f
        .get_str("tokenizer.ggml.model")?
        .unwrap_or_default()
        .to_string();
    let tokens = f
        .get_str_array("tokenizer.ggml.tokens")?
        .unwrap_or_default()
        .to_vec();
    let token_types = f
        .get_i32_array("tokenizer.ggml.token_type")?
        .unwrap_or_default()
        .to_vec();
    if !token_types.is_empty() && token_types.len() != tokens.len() {
        return Err(Error::invalid_file(
            f.path(),
            format!(
                "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                token_types.len(),
                tokens.len()
            ),
        ));
    }
    let id = |k: &str| -> Result<Option<u32>> {
        match f.get_uint(k)? {
            None => Ok(None),
            Some(v) if usize::try_from(v).is_ok_and(|i| i < tokens.len()) => {
                u32::try_from(v).map(Some).map_err(|_| {
                    Error::invalid_file(f.path(), format!("metadata `{k}` = {v} is too large"))
                })
            }
            Some(v) => Err(Error::invalid_file(
                f.path(),
                format!(
                    "metadata `{k}` = {v} is outside the {}-token vocabulary",
                    tokens.len()
                ),
            )),
        }
    };
    Ok(GgufVocab {
        pre: f.get_str("tokenizer.ggml.pre")?.map(str::to_string),
        merges: f
            .get_str_array("tokenizer.ggml.merges")?
            .unwrap_or_default()
            .to_vec(),
        bos: id("tokenizer.ggml.bos_token_id")?,
        eos: id("tokenizer.ggml.eos_token_id")?,
        unk: id("tokenizer.ggml.unknown_token_id")?,
        // llama.cpp's default: SentencePiece (`llama`) vocabularies add BOS, BPE ones do not.
        add_bos: f
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(model == "llama"),
        scores: f
            .get_f32_array("tokenizer.ggml.scores")?
            .unwrap_or_default()
            .to_vec(),
        add_space_prefix: f.get_bool("tokenizer.ggml.add_space_prefix")?,
        model,
        tokens,
        token_types,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly on purpose
mod tests {
    use super::writer::GgufWriter;
    use super::*;
    use super::{TinyArch, TinyLlama};
    use crate::model::{TensorBytes, Weights};
    use crate::quant::DType;

    fn parse(w: &GgufWriter) -> Result<GgufModel> {
        GgufModel::from_file(&GgufFile::parse(
            Path::new("tiny.gguf"),
            TensorBytes::from_vec(w.to_bytes()),
        )?)
    }

    fn with_test_tokenizer(m: GgufModel, tiny: &TinyLlama) -> ImportedModel {
        let tok = Tokenizer::from_json(&tiny.tokenizer_json(), Default::default()).unwrap();
        m.with_tokenizer(tok)
    }

    #[test]
    fn tiny_llama_maps_to_its_config_and_weights_build() {
        // The tiny model's 64-value rows hold no 256-value k-quant block.
        for dtype in DType::ALL.into_iter().filter(|d| d.row_bytes(64).is_some()) {
            let tiny = TinyLlama::new(7);
            let m = parse(&tiny.gguf_writer(dtype)).unwrap();
            assert_eq!(m.config, tiny.config, "{dtype}");
            assert_eq!(m.tensors["blk.1.ffn_down.weight"].dtype, dtype);
            assert_eq!(m.tensors["blk.1.ffn_down.weight"].shape, [64, 128]);
            assert_eq!(m.tensors["blk.1.ffn_norm.weight"].dtype, DType::F32);
            assert_eq!(m.vocab.tokens.len(), 128);
            assert_eq!(
                (m.vocab.bos, m.vocab.eos, m.vocab.add_bos),
                (Some(1), Some(2), false)
            );
            assert_eq!(m.vocab.pre.as_deref(), Some("smollm"));
            assert_eq!(
                m.chat_template.as_deref(),
                Some(tiny.chat_template.as_str())
            );
            Weights::from_imported(&with_test_tokenizer(m, &tiny)).unwrap();
        }
    }

    #[test]
    fn qwen2_uses_half_split_rope_and_keeps_biases() {
        let tiny = TinyLlama::with_arch(3, TinyArch::Qwen2).with_tied_embeddings();
        let m = parse(&tiny.gguf_writer(DType::Q8_0)).unwrap();
        assert_eq!(m.config, tiny.config);
        assert_eq!(m.config.rope_style, RopeStyle::HalfSplit);
        assert!(m.config.tied_embeddings);
        let w = Weights::from_imported(&with_test_tokenizer(m, &tiny)).unwrap();
        assert!(w.layers[0].bq.is_some());
    }

    #[test]
    fn head_dim_and_vocab_fall_back_to_derived_values() {
        let tiny = TinyLlama::new(1);
        let mut w = tiny.gguf_writer(DType::F32);
        w.remove("llama.vocab_size")
            .remove("llama.rope.dimension_count");
        let m = parse(&w).unwrap();
        assert_eq!((m.config.head_dim, m.config.vocab_size), (16, 128));
        // Keys are read under the architecture's own prefix.
        w.add("general.architecture", Value::String("mistral".into()));
        let e = parse(&w).unwrap_err().to_string();
        assert!(
            e.contains("`mistral.attention.head_count` is missing"),
            "{e}"
        );
    }
}
