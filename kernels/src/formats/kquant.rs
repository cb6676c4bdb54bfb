//! The K-quants (Q4_K, Q5_K, Q6_K): 256-element super-blocks with 6- or 8-bit sub-block scales,
//! dotted against Q8K activations.

#![allow(non_camel_case_types)]

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{ActForm, Format, MinTerm, QuantFormat};
use crate::quant::{QK_K, f16_at};

/// 256 weights in 8 sub-blocks of 32: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins,
/// 128 nibble bytes (sub-blocks 2j and 2j+1 share bytes 32j..32j+32, low and high nibbles).
#[derive(Debug)]
pub struct Q4_K;
/// Q4_K's layout plus 32 bytes of fifth bits (bit 2j of byte e is element e of sub-block 2j).
#[derive(Debug)]
pub struct Q5_K;
/// 256 weights in 16 sub-blocks of 16: 128 low-nibble bytes, 64 bytes of 2-bit highs,
/// 16 i8 scales, f16 d at the end; values are 6-bit minus 32.
#[derive(Debug)]
pub struct Q6_K;

/// The eight 6-bit scales and eight 6-bit mins packed into 12 bytes (llama.cpp's
/// `get_scale_min_k4`).
#[inline(always)]
pub fn k4_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        if j < 4 {
            sc[j] = q[j] & 63;
            mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
    (sc, mn)
}

/// `mins · sums` pairwise, as `_mm_madd_epi16` forms it.
#[inline(always)]
fn k4_min_lanes(b: &[u8], sums: &[i16]) -> [i32; 4] {
    let (_, mn) = k4_scales(&b[4..16]);
    let mut p = [0i32; 4];
    for (m, p) in p.iter_mut().enumerate() {
        let s32 = |j: usize| i32::from(sums[2 * j]) + i32::from(sums[2 * j + 1]);
        *p = i32::from(mn[2 * m]) * s32(2 * m) + i32::from(mn[2 * m + 1]) * s32(2 * m + 1);
    }
    p
}

/// Lane sums of a 4- or 5-bit K super-block, `value(sub, e)` giving element `e` of sub-block
/// `sub` (both 0..8 / 0..32).
#[inline(always)]
fn k4_lanes(b: &[u8], a: &[i8], value: impl Fn(usize, usize) -> i32) -> [i32; 8] {
    let (sc, _) = k4_scales(&b[4..16]);
    let mut lanes = [0i32; 8];
    for (sub, &s) in sc.iter().enumerate() {
        let mut part = [0i32; 8];
        for e in 0..32 {
            part[e / 4] += value(sub, e) * i32::from(a[32 * sub + e]);
        }
        for (l, p) in lanes.iter_mut().zip(part) {
            *l += i32::from(s) * p;
        }
    }
    lanes
}

impl Format for Q4_K {
    const NAME: &'static str = "Q4_K";
    const GGUF_ID: u32 = 12;
    const BLOCK_ELEMS: usize = QK_K;
    const BLOCK_BYTES: usize = 4 + 12 + QK_K / 2;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(b), f16_at(&b[2..]));
        let (sc, mn) = k4_scales(&b[4..16]);
        for (sub, o) in out.chunks_exact_mut(32).enumerate() {
            let (d1, m1) = (d * f32::from(sc[sub]), dmin * f32::from(mn[sub]));
            let q = &b[16 + 32 * (sub / 2)..];
            for (e, o) in o.iter_mut().enumerate() {
                let v = if sub.is_multiple_of(2) { q[e] & 0xF } else { q[e] >> 4 };
                *o = d1 * f32::from(v) - m1;
            }
        }
    }
}

impl Format for Q5_K {
    const NAME: &'static str = "Q5_K";
    const GGUF_ID: u32 = 13;
    const BLOCK_ELEMS: usize = QK_K;
    const BLOCK_BYTES: usize = 4 + 12 + QK_K / 8 + QK_K / 2;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(b), f16_at(&b[2..]));
        let (sc, mn) = k4_scales(&b[4..16]);
        for (sub, o) in out.chunks_exact_mut(32).enumerate() {
            let (d1, m1) = (d * f32::from(sc[sub]), dmin * f32::from(mn[sub]));
            for (e, o) in o.iter_mut().enumerate() {
                *o = d1 * f32::from(q5k_value(b, sub, e)) - m1;
            }
        }
    }
}

#[inline(always)]
fn q5k_value(b: &[u8], sub: usize, e: usize) -> u8 {
    let q = b[48 + 32 * (sub / 2) + e];
    let low = if sub.is_multiple_of(2) { q & 0xF } else { q >> 4 };
    low | (((b[16 + e] >> sub) & 1) << 4)
}

/// Element `e` (0..32) of 32-element chunk `c` (0..8) of a Q6_K block, minus 32.
#[inline(always)]
fn q6k_value(b: &[u8], c: usize, e: usize) -> i32 {
    let (half, k) = (c / 4, c % 4);
    let ql = b[64 * half + 32 * (k % 2) + e];
    let low = if k < 2 { ql & 0xF } else { ql >> 4 };
    let high = (b[128 + 32 * half + e] >> (2 * k)) & 3;
    i32::from(low | (high << 4)) - 32
}

impl Format for Q6_K {
    const NAME: &'static str = "Q6_K";
    const GGUF_ID: u32 = 14;
    const BLOCK_ELEMS: usize = QK_K;
    const BLOCK_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let d = f16_at(&b[208..]);
        for (c, o) in out.chunks_exact_mut(32).enumerate() {
            for (e, o) in o.iter_mut().enumerate() {
                let sc = b[192 + 2 * c + e / 16] as i8;
                *o = d * f32::from(sc) * q6k_value(b, c, e) as f32;
            }
        }
    }
}

/// The K-quants' dot products form the same exact integers with or without VNNI, and run
/// faster compiled for AVX2 alone than inside the AVX-512 kernels, so they have no VNNI code.
macro_rules! k_dot_is_avx2 {
    () => {
        const HAS_VNNI_DOT: bool = false;
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn dot_vnni(w: &Self::Unpacked, a: *const i8, sums: *const i16) -> x86::I {
            // SAFETY: the caller's contract.
            unsafe { Self::dot(w, a, sums, std::arch::x86_64::_mm256_set1_epi16(1)) }
        }
    };
}

/// Q4_K and Q5_K share the packed 6-bit scales and mins, unpacked once per block and tile,
/// and so their min term.
macro_rules! k4_scales_and_mins {
    () => {
        fn min_lanes(b: &[u8], sums: &[i16]) -> [i32; 4] {
            k4_min_lanes(b, sums)
        }
        #[cfg(target_arch = "x86_64")]
        type Unpacked = x86::K4Block;
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> x86::K4Block {
            // SAFETY: the caller's contract.
            unsafe { x86::k4_block(p) }
        }
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn min_prod(w: &x86::K4Block, sums: *const i16) -> std::arch::x86_64::__m128i {
            // SAFETY: the caller's contract.
            unsafe { x86::k4_min_prod(w, sums) }
        }
    };
}

impl QuantFormat for Q4_K {
    const ACT: ActForm = ActForm::Q8K;
    const MIN: MinTerm = MinTerm::SuperQuad;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        k4_lanes(b, a, |sub, e| {
            let q = b[16 + 32 * (sub / 2) + e];
            i32::from(if sub.is_multiple_of(2) { q & 0xF } else { q >> 4 })
        })
    }
    k_dot_is_avx2!();
    k4_scales_and_mins!();
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::K4Block, a: *const i8, _sums: *const i16, _ones: x86::I) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: `w.p` is a whole Q4_K block and `a` 256 quants (the caller's contract).
        unsafe {
            let m4 = _mm256_set1_epi8(0xF);
            let mut sumi = [_mm256_setzero_si256(); 2];
            for j in 0..4 {
                let bits = x86::load(w.p.add(16 + 32 * j).cast());
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                let pl = _mm256_madd_epi16(
                    x86::bcast16(w.scales, 2 * j),
                    _mm256_maddubs_epi16(lo, x86::load(a.add(64 * j))),
                );
                let ph = _mm256_madd_epi16(
                    x86::bcast16(w.scales, 2 * j + 1),
                    _mm256_maddubs_epi16(hi, x86::load(a.add(64 * j + 32))),
                );
                sumi[j % 2] = _mm256_add_epi32(sumi[j % 2], _mm256_add_epi32(pl, ph));
            }
            _mm256_add_epi32(sumi[0], sumi[1])
        }
    }
}

impl QuantFormat for Q5_K {
    const ACT: ActForm = ActForm::Q8K;
    const MIN: MinTerm = MinTerm::SuperScalar;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        k4_lanes(b, a, |sub, e| i32::from(q5k_value(b, sub, e)))
    }
    k_dot_is_avx2!();
    k4_scales_and_mins!();
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::K4Block, a: *const i8, _sums: *const i16, _ones: x86::I) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: `w.p` is a whole Q5_K block and `a` 256 quants (the caller's contract).
        unsafe {
            let p = w.p;
            let m4 = _mm256_set1_epi8(0xF);
            let one = _mm256_set1_epi8(1);
            let hbits = x86::load(p.add(16).cast());
            let mut sumi = _mm256_setzero_si256();
            for j in 0..4 {
                let bits = x86::load(p.add(48 + 32 * j).cast());
                // Bit `sub` of each qh byte, moved to bit 4 (16-bit shifts never carry a set
                // bit across bytes: only bit 0 of each byte survives the mask).
                let h0 = x86::bit_to_16(hbits, 2 * j as i32, one);
                let h1 = x86::bit_to_16(hbits, 2 * j as i32 + 1, one);
                let q0 = _mm256_add_epi8(_mm256_and_si256(bits, m4), h0);
                let q1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h1);
                let p0 = _mm256_madd_epi16(
                    x86::bcast16(w.scales, 2 * j),
                    _mm256_maddubs_epi16(q0, x86::load(a.add(64 * j))),
                );
                let p1 = _mm256_madd_epi16(
                    x86::bcast16(w.scales, 2 * j + 1),
                    _mm256_maddubs_epi16(q1, x86::load(a.add(64 * j + 32))),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            sumi
        }
    }
}

impl QuantFormat for Q6_K {
    const ACT: ActForm = ActForm::Q8K;
    const MIN: MinTerm = MinTerm::None;
    const SCALE_AT: usize = 208;
    fn lanes(b: &[u8], a: &[i8], sums: &[i16]) -> [i32; 8] {
        // Unsigned 6-bit values times the scale, lane `l` = elements 4l..4l+4 of every chunk;
        // the −32 offset comes off afterwards as `32 · (scaled sums of chunk l)`, lane by lane,
        // as llama.cpp's current x86 kernel forms it (the per-lane split is what the float
        // accumulation sees, so it has to be this one).
        let mut lanes = [0i32; 8];
        for c in 0..8 {
            for e in 0..32 {
                let sc = i32::from(b[192 + 2 * c + e / 16] as i8);
                lanes[(e % 32) / 4] += sc * (q6k_value(b, c, e) + 32) * i32::from(a[32 * c + e]);
            }
        }
        for (l, lane) in lanes.iter_mut().enumerate() {
            let sc = |j: usize| i32::from(b[192 + j] as i8);
            *lane -= (sc(2 * l) * i32::from(sums[2 * l])
                + sc(2 * l + 1) * i32::from(sums[2 * l + 1]))
                << 5;
        }
        lanes
    }
    k_dot_is_avx2!();
    // Q6_K's sixteen i8 scales load as they are: the block is its own unpacking.
    #[cfg(target_arch = "x86_64")]
    type Unpacked = *const u8;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> *const u8 {
        p
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(p: &*const u8, a: *const i8, sums: *const i16, _ones: x86::I) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: `p` is a whole Q6_K block and `a` 256 quants (the caller's contract).
        unsafe {
            let p = *p;
            let m4 = _mm256_set1_epi8(0xF);
            let m3 = _mm256_set1_epi8(3);
            let sc = p.add(192).cast::<i8>();
            let mut sumi = [_mm256_setzero_si256(); 2];
            for half in 0..2 {
                // Scales 8h..8h+8 as i16 in both 128-bit halves: chunk c = 4h+k takes
                // scale 2c in its low half and 2c+1 in its high half.
                let sc16 = _mm_cvtepi8_epi16(_mm_loadl_epi64(sc.add(8 * half).cast()));
                let sc16 = _mm256_broadcastsi128_si256(sc16);
                let ql1 = x86::load(p.add(64 * half).cast());
                let ql2 = x86::load(p.add(64 * half + 32).cast());
                let qh = x86::load(p.add(128 + 32 * half).cast());
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), x86::pair_to_high(qh, 0, m3)),
                    _mm256_or_si256(_mm256_and_si256(ql2, m4), x86::pair_to_high(qh, 2, m3)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        x86::pair_to_high(qh, 4, m3),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql2, 4), m4),
                        x86::pair_to_high(qh, 6, m3),
                    ),
                ];
                for (k, q) in q.into_iter().enumerate() {
                    let c = 4 * half + k;
                    let p16 = _mm256_maddubs_epi16(q, x86::load(a.add(32 * c)));
                    let ctl = _mm256_set_m128i(
                        _mm_set1_epi16((((4 * k + 3) << 8) | (4 * k + 2)) as i16),
                        _mm_set1_epi16((((4 * k + 1) << 8) | (4 * k)) as i16),
                    );
                    let scale = _mm256_shuffle_epi8(sc16, ctl);
                    sumi[k % 2] = _mm256_add_epi32(sumi[k % 2], _mm256_madd_epi16(scale, p16));
                }
            }
            let sumi = _mm256_add_epi32(sumi[0], sumi[1]);
            let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.cast()));
            let offset = _mm256_madd_epi16(_mm256_loadu_si256(sums.cast()), scales16);
            _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5))
        }
    }
}
