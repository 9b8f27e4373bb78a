// Host launchers of src/sample.cu: each runs the kernel over the grid `g` (cuda_host.h).
#include "cuda_host.h"

#include "sample.cu"

extern "C" int ls_host_argmax(LsLaunch g, const float* logits, int n, u32* out) {
    return ls_host::launch(g, [=] { argmax(logits, n, out); });
}

extern "C" int ls_host_top_k(LsLaunch g, const float* logits, int n, int k, float* out_v,
                             u32* out_i) {
    return ls_host::launch(g, [=] { top_k(logits, n, k, out_v, out_i); });
}
