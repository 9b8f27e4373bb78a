//! Dense FFN executors for calibration: the plain FFN with optional per-layer thresholds on `h`,
//! and a collector that records every token's normalised FFN input.

use crate::Result;
use crate::backend::cpu::{self, Kernels, Precision, QuantizedActs};
use crate::forward::FfnExecutor;
use crate::model::{Down, FfnActivation, LayerWeights, ModelConfig};

/// The dense FFN of one token with preallocated buffers.
#[derive(Debug)]
pub struct DenseFfn {
    activation: FfnActivation,
    /// `h = act(gate·xn) * (up·xn)` of the last token (`n_ff`).
    pub h: Vec<f32>,
    up: Vec<f32>,       // (n_ff)
    partials: Vec<f32>, // (n_parts, d_model)
    acts: QuantizedActs,
}

impl DenseFfn {
    /// Buffers for `c`'s FFN.
    pub fn new(c: &ModelConfig) -> DenseFfn {
        let parts = crate::backend::cpu::compute_threads().max(1);
        DenseFfn {
            activation: c.activation,
            h: vec![0.0; c.n_ff],
            up: vec![0.0; c.n_ff],
            partials: vec![0.0; parts * c.d_model],
            acts: QuantizedActs::new(0),
        }
    }

    /// Computes `self.h` from `xn` (exact precision).
    pub fn activations(&mut self, layer: &LayerWeights, xn: &[f32]) {
        let k = Kernels::best();
        let x = k.prepare(xn, Precision::Exact, &mut self.acts);
        k.matvecs(
            x,
            [
                (&layer.ffn.gate, &mut self.h[..]),
                (&layer.ffn.up, &mut self.up[..]),
            ],
        );
        let act = self.activation;
        for (h, u) in self.h.iter_mut().zip(&self.up) {
            *h = act.apply(*h) * u;
        }
    }

    /// `out = Σ_i h_i · down_i` over the neurons with `h_i != 0`.
    pub fn down(&mut self, layer: &LayerWeights, out: &mut [f32]) {
        let k = Kernels::best();
        match &layer.ffn.down {
            Down::Rows(m) => k.matvec(m, &self.h, out, Precision::Exact, &mut self.acts),
            Down::Neurons(m) => cpu::down_neurons(k, m, &self.h, &mut self.partials, out),
        }
    }
}

/// The dense FFN, with `h_i` zeroed where it is not active at `thresholds[l]`
/// ([`crate::sparsity::is_active`]) when thresholds are given (TEAL-style magnitude sparsity).
/// Counts how many activations it zeroed.
#[derive(Debug)]
pub struct Thresholded {
    ffn: DenseFfn,
    thresholds: Option<Vec<f32>>,
    /// Activations zeroed and activations seen.
    pub zeroed: u64,
    pub seen: u64,
}

impl Thresholded {
    /// With `thresholds = None` this is the dense FFN.
    pub fn new(c: &ModelConfig, thresholds: Option<Vec<f32>>) -> Thresholded {
        Thresholded {
            ffn: DenseFfn::new(c),
            thresholds,
            zeroed: 0,
            seen: 0,
        }
    }
}

impl FfnExecutor for Thresholded {
    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()> {
        self.ffn.activations(layer, xn);
        if let Some(t) = &self.thresholds {
            let thr = t[l];
            for h in self.ffn.h.iter_mut() {
                if !crate::sparsity::is_active(*h, thr) {
                    *h = 0.0;
                    self.zeroed += 1;
                }
            }
        }
        self.seen += self.ffn.h.len() as u64;
        self.ffn.down(layer, out);
        Ok(())
    }
}

/// The dense FFN that records every token's `xn`, per layer (f16, token-major), up to a limit.
#[derive(Debug)]
pub struct Collector {
    ffn: DenseFfn,
    d_model: usize,
    max_tokens: usize,
    /// Per layer: `(tokens, d_model)` normalised FFN inputs.
    pub xs: Vec<Vec<half::f16>>,
}

impl Collector {
    /// Records at most `max_tokens` tokens per layer.
    pub fn new(c: &ModelConfig, max_tokens: usize) -> Collector {
        Collector {
            ffn: DenseFfn::new(c),
            d_model: c.d_model,
            max_tokens,
            xs: (0..c.n_layers)
                .map(|_| Vec::with_capacity(max_tokens * c.d_model))
                .collect(),
        }
    }

    /// Tokens recorded (per layer).
    pub fn tokens(&self) -> usize {
        self.xs.first().map_or(0, |x| x.len() / self.d_model)
    }

    /// Layer `l`'s inputs as f32, `(tokens, d_model)`.
    pub fn layer_f32(&self, l: usize) -> Vec<f32> {
        self.xs[l].iter().map(|v| v.to_f32()).collect()
    }
}

impl FfnExecutor for Collector {
    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()> {
        if self.xs[l].len() < self.max_tokens * self.d_model {
            self.xs[l].extend(xn.iter().map(|&v| half::f16::from_f32(v)));
        }
        self.ffn.activations(layer, xn);
        self.ffn.down(layer, out);
        Ok(())
    }
}
