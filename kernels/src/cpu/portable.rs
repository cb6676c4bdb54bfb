//! Portable kernels: plain Rust that runs anywhere and is the reference the SIMD kernels are
//! tested against. They reproduce the SIMD lane structure (eight partial sums per block, then a
//! fixed pairwise horizontal sum) so both give bit-identical results.

use crate::kv::{KvData, Phase};
use crate::pool::SharedMut;
use crate::quant::{Activations, QK, WeightMatrix, WeightType, f16_at, quantize_block};

/// The horizontal sum order of an 8-lane AVX register used throughout (as llama.cpp's
/// `hsum_float_8`): `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline(always)]
pub fn hsum8(a: [f32; 8]) -> f32 {
    let q = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// Quantizes rows `rows` of `x` (`n_rows × cols`) into the activation buffers; `s_tr` is
/// block-major (`[block][row]`) so tiles can load the min terms of consecutive tokens at once.
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
                d.write(t * nb + b, db);
                s_tr.write(b * n_rows + t, sb);
            }
        }
    }
}

/// Integer dot products of one weight block against 32 activation quants, as eight lane sums of
/// four consecutive elements each.
#[inline(always)]
fn lanes_q4_1(qs: &[u8], a: &[i8]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for j in 0..QK / 2 {
        lanes[j / 4] += i32::from(qs[j] & 0xF) * i32::from(a[j]);
        lanes[(j + QK / 2) / 4] += i32::from(qs[j] >> 4) * i32::from(a[j + QK / 2]);
    }
    lanes
}

#[inline(always)]
fn lanes_q4_0(qs: &[u8], a: &[i8]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for j in 0..QK / 2 {
        lanes[j / 4] += (i32::from(qs[j] & 0xF) - 8) * i32::from(a[j]);
        lanes[(j + QK / 2) / 4] += (i32::from(qs[j] >> 4) - 8) * i32::from(a[j + QK / 2]);
    }
    lanes
}

#[inline(always)]
fn lanes_q8_0(qs: &[u8], a: &[i8]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for j in 0..QK {
        lanes[j / 4] += i32::from(qs[j] as i8) * i32::from(a[j]);
    }
    lanes
}

/// `W[r] · x[t]` for a quantized weight row.
pub fn dot_quantized(ty: WeightType, row: &[u8], acts: &Activations, t: usize) -> f32 {
    let nb = acts.blocks_per_row();
    let a = &acts.qs[t * acts.cols..(t + 1) * acts.cols];
    let d = &acts.d[t * nb..(t + 1) * nb];
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (b, blk) in row.chunks_exact(ty.block_bytes()).enumerate() {
        let ab = &a[b * QK..(b + 1) * QK];
        let lanes = match ty {
            WeightType::Q4_1 => lanes_q4_1(&blk[4..], ab),
            WeightType::Q4_0 => lanes_q4_0(&blk[2..], ab),
            WeightType::Q8_0 => lanes_q8_0(&blk[2..], ab),
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => {
                unreachable!("float weights take dot_float")
            }
        };
        let dd = f16_at(blk) * d[b];
        for l in 0..8 {
            acc[l] = dd.mul_add(lanes[l] as f32, acc[l]);
        }
        if ty == WeightType::Q4_1 {
            summs = f16_at(&blk[2..]).mul_add(acts.s[b * acts.rows + t], summs);
        }
    }
    hsum8(acc) + summs
}

/// `W[r] · x[t]` for a float weight row against the f32 activations.
#[inline(always)]
pub fn dot_float(ty: WeightType, row: &[u8], x: &[f32]) -> f32 {
    let width = ty.block_bytes();
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    let mut i = 0;
    for c in chunks.by_ref() {
        for l in 0..8 {
            acc[l] = weight_at(ty, &row[(i + l) * width..]).mul_add(c[l], acc[l]);
        }
        i += 8;
    }
    let mut tail = 0f32;
    for &xv in chunks.remainder() {
        tail = weight_at(ty, &row[i * width..]).mul_add(xv, tail);
        i += 1;
    }
    hsum8(acc) + tail
}

#[inline(always)]
fn weight_at(ty: WeightType, b: &[u8]) -> f32 {
    match ty {
        WeightType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        WeightType::F16 => f16_at(b),
        WeightType::BF16 => half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1 => {
            unreachable!("quantized weights take dot_quantized")
        }
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
    for r in rows {
        let row = w.row(r);
        for t in 0..acts.rows {
            let v = if w.ty.is_quantized() {
                dot_quantized(w.ty, row, acts, t)
            } else {
                dot_float(w.ty, row, &acts.f32[t * acts.cols..(t + 1) * acts.cols])
            };
            // SAFETY: threads own disjoint row ranges, so each element has one writer.
            unsafe { out.write(t * ldo + col0 + r, v) };
        }
    }
}

/// `q · k` over one head (`q.len()` elements) of KV at element offset `off`.
#[inline(always)]
pub fn qk_dot(q: &[f32], kv: &KvData, off: usize, phase: Phase) -> f32 {
    match kv {
        KvData::F16(v) => {
            let k = &v[off..off + q.len()];
            super::ops::qk_dot_lanes(q, |i| k[i].to_f32(), phase)
        }
        KvData::F32(v) => {
            let k = &v[off..off + q.len()];
            super::ops::qk_dot_lanes(q, |i| k[i], phase)
        }
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
    }
}
