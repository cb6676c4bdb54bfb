// Every weight format the CPU backend computes with, as device functions: the value of an
// element (what `formats::*::dequantize` writes) and the integer sum of one of a block's eight
// lanes against quantized activations (what `QuantFormat::lanes` gives lane `l`: elements
// 4l..4l+4 of each 32-element run, weighted by their sub-block scale for the K-quants). The
// integers are exact however they are formed; the float steps around them are in matmul.cu.
#pragma once
#include "common.cuh"

#define PD_QK 32
#define PD_QK_K 256

// How a format's block offsets enter the dot product (`formats::MinTerm`).
#define PD_MIN_NONE 0
#define PD_MIN_PER_BLOCK 1
#define PD_MIN_SUPER_QUAD 2
#define PD_MIN_SUPER_SCALAR 3

// Packs four small signed values into the bytes of an int, for `__dp4a`.
__device__ __forceinline__ int pd_pack4(int a, int b, int c, int d) {
    return (a & 0xff) | ((b & 0xff) << 8) | ((c & 0xff) << 16) | ((d & 0xff) << 24);
}

// Four activation quants at `a`, which must be 4-byte aligned: a GPU faults on a misaligned
// int load (`just test-emu-asan` runs the emulator with UBSan's alignment check for this).
__device__ __forceinline__ int pd_act4(const i8* a) { return *(const int*)a; }

__device__ __forceinline__ int pd_nibble(const u8* qs, int j) {
    return j < 16 ? (qs[j] & 0xf) : (qs[j - 16] >> 4);
}

__device__ __forceinline__ int pd_lane32(const i8* a, int l, int v0, int v1, int v2, int v3) {
    return __dp4a(pd_pack4(v0, v1, v2, v3), pd_act4(a + 4 * l), 0);
}

struct FmtQ8_0 {
    static const int BE = 32, BB = 34, ACT_K = 0, MIN = PD_MIN_NONE, SCALE_AT = 0, MIN_AT = 2;
    __device__ static float value(const u8* b, int j) { return float(i8(b[2 + j])) * pd_f16_at(b); }
    __device__ static int q(const u8* b, int j) { return i8(b[2 + j]); }
    __device__ static int lane(const u8* b, const i8* a, const i16*, int l) {
        const u8* q = b + 2 + 4 * l;
        return pd_lane32(a, l, i8(q[0]), i8(q[1]), i8(q[2]), i8(q[3]));
    }
};

struct FmtQ4_0 {
    static const int BE = 32, BB = 18, ACT_K = 0, MIN = PD_MIN_NONE, SCALE_AT = 0, MIN_AT = 2;
    __device__ static float value(const u8* b, int j) {
        return float(pd_nibble(b + 2, j) - 8) * pd_f16_at(b);
    }
    __device__ static int q(const u8* b, int j) { return pd_nibble(b + 2, j) - 8; }
    __device__ static int lane(const u8* b, const i8* a, const i16*, int l) {
        const u8* q = b + 2;
        int j = 4 * l;
        return pd_lane32(a, l, pd_nibble(q, j) - 8, pd_nibble(q, j + 1) - 8,
                         pd_nibble(q, j + 2) - 8, pd_nibble(q, j + 3) - 8);
    }
};

struct FmtQ4_1 {
    static const int BE = 32, BB = 20, ACT_K = 0, MIN = PD_MIN_PER_BLOCK, SCALE_AT = 0, MIN_AT = 2;
    __device__ static float value(const u8* b, int j) {
        return float(pd_nibble(b + 4, j)) * pd_f16_at(b) + pd_f16_at(b + 2);
    }
    __device__ static int q(const u8* b, int j) { return pd_nibble(b + 4, j); }
    __device__ static int lane(const u8* b, const i8* a, const i16*, int l) {
        const u8* q = b + 4;
        int j = 4 * l;
        return pd_lane32(a, l, pd_nibble(q, j), pd_nibble(q, j + 1), pd_nibble(q, j + 2),
                         pd_nibble(q, j + 3));
    }
};

__device__ __forceinline__ int pd_q5(const u8* qs, u32 qh, int j) {
    return pd_nibble(qs, j) | (int((qh >> j) & 1) << 4);
}

struct FmtQ5_0 {
    static const int BE = 32, BB = 22, ACT_K = 0, MIN = PD_MIN_NONE, SCALE_AT = 0, MIN_AT = 2;
    __device__ static float value(const u8* b, int j) {
        return float(pd_q5(b + 6, pd_u32_at(b + 2), j) - 16) * pd_f16_at(b);
    }
    __device__ static int q(const u8* b, int j) { return pd_q5(b + 6, pd_u32_at(b + 2), j) - 16; }
    __device__ static int lane(const u8* b, const i8* a, const i16*, int l) {
        u32 qh = pd_u32_at(b + 2);
        const u8* q = b + 6;
        int j = 4 * l;
        return pd_lane32(a, l, pd_q5(q, qh, j) - 16, pd_q5(q, qh, j + 1) - 16,
                         pd_q5(q, qh, j + 2) - 16, pd_q5(q, qh, j + 3) - 16);
    }
};

struct FmtQ5_1 {
    static const int BE = 32, BB = 24, ACT_K = 0, MIN = PD_MIN_PER_BLOCK, SCALE_AT = 0, MIN_AT = 2;
    __device__ static float value(const u8* b, int j) {
        return float(pd_q5(b + 8, pd_u32_at(b + 4), j)) * pd_f16_at(b) + pd_f16_at(b + 2);
    }
    __device__ static int q(const u8* b, int j) { return pd_q5(b + 8, pd_u32_at(b + 4), j); }
    __device__ static int lane(const u8* b, const i8* a, const i16*, int l) {
        u32 qh = pd_u32_at(b + 4);
        const u8* q = b + 8;
        int j = 4 * l;
        return pd_lane32(a, l, pd_q5(q, qh, j), pd_q5(q, qh, j + 1), pd_q5(q, qh, j + 2),
                         pd_q5(q, qh, j + 3));
    }
};

// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block (`get_scale_min_k4`).
__device__ __forceinline__ void pd_k4_scale_min(const u8* q, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

__device__ __forceinline__ int pd_q4k_value(const u8* b, int sub, int e) {
    u8 q = b[16 + 32 * (sub / 2) + e];
    return (sub % 2 == 0) ? (q & 0xf) : (q >> 4);
}

__device__ __forceinline__ int pd_q5k_value(const u8* b, int sub, int e) {
    u8 q = b[48 + 32 * (sub / 2) + e];
    int low = (sub % 2 == 0) ? (q & 0xf) : (q >> 4);
    return low | (((b[16 + e] >> sub) & 1) << 4);
}

// `mins[2m]·s[2m] + mins[2m+1]·s[2m+1]` over the 32-element sums `s` (pairs of `sums`).
__device__ __forceinline__ int pd_k4_min_lane(const u8* b, const i16* sums, int m) {
    int p = 0;
    for (int k = 2 * m; k < 2 * m + 2; k++) {
        int sc, mn;
        pd_k4_scale_min(b + 4, k, &sc, &mn);
        p += mn * (int(sums[2 * k]) + int(sums[2 * k + 1]));
    }
    return p;
}

// Q4_K and Q5_K: the same scales, mins and lanes over their own element values `V`.
template <int (*V)(const u8*, int, int), int BYTES, int MIN_TERM>
struct FmtK4 {
    static const int BE = 256, BB = BYTES, ACT_K = 1, MIN = MIN_TERM, SCALE_AT = 0, MIN_AT = 2;
    __device__ static float value(const u8* b, int j) {
        int sub = j / 32, sc, mn;
        pd_k4_scale_min(b + 4, sub, &sc, &mn);
        float d1 = pd_f16_at(b) * float(sc), m1 = pd_f16_at(b + 2) * float(mn);
        return d1 * float(V(b, sub, j % 32)) - m1;
    }
    __device__ static int lane(const u8* b, const i8* a, const i16*, int l) {
        int sum = 0, e = 4 * l;
        for (int sub = 0; sub < 8; sub++) {
            int sc, mn;
            pd_k4_scale_min(b + 4, sub, &sc, &mn);
            int w = pd_pack4(V(b, sub, e), V(b, sub, e + 1), V(b, sub, e + 2), V(b, sub, e + 3));
            sum += sc * __dp4a(w, pd_act4(a + 32 * sub + e), 0);
        }
        return sum;
    }
    __device__ static int min_lane(const u8* b, const i16* sums, int m) {
        return pd_k4_min_lane(b, sums, m);
    }
    // For the tensor cores (`pd_mma_block`): quants `e..e+3` of sub-block `c` as one fragment
    // register, and the sub-block's scale.
    static const int HALVES = 1;
    __device__ static u32 quad(const u8* b, int c, int e) {
        return u32(pd_pack4(V(b, c, e), V(b, c, e + 1), V(b, c, e + 2), V(b, c, e + 3)));
    }
    __device__ static int chunk_scale(const u8* b, int c, int) {
        int sc, mn;
        pd_k4_scale_min(b + 4, c, &sc, &mn);
        return sc;
    }
};

typedef FmtK4<pd_q4k_value, 144, PD_MIN_SUPER_QUAD> FmtQ4_K;
typedef FmtK4<pd_q5k_value, 176, PD_MIN_SUPER_SCALAR> FmtQ5_K;

// Element `e` of 32-element chunk `c` of a Q6_K block, before the −32 offset (0..64).
__device__ __forceinline__ int pd_q6k_raw(const u8* b, int c, int e) {
    int half = c / 4, k = c % 4;
    u8 ql = b[64 * half + 32 * (k % 2) + e];
    int low = k < 2 ? (ql & 0xf) : (ql >> 4);
    int high = (b[128 + 32 * half + e] >> (2 * k)) & 3;
    return low | (high << 4);
}

struct FmtQ6_K {
    static const int BE = 256, BB = 210, ACT_K = 1, MIN = PD_MIN_NONE, SCALE_AT = 208, MIN_AT = 0;
    __device__ static float value(const u8* b, int j) {
        int c = j / 32, e = j % 32;
        float sc = float(i8(b[192 + 2 * c + e / 16]));
        return pd_f16_at(b + 208) * sc * float(pd_q6k_raw(b, c, e) - 32);
    }
    // The CPU's lanes take the −32 offset off per lane pair of 16-element sums (as its AVX2
    // layout does); the same integers here.
    __device__ static int lane(const u8* b, const i8* a, const i16* sums, int l) {
        int sum = 0;
        int e = 4 * l;
        for (int c = 0; c < 8; c++) {
            int sc = i8(b[192 + 2 * c + e / 16]);
            int part = __dp4a(pd_pack4(pd_q6k_raw(b, c, e), pd_q6k_raw(b, c, e + 1),
                                       pd_q6k_raw(b, c, e + 2), pd_q6k_raw(b, c, e + 3)),
                              pd_act4(a + 32 * c + e), 0);
            sum += sc * part;
        }
        int s0 = i8(b[192 + 2 * l]), s1 = i8(b[192 + 2 * l + 1]);
        return sum - ((s0 * int(sums[2 * l]) + s1 * int(sums[2 * l + 1])) << 5);
    }
    // For the tensor cores: signed quants (−32..31) of chunk `c`, whose halves of 16 have
    // their own scales.
    static const int HALVES = 2;
    __device__ static u32 quad(const u8* b, int c, int e) {
        return u32(pd_pack4(pd_q6k_raw(b, c, e) - 32, pd_q6k_raw(b, c, e + 1) - 32,
                            pd_q6k_raw(b, c, e + 2) - 32, pd_q6k_raw(b, c, e + 3) - 32));
    }
    __device__ static int chunk_scale(const u8* b, int c, int h) { return i8(b[192 + 2 * c + h]); }
};
