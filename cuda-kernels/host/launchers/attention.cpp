// Host launcher of src/attention.cu: runs the kernel over the grid `g` (cuda_host.h).
#include "cuda_host.h"

#include "attention.cu"

extern "C" int ls_host_attention_decode(LsLaunch g, const float* q, const float* k_cache,
                                        const float* v_cache, float* out, int first, int n_pos,
                                        int n_heads, int n_kv_heads, int head_dim, int kv_stride) {
    return ls_host::launch(g, [=] {
        attention_decode(q, k_cache, v_cache, out, first, n_pos, n_heads, n_kv_heads, head_dim,
                         kv_stride);
    });
}
