// The element-wise steps of the llama block and the quantizers of the matmuls' inputs, each
// computing every value with the CPU backend's float operations in its order (`cpu::ops`,
// `quant::quantize_block*`), except `rms_norm`'s sum of squares (see there).
#include "common.cuh"

// The RMSNorm scale of row `xr` (`n` values), the lanes of one warp together (every lane
// must call it: the sum goes through shuffles).
__device__ float pd_rms_scale(const float* xr, int n, int lane, float eps) {
    double sum = 0.0;
    for (int i = lane; i < n; i += 32) sum += double(xr[i] * xr[i]);
    for (int m = 16; m >= 1; m /= 2) sum += __shfl_xor_sync(PD_FULL_MASK, sum, m);
    float mean = float(sum / double(n));
    return 1.0f / sqrtf(mean + eps);
}

// `out[t] = x[t] / rms(x[t]) * weight`, one warp per row. The CPU sums the squares one after
// another in f64; here each lane sums every 32nd square in f64 and a shuffle tree adds the
// lanes. Both are within a few f64 ulps of the exact sum, far below the f32 the mean is rounded
// to, so the results agree except when the two sums straddle an f32 rounding boundary (then by
// one f32 ulp of the row's scale).
extern "C" __global__ void rms_norm(const float* x, const float* weight, int rows, int n, float eps,
                                    float* out) {
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    bool live = r < rows;
    const float* xr = x + (size_t)(live ? r : 0) * n;
    float scale = pd_rms_scale(xr, n, lane, eps);
    if (!live) return;
    float* o = out + (size_t)r * n;
    for (int i = lane; i < n; i += 32) o[i] = (xr[i] * scale) * weight[i];
}

// `rms_norm` then `quantize_q8` of each row in one pass, one warp per row as `rms_norm`: after
// the row's scale, each lane normalizes whole 32-blocks into `out` and quantizes them as
// `quantize_q8` does, while they are in cache. `n` is a multiple of 32.
extern "C" __global__ void rms_norm_q8(const float* x, const float* weight, int rows, int n,
                                       float eps, float* out, i8* qs, float* d, float* s) {
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    bool live = r < rows;
    const float* xr = x + (size_t)(live ? r : 0) * n;
    float scale = pd_rms_scale(xr, n, lane, eps);
    if (!live) return;
    float* o = out + (size_t)r * n;
    for (int c = lane * 32; c < n; c += 32 * 32) {
        for (int i = c; i < c + 32; i++) o[i] = (xr[i] * scale) * weight[i];
        size_t b = ((size_t)r * n + c) / 32;
        int bsum;
        float dd = pd_quantize_block32(o + c, qs + b * 32, &bsum);
        d[b] = pd_round_f16(dd);
        s[b] = pd_round_f16(dd * float(bsum));
    }
}

// RoPE over `ntok` rows of `heads × head_dim`: one thread per (token, head, pair). Normal mode
// rotates adjacent pairs, NeoX pairs `(i, i + head_dim/2)`; the first products fused, the
// second rounded, as GCC compiles llama.cpp's `rotate_pairs`.
extern "C" __global__ void rope(float* x, int ntok, int heads, int head_dim, const float* cos_t,
                                const float* sin_t, int neox) {
    int half = head_dim / 2;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)ntok * heads * half) return;
    int p = int(i % half);
    long th = i / half;
    int t = int(th / heads);
    float* head = x + th * head_dim;
    float c = cos_t[(size_t)t * half + p], s = sin_t[(size_t)t * half + p];
    int a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
    pd_rotate(head + a, head + b, c, s);
}

extern "C" __global__ void swiglu(const float* gate, const float* up, long n, float* out) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pd_silu(gate[i]) * up[i];
}

// `out = gelu(gate) * up` as llama.cpp's CPU computes it (`cpu::ops::geglu`): `table` holds
// GELU at every f16 input (`cpu::ops::gelu_table`), looked up by the input rounded to f16.
extern "C" __global__ void geglu(const float* gate, const float* up, long n, const float* table,
                                 float* out) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    if (g <= -10.0f)
        out[i] = 0.0f;
    else
        out[i] = (g >= 10.0f ? g : table[pd_f32_to_f16(g)]) * up[i];
}

extern "C" __global__ void scale_f32(float* x, long n, float s) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}

// `dst = src`: a copy on the device that a graph can hold (a `cuMemcpy` would end one).
extern "C" __global__ void copy_f32(const float* src, long n, float* dst) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

extern "C" __global__ void add_assign(float* x, const float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// Adds `bias` (`width` values) to every row of `x`.
extern "C" __global__ void add_rows(float* x, const float* bias, long n, int width) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % width];
}

// `out[k] = x[rows[k]]`, rows of `width` values.
extern "C" __global__ void gather_rows(const float* x, const u32* rows, int nrows, int width,
                                       float* out) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)nrows * width) return;
    int k = int(i / width), c = int(i % width);
    out[i] = x[(size_t)rows[k] * width + c];
}

// The Hadamard transform of each run of `n` values scaled by 1/√n, butterflies in
// `q8kv::fwht`'s order: one thread per run.
extern "C" __global__ void fwht(float* x, long runs, int n) {
    long r = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= runs) return;
    float* v = x + r * n;
    float sc = 1.0f / sqrtf(float(n));
    for (int i = 0; i < n; i++) v[i] *= sc;
    for (int len = 1; len < n; len *= 2)
        for (int base = 0; base < n; base += 2 * len)
            for (int i = base; i < base + len; i++) {
                float a = v[i], b = v[i + len];
                v[i] = a + b;
                v[i + len] = a - b;
            }
}

// Q8 activations (`quant::quantize_block`, llama.cpp's `quantize_row_q8_1`): one thread per
// 32-block; quants, the f16-rounded scale `d` and scaled sum `s` per block.
extern "C" __global__ void quantize_q8(const float* x, long blocks, i8* qs, float* d, float* s) {
    long b = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= blocks) return;
    int sum;
    float dd = pd_quantize_block32(x + b * 32, qs + b * 32, &sum);
    d[b] = pd_round_f16(dd);
    s[b] = pd_round_f16(dd * float(sum));
}

// Q8K activations (`quant::quantize_block_k`, llama.cpp's `quantize_row_q8_K_ref`): one thread
// per 256-block; quants, the scale and the sixteen 16-element sums.
extern "C" __global__ void quantize_q8k(const float* x, long blocks, i8* qs, float* d, i16* sums) {
    long b = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= blocks) return;
    const float* v = x + b * 256;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; j++) {
        if (fabsf(v[j]) > amax) {
            amax = fabsf(v[j]);
            max = v[j];
        }
    }
    i8* q = qs + b * 256;
    i16* sm = sums + b * 16;
    if (amax == 0.0f) {
        for (int j = 0; j < 256; j++) q[j] = 0;
        for (int j = 0; j < 16; j++) sm[j] = 0;
        d[b] = 0.0f;
        return;
    }
    float iscale = -127.0f / max;
    for (int j = 0; j < 256; j++) q[j] = i8(pd_min(int(rintf(iscale * v[j])), 127));
    for (int k = 0; k < 16; k++) {
        int acc = 0;
        for (int j = 0; j < 16; j++) acc += q[16 * k + j];
        sm[k] = i16(acc);
    }
    d[b] = 1.0f / iscale;
}

// Each value rounded to f16 (`bf16` = 0) or bf16 (1) and back: the activations float weights
// of that type read.
extern "C" __global__ void round_to(const float* x, long n, int bf16, float* out) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = bf16 ? pd_bf16_to_f32(pd_f32_to_bf16(x[i])) : pd_round_f16(x[i]);
}
