// Dense mat-vec over a resident weight matrix (attention projections, output head).
#include "common.cuh"

#define LS_MATVEC_WARPS 8 // warps per block (block = 256 threads)

// matvec: y[r] = W[r] . x (+ bias[r]) for r in 0..rows.
//
// Grid:  (ceil(rows / 8)); block: (256) = 8 warps, one warp per row.
// Args:
//   w          rows x cols, row-major, each row `cols` values in `dtype` stored back to back
//              (row r starts at byte r * row_bytes(dtype, cols)); cols a multiple of 32 for block
//              types
//   dtype      element type (common.cuh)
//   rows, cols the matrix shape
//   x          cols f32
//   bias       rows f32, or null for none
//   y          rows f32, overwritten (must not alias x)
extern "C" __global__ void matvec(const u8* w, int dtype, int rows, int cols, const float* x,
                                  const float* bias, float* y) {
    const int r = blockIdx.x * LS_MATVEC_WARPS + threadIdx.x / LS_WARP;
    if (r >= rows) return; // whole warp leaves together
    const float v = ls_warp_dot(dtype, w + r * ls_row_bytes(dtype, cols), x, cols);
    if (threadIdx.x % LS_WARP == 0) y[r] = bias != 0 ? v + bias[r] : v;
}
