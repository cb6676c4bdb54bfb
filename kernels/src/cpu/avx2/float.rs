//! AVX2 float-weight matmuls (F32, F16, BF16): llama.cpp's tinyBLAS and `ggml_vec_dot_*`
//! summation orders in registers, as `portable::dot_float` spells them out.

use std::arch::x86_64::*;

use half::bf16;

use super::hsum8;
use crate::cpu::ops::Tail;
use crate::cpu::portable;
use crate::formats::{FloatFormat, FloatKind};
use crate::pool::SharedMut;
use crate::quant::{Activations, WeightMatrix};

/// `ops::lanes16`, the 16 lanes in two registers; `w(i)`/`x(i)` load elements `i..i+8`.
#[inline(always)]
pub(super) unsafe fn lanes16(
    n: usize,
    w: impl Fn(usize) -> __m256,
    x: impl Fn(usize) -> __m256,
) -> f32 {
    // SAFETY: register-only AVX2/FMA operations, enabled by the (inlining) caller.
    unsafe {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for l in (0..n).step_by(16) {
            lo = _mm256_fmadd_ps(w(l), x(l), lo);
            hi = _mm256_fmadd_ps(w(l + 8), x(l + 8), hi);
        }
        hsum8(_mm256_add_ps(hi, lo))
    }
}

/// `ops::lanes16x4`: vector loads `w`/`x` for the whole 64s, scalar `w1`/`x1` for the tail.
#[inline(always)]
pub(super) unsafe fn lanes16x4(
    n: usize,
    w: impl Fn(usize) -> __m256,
    x: impl Fn(usize) -> __m256,
    w1: impl Fn(usize) -> f32,
    x1: impl Fn(usize) -> f32,
    tail: Tail,
) -> f32 {
    // SAFETY: register-only AVX2/FMA operations, enabled by the (inlining) caller.
    let head = unsafe {
        let mut s = [_mm256_setzero_ps(); 8]; // 4 accumulators × 16 lanes
        for i in (0..n & !63).step_by(64) {
            for (r, acc) in s.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(w(i + 8 * r), x(i + 8 * r), *acc);
            }
        }
        let lo = _mm256_add_ps(_mm256_add_ps(s[0], s[4]), _mm256_add_ps(s[2], s[6]));
        let hi = _mm256_add_ps(_mm256_add_ps(s[1], s[5]), _mm256_add_ps(s[3], s[7]));
        hsum8(_mm256_add_ps(hi, lo))
    };
    tail.add(f64::from(head), (n & !63)..n, w1, x1)
}

/// One `dpbf16` step (see `ops`) for 32 bf16 weights at `w` and activations at `x` into the
/// 16 lanes `lo`/`hi`. A 32-bit lane holds elements `2t` (low half) and `2t+1` (high half):
/// masking keeps the odd one as an f32, shifting promotes the even one.
#[inline(always)]
unsafe fn dpbf16(lo: &mut __m256, hi: &mut __m256, w: *const u16, x: *const u16) {
    // SAFETY: the caller guarantees 32 readable elements at `w` and `x`; AVX2/FMA enabled.
    unsafe {
        let mask = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        let odd = |v: __m256i| _mm256_castsi256_ps(_mm256_and_si256(v, mask));
        let even = |v: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        for (acc, at) in [(lo, 0), (hi, 16)] {
            let wv = _mm256_loadu_si256(w.add(at).cast());
            let xv = _mm256_loadu_si256(x.add(at).cast());
            *acc = _mm256_fmadd_ps(odd(wv), odd(xv), *acc);
            *acc = _mm256_fmadd_ps(even(wv), even(xv), *acc);
        }
    }
}

/// `portable::dot_float` with AVX2: the same lanes and order, in registers.
#[inline(always)]
unsafe fn dot_float<F: FloatFormat>(row: &[u8], acts: &Activations, t: usize, tiled: bool) -> f32 {
    let n = acts.cols;
    assert!(row.len() == n * F::BLOCK_BYTES);
    let w1 = |i: usize| F::at(&row[i * F::BLOCK_BYTES..]);
    let p = row.as_ptr();
    // SAFETY: every load reads below `n` (`i + 8 <= n`, or `+ 32` for `dpbf16`), and the
    // row and activation slices hold `n` elements (asserted above and by the slicing below);
    // AVX2/F16C/FMA are enabled in the (inlining) caller.
    unsafe {
        match F::KIND {
            FloatKind::F32 | FloatKind::F16 => {
                let x = if F::KIND == FloatKind::F16 { &acts.h } else { &acts.f32 };
                let x = &x[t * n..(t + 1) * n];
                let w = |i: usize| match F::KIND {
                    FloatKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i).cast())),
                    _ => _mm256_loadu_ps(p.add(4 * i).cast()),
                };
                let xv = |i: usize| _mm256_loadu_ps(x.as_ptr().add(i));
                let tail = if F::KIND == FloatKind::F16 { Tail::F64 } else { Tail::F32 };
                if tiled { lanes16(n, w, xv) } else { lanes16x4(n, w, xv, w1, |i| x[i], tail) }
            }
            FloatKind::BF16 => {
                let x = &acts.bh[t * n..(t + 1) * n];
                let (w, xp) = (p.cast::<u16>(), x.as_ptr());
                let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                if tiled {
                    for l in (0..n).step_by(32) {
                        dpbf16(&mut lo, &mut hi, w.add(l), xp.add(l));
                    }
                    return hsum8(_mm256_add_ps(hi, lo));
                }
                let (mut lo2, mut hi2) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let np = n & !63;
                for i in (0..np).step_by(64) {
                    dpbf16(&mut lo, &mut hi, w.add(i), xp.add(i));
                    dpbf16(&mut lo2, &mut hi2, w.add(i + 32), xp.add(i + 32));
                }
                let head = f64::from(hsum8(_mm256_add_ps(hi, lo)))
                    + f64::from(hsum8(_mm256_add_ps(hi2, lo2)));
                Tail::F64.add(head, np..n, w1, |i| bf16::from_bits(x[i]).to_f32())
            }
        }
    }
}

/// Float-weight matmul: each output in the order its token's phase picks.
#[inline(always)]
pub(super) unsafe fn matmul_float<F: FloatFormat>(
    w: &WeightMatrix<'_>,
    acts: &Activations,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
) {
    debug_assert!(acts.forms.has_float(F::KIND));
    for r in rows {
        let row = w.row(r);
        for t in 0..acts.rows {
            let tiled = portable::float_tiled::<F>(acts.phases[t], w.rows, w.cols);
            // SAFETY: AVX2/FMA/F16C enabled by the caller; threads own disjoint row ranges, so
            // each output element has one writer.
            unsafe { out.write(t * ldo + col0 + r, dot_float::<F>(row, acts, t, tiled)) };
        }
    }
}
