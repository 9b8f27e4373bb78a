// The small dense f32 steps of the forward pass (engine/src/backend/cpu/dense.rs and the RoPE of
// engine/src/reference.rs): RMSNorm, RoPE, the gated activation, residual add.
#include "common.cuh"

#define LS_NORM_THREADS 256

// rmsnorm: out[r][i] = x[r][i] / sqrt(mean_i(x[r][i]^2) + eps) * weight[i].
//
// Grid:  (n_rows); block: (256). One block per row of n values.
// Args:  out, x  n_rows x n f32 (may be the same buffer); weight  n f32; eps as in the config.
extern "C" __global__ void rmsnorm(float* out, const float* x, const float* weight, int n,
                                   float eps) {
    __shared__ float partial[LS_NORM_THREADS / LS_WARP];
    const float* xr = x + (long long)blockIdx.x * n;
    float* orow = out + (long long)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = ls_warp_sum(ss);
    if (threadIdx.x % LS_WARP == 0) partial[threadIdx.x / LS_WARP] = ss;
    __syncthreads();
    if (threadIdx.x < LS_WARP) {
        float t = threadIdx.x < blockDim.x / LS_WARP ? partial[threadIdx.x] : 0.0f;
        t = ls_warp_sum(t);
        if (threadIdx.x == 0) partial[0] = t;
    }
    __syncthreads();
    const float scale = 1.0f / sqrtf(partial[0] / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * scale * weight[i];
}

// rope: rotates each head of x in place by position pos. For pair i in 0..head_dim/2,
// theta = pos * inv_freq[i] (the layer's frequencies: base^(-2i / head_dim), divided by any
// scaling factor; engine/src/model/config.rs rope_inv_freq), and the pair (a, b) becomes
// (a cos - b sin, a sin + b cos), where (a, b) = (x[2i], x[2i+1]) for style 0 (AdjacentPairs,
// GGUF llama) or (x[i], x[i + head_dim/2]) for style 1 (HalfSplit, Hugging Face).
//
// Grid:  (n_heads); block: (head_dim / 2 rounded up to a warp), head_dim even, at most 2048.
// Args:  x  n_heads x head_dim f32 (call once for Q, once for K); inv_freq  head_dim / 2 f32.
extern "C" __global__ void rope(float* x, int head_dim, int pos, const float* inv_freq,
                                int style) {
    const int i = threadIdx.x;
    const int half = head_dim / 2;
    if (i >= half) return;
    float* head = x + (long long)blockIdx.x * head_dim;
    const float theta = (float)pos * inv_freq[i];
    float s, c;
    sincosf(theta, &s, &c);
    const int a = style == 0 ? 2 * i : i;
    const int b = style == 0 ? 2 * i + 1 : i + half;
    const float x0 = head[a], x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x0 * s + x1 * c;
}

// gate_mul: gate[i] = act(gate[i]) * up[i], act by its code (common.cuh ls_activation): the
// gated FFN's elementwise step (SwiGLU, GeGLU).
//
// Grid:  (ceil(n / 256)); block: (256).
extern "C" __global__ void gate_mul(float* gate, const float* up, int n, int act) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = ls_activation(act, gate[i]) * up[i];
}

// add_inplace: a[i] += b[i] (residual connections).
//
// Grid:  (ceil(n / 256)); block: (256).
extern "C" __global__ void add_inplace(float* a, const float* b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += b[i];
}
