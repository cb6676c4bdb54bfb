//! AVX2 attention kernels: `q·k` over the KV cache, softmax's exp, `p·v` accumulation and f16
//! rounding, each with the operations of its portable twin in `ops`.

use std::arch::x86_64::*;

use super::float::{lanes16, lanes16x4};
use super::hsum8;
use crate::cpu::ops::Tail;
use crate::kv::{KvData, Phase};

/// Eight KV elements as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(kv: &KvData, at: usize) -> __m256 {
    match kv {
        KvData::F16(v) => {
            assert!(at + 8 <= v.len());
            // SAFETY: bounds asserted above.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(at).cast())) }
        }
        KvData::F32(v) => {
            assert!(at + 8 <= v.len());
            // SAFETY: bounds asserted above.
            unsafe { _mm256_loadu_ps(v.as_ptr().add(at)) }
        }
    }
}

/// `q · k` over one head of KV at element offset `off`, in `phase`'s summation order
/// (`ops::qk_dot_lanes` is the reference).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn qk_dot(q: &[f32], kv: &KvData, off: usize, phase: Phase) -> f32 {
    let n = q.len();
    assert!(n.is_multiple_of(16));
    let qv = |i: usize| -> __m256 {
        // SAFETY: callers pass `i + 8 <= n`.
        unsafe { _mm256_loadu_ps(q.as_ptr().add(i)) }
    };
    // SAFETY: (all `load8` calls) `off + n` lies within the KV buffer; AVX2 enabled here.
    let kv8 = |i: usize| unsafe { load8(kv, off + i) };
    let k1 = |i: usize| match kv {
        KvData::F16(v) => v[off + i].to_f32(),
        KvData::F32(v) => v[off + i],
    };
    // SAFETY: AVX2/FMA enabled here; the loads are in bounds as above.
    unsafe {
        match phase {
            Phase::Prefill => lanes16(n, kv8, qv),
            Phase::Decode => lanes16x4(n, kv8, qv, k1, |i| q[i], Tail::F64),
        }
    }
}

/// Eight lanes of the f32 whose bits are `bits`.
#[inline(always)]
unsafe fn splat(bits: u32) -> __m256 {
    // SAFETY: AVX is enabled in the (inlining) caller.
    unsafe { _mm256_set1_ps(f32::from_bits(bits)) }
}

/// `2^e` for four integral exponents `e` (|e| <= 192), as f64.
#[inline(always)]
unsafe fn pow2_f64(e: __m128i) -> __m256d {
    // SAFETY: register-only AVX2 operations, enabled by the (inlining) caller.
    unsafe {
        let biased = _mm_add_epi32(e, _mm_set1_epi32(1023));
        _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_cvtepi32_epi64(biased), 52))
    }
}

/// `ops::exp` on eight lanes: the same operations, each with the same rounding (the final
/// `j · 2^n` exact in f64, then one rounding to f32).
#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    // SAFETY: register-only AVX2/FMA operations, enabled by the (inlining) caller.
    unsafe {
        let shift = splat(0x4b40_0000);
        let n = _mm256_sub_ps(_mm256_fmadd_ps(x, splat(0x3fb8_aa3b), shift), shift);
        let b = _mm256_fnmadd_ps(n, splat(0x35bf_be8e), _mm256_fnmadd_ps(n, splat(0x3f31_7200), x));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(splat(0x3c07_2010), b, splat(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(splat(0x3e2a_af33), b, splat(0x3eff_fedb)),
            ),
            u,
            _mm256_fmadd_ps(splat(0x3f7f_fff6), b, _mm256_set1_ps(1.0)),
        );
        // n is integral, so the conversion is exact; lanes with |n| > 192 are replaced below.
        let e = _mm256_cvtps_epi32(n);
        let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(j));
        let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(j, 1));
        let lo = _mm256_cvtpd_ps(_mm256_mul_pd(lo, pow2_f64(_mm256_castsi256_si128(e))));
        let hi = _mm256_cvtpd_ps(_mm256_mul_pd(hi, pow2_f64(_mm256_extracti128_si256(e, 1))));
        let r = _mm256_set_m128(hi, lo);
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        let neg = _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps());
        let sat = _mm256_blendv_ps(_mm256_set1_ps(f32::INFINITY), _mm256_setzero_ps(), neg);
        _mm256_blendv_ps(r, sat, big)
    }
}

/// `ops::Isa::exp16` with AVX2: both halves of the chunk at once.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn exp16(chunk: &mut [f32], max: f32, valid: usize) -> f32 {
    assert!(chunk.len() == 16 && valid <= 16);
    let m = _mm256_set1_ps(max);
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let p = chunk.as_mut_ptr();
    let mut halves = [_mm256_setzero_ps(); 2];
    for (h, out) in halves.iter_mut().enumerate() {
        // Lanes `8h + i` with `8h + i < valid` are live; the others stay as they are (zero).
        let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32 - 8 * h as i32), lane);
        let live = _mm256_castsi256_ps(live);
        // SAFETY: `chunk` holds 16 floats (asserted); AVX2/FMA are enabled here.
        unsafe {
            let at = p.add(8 * h);
            let v = _mm256_loadu_ps(at);
            let e = _mm256_and_ps(exp8(_mm256_sub_ps(v, m)), live);
            _mm256_storeu_ps(at, _mm256_blendv_ps(v, e, live));
            *out = e;
        }
    }
    hsum8(_mm256_add_ps(halves[1], halves[0]))
}

/// `out += p * v` over one head of KV at element offset `off`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn kv_axpy(p: f32, kv: &KvData, off: usize, out: &mut [f32]) {
    let n = out.len();
    assert!(n.is_multiple_of(8));
    let pv = _mm256_set1_ps(p);
    match kv {
        KvData::F16(v) => {
            let x = &v[off..off + n];
            for i in (0..n).step_by(8) {
                // SAFETY: `i + 8 <= n` for both slices.
                unsafe {
                    let xf = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i).cast()));
                    let o = out.as_mut_ptr().add(i);
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(pv, xf, _mm256_loadu_ps(o)));
                }
            }
        }
        KvData::F32(v) => {
            let x = &v[off..off + n];
            for i in (0..n).step_by(8) {
                // SAFETY: `i + 8 <= n` for both slices.
                unsafe {
                    let xf = _mm256_loadu_ps(x.as_ptr().add(i));
                    let o = out.as_mut_ptr().add(i);
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(pv, xf, _mm256_loadu_ps(o)));
                }
            }
        }
    }
}

/// Rounds each value to the nearest f16 (ties to even) and back, eight at a time.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn round_f16_slice(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(8);
    for c in chunks.by_ref() {
        // SAFETY: `c` holds exactly eight floats.
        unsafe {
            let v = _mm256_loadu_ps(c.as_ptr());
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    for v in chunks.into_remainder() {
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(*v));
        *v = _mm_cvtss_f32(_mm_cvtph_ps(h));
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::{Simd, ops};

    /// The vector exp rounds as `ops::exp` does at every step, over the whole range softmax
    /// feeds it (scores minus their max, so ≤ 0) and past both saturation points.
    #[test]
    fn exp16_equals_scalar_exp() {
        if !Simd::Avx2.is_supported() {
            return;
        }
        let mut x = -140.0f32;
        let mut seen = 0;
        let mut values: Vec<f32> = vec![0.0, -0.0, 1.0, 88.0, 89.0, -87.3, -103.9, -200.0, 300.0];
        while x < 2.0 {
            values.push(x);
            x += 0.013_7;
        }
        for chunk in values.chunks(16) {
            for valid in [chunk.len(), chunk.len() / 2] {
                let mut v = [0f32; 16];
                v[..chunk.len()].copy_from_slice(chunk);
                let mut want = v;
                let mut e = [0f32; 16];
                for t in 0..valid {
                    want[t] = ops::exp(v[t] - 0.5);
                    e[t] = want[t];
                }
                let want_sum = ops::reduce16(&e);
                // SAFETY: AVX2 checked above.
                let sum = unsafe { super::exp16(&mut v, 0.5, valid) };
                assert_eq!(v.map(f32::to_bits), want.map(f32::to_bits), "{chunk:?} valid {valid}");
                assert_eq!(sum.to_bits(), want_sum.to_bits());
                seen += valid;
            }
        }
        assert!(seen > 10_000);
    }
}
