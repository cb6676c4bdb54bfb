// Matrix products against the weights, in every format, and the embedding lookup.
//
// Each output `out[t * rows + r] = W[r] · x[t]` is summed in exactly the CPU backend's order
// (`cpu::portable::dot_quantized` / `dot_float`), so the two backends agree bit for bit:
// - quantized weights: eight lane accumulators, one FMA per block with the product of the two
//   scales, the format's min term on the side, then `hsum8`;
// - float weights: 16 lane accumulators for prompt tokens, 4 × 16 with a tail for generated
//   ones (llama.cpp's batched and single-token kernels), then `reduce16`.
// Two launch shapes compute the same sums: `_lanes` gives each of a row's eight lanes its own
// thread and sums them with shuffles (decode: few tokens, many rows in flight); `_rows` gives
// a thread a whole row for up to eight tokens, reading the weights once for all of them
// (prompts).
#include "common.cuh"
#include "formats.cuh"

// The activations a quantized matmul reads, as the backend lays them out: `qs` quants
// (`ntok × cols`), per-block scales `d` and (Q8) scaled sums `s` or (Q8K) 16-element sums.
#define PD_MM_PARAMS                                                                          \
    const u8 *w, int rows, int row_bytes, int cols, const i8 *qs, const float *d,              \
        const float *s, const i16 *ksums, int ntok, float *out
#define PD_MM_ARGS w, rows, row_bytes, cols, qs, d, s, ksums, ntok, out

// Everything one (row, token) dot carries from block to block for lane `l`.
template <class F>
struct Acc {
    float acc = 0.0f, summs = 0.0f, acc_m = 0.0f;

    __device__ void block(const u8* blk, const i8* a, float da, float sa, const i16* sums, int l) {
        int lane = F::lane(blk, a, sums, l);
        float dd = pd_f16_at(blk + F::SCALE_AT) * da;
        acc = fmaf(dd, float(lane), acc);
        if (F::MIN == PD_MIN_PER_BLOCK) {
            summs = fmaf(pd_f16_at(blk + F::MIN_AT), sa, summs);
        } else if (F::MIN == PD_MIN_SUPER_QUAD) {
            float dmin = -(da * pd_f16_at(blk + F::MIN_AT));
            acc_m = fmaf(dmin, float(min_lane(blk, sums, l & 3)), acc_m);
        } else if (F::MIN == PD_MIN_SUPER_SCALAR) {
            int p0 = min_lane(blk, sums, 0), p1 = min_lane(blk, sums, 1);
            int p2 = min_lane(blk, sums, 2), p3 = min_lane(blk, sums, 3);
            float dmin = -(da * pd_f16_at(blk + F::MIN_AT));
            summs = fmaf(dmin, float((p0 + p1) + (p2 + p3)), summs);
        }
    }

    __device__ static int min_lane(const u8* blk, const i16* sums, int m) {
        if constexpr (F::MIN == PD_MIN_SUPER_QUAD || F::MIN == PD_MIN_SUPER_SCALAR)
            return F::min_lane(blk, sums, m);
        else
            return 0;
    }
};

// Where block `b` of token `t`'s activations is.
template <class F>
struct ActView {
    const i8* qs;
    const float *d, *s;
    const i16* ksums;
    int cols;

    __device__ const i8* quants(int t, int b) const { return qs + (size_t)t * cols + b * F::BE; }
    __device__ float scale(int t, int b) const { return d[(size_t)t * (cols / F::BE) + b]; }
    __device__ float sum(int t, int b) const {
        return F::ACT_K ? 0.0f : s[(size_t)t * (cols / F::BE) + b];
    }
    __device__ const i16* sums(int t, int b) const {
        return F::ACT_K ? ksums + ((size_t)t * (cols / F::BE) + b) * 16 : nullptr;
    }
};

// One row's eight lanes in eight threads; tokens one after another.
template <class F>
__device__ void mm_lanes(PD_MM_PARAMS) {
    int tid = threadIdx.x;
    int r = blockIdx.x * (blockDim.x / 8) + tid / 8;
    int l = tid % 8;
    bool live = r < rows;
    const u8* row = w + (size_t)(live ? r : 0) * row_bytes;
    int nb = cols / F::BE;
    ActView<F> act{qs, d, s, ksums, cols};
    for (int t = 0; t < ntok; t++) {
        Acc<F> a;
        for (int b = 0; b < nb; b++) {
            a.block(row + (size_t)b * F::BB, act.quants(t, b), act.scale(t, b), act.sum(t, b),
                    act.sums(t, b), l);
        }
        float total = pd_group8_hsum(a.acc);
        if (F::MIN == PD_MIN_SUPER_QUAD) {
            // Lanes l and l^4 hold the same quad term m[l & 3]: (m0+m2)+(m1+m3).
            float m = a.acc_m + __shfl_xor_sync(PD_FULL_MASK, a.acc_m, 2);
            total = total + (m + __shfl_xor_sync(PD_FULL_MASK, m, 1));
        } else if (F::MIN != PD_MIN_NONE) {
            total = total + a.summs;
        }
        if (live && l == 0) out[(size_t)t * rows + r] = total;
    }
}

#define PD_TOK_CHUNK 8

// One row in one thread, for up to eight tokens at once (`blockIdx.y` picks which eight).
template <class F>
__device__ void mm_rows(PD_MM_PARAMS) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int t0 = blockIdx.y * PD_TOK_CHUNK;
    int n = pd_min(PD_TOK_CHUNK, ntok - t0);
    const u8* row = w + (size_t)r * row_bytes;
    int nb = cols / F::BE;
    ActView<F> act{qs, d, s, ksums, cols};
    // Loops over the chunk's tokens and lanes unrolled with constant bounds, so that the 64
    // accumulators stay in registers (with `k < n` as the loop bound, ptxas -v showed a
    // 768-byte stack frame: every FMA a round trip through local memory).
    Acc<F> a[PD_TOK_CHUNK][8];
    for (int b = 0; b < nb; b++) {
        const u8* blk = row + (size_t)b * F::BB;
#pragma unroll
        for (int k = 0; k < PD_TOK_CHUNK; k++) {
            if (k >= n) break;
            int t = t0 + k;
            const i8* q = act.quants(t, b);
            float da = act.scale(t, b), sa = act.sum(t, b);
            const i16* sums = act.sums(t, b);
#pragma unroll
            for (int l = 0; l < 8; l++) a[k][l].block(blk, q, da, sa, sums, l);
        }
    }
#pragma unroll
    for (int k = 0; k < PD_TOK_CHUNK; k++) {
        if (k >= n) break;
        float lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = a[k][l].acc;
        float total = pd_hsum8(lanes);
        if (F::MIN == PD_MIN_SUPER_QUAD) {
            total = total + ((a[k][0].acc_m + a[k][2].acc_m) + (a[k][1].acc_m + a[k][3].acc_m));
        } else if (F::MIN != PD_MIN_NONE) {
            total = total + a[k][0].summs;
        }
        out[(size_t)(t0 + k) * rows + r] = total;
    }
}

extern "C" __global__ void mm_q8_0_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ8_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_0_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ4_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_1_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ4_1>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_0_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ5_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_1_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ5_1>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_k_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ4_K>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_k_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ5_K>(PD_MM_ARGS); }
extern "C" __global__ void mm_q6_k_lanes(PD_MM_PARAMS) { mm_lanes<FmtQ6_K>(PD_MM_ARGS); }

extern "C" __global__ void mm_q8_0_rows(PD_MM_PARAMS) { mm_rows<FmtQ8_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_0_rows(PD_MM_PARAMS) { mm_rows<FmtQ4_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_1_rows(PD_MM_PARAMS) { mm_rows<FmtQ4_1>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_0_rows(PD_MM_PARAMS) { mm_rows<FmtQ5_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_1_rows(PD_MM_PARAMS) { mm_rows<FmtQ5_1>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_k_rows(PD_MM_PARAMS) { mm_rows<FmtQ4_K>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_k_rows(PD_MM_PARAMS) { mm_rows<FmtQ5_K>(PD_MM_ARGS); }
extern "C" __global__ void mm_q6_k_rows(PD_MM_PARAMS) { mm_rows<FmtQ6_K>(PD_MM_ARGS); }

// ---- Tensor cores (opt-in: `CudaBackend::with_mma`) ----
//
// Prompt matmuls of the quantized formats on the int8 tensor cores. A warp takes 16 rows × 32
// tokens; for each block of K, m16n8k32 MMAs (one per 8 tokens and 32 quants) give the
// block's exact integer dot for every (row, token). The float steps are then the CPU's per
// block (an FMA with the product of the two scales, the min term on the side), but on the
// block's whole dot rather than on each of the CPU's eight lanes, so the sum rounds
// differently: within the bound the tests state, not the CPU's bits.

#define PD_MMA_ROWS 64
#define PD_MMA_TOKS 32

// Quants `j..j+3` of a block as the four bytes of an MMA fragment register.
template <class F>
__device__ __forceinline__ u32 pd_quad(const u8* blk, int j) {
    return u32(pd_pack4(F::q(blk, j), F::q(blk, j + 1), F::q(blk, j + 2), F::q(blk, j + 3)));
}

// The B fragments of the warp's four groups of 8 tokens for the 32 activation quants at `at`
// in block `b`; zero past the last token.
template <class F>
__device__ __forceinline__ void pd_act_frags(const ActView<F>& act, int b, int at, int tok0,
                                             int ntok, int g, int t, u32 (&bq)[4][2]) {
    for (int j = 0; j < 4; j++) {
        int tb = tok0 + 8 * j + g;
        bq[j][0] = bq[j][1] = 0;
        if (tb >= ntok) continue;
        const i8* q = act.quants(tb, b) + at;
        bq[j][0] = u32(pd_act4(q + 4 * t));
        bq[j][1] = u32(pd_act4(q + 16 + 4 * t));
    }
}

// Block `b`'s exact integer dot for the fragment's (row, token) pairs, `dot[j][i]` (rows `blk`).
// The 32-element formats: one MMA per 8 tokens. The K-quants: a super-block's chunks of 32
// quants each carry their own small integer scale (Q6_K's two, one per 16), so one MMA per
// chunk gives the chunk's dot, the scales weight it in integers, and the super-block's dot is
// exact too (|dot| < 2^28 in every format; as a float it rounds once, as the CPU's lane sums
// may). Q6_K's halves take the same m16n8k32 MMA, each with the other half's weights zero:
// one instruction shape, whose fragment layout every format relies on alike.
template <class F>
__device__ __forceinline__ void pd_mma_block(const ActView<F>& act, int b, const u8* const (&blk)[2],
                                             int tok0, int ntok, int g, int t, int (&dot)[4][4]) {
    u32 bq[4][2];
    if constexpr (F::BE == PD_QK) {
        u32 a[4] = {pd_quad<F>(blk[0], 4 * t), pd_quad<F>(blk[1], 4 * t),
                    pd_quad<F>(blk[0], 16 + 4 * t), pd_quad<F>(blk[1], 16 + 4 * t)};
        pd_act_frags(act, b, 0, tok0, ntok, g, t, bq);
        for (int j = 0; j < 4; j++) pd_mma_s8(dot[j], a, bq[j]);
    } else {
        for (int c = 0; c < 8; c++) {
            u32 wq[4] = {F::quad(blk[0], c, 4 * t), F::quad(blk[1], c, 4 * t),
                         F::quad(blk[0], c, 16 + 4 * t), F::quad(blk[1], c, 16 + 4 * t)};
            pd_act_frags(act, b, 32 * c, tok0, ntok, g, t, bq);
            for (int h = 0; h < F::HALVES; h++) {
                u32 a[4] = {wq[0], wq[1], wq[2], wq[3]};
                if constexpr (F::HALVES == 2) {
                    // Half 0 is the fragments' columns 0..15 (a[0], a[1]), half 1 16..31.
                    a[2 * (1 - h)] = 0;
                    a[2 * (1 - h) + 1] = 0;
                }
                int sc[2] = {F::chunk_scale(blk[0], c, h), F::chunk_scale(blk[1], c, h)};
                for (int j = 0; j < 4; j++) {
                    int part[4] = {0, 0, 0, 0};
                    pd_mma_s8(part, a, bq[j]);
                    for (int i = 0; i < 4; i++) dot[j][i] += sc[i >> 1] * part[i];
                }
            }
        }
    }
}

// Four warps of 16 rows; `blockIdx.y` picks 32 tokens. Rows and tokens past the ends compute
// on row 0 and zero quants and are not stored: every lane takes part in every MMA. Per block,
// the CPU's float steps on the block's integer dot; the K-quants' min term from the CPU's
// integer `min_lane`s in one accumulator (Q5_K's own order; Q4_K's four become one).
template <class F>
__device__ void mm_mma(PD_MM_PARAMS) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int r0 = blockIdx.x * PD_MMA_ROWS + (threadIdx.x / 32) * 16 + g, r1 = r0 + 8;
    int tok0 = blockIdx.y * PD_MMA_TOKS;
    const u8* row0 = w + (size_t)(r0 < rows ? r0 : 0) * row_bytes;
    const u8* row1 = w + (size_t)(r1 < rows ? r1 : 0) * row_bytes;
    ActView<F> act{qs, d, s, ksums, cols};
    float acc[4][4] = {}, summs[4][4] = {};
    for (int b = 0; b < cols / F::BE; b++) {
        const u8* const blk[2] = {row0 + (size_t)b * F::BB, row1 + (size_t)b * F::BB};
        int dot[4][4] = {};
        pd_mma_block(act, b, blk, tok0, ntok, g, t, dot);
        // The K-quants' sub-block mins, per row: what `min_lane` would decode for every token.
        int mins[2][8] = {};
        if constexpr (F::MIN == PD_MIN_SUPER_QUAD || F::MIN == PD_MIN_SUPER_SCALAR) {
            for (int r = 0; r < 2; r++) {
                for (int sub = 0; sub < 8; sub++) {
                    int sc, mn;
                    pd_k4_scale_min(blk[r] + 4, sub, &sc, &mn);
                    mins[r][sub] = mn;
                }
            }
        }
        // Unrolled, so that the accumulators stay in registers (ptxas -v: no stack frame).
#pragma unroll
        for (int j = 0; j < 4; j++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int tok = tok0 + 8 * j + 2 * t + (i & 1);
                if (tok >= ntok) continue;
                const u8* wb = blk[i >> 1];
                float da = act.scale(tok, b);
                acc[j][i] = fmaf(pd_f16_at(wb + F::SCALE_AT) * da, float(dot[j][i]), acc[j][i]);
                if (F::MIN == PD_MIN_PER_BLOCK) {
                    summs[j][i] = fmaf(pd_f16_at(wb + F::MIN_AT), act.sum(tok, b), summs[j][i]);
                } else if (F::MIN != PD_MIN_NONE) {
                    // The CPU's `(p0 + p1) + (p2 + p3)` of `min_lane`s: the same integer.
                    const i16* sums = act.sums(tok, b);
                    int p = 0;
                    for (int sub = 0; sub < 8; sub++)
                        p += mins[i >> 1][sub] * (int(sums[2 * sub]) + int(sums[2 * sub + 1]));
                    float dmin = -(da * pd_f16_at(wb + F::MIN_AT));
                    summs[j][i] = fmaf(dmin, float(p), summs[j][i]);
                }
            }
        }
    }
    for (int j = 0; j < 4; j++) {
        for (int i = 0; i < 4; i++) {
            int r = i < 2 ? r0 : r1, tok = tok0 + 8 * j + 2 * t + (i & 1);
            if (r >= rows || tok >= ntok) continue;
            float total = acc[j][i];
            if (F::MIN != PD_MIN_NONE) total = total + summs[j][i];
            out[(size_t)tok * rows + r] = total;
        }
    }
}

extern "C" __global__ void mm_q8_0_mma(PD_MM_PARAMS) { mm_mma<FmtQ8_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_0_mma(PD_MM_PARAMS) { mm_mma<FmtQ4_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_1_mma(PD_MM_PARAMS) { mm_mma<FmtQ4_1>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_0_mma(PD_MM_PARAMS) { mm_mma<FmtQ5_0>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_1_mma(PD_MM_PARAMS) { mm_mma<FmtQ5_1>(PD_MM_ARGS); }
extern "C" __global__ void mm_q4_k_mma(PD_MM_PARAMS) { mm_mma<FmtQ4_K>(PD_MM_ARGS); }
extern "C" __global__ void mm_q5_k_mma(PD_MM_PARAMS) { mm_mma<FmtQ5_K>(PD_MM_ARGS); }
extern "C" __global__ void mm_q6_k_mma(PD_MM_PARAMS) { mm_mma<FmtQ6_K>(PD_MM_ARGS); }

// ---- Float weights ----

#define PD_KIND_F32 0
#define PD_KIND_F16 1
#define PD_KIND_BF16 2

template <int KIND>
__device__ __forceinline__ float pd_wat(const u8* row, int i) {
    if (KIND == PD_KIND_F32) return ((const float*)row)[i];
    u16 h = ((const u16*)row)[i];
    return KIND == PD_KIND_F16 ? pd_f16_to_f32(h) : pd_bf16_to_f32(h);
}

// `pd_reduce16` of the values the 16 lanes of a group hold.
__device__ __forceinline__ float pd_group16_reduce(float v) {
    v = v + __shfl_xor_sync(PD_FULL_MASK, v, 8);
    return pd_group8_hsum(v);
}

// lane `t`'s share of one `_mm512_dpbf16_ps` over the 32 elements at `base`.
template <int KIND>
__device__ __forceinline__ float pd_dpbf16(float acc, const u8* row, const float* x, int base,
                                           int t) {
    int e = base + 2 * t, o = e + 1;
    return fmaf(pd_wat<KIND>(row, e), x[e], fmaf(pd_wat<KIND>(row, o), x[o], acc));
}

// `W[r] · x` for one token in the order `cpu::portable::dot_float` takes for `tiled`; lane `t`
// of a 16-lane group. Every lane returns the sum.
template <int KIND>
__device__ float pd_dot_float(const u8* row, const float* x, int n, bool tiled, int t) {
    if (KIND == PD_KIND_BF16) {
        if (tiled) {
            float c = 0.0f;
            for (int l = 0; l < n; l += 32) c = pd_dpbf16<KIND>(c, row, x, l, t);
            return pd_group16_reduce(c);
        }
        float c1 = 0.0f, c2 = 0.0f;
        int np = n & ~63;
        for (int i = 0; i < np; i += 64) {
            c1 = pd_dpbf16<KIND>(c1, row, x, i, t);
            c2 = pd_dpbf16<KIND>(c2, row, x, i + 32, t);
        }
        double sum = double(pd_group16_reduce(c1)) + double(pd_group16_reduce(c2));
        for (int i = np; i < n; i++) sum += double(pd_wat<KIND>(row, i) * x[i]);
        return float(sum);
    }
    if (tiled) {
        float c = 0.0f;
        for (int l = 0; l < n; l += 16) c = fmaf(pd_wat<KIND>(row, l + t), x[l + t], c);
        return pd_group16_reduce(c);
    }
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int np = n & ~63;
    for (int i = 0; i < np; i += 64) {
        s0 = fmaf(pd_wat<KIND>(row, i + t), x[i + t], s0);
        s1 = fmaf(pd_wat<KIND>(row, i + 16 + t), x[i + 16 + t], s1);
        s2 = fmaf(pd_wat<KIND>(row, i + 32 + t), x[i + 32 + t], s2);
        s3 = fmaf(pd_wat<KIND>(row, i + 48 + t), x[i + 48 + t], s3);
    }
    float head = pd_group16_reduce((s0 + s2) + (s1 + s3));
    if (KIND == PD_KIND_F32) {
        // ggml_vec_dot_f32's tail, in float and unfused.
        float sum = head;
        for (int i = np; i < n; i++) sum += pd_wat<KIND>(row, i) * x[i];
        return sum;
    }
    double sum = double(head);
    for (int i = np; i < n; i++) sum += double(pd_wat<KIND>(row, i) * x[i]);
    return float(sum);
}

// 16 lanes per row; `x` holds the activations rounded to the weight's type, `phases` each
// token's phase (0 prompt, 1 generated), which picks llama.cpp's kernel and so the order.
template <int KIND>
__device__ void mm_float(const u8* w, int rows, int cols, const float* x, const u8* phases,
                         int ntok, float* out) {
    int tid = threadIdx.x;
    int r = blockIdx.x * (blockDim.x / 16) + tid / 16;
    int t16 = tid % 16;
    bool live = r < rows;
    const u8* row = w + (size_t)(live ? r : 0) * cols * (KIND == PD_KIND_F32 ? 4 : 2);
    int width = KIND == PD_KIND_BF16 ? 32 : 16;
    bool shape_tiles = cols % width == 0 && rows % 4 == 0;
    for (int t = 0; t < ntok; t++) {
        bool tiled = phases[t] == 0 && shape_tiles;
        float v = pd_dot_float<KIND>(row, x + (size_t)t * cols, cols, tiled, t16);
        if (live && t16 == 0) out[(size_t)t * rows + r] = v;
    }
}

extern "C" __global__ void mm_f32(const u8* w, int rows, int cols, const float* x,
                                  const u8* phases, int ntok, float* out) {
    mm_float<PD_KIND_F32>(w, rows, cols, x, phases, ntok, out);
}
extern "C" __global__ void mm_f16(const u8* w, int rows, int cols, const float* x,
                                  const u8* phases, int ntok, float* out) {
    mm_float<PD_KIND_F16>(w, rows, cols, x, phases, ntok, out);
}
extern "C" __global__ void mm_bf16(const u8* w, int rows, int cols, const float* x,
                                   const u8* phases, int ntok, float* out) {
    mm_float<PD_KIND_BF16>(w, rows, cols, x, phases, ntok, out);
}

// ---- Embedding lookup ----

// Row `tokens[t]` of a quantized table, dequantized: one thread per (token, block).
template <class F>
__device__ void embed_q(const u8* table, int row_bytes, const u32* tokens, int ntok, int cols,
                        float* out) {
    int nb = cols / F::BE;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ntok * nb) return;
    int t = i / nb, b = i % nb;
    const u8* blk = table + (size_t)tokens[t] * row_bytes + (size_t)b * F::BB;
    float* o = out + (size_t)t * cols + b * F::BE;
    for (int j = 0; j < F::BE; j++) o[j] = F::value(blk, j);
}

#define PD_EMBED_PARAMS const u8 *table, int row_bytes, const u32 *tokens, int ntok, int cols, float *out
#define PD_EMBED_ARGS table, row_bytes, tokens, ntok, cols, out

extern "C" __global__ void embed_q8_0(PD_EMBED_PARAMS) { embed_q<FmtQ8_0>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_q4_0(PD_EMBED_PARAMS) { embed_q<FmtQ4_0>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_q4_1(PD_EMBED_PARAMS) { embed_q<FmtQ4_1>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_q5_0(PD_EMBED_PARAMS) { embed_q<FmtQ5_0>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_q5_1(PD_EMBED_PARAMS) { embed_q<FmtQ5_1>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_q4_k(PD_EMBED_PARAMS) { embed_q<FmtQ4_K>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_q5_k(PD_EMBED_PARAMS) { embed_q<FmtQ5_K>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_q6_k(PD_EMBED_PARAMS) { embed_q<FmtQ6_K>(PD_EMBED_ARGS); }

template <int KIND>
__device__ void embed_float(const u8* table, int row_bytes, const u32* tokens, int ntok, int cols,
                            float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ntok * cols) return;
    int t = i / cols, c = i % cols;
    out[i] = pd_wat<KIND>(table + (size_t)tokens[t] * row_bytes, c);
}

extern "C" __global__ void embed_f32(PD_EMBED_PARAMS) { embed_float<PD_KIND_F32>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_f16(PD_EMBED_PARAMS) { embed_float<PD_KIND_F16>(PD_EMBED_ARGS); }
extern "C" __global__ void embed_bf16(PD_EMBED_PARAMS) { embed_float<PD_KIND_BF16>(PD_EMBED_ARGS); }
