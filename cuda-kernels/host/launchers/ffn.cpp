// Host launchers of src/ffn.cu: each runs the kernel over the grid `g` (cuda_host.h).
#include "cuda_host.h"

#include "ffn.cu"

extern "C" int ls_host_ffn_gate_up_gathered(LsLaunch g, const u8* const* chunk_ptrs,
                                            const u32* chunk_index, int n_chunks,
                                            int chunk_neurons, int n_ff, int d_model,
                                            int bundle_bytes, int up_at, int gate_dtype,
                                            int up_dtype, int act, float threshold,
                                            const float* x, float* h, u32* active) {
    return ls_host::launch(g, [=] {
        ffn_gate_up_gathered(chunk_ptrs, chunk_index, n_chunks, chunk_neurons, n_ff, d_model,
                             bundle_bytes, up_at, gate_dtype, up_dtype, act, threshold, x, h,
                             active);
    });
}

extern "C" int ls_host_ffn_down_gathered(LsLaunch g, const u8* const* chunk_ptrs,
                                         const u32* chunk_index, int n_chunks, int chunk_neurons,
                                         int n_ff, int d_model, int bundle_bytes, int down_at,
                                         int down_dtype, const float* h, float* acc) {
    return ls_host::launch(g, [=] {
        ffn_down_gathered(chunk_ptrs, chunk_index, n_chunks, chunk_neurons, n_ff, d_model,
                          bundle_bytes, down_at, down_dtype, h, acc);
    });
}
