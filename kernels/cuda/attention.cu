// The paged KV cache: writing a step's K and V rows into their slots, and causal attention of
// each query token over its sequence's blocks (block tables, GQA).
//
// Attention reproduces `cpu::ops::attend` operation for operation, so it agrees with the CPU
// bit for bit: q rounded to the KV type, scores `q·k` in the token phase's lane order, the
// maximum, llama.cpp's `exp` over 16-position chunks summed in f64, probabilities rounded to
// the KV type, and V accumulated into 16 (prompt) or 64 (generated) lane sets per dimension,
// folded in `reduce16`'s tree. Only f16 and f32 caches are computed here so far.
#include "common.cuh"

#define PD_MAX_HEAD_DIM 256
#define PD_ATTN_THREADS 64

// Where the caller's KV pool is and how it is laid out (`KvGeometry`).
struct KvPool {
    const u8* base;
    int f16;  // 1: f16 elements, 0: f32
    int layers, kv_heads, head_dim, block_size;

    // Element offset of row (block, layer, k/v, head, slot), as `KvGeometry::offset`.
    __device__ size_t offset(int block, int layer, int kv, int head, int slot) const {
        size_t rows_per_layer = (size_t)2 * kv_heads * block_size;
        size_t row = ((size_t)block * layers + layer) * rows_per_layer +
                     (size_t)(kv * kv_heads + head) * block_size + slot;
        return row * head_dim;
    }

    __device__ float at(size_t off) const {
        return f16 ? pd_f16_to_f32(((const u16*)base)[off]) : ((const float*)base)[off];
    }
};

// Writes token `i`'s K and V (`kv_heads × head_dim` each) into slot `slots[2i+1]` of block
// `slots[2i]`: one thread per element.
extern "C" __global__ void kv_write(u8* base, int f16, int layers, int kv_heads, int head_dim,
                                    int block_size, int layer, const float* k, const float* v,
                                    const u32* slots, int ntok) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int kvd = kv_heads * head_dim;
    if (i >= (long)ntok * kvd * 2) return;
    int which = int(i / ((long)ntok * kvd));
    long rest = i % ((long)ntok * kvd);
    int t = int(rest / kvd), e = int(rest % kvd);
    int h = e / head_dim, d = e % head_dim;
    KvPool pool{base, f16, layers, kv_heads, head_dim, block_size};
    size_t off = pool.offset(int(slots[2 * t]), layer, which, h, int(slots[2 * t + 1])) + d;
    float val = (which == 0 ? k : v)[(size_t)t * kvd + e];
    if (f16)
        ((u16*)base)[off] = pd_f32_to_f16(val);
    else
        ((float*)base)[off] = val;
}

// `q · k` of one head in the phase's order (`ops::qk_dot_lanes`): 16 lanes for prompt tokens,
// 4 × 16 plus an f64 tail for generated ones.
__device__ float pd_qk(const float* q, const KvPool& pool, size_t off, int hd, bool decode) {
    float c[16];
    for (int t = 0; t < 16; t++) c[t] = 0.0f;
    if (!decode) {
        for (int l = 0; l < hd; l += 16)
            for (int t = 0; t < 16; t++) c[t] = fmaf(pool.at(off + l + t), q[l + t], c[t]);
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
                s[j][t] = fmaf(pool.at(off + e), q[e], s[j][t]);
            }
    for (int t = 0; t < 16; t++) c[t] = (s[0][t] + s[2][t]) + (s[1][t] + s[3][t]);
    double sum = double(pd_reduce16(c));
    for (int i = np; i < hd; i++) sum += double(pool.at(off + i) * q[i]);
    return float(sum);
}

// One block per (query token, KV head); its query heads one after another. `tables` holds
// every query's block table, query `t`'s from `table_at[t]`; `scratch` gives each block
// `stride` floats of scores (`stride` ≥ the longest sequence, rounded up to 16) and
// `stride / 16` chunk sums.
extern "C" __global__ void attention(const u8* base, int f16, int layers, int kv_heads,
                                     int head_dim, int block_size, int layer, int heads,
                                     const float* q, const u32* pos, const u8* phases,
                                     const u32* tables, const u32* table_at, float* out,
                                     float* scratch, int stride) {
    __shared__ float qh[PD_MAX_HEAD_DIM];
    __shared__ float part[PD_ATTN_THREADS];
    __shared__ float shared_max;
    __shared__ float shared_inv;
    int t = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x, nthreads = blockDim.x;
    KvPool pool{base, f16, layers, kv_heads, head_dim, block_size};
    int hd = head_dim, group = heads / kv_heads;
    int n = int(pos[t]) + 1;
    bool decode = phases[t] != 0;
    int sets = decode ? 64 : 16;
    const u32* table = tables + table_at[t];
    float* p = scratch + ((size_t)t * kv_heads + kvh) * (stride + stride / 16);
    float* csum = p + stride;
    float scale = 1.0f / sqrtf(float(hd));
    int chunks = (n + 15) / 16;
    for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        const float* qsrc = q + ((size_t)t * heads + h) * hd;
        for (int d = tid; d < hd; d += nthreads) qh[d] = f16 ? pd_round_f16(qsrc[d]) : qsrc[d];
        __syncthreads();
        float m = __uint_as_float(0xff800000u);
        for (int j = tid; j < chunks * 16; j += nthreads) {
            if (j < n) {
                size_t off = pool.offset(int(table[j / block_size]), layer, 0, kvh, j % block_size);
                p[j] = pd_qk(qh, pool, off, hd, decode) * scale;
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
        for (int c = tid; c < chunks; c += nthreads) {
            float e[16];
            for (int k = 0; k < 16; k++) {
                int j = 16 * c + k;
                if (j < n) {
                    p[j] = pd_exp(p[j] - mx);
                    e[k] = p[j];
                } else {
                    e[k] = 0.0f;
                }
            }
            csum[c] = pd_reduce16(e);
        }
        __syncthreads();
        if (tid == 0) {
            double sum = 0.0;
            for (int c = 0; c < chunks; c++) sum += double(csum[c]);
            shared_inv = float(1.0 / sum);
        }
        __syncthreads();
        float inv = shared_inv;
        for (int j = tid; j < n; j += nthreads) {
            float v = p[j] * inv;
            p[j] = f16 ? pd_round_f16(v) : v;
        }
        __syncthreads();
        float* o = out + ((size_t)t * heads + h) * hd;
        for (int d = tid; d < hd; d += nthreads) {
            float r[64];
            for (int k = 0; k < sets; k++) r[k] = 0.0f;
            for (int j = 0; j < n; j++) {
                size_t off = pool.offset(int(table[j / block_size]), layer, 1, kvh, j % block_size);
                int set = j % sets;
                r[set] = fmaf(p[j], pool.at(off + d), r[set]);
            }
            if (decode) {
                for (int k = 0; k < 16; k++) {
                    r[k] = r[k] + r[32 + k];
                    r[16 + k] = r[16 + k] + r[48 + k];
                    r[k] = r[k] + r[16 + k];
                }
            }
            for (int i = 0; i < 8; i++) r[i] = r[i + 8] + r[i];
            for (int i = 0; i < 4; i++) r[i] = r[i] + r[i + 4];
            r[0] = r[0] + r[2];
            r[1] = r[1] + r[3];
            o[d] = r[0] + r[1];
        }
        __syncthreads();
    }
}
