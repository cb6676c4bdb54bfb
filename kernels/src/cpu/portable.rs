//! Portable kernels: plain Rust that runs anywhere and is the reference the SIMD kernels are
//! tested against. They reproduce the SIMD lane structure (eight partial sums per block, then a
//! fixed pairwise horizontal sum) so both give bit-identical results.

use half::bf16;

use super::ops::{self, Tail};
use crate::formats::{ActForm, FloatFormat, FloatKind, MinTerm, QuantFormat};
use crate::kv::{KvData, Phase};
use crate::pool::SharedMut;
use crate::quant::{
    Activations, FormatVisitor, QK, QK_K, WeightMatrix, f16_at, quantize_block, quantize_block_k,
};

/// The horizontal sum order of an 8-lane AVX register used throughout (as llama.cpp's
/// `hsum_float_8`): `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline(always)]
pub fn hsum8(a: [f32; 8]) -> f32 {
    let q = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// Quantizes rows `rows` of `x` (`n_rows × cols`) into the activation buffers; `d` and `s_tr`
/// are block-major (`[block][row]`) so tiles can load consecutive tokens' scales and min
/// terms at once.
pub fn quantize_rows(
    x: &[f32],
    cols: usize,
    qs: &SharedMut<i8>,
    d: &SharedMut<f32>,
    s_tr: &SharedMut<f32>,
    n_rows: usize,
    rows: std::ops::Range<usize>,
) {
    let nb = cols / QK;
    for t in rows {
        for b in 0..nb {
            let o = t * cols + b * QK;
            // SAFETY: each row is quantized by exactly one thread; indices are bounds-checked.
            let (db, sb) = quantize_block(&x[o..o + QK], unsafe { qs.slice(o..o + QK) });
            // SAFETY: as above.
            unsafe {
                d.write(b * n_rows + t, db);
                s_tr.write(b * n_rows + t, sb);
            }
        }
    }
}

/// Quantizes rows `rows` of `x` (`n_rows × cols`) into Q8K super-blocks. Every SIMD level
/// runs this same code (AVX2 compiles it with its features on): its rounding must match
/// llama.cpp's reference quantizer, which every CPU build of llama.cpp runs too.
#[inline(always)]
pub fn quantize_rows_k(
    x: &[f32],
    cols: usize,
    kqs: &SharedMut<i8>,
    kd: &SharedMut<f32>,
    ksums: &SharedMut<i16>,
    kpairs: &SharedMut<i16>,
    rows: std::ops::Range<usize>,
) {
    let nb = cols / QK_K;
    for t in rows {
        for b in 0..nb {
            let o = t * cols + b * QK_K;
            let s = (t * nb + b) * (QK_K / 16);
            // SAFETY: each row is quantized by exactly one thread; indices are bounds-checked.
            let d = unsafe {
                quantize_block_k(
                    &x[o..o + QK_K],
                    kqs.slice(o..o + QK_K),
                    ksums.slice(s..s + QK_K / 16),
                )
            };
            // SAFETY: as above (the pair sums are this block's own eight).
            unsafe {
                kd.write(t * nb + b, d);
                let sums = ksums.slice(s..s + QK_K / 16);
                for (p, two) in
                    kpairs.slice(s / 2..s / 2 + QK_K / 32).iter_mut().zip(sums.chunks_exact(2))
                {
                    *p = two[0] + two[1];
                }
            }
        }
    }
}

/// `W[r] · x[t]` for a quantized weight row: per block, one FMA per lane with the product of
/// the two scales, then the format's min term, in llama.cpp's order (see `formats`).
pub fn dot_quantized<F: QuantFormat>(row: &[u8], acts: &Activations, t: usize) -> f32 {
    let be = F::BLOCK_ELEMS;
    let nb = acts.cols / be;
    let q = match F::ACT {
        ActForm::Q8 => &acts.qs,
        ActForm::Q8K => &acts.kqs,
    };
    let q = &q[t * acts.cols..(t + 1) * acts.cols];
    // Q8 scales are block-major (as a tile reads them), Q8K's token-major.
    let d = |b: usize| match F::ACT {
        ActForm::Q8 => acts.d[b * acts.rows + t],
        ActForm::Q8K => acts.kd[t * nb + b],
    };
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    let mut acc_m = [0f32; 4];
    for (b, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
        let sums: &[i16] = match F::ACT {
            ActForm::Q8 => &[],
            ActForm::Q8K => &acts.ksums[(t * nb + b) * (QK_K / 16)..(t * nb + b + 1) * (QK_K / 16)],
        };
        let lanes = F::lanes(blk, &q[b * be..(b + 1) * be], sums);
        let dd = f16_at(&blk[F::SCALE_AT..]) * d(b);
        for l in 0..8 {
            acc[l] = dd.mul_add(lanes[l] as f32, acc[l]);
        }
        let min = || f16_at(&blk[F::MIN_AT..]);
        let mins = || F::min_lanes(blk, sums);
        match F::MIN {
            MinTerm::None => {}
            MinTerm::PerBlock => summs = min().mul_add(acts.s[b * acts.rows + t], summs),
            MinTerm::SuperQuad => {
                let dmin = -(d(b) * min());
                for (a, p) in acc_m.iter_mut().zip(mins()) {
                    *a = dmin.mul_add(p as f32, *a);
                }
            }
            MinTerm::SuperScalar => {
                let p = mins();
                let dmin = -(d(b) * min());
                summs = dmin.mul_add(((p[0] + p[1]) + (p[2] + p[3])) as f32, summs);
            }
        }
    }
    match F::MIN {
        MinTerm::None => hsum8(acc),
        MinTerm::PerBlock | MinTerm::SuperScalar => hsum8(acc) + summs,
        MinTerm::SuperQuad => hsum8(acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3])),
    }
}

/// Whether llama.cpp would compute a float matmul of a `rows × cols` weight for a token of
/// `phase` with its batched tinyBLAS kernel (prompt micro-batches; `cols` a multiple of its
/// vector width, `rows` of 4) rather than `ggml_vec_dot_*` (single tokens, or shapes tinyBLAS
/// refuses). pdmesh decides by the token's phase, never by the batch, so a sequence's logits do
/// not depend on what it was batched with.
#[inline(always)]
pub fn float_tiled<F: FloatFormat>(phase: Phase, rows: usize, cols: usize) -> bool {
    let width = match F::KIND {
        FloatKind::BF16 => 32,
        FloatKind::F32 | FloatKind::F16 => 16,
    };
    phase == Phase::Prefill && cols.is_multiple_of(width) && rows.is_multiple_of(4)
}

/// `W[r] · x[t]` for a float weight row, in the order of the llama.cpp kernel `tiled` names
/// (`float_tiled`), against the activations rounded to the weight's type as llama.cpp rounds
/// them.
#[inline(always)]
pub fn dot_float<F: FloatFormat>(row: &[u8], acts: &Activations, t: usize, tiled: bool) -> f32 {
    let n = acts.cols;
    let w = |i: usize| F::at(&row[i * F::BLOCK_BYTES..]);
    let x = &acts.f32[t * n..(t + 1) * n];
    match F::KIND {
        FloatKind::F32 if tiled => ops::lanes16(n, w, |i| x[i]),
        FloatKind::F32 => ops::lanes16x4(n, w, |i| x[i], Tail::F32),
        FloatKind::F16 => {
            let x = &acts.h[t * n..(t + 1) * n];
            if tiled {
                ops::lanes16(n, w, |i| x[i])
            } else {
                ops::lanes16x4(n, w, |i| x[i], Tail::F64)
            }
        }
        FloatKind::BF16 => {
            let x = &acts.bh[t * n..(t + 1) * n];
            let x = |i: usize| bf16::from_bits(x[i]).to_f32();
            if tiled { ops::bf16_lanes16(n, w, x) } else { ops::bf16_lanes16x2(n, w, x) }
        }
    }
}

/// `out[t * ldo + col0 + r]` for `r` in `rows`, every token `t`, for one weight format.
struct Rows<'a, 'w> {
    w: &'a WeightMatrix<'w>,
    acts: &'a Activations,
    rows: std::ops::Range<usize>,
    out: &'a SharedMut<f32>,
    ldo: usize,
    col0: usize,
}

impl Rows<'_, '_> {
    fn each(self, dot: impl Fn(&[u8], usize) -> f32) {
        for r in self.rows.clone() {
            let row = self.w.row(r);
            for t in 0..self.acts.rows {
                // SAFETY: threads own disjoint row ranges, so each element has one writer.
                unsafe { self.out.write(t * self.ldo + self.col0 + r, dot(row, t)) };
            }
        }
    }
}

impl FormatVisitor for Rows<'_, '_> {
    type Out = ();
    fn float<F: FloatFormat>(self) {
        let (acts, w) = (self.acts, self.w);
        debug_assert!(acts.forms.has_float(F::KIND));
        self.each(|row, t| {
            dot_float::<F>(row, acts, t, float_tiled::<F>(acts.phases[t], w.rows, w.cols))
        });
    }
    fn quant<F: QuantFormat>(self) {
        let acts = self.acts;
        self.each(|row, t| dot_quantized::<F>(row, acts, t));
    }
}

/// Computes `out[t * ldo + col0 + r]` for `r` in `rows`, every token `t`.
pub fn matmul_rows(
    w: &WeightMatrix<'_>,
    acts: &Activations,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
) {
    w.ty.visit(Rows { w, acts, rows, out, ldo, col0 });
}

/// `q · k` over one head (`q.len()` elements) of KV at element offset `off`.
#[inline(always)]
pub fn qk_dot(q: &[f32], kv: &KvData, off: usize, phase: Phase) -> f32 {
    match kv {
        KvData::F16(v) => {
            let k = &v[off..off + q.len()];
            ops::qk_dot_lanes(q, |i| k[i].to_f32(), phase)
        }
        KvData::F32(v) => {
            let k = &v[off..off + q.len()];
            ops::qk_dot_lanes(q, |i| k[i], phase)
        }
        KvData::Q8_0(_) => unreachable!("q8_0 KV is read by q8kv::attend_q8"),
    }
}

/// `out += p * v` over one head of KV at element offset `off`.
#[inline(always)]
pub fn kv_axpy(p: f32, kv: &KvData, off: usize, out: &mut [f32]) {
    let n = out.len();
    match kv {
        KvData::F16(v) => {
            for (o, x) in out.iter_mut().zip(&v[off..off + n]) {
                *o = p.mul_add(x.to_f32(), *o);
            }
        }
        KvData::F32(v) => {
            for (o, &x) in out.iter_mut().zip(&v[off..off + n]) {
                *o = p.mul_add(x, *o);
            }
        }
        KvData::Q8_0(_) => unreachable!("q8_0 KV is read by q8kv::attend_q8"),
    }
}
