//! AVX2 building blocks the formats' x86 dot products share (loads, nibble unpacking, signed
//! byte dots with and without VNNI, the K-quants' scale and min products).

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
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
    }
}

/// `Σ (w − off)·a` per lane for unsigned `w` (Q4_0, Q5_0 without their offset), as a signed
/// dot: AVX2 has registers for nothing more per tile.
#[inline(always)]
pub unsafe fn dot_offset(w: I, a: I, off: i8, ones: I) -> I {
    // SAFETY: register-only AVX2 operations.
    unsafe { dot_signed(_mm256_sub_epi8(w, _mm256_set1_epi8(off)), a, ones) }
}

/// `dot_offset` with VNNI: the row's products accumulate onto `−off·Σa`, which depends only
/// on the activations, so the compiler forms it once per token for all of a tile's rows
/// (AVX-512 leaves the registers for it).
#[inline(always)]
pub unsafe fn dot_offset_vnni(w: I, a: I, off: i8) -> I {
    // SAFETY: only inlined into kernels that enable AVX512-VNNI/VL.
    unsafe {
        let zero = _mm256_setzero_si256();
        let oa = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(off), a);
        _mm256_dpbusd_epi32(_mm256_sub_epi32(zero, oa), w, a)
    }
}

/// A Q4_K/Q5_K block as the tile kernel keeps it between tokens: the block, and its 6-bit
/// scales and mins unpacked once into i16 (the scales in both 128-bit halves, for `vpshufb`).
#[derive(Debug, Clone, Copy)]
pub struct K4Block {
    pub p: *const u8,
    pub scales: I,
    pub mins: __m128i,
}

/// Unpacks a Q4_K/Q5_K block's 12 bytes of scales and mins (at `p + 4`) with eight-byte
/// integer steps: llama.cpp's `get_scale_min_k4` for all eight sub-blocks at once.
#[inline(always)]
pub unsafe fn k4_block(p: *const u8) -> K4Block {
    const M6: u64 = 0x3f3f_3f3f;
    const M4: u64 = 0x0f0f_0f0f;
    // Bits 6..7 of each byte, moved to bits 4..5 of the same byte by a 2-bit shift of the
    // word (what the neighbouring byte shifts in lands in bits 6..7 and is masked off).
    const TOP: u64 = 0x3030_3030;
    // SAFETY: `p` is a whole block (the caller's contract): bytes 4..16 are readable.
    unsafe {
        let a = p.add(4).cast::<u64>().read_unaligned();
        let c = u64::from(p.add(12).cast::<u32>().read_unaligned());
        let (lo, hi) = (a & 0xffff_ffff, a >> 32);
        let sc = (lo & M6) | (((c & M4) | ((lo >> 2) & TOP)) << 32);
        let mn = (hi & M6) | ((((c >> 4) & M4) | ((hi >> 2) & TOP)) << 32);
        let sc = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64));
        K4Block {
            p,
            scales: _mm256_broadcastsi128_si256(sc),
            mins: _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64)),
        }
    }
}

/// i16 element `k` (0..8) of each 128-bit half of `v`, in every i16 lane of that half (`k`
/// is a constant once the callers' loops unroll, and so is the shuffle control).
#[inline(always)]
pub unsafe fn bcast16(v: I, k: usize) -> I {
    let k = k as i16;
    // SAFETY: register-only AVX2 operation.
    unsafe { _mm256_shuffle_epi8(v, _mm256_set1_epi16(((2 * k + 1) << 8) | (2 * k))) }
}

/// Q4_K/Q5_K: `madd(mins, pair sums)` over the eight sub-blocks.
#[inline(always)]
pub unsafe fn k4_min_prod(w: &K4Block, pairs: *const i16) -> __m128i {
    // SAFETY: `pairs` points at eight i16 (the caller's contract).
    unsafe { _mm_madd_epi16(w.mins, _mm_loadu_si128(pairs.cast())) }
}
