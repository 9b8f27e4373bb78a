//! Hugging Face safetensors directory import: `config.json`, one or more `*.safetensors` files
//! (memory-mapped, F32/F16/BF16), `tokenizer.json`, and optionally `generation_config.json`,
//! `tokenizer_config.json` and `chat_template.jinja`.
//!
//! Supported architectures: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`. Tensor
//! names are mapped to the canonical GGUF-style names (`model.layers.3.mlp.up_proj.weight` →
//! `blk.3.ffn_up.weight`); Q/K rows are not permuted, so RoPE is [`RopeStyle::HalfSplit`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use serde_json::Value as Json;

use super::gguf::{TinyArch, TinyLlama};
use super::{
    Architecture, FfnActivation, ImportedModel, ModelConfig, RopeStyle, TensorRef, read_file,
};
use crate::quant::DType;
use crate::tokenizer::{SpecialTokens, Tokenizer};
use crate::{Error, Result};

/// `architectures[0]` values this importer maps.
pub const SUPPORTED_ARCHITECTURES: &str = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM";

/// The fields of `config.json` we read. Absent optional fields take Hugging Face's defaults.
#[derive(Debug, Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rms_norm_eps: Option<f64>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    rope_scaling: Option<Json>,
    bos_token_id: Option<Json>,
    eos_token_id: Option<Json>,
}

/// Per-layer name pairs: Hugging Face suffix after `model.layers.{i}.`, canonical suffix after
/// `blk.{i}.`.
const LAYER_NAMES: [(&str, &str); 12] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// Whole-model name pairs: Hugging Face, canonical.
const GLOBAL_NAMES: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// The canonical name of a Hugging Face tensor name, or `None` when it is not one we know.
pub fn canonical_name(hf: &str) -> Option<String> {
    if let Some((_, c)) = GLOBAL_NAMES.iter().find(|(h, _)| *h == hf) {
        return Some(c.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, c) = LAYER_NAMES.iter().find(|(h, _)| *h == suffix)?;
    Some(format!("blk.{layer}.{c}"))
}

/// The Hugging Face name of a canonical tensor name (the inverse of [`canonical_name`]).
pub fn hf_name(canonical: &str) -> Option<String> {
    if let Some((h, _)) = GLOBAL_NAMES.iter().find(|(_, c)| *c == canonical) {
        return Some(h.to_string());
    }
    let rest = canonical.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (h, _) = LAYER_NAMES.iter().find(|(_, c)| *c == suffix)?;
    Some(format!("model.layers.{layer}.{h}"))
}

fn read_json(path: &Path) -> Result<Option<Json>> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| Error::invalid_file(path, format!("not valid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Token ids from a JSON number, array of numbers, or null.
fn ids(path: &Path, key: &str, v: Option<&Json>) -> Result<Vec<u32>> {
    let bad = || Error::invalid_file(path, format!("`{key}` is not a token id or a list of them"));
    let one = |v: &Json| {
        v.as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(bad)
    };
    match v {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(a)) => a.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn map_config(path: &Path, c: &HfConfig) -> Result<ModelConfig> {
    let arch = c
        .architectures
        .as_ref()
        .and_then(|a| a.first())
        .ok_or_else(|| Error::invalid_file(path, "`architectures` is missing"))?;
    if !SUPPORTED_ARCHITECTURES.split(", ").any(|a| a == arch) {
        return Err(Error::unsupported(
            path,
            format!("architecture `{arch}` is not supported; supported: {SUPPORTED_ARCHITECTURES}"),
        ));
    }
    if c.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(Error::unsupported(path, "`rope_scaling` is not supported"));
    }
    let req = |v: Option<usize>, key: &str| {
        v.ok_or_else(|| Error::invalid_file(path, format!("`{key}` is missing")))
    };
    let activation = match c.hidden_act.as_deref().unwrap_or("silu") {
        "silu" | "swish" => FfnActivation::Silu,
        "relu" => FfnActivation::Relu,
        other => {
            return Err(Error::unsupported(
                path,
                format!("hidden_act `{other}` is not supported; supported: silu, relu"),
            ));
        }
    };
    let d_model = req(c.hidden_size, "hidden_size")?;
    let n_heads = req(c.num_attention_heads, "num_attention_heads")?;
    let config = ModelConfig {
        architecture: if arch == "Qwen2ForCausalLM" {
            Architecture::Qwen2
        } else {
            Architecture::Llama
        },
        n_layers: req(c.num_hidden_layers, "num_hidden_layers")?,
        d_model,
        n_ff: req(c.intermediate_size, "intermediate_size")?,
        n_heads,
        n_kv_heads: c.num_key_value_heads.unwrap_or(n_heads),
        head_dim: c
            .head_dim
            .unwrap_or_else(|| d_model.checked_div(n_heads).unwrap_or(0)),
        vocab_size: req(c.vocab_size, "vocab_size")?,
        context_length: c.max_position_embeddings.unwrap_or(2048),
        rope_base: c.rope_theta.unwrap_or(10000.0) as f32,
        rope_style: RopeStyle::HalfSplit,
        rms_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
        activation,
        tied_embeddings: c.tie_word_embeddings.unwrap_or(false),
        ..ModelConfig::without_features()
    };
    config
        .validate()
        .map_err(|reason| Error::invalid_file(path, reason))?;
    Ok(config)
}

/// Reads every tensor of one `.safetensors` file into `out` under canonical names.
fn read_shard(
    file: &Path,
    n_layers: usize,
    out: &mut BTreeMap<String, (TensorRef, PathBuf)>,
) -> Result<()> {
    let bytes = read_file(file)?;
    let (header_len, metadata) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::invalid_file(file, format!("safetensors header: {e}")))?;
    let data_start = header_len
        .checked_add(8)
        .ok_or_else(|| Error::invalid_file(file, "header length overflows"))?;
    for (name, info) in metadata.tensors() {
        if name.ends_with(".rotary_emb.inv_freq") {
            continue; // recomputed from rope_theta
        }
        let canonical = canonical_name(&name).ok_or_else(|| {
            Error::unsupported(
                file,
                format!("tensor `{name}` is not part of a Llama-family model"),
            )
        })?;
        if let Some(l) = canonical
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, _)| l.parse::<usize>().ok())
            && l >= n_layers
        {
            return Err(Error::invalid_file(
                file,
                format!("tensor `{name}` is for layer {l}, but config.json has {n_layers} layers"),
            ));
        }
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::Bf16,
            other => {
                return Err(Error::unsupported(
                    file,
                    format!(
                        "tensor {name} has dtype {other:?}, which is not supported; supported: \
                         F32, F16, BF16"
                    ),
                ));
            }
        };
        let (begin, end) = info.data_offsets;
        let want = info
            .shape
            .iter()
            .try_fold(dtype.block_bytes(), |a, &d| a.checked_mul(d));
        let data = end
            .checked_sub(begin)
            .filter(|len| Some(*len) == want)
            .and_then(|len| bytes.slice(data_start.checked_add(begin)?, len))
            .ok_or_else(|| {
                Error::invalid_file(
                    file,
                    format!("tensor `{name}` data offsets {begin}..{end} do not fit its shape or the file"),
                )
            })?;
        let t = TensorRef {
            dtype,
            shape: info.shape.clone(),
            data,
        };
        if let Some((_, first)) = out.insert(canonical, (t, file.to_path_buf())) {
            return Err(Error::invalid_file(
                file,
                format!("tensor `{name}` also appears in {}", first.display()),
            ));
        }
    }
    Ok(())
}

/// Imports a Hugging Face model directory.
/// Reads and validates a model directory's `config.json`.
pub(crate) fn read_config(dir: &Path) -> Result<ModelConfig> {
    read_hf_config(dir).map(|(_, _, c)| c)
}

/// `config.json`'s path, its raw form and the validated config.
fn read_hf_config(dir: &Path) -> Result<(PathBuf, HfConfig, ModelConfig)> {
    let config_path = dir.join("config.json");
    let raw = read_json(&config_path)?
        .ok_or_else(|| Error::invalid_file(dir, "config.json is missing"))?;
    let hf: HfConfig = serde_json::from_value(raw)
        .map_err(|e| Error::invalid_file(&config_path, format!("unexpected field type: {e}")))?;
    let config = map_config(&config_path, &hf)?;
    Ok((config_path, hf, config))
}

pub fn import(dir: &Path) -> Result<ImportedModel> {
    let (config_path, hf, config) = read_hf_config(dir)?;

    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    if shards.is_empty() {
        return Err(Error::invalid_file(dir, "no *.safetensors files"));
    }
    let mut found = BTreeMap::new();
    for shard in &shards {
        read_shard(shard, config.n_layers, &mut found)?;
    }
    let mut tensors: BTreeMap<String, TensorRef> =
        found.into_iter().map(|(k, (t, _))| (k, t)).collect();
    // Tied: the head is the embedding (Hugging Face ignores a stored lm_head then). Untied with
    // no lm_head is a broken checkpoint; Weights::from_imported reports `output.weight` missing.
    if config.tied_embeddings {
        tensors.remove("output.weight");
    }

    let gen_config = read_json(&dir.join("generation_config.json"))?;
    let tok_config_path = dir.join("tokenizer_config.json");
    let tok_config = read_json(&tok_config_path)?;
    let mut eos = ids(&config_path, "eos_token_id", hf.eos_token_id.as_ref())?;
    let gen_path = dir.join("generation_config.json");
    let gen_eos = gen_config.as_ref().and_then(|g| g.get("eos_token_id"));
    for id in ids(&gen_path, "eos_token_id", gen_eos)? {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    let bos = ids(&config_path, "bos_token_id", hf.bos_token_id.as_ref())?
        .first()
        .copied()
        .or(ids(
            &gen_path,
            "bos_token_id",
            gen_config.as_ref().and_then(|g| g.get("bos_token_id")),
        )?
        .first()
        .copied());
    let add_bos = tok_config
        .as_ref()
        .and_then(|t| t.get("add_bos_token"))
        .and_then(Json::as_bool)
        .unwrap_or(false);
    let chat_template = match tok_config.as_ref().and_then(|t| t.get("chat_template")) {
        Some(Json::String(s)) => Some(s.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(dir.join("chat_template.jinja"), e)),
        },
    };

    let tok_path = dir.join("tokenizer.json");
    let json = std::fs::read_to_string(&tok_path).map_err(|e| Error::io(&tok_path, e))?;
    let tokenizer =
        Tokenizer::from_json(&json, SpecialTokens { bos, eos, add_bos }).map_err(|e| match e {
            Error::Tokenizer(reason) => Error::invalid_file(&tok_path, reason),
            other => other,
        })?;
    Ok(ImportedModel {
        path: dir.to_path_buf(),
        config,
        tensors,
        tokenizer,
        chat_template,
    })
}

/// Writes `tiny` as a Hugging Face directory: `config.json`, two shards of `dtype` tensors
/// (F32, F16 or BF16), `tokenizer.json`, `tokenizer_config.json` (with the chat template) and
/// `generation_config.json`. The weights are those of [`TinyLlama::write_gguf`] before the GGUF
/// Q/K permutation, so both files describe the same model.
pub fn write_tiny_dir(dir: &Path, tiny: &TinyLlama, dtype: DType) -> Result<()> {
    assert!(
        dtype.block_len() == 1,
        "safetensors holds float tensors, not {dtype}"
    );
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let c = &tiny.config;
    let arch = match tiny.arch {
        TinyArch::Llama => "LlamaForCausalLM",
        TinyArch::Qwen2 => "Qwen2ForCausalLM",
        other => {
            return Err(Error::InvalidArgument {
                arg: "tiny",
                reason: format!(
                    "safetensors import reads llama and qwen2, not {}",
                    other.name()
                ),
            });
        }
    };
    let config = serde_json::json!({
        "architectures": [arch],
        "hidden_size": c.d_model,
        "intermediate_size": c.n_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "rope_theta": c.rope_base,
        "rms_norm_eps": c.rms_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.context_length,
        "tie_word_embeddings": c.tied_embeddings,
        "hidden_act": "silu",
        "bos_token_id": tiny.bos,
        "eos_token_id": tiny.eos,
        "torch_dtype": "float32",
    });
    let files = [
        ("config.json", config.to_string()),
        ("tokenizer.json", tiny.tokenizer_json()),
        (
            "tokenizer_config.json",
            serde_json::json!({"add_bos_token": false, "chat_template": tiny.chat_template})
                .to_string(),
        ),
        (
            "generation_config.json",
            serde_json::json!({"eos_token_id": [tiny.eos]}).to_string(),
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.join(name), text).map_err(|e| Error::io(dir.join(name), e))?;
    }
    let st_dtype = match dtype {
        DType::F16 => Dtype::F16,
        DType::Bf16 => Dtype::BF16,
        _ => Dtype::F32,
    };
    type Shard = Vec<(String, Vec<usize>, Vec<u8>)>; // (HF name, shape, bytes)
    let mut shards: [Shard; 2] = Default::default();
    for (name, (shape, values)) in &tiny.tensors {
        let hf = hf_name(name).unwrap_or_else(|| panic!("tiny tensor {name} has no HF name"));
        let mut bytes = Vec::new();
        crate::quant::quantize_row(dtype, values, &mut bytes);
        let second = name.starts_with("blk.1.") || name.starts_with("output");
        shards[usize::from(second)].push((hf, shape.clone(), bytes));
    }
    for (i, shard) in shards.iter().enumerate() {
        let path = dir.join(format!("model-{:05}-of-00002.safetensors", i + 1));
        let views = shard
            .iter()
            .map(|(n, shape, b)| {
                safetensors::tensor::TensorView::new(st_dtype, shape.clone(), b).map(|v| (n, v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::invalid_file(&path, e.to_string()))?;
        safetensors::serialize_to_file(views, None, &path)
            .map_err(|e| Error::invalid_file(&path, e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly on purpose
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for hf in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.12.self_attn.o_proj.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.3.post_attention_layernorm.weight",
        ] {
            let c = canonical_name(hf).unwrap();
            assert_eq!(hf_name(&c).as_deref(), Some(hf));
        }
        assert_eq!(
            canonical_name("model.layers.3.mlp.up_proj.weight").as_deref(),
            Some("blk.3.ffn_up.weight")
        );
        assert_eq!(canonical_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(
            canonical_name("model.layers.0.self_attn.q_norm.weight"),
            None
        );
    }
}
