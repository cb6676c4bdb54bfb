//! Attention over a q8_0 KV cache, computed as llama.cpp's CPU flash attention computes it
//! when `type_k = type_v = q8_0` (its only path for a quantized cache, the same for prompt and
//! decode tokens): the query is quantized to q8_0, scores are integer block dots, softmax is
//! online with glibc's scalar `expf`, and V is dequantized and accumulated with FMA.
//! `docs/design/int8-kv-cache.md` derives every rounding step from the pinned llama.cpp build.
//!
//! Also here: the q8_0 row quantizer for the cache write and the Hadamard transform llama.cpp
//! applies around attention when the cache is quantized.

use half::f16;

use super::ops::{AttnScratch, Isa};
use super::portable::hsum8;
use crate::formats::{Format, Q8_0, QuantFormat};
use crate::kv::{AttnQuery, KvGeometry, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
use crate::quant::{f16_at, quantize_block};

/// Quantizes `x` (a whole number of 32-value blocks) into q8_0 blocks in `out`, as the x86
/// `quantize_row_q8_0` does: scale `amax/127` stored as f16, quants `round_half_even(x·127/amax)`.
#[inline(always)]
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    debug_assert_eq!(out.len(), x.len() / Q8_0_BLOCK * Q8_0_BLOCK_BYTES);
    for (xb, ob) in x.chunks_exact(Q8_0_BLOCK).zip(out.chunks_exact_mut(Q8_0_BLOCK_BYTES)) {
        let mut qs = [0i8; Q8_0_BLOCK];
        // Its `d` is already rounded through f16, so converting it back is exact.
        let (d, _) = quantize_block(xb, &mut qs);
        ob[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        for (o, q) in ob[2..].iter_mut().zip(qs) {
            *o = q as u8;
        }
    }
}

/// `Σ k·q` over two q8_0 rows as llama.cpp's x86 `ggml_vec_dot_q8_0_q8_0`: per block, the
/// eight exact integer lanes of the Q8_0 weight dot (K as the weight, q as the activation),
/// each FMA'd with the product of the scales into its f32 accumulator, folded as `hsum8`.
#[inline(always)]
pub fn dot_q8_0(k: &[u8], q: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (kb, qb) in k.chunks_exact(Q8_0_BLOCK_BYTES).zip(q.chunks_exact(Q8_0_BLOCK_BYTES)) {
        let dd = f16_at(kb) * f16_at(qb);
        let lanes = Q8_0::lanes(kb, bytemuck::cast_slice(&qb[2..]), &[]);
        for (a, p) in acc.iter_mut().zip(lanes) {
            *a = dd.mul_add(p as f32, *a);
        }
    }
    hsum8(acc)
}

/// Dequantizes a q8_0 row: llama.cpp's `dequantize_row_q8_0`, block by block.
#[inline(always)]
pub fn dequantize_row_q8_0(row: &[u8], out: &mut [f32]) {
    for (b, o) in row.chunks_exact(Q8_0_BLOCK_BYTES).zip(out.chunks_exact_mut(Q8_0_BLOCK)) {
        Q8_0::dequantize(b, o);
    }
}

/// glibc 2.36's `expf` (its FMA variant, which x86-64 CPUs with FMA run): llama.cpp's flash
/// attention calls the C library's scalar `expf`, so its every rounding is this algorithm's.
#[inline(always)]
pub fn glibc_expf(x: f32) -> f32 {
    const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe); // 0x1.71547652b82fep+5
    const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000); // 0x1.8p+52
    const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394); // 0x1.c6af84b912394p-20
    const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3); // 0x1.ebfce50fac4f3p-13
    const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6); // 0x1.62e42ff0c52d6p-6
    let b = x.to_bits();
    if (b >> 20) & 0x7ff >= 0x42b {
        // |x| >= 88, infinities and NaN.
        if b == 0xff80_0000 {
            return 0.0;
        }
        if (b >> 20) & 0x7ff >= 0x7f8 {
            return x + x;
        }
        if x > f32::from_bits(0x42b1_7217) {
            return f32::INFINITY;
        }
        if x < f32::from_bits(0xc2cf_f1b4) {
            return 0.0;
        }
        if x < f32::from_bits(0xc2ce_8ecf) {
            return f32::from_bits(1);
        }
    }
    let xd = f64::from(x);
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(EXP2F_TABLE[(ki & 31) as usize].wrapping_add(ki << 47));
    let z = C0.mul_add(r, C1);
    let r2 = r * r;
    let y = C2.mul_add(r, 1.0);
    let y = z.mul_add(r2, y);
    (y * s) as f32
}

/// glibc's `__exp2f_data.tab`: `bits(2^(i/32)) − (i << 47)`.
const EXP2F_TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];

/// The fast Walsh–Hadamard transform over each run of `n` values (a power of two), scaled by
/// `1/√n` first, with butterflies of widening span: ggml's CPU kernel for the Hadamard matmul
/// llama.cpp puts around attention when the KV cache is quantized.
#[inline(always)]
pub fn fwht(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let sc = 1.0 / (n as f32).sqrt();
    for run in x.chunks_exact_mut(n) {
        for v in run.iter_mut() {
            *v *= sc;
        }
        let mut len = 1;
        while len < n {
            for pair in run.chunks_exact_mut(2 * len) {
                let (a, b) = pair.split_at_mut(len);
                for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                    let (x, y) = (*u, *v);
                    *u = x + y;
                    *v = x - y;
                }
            }
            len *= 2;
        }
    }
}

/// Attention of one query token for one KV head and the `group` query heads that share it,
/// over a q8_0 cache: llama.cpp's `flash_attn_ext_f16_one_chunk` row by row (keys in position
/// order, a strict `>` for a new maximum, `S = S·ms + vs` fused, output times `1/S`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_q8<I: Isa>(
    isa: I,
    geom: &KvGeometry,
    kv: &[u8],
    layer: usize,
    kv_head: usize,
    query: &AttnQuery<'_>,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let hd = geom.head_dim;
    let rb = geom.row_bytes();
    let group = q.len() / hd;
    let n = query.pos + 1;
    // llama.cpp's flash attention skips a masked key (`continue`): the online softmax starts
    // at the window.
    let first = query.first.min(query.pos);
    let bs = geom.block_size;
    let AttnScratch { q: v32, p: scores, acc: vkq, qq, .. } = scratch;
    qq.resize(group * rb, 0);
    scores.resize(group * n, 0.0);
    vkq.clear();
    vkq.resize(group * hd, 0.0);
    v32.resize(hd, 0.0);
    for (qh, qqh) in q.chunks_exact(hd).zip(qq.chunks_exact_mut(rb)) {
        quantize_row_q8_0(qh, qqh);
    }
    let row = |kv_sel: usize, j: usize| {
        let r = geom.row(query.blocks[j / bs] as usize, layer, kv_sel, kv_head, j % bs);
        &kv[r * rb..(r + 1) * rb]
    };
    // Scores first: each K row is read once for the whole group. `+ 0.0` is the mask's add
    // (it turns a -0 score into +0, as llama.cpp's does).
    for j in first..n {
        let k = row(0, j);
        for (h, qqh) in qq.chunks_exact(rb).enumerate() {
            scores[h * n + j] = isa.dot_q8_0(k, qqh) * scale + 0.0;
        }
    }
    let mut m = [f32::NEG_INFINITY; MAX_GROUP];
    let mut s = [0f32; MAX_GROUP];
    assert!(group <= MAX_GROUP, "attention: more than {MAX_GROUP} query heads per KV head");
    for j in first..n {
        isa.dequantize_q8_0(row(1, j), v32);
        for h in 0..group {
            let sj = scores[h * n + j];
            let acc = &mut vkq[h * hd..(h + 1) * hd];
            let (ms, vs) = if sj > m[h] {
                let old = m[h];
                m[h] = sj;
                let ms = glibc_expf(old - sj);
                // Multiplying by 1 changes nothing; llama.cpp scales unconditionally.
                if ms != 1.0 {
                    for a in acc.iter_mut() {
                        *a *= ms;
                    }
                }
                (ms, 1.0)
            } else {
                (1.0, glibc_expf(sj - m[h]))
            };
            for (a, &v) in acc.iter_mut().zip(v32.iter()) {
                *a = v.mul_add(vs, *a);
            }
            s[h] = s[h].mul_add(ms, vs);
        }
    }
    for h in 0..group {
        let inv = if s[h] == 0.0 { 0.0 } else { 1.0 / s[h] };
        for (o, &a) in out[h * hd..(h + 1) * hd].iter_mut().zip(&vkq[h * hd..(h + 1) * hd]) {
            *o = a * inv;
        }
    }
}

/// The most query heads that share one KV head (GQA) the q8_0 kernel keeps state for.
pub const MAX_GROUP: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantizer_rounds_ties_to_even_from_the_f32_product() {
        // amax 127 gives id = 1: quants are the values rounded half to even.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        let mut out = [0u8; 34];
        quantize_row_q8_0(&x, &mut out);
        assert_eq!(f16_at(&out), 1.0);
        assert_eq!([out[2] as i8, out[3] as i8, out[4] as i8, out[5] as i8], [127, 2, -4, 0]);
        let mut back = [0f32; 32];
        dequantize_row_q8_0(&out, &mut back);
        assert_eq!(back[..4], [127.0, 2.0, -4.0, 0.0]);
    }

    #[test]
    fn a_zero_block_has_scale_zero() {
        let mut out = [1u8; 34];
        quantize_row_q8_0(&[0.0; 32], &mut out);
        assert!(out.iter().all(|&b| b == 0));
    }

    #[test]
    fn dot_sums_lanes_in_hsum8_order() {
        // Block 0 (scales 2^12 each): +1 in lane 0, -1 in lane 4. Block 1 (scales 1): +1 in
        // lanes 1 and 5. hsum8 adds lane 0 to lane 4 first, so both 1s survive; a running sum
        // of the lanes in index order would lose them against 2^24.
        let block = |scale: f32, quants: &[(usize, i8)]| {
            let mut b = [0u8; 34];
            b[..2].copy_from_slice(&f16::from_f32(scale).to_bits().to_le_bytes());
            for &(j, q) in quants {
                b[2 + j] = q as u8;
            }
            b
        };
        let k = [block(4096.0, &[(0, 1), (16, -1)]), block(1.0, &[(4, 1), (20, 1)])].concat();
        let q = [block(4096.0, &[(0, 1), (16, 1)]), block(1.0, &[(4, 1), (20, 1)])].concat();
        assert_eq!(dot_q8_0(&k, &q), 2.0);
    }

    #[test]
    fn expf_matches_glibc_at_its_edges() {
        assert_eq!(glibc_expf(0.0), 1.0);
        assert_eq!(glibc_expf(-0.0), 1.0);
        assert_eq!(glibc_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(glibc_expf(f32::INFINITY), f32::INFINITY);
        assert!(glibc_expf(f32::NAN).is_nan());
        assert_eq!(glibc_expf(89.0), f32::INFINITY);
        assert_eq!(glibc_expf(-104.0), 0.0);
        assert_eq!(glibc_expf(-103.5), f32::from_bits(1));
        assert_eq!(glibc_expf(1.0), std::f32::consts::E);
        // Correctly rounded across the ordinary range, as glibc's is in practice.
        for i in -2000..2000 {
            let x = i as f32 * 0.0437;
            let want = (f64::from(x)).exp() as f32;
            let got = glibc_expf(x);
            assert!(got == want || (got - want).abs() <= want * 1.2e-7, "{x}: {got} vs {want}");
        }
    }

    #[test]
    fn fwht_is_its_own_inverse_up_to_rounding_and_exact_on_a_spike() {
        let mut x = [0f32; 64];
        x[0] = 8.0;
        fwht(&mut x, 64);
        assert!(x.iter().all(|&v| v == 1.0));
        fwht(&mut x, 64);
        assert_eq!(x[0], 8.0);
        assert!(x[1..].iter().all(|&v| v == 0.0));
        let mut y: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        let orig = y.clone();
        fwht(&mut y, 128);
        fwht(&mut y, 128);
        assert!(y.iter().zip(&orig).all(|(a, b)| (a - b).abs() < 1e-5));
    }
}
