//! A layer-major exact forward pass over one window of tokens, with the FFN left to a caller's
//! [`FfnExecutor`]. Calibration and its quality checks need every token's normalised FFN input
//! `xn` and intermediate activation `h`, and need to change how `h` is used (thresholds);
//! [`crate::forward::Session`] keeps those internal, so this pass runs the same steps with the
//! same kernels in exact precision: all tokens of the window go through layer `l` before layer
//! `l + 1` (the window starts from an empty context, so attention needs only the current layer's
//! keys and values). Its logits agree with `Session` in exact precision to float rounding (tested).

use crate::backend::cpu::{self, Disjoint, Kernels, Precision, QuantizedActs};
use crate::forward::{finish_qkv, norm_rows};
use crate::model::{LayerWeights, Weights};
use crate::{Error, Result};

/// Runs one layer's FFN for one token.
pub trait FfnExecutor {
    /// Called before layer `l` runs for a token, with that token's residual stream `x`.
    fn begin_layer(&mut self, _l: usize, _x: &[f32]) {}

    /// Computes the FFN of layer `l` for one token: `xn` is its normalised FFN input (`d_model`),
    /// `out` receives the FFN output (`d_model`) that is added to the residual stream.
    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()>;
}

/// Most tokens per mat-mat call.
const BATCH: usize = 32;

/// Scratch for windows of up to `max_window` tokens, allocated once.
#[derive(Debug)]
pub struct WindowForward<'w> {
    w: &'w Weights,
    max_window: usize,
    x: Vec<f32>,      // (max_window, d_model) residual stream
    xn: Vec<f32>,     // (max_window, d_model) normalised input of a sub-block
    q: Vec<f32>,      // (max_window, q_dim)
    k: Vec<f32>,      // (max_window, kv_dim) keys of the current layer
    v: Vec<f32>,      // (max_window, kv_dim) values of the current layer
    att: Vec<f32>,    // (max_window, q_dim) attention output
    proj: Vec<f32>,   // (max_window, d_model)
    scores: Vec<f32>, // (n_heads, max_window)
    out: Vec<f32>,    // (d_model) FFN output of one token
    logits: Vec<f32>, // (BATCH, vocab)
    /// Per layer, the RoPE frequencies it rotates with.
    inv_freq: Vec<Vec<f32>>,
    acts: QuantizedActs,
    kernels: &'static Kernels,
}

impl<'w> WindowForward<'w> {
    /// Scratch for windows of up to `max_window` tokens (at most the context length).
    pub fn new(w: &'w Weights, max_window: usize) -> Result<WindowForward<'w>> {
        let c = &w.config;
        if max_window < 2 || max_window > c.context_length {
            return Err(Error::InvalidArgument {
                arg: "window",
                reason: format!("{max_window} is outside 2..={}", c.context_length),
            });
        }
        let n = max_window;
        Ok(WindowForward {
            w,
            max_window,
            x: vec![0.0; n * c.d_model],
            xn: vec![0.0; n * c.d_model],
            q: vec![0.0; n * c.q_dim()],
            k: vec![0.0; n * c.kv_dim()],
            v: vec![0.0; n * c.kv_dim()],
            att: vec![0.0; n * c.q_dim()],
            proj: vec![0.0; n * c.d_model],
            scores: vec![0.0; c.n_heads * n],
            out: vec![0.0; c.d_model],
            logits: vec![0.0; BATCH * c.vocab_size],
            inv_freq: (0..c.n_layers)
                .map(|l| c.rope_inv_freq(c.layer_attention(l)))
                .collect(),
            acts: QuantizedActs::new(0),
            kernels: Kernels::best(),
        })
    }

    /// Largest window.
    pub fn max_window(&self) -> usize {
        self.max_window
    }

    /// Runs `tokens` (2..=max_window of them) from an empty context, calling `exec` for every
    /// layer and token (all tokens of layer `l`, in order, before layer `l + 1`). Returns the
    /// summed negative log-likelihood (nats) of `tokens[1..]` given their prefixes, and how many
    /// tokens that is.
    pub fn run(&mut self, tokens: &[u32], exec: &mut dyn FfnExecutor) -> Result<(f64, usize)> {
        let c = &self.w.config;
        let n = tokens.len();
        if n < 2 || n > self.max_window {
            return Err(Error::InvalidArgument {
                arg: "tokens",
                reason: format!("{n} tokens, a window holds 2..={}", self.max_window),
            });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::InvalidArgument {
                arg: "token",
                reason: format!("id {t} is outside the vocabulary ({})", c.vocab_size),
            });
        }
        let d = c.d_model;
        for (x, &t) in self.x.chunks_exact_mut(d).zip(tokens) {
            self.w.token_embd.dequantize_row(t as usize, x);
            if c.embedding_scale != 1.0 {
                x.iter_mut().for_each(|v| *v *= c.embedding_scale);
            }
        }
        let w = self.w;
        for (l, layer) in w.layers.iter().enumerate() {
            self.attention(l, layer, n);
            for t in 0..n {
                let x = &mut self.x[t * d..(t + 1) * d];
                exec.begin_layer(l, x);
                let xn = &mut self.xn[t * d..(t + 1) * d];
                cpu::rmsnorm(xn, x, &layer.ffn_norm, c.rms_eps);
                exec.ffn(l, layer, xn, &mut self.out)?;
                norm_rows(&layer.post_ffn_norm, &mut self.out, d, c.rms_eps);
                cpu::add_inplace(x, &self.out);
            }
        }
        self.nll(tokens)
    }

    /// Teacher-forced NLL of `tokens[1..]` from the final residual stream of every token.
    fn nll(&mut self, tokens: &[u32]) -> Result<(f64, usize)> {
        let c = &self.w.config;
        let (d, vocab, n) = (c.d_model, c.vocab_size, tokens.len() - 1);
        let mut sum = 0f64;
        for start in (0..n).step_by(BATCH) {
            let m = BATCH.min(n - start);
            for t in 0..m {
                let row = (start + t) * d;
                cpu::rmsnorm(
                    &mut self.xn[t * d..(t + 1) * d],
                    &self.x[row..row + d],
                    &self.w.output_norm,
                    c.rms_eps,
                );
            }
            let x = self
                .kernels
                .prepare(&self.xn[..m * d], Precision::Exact, &mut self.acts);
            self.kernels
                .matmats(x, m, [(&self.w.output, &mut self.logits[..m * vocab])]);
            for t in 0..m {
                let logits = &self.logits[t * vocab..(t + 1) * vocab];
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let log_sum = logits
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln();
                let target = tokens[start + t + 1] as usize;
                sum += log_sum - f64::from(logits[target] - max);
            }
        }
        Ok((sum, n))
    }

    /// The attention block of layer `l` for tokens `0..n` (positions `0..n`), added to `x`.
    fn attention(&mut self, l: usize, layer: &LayerWeights, n: usize) {
        let c = &self.w.config;
        let (d, hd, kv_dim, q_dim) = (c.d_model, c.head_dim, c.kv_dim(), c.q_dim());
        let k = self.kernels;
        for (xn, x) in self
            .xn
            .chunks_exact_mut(d)
            .zip(self.x.chunks_exact(d))
            .take(n)
        {
            cpu::rmsnorm(xn, x, &layer.attn_norm, c.rms_eps);
        }
        for s in (0..n).step_by(BATCH) {
            let m = BATCH.min(n - s);
            let x = k.prepare(
                &self.xn[s * d..(s + m) * d],
                Precision::Exact,
                &mut self.acts,
            );
            k.matmats(
                x,
                m,
                [
                    (&layer.wq, &mut self.q[s * q_dim..(s + m) * q_dim]),
                    (&layer.wk, &mut self.k[s * kv_dim..(s + m) * kv_dim]),
                    (&layer.wv, &mut self.v[s * kv_dim..(s + m) * kv_dim]),
                ],
            );
        }
        let half = c.head_dim / 2;
        let mut table = vec![(0f32, 1f32); half];
        for t in 0..n {
            for (sc, f) in table.iter_mut().zip(&self.inv_freq[l]) {
                *sc = (t as f32 * f).sin_cos();
            }
            let q = &mut self.q[t * q_dim..(t + 1) * q_dim];
            let kk = &mut self.k[t * kv_dim..(t + 1) * kv_dim];
            let v = &mut self.v[t * kv_dim..(t + 1) * kv_dim];
            finish_qkv(c, layer, &table, q, kk, v);
        }

        // Causal attention, one query head per task; GQA maps `group` query heads to a KV head.
        let group = c.n_heads / c.n_kv_heads;
        let window = c.layer_attention(l).window;
        let (q, keys, values) = (&self.q, &self.k, &self.v);
        let max_window = self.max_window;
        let att = Disjoint::new(&mut self.att);
        let all_scores = Disjoint::new(&mut self.scores);
        cpu::for_each_chunk(c.n_heads, 1, |heads| {
            for h in heads {
                let kv_off = (h / group) * hd;
                for t in 0..n {
                    let o = t * q_dim + h * hd;
                    // SAFETY: each head is handed out once; head `h` alone uses its score row and
                    // its `hd` outputs of every token.
                    let (out, scores) = unsafe {
                        (
                            att.range(o..o + hd),
                            all_scores.range(h * max_window..h * max_window + t + 1),
                        )
                    };
                    let first = window.map_or(0, |w| (t + 1).saturating_sub(w));
                    cpu::attend(
                        &q[o..o + hd],
                        keys,
                        values,
                        kv_dim,
                        kv_off,
                        first,
                        scores,
                        out,
                    );
                }
            }
        });
        for s in (0..n).step_by(BATCH) {
            let m = BATCH.min(n - s);
            let x = k.prepare(
                &self.att[s * q_dim..(s + m) * q_dim],
                Precision::Exact,
                &mut self.acts,
            );
            k.matmats(x, m, [(&layer.wo, &mut self.proj[s * d..(s + m) * d])]);
        }
        norm_rows(&layer.post_attn_norm, &mut self.proj[..n * d], d, c.rms_eps);
        cpu::add_inplace(&mut self.x[..n * d], &self.proj[..n * d]);
    }
}
