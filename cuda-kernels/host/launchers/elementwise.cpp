// Host launchers of src/elementwise.cu: each runs the kernel over the grid `g` (cuda_host.h).
#include "cuda_host.h"

#include "elementwise.cu"

extern "C" int ls_host_rmsnorm(LsLaunch g, float* out, const float* x, const float* weight, int n,
                               float eps) {
    return ls_host::launch(g, [=] { rmsnorm(out, x, weight, n, eps); });
}

extern "C" int ls_host_rope(LsLaunch g, float* x, int head_dim, int pos, const float* inv_freq,
                            int style) {
    return ls_host::launch(g, [=] { rope(x, head_dim, pos, inv_freq, style); });
}

extern "C" int ls_host_gate_mul(LsLaunch g, float* gate, const float* up, int n, int act) {
    return ls_host::launch(g, [=] { gate_mul(gate, up, n, act); });
}

extern "C" int ls_host_add_inplace(LsLaunch g, float* a, const float* b, int n) {
    return ls_host::launch(g, [=] { add_inplace(a, b, n); });
}
