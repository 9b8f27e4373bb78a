//! Small dense f32 helpers of the forward pass. Plain Rust written so the compiler vectorises the
//! sums and products (eight independent lanes); the exponentials use the standard library.

use crate::model::RopeStyle;

/// Sum of squares in eight lanes.
fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (chunks, tail) = x.as_chunks::<8>();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    acc.iter().sum::<f32>() + tail.iter().map(|v| v * v).sum::<f32>()
}

/// RMSNorm: `out[i] = x[i] / sqrt(mean(x²) + eps) * weight[i]`.
///
/// Panics unless `out`, `x` and `weight` have the same length.
pub fn rmsnorm(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
    assert!(
        out.len() == x.len() && x.len() == weight.len(),
        "rmsnorm lengths {} / {} / {}",
        out.len(),
        x.len(),
        weight.len()
    );
    if x.is_empty() {
        return;
    }
    let scale = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// [`rmsnorm`] in place: `x[i] = x[i] / sqrt(mean(x²) + eps) * weight[i]`.
///
/// Panics unless `x` and `weight` have the same length.
pub fn rmsnorm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len(), "rmsnorm lengths");
    if x.is_empty() {
        return;
    }
    let scale = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
    for (v, w) in x.iter_mut().zip(weight) {
        *v = *v * scale * w;
    }
}

/// Softmax in place, shifted by the maximum for stability. An empty slice is left alone.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if x.is_empty() {
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// SwiGLU's elementwise step: `gate[i] = silu(gate[i]) * up[i]`, `silu(g) = g / (1 + e^-g)`.
///
/// Panics unless both slices have the same length.
pub fn silu_mul(gate_inout: &mut [f32], up: &[f32]) {
    assert_eq!(gate_inout.len(), up.len(), "silu_mul lengths");
    for (g, u) in gate_inout.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `a[i] += b[i]` (residual connections).
///
/// Panics unless both slices have the same length.
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "add_inplace lengths");
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// Rotates each head of `x` (`head_dim` values each) by the angles whose `(sin, cos)` are in
/// `table` (pair `i`: the position times `base^(-2i/head_dim)`), pairing values as `style` says.
///
/// Panics unless `table` holds `head_dim / 2` pairs and `x` whole heads.
pub fn rope(x: &mut [f32], head_dim: usize, table: &[(f32, f32)], style: RopeStyle) {
    let half = head_dim / 2;
    assert_eq!(table.len(), half, "rope table of {head_dim}-value heads");
    assert!(x.len().is_multiple_of(head_dim), "rope over whole heads");
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(sin, cos)) in table.iter().enumerate() {
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
