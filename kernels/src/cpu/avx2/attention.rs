//! AVX2 attention kernels: `q·k` over the KV cache, softmax's exp, `p·v` accumulation and f16
//! rounding, each with the operations of its portable twin in `ops`.

use std::arch::x86_64::*;

use super::float::{lanes16, lanes16x4};
use super::hsum8;
use crate::cpu::ops::AttnScratch;
use crate::cpu::ops::Tail;
use crate::kv::{AttnQuery, KvData, KvGeometry, Phase};

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
        KvData::Q8_0(_) => unreachable!("q8_0 KV is read by q8kv::attend_q8"),
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
        KvData::Q8_0(_) => unreachable!("q8_0 KV is read by q8kv::attend_q8"),
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
pub unsafe fn exp16(chunk: &mut [f32], max: f32, from: usize, valid: usize) -> f32 {
    assert!(chunk.len() == 16 && valid <= 16 && from <= 16);
    let m = _mm256_set1_ps(max);
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let p = chunk.as_mut_ptr();
    let mut halves = [_mm256_setzero_ps(); 2];
    for (h, out) in halves.iter_mut().enumerate() {
        // Lanes `8h + i` below `valid` are written: their exp when at or past `from`, zero
        // (masked) before it; the lanes past `valid` stay as they are (zero).
        let lane = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h as i32));
        let inside = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32), lane);
        let masked = _mm256_cmpgt_epi32(_mm256_set1_epi32(from as i32), lane);
        let live = _mm256_castsi256_ps(_mm256_andnot_si256(masked, inside));
        let inside = _mm256_castsi256_ps(inside);
        // SAFETY: `chunk` holds 16 floats (asserted); AVX2/FMA are enabled here.
        unsafe {
            let at = p.add(8 * h);
            let v = _mm256_loadu_ps(at);
            let e = _mm256_and_ps(exp8(_mm256_sub_ps(v, m)), live);
            _mm256_storeu_ps(at, _mm256_blendv_ps(v, e, inside));
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
        KvData::Q8_0(_) => unreachable!("q8_0 KV is read by q8kv::attend_q8"),
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

/// A KV element type the batched kernel reads: eight of them as f32.
trait KvElem: Copy {
    /// Whether q and the probabilities are rounded to this type first.
    const HALF: bool;
    /// # Safety
    /// Eight elements must be readable at `p`; AVX2/F16C enabled by the caller.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl KvElem for half::f16 {
    const HALF: bool = true;
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl KvElem for f32 {
    const HALF: bool = false;
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
}

/// `hsum8` of eight vectors at once: lane `k` of the result is `hsum8(v[k])`, from the same
/// additions (each pairs the same two values; only operand order, which IEEE addition ignores,
/// differs), so a score costs a third of a horizontal sum.
#[inline(always)]
unsafe fn hsum8x8(v: &[__m256; 8]) -> __m256 {
    // SAFETY: register-only AVX operations, enabled by the (inlining) caller.
    unsafe {
        // q[k]: the four `hi + lo` lanes of v[k] in the low half, of v[k + 4] in the high half.
        let q: [__m256; 4] = std::array::from_fn(|k| {
            let lo = _mm256_permute2f128_ps::<0x20>(v[k], v[k + 4]);
            let hi = _mm256_permute2f128_ps::<0x31>(v[k], v[k + 4]);
            _mm256_add_ps(hi, lo)
        });
        // Lanes 0 + 2 and 1 + 3 of each (`q + movehl(q)`), two vectors per register half.
        let pair = |a: __m256, b: __m256| {
            _mm256_add_ps(_mm256_shuffle_ps::<0x44>(a, b), _mm256_shuffle_ps::<0xEE>(a, b))
        };
        let (t01, t23) = (pair(q[0], q[1]), pair(q[2], q[3]));
        // The last step (`+ movehdup`): v0..v3 in the low half, v4..v7 in the high one.
        _mm256_add_ps(_mm256_shuffle_ps::<0x88>(t01, t23), _mm256_shuffle_ps::<0xDD>(t01, t23))
    }
}

/// Whether `attend` covers a head of `head_dim` in `phase`: decode's summation order is
/// batched only over whole 64s (`ops::attend` takes the others).
pub fn attend_fits(head_dim: usize, phase: Phase) -> bool {
    match phase {
        Phase::Prefill => head_dim.is_multiple_of(16),
        Phase::Decode => head_dim.is_multiple_of(64),
    }
}

/// `ops::attend` for the query heads in `q` that share KV head `kv_head`, computing each
/// value with the same operations in the same order, batched for the machine:
/// - each K row is loaded once for up to four query heads, and eight keys' score vectors are
///   summed horizontally together (`hsum8x8`);
/// - `p·v` runs one 8-dim slice of V at a time with eight lane sets in registers, instead
///   of reading and writing every set's accumulator in memory for every key; sets no key
///   reached (short contexts) are never stored or loaded.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `attend_fits(head_dim, phase)`; `query.blocks`
/// names blocks of `kv` (checked by the caller).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn attend(
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
    // SAFETY: forwarded contract.
    unsafe {
        match kv {
            KvData::F16(v) => attend_in(geom, v, layer, kv_head, query, q, scale, out, scratch),
            KvData::F32(v) => attend_in(geom, v, layer, kv_head, query, q, scale, out, scratch),
            KvData::Q8_0(_) => unreachable!("q8_0 KV is read by q8kv::attend_q8"),
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_in<E: KvElem>(
    geom: &KvGeometry,
    data: &[E],
    layer: usize,
    kv_head: usize,
    query: &AttnQuery<'_>,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let hd = geom.head_dim;
    assert!(attend_fits(hd, query.phase) && q.len().is_multiple_of(hd) && out.len() == q.len());
    let group = q.len() / hd;
    let bs = geom.block_size;
    // A window's keys from a multiple of 64 before its first: that keeps every key in the
    // softmax chunk (16) and lane set (16 or 64) it has counted from position 0. The keys
    // between `base` and `first` read the first one's row (theirs may be gone) and are
    // masked to exact zeros.
    let first = query.first.min(query.pos);
    let base = first / 64 * 64;
    let masked = first - base;
    let n = query.pos + 1 - base;
    let AttnScratch { q: qh, p, acc, offs, .. } = scratch;
    offs.clear();
    offs.extend((base..=query.pos).map(|j| {
        let j = j.max(first);
        geom.offset(query.blocks[j / bs] as usize, layer, 0, kv_head, j % bs)
    }));
    // V's rows sit `kv_heads` heads of a block after K's.
    let vshift = geom.kv_heads * bs * hd;
    let last = offs.iter().copied().max().unwrap_or(0);
    assert!(last + vshift + hd <= data.len(), "attention: KV offset out of range");
    qh.clear();
    qh.extend_from_slice(q);
    if E::HALF {
        // SAFETY: AVX2/F16C enabled here.
        unsafe { round_f16_slice(qh) };
    }
    let np = n.next_multiple_of(16);
    p.clear();
    p.resize(group * np, 0.0);
    let kp = data.as_ptr();
    // SAFETY: (all scores) every K row read lies below `last + hd` (asserted); the q rows and
    // score rows are inside `qh` and `p` as sized above; AVX2/FMA enabled here.
    unsafe {
        match query.phase {
            Phase::Prefill => {
                let mut h = 0;
                while h < group {
                    match group - h {
                        1 => scores::<E, 1, false>(kp, offs, qh, hd, h, p, np, scale),
                        2 => scores::<E, 2, false>(kp, offs, qh, hd, h, p, np, scale),
                        3 => scores::<E, 3, false>(kp, offs, qh, hd, h, p, np, scale),
                        _ => scores::<E, 4, false>(kp, offs, qh, hd, h, p, np, scale),
                    }
                    h += (group - h).min(4);
                }
            }
            Phase::Decode => {
                for h in 0..group {
                    scores::<E, 1, true>(kp, offs, qh, hd, h, p, np, scale);
                }
            }
        }
    }
    let sets = match query.phase {
        Phase::Prefill => 16,
        Phase::Decode => 64,
    };
    acc.resize(sets * 8, 0.0);
    for h in 0..group {
        let ph = &mut p[h * np..(h + 1) * np];
        // SAFETY: AVX2/FMA enabled here; `ph` holds `np` scores, padded with zeros.
        unsafe { softmax(ph, masked, n, E::HALF) };
        for c in (0..hd).step_by(8) {
            // SAFETY: V rows lie below `last + vshift + hd` (asserted); `acc` holds `sets`
            // vectors; AVX2/FMA enabled here.
            let o = unsafe { pv_slice(kp.add(vshift + c), offs, ph, sets, acc) };
            // SAFETY: `h * hd + c + 8 <= out.len()`.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(h * hd + c), o) };
        }
    }
}

/// Scores of `G` query heads from `h0` against every key, each key's eight-lane vector formed
/// in its phase's order and eight keys summed horizontally at once. Prefill: `lanes16`'s two
/// accumulators per head, each K slice loaded once for all `G`. Decode (`G` = 1, whole 64s):
/// `lanes16x4`'s eight.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
unsafe fn scores<E: KvElem, const G: usize, const DECODE: bool>(
    kp: *const E,
    offs: &[usize],
    qh: &[f32],
    hd: usize,
    h0: usize,
    p: &mut [f32],
    np: usize,
    scale: f32,
) {
    let n = offs.len();
    // SAFETY: (whole body) the caller's contract on `kp`/`offs`; q rows `h0..h0+G` in `qh`.
    unsafe {
        let qp = qh.as_ptr().add(h0 * hd);
        for j0 in (0..n).step_by(8) {
            let mut v = [[_mm256_setzero_ps(); 8]; G];
            for k in 0..(n - j0).min(8) {
                let row = kp.add(offs[j0 + k]);
                if DECODE {
                    let mut s = [_mm256_setzero_ps(); 8];
                    for i in (0..hd).step_by(64) {
                        for (r, acc) in s.iter_mut().enumerate() {
                            let at = i + 8 * r;
                            let (kv, q) = (E::load8(row.add(at)), _mm256_loadu_ps(qp.add(at)));
                            *acc = _mm256_fmadd_ps(kv, q, *acc);
                        }
                    }
                    let lo = _mm256_add_ps(_mm256_add_ps(s[0], s[4]), _mm256_add_ps(s[2], s[6]));
                    let hi = _mm256_add_ps(_mm256_add_ps(s[1], s[5]), _mm256_add_ps(s[3], s[7]));
                    v[0][k] = _mm256_add_ps(hi, lo);
                    continue;
                }
                let mut lo = [_mm256_setzero_ps(); G];
                let mut hi = [_mm256_setzero_ps(); G];
                for l in (0..hd).step_by(16) {
                    let (a, b) = (E::load8(row.add(l)), E::load8(row.add(l + 8)));
                    for g in 0..G {
                        let qg = qp.add(g * hd + l);
                        lo[g] = _mm256_fmadd_ps(a, _mm256_loadu_ps(qg), lo[g]);
                        hi[g] = _mm256_fmadd_ps(b, _mm256_loadu_ps(qg.add(8)), hi[g]);
                    }
                }
                for g in 0..G {
                    v[g][k] = _mm256_add_ps(hi[g], lo[g]);
                }
            }
            for (g, vg) in v.iter().enumerate() {
                let s = _mm256_mul_ps(hsum8x8(vg), _mm256_set1_ps(scale));
                _mm256_storeu_ps(p.as_mut_ptr().add((h0 + g) * np + j0), s);
            }
        }
    }
}

/// `ops::attend`'s softmax over scores `from..n` of `p` (zero-padded to a multiple of 16), in
/// place: probabilities, rounded to f16 when `half`; the scores before `from` (fewer than 64)
/// become exact zeros.
#[inline(always)]
unsafe fn softmax(p: &mut [f32], from: usize, n: usize, half: bool) {
    // The max is the same whatever the order; `max_ps(x, m)` keeps `m` when `x` is NaN, as
    // `f32::max` does.
    let start = from.next_multiple_of(8).min(n);
    let whole = start + ((n - start) & !7);
    // SAFETY: (whole body) `p` holds `n.next_multiple_of(16)` floats; AVX2/FMA enabled by the
    // (inlining) caller.
    unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (start..whole).step_by(8) {
            m = _mm256_max_ps(_mm256_loadu_ps(p.as_ptr().add(i)), m);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let rest = p[from..start].iter().chain(&p[whole..n]).copied();
        let max = lanes.into_iter().chain(rest).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f64;
        for (c, chunk) in p.chunks_exact_mut(16).enumerate() {
            let lo = from.saturating_sub(16 * c).min(16);
            sum += f64::from(exp16(chunk, max, lo, (n - 16 * c).min(16)));
        }
        let inv = _mm256_set1_ps((1.0 / sum) as f32);
        for i in (0..whole).step_by(8) {
            let at = p.as_mut_ptr().add(i);
            _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(at), inv));
        }
        let inv = (1.0 / sum) as f32;
        for v in &mut p[whole..n] {
            *v *= inv;
        }
        if half {
            round_f16_slice(&mut p[..n]);
        }
    }
}

/// Dims `c..c+8` of `Σ p_j·v_j` (V's row `j` at `vp + offs[j]`) with `sets` lane sets: key
/// `j` goes to set `j % sets` in key order, eight sets at a time in registers; the sets are
/// then folded as `ops::attend` folds them. `acc` holds `sets` vectors of scratch.
#[inline(always)]
unsafe fn pv_slice(
    vp: *const impl KvElem,
    offs: &[usize],
    p: &[f32],
    sets: usize,
    acc: &mut [f32],
) -> __m256 {
    let n = offs.len();
    let used = n.min(sets);
    let a = acc.as_mut_ptr();
    // SAFETY: (whole body) the caller's contract on `vp`/`offs`; `acc` holds `sets` vectors;
    // AVX2/FMA enabled by the (inlining) caller.
    unsafe {
        for g in (0..used).step_by(8) {
            let mut r = [_mm256_setzero_ps(); 8];
            let mut base = g;
            // Key `j < n` always: `offs` has `n` entries and `p` at least `n`.
            let key = |j: usize, rk: &mut __m256| {
                let v = KvElem::load8(vp.add(*offs.get_unchecked(j)));
                *rk = _mm256_fmadd_ps(_mm256_set1_ps(*p.get_unchecked(j)), v, *rk);
            };
            while base + 8 <= n {
                for (k, rk) in r.iter_mut().enumerate() {
                    key(base + k, rk);
                }
                base += sets;
            }
            for (k, rk) in r.iter_mut().enumerate().take(n.saturating_sub(base)) {
                key(base + k, rk);
            }
            for (k, rk) in r.iter().enumerate() {
                _mm256_storeu_ps(a.add(8 * (g + k)), *rk);
            }
        }
        // The fold. A set no key reached is +0, and `x + 0` is `x` except that it turns -0
        // (a reached set whose products all underflowed) into +0: keep that one addition.
        let set = |i: usize| (i < used).then(|| _mm256_loadu_ps(a.add(8 * i)));
        let add = |x: Option<__m256>, y: Option<__m256>| match (x, y) {
            (Some(x), Some(y)) => Some(_mm256_add_ps(x, y)),
            (Some(x), None) | (None, Some(x)) => Some(_mm256_add_ps(x, _mm256_setzero_ps())),
            (None, None) => None,
        };
        let mut u: [Option<__m256>; 16] = std::array::from_fn(set);
        if sets == 64 {
            for (t, ut) in u.iter_mut().enumerate() {
                *ut = add(add(set(t), set(32 + t)), add(set(16 + t), set(48 + t)));
            }
        }
        for i in 0..8 {
            u[i] = add(u[i + 8], u[i]);
        }
        for i in 0..4 {
            u[i] = add(u[i], u[i + 4]);
        }
        u[0] = add(u[0], u[2]);
        u[1] = add(u[1], u[3]);
        add(u[0], u[1]).unwrap_or(_mm256_setzero_ps())
    }
}

/// `q8kv::dequantize_row_q8_0` eight values at a time: each is one exact int-to-float
/// conversion and one rounded product, as there.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_row_q8_0(row: &[u8], out: &mut [f32]) {
    use crate::kv::{Q8_0_BLOCK as N, Q8_0_BLOCK_BYTES as B};
    use crate::quant::f16_at;
    assert_eq!(row.len() / B * N, out.len());
    for (b, o) in row.chunks_exact(B).zip(out.chunks_exact_mut(N)) {
        let d = _mm256_set1_ps(f16_at(b));
        for k in 0..4 {
            // SAFETY: 32 quant bytes follow the scale and `o` holds 32 floats.
            unsafe {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.as_ptr().add(2 + 8 * k).cast()));
                _mm256_storeu_ps(
                    o.as_mut_ptr().add(8 * k),
                    _mm256_mul_ps(_mm256_cvtepi32_ps(q), d),
                );
            }
        }
    }
}

/// `q8kv::dot_q8_0` with one 32-byte integer dot per block: the same eight exact lanes, the
/// same FMA per lane and the same `hsum8`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(k: &[u8], q: &[u8]) -> f32 {
    use crate::formats::x86;
    use crate::kv::Q8_0_BLOCK_BYTES as B;
    use crate::quant::f16_at;
    assert!(k.len() == q.len() && k.len().is_multiple_of(B));
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (kb, qb) in k.chunks_exact(B).zip(q.chunks_exact(B)) {
        let dd = _mm256_set1_ps(f16_at(kb) * f16_at(qb));
        // SAFETY: each block has 32 quant bytes after its 2-byte scale.
        let p = unsafe {
            x86::dot_signed(
                x86::load(kb.as_ptr().add(2).cast()),
                x86::load(qb.as_ptr().add(2).cast()),
                ones,
            )
        };
        acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p), acc);
    }
    hsum8(acc)
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
                let sum = unsafe { super::exp16(&mut v, 0.5, 0, valid) };
                assert_eq!(v.map(f32::to_bits), want.map(f32::to_bits), "{chunk:?} valid {valid}");
                assert_eq!(sum.to_bits(), want_sum.to_bits());
                seen += valid;
            }
        }
        assert!(seen > 10_000);
    }
}
