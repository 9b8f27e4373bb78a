//! Architecture hyper-parameters, validated once at import.

use serde::{Deserialize, Serialize};

/// Supported architecture families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// Llama 2/3, Mistral, Qwen2/2.5 (with QKV bias), SmolLM: RMSNorm, RoPE, GQA, gated FFN.
    Llama,
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Rotate `(x[2i], x[2i+1])`: GGUF llama, whose converter permuted Q and K rows.
    AdjacentPairs,
    /// Rotate `(x[i], x[i + head_dim/2])`: Hugging Face checkpoints (and GGUF neox-style models).
    HalfSplit,
}

/// The activation of the FFN's gate: `down(act(gate·x) * (up·x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnActivation {
    /// SwiGLU (`silu`), the Llama default.
    Silu,
    /// ReLU-gated FFN (exactly sparse).
    Relu,
}

/// Model dimensions and constants.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub n_layers: usize,
    /// Residual stream width.
    pub d_model: usize,
    /// FFN intermediate width (number of neurons per layer).
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Per-head width; `n_heads * head_dim` is the Q projection width.
    pub head_dim: usize,
    pub vocab_size: usize,
    /// Longest context the model was trained for, in tokens.
    pub context_length: usize,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    pub activation: FfnActivation,
    /// The output head reuses the token embedding.
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// Checks that the numbers describe a model we can run; returns what is wrong otherwise.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("n_layers", self.n_layers),
            ("d_model", self.d_model),
            ("n_ff", self.n_ff),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("context_length", self.context_length),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} is 0"));
            }
            if v > 1 << 24 {
                return Err(format!("{name} = {v} is implausibly large"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "n_heads {} is not a multiple of n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            return Err(format!(
                "rope_base {} is not a positive number",
                self.rope_base
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            return Err(format!("rms_eps {} is out of range", self.rms_eps));
        }
        Ok(())
    }

    /// Width of the K and V projections.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of the Q projection.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
}

impl FfnActivation {
    /// The gate activation applied to one pre-activation value.
    #[inline]
    pub fn apply(self, g: f32) -> f32 {
        match self {
            FfnActivation::Silu => g / (1.0 + (-g).exp()),
            FfnActivation::Relu => g.max(0.0),
        }
    }
}
