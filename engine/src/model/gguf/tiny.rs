//! Tiny seeded random Llama-family models for tests: the same weights can be written as GGUF
//! (Q/K permuted as llama.cpp's converter does) or as a Hugging Face safetensors directory
//! (see [`crate::model::safetensors::write_tiny_dir`]), so both importers can be checked to give
//! the same model.

use std::collections::BTreeMap;
use std::path::Path;

use super::value::{Array, Value};
use super::writer::GgufWriter;
use crate::Result;
use crate::model::{Architecture, FfnActivation, ModelConfig, RopeStyle, SlidingWindow};
use crate::quant::DType;

/// Which flavour of the Llama family a tiny model imitates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TinyArch {
    /// GGUF `llama`: adjacent-pair RoPE in GGUF (Q/K rows permuted at write time).
    Llama,
    /// GGUF `qwen2`: half-split RoPE, Q/K/V biases.
    Qwen2,
    /// GGUF `qwen3`: half-split RoPE, QK-norm, no biases.
    Qwen3,
    /// GGUF `gemma3`: half-split RoPE, QK-norm, post-norms, GeGLU, embeddings scaled by √d, a
    /// 4-position sliding window on every layer but each second one (local RoPE base 10000,
    /// global 10⁶), tied embeddings.
    Gemma3,
}

impl TinyArch {
    /// Every flavour.
    pub const ALL: [TinyArch; 4] = [
        TinyArch::Llama,
        TinyArch::Qwen2,
        TinyArch::Qwen3,
        TinyArch::Gemma3,
    ];

    /// GGUF architecture name.
    pub const fn name(self) -> &'static str {
        match self {
            TinyArch::Llama => "llama",
            TinyArch::Qwen2 => "qwen2",
            TinyArch::Qwen3 => "qwen3",
            TinyArch::Gemma3 => "gemma3",
        }
    }

    /// The config an importer must produce for a model of this flavour and `shape`.
    fn config(self, shape: TinyShape) -> ModelConfig {
        let gemma = self == TinyArch::Gemma3;
        let TinyShape {
            n_layers,
            d_model,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        ModelConfig {
            architecture: match self {
                TinyArch::Llama => Architecture::Llama,
                TinyArch::Qwen2 => Architecture::Qwen2,
                TinyArch::Qwen3 => Architecture::Qwen3,
                TinyArch::Gemma3 => Architecture::Gemma3,
            },
            n_layers,
            d_model,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size: 128,
            context_length: 256,
            rope_base: if gemma { 1_000_000.0 } else { 10000.0 },
            rope_style: match self {
                TinyArch::Llama => RopeStyle::AdjacentPairs,
                _ => RopeStyle::HalfSplit,
            },
            rms_eps: 1e-5,
            activation: if gemma {
                FfnActivation::GeluTanh
            } else {
                FfnActivation::Silu
            },
            tied_embeddings: false,
            qk_norm: matches!(self, TinyArch::Qwen3 | TinyArch::Gemma3),
            post_norms: gemma,
            embedding_scale: if gemma { 8.0 } else { 1.0 },
            sliding_window: gemma.then_some(SlidingWindow {
                window: 4,
                global_every: 2,
                rope_base: 10000.0,
            }),
            rope_freq_factors: None,
        }
    }
}

/// The dimensions of a generated model (the vocabulary is always the tiny one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TinyShape {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl TinyShape {
    /// The tiny model's: d_model 64, n_ff 128, 4 heads of 16, 2 KV heads.
    pub const fn tiny(n_layers: usize) -> TinyShape {
        TinyShape {
            n_layers,
            d_model: 64,
            n_ff: 128,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
        }
    }

    /// Gemma-3-270M's layers: 18 of them, d_model 640, n_ff 2048, 4 heads of 256 and one KV
    /// head (the GPU check's Gemma-shaped model; about 120 M parameters without the vocabulary).
    pub const GEMMA3_270M: TinyShape = TinyShape {
        n_layers: 18,
        d_model: 640,
        n_ff: 2048,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
    };
}

/// A tiny model: 2 layers, d_model 64, n_ff 128, 4 heads of 16, 2 KV heads, vocab 128, a
/// minimal GPT-2 byte-level BPE vocabulary (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
/// printable ASCII, `Ġ`, `Ċ`, 29 merges) and a ChatML template.
#[derive(Clone, Debug)]
pub struct TinyLlama {
    /// Which flavour: decides the GGUF architecture name, RoPE style and biases.
    pub arch: TinyArch,
    /// The config an importer must produce (for GGUF llama: `rope_style` AdjacentPairs).
    pub config: ModelConfig,
    /// f32 weights by canonical name in Hugging Face layout (Q/K rows *not* permuted):
    /// `(shape outermost first, row-major values)`.
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// Vocabulary in id order (GPT-2 byte-level spelling: `Ġ` is a space, `Ċ` a newline).
    pub tokens: Vec<String>,
    /// GGUF token types: 3 (control) for the three specials, 1 otherwise.
    pub token_types: Vec<i32>,
    /// BPE merges, `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// `<|im_start|>` (1).
    pub bos: u32,
    /// `<|im_end|>` (2).
    pub eos: u32,
    /// A ChatML Jinja template.
    pub chat_template: String,
}

const MERGES: [&str; 29] = [
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "e n", "Ġ o", "Ġ w",
    "o r", "e s", "Ġ c", "i s", "i t", "a n", "Ġ b", "e d", "Ġ f", "Ġ p", "Ġ m", "a r", "a l",
    "o u", "Ġ d", "Ġ h",
];

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

/// splitmix64: a tiny, well-mixed, seeded generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn fill(&mut self, n: usize, scale: f32, bias: f32) -> Vec<f32> {
        (0..n).map(|_| bias + scale * self.uniform()).collect()
    }
}

/// The GGUF llama converter's Q/K row permutation (`convert_hf_to_gguf.py` `permute`): within each
/// head, HF row `j * head_dim/2 + i` becomes GGUF row `2 * i + j`.
pub fn permute_qk(values: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = values.len() / cols;
    let hd = rows / n_heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..n_heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + j * (hd / 2) + i;
                let dst = h * hd + 2 * i + j;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

impl TinyLlama {
    /// A tiny Llama with weights drawn from `seed`; untied output head.
    pub fn new(seed: u64) -> TinyLlama {
        TinyLlama::with_arch(seed, TinyArch::Llama)
    }

    /// A tiny model of the given flavour with weights drawn from `seed`.
    pub fn with_arch(seed: u64, arch: TinyArch) -> TinyLlama {
        TinyLlama::with_layers(seed, arch, 2)
    }

    /// [`TinyLlama::with_arch`] with `n_layers` layers (the first two are the same as its).
    pub fn with_layers(seed: u64, arch: TinyArch, n_layers: usize) -> TinyLlama {
        TinyLlama::with_shape(seed, arch, TinyShape::tiny(n_layers))
    }

    /// A model of the given flavour and layer dimensions, the tiny vocabulary, weights drawn
    /// from `seed`.
    pub fn with_shape(seed: u64, arch: TinyArch, shape: TinyShape) -> TinyLlama {
        let config = arch.config(shape);
        let mut rng = Rng(seed);
        let (d, q, kv, ff, v) = (
            config.d_model,
            config.q_dim(),
            config.kv_dim(),
            config.n_ff,
            config.vocab_size,
        );
        let mut tensors = BTreeMap::new();
        let mut mat = |name: String, rows: usize, cols: usize, rng: &mut Rng| {
            let scale = 1.0 / (cols as f32).sqrt();
            tensors.insert(name, (vec![rows, cols], rng.fill(rows * cols, scale, 0.0)));
        };
        mat("token_embd.weight".into(), v, d, &mut rng);
        mat("output.weight".into(), v, d, &mut rng);
        for l in 0..config.n_layers {
            mat(format!("blk.{l}.attn_q.weight"), q, d, &mut rng);
            mat(format!("blk.{l}.attn_k.weight"), kv, d, &mut rng);
            mat(format!("blk.{l}.attn_v.weight"), kv, d, &mut rng);
            mat(format!("blk.{l}.attn_output.weight"), d, q, &mut rng);
            mat(format!("blk.{l}.ffn_gate.weight"), ff, d, &mut rng);
            mat(format!("blk.{l}.ffn_up.weight"), ff, d, &mut rng);
            mat(format!("blk.{l}.ffn_down.weight"), d, ff, &mut rng);
        }
        for l in 0..config.n_layers {
            for norm in ["attn_norm", "ffn_norm"] {
                tensors.insert(
                    format!("blk.{l}.{norm}.weight"),
                    (vec![d], rng.fill(d, 0.1, 1.0)),
                );
            }
            if config.post_norms {
                for norm in ["post_attention_norm", "post_ffw_norm"] {
                    tensors.insert(
                        format!("blk.{l}.{norm}.weight"),
                        (vec![d], rng.fill(d, 0.1, 1.0)),
                    );
                }
            }
            if config.qk_norm {
                for norm in ["attn_q_norm", "attn_k_norm"] {
                    let hd = config.head_dim;
                    tensors.insert(
                        format!("blk.{l}.{norm}.weight"),
                        (vec![hd], rng.fill(hd, 0.1, 1.0)),
                    );
                }
            }
            if arch == TinyArch::Qwen2 {
                for (b, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                    tensors.insert(
                        format!("blk.{l}.{b}.bias"),
                        (vec![n], rng.fill(n, 0.1, 0.0)),
                    );
                }
            }
        }
        tensors.insert(
            "output_norm.weight".into(),
            (vec![d], rng.fill(d, 0.1, 1.0)),
        );

        let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        tokens.extend((33u8..=126).map(|b| char::from(b).to_string()));
        tokens.push("Ġ".into());
        tokens.push("Ċ".into());
        tokens.extend(MERGES.iter().map(|m| m.replace(' ', "")));
        let token_types = (0..tokens.len())
            .map(|i| if i < 3 { 3 } else { 1 })
            .collect();
        let tiny = TinyLlama {
            arch,
            config,
            tensors,
            tokens,
            token_types,
            merges: MERGES.iter().map(|m| m.to_string()).collect(),
            bos: 1,
            eos: 2,
            chat_template: CHATML.to_string(),
        };
        if arch == TinyArch::Gemma3 {
            tiny.with_tied_embeddings()
        } else {
            tiny
        }
    }

    /// Ties the output head to the token embedding (drops `output.weight`).
    pub fn with_tied_embeddings(mut self) -> TinyLlama {
        self.config.tied_embeddings = true;
        self.tensors.remove("output.weight");
        self
    }

    /// GGUF architecture name.
    pub fn arch_name(&self) -> &'static str {
        self.arch.name()
    }

    /// A writer holding the whole model, matrices stored as `dtype` (norms and biases f32), so
    /// that tests can alter it before writing.
    pub fn gguf_writer(&self, dtype: DType) -> GgufWriter {
        let c = &self.config;
        let a = self.arch_name();
        let u = |n: usize| Value::U32(n as u32);
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::String(a.into()))
            .add("general.name", Value::String(format!("tiny-{a}")))
            .add(&format!("{a}.block_count"), u(c.n_layers))
            .add(&format!("{a}.context_length"), u(c.context_length))
            .add(&format!("{a}.embedding_length"), u(c.d_model))
            .add(&format!("{a}.feed_forward_length"), u(c.n_ff))
            .add(&format!("{a}.attention.head_count"), u(c.n_heads))
            .add(&format!("{a}.attention.head_count_kv"), u(c.n_kv_heads))
            .add(&format!("{a}.rope.dimension_count"), u(c.head_dim))
            .add(&format!("{a}.attention.key_length"), u(c.head_dim))
            .add(&format!("{a}.attention.value_length"), u(c.head_dim))
            .add(&format!("{a}.rope.freq_base"), Value::F32(c.rope_base))
            .add(
                &format!("{a}.attention.layer_norm_rms_epsilon"),
                Value::F32(c.rms_eps),
            )
            .add(&format!("{a}.vocab_size"), u(c.vocab_size));
        if let Some(sw) = &c.sliding_window {
            w.add(&format!("{a}.attention.sliding_window"), u(sw.window))
                .add(
                    &format!("{a}.attention.sliding_window_pattern"),
                    u(sw.global_every),
                )
                .add(&format!("{a}.rope.freq_base_swa"), Value::F32(sw.rope_base));
        }
        w.add("tokenizer.ggml.model", Value::String("gpt2".into()))
            .add("tokenizer.ggml.pre", Value::String("smollm".into()))
            .add(
                "tokenizer.ggml.tokens",
                Value::Array(Array::String(self.tokens.clone())),
            )
            .add(
                "tokenizer.ggml.token_type",
                Value::Array(Array::I32(self.token_types.clone())),
            )
            .add(
                "tokenizer.ggml.merges",
                Value::Array(Array::String(self.merges.clone())),
            )
            .add("tokenizer.ggml.bos_token_id", Value::U32(self.bos))
            .add("tokenizer.ggml.eos_token_id", Value::U32(self.eos))
            .add("tokenizer.ggml.unknown_token_id", Value::U32(0))
            .add("tokenizer.ggml.add_bos_token", Value::Bool(false))
            .add(
                "tokenizer.chat_template",
                Value::String(self.chat_template.clone()),
            );
        for (name, (shape, values)) in &self.tensors {
            let permuted;
            let values = match (self.arch, name.rsplit('.').nth(1)) {
                (TinyArch::Llama, Some("attn_q")) if name.ends_with(".weight") => {
                    permuted = permute_qk(values, c.n_heads, shape[1]);
                    &permuted
                }
                (TinyArch::Llama, Some("attn_k")) if name.ends_with(".weight") => {
                    permuted = permute_qk(values, c.n_kv_heads, shape[1]);
                    &permuted
                }
                _ => values,
            };
            let dt = if shape.len() == 1 { DType::F32 } else { dtype };
            w.add_f32_tensor(name, dt, shape, values);
        }
        w
    }

    /// Writes the model as GGUF with matrices stored as `dtype`.
    pub fn write_gguf(&self, path: &Path, dtype: DType) -> Result<()> {
        self.gguf_writer(dtype).write(path)
    }

    /// A `tokenizer.json` equivalent to the GGUF vocabulary (byte-level BPE with the `smollm`
    /// pre-tokenizer: digits split one by one, then the GPT-2 regex).
    pub fn tokenizer_json(&self) -> String {
        let vocab: serde_json::Map<String, serde_json::Value> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), serde_json::Value::from(i)))
            .collect();
        let added: Vec<serde_json::Value> = self.tokens[..3]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": self.merges}
        })
        .to_string()
    }
}

/// Writes a tiny seeded random Llama (see [`TinyLlama`]) as GGUF with matrices stored as `dtype`.
pub fn tiny_llama(path: &Path, seed: u64, dtype: DType) -> Result<()> {
    TinyLlama::new(seed).write_gguf(path, dtype)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly on purpose
mod tests {
    use super::*;

    #[test]
    fn permutation_moves_half_split_pairs_next_to_each_other() {
        // One head of width 4, one column: HF rows [a0, a1, b0, b1] (pairs (a0,b0), (a1,b1)).
        let p = permute_qk(&[10., 11., 20., 21.], 1, 1);
        assert_eq!(p, [10., 20., 11., 21.]);
    }

    #[test]
    fn tokenizer_json_loads_and_vocab_has_128_tokens() {
        let m = TinyLlama::new(1);
        assert_eq!(m.tokens.len(), 128);
        let t = crate::tokenizer::Tokenizer::from_json(&m.tokenizer_json(), Default::default())
            .unwrap();
        let ids = t.encode("the cat").unwrap();
        assert_eq!(t.decode(&ids).unwrap(), "the cat");
        assert!(ids.len() < 7, "merges apply: {ids:?}");
    }
}
