// The paged KV cache: writing a step's K and V rows into their slots, and causal attention of
// each query token over its sequence's blocks (block tables, GQA).
//
// Attention over f16/f32 KV reproduces `cpu::ops::attend` operation for operation, so it agrees
// with the CPU bit for bit: q rounded to the KV type, scores `q·k` in the token phase's lane
// order, the maximum, llama.cpp's `exp` over 16-position chunks summed in f64, probabilities
// rounded to the KV type, and V accumulated into 16 (prompt) or 64 (generated) lane sets per
// dimension, folded in `reduce16`'s tree. Over q8_0 KV it reproduces `cpu::q8kv::attend_q8`
// (llama.cpp's CPU flash attention): q quantized to q8_0, integer block dots, an online softmax
// with glibc's `expf`, in position order.
#include "common.cuh"
#include "formats.cuh"

#define PD_MAX_HEAD_DIM 256
#define PD_ATTN_THREADS 64

#define PD_KV_F32 0
#define PD_KV_F16 1
#define PD_KV_Q8_0 2

// Where the caller's KV pool is and how it is laid out (`KvGeometry`).
struct KvPool {
    const u8* base;
    int dtype;  // PD_KV_*
    int layers, kv_heads, head_dim, block_size;

    // Index of row (block, layer, k/v, head, slot), as `KvGeometry::row`.
    __device__ size_t row(int block, int layer, int kv, int head, int slot) const {
        size_t rows_per_layer = (size_t)2 * kv_heads * block_size;
        return ((size_t)block * layers + layer) * rows_per_layer +
               (size_t)(kv * kv_heads + head) * block_size + slot;
    }

    // Element offset of a row of f16/f32 elements, as `KvGeometry::offset`.
    __device__ size_t offset(int block, int layer, int kv, int head, int slot) const {
        return row(block, layer, kv, head, slot) * head_dim;
    }

    // A q8_0 row's bytes.
    __device__ const u8* q8_row(int block, int layer, int kv, int head, int slot) const {
        return base + row(block, layer, kv, head, slot) * (size_t)(head_dim / 32 * 34);
    }

    __device__ float at(size_t off) const {
        return dtype == PD_KV_F16 ? pd_f16_to_f32(((const u16*)base)[off])
                                  : ((const float*)base)[off];
    }
};

// Writes token `i`'s K and V (`kv_heads × head_dim` each) into slot `slots[2i+1]` of block
// `slots[2i]`: one thread per element.
extern "C" __global__ void kv_write(u8* base, int dtype, int layers, int kv_heads, int head_dim,
                                    int block_size, int layer, const float* k, const float* v,
                                    const u32* slots, int ntok) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int kvd = kv_heads * head_dim;
    if (i >= (long)ntok * kvd * 2) return;
    int which = int(i / ((long)ntok * kvd));
    long rest = i % ((long)ntok * kvd);
    int t = int(rest / kvd), e = int(rest % kvd);
    int h = e / head_dim, d = e % head_dim;
    KvPool pool{base, dtype, layers, kv_heads, head_dim, block_size};
    size_t off = pool.offset(int(slots[2 * t]), layer, which, h, int(slots[2 * t + 1])) + d;
    float val = (which == 0 ? k : v)[(size_t)t * kvd + e];
    if (dtype == PD_KV_F16)
        ((u16*)base)[off] = pd_f32_to_f16(val);
    else
        ((float*)base)[off] = val;
}

// `rope` of Q and K, then K and V stored as `kv_write` stores them, in one pass: one thread
// per (token, head, pair) of Q; those of the first `kv_heads` heads also rotate their K pair
// and store it with the V pair, so K never goes back to memory unstored. f16/f32 KV (a q8_0
// cache rotates K and V by Hadamard matrices first). The same operations as the two kernels.
extern "C" __global__ void rope_kv_write(u8* base, int dtype, int layers, int kv_heads,
                                         int head_dim, int block_size, int layer, float* q,
                                         const float* k, const float* v, const u32* slots,
                                         int ntok, int heads, const float* cos_t,
                                         const float* sin_t, int neox) {
    int half = head_dim / 2;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)ntok * heads * half) return;
    int p = int(i % half);
    long th = i / half;
    int t = int(th / heads), h = int(th % heads);
    float c = cos_t[(size_t)t * half + p], s = sin_t[(size_t)t * half + p];
    int a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
    float* qh = q + th * head_dim;
    pd_rotate(qh + a, qh + b, c, s);
    if (h >= kv_heads) return;
    size_t row = (size_t)t * kv_heads * head_dim + (size_t)h * head_dim;
    float vals[4] = {k[row + a], k[row + b], v[row + a], v[row + b]};
    pd_rotate(vals, vals + 1, c, s);
    KvPool pool{base, dtype, layers, kv_heads, head_dim, block_size};
    int blk = int(slots[2 * t]), slot = int(slots[2 * t + 1]);
    size_t ko = pool.offset(blk, layer, 0, h, slot), vo = pool.offset(blk, layer, 1, h, slot);
    size_t offs[4] = {ko + a, ko + b, vo + a, vo + b};
    for (int j = 0; j < 4; j++) {
        if (dtype == PD_KV_F16)
            ((u16*)base)[offs[j]] = pd_f32_to_f16(vals[j]);
        else
            ((float*)base)[offs[j]] = vals[j];
    }
}

// Quantizes `n` values into q8_0 blocks as `cpu::q8kv::quantize_row_q8_0` (the activation
// quantizer's rounding; the f16 scale stored, the scaled sum dropped).
__device__ void pd_quantize_q8_0_block(const float* x, u8* out) {
    int sum;
    u16 d = pd_f32_to_f16(pd_quantize_block32(x, (i8*)(out + 2), &sum));
    out[0] = u8(d & 0xff);
    out[1] = u8(d >> 8);
}

// q8_0 KV: one thread per 32-value block of token `i`'s K or V head row.
extern "C" __global__ void kv_write_q8(u8* base, int dtype, int layers, int kv_heads,
                                       int head_dim, int block_size, int layer, const float* k,
                                       const float* v, const u32* slots, int ntok) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int per_row = head_dim / 32;
    int kvd = kv_heads * head_dim;
    long per_tok = (long)kv_heads * per_row;
    if (i >= (long)ntok * per_tok * 2) return;
    int which = int(i / ((long)ntok * per_tok));
    long rest = i % ((long)ntok * per_tok);
    int t = int(rest / per_tok), hb = int(rest % per_tok);
    int h = hb / per_row, b = hb % per_row;
    KvPool pool{base, dtype, layers, kv_heads, head_dim, block_size};
    u8* row = (u8*)pool.q8_row(int(slots[2 * t]), layer, which, h, int(slots[2 * t + 1]));
    const float* src = (which == 0 ? k : v) + (size_t)t * kvd + h * head_dim + b * 32;
    pd_quantize_q8_0_block(src, row + b * 34);
}

// A K row in the pool, as `pd_qk` reads it.
struct PdPoolRow {
    const KvPool& pool;
    size_t off;
    __device__ float operator()(int e) const { return pool.at(off + e); }
};

// A K row copied into shared memory (as f32).
struct PdSharedRow {
    const float* k;
    __device__ float operator()(int e) const { return k[e]; }
};

// `q · k` of one head in the phase's order (`ops::qk_dot_lanes`): 16 lanes for prompt tokens,
// 4 × 16 plus an f64 tail for generated ones.
template <class Row>
__device__ float pd_qk(const float* q, const Row& k, int hd, bool decode) {
    float c[16];
    for (int t = 0; t < 16; t++) c[t] = 0.0f;
    if (!decode) {
        for (int l = 0; l < hd; l += 16)
            for (int t = 0; t < 16; t++) c[t] = fmaf(k(l + t), q[l + t], c[t]);
        return pd_reduce16(c);
    }
    float s[4][16];
    for (int j = 0; j < 4; j++)
        for (int t = 0; t < 16; t++) s[j][t] = 0.0f;
    int np = hd & ~63;
    for (int i = 0; i < np; i += 64)
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 16; t++) {
                int e = i + 16 * j + t;
                s[j][t] = fmaf(k(e), q[e], s[j][t]);
            }
    for (int t = 0; t < 16; t++) c[t] = (s[0][t] + s[2][t]) + (s[1][t] + s[3][t]);
    double sum = double(pd_reduce16(c));
    for (int i = np; i < hd; i++) sum += double(k(i) * q[i]);
    return float(sum);
}

// Chunk `c` of a query's scores `lo..n` turned into `exp(score - mx)` in place, and their sum
// as `ops::attend` forms it (16 lanes, zeros outside `lo..n`; the masked ones before `lo`
// written as zeros).
__device__ float pd_exp_chunk(float* p, int c, int lo, int n, float mx) {
    float e[16];
    for (int k = 0; k < 16; k++) {
        int j = 16 * c + k;
        if (j >= lo && j < n) {
            p[j] = pd_exp(p[j] - mx);
            e[k] = p[j];
        } else {
            if (j < n) p[j] = 0.0f;
            e[k] = 0.0f;
        }
    }
    return pd_reduce16(e);
}

// Folds the weighted-V accumulators of one output value as `ops::attend` does: 64 sets for a
// generated token, 16 for a prompt token.
__device__ __forceinline__ float pd_fold_sets(float* r, bool decode) {
    if (decode) {
#pragma unroll
        for (int k = 0; k < 16; k++) {
            r[k] = r[k] + r[32 + k];
            r[16 + k] = r[16 + k] + r[48 + k];
            r[k] = r[k] + r[16 + k];
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) r[i] = r[i + 8] + r[i];
#pragma unroll
    for (int i = 0; i < 4; i++) r[i] = r[i] + r[i + 4];
    r[0] = r[0] + r[2];
    r[1] = r[1] + r[3];
    return r[0] + r[1];
}

// Element `d` of `Σ_j p[j]·V[j]` over a query's `n` positions, as `ops::attend` sums it: in
// `SETS` accumulators (position j into set j % SETS, in increasing j; 64 for a generated
// token, 16 for a prompt token), then folded. The set count is a template parameter and the
// inner loop unrolled so that the accumulators are registers: with a runtime count and
// `r[j % sets]`, ptxas kept them in local memory (a 256-byte stack frame).
template <int SETS>
__device__ float pd_weighted_v(const float* p, int lo, int n, const KvPool& pool,
                               const u32* table, int block_size, int layer, int kvh, int d) {
    float r[SETS];
#pragma unroll
    for (int k = 0; k < SETS; k++) r[k] = 0.0f;
    // Masked positions add exact zeros: the loop starts at the window, keeping each
    // position's set.
    for (int j0 = lo / SETS * SETS; j0 < n; j0 += SETS) {
#pragma unroll
        for (int k = 0; k < SETS; k++) {
            int j = j0 + k;
            if (j >= n) break;
            if (j < lo) continue;
            size_t off = pool.offset(int(table[j / block_size]), layer, 1, kvh, j % block_size);
            r[k] = fmaf(p[j], pool.at(off + d), r[k]);
        }
    }
    return pd_fold_sets(r, SETS == 64);
}

// One block per (query token, KV head); its query heads one after another. `tables` holds
// every query's block table, query `t`'s from `table_at[t]`; `scratch` gives each block
// `stride` floats of scores (`stride` ≥ the longest sequence, rounded up to 16) and
// `stride / 16` chunk sums.
extern "C" __global__ void attention(const u8* base, int dtype, int layers, int kv_heads,
                                     int head_dim, int block_size, int layer, int heads,
                                     float scale, const float* q, const u32* pos,
                                     const u32* firsts, const u8* phases, const u32* tables,
                                     const u32* table_at, float* out, float* scratch,
                                     int stride) {
    __shared__ float qh[PD_MAX_HEAD_DIM];
    __shared__ float part[PD_ATTN_THREADS];
    __shared__ float shared_max;
    __shared__ float shared_inv;
    int t = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x, nthreads = blockDim.x;
    KvPool pool{base, dtype, layers, kv_heads, head_dim, block_size};
    bool f16 = dtype == PD_KV_F16;
    int hd = head_dim, group = heads / kv_heads;
    int n = int(pos[t]) + 1, lo = int(firsts[t]);
    bool decode = phases[t] != 0;
    const u32* table = tables + table_at[t];
    float* p = scratch + ((size_t)t * kv_heads + kvh) * (stride + stride / 16);
    float* csum = p + stride;
    int chunks = (n + 15) / 16, c0 = lo / 16;
    for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        const float* qsrc = q + ((size_t)t * heads + h) * hd;
        for (int d = tid; d < hd; d += nthreads) qh[d] = f16 ? pd_round_f16(qsrc[d]) : qsrc[d];
        __syncthreads();
        float m = __uint_as_float(0xff800000u);
        for (int j = c0 * 16 + tid; j < chunks * 16; j += nthreads) {
            if (j >= lo && j < n) {
                size_t off = pool.offset(int(table[j / block_size]), layer, 0, kvh, j % block_size);
                p[j] = pd_qk(qh, PdPoolRow{pool, off}, hd, decode) * scale;
                m = fmaxf(m, p[j]);
            } else {
                p[j] = 0.0f;
            }
        }
        part[tid] = m;
        __syncthreads();
        if (tid == 0) {
            float mx = __uint_as_float(0xff800000u);
            for (int i = 0; i < nthreads; i++) mx = fmaxf(mx, part[i]);
            shared_max = mx;
        }
        __syncthreads();
        float mx = shared_max;
        for (int c = c0 + tid; c < chunks; c += nthreads) csum[c] = pd_exp_chunk(p, c, lo, n, mx);
        __syncthreads();
        if (tid == 0) {
            double sum = 0.0;
            for (int c = c0; c < chunks; c++) sum += double(csum[c]);
            shared_inv = float(1.0 / sum);
        }
        __syncthreads();
        float inv = shared_inv;
        for (int j = lo + tid; j < n; j += nthreads) {
            float v = p[j] * inv;
            p[j] = f16 ? pd_round_f16(v) : v;
        }
        __syncthreads();
        float* o = out + ((size_t)t * heads + h) * hd;
        for (int d = tid; d < hd; d += nthreads) {
            o[d] = decode ? pd_weighted_v<64>(p, lo, n, pool, table, block_size, layer, kvh, d)
                          : pd_weighted_v<16>(p, lo, n, pool, table, block_size, layer, kvh, d);
        }
        __syncthreads();
    }
}

#define PD_TILE 16

// K (`which` 0) or V (1) rows of positions `at .. at + 16` into `tile` as f32, zeros outside
// `from .. len` (the rows before a window may be gone): the block's threads share the work.
__device__ void pd_load_tile(float* tile, const KvPool& pool, const u32* table, int layer,
                             int which, int kvh, int at, int from, int len) {
    int hd = pool.head_dim, bs = pool.block_size;
    for (int i = threadIdx.x; i < PD_TILE * hd; i += blockDim.x) {
        int j = at + i / hd;
        bool in = j >= from && j < len;
        size_t off = in ? pool.offset(int(table[j / bs]), layer, which, kvh, j % bs) : 0;
        tile[i] = in ? pool.at(off + i % hd) : 0.0f;
    }
}

// `pd_weighted_v` for `attention_tiled`: V tile by tile through shared memory (`kv`, which the
// whole block loads, live thread or not). Position `16·kc + jj` goes to set
// `(16·kc + jj) % SETS`, that is `16·(kc % (SETS/16)) + jj`: the tiles are taken SETS/16 at a
// time, unrolled, so every set index is a constant and the sets stay in registers.
template <int SETS>
__device__ float pd_tiled_weighted_v(const float* p, int lo, int n, bool live, int d, int hd,
                                     float* kv, const KvPool& pool, const u32* table, int layer,
                                     int kvh, int kstart, int kchunks, int earliest,
                                     int longest) {
    float r[SETS];
#pragma unroll
    for (int k = 0; k < SETS; k++) r[k] = 0.0f;
    // From the group of tiles holding the earliest window's start, so that every position
    // keeps its set; positions before a query's window add exact zeros and are skipped.
    for (int kc0 = kstart / (SETS / 16) * (SETS / 16); kc0 < kchunks; kc0 += SETS / 16) {
#pragma unroll
        for (int q = 0; q < SETS / 16; q++) {
            int kc = kc0 + q;
            if (kc >= kchunks) break;
            if (kc < kstart) continue;
            __syncthreads();
            pd_load_tile(kv, pool, table, layer, 1, kvh, kc * 16, earliest, longest);
            __syncthreads();
            if (!live) continue;
#pragma unroll
            for (int jj = 0; jj < 16; jj++) {
                int j = kc * 16 + jj;
                if (j >= n) break;
                if (j < lo) continue;
                r[16 * q + jj] = fmaf(p[j], kv[jj * hd + d], r[16 * q + jj]);
            }
        }
    }
    return pd_fold_sets(r, SETS == 64);
}

// `attention` for tiles of queries of one sequence and phase (consecutive positions), as
// flash attention tiles the work: the block loads 16 keys (then 16 values) at a time into
// shared memory once for all of its up to 16 queries, where `attention` reads every K and V
// row once per query. Each query's scores still go to `scratch` and its softmax takes the
// maximum first, as the CPU does, instead of flash attention's running rescale, which would
// round differently; every sum keeps `attention`'s order, so the results are its bits.
// `tiles` holds (first query, count) per block; f16/f32 KV.
extern "C" __global__ void attention_tiled(const u8* base, int dtype, int layers, int kv_heads,
                                           int head_dim, int block_size, int layer, int heads,
                                           float scale, const float* q, const u32* pos,
                                           const u32* firsts, const u8* phases,
                                           const u32* tables, const u32* table_at, float* out,
                                           float* scratch, int stride, const u32* tiles) {
    __shared__ float qs[PD_TILE * PD_MAX_HEAD_DIM];
    __shared__ float kv[PD_TILE * PD_MAX_HEAD_DIM];
    __shared__ float inv[PD_TILE];
    int kvh = blockIdx.y, tid = threadIdx.x, nthreads = blockDim.x;
    int first = int(tiles[2 * blockIdx.x]), count = int(tiles[2 * blockIdx.x + 1]);
    KvPool pool{base, dtype, layers, kv_heads, head_dim, block_size};
    bool f16 = dtype == PD_KV_F16;
    int hd = head_dim, group = heads / kv_heads;
    bool decode = phases[first] != 0;
    const u32* table = tables + table_at[first];
    int longest = 0, earliest = int(firsts[first]);
    for (int i = 0; i < count; i++) {
        longest = pd_max(longest, int(pos[first + i]) + 1);
        earliest = pd_min(earliest, int(firsts[first + i]));
    }
    int kchunks = (longest + 15) / 16, kstart = earliest / 16;
    size_t per_query = (size_t)stride + stride / 16;
#define PD_SCORES(i) (scratch + ((size_t)(first + (i)) * kv_heads + kvh) * per_query)
    for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        for (int i = tid; i < count * hd; i += nthreads) {
            int qi = i / hd, d = i % hd;
            float x = q[((size_t)(first + qi) * heads + h) * hd + d];
            qs[qi * hd + d] = f16 ? pd_round_f16(x) : x;
        }
        // Scores, 16 keys at a time.
        for (int kc = kstart; kc < kchunks; kc++) {
            __syncthreads();
            pd_load_tile(kv, pool, table, layer, 0, kvh, kc * 16, earliest, longest);
            __syncthreads();
            for (int i = tid; i < count * PD_TILE; i += nthreads) {
                int qi = i / PD_TILE, j = kc * 16 + i % PD_TILE;
                int n = int(pos[first + qi]) + 1, lo = int(firsts[first + qi]);
                float* p = PD_SCORES(qi);
                if (j >= lo && j < n)
                    p[j] = pd_qk(qs + qi * hd, PdSharedRow{kv + (j % 16) * hd}, hd, decode) * scale;
                else if (j < (n + 15) / 16 * 16)
                    p[j] = 0.0f;
            }
        }
        __syncthreads();
        // Each query's softmax: its maximum, then exponentials summed in chunks of 16.
        for (int qi = tid; qi < count; qi += nthreads) {
            int n = int(pos[first + qi]) + 1, chunks = (n + 15) / 16;
            int lo = int(firsts[first + qi]);
            float* p = PD_SCORES(qi);
            float* csum = p + stride;
            float mx = __uint_as_float(0xff800000u);
            for (int j = lo; j < n; j++) mx = fmaxf(mx, p[j]);
            double sum = 0.0;
            for (int c = lo / 16; c < chunks; c++) {
                csum[c] = pd_exp_chunk(p, c, lo, n, mx);
                sum += double(csum[c]);
            }
            inv[qi] = float(1.0 / sum);
        }
        __syncthreads();
        for (int i = tid; i < count * longest; i += nthreads) {
            int qi = i / longest, j = i % longest;
            if (j >= int(firsts[first + qi]) && j <= int(pos[first + qi])) {
                float* p = PD_SCORES(qi);
                float v = p[j] * inv[qi];
                p[j] = f16 ? pd_round_f16(v) : v;
            }
        }
        // Weighted values, 16 at a time, for `nthreads` (query, element) pairs per round.
        for (int r0 = 0; r0 < count * hd; r0 += nthreads) {
            int pair = r0 + tid;
            bool live = pair < count * hd;
            int qi = live ? pair / hd : 0, d = pair % hd;
            int n = int(pos[first + qi]) + 1, lo = int(firsts[first + qi]);
            const float* p = PD_SCORES(qi);
            // `decode` is the block's: every thread takes the same branch to its barriers.
            float v = decode ? pd_tiled_weighted_v<64>(p, lo, n, live, d, hd, kv, pool, table,
                                                       layer, kvh, kstart, kchunks, earliest,
                                                       longest)
                             : pd_tiled_weighted_v<16>(p, lo, n, live, d, hd, kv, pool, table,
                                                       layer, kvh, kstart, kchunks, earliest,
                                                       longest);
            if (live) out[((size_t)(first + qi) * heads + h) * hd + d] = v;
        }
        __syncthreads();
    }
#undef PD_SCORES
}

// Threads of an `attention_flash` block, and the outputs (query, element) each keeps: a
// tile's 16 queries × up to 256 elements.
#define PD_FLASH_THREADS 256
#define PD_FLASH_OUTS (PD_TILE * PD_MAX_HEAD_DIM / PD_FLASH_THREADS)

// `attention_tiled`'s tiles with flash attention's running softmax (opt-in: `--cuda-flash`).
// A tile's scores exist only 16 keys at a time, in shared memory; each query keeps a running
// maximum and sum, and its outputs stay in registers, rescaled by `exp(old max - new max)`
// whenever the maximum grows. So no scores go through global memory and K and V are read
// once per tile, in one pass. It rounds differently from the CPU (each `exp(s - max)` as a
// product of rescales, probabilities kept in f32, the division last, prompt-order dots for
// every query), so `cuda_backend.rs` holds it to a bound instead of bits. f16/f32 KV;
// launched with `PD_FLASH_THREADS` threads, which `PD_FLASH_OUTS` assumes.
extern "C" __global__ void attention_flash(const u8* base, int dtype, int layers, int kv_heads,
                                           int head_dim, int block_size, int layer, int heads,
                                           float scale, const float* q, const u32* pos,
                                           const u32* firsts, const u32* tables,
                                           const u32* table_at, float* out, const u32* tiles) {
    __shared__ float qs[PD_TILE * PD_MAX_HEAD_DIM];
    __shared__ float kv[PD_TILE * PD_MAX_HEAD_DIM];
    // A tile's scores, then its probabilities: [query][key].
    __shared__ float pr[PD_TILE * PD_TILE];
    __shared__ float run_max[PD_TILE], run_sum[PD_TILE], rescale[PD_TILE];
    int kvh = blockIdx.y, tid = threadIdx.x, nthreads = blockDim.x;
    int first = int(tiles[2 * blockIdx.x]), count = int(tiles[2 * blockIdx.x + 1]);
    KvPool pool{base, dtype, layers, kv_heads, head_dim, block_size};
    bool f16 = dtype == PD_KV_F16;
    int hd = head_dim, group = heads / kv_heads, outs = count * hd;
    const u32* table = tables + table_at[first];
    int longest = 0, earliest = int(firsts[first]);
    for (int i = 0; i < count; i++) {
        longest = pd_max(longest, int(pos[first + i]) + 1);
        earliest = pd_min(earliest, int(firsts[first + i]));
    }
    int kchunks = (longest + 15) / 16;
    const float neg_inf = __uint_as_float(0xff800000u);
    for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        for (int i = tid; i < outs; i += nthreads) {
            float x = q[((size_t)(first + i / hd) * heads + h) * hd + i % hd];
            qs[i] = f16 ? pd_round_f16(x) : x;
        }
        for (int qi = tid; qi < count; qi += nthreads) {
            run_max[qi] = neg_inf;
            run_sum[qi] = 0.0f;
        }
        float o[PD_FLASH_OUTS];
#pragma unroll
        for (int r = 0; r < PD_FLASH_OUTS; r++) o[r] = 0.0f;
        for (int kc = earliest / 16; kc < kchunks; kc++) {
            __syncthreads();
            pd_load_tile(kv, pool, table, layer, 0, kvh, kc * 16, earliest, longest);
            __syncthreads();
            for (int i = tid; i < count * PD_TILE; i += nthreads) {
                int qi = i / PD_TILE, j = kc * 16 + i % PD_TILE;
                bool seen = j >= int(firsts[first + qi]) && j <= int(pos[first + qi]);
                pr[i] = seen ? pd_qk(qs + qi * hd, PdSharedRow{kv + (j % 16) * hd}, hd, false) *
                                   scale
                             : neg_inf;
            }
            __syncthreads();
            // `pd_exp(-inf)` is 0, for masked keys and the first rescale alike; a query none
            // of whose keys so far is in its window (a later window in the tile) keeps an
            // infinite maximum, and adds nothing yet.
            for (int qi = tid; qi < count; qi += nthreads) {
                float* s = pr + qi * PD_TILE;
                float m = run_max[qi];
                for (int jj = 0; jj < PD_TILE; jj++) m = fmaxf(m, s[jj]);
                bool none = m == neg_inf;
                float a = none ? 1.0f : pd_exp(run_max[qi] - m), sum = 0.0f;
                for (int jj = 0; jj < PD_TILE; jj++) {
                    s[jj] = none ? 0.0f : pd_exp(s[jj] - m);
                    sum += s[jj];
                }
                run_sum[qi] = fmaf(run_sum[qi], a, sum);
                run_max[qi] = m;
                rescale[qi] = a;
            }
            __syncthreads();
            pd_load_tile(kv, pool, table, layer, 1, kvh, kc * 16, earliest, longest);
            __syncthreads();
#pragma unroll
            for (int r = 0; r < PD_FLASH_OUTS; r++) {
                int i = tid + r * PD_FLASH_THREADS;
                if (i >= outs) break;
                int qi = i / hd, d = i % hd;
                const float* p = pr + qi * PD_TILE;
                float acc = o[r] * rescale[qi];
                for (int jj = 0; jj < PD_TILE; jj++) acc = fmaf(p[jj], kv[jj * hd + d], acc);
                o[r] = acc;
            }
        }
#pragma unroll
        for (int r = 0; r < PD_FLASH_OUTS; r++) {
            int i = tid + r * PD_FLASH_THREADS;
            if (i >= outs) break;
            int qi = i / hd;
            out[((size_t)(first + qi) * heads + h) * hd + i % hd] = o[r] / run_sum[qi];
        }
        __syncthreads();
    }
}

// glibc's `__exp2f_data.tab`: `bits(2^(i/32)) - (i << 47)`.
__constant__ u64 PD_EXP2F_TABLE[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

__device__ __forceinline__ double pd_u64_as_double(u64 b) { return __longlong_as_double((long long)b); }

__device__ __forceinline__ u64 pd_double_as_u64(double d) {
    return (u64)__double_as_longlong(d);
}

// glibc 2.36's `expf` (its FMA variant): `cpu::q8kv::glibc_expf`, step for step.
__device__ float pd_glibc_expf(float x) {
    const double inv_ln2_n = pd_u64_as_double(0x40471547652b82feull);
    const double shift = pd_u64_as_double(0x4338000000000000ull);
    const double c0 = pd_u64_as_double(0x3ebc6af84b912394ull);
    const double c1 = pd_u64_as_double(0x3f2ebfce50fac4f3ull);
    const double c2 = pd_u64_as_double(0x3f962e42ff0c52d6ull);
    u32 b = __float_as_uint(x);
    if (((b >> 20) & 0x7ff) >= 0x42b) {
        if (b == 0xff800000u) return 0.0f;
        if (((b >> 20) & 0x7ff) >= 0x7f8) return x + x;
        if (x > __uint_as_float(0x42b17217u)) return __uint_as_float(0x7f800000u);
        if (x < __uint_as_float(0xc2cff1b4u)) return 0.0f;
        if (x < __uint_as_float(0xc2ce8ecfu)) return __uint_as_float(1u);
    }
    double xd = double(x);
    double kd = fma(inv_ln2_n, xd, shift);
    u64 ki = pd_double_as_u64(kd);
    kd = kd - shift;
    double r = fma(inv_ln2_n, xd, -kd);
    double s = pd_u64_as_double(PD_EXP2F_TABLE[ki & 31] + (ki << 47));
    double z = fma(c0, r, c1);
    double r2 = r * r;
    double y = fma(c2, r, 1.0);
    y = fma(z, r2, y);
    return float(y * s);
}

// A quantized query's blocks: q8_0's 34 bytes each at 2 bytes into a 36-byte slot, so that
// the quants start 4-byte aligned — the activation side of a lane reads them as one int, and
// a GPU faults on a misaligned one (x86, and so the emulator, would not notice).
#define PD_Q8_SLOT 36

// `Σ k·q` over a q8_0 K row of `nb` blocks and a query in `PD_Q8_SLOT` slots
// (`cpu::q8kv::dot_q8_0`): K as the weight, q as the activation, eight lane accumulators,
// `hsum8`.
__device__ float pd_dot_q8_0(const u8* k, const u8* q, int nb) {
    float acc[8];
    for (int l = 0; l < 8; l++) acc[l] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const u8* kb = k + b * 34;
        const u8* qb = q + b * PD_Q8_SLOT + 2;
        float dd = pd_f16_at(kb) * pd_f16_at(qb);
        for (int l = 0; l < 8; l++)
            acc[l] = fmaf(dd, float(FmtQ8_0::lane(kb, (const i8*)(qb + 2), nullptr, l)), acc[l]);
    }
    return pd_hsum8(acc);
}

// Attention over q8_0 KV (see the top of the file): one block per (query token, KV head), its
// query heads one after another; scores in `scratch` as `attention`'s. Every thread runs the
// online softmax's scalar recurrence itself (the same values in each), and keeps the output
// accumulator of its own dimensions.
extern "C" __global__ void attention_q8(const u8* base, int dtype, int layers, int kv_heads,
                                        int head_dim, int block_size, int layer, int heads,
                                        float scale, const float* q, const u32* pos,
                                        const u32* firsts, const u8* phases, const u32* tables,
                                        const u32* table_at, float* out, float* scratch,
                                        int stride) {
    // Words, for the slots' alignment.
    __shared__ u32 qq_words[PD_MAX_HEAD_DIM / 32 * PD_Q8_SLOT / 4];
    u8* qq = (u8*)qq_words;
    int t = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x, nthreads = blockDim.x;
    KvPool pool{base, dtype, layers, kv_heads, head_dim, block_size};
    int hd = head_dim, group = heads / kv_heads, nb = hd / 32;
    // Keys before the window are skipped, as llama.cpp's flash attention skips a masked one.
    int n = int(pos[t]) + 1, lo = int(firsts[t]);
    const u32* table = tables + table_at[t];
    float* p = scratch + ((size_t)t * kv_heads + kvh) * (stride + stride / 16);
    for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        const float* qsrc = q + ((size_t)t * heads + h) * hd;
        for (int b = tid; b < nb; b += nthreads)
            pd_quantize_q8_0_block(qsrc + b * 32, qq + b * PD_Q8_SLOT + 2);
        __syncthreads();
        for (int j = lo + tid; j < n; j += nthreads) {
            const u8* k = pool.q8_row(int(table[j / block_size]), layer, 0, kvh, j % block_size);
            // `+ 0.0f` is llama.cpp's mask add: it turns a -0 score into +0.
            p[j] = pd_dot_q8_0(k, qq, nb) * scale + 0.0f;
        }
        __syncthreads();
        float* o = out + ((size_t)t * heads + h) * hd;
        for (int d0 = 0; d0 < hd; d0 += nthreads) {
            int d = d0 + tid;
            float m = __uint_as_float(0xff800000u), s = 0.0f, acc = 0.0f;
            for (int j = lo; j < n; j++) {
                float sj = p[j], ms = 1.0f, vs = 1.0f;
                if (sj > m) {
                    float old = m;
                    m = sj;
                    ms = pd_glibc_expf(old - sj);
                    if (ms != 1.0f) acc *= ms;
                } else {
                    vs = pd_glibc_expf(sj - m);
                }
                if (d < hd) {
                    const u8* vr =
                        pool.q8_row(int(table[j / block_size]), layer, 1, kvh, j % block_size);
                    float v = float(i8(vr[(d / 32) * 34 + 2 + d % 32])) * pd_f16_at(vr + (d / 32) * 34);
                    acc = fmaf(v, vs, acc);
                }
                s = fmaf(s, ms, vs);
            }
            float inv = s == 0.0f ? 0.0f : 1.0f / s;
            if (d < hd) o[d] = acc * inv;
        }
        __syncthreads();
    }
}
