// Host launcher of src/matvec.cu: runs the kernel over the grid `g` (cuda_host.h).
#include "cuda_host.h"

#include "matvec.cu"

extern "C" int ls_host_matvec(LsLaunch g, const u8* w, int dtype, int rows, int cols,
                              const float* x, const float* bias, float* y) {
    return ls_host::launch(g, [=] { matvec(w, dtype, rows, cols, x, bias, y); });
}
