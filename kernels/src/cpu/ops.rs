//! Element-wise operations and paged attention, written once over an `Isa` of primitive
//! kernels. Bodies are `#[inline(always)]` so that each ISA instantiates them inside a
//! `#[target_feature]` function and the compiler vectorises them for that ISA; the arithmetic
//! (and so every bit of the result) is the same for all of them.

use super::portable::hsum8;
use crate::kv::{AttnQuery, KvData, KvGeometry};

/// The primitives that differ per instruction set.
pub(crate) trait Isa: Copy + Send + Sync {
    fn kv_dot(self, q: &[f32], kv: &KvData, off: usize) -> f32;
    fn kv_axpy(self, p: f32, kv: &KvData, off: usize, out: &mut [f32]);
}

/// `e^x` to within a couple of ulp, built only from operations with exactly specified results
/// (FMA, rounding, bit moves), so every ISA returns the same bits and the loop vectorises.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let p = 1.987_569_1e-4f32.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 5e-1);
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// Sum of a slice in eight lanes, then the fixed horizontal order.
#[inline(always)]
fn sum_lanes(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in chunks.by_ref() {
        for l in 0..8 {
            acc[l] += f(c[l]);
        }
    }
    let mut tail = 0f32;
    for &x in chunks.remainder() {
        tail += f(x);
    }
    hsum8(acc) + tail
}

#[inline(always)]
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut acc = [0f32; 8];
        let mut chunks = xr.chunks_exact(8);
        for c in chunks.by_ref() {
            for l in 0..8 {
                acc[l] = c[l].mul_add(c[l], acc[l]);
            }
        }
        let mut tail = 0f32;
        for &v in chunks.remainder() {
            tail = v.mul_add(v, tail);
        }
        let mean = (hsum8(acc) + tail) / n as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = (v * scale) * w;
        }
    }
}

#[inline(always)]
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

#[inline(always)]
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Rotates adjacent pairs of each head; `cos`/`sin` have `head_dim / 2` entries per token.
#[inline(always)]
pub fn rope_rows(x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for (t, row) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let c = &cos[t * half..(t + 1) * half];
        let s = &sin[t * half..(t + 1) * half];
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let x0 = head[2 * i];
                let x1 = head[2 * i + 1];
                head[2 * i] = x0 * c[i] - x1 * s[i];
                head[2 * i + 1] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

/// Attention of one query token for one KV head and the query heads that share it (GQA).
/// `q` and `out` hold those `group` heads; `scores` is scratch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend<I: Isa>(
    isa: I,
    geom: &KvGeometry,
    kv: &KvData,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery<'_>,
    q: &[f32],
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let hd = geom.head_dim;
    let group = q.len() / hd;
    let n = query.pos + 1;
    let bs = geom.block_size;
    let scale = 1.0 / (hd as f32).sqrt();
    scores.clear();
    scores.resize(group * n, 0.0);
    for j in 0..n {
        let block = query.blocks[j / bs] as usize;
        let off = geom.offset(block, layer, 0, kv_head, j % bs);
        for h in 0..group {
            scores[h * n + j] = isa.kv_dot(&q[h * hd..(h + 1) * hd], kv, off) * scale;
        }
    }
    for h in 0..group {
        let s = &mut scores[h * n..(h + 1) * n];
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in s.iter_mut() {
            *v = exp(*v - max);
        }
        let inv = 1.0 / sum_lanes(s, |v| v);
        for v in s.iter_mut() {
            *v *= inv;
        }
    }
    out.fill(0.0);
    for j in 0..n {
        let block = query.blocks[j / bs] as usize;
        let off = geom.offset(block, layer, 1, kv_head, j % bs);
        for h in 0..group {
            isa.kv_axpy(scores[h * n + j], kv, off, &mut out[h * hd..(h + 1) * hd]);
        }
    }
}
