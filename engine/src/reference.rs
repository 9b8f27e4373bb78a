//! The reference forward pass: plain, dense, f32, one token at a time. It is deliberately slow and
//! obvious — the oracle every faster path (quantised CPU engine, sparse pipeline, CUDA) is tested
//! against. Weights are dequantised once into plain row-major `Vec<f32>` matrices.

use crate::model::{Down, ModelConfig, QRows, RopeStyle, Weights};

/// One layer, dequantised. Matrices are row-major, `(rows, cols)`.
#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,              // (d_model)
    wq: Vec<f32>,                     // (q_dim, d_model)
    wk: Vec<f32>,                     // (kv_dim, d_model)
    wv: Vec<f32>,                     // (kv_dim, d_model)
    wo: Vec<f32>,                     // (d_model, q_dim)
    bq: Option<Vec<f32>>,             // (q_dim)
    bk: Option<Vec<f32>>,             // (kv_dim)
    bv: Option<Vec<f32>>,             // (kv_dim)
    q_norm: Option<Vec<f32>>,         // (head_dim), per head
    k_norm: Option<Vec<f32>>,         // (head_dim), per head
    post_attn_norm: Option<Vec<f32>>, // (d_model)
    ffn_norm: Vec<f32>,               // (d_model)
    post_ffn_norm: Option<Vec<f32>>,  // (d_model)
    w_gate: Vec<f32>,                 // (n_ff, d_model)
    w_up: Vec<f32>,                   // (n_ff, d_model)
    w_down: Vec<f32>,                 // (d_model, n_ff)
}

/// A model with every weight in f32, plus its KV cache: good for a few hundred tokens of testing.
#[derive(Debug)]
pub struct Reference {
    cfg: ModelConfig,
    token_embd: Vec<f32>,  // (vocab, d_model)
    output_norm: Vec<f32>, // (d_model)
    output: Vec<f32>,      // (vocab, d_model)
    layers: Vec<Layer>,
    key_cache: Vec<Vec<f32>>,   // per layer: (position, kv_dim)
    value_cache: Vec<Vec<f32>>, // per layer: (position, kv_dim)
}

fn dequantize(m: &QRows) -> Vec<f32> {
    let mut out = vec![0f32; m.rows * m.cols];
    for (i, row) in out.chunks_exact_mut(m.cols).enumerate() {
        m.dequantize_row(i, row);
    }
    out
}

fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; a.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = a[r * cols + c];
        }
    }
    t
}

/// `out = W x` for row-major `W` of shape `(out.len(), x.len())`.
fn matmul(out: &mut [f32], w: &[f32], x: &[f32]) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(x.len())) {
        *o = row.iter().zip(x).map(|(a, b)| a * b).sum();
    }
}

fn rmsnorm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * scale * w).collect()
}

/// RMSNorm of every `width`-value row of `x`, when the model has the weights.
fn norm_rows(x: &mut [f32], weight: &Option<Vec<f32>>, width: usize, eps: f32) {
    if let Some(w) = weight {
        for row in x.chunks_exact_mut(width) {
            let n = rmsnorm(row, w, eps);
            row.copy_from_slice(&n);
        }
    }
}

fn add_bias(x: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        x.iter_mut().zip(b).for_each(|(v, b)| *v += b);
    }
}

/// Rotates each head of `x` by position `pos`, pair `i` at frequency `inv_freq[i]`.
fn rope(x: &mut [f32], head_dim: usize, pos: usize, inv_freq: &[f32], style: RopeStyle) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for (i, f) in inv_freq.iter().enumerate() {
            let theta = pos as f32 * f;
            let (sin, cos) = theta.sin_cos();
            let (a, b) = match style {
                RopeStyle::AdjacentPairs => (2 * i, 2 * i + 1),
                RopeStyle::HalfSplit => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
    }
}

fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

impl Reference {
    /// Dequantises every weight of `w`.
    pub fn new(w: &Weights) -> Reference {
        let c = &w.config;
        let layers = w
            .layers
            .iter()
            .map(|l| Layer {
                attn_norm: l.attn_norm.clone(),
                wq: dequantize(&l.wq),
                wk: dequantize(&l.wk),
                wv: dequantize(&l.wv),
                wo: dequantize(&l.wo),
                bq: l.bq.clone(),
                bk: l.bk.clone(),
                bv: l.bv.clone(),
                q_norm: l.q_norm.clone(),
                k_norm: l.k_norm.clone(),
                post_attn_norm: l.post_attn_norm.clone(),
                ffn_norm: l.ffn_norm.clone(),
                post_ffn_norm: l.post_ffn_norm.clone(),
                w_gate: dequantize(&l.ffn.gate),
                w_up: dequantize(&l.ffn.up),
                w_down: match &l.ffn.down {
                    Down::Rows(m) => dequantize(m),
                    Down::Neurons(m) => transpose(&dequantize(m), c.n_ff, c.d_model),
                },
            })
            .collect();
        Reference {
            cfg: c.clone(),
            token_embd: dequantize(&w.token_embd),
            output_norm: w.output_norm.clone(),
            output: dequantize(&w.output),
            layers,
            key_cache: vec![Vec::new(); c.n_layers],
            value_cache: vec![Vec::new(); c.n_layers],
        }
    }

    /// Number of tokens already in the KV cache.
    pub fn position(&self) -> usize {
        self.key_cache[0].len() / self.cfg.kv_dim()
    }

    /// Runs one token at the next position and returns the logits over the vocabulary.
    pub fn forward(&mut self, token: u32) -> Vec<f32> {
        let c = &self.cfg;
        let (d, hd, kv_dim) = (c.d_model, c.head_dim, c.kv_dim());
        let pos = self.position();
        let group = c.n_heads / c.n_kv_heads; // query heads per KV head (GQA)

        // Token embedding.
        let t = token as usize;
        let mut x: Vec<f32> = self.token_embd[t * d..(t + 1) * d]
            .iter()
            .map(|v| v * c.embedding_scale)
            .collect();

        for (l, layer) in self.layers.iter().enumerate() {
            // Attention: RMSNorm, Q/K/V projections (+ bias), per-head norm of Q and K, RoPE
            // with the layer's frequencies; a local layer sees only its window.
            let how = c.layer_attention(l);
            let inv_freq = c.rope_inv_freq(how);
            let first = how.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let xn = rmsnorm(&x, &layer.attn_norm, c.rms_eps);
            let mut q = vec![0f32; c.q_dim()];
            let mut k = vec![0f32; kv_dim];
            let mut v = vec![0f32; kv_dim];
            matmul(&mut q, &layer.wq, &xn);
            matmul(&mut k, &layer.wk, &xn);
            matmul(&mut v, &layer.wv, &xn);
            add_bias(&mut q, &layer.bq);
            add_bias(&mut k, &layer.bk);
            add_bias(&mut v, &layer.bv);
            norm_rows(&mut q, &layer.q_norm, hd, c.rms_eps);
            norm_rows(&mut k, &layer.k_norm, hd, c.rms_eps);
            rope(&mut q, hd, pos, &inv_freq, c.rope_style);
            rope(&mut k, hd, pos, &inv_freq, c.rope_style);

            // KV cache write.
            self.key_cache[l].extend_from_slice(&k);
            self.value_cache[l].extend_from_slice(&v);
            let (keys, values) = (&self.key_cache[l], &self.value_cache[l]);

            // Causal attention per query head over positions first..=pos.
            let mut att_out = vec![0f32; c.q_dim()];
            for h in 0..c.n_heads {
                let kv_off = (h / group) * hd;
                let qh = &q[h * hd..(h + 1) * hd];
                let mut scores: Vec<f32> = (first..=pos)
                    .map(|p| {
                        let kh = &keys[p * kv_dim + kv_off..p * kv_dim + kv_off + hd];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                softmax(&mut scores);
                let out = &mut att_out[h * hd..(h + 1) * hd];
                for (p, s) in (first..=pos).zip(&scores) {
                    let vh = &values[p * kv_dim + kv_off..p * kv_dim + kv_off + hd];
                    out.iter_mut().zip(vh).for_each(|(o, v)| *o += s * v);
                }
            }

            // Output projection, post-norm, residual.
            let mut proj = vec![0f32; d];
            matmul(&mut proj, &layer.wo, &att_out);
            norm_rows(&mut proj, &layer.post_attn_norm, d, c.rms_eps);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);

            // FFN: RMSNorm, gated activation (SwiGLU, ReLU or GeGLU), down projection,
            // post-norm, residual.
            let xn = rmsnorm(&x, &layer.ffn_norm, c.rms_eps);
            let mut gate = vec![0f32; c.n_ff];
            let mut up = vec![0f32; c.n_ff];
            matmul(&mut gate, &layer.w_gate, &xn);
            matmul(&mut up, &layer.w_up, &xn);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| crate::model::FfnActivation::apply(c.activation, *g) * u)
                .collect();
            let mut down = vec![0f32; d];
            matmul(&mut down, &layer.w_down, &act);
            norm_rows(&mut down, &layer.post_ffn_norm, d, c.rms_eps);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }

        // Final norm and output head.
        let xn = rmsnorm(&x, &self.output_norm, c.rms_eps);
        let mut logits = vec![0f32; c.vocab_size];
        matmul(&mut logits, &self.output, &xn);
        logits
    }
}
