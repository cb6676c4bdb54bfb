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

mod block32;
mod float;
mod kquant;
/// AVX2 building blocks shared by the formats. Each is `inline(always)` and only ever inlined
/// into the tile kernels, which carry `#[target_feature(enable = "avx2,fma,f16c")]`.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

pub use block32::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
pub use float::{BF16, F16, F32};
pub use kquant::{Q4_K, Q5_K, Q6_K, k4_scales};

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
    /// Whether the tile kernel walks this format's blocks in 32-weight chunks (`chunk`), each
    /// unpacked once and dotted with every token of the tile, instead of calling `dot` per
    /// token: the K-quants, whose unpacking and scales cost as much as their products. They
    /// have no VNNI code (the same `maddubs`/`madd` integers either way).
    const CHUNKED: bool = false;
    /// `lanes` with AVX2 (every format that is not `CHUNKED`).
    ///
    /// # Safety
    /// `a` points at `BLOCK_ELEMS` quants and, for Q8K activations, `sums` at their sixteen
    /// 16-element sums; AVX2 is enabled in the (inlining) caller.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot(
        _w: &Self::Unpacked,
        _a: *const i8,
        _sums: *const i16,
        _ones: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        unreachable!("chunked formats are dotted chunk by chunk")
    }
    /// `lanes` with AVX512-VNNI where it helps (the same integers; not `CHUNKED` formats).
    ///
    /// # Safety
    /// As `dot`, and the caller checked AVX512-VNNI/VL.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_vnni(
        _w: &Self::Unpacked,
        _a: *const i8,
        _sums: *const i16,
    ) -> std::arch::x86_64::__m256i {
        unreachable!("chunked formats are dotted chunk by chunk")
    }
    /// Chunk `c` (0..BLOCK_ELEMS/32) of an unpacked block: its weights as unsigned bytes and
    /// the i16 scale of each `maddubs` lane. `lanes` is the sum over chunks of
    /// `madd(scale, maddubs(weights, quants))`, minus `chunk_offset`.
    ///
    /// # Safety
    /// As `dot`; only called when `CHUNKED`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn chunk(_w: &Self::Unpacked, _c: usize) -> (x86::I, x86::I) {
        unreachable!("only chunked formats are walked by chunk")
    }
    /// What comes off the chunk sums of a chunked format (Q6_K's −32 offset), per lane.
    ///
    /// # Safety
    /// As `dot`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn chunk_offset(_w: &Self::Unpacked, _sums: *const i16) -> x86::I {
        // SAFETY: AVX is enabled in the (inlining) caller.
        unsafe { std::arch::x86_64::_mm256_setzero_si256() }
    }
    /// `min_lanes` with SSE (K-quants with mins only), from the activations' eight 32-element
    /// sums (`Activations::kpairs`).
    ///
    /// # Safety
    /// `w` is an unpacked block, `pairs` points at eight i16; AVX2 is enabled in the caller.
    #[cfg(target_arch = "x86_64")]
    unsafe fn min_prod(_w: &Self::Unpacked, _pairs: *const i16) -> std::arch::x86_64::__m128i {
        // SAFETY: SSE2 is baseline on x86-64.
        unsafe { std::arch::x86_64::_mm_setzero_si128() }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

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
