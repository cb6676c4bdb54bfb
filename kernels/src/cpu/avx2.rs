//! AVX2/FMA/F16C kernels, chosen at run time. Each computes every output element with exactly
//! the operations of its portable twin (same lane sums, same FMA order, same horizontal sum),
//! so the two agree bit for bit and the tests compare them for equality.
//!
//! The quantized matmul is register-tiled: a tile of weight rows × tokens unpacks each weight
//! block once and reuses it for every token of the tile. Tile sizes change how fast a result is
//! reached, never the operations that produce it, which keeps logits batch-invariant.
//!
//! This file holds the quantized matmuls and activation quantization; float weights are in
//! `float`, attention and softmax in `attention`.

use std::arch::x86_64::*;

use crate::formats::{ActForm, FloatFormat, MinTerm, QuantFormat};
use crate::pool::SharedMut;
use crate::quant::{Activations, FormatVisitor, QK, QK_K, WeightMatrix, round_f16};

use super::portable;

mod attention;
mod float;

pub(crate) use attention::attend;
pub use attention::{
    attend_fits, dequantize_row_q8_0, dot_q8_0, exp16, kv_axpy, qk_dot, round_f16_slice,
};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum8(x: __m256) -> f32 {
    let hi = _mm256_extractf128_ps(x, 1);
    let q = _mm_add_ps(hi, _mm256_castps256_ps128(x));
    let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    let q = _mm_add_ss(q, _mm_movehdup_ps(q));
    _mm_cvtss_f32(q)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32(p: *const u8) -> f32 {
    // A broadcast load that writes the whole register. Whatever intrinsics say, the compiler
    // makes a two-byte load into lane 0 a `vpinsrw` into a register it picks freely, with a
    // false dependency on that register's last value; at T=1 that tied each block to the
    // previous block's FMA (Q8_0 with the AVX-512 kernels: 2.7 ns per 32 weights, not 1.1).
    let v: __m128i;
    // SAFETY: the caller guarantees two readable bytes at `p`; AVX2 is enabled here.
    unsafe {
        std::arch::asm!(
            "vpbroadcastw {v}, word ptr [{p}]",
            v = out(xmm_reg) v,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    _mm_cvtss_f32(_mm_cvtph_ps(v))
}

/// Eight lanes of the float at `p`, loaded by the broadcast itself. Written as assembly so the
/// compiler keeps it a load: it would otherwise forward the just-stored value through a
/// shuffle, which takes the vector unit this is meant to spare.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn broadcast_mem(p: *const f32) -> __m256 {
    let v: __m256;
    // SAFETY: the caller guarantees four readable bytes at `p`; AVX is enabled by the caller.
    unsafe {
        std::arch::asm!(
            "vbroadcastss {v}, dword ptr [{p}]",
            v = out(ymm_reg) v,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    v
}

/// Loads `T` (≤ 8) consecutive floats into the low lanes of a vector.
#[inline(always)]
unsafe fn load_partial<const T: usize>(p: *const f32) -> __m256 {
    // SAFETY: the caller guarantees `T` readable floats at `p`; AVX2 is enabled by the caller.
    unsafe {
        match T {
            8 => _mm256_loadu_ps(p),
            4 => _mm256_zextps128_ps256(_mm_loadu_ps(p)),
            1 => _mm256_zextps128_ps256(_mm_set_ss(*p)),
            _ => {
                let mut tmp = [0f32; 8];
                std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), T);
                _mm256_loadu_ps(tmp.as_ptr())
            }
        }
    }
}

/// How far ahead (in bytes) the kernels prefetch the weight stream: every cache line of the
/// block 2 KB on. Prefetching one line per block 8 rows ahead, as before, missed most lines of
/// the 144-210 byte K-quant blocks and cost more than it hid (1B Q4_K_M decode, same run:
/// no prefetch 41-46, 2 KB 45-47, 8 KB 44-45 tok/s; one line 8 rows ahead 32-35).
const PREFETCH_BYTES: usize = 2048;

/// Computes the `R × T` outputs for weight rows `r0..r0+R` and tokens `t0..t0+T`, in the
/// order `portable::dot_quantized` spells out.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn tile<F: QuantFormat, const VNNI: bool, const R: usize, const T: usize>(
    w: &WeightMatrix<'_>,
    r0: usize,
    acts: &Activations,
    t0: usize,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
    prefetch: bool,
) {
    let be = F::BLOCK_ELEMS;
    let nb = acts.cols / be;
    let rb = w.row_bytes();
    debug_assert!(r0 + R <= w.rows && t0 + T <= acts.rows && T <= 8);
    debug_assert_eq!(rb, nb * F::BLOCK_BYTES);
    let base = w.data.as_ptr();
    let (aq, ad) = match F::ACT {
        ActForm::Q8 => (acts.qs.as_ptr(), acts.d.as_ptr()),
        ActForm::Q8K => (acts.kqs.as_ptr(), acts.kd.as_ptr()),
    };
    let as_ = acts.s.as_ptr();
    let ks = acts.ksums.as_ptr();
    let kp = acts.kpairs.as_ptr();
    let k_min = matches!(F::MIN, MinTerm::SuperQuad | MinTerm::SuperScalar);
    // SAFETY: (whole body) every pointer offset below stays inside `w.data` (rows r0..r0+R,
    // blocks 0..nb of `rb` bytes each) or inside the activation buffers (tokens t0..t0+T,
    // sized by `Activations::resize` for this format's form); AVX2/FMA/F16C are enabled by
    // the calling kernel.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut summ = [_mm256_setzero_ps(); R];
        let mut acc_m = [[_mm_setzero_ps(); T]; R];
        let mut summs = [[0f32; T]; R];
        for b in 0..nb {
            let row0 = base.add(r0 * rb + b * F::BLOCK_BYTES);
            let mut wv = [F::unpack(row0); R];
            let mut wd = [_mm256_setzero_ps(); R];
            let mut wm = [0f32; R];
            let mut wmn = [_mm_setzero_ps(); R];
            for r in 0..R {
                let blk = row0.add(r * rb);
                if prefetch {
                    // Weights stream from memory once per step: fetch rows ahead while computing.
                    // A fixed count per block (no branch to mispredict): lines a block's hints
                    // miss at its end are the next block's first.
                    let ahead = blk.wrapping_add(PREFETCH_BYTES);
                    for line in 0..F::BLOCK_BYTES.div_ceil(64) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
                    }
                }
                if r > 0 {
                    wv[r] = F::unpack(blk);
                }
                wd[r] = _mm256_set1_ps(f16_to_f32(blk.add(F::SCALE_AT)));
                if !matches!(F::MIN, MinTerm::None) {
                    wm[r] = f16_to_f32(blk.add(F::MIN_AT));
                    wmn[r] = _mm_set1_ps(-wm[r]);
                }
            }
            // Chunked formats form every (row, token) lane sum of the block first, unpacking
            // each 32-weight chunk and its scales once for all the tile's tokens.
            let mut ksumi = [[_mm256_setzero_si256(); T]; R];
            if F::CHUNKED {
                for c in 0..be / 32 {
                    for r in 0..R {
                        let (q, sc) = F::chunk(&wv[r], c);
                        for t in 0..T {
                            let a = aq.add((t0 + t) * acts.cols + b * be + 32 * c);
                            let p = _mm256_maddubs_epi16(q, load_i(a));
                            ksumi[r][t] = if VNNI {
                                // The same exact integer sum, its add fused into the multiply.
                                _mm256_dpwssd_epi32(ksumi[r][t], sc, p)
                            } else {
                                _mm256_add_epi32(ksumi[r][t], _mm256_madd_epi16(sc, p))
                            };
                        }
                    }
                }
            }
            // Blocks with a scale per 32 weights: the tile's scale products `wd·da` come from
            // one multiply per row for all its tokens (a multiply per row and token was a third
            // of the float work). With AVX-512 each is then broadcast from memory by the FMA's
            // load; AVX2 has fewer vector registers and its tile a single row, whose FMAs would
            // wait on the store just before: a lane permute is faster there (default model,
            // 16 streams, 2 threads, AVX2, 9 alternating runs: +9% median, new faster in 7).
            let by_row = T >= 4 && matches!(F::ACT, ActForm::Q8);
            let mut ddv = [_mm256_setzero_ps(); R];
            let mut ddm = [[0f32; 8]; R];
            if by_row {
                let das = load_partial::<T>(ad.add(b * acts.rows + t0));
                for r in 0..R {
                    ddv[r] = _mm256_mul_ps(wd[r], das);
                    if VNNI {
                        _mm256_storeu_ps(ddm[r].as_mut_ptr(), ddv[r]);
                    }
                }
            }
            for t in 0..T {
                let a = aq.add((t0 + t) * acts.cols + b * be);
                let dat = match F::ACT {
                    ActForm::Q8 => *ad.add(b * acts.rows + t0 + t),
                    ActForm::Q8K => *ad.add((t0 + t) * nb + b),
                };
                let da = _mm256_set1_ps(dat);
                let sums = match F::ACT {
                    ActForm::Q8 => std::ptr::null(),
                    ActForm::Q8K => ks.add(((t0 + t) * nb + b) * (QK_K / 16)),
                };
                for r in 0..R {
                    let sumi = if F::CHUNKED {
                        _mm256_sub_epi32(ksumi[r][t], F::chunk_offset(&wv[r], sums))
                    } else if VNNI {
                        F::dot_vnni(&wv[r], a, sums)
                    } else {
                        F::dot(&wv[r], a, sums, ones)
                    };
                    let dd = if by_row {
                        if VNNI {
                            broadcast_mem(ddm[r].as_ptr().add(t))
                        } else {
                            _mm256_permutevar8x32_ps(ddv[r], _mm256_set1_epi32(t as i32))
                        }
                    } else {
                        _mm256_mul_ps(wd[r], da)
                    };
                    acc[r][t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi), acc[r][t]);
                    if k_min {
                        let pairs = kp.add(((t0 + t) * nb + b) * (QK_K / 32));
                        let prod = F::min_prod(&wv[r], pairs);
                        let dmin = -(dat * wm[r]);
                        if matches!(F::MIN, MinTerm::SuperQuad) {
                            // -(dat·m) = (-m)·dat exactly: one vector multiply, no broadcast.
                            let dmin = _mm_mul_ps(wmn[r], _mm256_castps256_ps128(da));
                            acc_m[r][t] = _mm_fmadd_ps(dmin, _mm_cvtepi32_ps(prod), acc_m[r][t]);
                        } else {
                            summs[r][t] = dmin.mul_add(hsum_i32_4(prod) as f32, summs[r][t]);
                        }
                    }
                }
            }
            if matches!(F::MIN, MinTerm::PerBlock) {
                let s = load_partial::<T>(as_.add(b * acts.rows + t0));
                for r in 0..R {
                    summ[r] = _mm256_fmadd_ps(_mm256_set1_ps(wm[r]), s, summ[r]);
                }
            }
        }
        for r in 0..R {
            let mut sm = [0f32; 8];
            _mm256_storeu_ps(sm.as_mut_ptr(), summ[r]);
            for t in 0..T {
                let h = hsum8(acc[r][t]);
                let v = match F::MIN {
                    MinTerm::None => h,
                    MinTerm::PerBlock => h + sm[t],
                    MinTerm::SuperQuad => {
                        let m = acc_m[r][t];
                        let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
                        h + _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)))
                    }
                    MinTerm::SuperScalar => h + summs[r][t],
                };
                out.write((t0 + t) * ldo + col0 + r0 + r, v);
            }
        }
    }
}

/// 32 quants at `a`.
#[inline(always)]
unsafe fn load_i(a: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(a.cast()) }
}

/// The sum of four i32 lanes (exact: the order is immaterial).
#[inline(always)]
unsafe fn hsum_i32_4(x: __m128i) -> i32 {
    // SAFETY: register-only SSE2 operations.
    unsafe {
        let s = _mm_add_epi32(x, _mm_unpackhi_epi64(x, x));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01)))
    }
}

#[inline(always)]
unsafe fn matmul_format<F: QuantFormat, const VNNI: bool>(
    w: &WeightMatrix<'_>,
    acts: &Activations,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
) {
    let n_tok = acts.rows;
    // SAFETY: (whole body) tiles stay within `rows` and `0..n_tok`; AVX2 is enabled by the caller.
    unsafe {
        if n_tok < 4 {
            // Decode-sized batches stream the weights from memory once: one row at a time keeps
            // that one sequential stream, which the prefetchers follow far better than 4-row
            // tiles' four interleaved ones (1B Q4_K_M decode: 16 → 28-31 tok/s, 2 threads).
            // Chunked formats take the row's tokens together, unpacking each chunk once.
            for r in rows {
                match n_tok {
                    2 if F::CHUNKED => tile::<F, VNNI, 1, 2>(w, r, acts, 0, out, ldo, col0, true),
                    3 if F::CHUNKED => tile::<F, VNNI, 1, 3>(w, r, acts, 0, out, ldo, col0, true),
                    _ => {
                        for t in 0..n_tok {
                            tile::<F, VNNI, 1, 1>(w, r, acts, t, out, ldo, col0, t == 0);
                        }
                    }
                }
            }
            return;
        }
        // Token chunks keep the activations a tile streams resident in L1/L2. Within a chunk,
        // tokens go in groups of 8, then 4, then singles. Rows go in chunks that every group
        // of the token chunk uses while they are still in L1/L2, so a weight streams from
        // memory once per token chunk, not once per group.
        const TOK_CHUNK: usize = 64;
        const ROW_CHUNK: usize = 24;
        let mut tc = 0;
        while tc < n_tok {
            let te = (tc + TOK_CHUNK).min(n_tok);
            let mut rc = rows.start;
            while rc < rows.end {
                let chunk = rc..(rc + ROW_CHUNK).min(rows.end);
                let mut t = tc;
                // One token group of `T` against the row chunk, `R` (`RK`) rows per tile.
                macro_rules! pass {
                    ($r:literal, $rk:literal, $t:literal) => {{
                        let first = t == tc;
                        rows_pass::<F, VNNI, $r, $rk, $t>(
                            w,
                            chunk.clone(),
                            acts,
                            t,
                            first,
                            out,
                            ldo,
                            col0,
                        );
                        t += $t;
                    }};
                }
                while t + 8 <= te {
                    pass!(2, 1, 8);
                }
                while t + 4 <= te {
                    pass!(3, 1, 4);
                }
                while t < te {
                    pass!(4, 2, 1);
                }
                rc = chunk.end;
            }
            tc = te;
        }
    }
}

/// One group of `T` tokens against every row of `rows`, `R` rows at a time (`RK` for chunked
/// formats, which keep a lane sum per tile element in registers through the block: one row
/// per tile leaves room for them, 1B Q4_K_M prefill +12%); `pf`: prefetch the rows ahead (the
/// first group to read these rows).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_pass<
    F: QuantFormat,
    const VNNI: bool,
    const R: usize,
    const RK: usize,
    const T: usize,
>(
    w: &WeightMatrix<'_>,
    rows: std::ops::Range<usize>,
    acts: &Activations,
    t: usize,
    pf: bool,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
) {
    let mut r = rows.start;
    // A tile keeps R × T accumulators live: AVX-512's 32 vector registers hold 16 of them,
    // AVX2's 16 would spill, so without VNNI (AVX-512) such a tile takes one row at a time.
    let fits = VNNI || R * T < 16;
    // SAFETY: tiles stay within `rows` and the token group; AVX2 is enabled by the caller.
    unsafe {
        let step = if F::CHUNKED {
            RK
        } else if fits {
            R
        } else {
            1
        };
        while r + step <= rows.end {
            if F::CHUNKED {
                tile::<F, VNNI, RK, T>(w, r, acts, t, out, ldo, col0, pf);
            } else if fits {
                tile::<F, VNNI, R, T>(w, r, acts, t, out, ldo, col0, pf);
            } else {
                tile::<F, VNNI, 1, T>(w, r, acts, t, out, ldo, col0, pf);
            }
            r += step;
        }
        while r < rows.end {
            tile::<F, VNNI, 1, T>(w, r, acts, t, out, ldo, col0, pf);
            r += 1;
        }
    }
}

/// The tile kernels for one weight format; float weights take the shared code.
struct Dispatch<'a, 'w, const VNNI: bool> {
    w: &'a WeightMatrix<'w>,
    acts: &'a Activations,
    rows: std::ops::Range<usize>,
    out: &'a SharedMut<f32>,
    ldo: usize,
    col0: usize,
}

impl<const VNNI: bool> FormatVisitor for Dispatch<'_, '_, VNNI> {
    type Out = ();
    #[inline(always)]
    fn float<F: FloatFormat>(self) {
        // SAFETY: as for `quant` below.
        unsafe {
            float::matmul_float::<F>(self.w, self.acts, self.rows, self.out, self.ldo, self.col0)
        }
    }
    #[inline(always)]
    fn quant<F: QuantFormat>(self) {
        debug_assert!(self.acts.has(F::ACT));
        // SAFETY: only reached from the `#[target_feature]` kernels below, whose callers
        // checked the CPU features; bounds are their callers' contract.
        unsafe {
            matmul_format::<F, VNNI>(self.w, self.acts, self.rows, self.out, self.ldo, self.col0)
        }
    }
}

#[inline(always)]
fn matmul_dispatch<const VNNI: bool>(
    w: &WeightMatrix<'_>,
    acts: &Activations,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
) {
    w.ty.visit(Dispatch::<VNNI> { w, acts, rows, out, ldo, col0 });
}

/// AVX2 version of `portable::matmul_rows`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `out` must have room for `acts.rows × ldo`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matmul_rows(
    w: &WeightMatrix<'_>,
    acts: &Activations,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
) {
    matmul_dispatch::<false>(w, acts, rows, out, ldo, col0)
}

/// `matmul_rows` with the integer dot products done by AVX512-VNNI (256-bit forms).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX512-VNNI and AVX512-VL; as `matmul_rows` otherwise.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub unsafe fn matmul_rows_vnni(
    w: &WeightMatrix<'_>,
    acts: &Activations,
    rows: std::ops::Range<usize>,
    out: &SharedMut<f32>,
    ldo: usize,
    col0: usize,
) {
    matmul_dispatch::<true>(w, acts, rows, out, ldo, col0)
}

/// AVX2 version of `portable::quantize_rows`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the buffers must be sized for `n_rows × cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_rows(
    x: &[f32],
    cols: usize,
    qs: &SharedMut<i8>,
    d: &SharedMut<f32>,
    s_tr: &SharedMut<f32>,
    n_rows: usize,
    rows: std::ops::Range<usize>,
) {
    let nb = cols / QK;
    assert!(x.len() >= n_rows * cols && rows.end <= n_rows);
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for t in rows {
        for b in 0..nb {
            let o = t * cols + b * QK;
            // SAFETY: `o + 32 <= x.len()` by the assert above; AVX2 enabled on this function.
            let (v0, v1, v2, v3) = unsafe {
                let p = x.as_ptr().add(o);
                (
                    _mm256_loadu_ps(p),
                    _mm256_loadu_ps(p.add(8)),
                    _mm256_loadu_ps(p.add(16)),
                    _mm256_loadu_ps(p.add(24)),
                )
            };
            let m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
            let m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3));
            let m = _mm256_max_ps(m01, m23);
            let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let dsc = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mul = _mm256_set1_ps(id);
            const RN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let i0 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v0, mul)));
            let i1 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v1, mul)));
            let i2 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v2, mul)));
            let i3 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v3, mul)));
            let sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            let s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
            let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01));
            let isum = _mm_cvtsi128_si32(s4);
            let p01 = _mm256_packs_epi32(i0, i1);
            let p23 = _mm256_packs_epi32(i2, i3);
            let packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
            // SAFETY: each (t, b) is written by exactly one thread (rows are disjoint per thread)
            // and the indices are within the buffers sized for `n_rows × cols`.
            unsafe {
                _mm256_storeu_si256(qs.slice(o..o + QK).as_mut_ptr().cast(), packed);
                d.write(b * n_rows + t, round_f16(dsc));
                s_tr.write(b * n_rows + t, round_f16(dsc * isum as f32));
            }
        }
    }
}

/// `portable::quantize_rows_k`, the same code compiled with AVX2 enabled: its rounding then
/// inlines as `vroundss` instead of a libm call per element, and its loops vectorize.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_rows_k(
    x: &[f32],
    cols: usize,
    kqs: &SharedMut<i8>,
    kd: &SharedMut<f32>,
    ksums: &SharedMut<i16>,
    kpairs: &SharedMut<i16>,
    rows: std::ops::Range<usize>,
) {
    portable::quantize_rows_k(x, cols, kqs, kd, ksums, kpairs, rows)
}
