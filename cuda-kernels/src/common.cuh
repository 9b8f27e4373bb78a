// Shared device helpers for the LeanStream kernels: element types, block layouts, dot products
// and warp reductions. Needs no CUDA headers (NVRTC provides the built-ins used here), so the PTX
// depends only on the pinned NVRTC.
//
// Element types (the values of `dtype` arguments) follow engine/src/quant/mod.rs `DType::ALL`:
//   0 F32   4 bytes, little-endian IEEE single
//   1 F16   2 bytes, IEEE half
//   2 BF16  2 bytes, bfloat16
//   3 Q8_0  34-byte blocks of 32: f16 d, 32 x i8 q;              value = d * q
//   4 Q4_0  18-byte blocks of 32: f16 d, 16 bytes of nibbles;    value = d * (q - 8)
//   5 Q4_1  20-byte blocks of 32: f16 d, f16 m, 16 nibble bytes; value = d * q + m
//   6 Q5_0  22-byte blocks of 32: f16 d, u32 qh, 16 nibble bytes; value = d * (q - 16)
//   7 Q5_1  24-byte blocks of 32: f16 d, f16 m, u32 qh, 16 nibble bytes; value = d * q + m
//   8 Q2_K   84-byte super-blocks of 256 } k-quants: 16 groups of 16 values, value =
//   9 Q3_K  110-byte super-blocks of 256 } scale[g] * q - min[g]; the layouts are spelled out
//  10 Q4_K  144-byte super-blocks of 256 } at ls_kq_scale_min and ls_kq_quant below (and in
//  11 Q5_K  176-byte super-blocks of 256 } engine/src/quant/kquant.rs)
//  12 Q6_K  210-byte super-blocks of 256 }
// In Q4/Q5 blocks byte j holds element j in its low nibble and element j + 16 in its high one;
// bit j of the little-endian qh is bit 4 of element j.
// Rows are blocks back to back with no padding; block types need a multiple of 32 values, k-quant
// types of 256.
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
#define LS_Q5_0 6
#define LS_Q5_1 7
#define LS_Q2_K 8
#define LS_Q3_K 9
#define LS_Q4_K 10
#define LS_Q5_K 11
#define LS_Q6_K 12

#define LS_QK 32
#define LS_QK_K 256
#define LS_WARP 32
#define LS_FULL_MASK 0xffffffffu
#define LS_INF __int_as_float(0x7f800000) // +infinity (no <math.h> under NVRTC)

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// IEEE half bits to f32, exact (subnormals, infinities and NaN included), via the PTX conversion;
// the same by bits where the kernels are built for the host (cuda-kernels/host/).
__device__ __forceinline__ float ls_f16_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const u32 sign = (u32)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) { // zero or subnormal: mant * 2^-24, exact in f32
        const float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const u32 bits = exp == 0x1f ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13);
    return __int_as_float((int)(sign | bits));
#endif
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
    case LS_Q4_1: return 20;
    case LS_Q5_0: return 22;
    case LS_Q5_1: return 24;
    case LS_Q2_K: return 84;
    case LS_Q3_K: return 110;
    case LS_Q4_K: return 144;
    case LS_Q5_K: return 176;
    default: return 210; // LS_Q6_K
    }
}

__device__ __forceinline__ bool ls_is_kquant(int dtype) {
    return dtype >= LS_Q2_K;
}

__device__ __forceinline__ int ls_block_len(int dtype) {
    return dtype <= LS_BF16 ? 1 : ls_is_kquant(dtype) ? LS_QK_K : LS_QK;
}

// The low four bits of element k (0..31) of a 32-value block whose nibble bytes start at q.
__device__ __forceinline__ int ls_nibble(const u8* q, int k) {
    return k < 16 ? (q[k] & 0x0f) : (q[k - 16] >> 4);
}

// The 5-bit quant k (0..31) of a Q5 block whose u32 qh starts at qh (the nibbles follow it).
__device__ __forceinline__ int ls_q5(const u8* qh, int k) {
    const u32 h = qh[0] | (qh[1] << 8) | (qh[2] << 16) | ((u32)qh[3] << 24);
    return ls_nibble(qh + 4, k) | (((h >> k) & 1) << 4);
}

// Scale and min of 16-value group g (0..15) of a k-quant super-block: value = scale * q - min.
//   Q2_K: scales[16] @0, qs[64] @16, f16 d @80, f16 dmin @82; scale = d * (scales[g] & 15),
//         min = dmin * (scales[g] >> 4).
//   Q3_K: hmask[32] @0, qs[64] @32, scales[12] @96, f16 d @108; 6-bit scale s6: low four bits
//         in nibble g / 8 of byte g % 8, high two at bit 2 (g / 4) of byte 8 + g % 4;
//         scale = d * (s6 - 32), no min.
//   Q4_K/Q5_K: f16 d @0, f16 dmin @2, scales[12] @4; 32-value sub-block j = g / 2 has 6-bit sc
//         and m: j < 4: sc = s[j] & 63, m = s[j + 4] & 63; j >= 4: sc = (s[j + 4] & 15) |
//         (s[j - 4] >> 6) << 4, m = (s[j + 4] >> 4) | (s[j] >> 6) << 4; scale = d * sc,
//         min = dmin * m.
//   Q6_K: ql[128] @0, qh[64] @128, scales[16] (i8) @192, f16 d @208; scale = d * scales[g].
__device__ __forceinline__ void ls_kq_scale_min(int dtype, const u8* b, int g, float* scale,
                                                float* min) {
    switch (dtype) {
    case LS_Q2_K:
        *scale = ls_f16_to_f32(ls_u16_at(b + 80)) * (float)(b[g] & 0x0f);
        *min = ls_f16_to_f32(ls_u16_at(b + 82)) * (float)(b[g] >> 4);
        return;
    case LS_Q3_K: {
        const u8* s = b + 96;
        const int s6 = ((s[g % 8] >> (4 * (g / 8))) & 0x0f) | (((s[8 + g % 4] >> (2 * (g / 4))) & 3) << 4);
        *scale = ls_f16_to_f32(ls_u16_at(b + 108)) * (float)(s6 - 32);
        *min = 0.0f;
        return;
    }
    case LS_Q4_K:
    case LS_Q5_K: {
        const u8* s = b + 4;
        const int j = g / 2;
        const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        const int m = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        *scale = ls_f16_to_f32(ls_u16_at(b)) * (float)sc;
        *min = ls_f16_to_f32(ls_u16_at(b + 2)) * (float)m;
        return;
    }
    default: // LS_Q6_K
        *scale = ls_f16_to_f32(ls_u16_at(b + 208)) * (float)(signed char)b[192 + g];
        *min = 0.0f;
        return;
    }
}

// Integer quant of element e (0..255) of a k-quant super-block; with l = e % 32, h = e / 128,
// s = e % 128 / 32:
//   Q2_K: (qs[32h + l] >> 2s) & 3
//   Q3_K: ((qs[32h + l] >> 2s) & 3) - 4, without the - 4 where bit e / 32 of hmask[l] is set
//   Q4_K: (qs[32 (e / 64) + l] >> 4 (e / 32 % 2)) & 15, qs @16
//   Q5_K: the same with qs @48, plus bit e / 32 of qh[l] (qh @16) as bit 4
//   Q6_K: ((ql[64h + e % 64] >> 4 (e % 128 / 64)) & 15 | ((qh[32h + l] >> 2s) & 3) << 4) - 32
__device__ __forceinline__ int ls_kq_quant(int dtype, const u8* b, int e) {
    const int l = e % 32, h = e / 128, s = e % 128 / 32;
    switch (dtype) {
    case LS_Q2_K: return (b[16 + 32 * h + l] >> (2 * s)) & 3;
    case LS_Q3_K: {
        const int low = (b[32 + 32 * h + l] >> (2 * s)) & 3;
        return ((b[l] >> (e / 32)) & 1) ? low : low - 4;
    }
    case LS_Q4_K: return (b[16 + 32 * (e / 64) + l] >> (4 * (e / 32 % 2))) & 0x0f;
    case LS_Q5_K: {
        const int low = (b[48 + 32 * (e / 64) + l] >> (4 * (e / 32 % 2))) & 0x0f;
        return low | (((b[16 + l] >> (e / 32)) & 1) << 4);
    }
    default: { // LS_Q6_K
        const int low = (b[64 * h + e % 64] >> (4 * (e % 128 / 64))) & 0x0f;
        return (low | (((b[128 + 32 * h + l] >> (2 * s)) & 3) << 4)) - 32;
    }
    }
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
    case LS_Q4_1: {
        const u8* b = row + (i / LS_QK) * 20;
        int k = i % LS_QK;
        int q = k < 16 ? (b[4 + k] & 0x0f) : (b[4 + k - 16] >> 4);
        return ls_f16_to_f32(ls_u16_at(b)) * (float)q + ls_f16_to_f32(ls_u16_at(b + 2));
    }
    case LS_Q5_0: {
        const u8* b = row + (i / LS_QK) * 22;
        return ls_f16_to_f32(ls_u16_at(b)) * (float)(ls_q5(b + 2, i % LS_QK) - 16);
    }
    case LS_Q5_1: {
        const u8* b = row + (i / LS_QK) * 24;
        return ls_f16_to_f32(ls_u16_at(b)) * (float)ls_q5(b + 4, i % LS_QK) +
               ls_f16_to_f32(ls_u16_at(b + 2));
    }
    default: { // k-quants
        const u8* b = row + (long long)(i / LS_QK_K) * ls_block_bytes(dtype);
        const int e = i % LS_QK_K;
        float scale, min;
        ls_kq_scale_min(dtype, b, e / 16, &scale, &min);
        return scale * (float)ls_kq_quant(dtype, b, e) - min;
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
// l / 4, l / 4 + 8, ...; so a warp reads 8 consecutive blocks at a time. K-quants: lane l takes
// 16-value group l % 16 of super-blocks l / 16, l / 16 + 2, ...; a warp reads two super-blocks
// at a time. Float types: lane l takes elements l, l + 32, ...
__device__ __forceinline__ float ls_warp_dot(int dtype, const u8* row, const float* x, int n) {
    const int lane = threadIdx.x % LS_WARP;
    float acc = 0.0f;
    if (dtype <= LS_BF16) {
        for (int i = lane; i < n; i += LS_WARP) acc += ls_element(dtype, row, i) * x[i];
        return ls_warp_sum(acc);
    }
    if (ls_is_kquant(dtype)) {
        const int bytes = ls_block_bytes(dtype);
        const int g = lane % 16;
        for (int b = lane / 16; b < n / LS_QK_K; b += 2) {
            const u8* blk = row + (long long)b * bytes;
            const float* xg = x + b * LS_QK_K + 16 * g;
            float scale, min;
            ls_kq_scale_min(dtype, blk, g, &scale, &min);
            float s = 0.0f, sx = 0.0f;
            for (int j = 0; j < 16; j++) {
                s += (float)ls_kq_quant(dtype, blk, 16 * g + j) * xg[j];
                sx += xg[j];
            }
            acc += scale * s - min * sx;
        }
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
        } else if (dtype == LS_Q5_0 || dtype == LS_Q5_1) {
            // Part p covers elements 8p..8p+7 (qh bit j, nibble j as ls_q5 reads them).
            const bool one = dtype == LS_Q5_1;
            const u8* blk = row + b * (one ? 24 : 22);
            const u8* qh = blk + (one ? 4 : 2);
            const float d = ls_f16_to_f32(ls_u16_at(blk));
            const float m = one ? ls_f16_to_f32(ls_u16_at(blk + 2)) : 0.0f;
            const int off = one ? 0 : 16;
            float s = 0.0f, sx = 0.0f;
            for (int j = 8 * part; j < 8 * part + 8; j++) {
                s += (float)(ls_q5(qh, j) - off) * xb[j];
                sx += xb[j];
            }
            acc += d * s + m * sx;
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

// FFN activation codes (engine/src/model/config.rs FfnActivation): 0 = SiLU (SwiGLU), 1 = ReLU,
// 2 = GELU with the tanh approximation (GeGLU), written as g / (1 + e^(-2u)) with
// u = sqrt(2/pi) (g + 0.044715 g^3), the CPU's form.
__device__ __forceinline__ float ls_activation(int act, float g) {
    if (act == 0) return g / (1.0f + expf(-g));
    if (act == 1) return fmaxf(g, 0.0f);
    const float u = 0.7978846f * (g + 0.044715f * g * g * g);
    return g / (1.0f + expf(-2.0f * u));
}
