// Shared device helpers for the LeanStream kernels: element types, block layouts, dot products
// and warp reductions. Needs no CUDA headers (NVRTC provides the built-ins used here), so the PTX
// depends only on the pinned NVRTC.
//
// Element types (the values of `dtype` arguments) follow engine/src/quant.rs `DType::ALL`:
//   0 F32   4 bytes, little-endian IEEE single
//   1 F16   2 bytes, IEEE half
//   2 BF16  2 bytes, bfloat16
//   3 Q8_0  34-byte blocks of 32: f16 d, 32 x i8 q;              value = d * q
//   4 Q4_0  18-byte blocks of 32: f16 d, 16 bytes of nibbles;    value = d * (q - 8)
//   5 Q4_1  20-byte blocks of 32: f16 d, f16 m, 16 nibble bytes; value = d * q + m
// In Q4 blocks byte j holds element j in its low nibble and element j + 16 in its high one.
// Rows are blocks back to back with no padding; block types need a multiple of 32 values.
//
// Weights are read byte by byte (Q4_0 blocks are only 2-byte aligned, and an .lsm bundle may put
// an f32 row at any even offset); activations are f32 and 4-byte aligned.
#pragma once

#define LS_F32 0
#define LS_F16 1
#define LS_BF16 2
#define LS_Q8_0 3
#define LS_Q4_0 4
#define LS_Q4_1 5

#define LS_QK 32
#define LS_WARP 32
#define LS_FULL_MASK 0xffffffffu
#define LS_INF __int_as_float(0x7f800000) // +infinity (no <math.h> under NVRTC)

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// IEEE half bits to f32, exact (subnormals, infinities and NaN included), via the PTX conversion.
__device__ __forceinline__ float ls_f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// bfloat16 bits to f32 (exact: the upper half of an f32).
__device__ __forceinline__ float ls_bf16_to_f32(u16 h) {
    return __int_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 ls_u16_at(const u8* p) {
    return (u16)(p[0] | (p[1] << 8));
}

__device__ __forceinline__ float ls_f32_at(const u8* p) {
    return __int_as_float((int)(p[0] | (p[1] << 8) | (p[2] << 16) | ((u32)p[3] << 24)));
}

// Bytes per block and values per block of a type.
__device__ __forceinline__ int ls_block_bytes(int dtype) {
    switch (dtype) {
    case LS_F32: return 4;
    case LS_F16:
    case LS_BF16: return 2;
    case LS_Q8_0: return 34;
    case LS_Q4_0: return 18;
    default: return 20; // LS_Q4_1
    }
}

__device__ __forceinline__ int ls_block_len(int dtype) {
    return dtype <= LS_BF16 ? 1 : LS_QK;
}

// Bytes of a row of n values (n a whole number of blocks).
__device__ __forceinline__ long long ls_row_bytes(int dtype, int n) {
    return (long long)(n / ls_block_len(dtype)) * ls_block_bytes(dtype);
}

// Element i of a row stored in `dtype` (used where one thread reads one element of many rows).
__device__ __forceinline__ float ls_element(int dtype, const u8* row, int i) {
    switch (dtype) {
    case LS_F32: return ls_f32_at(row + 4 * i);
    case LS_F16: return ls_f16_to_f32(ls_u16_at(row + 2 * i));
    case LS_BF16: return ls_bf16_to_f32(ls_u16_at(row + 2 * i));
    case LS_Q8_0: {
        const u8* b = row + (i / LS_QK) * 34;
        return ls_f16_to_f32(ls_u16_at(b)) * (float)(signed char)b[2 + i % LS_QK];
    }
    case LS_Q4_0: {
        const u8* b = row + (i / LS_QK) * 18;
        int k = i % LS_QK;
        int q = k < 16 ? (b[2 + k] & 0x0f) : (b[2 + k - 16] >> 4);
        return ls_f16_to_f32(ls_u16_at(b)) * (float)(q - 8);
    }
    default: { // LS_Q4_1
        const u8* b = row + (i / LS_QK) * 20;
        int k = i % LS_QK;
        int q = k < 16 ? (b[4 + k] & 0x0f) : (b[4 + k - 16] >> 4);
        return ls_f16_to_f32(ls_u16_at(b)) * (float)q + ls_f16_to_f32(ls_u16_at(b + 2));
    }
    }
}

__device__ __forceinline__ float ls_warp_sum(float v) {
    for (int o = LS_WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(LS_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float ls_warp_max(float v) {
    for (int o = LS_WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(LS_FULL_MASK, v, o));
    return v;
}

// Dot product of one stored row of n values with f32 x, computed by one whole warp (every lane
// must call it; every lane gets the result).
//
// Block types: a block is split in four parts of 8 values, lane l takes part l % 4 of blocks
// l / 4, l / 4 + 8, ...; so a warp reads 8 consecutive blocks at a time. Float types: lane l takes
// elements l, l + 32, ...
__device__ __forceinline__ float ls_warp_dot(int dtype, const u8* row, const float* x, int n) {
    const int lane = threadIdx.x % LS_WARP;
    float acc = 0.0f;
    if (dtype <= LS_BF16) {
        for (int i = lane; i < n; i += LS_WARP) acc += ls_element(dtype, row, i) * x[i];
        return ls_warp_sum(acc);
    }
    const int nb = n / LS_QK;
    const int part = lane % 4;
    for (int b = lane / 4; b < nb; b += LS_WARP / 4) {
        const float* xb = x + b * LS_QK;
        if (dtype == LS_Q8_0) {
            const u8* blk = row + b * 34;
            const float d = ls_f16_to_f32(ls_u16_at(blk));
            float s = 0.0f;
            for (int j = 8 * part; j < 8 * part + 8; j++) s += (float)(signed char)blk[2 + j] * xb[j];
            acc += d * s;
        } else if (dtype == LS_Q4_0) {
            // Part p covers bytes 4p..4p+3: elements 4p..4p+3 (low) and 16+4p..16+4p+3 (high).
            const u8* blk = row + b * 18;
            const float d = ls_f16_to_f32(ls_u16_at(blk));
            float s = 0.0f;
            for (int j = 4 * part; j < 4 * part + 4; j++) {
                const int q = blk[2 + j];
                s += (float)((q & 0x0f) - 8) * xb[j] + (float)((q >> 4) - 8) * xb[j + 16];
            }
            acc += d * s;
        } else { // LS_Q4_1
            const u8* blk = row + b * 20;
            const float d = ls_f16_to_f32(ls_u16_at(blk));
            const float m = ls_f16_to_f32(ls_u16_at(blk + 2));
            float s = 0.0f, sx = 0.0f;
            for (int j = 4 * part; j < 4 * part + 4; j++) {
                const int q = blk[4 + j];
                s += (float)(q & 0x0f) * xb[j] + (float)(q >> 4) * xb[j + 16];
                sx += xb[j] + xb[j + 16];
            }
            acc += d * s + m * sx;
        }
    }
    return ls_warp_sum(acc);
}
