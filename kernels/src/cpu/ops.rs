//! Element-wise operations and paged attention, written once over an `Isa` of primitive
//! kernels. Bodies are `#[inline(always)]` so that each ISA instantiates them inside a
//! `#[target_feature]` function and the compiler vectorises them for that ISA; the arithmetic
//! (and so every bit of the result) is the same for all of them.
//!
//! The arithmetic follows llama.cpp's CPU backend operation for operation (rounding points,
//! FMA placement, summation trees, its polynomial `exp`), so that pdmesh reproduces llama.cpp's
//! logits bit for bit on the same GGUF; `scripts/compare_llamacpp.py` checks it.

use super::portable::hsum8;
use crate::backend::RopeMode;
use crate::kv::{AttnQuery, KvData, KvGeometry, Phase};

/// The primitives that differ per instruction set.
pub(crate) trait Isa: Copy + Send + Sync {
    /// `q · k` over one head of KV at element offset `off`, summed in `phase`'s order.
    fn qk_dot(self, q: &[f32], kv: &KvData, off: usize, phase: Phase) -> f32;
    /// `out = fma(p, v, out)` element-wise over one head of KV at element offset `off`.
    fn kv_axpy(self, p: f32, kv: &KvData, off: usize, out: &mut [f32]);
    /// Rounds each value to the nearest f16 (ties to even) and back.
    fn round_f16(self, x: &mut [f32]);
    /// `Σ k·q` over two q8_0 rows (`q8kv::dot_q8_0` is the reference).
    #[inline(always)]
    fn dot_q8_0(self, k: &[u8], q: &[u8]) -> f32 {
        super::q8kv::dot_q8_0(k, q)
    }
    /// q8_0 row to f32 (`q8kv::dequantize_row_q8_0` is the reference).
    #[inline(always)]
    fn dequantize_q8_0(self, row: &[u8], out: &mut [f32]) {
        super::q8kv::dequantize_row_q8_0(row, out)
    }
    /// Softmax's step over one 16-lane chunk: `v = exp(v - max)` for lanes `from..valid`,
    /// zero for the masked lanes before `from` (the lanes past `valid` are left as they are,
    /// zero), returning the chunk's `reduce16` with every lane outside `from..valid` counted
    /// as zero.
    #[inline(always)]
    fn exp16(self, chunk: &mut [f32], max: f32, from: usize, valid: usize) -> f32 {
        let mut e = [0f32; 16];
        chunk[..from.min(valid)].fill(0.0);
        for (t, v) in chunk[..valid].iter_mut().enumerate().skip(from) {
            *v = exp(*v - max);
            e[t] = *v;
        }
        reduce16(&e)
    }
}

/// Horizontal sum of 16 lanes in the order GCC expands `_mm512_reduce_add_ps`:
/// fold the upper 8 lanes onto the lower 8, then the 8-lane tree of `hsum8`.
#[inline(always)]
pub fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t = [0f32; 8];
    for i in 0..8 {
        t[i] = v[i + 8] + v[i];
    }
    hsum8(t)
}

/// `q · k` for one head, in the summation order of `phase` (see `Phase`).
#[inline(always)]
pub fn qk_dot_lanes(q: &[f32], k: impl Fn(usize) -> f32, phase: Phase) -> f32 {
    match phase {
        Phase::Prefill => lanes16(q.len(), k, |i| q[i]),
        Phase::Decode => lanes16x4(q.len(), k, |i| q[i], Tail::F64),
    }
}

/// How `lanes16x4` adds the elements past the last whole 64 (llama.cpp's `ggml_vec_dot_f16`
/// sums them in `ggml_float`, `ggml_vec_dot_f32` in float).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    F64,
    F32,
}

impl Tail {
    /// `head` plus `w(i)·x(i)` for `i` in `range`, one element at a time in this precision
    /// (`head` is an f32 value for `F32`; `ggml_float` sums hand theirs over unrounded).
    #[inline(always)]
    pub fn add(
        self,
        head: f64,
        range: std::ops::Range<usize>,
        w: impl Fn(usize) -> f32,
        x: impl Fn(usize) -> f32,
    ) -> f32 {
        match self {
            Tail::F64 => {
                let mut sum = head;
                for i in range {
                    sum += f64::from(w(i) * x(i));
                }
                sum as f32
            }
            Tail::F32 => {
                let mut sum = head as f32;
                for i in range {
                    // Not contracted into an FMA, like the rest of ggml's scalar code.
                    sum += w(i) * x(i);
                }
                sum
            }
        }
    }
}

/// `Σ w(i)·x(i)` as llama.cpp's batched tinyBLAS kernel on AVX-512 sums it (F32 and F16
/// weights): one FMA accumulator per lane `i % 16`, then `reduce16`.
#[inline(always)]
pub fn lanes16(n: usize, w: impl Fn(usize) -> f32, x: impl Fn(usize) -> f32) -> f32 {
    debug_assert!(n.is_multiple_of(16));
    let mut c = [0f32; 16];
    for l in (0..n).step_by(16) {
        for (t, c) in c.iter_mut().enumerate() {
            *c = w(l + t).mul_add(x(l + t), *c);
        }
    }
    reduce16(&c)
}

/// `Σ w(i)·x(i)` as llama.cpp's AVX-512 `ggml_vec_dot_f16`/`_f32` sum it (single tokens):
/// four 16-lane FMA accumulators over each 64 elements, folded `(s0+s2)+(s1+s3)`, `reduce16`,
/// then the tail element by element.
#[inline(always)]
pub fn lanes16x4(n: usize, w: impl Fn(usize) -> f32, x: impl Fn(usize) -> f32, tail: Tail) -> f32 {
    let mut s = [[0f32; 16]; 4];
    let np = n & !63;
    for i in (0..np).step_by(64) {
        for (j, sj) in s.iter_mut().enumerate() {
            for (t, a) in sj.iter_mut().enumerate() {
                *a = w(i + 16 * j + t).mul_add(x(i + 16 * j + t), *a);
            }
        }
    }
    let mut u = [0f32; 16];
    for t in 0..16 {
        u[t] = (s[0][t] + s[2][t]) + (s[1][t] + s[3][t]);
    }
    tail.add(f64::from(reduce16(&u)), np..n, w, x)
}

/// One `_mm512_dpbf16_ps` over the 32 elements at `base`: lane `t` adds the product of
/// elements `2t+1` and then that of `2t`, each rounded once (bf16 products are exact in f32,
/// so each step is an FMA; the instruction's flushing of denormals is not reproduced).
#[inline(always)]
fn dpbf16(acc: &mut [f32; 16], base: usize, w: &impl Fn(usize) -> f32, x: &impl Fn(usize) -> f32) {
    for (t, a) in acc.iter_mut().enumerate() {
        let (o, e) = (base + 2 * t + 1, base + 2 * t);
        *a = w(e).mul_add(x(e), w(o).mul_add(x(o), *a));
    }
}

/// `Σ w(i)·x(i)` for BF16 weights as llama.cpp's batched tinyBLAS kernel sums it on AVX-512
/// BF16: `dpbf16` over each 32 elements into one set of 16 lanes, then `reduce16`.
#[inline(always)]
pub fn bf16_lanes16(n: usize, w: impl Fn(usize) -> f32, x: impl Fn(usize) -> f32) -> f32 {
    debug_assert!(n.is_multiple_of(32));
    let mut c = [0f32; 16];
    for l in (0..n).step_by(32) {
        dpbf16(&mut c, l, &w, &x);
    }
    reduce16(&c)
}

/// `Σ w(i)·x(i)` as llama.cpp's `ggml_vec_dot_bf16` sums it on AVX-512 BF16: two lane sets
/// over alternate 32-element halves of each 64, each reduced and added in `ggml_float`, then the
/// tail.
#[inline(always)]
pub fn bf16_lanes16x2(n: usize, w: impl Fn(usize) -> f32, x: impl Fn(usize) -> f32) -> f32 {
    let (mut c1, mut c2) = ([0f32; 16], [0f32; 16]);
    let np = n & !63;
    for i in (0..np).step_by(64) {
        dpbf16(&mut c1, i, &w, &x);
        dpbf16(&mut c2, i + 32, &w, &x);
    }
    Tail::F64.add(f64::from(reduce16(&c1)) + f64::from(reduce16(&c2)), np..n, w, x)
}

/// llama.cpp's vectorised `expf` (its AVX-512 `ggml_v_expf`): a range reduction by `ln 2`, a
/// degree-5 polynomial and an exact scaling by `2^n`, every step with a specified rounding.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let log2e = f32::from_bits(0x3fb8_aa3b);
    let shift = f32::from_bits(0x4b40_0000); // 1.5 * 2^23: rounds to an integer when added
    let ln2_hi = f32::from_bits(0x3f31_7200);
    let ln2_lo = f32::from_bits(0x35bf_be8e);
    let z = x.mul_add(log2e, shift);
    let n = z - shift;
    let b = (-n).mul_add(ln2_lo, (-n).mul_add(ln2_hi, x));
    let u = b * b;
    let c1 = f32::from_bits(0x3f7f_fff6);
    let c2 = f32::from_bits(0x3eff_fedb);
    let c3 = f32::from_bits(0x3e2a_af33);
    let c4 = f32::from_bits(0x3d2b_9f17);
    let c5 = f32::from_bits(0x3c07_2010);
    let j = c5.mul_add(b, c4).mul_add(u, c3.mul_add(b, c2)).mul_add(u, c1.mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // j · 2^n is exact in f64 (|n| <= 192), so this rounds once, like `vscalefps`.
    (f64::from(j) * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(0.0 - x))
}

#[inline(always)]
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        // Sequential f64 sum of f32 squares, as llama.cpp does.
        let mut sum = 0f64;
        for &v in xr {
            sum += f64::from(v * v);
        }
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = (v * scale) * w;
        }
    }
}

/// The q8_0 cache write's quantizer (`q8kv`), here so that each ISA compiles its own.
#[inline(always)]
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    super::q8kv::quantize_row_q8_0(x, out)
}

#[inline(always)]
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// llama.cpp's GELU table (`ggml_table_gelu_f16`): for every f16 bit pattern `x`, ggml's
/// `ggml_gelu_f32(x)` (the tanh approximation) rounded to f16, here widened back to f32. It is
/// computed as GCC compiles ggml's expression, `1 + a·x·x` fused into one FMA, with the C
/// library's `tanhf` (Rust's `f32::tanh`): `gelu_table_is_llama_cpps` holds it to the table
/// of the llama.cpp build the references come from, entry for entry.
pub fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        const A: f32 = 0.044_715;
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        (0..=u16::MAX)
            .map(|bits| {
                let x = half::f16::from_bits(bits).to_f32();
                let inner = (A * x).mul_add(x, 1.0);
                let y = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh());
                half::f16::from_f32(y).to_f32()
            })
            .collect()
    })
}

/// `gelu(x)` as llama.cpp's CPU backend computes it (`GGML_GELU_FP16`): 0 at or below -10,
/// `x` at or above 10, else the table's value at `x` rounded to f16.
#[inline(always)]
pub fn gelu(table: &[f32], x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        table[usize::from(half::f16::from_f32(x).to_bits())]
    }
}

/// `out = gelu(gate) * up` (`ggml_vec_geglu_f32`).
#[inline(always)]
pub fn geglu(table: &[f32], gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = if g <= -10.0 { 0.0 } else { gelu(table, g) * u };
    }
}

#[inline(always)]
pub fn scale(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

#[inline(always)]
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every row of `x` (rows of `bias`'s length).
#[inline(always)]
pub fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// One pair's rotation. The first products are fused, the second rounded: the form GCC
/// compiles llama.cpp's `rotate_pairs` (`x0*cos - x1*sin`, `x0*sin + x1*cos`) into, for both
/// pairings.
#[inline(always)]
fn rotate(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c))
}

/// Rotates the pairs of each head that `mode` names; `cos`/`sin` have `head_dim / 2` entries
/// per token, pair `i`'s at entry `i`.
#[inline(always)]
pub fn rope_rows(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
    mode: RopeMode,
) {
    let half = head_dim / 2;
    for (t, row) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let c = &cos[t * half..(t + 1) * half];
        let s = &sin[t * half..(t + 1) * half];
        for head in row.chunks_exact_mut(head_dim) {
            match mode {
                RopeMode::Normal => {
                    for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                        (pair[0], pair[1]) = rotate(pair[0], pair[1], c[i], s[i]);
                    }
                }
                RopeMode::Neox => {
                    let (lo, hi) = head.split_at_mut(half);
                    for (i, (a, b)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                        (*a, *b) = rotate(*a, *b, c[i], s[i]);
                    }
                }
            }
        }
    }
}

/// Per-thread buffers for `attend`.
#[derive(Debug, Default)]
pub(crate) struct AttnScratch {
    pub(crate) q: Vec<f32>,
    pub(crate) p: Vec<f32>,
    pub(crate) acc: Vec<f32>,
    /// Element offsets of the K rows, position by position (the AVX2 kernel's).
    pub(crate) offs: Vec<usize>,
    /// The group's query rows quantized to q8_0 (the q8_0 kernel's).
    pub(crate) qq: Vec<u8>,
}

/// Attention of one query token for one KV head and the query heads that share it (GQA).
/// `q` and `out` hold those `group` heads. A q8_0 cache goes to `q8kv::attend_q8`.
///
/// Scores are `q·k` (q rounded to the KV type first) times `scale`; softmax exponentiates in
/// 16-lane chunks aligned to position 0 and sums the chunks in f64; probabilities are rounded
/// to the KV type and multiplied into V with one accumulator per lane (16 for prefill, 64 for
/// decode), which are then reduced in `phase`'s order. Positions before `query.first` are
/// skipped: llama.cpp's mask makes them exact zeros, which change none of these sums.
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
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    if let KvData::Q8_0(bytes) = kv {
        let q8 = super::q8kv::attend_q8;
        return q8(isa, geom, bytes, layer, kv_head, query, q, scale, out, scratch);
    }
    let hd = geom.head_dim;
    let group = q.len() / hd;
    let n = query.pos + 1;
    let first = query.first.min(query.pos);
    let bs = geom.block_size;
    let half_kv = matches!(kv, KvData::F16(_));
    let sets = match query.phase {
        Phase::Prefill => 16,
        Phase::Decode => 64,
    };
    let AttnScratch { q: qh, p, acc, .. } = scratch;
    qh.resize(hd, 0.0);
    p.clear();
    p.resize(n.next_multiple_of(16), 0.0);
    acc.resize(sets * hd, 0.0);
    for h in 0..group {
        qh.copy_from_slice(&q[h * hd..(h + 1) * hd]);
        if half_kv {
            isa.round_f16(qh);
        }
        for (j, pj) in p[..n].iter_mut().enumerate().skip(first) {
            let off = geom.offset(query.blocks[j / bs] as usize, layer, 0, kv_head, j % bs);
            *pj = isa.qk_dot(qh, kv, off, query.phase) * scale;
        }
        let max = p[first..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Chunks of 16 from position 0; lanes outside `first..n` stay exactly zero (they are
        // masked with -inf in llama.cpp, whose exp gives +0), and whole chunks of them add
        // +0 to the sum: they are skipped.
        let mut sum = 0f64;
        for (c, chunk) in p.chunks_exact_mut(16).enumerate().skip(first / 16) {
            let from = first.saturating_sub(16 * c);
            sum += f64::from(isa.exp16(chunk, max, from, (n - 16 * c).min(16)));
        }
        let inv = (1.0 / sum) as f32;
        for v in &mut p[first..n] {
            *v *= inv;
        }
        if half_kv {
            isa.round_f16(&mut p[first..n]);
        }
        acc.fill(0.0);
        for (j, &pj) in p[..n].iter().enumerate().skip(first) {
            let off = geom.offset(query.blocks[j / bs] as usize, layer, 1, kv_head, j % bs);
            let set = j % sets;
            isa.kv_axpy(pj, kv, off, &mut acc[set * hd..(set + 1) * hd]);
        }
        // Fold the lane sets row-wise (every dim at once, so it vectorises): decode first
        // combines its four 16-lane accumulators, then both reduce 16 lanes like `reduce16`.
        let rows = &mut acc[..sets * hd];
        let add_into = |rows: &mut [f32], dst: usize, a: usize, b: usize| {
            for d in 0..hd {
                rows[dst * hd + d] = rows[a * hd + d] + rows[b * hd + d];
            }
        };
        if query.phase == Phase::Decode {
            for t in 0..16 {
                add_into(rows, t, t, 32 + t);
                add_into(rows, 16 + t, 16 + t, 48 + t);
                add_into(rows, t, t, 16 + t);
            }
        }
        for i in 0..8 {
            add_into(rows, i, i + 8, i);
        }
        for i in 0..4 {
            add_into(rows, i, i, i + 4);
        }
        add_into(rows, 0, 0, 2);
        add_into(rows, 1, 1, 3);
        let o = &mut out[h * hd..(h + 1) * hd];
        for (d, o) in o.iter_mut().enumerate() {
            *o = rows[d] + rows[hd + d];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `_mm512_dpbf16_ps` adds a lane's odd product before its even one, rounding after each
    /// (measured on an AVX-512 BF16 CPU): with 1 in the lane, `+2^24` then `-2^24` leaves 0,
    /// the other order or one rounding would leave 1.
    #[test]
    fn dpbf16_adds_the_odd_product_first() {
        let mut w = [0f32; 64];
        let mut x = [1f32; 64];
        w[0] = 1.0; // lane 0 holds 1 after the first 32
        w[33] = 4096.0;
        x[33] = 4096.0;
        w[32] = -4096.0;
        x[32] = 4096.0;
        assert_eq!(bf16_lanes16(64, |i| w[i], |i| x[i]), 0.0);
        assert_eq!(bf16_lanes16x2(64, |i| w[i], |i| x[i]), 1.0); // in separate lane sets
    }

    /// The vec_dot order folds its four accumulators `(s0+s2)+(s1+s3)`: with 2^24 in s0 and
    /// s2 = -2^24, the 1s in s1 and s3 survive; summed in index order they would not.
    #[test]
    fn vec_dot_folds_accumulators_pairwise() {
        let mut w = [0f32; 64];
        w[0] = 16_777_216.0;
        w[16] = 1.0;
        w[32] = -16_777_216.0;
        w[48] = 1.0;
        assert_eq!(lanes16x4(64, |i| w[i], |_| 1.0, Tail::F32), 2.0);
    }
}
