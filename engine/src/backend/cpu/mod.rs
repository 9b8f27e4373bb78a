//! CPU kernels. STUB: being written (SIMD dot products over quantised rows).
