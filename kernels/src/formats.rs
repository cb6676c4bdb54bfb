//! Every weight storage format, one implementation each: its GGUF type id, block layout,
//! dequantization, and — for the quantized ones — the integer dot product against quantized
//! activations, portable and AVX2. `quant::WeightType` and every dispatch over it are generated
//! from the list in `quant.rs`, so a new format is one impl here and one line there.
//!
//! The dot products reproduce llama.cpp's x86 `ggml_vec_dot_*` kernels operation for operation:
//! per block, eight i32 lane sums (lane `l` holds elements `4l..4l+4` of each 32-element run,
//! weighted by their sub-block scale for the K-quants), one FMA per lane with the product of the
//! two block scales, and the format's min/offset term accumulated on the side. Integer sums are
//! exact, so how a kernel forms them (maddubs, VNNI, scalar) never changes the result; only the
//! float steps are ordered, and those are written out once in `cpu::portable::dot_quantized`
//! and mirrored by the AVX2 tile kernel.

// Type names follow ggml's (Q4_K, Q5_K …) so they read as the formats people know.
#![allow(non_camel_case_types)]

use half::{bf16, f16};

use crate::quant::{QK, QK_K, f16_at};

/// The quantized activation form a format's dot product consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActForm {
    /// 32-element blocks, f16-rounded scale and scaled sum (llama.cpp's `block_q8_0`/`q8_1`).
    Q8,
    /// 256-element super-blocks, f32 scale and 32-element sums (llama.cpp's `block_q8_K`).
    Q8K,
}

/// How a format's block offsets enter the dot product, each in llama.cpp's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MinTerm {
    /// Symmetric blocks: no offset term.
    None,
    /// `summs = fma(m, s, summs)` per 32-block (Q4_1, Q5_1), added after the lane sum.
    PerBlock,
    /// Four f32 lanes per super-block, `fma(-d·dmin, mins·sums, acc_m)`, reduced
    /// `(m0+m2)+(m1+m3)` (Q4_K).
    SuperQuad,
    /// One scalar per super-block, `fma(-d·dmin, Σ mins·sums, summs)` (Q5_K).
    SuperScalar,
}

/// What every storage format has.
pub trait Format {
    const NAME: &'static str;
    /// The `ggml_type` id a GGUF tensor entry stores.
    const GGUF_ID: u32;
    /// Elements per storage block (1 for the float types).
    const BLOCK_ELEMS: usize;
    /// Bytes per storage block.
    const BLOCK_BYTES: usize;
    /// Writes the block's `BLOCK_ELEMS` values as llama.cpp's `to_float` computes them.
    fn dequantize(block: &[u8], out: &mut [f32]);
}

/// Which of llama.cpp's float paths a float format takes: the activations are rounded to the
/// weight's own type first (`vec_dot_type`), and the summation order is that of its AVX-512
/// kernels (see `cpu::portable::dot_float`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatKind {
    F32,
    F16,
    BF16,
}

/// A float format: matmuls read its elements directly against activations rounded to it.
pub trait FloatFormat: Format {
    const KIND: FloatKind;
    fn at(b: &[u8]) -> f32;
}

/// A block-quantized format with integer dot products against quantized activations.
pub trait QuantFormat: Format {
    const ACT: ActForm;
    const MIN: MinTerm;
    /// Byte offset of the block's f16 scale `d`.
    const SCALE_AT: usize = 0;
    /// Byte offset of the block's f16 min (`m` or `dmin`) when `MIN` is not `None`.
    const MIN_AT: usize = 2;

    /// Eight lane sums of weight × activation over the block (`a` holds `BLOCK_ELEMS` quants;
    /// `sums`, for Q8K activations, the sums of each 16 of them).
    fn lanes(block: &[u8], a: &[i8], sums: &[i16]) -> [i32; 8];

    /// For the K-quants with mins: `mins[2m]·s[2m] + mins[2m+1]·s[2m+1]`, where `s` are the
    /// activation sums of the eight 32-element sub-blocks (pairs of `sums`).
    fn min_lanes(_block: &[u8], _sums: &[i16]) -> [i32; 4] {
        [0; 4]
    }

    /// What the AVX2 tile kernel keeps of a weight block between tokens.
    #[cfg(target_arch = "x86_64")]
    type Unpacked: Copy;
    /// # Safety
    /// `p` points at a whole block; AVX2 is enabled in the (inlining) caller.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack(p: *const u8) -> Self::Unpacked;
    /// `lanes` with AVX2.
    ///
    /// # Safety
    /// `a` points at `BLOCK_ELEMS` quants and, for Q8K activations, `sums` at their sixteen
    /// 16-element sums; AVX2 is enabled in the (inlining) caller.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot(
        w: &Self::Unpacked,
        a: *const i8,
        sums: *const i16,
        ones: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;
    /// Whether `dot_vnni` has VNNI code of its own. The K-quants reuse `dot`, which runs
    /// faster compiled for AVX2 alone than inside the AVX-512 kernels.
    const HAS_VNNI_DOT: bool = true;
    /// `lanes` with AVX512-VNNI where it helps (the same integers).
    ///
    /// # Safety
    /// As `dot`, and the caller checked AVX512-VNNI/VL.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_vnni(
        w: &Self::Unpacked,
        a: *const i8,
        sums: *const i16,
    ) -> std::arch::x86_64::__m256i;
    /// `min_lanes` with SSE (K-quants with mins only).
    ///
    /// # Safety
    /// `p` points at a whole block, `sums` at sixteen i16; AVX2 is enabled in the caller.
    #[cfg(target_arch = "x86_64")]
    unsafe fn min_prod(_p: *const u8, _sums: *const i16) -> std::arch::x86_64::__m128i {
        // SAFETY: SSE2 is baseline on x86-64.
        unsafe { std::arch::x86_64::_mm_setzero_si128() }
    }
}

/// Names of GGUF tensor types pdmesh does not compute with, for the load error.
pub fn unsupported_type_name(id: u32) -> &'static str {
    match id {
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

// ---------------------------------------------------------------------------------------------
// Float formats.

#[derive(Debug)]
pub struct F32;
#[derive(Debug)]
pub struct F16;
#[derive(Debug)]
pub struct BF16;

macro_rules! float_format {
    ($t:ident, $name:literal, $id:literal, $bytes:literal, |$b:ident| $at:expr) => {
        impl Format for $t {
            const NAME: &'static str = $name;
            const GGUF_ID: u32 = $id;
            const BLOCK_ELEMS: usize = 1;
            const BLOCK_BYTES: usize = $bytes;
            fn dequantize(block: &[u8], out: &mut [f32]) {
                out[0] = Self::at(block);
            }
        }
        impl FloatFormat for $t {
            const KIND: FloatKind = FloatKind::$t;
            #[inline(always)]
            fn at($b: &[u8]) -> f32 {
                $at
            }
        }
    };
}

float_format!(F32, "F32", 0, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
float_format!(F16, "F16", 1, 2, |b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
float_format!(BF16, "BF16", 30, 2, |b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());

// ---------------------------------------------------------------------------------------------
// 32-element block formats (activations: Q8).

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
        use std::arch::x86_64::*;
        // SAFETY: a Q4_0 block has 16 quant bytes at offset 2.
        unsafe { _mm256_sub_epi8(x86::nibbles(p.add(2)), _mm256_set1_epi8(8)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::I, a: *const i8, _: *const i16, ones: x86::I) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_signed(*w, x86::load(a), ones) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_vnni(w: &x86::I, a: *const i8, _: *const i16) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_signed_vnni(*w, x86::load(a)) }
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
        // SAFETY: a Q5_0 block has its high bits at offset 2 and 16 nibble bytes at 6. A clear
        // high bit makes the byte `nibble | 0xF0`, i.e. `nibble - 16` as i8.
        unsafe {
            let hi = _mm256_andnot_si256(x86::bytes_from_bits(p.add(2)), _mm256_set1_epi8(-16));
            _mm256_or_si256(x86::nibbles(p.add(6)), hi)
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(w: &x86::I, a: *const i8, _: *const i16, ones: x86::I) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_signed(*w, x86::load(a), ones) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_vnni(w: &x86::I, a: *const i8, _: *const i16) -> x86::I {
        // SAFETY: the caller's contract.
        unsafe { x86::dot_signed_vnni(*w, x86::load(a)) }
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

// ---------------------------------------------------------------------------------------------
// K-quants: 256-element super-blocks (activations: Q8K).

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

/// The K-quant kernels read their super-block in place: the AVX2 tile keeps a pointer, and
/// VNNI would form the same exact integer sums, so it takes the AVX2 `dot`.
macro_rules! k_block_is_its_own_unpacking {
    () => {
        const HAS_VNNI_DOT: bool = false;
        #[cfg(target_arch = "x86_64")]
        type Unpacked = *const u8;
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> *const u8 {
            p
        }
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn dot_vnni(p: &*const u8, a: *const i8, sums: *const i16) -> x86::I {
            // SAFETY: the caller's contract.
            unsafe { Self::dot(p, a, sums, std::arch::x86_64::_mm256_set1_epi16(1)) }
        }
    };
}

/// Q4_K and Q5_K share the packed 6-bit mins and so their min term.
macro_rules! k4_mins {
    () => {
        fn min_lanes(b: &[u8], sums: &[i16]) -> [i32; 4] {
            k4_min_lanes(b, sums)
        }
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn min_prod(p: *const u8, sums: *const i16) -> std::arch::x86_64::__m128i {
            // SAFETY: the caller's contract.
            unsafe { x86::k4_min_prod(p, sums) }
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
    k_block_is_its_own_unpacking!();
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(p: &*const u8, a: *const i8, _sums: *const i16, _ones: x86::I) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: `p` is a whole Q4_K block and `a` 256 quants (the caller's contract).
        unsafe {
            let p = *p;
            let (sc, _) = k4_scales(std::slice::from_raw_parts(p.add(4), 12));
            let m4 = _mm256_set1_epi8(0xF);
            let mut sumi = _mm256_setzero_si256();
            for j in 0..4 {
                let bits = x86::load(p.add(16 + 32 * j).cast());
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                let pl = _mm256_madd_epi16(
                    _mm256_set1_epi16(i16::from(sc[2 * j])),
                    _mm256_maddubs_epi16(lo, x86::load(a.add(64 * j))),
                );
                let ph = _mm256_madd_epi16(
                    _mm256_set1_epi16(i16::from(sc[2 * j + 1])),
                    _mm256_maddubs_epi16(hi, x86::load(a.add(64 * j + 32))),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            sumi
        }
    }
    k4_mins!();
}

impl QuantFormat for Q5_K {
    const ACT: ActForm = ActForm::Q8K;
    const MIN: MinTerm = MinTerm::SuperScalar;
    fn lanes(b: &[u8], a: &[i8], _sums: &[i16]) -> [i32; 8] {
        k4_lanes(b, a, |sub, e| i32::from(q5k_value(b, sub, e)))
    }
    k_block_is_its_own_unpacking!();
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(p: &*const u8, a: *const i8, _sums: *const i16, _ones: x86::I) -> x86::I {
        use std::arch::x86_64::*;
        // SAFETY: `p` is a whole Q5_K block and `a` 256 quants (the caller's contract).
        unsafe {
            let p = *p;
            let (sc, _) = k4_scales(std::slice::from_raw_parts(p.add(4), 12));
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
                    _mm256_set1_epi16(i16::from(sc[2 * j])),
                    _mm256_maddubs_epi16(q0, x86::load(a.add(64 * j))),
                );
                let p1 = _mm256_madd_epi16(
                    _mm256_set1_epi16(i16::from(sc[2 * j + 1])),
                    _mm256_maddubs_epi16(q1, x86::load(a.add(64 * j + 32))),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            sumi
        }
    }
    k4_mins!();
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
    k_block_is_its_own_unpacking!();
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
            let mut sumi = _mm256_setzero_si256();
            for half in 0..2 {
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
                    let scale = _mm256_set_m128i(
                        _mm_set1_epi16(i16::from(*sc.add(2 * c + 1))),
                        _mm_set1_epi16(i16::from(*sc.add(2 * c))),
                    );
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, p16));
                }
            }
            let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.cast()));
            let offset = _mm256_madd_epi16(_mm256_loadu_si256(sums.cast()), scales16);
            _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5))
        }
    }
}

/// AVX2 building blocks shared by the formats. Each is `inline(always)` and only ever inlined
/// into the tile kernels, which carry `#[target_feature(enable = "avx2,fma,f16c")]`.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    pub type I = __m256i;

    #[inline(always)]
    pub unsafe fn load(p: *const i8) -> I {
        // SAFETY: the caller guarantees 32 readable bytes.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }

    /// 16 nibble bytes at `p` as 32 bytes: low nibbles, then high nibbles.
    #[inline(always)]
    pub unsafe fn nibbles(p: *const u8) -> I {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        unsafe {
            let tmp = _mm_loadu_si128(p.cast());
            let bytes = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
            _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F))
        }
    }

    /// 32 bits at `p` as 32 bytes, 0xFF where the bit is set.
    #[inline(always)]
    pub unsafe fn bytes_from_bits(p: *const u8) -> I {
        // SAFETY: the caller guarantees 4 readable bytes at `p`.
        unsafe {
            let x = p.cast::<i32>().read_unaligned();
            let shuf = _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            );
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
            let mask = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
            _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1))
        }
    }

    /// Bit `bit` of each byte of `h`, moved to bit 4.
    #[inline(always)]
    pub unsafe fn bit_to_16(h: I, bit: i32, one: I) -> I {
        // SAFETY: register-only AVX2 operations.
        unsafe { _mm256_slli_epi16(_mm256_and_si256(srli16(h, bit), one), 4) }
    }

    /// Bits `bit..bit+2` of each byte of `h`, moved to bits 4..6 (the mask drops whatever a
    /// 16-bit shift carried in from the neighbouring byte).
    #[inline(always)]
    pub unsafe fn pair_to_high(h: I, bit: i32, m3: I) -> I {
        // SAFETY: register-only AVX2 operations.
        unsafe { _mm256_slli_epi16(_mm256_and_si256(srli16(h, bit), m3), 4) }
    }

    /// `_mm256_srli_epi16` by a run-time count.
    #[inline(always)]
    pub unsafe fn srli16(x: I, n: i32) -> I {
        // SAFETY: register-only AVX2 operation.
        unsafe { _mm256_srl_epi16(x, _mm_cvtsi32_si128(n)) }
    }

    #[inline(always)]
    pub unsafe fn dot_unsigned(w: I, a: I, ones: I) -> I {
        // SAFETY: register-only AVX2 operations.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones) }
    }

    #[inline(always)]
    pub unsafe fn dot_signed(w: I, a: I, ones: I) -> I {
        // maddubs needs an unsigned operand: move w's sign onto a.
        // SAFETY: register-only AVX2 operations.
        unsafe {
            let aw = _mm256_sign_epi8(w, w);
            let sa = _mm256_sign_epi8(a, w);
            _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones)
        }
    }

    #[inline(always)]
    pub unsafe fn dot_unsigned_vnni(w: I, a: I) -> I {
        // SAFETY: only inlined into kernels that enable AVX512-VNNI/VL.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a) }
    }

    #[inline(always)]
    pub unsafe fn dot_signed_vnni(w: I, a: I) -> I {
        // SAFETY: only inlined into kernels that enable AVX512-VNNI/VL.
        unsafe {
            _mm256_dpbusd_epi32(
                _mm256_setzero_si256(),
                _mm256_sign_epi8(w, w),
                _mm256_sign_epi8(a, w),
            )
        }
    }

    /// Q4_K/Q5_K: `madd(mins, pair sums)` over the eight sub-blocks.
    #[inline(always)]
    pub unsafe fn k4_min_prod(p: *const u8, sums: *const i16) -> __m128i {
        // SAFETY: `p` is a whole block (scales at 4..16) and `sums` sixteen i16.
        unsafe {
            let (_, mn) = super::k4_scales(std::slice::from_raw_parts(p.add(4), 12));
            let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(mn.as_ptr().cast()));
            let s16 = _mm256_loadu_si256(sums.cast());
            let s32 = _mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
            _mm_madd_epi16(mins, s32)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(Q5_0::BLOCK_BYTES, 22);
        assert_eq!(Q5_1::BLOCK_BYTES, 24);
        assert_eq!(Q4_K::BLOCK_BYTES, 144);
        assert_eq!(Q5_K::BLOCK_BYTES, 176);
        assert_eq!(Q6_K::BLOCK_BYTES, 210);
    }

    #[test]
    fn k4_scales_unpack_both_halves() {
        // Sub-blocks 0..4 take the low 6 bits; 4..8 combine a nibble with the top 2 bits.
        let mut q = [0u8; 12];
        q[0] = 0b11_000001; // scale 0 = 1, top bits → scale 4's bits 4..5
        q[4] = 0b01_000010; // min 0 = 2, top bits → min 4's bits 4..5
        q[8] = 0x53; // scale 4 low nibble 3, min 4 low nibble 5
        let (sc, mn) = k4_scales(&q);
        assert_eq!((sc[0], mn[0]), (1, 2));
        assert_eq!((sc[4], mn[4]), (3 | (3 << 4), 5 | (1 << 4)));
    }

    #[test]
    fn q5_0_high_bits_and_offset() {
        // d = 1; qh has bit 0 and bit 16 set; nibbles all 1.
        let mut b = vec![0u8; 22];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
        b[2..6].copy_from_slice(&0x0001_0001u32.to_le_bytes());
        b[6..].fill(0x11);
        let mut out = [0.0; 32];
        Q5_0::dequantize(&b, &mut out);
        assert_eq!((out[0], out[1], out[16], out[17]), (1.0, -15.0, 1.0, -15.0));
    }
}
