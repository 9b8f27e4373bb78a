// Decode attention: one new query token against the KV cache (engine/src/reference.rs, "Causal
// attention per query head"), with grouped-query heads.
#include "common.cuh"

#define LS_ATT_WARPS 4       // warps per block (block = 128 threads)
#define LS_ATT_MAX_HEAD 256  // largest head_dim supported
#define LS_ATT_PER_LANE (LS_ATT_MAX_HEAD / LS_WARP)

// attention_decode: for query head h (KV head h / (n_heads / n_kv_heads)),
//   s_p = q_h . k_p / sqrt(head_dim) for p in first..n_pos,  out_h = sum_p softmax(s)_p * v_p.
// Each warp takes positions w, w + 4, ... with an online softmax (running max, running sum and a
// running weighted sum of values in registers); the four warps are merged at the end. No shared
// memory grows with n_pos, so any context length works.
//
// Grid:  (n_heads); block: (128) = 4 warps.
// Args:
//   q          n_heads x head_dim f32 (after RoPE)
//   k_cache    n_pos rows of kv_stride f32: row p holds the keys of position p, KV head g at
//              [g * head_dim, (g + 1) * head_dim) (after RoPE)
//   v_cache    same layout, values
//   out        n_heads x head_dim f32, overwritten
//   first      the first position attended (0, or where a sliding window starts), < n_pos
//   n_pos      positions in the cache up to the current one (included), >= 1
//   n_heads, n_kv_heads  n_heads a multiple of n_kv_heads
//   head_dim   at most 256 (lane l holds elements l, l + 32, ... below head_dim)
//   kv_stride  f32 between consecutive positions (n_kv_heads * head_dim for a dense cache)
extern "C" __global__ void attention_decode(const float* q, const float* k_cache,
                                            const float* v_cache, float* out, int first, int n_pos,
                                            int n_heads, int n_kv_heads, int head_dim,
                                            int kv_stride) {
    __shared__ float s_max[LS_ATT_WARPS];
    __shared__ float s_sum[LS_ATT_WARPS];
    __shared__ float s_acc[LS_ATT_WARPS][LS_ATT_MAX_HEAD];
    const int h = blockIdx.x;
    const int warp = threadIdx.x / LS_WARP;
    const int lane = threadIdx.x % LS_WARP;
    const int kv_off = (h / (n_heads / n_kv_heads)) * head_dim;
    const float* qh = q + (long long)h * head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);

    float qv[LS_ATT_PER_LANE];
    float acc[LS_ATT_PER_LANE];
#pragma unroll
    for (int t = 0; t < LS_ATT_PER_LANE; t++) {
        qv[t] = lane + LS_WARP * t < head_dim ? qh[lane + LS_WARP * t] : 0.0f;
        acc[t] = 0.0f;
    }
    float m = -LS_INF, l = 0.0f;
    for (int p = first + warp; p < n_pos; p += LS_ATT_WARPS) {
        const float* kp = k_cache + (long long)p * kv_stride + kv_off;
        const float* vp = v_cache + (long long)p * kv_stride + kv_off;
        float s = 0.0f;
#pragma unroll
        for (int t = 0; t < LS_ATT_PER_LANE; t++)
            if (lane + LS_WARP * t < head_dim) s += qv[t] * kp[lane + LS_WARP * t];
        s = ls_warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new); // 0 on the first position (m = -inf)
        const float e = expf(s - m_new);
        l = l * corr + e;
#pragma unroll
        for (int t = 0; t < LS_ATT_PER_LANE; t++)
            if (lane + LS_WARP * t < head_dim) acc[t] = acc[t] * corr + e * vp[lane + LS_WARP * t];
        m = m_new;
    }
    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = l;
    }
#pragma unroll
    for (int t = 0; t < LS_ATT_PER_LANE; t++)
        if (lane + LS_WARP * t < head_dim) s_acc[warp][lane + LS_WARP * t] = acc[t];
    __syncthreads();

    // Merge the warps: weights exp(m_w - M), warps that saw no position have l = 0.
    float big = -LS_INF;
    for (int w = 0; w < LS_ATT_WARPS; w++) big = fmaxf(big, s_max[w]);
    float total = 0.0f;
    float wgt[LS_ATT_WARPS];
    for (int w = 0; w < LS_ATT_WARPS; w++) {
        wgt[w] = s_sum[w] > 0.0f ? expf(s_max[w] - big) : 0.0f;
        total += wgt[w] * s_sum[w];
    }
    const float inv = 1.0f / total;
    float* oh = out + (long long)h * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < LS_ATT_WARPS; w++) v += wgt[w] * s_acc[w][i];
        oh[i] = v * inv;
    }
}
