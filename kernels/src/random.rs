//! Seeded random weights of any format: the kernel tests' inputs, and the weights of the
//! synthetic models `pdmesh synth-model` writes where a real model's file cannot travel.

use half::f16;
use rand::Rng;

use crate::WeightType;
use crate::formats::{FloatFormat, MinTerm, QuantFormat};
use crate::quant::FormatVisitor;

/// `n_blocks` random blocks of `ty`. Quantized blocks are random bytes (every bit pattern of
/// quants, sub-block scales and high bits is legal; Q8_0's -128 is the value that breaks naive
/// sign tricks) with sane f16 scales and mins written over them, so products stay finite;
/// float elements are uniform in [-1, 1).
pub fn random_blocks<R: Rng + ?Sized>(rng: &mut R, ty: WeightType, n_blocks: usize) -> Vec<u8> {
    ty.visit(RandomBlocks { rng, n_blocks })
}

struct RandomBlocks<'a, R: ?Sized> {
    rng: &'a mut R,
    n_blocks: usize,
}

fn f16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

impl<R: Rng + ?Sized> FormatVisitor for RandomBlocks<'_, R> {
    type Out = Vec<u8>;
    fn float<F: FloatFormat>(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.n_blocks * F::BLOCK_BYTES);
        for _ in 0..self.n_blocks {
            let v: f32 = self.rng.random_range(-1.0..1.0);
            match F::BLOCK_BYTES {
                4 => out.extend_from_slice(&v.to_le_bytes()),
                _ if F::NAME == "BF16" => {
                    out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes())
                }
                _ => out.extend_from_slice(&f16_bytes(v)),
            }
        }
        out
    }
    fn quant<F: QuantFormat>(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.n_blocks * F::BLOCK_BYTES);
        // K-quants multiply their scale by 6-bit sub-block scales: a smaller one keeps the
        // weights of both families about the same size.
        let scale = if F::BLOCK_ELEMS == 32 { 0.05 } else { 0.002 };
        for _ in 0..self.n_blocks {
            let start = out.len();
            out.extend((0..F::BLOCK_BYTES).map(|_| self.rng.random::<u8>()));
            let b = &mut out[start..];
            b[F::SCALE_AT..F::SCALE_AT + 2]
                .copy_from_slice(&f16_bytes(self.rng.random_range(scale / 50.0..scale)));
            if F::MIN != MinTerm::None {
                b[F::MIN_AT..F::MIN_AT + 2]
                    .copy_from_slice(&f16_bytes(self.rng.random_range(-scale * 4.0..scale * 4.0)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;
    use rand::SeedableRng;

    /// Every format's random blocks dequantize to finite values of a sane size, and the same
    /// seed gives the same bytes.
    #[test]
    fn random_blocks_are_finite_and_seeded() {
        for &ty in WeightType::ALL {
            let n = 8;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
            let b = random_blocks(&mut rng, ty, n);
            assert_eq!(b.len(), n * ty.block_bytes(), "{ty}");
            let mut again = rand_chacha::ChaCha8Rng::seed_from_u64(7);
            assert_eq!(b, random_blocks(&mut again, ty, n), "{ty}: not reproducible");
            let mut vals = vec![0f32; n * ty.block_elems()];
            dequantize_row(ty, &b, &mut vals);
            let largest = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(vals.iter().all(|v| v.is_finite()), "{ty}: not finite");
            assert!(largest > 0.0 && largest < 16.0, "{ty}: largest {largest}");
        }
    }
}
