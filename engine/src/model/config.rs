//! Architecture hyper-parameters, validated once at import.

use serde::{Deserialize, Serialize};

/// Supported architecture families. The name is what a model *is*, for display; what the forward
/// pass does is said by the feature fields of [`ModelConfig`] (QK-norm, post-norms, sliding
/// windows, …), which the importers set from the architecture, so no forward pass matches on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// Llama 2/3, Mistral, SmolLM (and Qwen2 files written before the architecture was told
    /// apart): RMSNorm, RoPE, GQA, gated FFN.
    Llama,
    /// Qwen2/2.5: Llama with Q/K/V biases and half-split RoPE.
    Qwen2,
    /// Qwen3: Llama with per-head RMSNorm on Q and K, half-split RoPE, no biases.
    Qwen3,
    /// Gemma 3: GeGLU, norms before and after attention and FFN, QK-norm, embeddings scaled by
    /// √d, sliding-window layers with their own RoPE base between global ones, tied embeddings.
    Gemma3,
}

impl Architecture {
    /// Lower-case name, as in GGUF's `general.architecture`.
    pub const fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
        }
    }
}

/// Local attention on some layers: a token sees only the last `window` positions (itself
/// included), and those layers rotate with their own RoPE base. Layer `l` is global (full
/// context, [`ModelConfig::rope_base`]) when `(l + 1) % global_every == 0`, local otherwise
/// (Gemma 3: five local layers, then one global).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlidingWindow {
    /// Positions a local layer sees, the query's own included.
    pub window: usize,
    /// Every `global_every`-th layer is global.
    pub global_every: usize,
    /// RoPE base of the local layers.
    pub rope_base: f32,
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
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
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
    /// Per-head RMSNorm of Q and K after their projections (weights `attn_{q,k}_norm`, one
    /// `head_dim` vector each, shared by all heads): Qwen3, Gemma 3.
    #[serde(default)]
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before each residual add (weights
    /// `post_attention_norm`, `post_ffw_norm`): Gemma 3.
    #[serde(default)]
    pub post_norms: bool,
    /// Factor the token embedding is multiplied by on the way in (√d_model for Gemma, else 1).
    #[serde(default = "one")]
    pub embedding_scale: f32,
    /// Local attention on some layers (Gemma 3); `None`: every layer sees the whole context.
    #[serde(default)]
    pub sliding_window: Option<SlidingWindow>,
    /// Per-pair divisors of the global layers' RoPE frequencies (`head_dim / 2` values): Llama 3.x
    /// frequency scaling (`rope_freqs.weight`), or a linear scaling factor repeated. `None`: 1.
    #[serde(default)]
    pub rope_freq_factors: Option<Vec<f32>>,
}

fn one() -> f32 {
    1.0
}

/// How one layer attends: how far back it sees and its RoPE frequencies' base.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// Positions it sees (the query's own included); `None`: the whole context.
    pub window: Option<usize>,
    /// RoPE base.
    pub rope_base: f32,
    /// Whether [`ModelConfig::rope_freq_factors`] apply (global layers only).
    pub scaled: bool,
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
        if !(self.embedding_scale.is_finite() && self.embedding_scale > 0.0) {
            return Err(format!(
                "embedding_scale {} is not a positive number",
                self.embedding_scale
            ));
        }
        if let Some(w) = &self.sliding_window
            && (w.window == 0
                || w.global_every == 0
                || !(w.rope_base.is_finite() && w.rope_base > 0.0))
        {
            return Err(format!("sliding window {w:?} is out of range"));
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.head_dim / 2 {
                return Err(format!(
                    "{} RoPE frequency factors for {} pairs per head",
                    f.len(),
                    self.head_dim / 2
                ));
            }
            if let Some(bad) = f.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
                return Err(format!(
                    "RoPE frequency factor {bad} is not a positive number"
                ));
            }
        }
        Ok(())
    }

    /// A Llama-shaped config of zeros with every optional feature off, for struct-update syntax
    /// (`ModelConfig { n_layers: 2, …, ..ModelConfig::without_features() }`): the importers of
    /// formats that describe only Llama-family models fill in the rest.
    pub fn without_features() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            n_layers: 0,
            d_model: 0,
            n_ff: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            vocab_size: 0,
            context_length: 0,
            rope_base: 10000.0,
            rope_style: RopeStyle::HalfSplit,
            rms_eps: 1e-6,
            activation: FfnActivation::Silu,
            tied_embeddings: false,
            qk_norm: false,
            post_norms: false,
            embedding_scale: 1.0,
            sliding_window: None,
            rope_freq_factors: None,
        }
    }

    /// How layer `l` attends (see [`SlidingWindow`]).
    pub fn layer_attention(&self, l: usize) -> LayerAttention {
        match &self.sliding_window {
            Some(w) if !(l + 1).is_multiple_of(w.global_every) => LayerAttention {
                window: Some(w.window),
                rope_base: w.rope_base,
                scaled: false,
            },
            _ => LayerAttention {
                window: None,
                rope_base: self.rope_base,
                scaled: true,
            },
        }
    }

    /// The RoPE frequencies of `attention`'s layers, one per pair of a head:
    /// `base^(-2i/head_dim) / factor_i`.
    pub fn rope_inv_freq(&self, attention: LayerAttention) -> Vec<f32> {
        let hd = self.head_dim;
        (0..hd / 2)
            .map(|i| {
                let factor = match (&self.rope_freq_factors, attention.scaled) {
                    (Some(f), true) => f[i],
                    _ => 1.0,
                };
                attention.rope_base.powf(-2.0 * i as f32 / hd as f32) / factor
            })
            .collect()
    }

    /// The distinct RoPE frequency tables of the layers, and which one each layer uses: one
    /// table for most models, two for sliding-window ones.
    pub fn rope_tables(&self) -> (Vec<Vec<f32>>, Vec<usize>) {
        let mut tables: Vec<Vec<f32>> = Vec::new();
        let of_layer = (0..self.n_layers)
            .map(|l| {
                let t = self.rope_inv_freq(self.layer_attention(l));
                match tables.iter().position(|have| *have == t) {
                    Some(i) => i,
                    None => {
                        tables.push(t);
                        tables.len() - 1
                    }
                }
            })
            .collect();
        (tables, of_layer)
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
            FfnActivation::GeluTanh => {
                // 0.5 g (1 + tanh(u)) with u = √(2/π) (g + 0.044715 g³), written as
                // g / (1 + e^(-2u)) (the same function, since 1 + tanh(u) = 2 / (1 + e^(-2u))):
                // one exponential instead of tanh's, a third of the time per value, and no
                // cancellation in 1 + tanh(u) where u is very negative.
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                let u = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
                g / (1.0 + (-2.0 * u).exp())
            }
        }
    }

    /// `gate[i] = act(gate[i]) * up[i]`: the gated FFN's elementwise step.
    ///
    /// Panics unless both slices have the same length.
    pub fn gate_inplace(self, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len(), "gate and up lengths");
        for (g, u) in gate.iter_mut().zip(up) {
            *g = self.apply(*g) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FfnActivation;

    /// The GeGLU gate, computed in f32 through one exponential, is GELU's tanh form to within
    /// f32 rounding: against the tanh form in f64 where that is accurate, and against its
    /// exponential form in f64 everywhere (for very negative inputs `1 + tanh` cancels even in
    /// f64, while the true value is a tiny negative number).
    #[test]
    fn gelu_tanh_matches_the_tanh_formula() {
        let u = |g: f64| (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044_715 * g * g * g);
        let tanh_form = |g: f64| 0.5 * g * (1.0 + u(g).tanh());
        let exp_form = |g: f64| g / (1.0 + (-2.0 * u(g)).exp());
        for i in -2000..=2000 {
            let g = i as f32 * 0.005;
            let got = f64::from(FfnActivation::GeluTanh.apply(g));
            let g = f64::from(g);
            let want = exp_form(g);
            // An f32 rounding of u moves e^(-2u), and so the result, by |2u| of it relatively.
            let rel = f64::from(f32::EPSILON) * (4.0 + 4.0 * (2.0 * u(g)).abs());
            let close = (got - want).abs() <= rel * want.abs();
            assert!(close || got == want, "gelu({g}) = {got}, want {want}");
            if g.abs() <= 3.0 {
                let tanh = tanh_form(g);
                assert!(
                    (got - tanh).abs() <= 1e-6,
                    "gelu({g}) = {got}, tanh form {tanh}"
                );
            }
        }
        assert_eq!(FfnActivation::GeluTanh.apply(-100.0), 0.0);
        assert_eq!(FfnActivation::GeluTanh.apply(100.0), 100.0);
    }
}
