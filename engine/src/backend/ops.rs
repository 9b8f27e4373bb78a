//! The kernel set every compute backend provides, one call per kernel on host vectors.
//!
//! This is the seam the conformance tests ([`super::conformance`]) run through: the same test
//! body drives the CPU kernels ([`CpuOps`]) and every [`super::device::Device`] (the CUDA
//! backend, and its kernels built for the host), and compares each with a plain f32
//! computation. The forward passes do not go through it (they keep their buffers on their own
//! device); they call the same kernels directly.

use crate::backend::cpu::{self, Kernels, Precision, QuantizedActs};
use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, QRows, RopeStyle, TensorBytes};
use crate::{Error, Result};

/// A matrix of quantised rows stored back to back.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    pub dtype: crate::quant::DType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

impl Matrix<'_> {
    /// Checks that the bytes hold `rows` rows of `cols` values, `x` has `cols` values and the
    /// bias (if any) `rows`.
    pub fn check(&self, x: &[f32], bias: Option<&[f32]>) -> Result<usize> {
        let row_bytes = self
            .dtype
            .row_bytes(self.cols)
            .ok_or_else(|| invalid("cols", format!("{} values per row", self.cols)))?;
        if self.bytes.len() != self.rows * row_bytes {
            return Err(invalid(
                "bytes",
                format!(
                    "{} bytes for {}×{} {:?}",
                    self.bytes.len(),
                    self.rows,
                    self.cols,
                    self.dtype
                ),
            ));
        }
        expect_len("x", x, self.cols)?;
        if let Some(b) = bias {
            expect_len("bias", b, self.rows)?;
        }
        Ok(row_bytes)
    }
}

/// The shape of one decode-attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// The first position attended: 0, or where a sliding window starts.
    pub first: usize,
    /// Positions in the caches (the current one included).
    pub n_pos: usize,
}

impl AttentionShape {
    /// Values of one cached position (`n_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Checks the query and the caches against the shape.
    pub fn check(&self, q: &[f32], keys: &[f32], values: &[f32]) -> Result<()> {
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(invalid("n_kv_heads", format!("{self:?}")));
        }
        if self.first >= self.n_pos {
            return Err(invalid(
                "n_pos",
                format!("no position to attend to: {self:?}"),
            ));
        }
        expect_len("q", q, self.n_heads * self.head_dim)?;
        expect_len("keys", keys, self.n_pos * self.kv_dim())?;
        expect_len("values", values, self.n_pos * self.kv_dim())
    }
}

/// A layer's sparse FFN over some of its chunks: what [`super::chunks::ChunkMath`] computes.
#[derive(Clone, Copy, Debug)]
pub struct FfnChunks<'a> {
    pub layout: &'a ChunkLayout,
    /// The listed chunks: (index inside the layer, stored bytes), no chunk twice.
    pub chunks: &'a [(usize, &'a [u8])],
    pub activation: FfnActivation,
    /// |activation| below this counts as inactive (0 keeps every neuron).
    pub threshold: f32,
    /// The FFN-normed input, `d_model` values.
    pub x: &'a [f32],
}

/// What [`KernelOps::ffn_chunks`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct FfnOutput {
    /// `n_ff` activations: the listed chunks' neurons, 0 elsewhere and where inactive.
    pub h: Vec<f32>,
    /// `d_model` values: the listed chunks' share of the FFN output.
    pub out: Vec<f32>,
    /// Neurons kept.
    pub active: usize,
}

/// One kernel per method; each validates its arguments and says what was wrong.
pub trait KernelOps {
    /// Which backend (and device) this is, for messages.
    fn name(&self) -> String;
    /// RMSNorm of each row of `x` (rows of `weight.len()` values).
    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32) -> Result<Vec<f32>>;
    /// `activation(gate) * up`, element by element (the gated FFN's step).
    fn gate(&self, activation: FfnActivation, gate: &[f32], up: &[f32]) -> Result<Vec<f32>>;
    /// `a + b`, element by element.
    fn add(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>>;
    /// `W x (+ bias)`.
    fn matvec(&self, w: Matrix<'_>, x: &[f32], bias: Option<&[f32]>) -> Result<Vec<f32>>;
    /// RoPE of every `head_dim`-value head of `x` at position `pos`, pair `i` turning by
    /// `pos · inv_freq[i]` (`head_dim / 2` frequencies: [`crate::model::ModelConfig::rope_inv_freq`]).
    fn rope(
        &self,
        x: &[f32],
        head_dim: usize,
        pos: usize,
        inv_freq: &[f32],
        style: RopeStyle,
    ) -> Result<Vec<f32>>;
    /// One query token's attention over cached keys and values (rows of `kv_dim` values per
    /// position) from position `shape.first`, grouped-query heads.
    fn attention_decode(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        shape: AttentionShape,
    ) -> Result<Vec<f32>>;
    /// The sparse FFN over the listed chunks.
    fn ffn_chunks(&self, f: &FfnChunks<'_>) -> Result<FfnOutput>;
    /// The index of the largest logit (the lowest among equals).
    fn argmax(&self, logits: &[f32]) -> Result<u32>;
    /// The `k` largest logits, largest first, as (index, value); ties by lower index.
    fn top_k(&self, logits: &[f32], k: usize) -> Result<Vec<(u32, f32)>>;
}

pub(crate) fn invalid(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

/// Checks that `v` has `want` values (the error names `arg`).
pub fn expect_len(arg: &'static str, v: &[f32], want: usize) -> Result<()> {
    if v.len() == want {
        Ok(())
    } else {
        Err(invalid(arg, format!("{} values, expected {want}", v.len())))
    }
}

/// Checks a [`FfnChunks`] call: input width, chunk indices, no chunk twice, whole chunks.
pub fn check_ffn(f: &FfnChunks<'_>) -> Result<()> {
    let l = f.layout;
    expect_len("x", f.x, l.d_model)?;
    let mut seen = vec![false; l.chunks_per_layer];
    for &(c, bytes) in f.chunks {
        if c >= l.chunks_per_layer || std::mem::replace(&mut seen[c], true) {
            return Err(invalid(
                "chunks",
                format!("chunk {c} missing or listed twice"),
            ));
        }
        if bytes.len() < l.neurons(c).len() * l.bundle_bytes {
            return Err(invalid(
                "chunks",
                format!("chunk {c}: {} bytes", bytes.len()),
            ));
        }
    }
    Ok(())
}

/// Checks an RMSNorm call: `x` is whole rows of `weight.len()` values. Returns the row count.
pub fn check_rows(x: &[f32], weight: &[f32]) -> Result<usize> {
    let n = weight.len();
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(invalid("x", format!("{} values in rows of {n}", x.len())));
    }
    Ok(x.len() / n)
}

/// Checks a RoPE call: an even `head_dim`, whole heads and a frequency per pair. Returns the
/// head count.
pub fn check_rope(x: &[f32], head_dim: usize, inv_freq: &[f32]) -> Result<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) || !x.len().is_multiple_of(head_dim) {
        return Err(invalid(
            "head_dim",
            format!("{head_dim} for {} values", x.len()),
        ));
    }
    expect_len("inv_freq", inv_freq, head_dim / 2)?;
    Ok(x.len() / head_dim)
}

/// Checks a sampling call: at least `k` (≥ 1) logits.
pub fn check_top_k(logits: &[f32], k: usize) -> Result<()> {
    if k == 0 || k > logits.len() {
        return Err(invalid("k", format!("{k} of {} logits", logits.len())));
    }
    Ok(())
}

/// The RoPE `(sin, cos)` table of position `pos` for frequencies `inv_freq`.
pub fn rope_table(inv_freq: &[f32], pos: usize) -> Vec<(f32, f32)> {
    inv_freq
        .iter()
        .map(|f| (pos as f32 * f).sin_cos())
        .collect()
}

/// The CPU kernels of [`crate::backend::cpu`] (the best table for this machine).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuOps;

impl KernelOps for CpuOps {
    fn name(&self) -> String {
        format!("cpu ({})", Kernels::best().name())
    }

    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32) -> Result<Vec<f32>> {
        check_rows(x, weight)?;
        let n = weight.len();
        let mut out = vec![0.0; x.len()];
        for (o, r) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
            cpu::rmsnorm(o, r, weight, eps);
        }
        Ok(out)
    }

    fn gate(&self, activation: FfnActivation, gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
        expect_len("up", up, gate.len())?;
        let mut out = gate.to_vec();
        Kernels::best().gate(activation, &mut out, up);
        Ok(out)
    }

    fn add(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
        expect_len("b", b, a.len())?;
        let mut out = a.to_vec();
        cpu::add_inplace(&mut out, b);
        Ok(out)
    }

    fn matvec(&self, w: Matrix<'_>, x: &[f32], bias: Option<&[f32]>) -> Result<Vec<f32>> {
        w.check(x, bias)?;
        let m = QRows::contiguous(
            w.dtype,
            w.rows,
            w.cols,
            TensorBytes::from_vec(w.bytes.to_vec()),
        )
        .ok_or_else(|| invalid("w", "not a whole matrix".into()))?;
        let mut y = vec![0.0; w.rows];
        let mut scratch = QuantizedActs::new(0);
        Kernels::best().matvec(&m, x, &mut y, Precision::Exact, &mut scratch);
        if let Some(b) = bias {
            cpu::add_inplace(&mut y, b);
        }
        Ok(y)
    }

    fn rope(
        &self,
        x: &[f32],
        head_dim: usize,
        pos: usize,
        inv_freq: &[f32],
        style: RopeStyle,
    ) -> Result<Vec<f32>> {
        check_rope(x, head_dim, inv_freq)?;
        let mut out = x.to_vec();
        cpu::rope(&mut out, head_dim, &rope_table(inv_freq, pos), style);
        Ok(out)
    }

    fn attention_decode(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        shape.check(q, keys, values)?;
        let hd = shape.head_dim;
        let group = shape.n_heads / shape.n_kv_heads;
        let mut out = vec![0.0; q.len()];
        let mut scores = vec![0.0; shape.n_pos];
        for (h, (qh, oh)) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).enumerate() {
            let kv_off = (h / group) * hd;
            let first = shape.first;
            cpu::attend(
                qh,
                keys,
                values,
                shape.kv_dim(),
                kv_off,
                first,
                &mut scores,
                oh,
            );
        }
        Ok(out)
    }

    fn ffn_chunks(&self, f: &FfnChunks<'_>) -> Result<FfnOutput> {
        check_ffn(f)?;
        let l = f.layout;
        let math = crate::backend::chunks::ChunkMath {
            layout: l,
            kernels: Kernels::best(),
            activation: f.activation,
            threshold: f.threshold,
            fast: None,
        };
        let (mut h, mut out) = (vec![0.0; l.n_ff], vec![0.0; l.d_model]);
        let active = f
            .chunks
            .iter()
            .map(|&(c, bytes)| math.chunk(c, bytes, f.x, &mut h[l.neurons(c)], &mut out))
            .sum();
        Ok(FfnOutput { h, out, active })
    }

    fn argmax(&self, logits: &[f32]) -> Result<u32> {
        check_top_k(logits, 1)?;
        Ok(crate::sample::argmax(logits))
    }

    fn top_k(&self, logits: &[f32], k: usize) -> Result<Vec<(u32, f32)>> {
        check_top_k(logits, k)?;
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        // Largest first; equal values by lower index (a stable sort keeps index order).
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        Ok(order[..k]
            .iter()
            .map(|&i| (i, logits[i as usize]))
            .collect())
    }
}
