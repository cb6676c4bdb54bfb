// What every pdmesh kernel shares: fixed-width types (NVRTC has no <stdint.h>), f16/bf16
// conversions, and the float steps the CPU backend takes in llama.cpp's order (its `exp`, the
// 8- and 16-lane horizontal sums), written once so that a kernel that sums in the CPU's order
// gets the CPU's bits. Compiled by NVRTC (with --fmad=false: no multiply-add is fused unless a
// kernel writes `fmaf`) and by the host compiler under emu/cuda_emu.h (-ffp-contract=off).
#pragma once

typedef decltype(sizeof(0)) size_t;  // NVRTC has no <stddef.h>; the same type where there is one
typedef signed char i8;
typedef unsigned char u8;
typedef short i16;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define PD_FULL_MASK 0xffffffffu

__device__ __forceinline__ float pd_f16_to_f32(u16 h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    u32 sign = u32(h & 0x8000) << 16;
    u32 exp = (h >> 10) & 0x1f;
    u32 man = h & 0x3ff;
    if (exp == 0) {
        // Zero or subnormal: man · 2^-24, exact in f32.
        float v = float(man) * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    return __uint_as_float(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

// f32 to f16, rounding to nearest, ties to even (what `half::f16::from_f32` and F16C do).
__device__ __forceinline__ u16 pd_f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000;
    u32 exp = (x >> 23) & 0xff;
    u32 man = x & 0x7fffff;
    if (exp == 0xff) return u16(sign | 0x7c00 | (man ? 0x200 | (man >> 13) : 0));
    int e = int(exp) - 127 + 15;
    if (e >= 31) return u16(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return u16(sign);
        // Subnormal: shift the full mantissa down and round to nearest even.
        u32 m = man | 0x800000;
        u32 shift = u32(14 - e);
        u32 half_bit = 1u << (shift - 1);
        u32 q = m >> shift;
        u32 rest = m & ((1u << shift) - 1);
        if (rest > half_bit || (rest == half_bit && (q & 1))) q++;
        return u16(sign | q);
    }
    u32 q = (u32(e) << 10) | (man >> 13);
    u32 rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (q & 1))) q++;  // may carry into the exponent: right
    return u16(sign | q);
#endif
}

__device__ __forceinline__ float pd_round_f16(float f) { return pd_f16_to_f32(pd_f32_to_f16(f)); }

__device__ __forceinline__ float pd_bf16_to_f32(u16 h) { return __uint_as_float(u32(h) << 16); }

// f32 to bf16, nearest even, NaN kept quiet (`half::bf16::from_f32`).
__device__ __forceinline__ u16 pd_f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return u16((x >> 16) | 0x40);
    u32 round = 0x8000;
    if ((x & round) != 0 && (x & (3 * round - 1)) != 0) return u16((x >> 16) + 1);
    return u16(x >> 16);
}

// A little-endian f16 at an address with no alignment promise (block scales sit at odd
// offsets in the packed formats).
__device__ __forceinline__ float pd_f16_at(const u8* p) { return pd_f16_to_f32(u16(p[0] | (p[1] << 8))); }

__device__ __forceinline__ u32 pd_u32_at(const u8* p) {
    return u32(p[0]) | (u32(p[1]) << 8) | (u32(p[2]) << 16) | (u32(p[3]) << 24);
}

// llama.cpp's vectorised expf (`ggml_v_expf`), as `cpu::ops::exp`: the same fused steps and a
// last scaling by 2^n done in f64, where it is exact, then rounded once.
__device__ __forceinline__ float pd_exp(float x) {
    const float log2e = __uint_as_float(0x3fb8aa3bu);
    const float shift = __uint_as_float(0x4b400000u);
    const float ln2_hi = __uint_as_float(0x3f317200u);
    const float ln2_lo = __uint_as_float(0x35bfbe8eu);
    float z = fmaf(x, log2e, shift);
    float n = z - shift;
    float b = fmaf(-n, ln2_lo, fmaf(-n, ln2_hi, x));
    float u = b * b;
    const float c1 = __uint_as_float(0x3f7ffff6u);
    const float c2 = __uint_as_float(0x3efffedbu);
    const float c3 = __uint_as_float(0x3e2aaf33u);
    const float c4 = __uint_as_float(0x3d2b9f17u);
    const float c5 = __uint_as_float(0x3c072010u);
    float j = fmaf(fmaf(fmaf(c5, b, c4), u, fmaf(c3, b, c2)), u, fmaf(c1, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : __uint_as_float(0x7f800000u);
    double scale = __longlong_as_double((long long)(int(n) + 1023) << 52);
    return float(double(j) * scale);
}

__device__ __forceinline__ float pd_silu(float x) { return x / (1.0f + pd_exp(0.0f - x)); }

// `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`: llama.cpp's `hsum_float_8`.
__device__ __forceinline__ float pd_hsum8(const float* a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Upper 8 lanes onto the lower 8, then `pd_hsum8` (`_mm512_reduce_add_ps` as GCC expands it).
__device__ __forceinline__ float pd_reduce16(const float* v) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = v[i + 8] + v[i];
    return pd_hsum8(t);
}

// `pd_hsum8` of the values held by the 8 consecutive lanes of a group (lane % 8 == 0 first),
// by shuffles; every lane of the group gets the sum. Float addition commutes, so each pair's
// sum is the same bits in both lanes that form it.
__device__ __forceinline__ float pd_group8_hsum(float v) {
    v = v + __shfl_xor_sync(PD_FULL_MASK, v, 4);
    v = v + __shfl_xor_sync(PD_FULL_MASK, v, 2);
    return v + __shfl_xor_sync(PD_FULL_MASK, v, 1);
}

__device__ __forceinline__ int pd_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int pd_max(int a, int b) { return a > b ? a : b; }

// Rotates the pair (`*a`, `*b`) by the angle of cosine `c` and sine `s`: the first products
// fused, the second rounded, as GCC compiles llama.cpp's `rotate_pairs`.
__device__ __forceinline__ void pd_rotate(float* a, float* b, float c, float s) {
    float x0 = *a, x1 = *b;
    *a = fmaf(x0, c, -(x1 * s));
    *b = fmaf(x0, s, x1 * c);
}

// Quantizes 32 values as `quant::quantize_block` (llama.cpp's `quantize_row_q8_1`): quants
// `round_half_even(x·127/amax)` into `q`; returns the unrounded scale `amax/127` and their sum
// in `sum`. Callers round the scale (and scaled sum) through f16 as their format stores it.
__device__ __forceinline__ float pd_quantize_block32(const float* x, i8* q, int* sum) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int s = 0;
    for (int j = 0; j < 32; j++) {
        int r = int(rintf(x[j] * id));
        q[j] = i8(r);
        s += r;
    }
    *sum = s;
    return amax / 127.0f;
}

// D += A·B for one warp on the int8 tensor cores (`mma.m16n8k32`, sm_80 and later): A 16×32 and
// B 32×8 signed bytes, D 16×8 int32, in the fragments the PTX ISA gives for this shape
// (lane = 4g + t): a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..], a[2] = A[g][16+4t..],
// a[3] = A[g+8][16+4t..]; b[0] = B[4t..4t+3][g], b[1] = B[16+4t..][g]; d[0], d[1] =
// D[g][2t], D[g][2t+1] and d[2], d[3] the same of row g+8. Every lane of the warp calls it.
__device__ __forceinline__ void pd_mma_s8(int* d, const u32* a, const u32* b) {
#ifdef PDMESH_EMU
    pdmesh_emu::mma_m16n8k32_s8(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
