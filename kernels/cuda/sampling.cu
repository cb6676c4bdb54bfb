// The sampler's reduction of a step's logits (`candidates::Cut::apply`): each row cut to the
// tokens its sampler can pick from, so that only those go back to the host. Every choice is a
// comparison or a maximum, exact in any order, so the set is the host rule's; the order within
// a row is whatever order the threads reach it (the sampler sorts).
#include "common.cuh"

// One row's cut, laid out as `candidates::Cut` is sent: three 4-byte fields.
struct PdCut {
    float scale, margin;
    u32 top_k;
};

// Unsigned keys in `f32::total_cmp`'s order (-0 below +0), the order the sampler ranks by.
__device__ __forceinline__ u32 pd_order_key(float z) {
    u32 b = __float_as_uint(z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define PD_CAND_MAX_THREADS 256

// A block per row (a power of two of threads, at most 256). Writes row `r`'s count to
// `counts[r]` and its first `cap` candidates to `ids`/`vals` at `r * cap`.
extern "C" __global__ void candidates_rows(const float* x, int cols, const PdCut* cuts, int cap,
                                           u32* counts, u32* ids, float* vals) {
    __shared__ float best[PD_CAND_MAX_THREADS];
    __shared__ u32 hist[256];
    // The k-th key's bits found so far, which bits those are, the rank left, and whether
    // fewer than k values are kept at all (then top-k cuts nothing).
    __shared__ u32 found[4];
    __shared__ u32 kept;
    int r = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const float* row = x + (size_t)r * cols;
    PdCut c = cuts[r];

    // The largest non-NaN value (fmaxf passes over NaN); a maximum is the same in any order.
    float m = __uint_as_float(0xff800000u);
    for (int i = tid; i < cols; i += nt) m = fmaxf(m, row[i]);
    best[tid] = m;
    __syncthreads();
    for (int half = nt / 2; half > 0; half /= 2) {
        if (tid < half) best[tid] = fmaxf(best[tid], best[tid + half]);
        __syncthreads();
    }
    float cut_at = best[0] * c.scale - c.margin;

    // With top-k, the k-th largest kept key, a byte at a time from the top (radix select):
    // each pass counts the kept keys that share the bytes found so far by their next byte.
    u32 prefix = 0, mask = 0, k = c.top_k;
    if (k > 0) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += nt) hist[i] = 0;
            __syncthreads();
            for (int i = tid; i < cols; i += nt) {
                float z = row[i] * c.scale;
                if (!(z >= cut_at)) continue;
                u32 key = pd_order_key(z);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                u32 above = 0;
                int b = 255;
                for (; b >= 0 && above + hist[b] < k; b--) above += hist[b];
                found[3] = b < 0;
                if (b >= 0) {
                    found[0] = prefix | (u32(b) << shift);
                    found[1] = mask | (255u << shift);
                    found[2] = k - above;
                }
            }
            __syncthreads();
            // Every thread reads the same flag; the next pass writes only after its barriers.
            if (found[3]) {
                prefix = 0;
                break;
            }
            prefix = found[0];
            mask = found[1];
            k = found[2];
        }
    }

    if (tid == 0) kept = 0;
    __syncthreads();
    for (int i = tid; i < cols; i += nt) {
        float v = row[i];
        float z = v * c.scale;
        if (!(z >= cut_at) || pd_order_key(z) < prefix) continue;
        u32 at = atomicAdd(&kept, 1u);
        if (at < u32(cap)) {
            ids[(size_t)r * cap + at] = u32(i);
            vals[(size_t)r * cap + at] = v;
        }
    }
    __syncthreads();
    if (tid == 0) counts[r] = kept;
}

// The rows' candidates packed one row after another, for one copy back: `out` holds
// `rows + 1` offsets (counted in candidates, from every row's full count), then the
// `(id, value bits)` pairs. A row over `cap` is not copied: the host reads the step whole.
extern "C" __global__ void candidates_pack(int rows, int cap, const u32* counts, const u32* ids,
                                           const float* vals, u32* out) {
    __shared__ u32 over;
    int tid = threadIdx.x, nt = blockDim.x;
    if (tid == 0) {
        u32 at = 0;
        over = 0;
        for (int r = 0; r < rows; r++) {
            out[r] = at;
            at += counts[r];
            over |= counts[r] > u32(cap);
        }
        out[rows] = at;
    }
    __syncthreads();
    if (over) return;
    u32* pairs = out + rows + 1;
    for (int r = 0; r < rows; r++) {
        u32 at = out[r], n = counts[r];
        for (u32 j = tid; j < n; j += nt) {
            pairs[2 * (at + j)] = ids[(size_t)r * cap + j];
            pairs[2 * (at + j) + 1] = __float_as_uint(vals[(size_t)r * cap + j]);
        }
    }
}
