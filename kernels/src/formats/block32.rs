//! The 32-element block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), dotted against Q8 activations.

#![allow(non_camel_case_types)]

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{ActForm, Format, MinTerm, QuantFormat};
use crate::quant::{QK, f16_at};

/// 32 weights: f16 scale, 32 × i8.
#[derive(Debug)]
pub struct Q8_0;
/// 32 weights: f16 scale, 32 × 4-bit (value − 8).
#[derive(Debug)]
pub struct Q4_0;
/// 32 weights: f16 scale, f16 min, 32 × 4-bit.
#[derive(Debug)]
pub struct Q4_1;
/// 32 weights: f16 scale, 32 high bits, 32 × 4-bit (value − 16).
#[derive(Debug)]
pub struct Q5_0;
/// 32 weights: f16 scale, f16 min, 32 high bits, 32 × 4-bit.
#[derive(Debug)]
pub struct Q5_1;

/// Element `j` of a 32-block packed as 16 nibble bytes (low nibbles first) and, for the 5-bit
/// formats, a u32 of high bits.
#[inline(always)]
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < QK / 2 { qs[j] & 0xF } else { qs[j - QK / 2] >> 4 }
}

#[inline(always)]
fn high_bit(qh: u32, j: usize) -> u8 {
    (((qh >> j) & 1) as u8) << 4
}

#[inline(always)]
fn qh_at(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Lane sums of 32 weight values (as produced by `value(j)`) against 32 activation quants.
#[inline(always)]
fn lanes32(a: &[i8], value: impl Fn(usize) -> i32) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for (j, &aj) in a.iter().enumerate().take(QK) {
        lanes[j / 4] += value(j) * i32::from(aj);
    }
    lanes
}

impl Format for Q8_0 {
    const NAME: &'static str = "Q8_0";
    const GGUF_ID: u32 = 8;
    const BLOCK_ELEMS: usize = QK;
    const BLOCK_BYTES: usize = 2 + QK;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        for (o, &q) in out.iter_mut().zip(&b[2..]) {
            *o = f32::from(q as i8) * d;
        }
    }
}

impl Format for Q4_0 {
    const NAME: &'static str = "Q4_0";
    const GGUF_ID: u32 = 2;
    const BLOCK_ELEMS: usize = QK;
    const BLOCK_BYTES: usize = 2 + QK / 2;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        for (j, o) in out.iter_mut().enumerate().take(QK) {
            *o = f32::from(nibble(&b[2..], j) as i8 - 8) * d;
        }
    }
}

impl Format for Q4_1 {
    const NAME: &'static str = "Q4_1";
    const GGUF_ID: u32 = 3;
    const BLOCK_ELEMS: usize = QK;
    const BLOCK_BYTES: usize = 4 + QK / 2;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let (d, m) = (f16_at(b), f16_at(&b[2..]));
        for (j, o) in out.iter_mut().enumerate().take(QK) {
            *o = f32::from(nibble(&b[4..], j)) * d + m;
        }
    }
}

impl Format for Q5_0 {
    const NAME: &'static str = "Q5_0";
    const GGUF_ID: u32 = 6;
    const BLOCK_ELEMS: usize = QK;
    const BLOCK_BYTES: usize = 2 + 4 + QK / 2;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        let qh = qh_at(&b[2..]);
        for (j, o) in out.iter_mut().enumerate().take(QK) {
            *o = f32::from((nibble(&b[6..], j) | high_bit(qh, j)) as i8 - 16) * d;
        }
    }
}

impl Format for Q5_1 {
    const NAME: &'static str = "Q5_1";
    const GGUF_ID: u32 = 7;
    const BLOCK_ELEMS: usize = QK;
    const BLOCK_BYTES: usize = 4 + 4 + QK / 2;
    fn dequantize(b: &[u8], out: &mut [f32]) {
        let (d, m) = (f16_at(b), f16_at(&b[2..]));
        let qh = qh_at(&b[4..]);
        for (j, o) in out.iter_mut().enumerate().take(QK) {
            *o = f32::from(nibble(&b[8..], j) | high_bit(qh, j)) * d + m;
        }
    }
}

impl QuantFormat for Q8_0 {
    const ACT: ActForm = ActForm::Q8;
    const MIN: MinTerm = MinTerm::None;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        lanes32(a, |j| i32::from(b[2 + j] as i8))
    }
    #[cfg(target_arch = "x86_64")]
    type Unpacked = std::arch::x86_64::__m256i;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> Self::Unpacked {
        // SAFETY: a Q8_0 block has 32 quant bytes at offset 2.
        unsafe { std::arch::x86_64::_mm256_loadu_si256(p.add(2).cast()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &Self::Unpacked, a: *const i8, _: *const i16, ones: x86::I) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_signed(*w, x86::load(a), ones) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_vnni(w: &Self::Unpacked, a: *const i8, _: *const i16) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_signed_vnni(*w, x86::load(a)) }
    }
}

impl QuantFormat for Q4_0 {
    const ACT: ActForm = ActForm::Q8;
    const MIN: MinTerm = MinTerm::None;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        lanes32(a, |j| i32::from(nibble(&b[2..], j)) - 8)
    }
    #[cfg(target_arch = "x86_64")]
    type Unpacked = x86::I;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> x86::I {
        // SAFETY: a Q4_0 block has 16 quant bytes at offset 2.
        unsafe { x86::nibbles(p.add(2)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::I, a: *const i8, _: *const i16, ones: x86::I) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_offset(*w, x86::load(a), 8, ones) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_vnni(w: &x86::I, a: *const i8, _: *const i16) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_offset_vnni(*w, x86::load(a), 8) }
    }
}

impl QuantFormat for Q4_1 {
    const ACT: ActForm = ActForm::Q8;
    const MIN: MinTerm = MinTerm::PerBlock;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        lanes32(a, |j| i32::from(nibble(&b[4..], j)))
    }
    #[cfg(target_arch = "x86_64")]
    type Unpacked = x86::I;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> x86::I {
        // SAFETY: a Q4_1 block has 16 quant bytes at offset 4.
        unsafe { x86::nibbles(p.add(4)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::I, a: *const i8, _: *const i16, ones: x86::I) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_unsigned(*w, x86::load(a), ones) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_vnni(w: &x86::I, a: *const i8, _: *const i16) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_unsigned_vnni(*w, x86::load(a)) }
    }
}

impl QuantFormat for Q5_0 {
    const ACT: ActForm = ActForm::Q8;
    const MIN: MinTerm = MinTerm::None;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        let qh = qh_at(&b[2..]);
        lanes32(a, |j| i32::from(nibble(&b[6..], j) | high_bit(qh, j)) - 16)
    }
    #[cfg(target_arch = "x86_64")]
    type Unpacked = x86::I;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: a Q5_0 block has its high bits at offset 2 and 16 nibble bytes at 6; the
        // unsigned 5-bit values, 16 above the weights.
        unsafe {
            let hi = _mm256_and_si256(x86::bytes_from_bits(p.add(2)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(x86::nibbles(p.add(6)), hi)
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::I, a: *const i8, _: *const i16, ones: x86::I) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_offset(*w, x86::load(a), 16, ones) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_vnni(w: &x86::I, a: *const i8, _: *const i16) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_offset_vnni(*w, x86::load(a), 16) }
    }
}

impl QuantFormat for Q5_1 {
    const ACT: ActForm = ActForm::Q8;
    const MIN: MinTerm = MinTerm::PerBlock;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        let qh = qh_at(&b[4..]);
        lanes32(a, |j| i32::from(nibble(&b[8..], j) | high_bit(qh, j)))
    }
    #[cfg(target_arch = "x86_64")]
    type Unpacked = x86::I;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: a Q5_1 block has its high bits at offset 4 and 16 nibble bytes at 8.
        unsafe {
            let hi = _mm256_and_si256(x86::bytes_from_bits(p.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(x86::nibbles(p.add(8)), hi)
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::I, a: *const i8, _: *const i16, ones: x86::I) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_unsigned(*w, x86::load(a), ones) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_vnni(w: &x86::I, a: *const i8, _: *const i16) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_unsigned_vnni(*w, x86::load(a)) }
    }
}
