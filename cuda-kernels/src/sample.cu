// Sampling helpers over the logits (engine/src/sample.rs): argmax for greedy decoding and the k
// largest logits for top-k sampling, so only k values travel back to the host.
//
// Order: logit descending, then index ascending (so argmax picks the lowest index among equals,
// as sample.rs does). NaN logits are never picked.
#include "common.cuh"

#define LS_SAMPLE_THREADS 1024

// True when (v, i) comes before (bv, bi) in the order above.
__device__ __forceinline__ bool ls_before(float v, u32 i, float bv, u32 bi) {
    return v > bv || (v == bv && i < bi);
}

// The first element of logits[0..n) in the order above that comes strictly after (after_v,
// after_i), reduced over the whole block. Every thread gets the result; index n when none.
__device__ void ls_block_best(const float* logits, int n, float after_v, u32 after_i,
                              bool bounded, float* out_v, u32* out_i) {
    __shared__ float sv[LS_SAMPLE_THREADS / LS_WARP];
    __shared__ u32 si[LS_SAMPLE_THREADS / LS_WARP];
    float bv = -LS_INF;
    u32 bi = (u32)n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = logits[i];
        if (v != v) continue; // NaN
        if (bounded && !ls_before(after_v, after_i, v, (u32)i)) continue;
        if (ls_before(v, (u32)i, bv, bi)) {
            bv = v;
            bi = (u32)i;
        }
    }
    for (int o = LS_WARP / 2; o > 0; o /= 2) {
        const float ov = __shfl_xor_sync(LS_FULL_MASK, bv, o);
        const u32 oi = __shfl_xor_sync(LS_FULL_MASK, bi, o);
        if (ls_before(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int warp = threadIdx.x / LS_WARP;
    __syncthreads(); // the previous call's readers are done with sv / si
    if (threadIdx.x % LS_WARP == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    bv = -LS_INF;
    bi = (u32)n;
    for (int w = 0; w < (int)(blockDim.x / LS_WARP); w++) {
        if (ls_before(sv[w], si[w], bv, bi)) {
            bv = sv[w];
            bi = si[w];
        }
    }
    *out_v = bv;
    *out_i = bi;
}

// argmax: *out = index of the largest logit (the lowest index among equals; 0 if all are NaN).
//
// Grid:  (1); block: (1024).
// Args:  logits  n f32; out  one u32.
extern "C" __global__ void argmax(const float* logits, int n, u32* out) {
    float v;
    u32 i;
    ls_block_best(logits, n, 0.0f, 0, false, &v, &i);
    if (threadIdx.x == 0) *out = i < (u32)n ? i : 0;
}

// top_k: the k largest logits in order: out_v[r], out_i[r] for r in 0..k (r = 0 the largest).
// Slots past the number of non-NaN logits get -inf and index n. k passes over the logits, so
// meant for the small k of sampling (tens); 1 <= k.
//
// Grid:  (1); block: (1024).
// Args:  logits  n f32; out_v  k f32; out_i  k u32.
extern "C" __global__ void top_k(const float* logits, int n, int k, float* out_v, u32* out_i) {
    float v = 0.0f;
    u32 i = 0;
    for (int r = 0; r < k; r++) {
        ls_block_best(logits, n, v, i, r > 0, &v, &i);
        if (threadIdx.x == 0) {
            out_v[r] = v;
            out_i[r] = i;
        }
    }
}
