// The sparse FFN over a list of neuron chunks (engine/src/pipeline/kernel.rs on the GPU).
//
// A chunk as stored in the .lsm (engine/src/pipeline/layout.rs) is `chunk_neurons` neuron bundles
// of `bundle_bytes` each, back to back from the chunk's first byte (the last chunk of a layer may
// hold fewer neurons; padding follows). Bundle j of chunk c is neuron c * chunk_neurons + j:
//   [0, up_at)               gate row, d_model values in gate_dtype
//   [up_at, down_at)         up row,   d_model values in up_dtype
//   [down_at, ...)           down column (the neuron's column of W_down), d_model values in
//                            down_dtype
// Chunks live wherever the cache put them (host-registered buffers on Jetson), so the kernels take
// one base pointer per listed chunk. Two launches per batch of arrived chunks: ffn_gate_up_gathered
// writes the neurons' activations into h, then ffn_down_gathered adds their down contributions to
// acc. Batches may come in any order; the sum is the same up to f32 rounding.
#include "common.cuh"

#define LS_FFN_WARPS 8 // warps per block of ffn_gate_up_gathered (block = 256 threads)

// ffn_gate_up_gathered: for every neuron j of every listed chunk,
//   a = act(gate_j . x) * (up_j . x);  h[neuron] = (a != 0 && |a| >= threshold) ? a : 0
// and, when `active` is not null, adds the number of neurons kept to *active.
//
// Grid:  (ceil(chunk_neurons / 8), n_chunks); block: (256) = 8 warps, one warp per neuron.
// Args:
//   chunk_ptrs     n_chunks device pointers, chunk_ptrs[i] = first byte of listed chunk i
//   chunk_index    n_chunks chunk indices inside the layer (c), giving the neurons' positions
//   n_chunks       number of listed chunks (no chunk twice)
//   chunk_neurons  neurons per chunk; n_ff neurons in the layer (bounds the last chunk)
//   d_model        width of x (a multiple of 32 for block types)
//   bundle_bytes, up_at   bundle geometry as in ChunkLayout
//   gate_dtype, up_dtype  element types (common.cuh)
//   act            0 = SiLU, 1 = ReLU, 2 = GELU (tanh);  threshold: |a| below it counts as inactive (0 keeps all)
//   x              d_model f32 (the FFN-normed residual)
//   h              n_ff f32, the layer's activations; only the listed chunks' ranges are written
//   active         optional u32 counter (may be null)
extern "C" __global__ void ffn_gate_up_gathered(const u8* const* chunk_ptrs, const u32* chunk_index,
                                                int n_chunks, int chunk_neurons, int n_ff,
                                                int d_model, int bundle_bytes, int up_at,
                                                int gate_dtype, int up_dtype, int act,
                                                float threshold, const float* x, float* h,
                                                u32* active) {
    const int i = blockIdx.y;
    const int j = blockIdx.x * LS_FFN_WARPS + threadIdx.x / LS_WARP;
    if (i >= n_chunks) return;
    const long long neuron = (long long)chunk_index[i] * chunk_neurons + j;
    if (j >= chunk_neurons || neuron >= n_ff) return; // whole warp leaves together
    const u8* bundle = chunk_ptrs[i] + (long long)j * bundle_bytes;
    const float g = ls_warp_dot(gate_dtype, bundle, x, d_model);
    const float u = ls_warp_dot(up_dtype, bundle + up_at, x, d_model);
    const float a = ls_activation(act, g) * u;
    const bool keep = a != 0.0f && fabsf(a) >= threshold;
    if (threadIdx.x % LS_WARP == 0) {
        h[neuron] = keep ? a : 0.0f;
        if (keep && active != 0) atomicAdd(active, 1u);
    }
}

// ffn_down_gathered: acc[i] += sum over listed chunks, over their neurons n with h[n] != 0, of
// h[n] * down_n[i]. Inactive neurons cost one read of h and no weight traffic.
//
// Grid:  (ceil(d_model / 256), n_chunks); block: (256), one thread per output element.
// Args:  as ffn_gate_up_gathered, plus
//   down_at     offset of the down column inside a bundle; down_dtype its element type
//   h           n_ff f32 written by ffn_gate_up_gathered for the same chunks
//   acc         d_model f32, added to with atomicAdd (so launches for different batches of
//               chunks may run in any order; the f32 sum order is not fixed)
extern "C" __global__ void ffn_down_gathered(const u8* const* chunk_ptrs, const u32* chunk_index,
                                             int n_chunks, int chunk_neurons, int n_ff,
                                             int d_model, int bundle_bytes, int down_at,
                                             int down_dtype, const float* h, float* acc) {
    const int c = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_chunks || i >= d_model) return;
    const long long first = (long long)chunk_index[c] * chunk_neurons;
    const int count = (int)min((long long)chunk_neurons, (long long)n_ff - first);
    const u8* chunk = chunk_ptrs[c];
    float sum = 0.0f;
    for (int j = 0; j < count; j++) {
        const float a = h[first + j]; // the same for the whole block: a uniform branch
        if (a == 0.0f) continue;
        sum += a * ls_element(down_dtype, chunk + (long long)j * bundle_bytes + down_at, i);
    }
    if (sum != 0.0f) atomicAdd(&acc[i], sum);
}
