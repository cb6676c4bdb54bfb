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
        unsafe fn min_prod(w: &x86::K4Block, pairs: *const i16) -> std::arch::x86_64::__m128i {
            // SAFETY: the caller's contract.
            unsafe { x86::k4_min_prod(w, pairs) }
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
    const CHUNKED: bool = true;
    k4_scales_and_mins!();
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk(w: &x86::K4Block, c: usize) -> (x86::I, x86::I) {
        use std::arch::x86_64::*;
        // SAFETY: `w.p` is a whole Q4_K block (the caller's contract).
        unsafe {
            let bits = x86::load(w.p.add(16 + 32 * (c / 2)).cast());
            let bits = if c.is_multiple_of(2) { bits } else { _mm256_srli_epi16(bits, 4) };
            (_mm256_and_si256(bits, _mm256_set1_epi8(0xF)), x86::bcast16(w.scales, c))
        }
    }
}

impl QuantFormat for Q5_K {
    const ACT: ActForm = ActForm::Q8K;
    const MIN: MinTerm = MinTerm::SuperScalar;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        k4_lanes(b, a, |sub, e| i32::from(q5k_value(b, sub, e)))
    }
    const CHUNKED: bool = true;
    k4_scales_and_mins!();
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk(w: &x86::K4Block, c: usize) -> (x86::I, x86::I) {
        use std::arch::x86_64::*;
        // SAFETY: `w.p` is a whole Q5_K block (the caller's contract).
        unsafe {
            let bits = x86::load(w.p.add(48 + 32 * (c / 2)).cast());
            let bits = if c.is_multiple_of(2) { bits } else { _mm256_srli_epi16(bits, 4) };
            let low = _mm256_and_si256(bits, _mm256_set1_epi8(0xF));
            // Bit `c` of each qh byte, moved to bit 4 (16-bit shifts never carry a set bit
            // across bytes: only bit 0 of each byte survives the mask).
            let hbits = x86::load(w.p.add(16).cast());
            let high = x86::bit_to_16(hbits, c as i32, _mm256_set1_epi8(1));
            (_mm256_add_epi8(low, high), x86::bcast16(w.scales, c))
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
    const CHUNKED: bool = true;
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
    unsafe fn chunk(p: &*const u8, c: usize) -> (x86::I, x86::I) {
        use std::arch::x86_64::*;
        // SAFETY: `p` is a whole Q6_K block (the caller's contract).
        unsafe {
            let (p, half, k) = (*p, c / 4, c % 4);
            let ql = x86::load(p.add(64 * half + 32 * (k % 2)).cast());
            let ql = if k < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
            let qh = x86::load(p.add(128 + 32 * half).cast());
            let q = _mm256_or_si256(
                _mm256_and_si256(ql, _mm256_set1_epi8(0xF)),
                x86::pair_to_high(qh, 2 * k as i32, _mm256_set1_epi8(3)),
            );
            // Scales 8h..8h+8 as i16 in both 128-bit halves; the chunk's first 16 weights
            // take scale 2c (low half), its last 16 scale 2c+1 (high half).
            let sc = _mm_cvtepi8_epi16(_mm_loadl_epi64(p.add(192 + 8 * half).cast()));
            let ctl = _mm256_set_m128i(
                _mm_set1_epi16((((4 * k + 3) << 8) | (4 * k + 2)) as i16),
                _mm_set1_epi16((((4 * k + 1) << 8) | (4 * k)) as i16),
            );
            (q, _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(sc), ctl))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk_offset(p: &*const u8, sums: *const i16) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: `p` is a whole Q6_K block and `sums` sixteen i16 (the caller's contract).
        unsafe {
            let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192).cast()));
            let offset = _mm256_madd_epi16(_mm256_loadu_si256(sums.cast()), scales16);
            _mm256_slli_epi32(offset, 5)
        }
    }
}
