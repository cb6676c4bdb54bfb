//! Seeded random weights and activations shared by the kernel test suites.

#![allow(clippy::unwrap_used, dead_code)] // helpers; each suite uses its own subset

use std::sync::Arc;

use half::f16;
use pdmesh_kernels::formats::{FloatFormat, MinTerm, QuantFormat};
use pdmesh_kernels::quant::FormatVisitor;
use pdmesh_kernels::{HostWeight, Phase, SharedBytes, WeightMatrix, WeightType};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub fn f16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

pub fn random_weights(rng: &mut ChaCha8Rng, ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    ty.visit(RandomWeights { rng, n_blocks: rows * cols / ty.block_elems() })
}

/// Random blocks of one format: random bytes (every bit pattern of quants, scales and high bits
/// is legal) with sane f16 scales and mins written over them.
pub struct RandomWeights<'a> {
    rng: &'a mut ChaCha8Rng,
    n_blocks: usize,
}

impl FormatVisitor for RandomWeights<'_> {
    type Out = Vec<u8>;
    fn float<F: FloatFormat>(self) -> Vec<u8> {
        let mut out = Vec::new();
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
        let mut out = Vec::new();
        for _ in 0..self.n_blocks {
            // Random bytes include i8 -128 for Q8_0, the value that breaks naive sign tricks.
            let mut b: Vec<u8> = (0..F::BLOCK_BYTES).map(|_| self.rng.random::<u8>()).collect();
            let scale = if F::BLOCK_ELEMS == 32 { 0.05 } else { 0.002 };
            b[F::SCALE_AT..F::SCALE_AT + 2]
                .copy_from_slice(&f16_bytes(self.rng.random_range(scale / 50.0..scale)));
            if F::MIN != MinTerm::None {
                b[F::MIN_AT..F::MIN_AT + 2]
                    .copy_from_slice(&f16_bytes(self.rng.random_range(-scale * 4.0..scale * 4.0)));
            }
            out.extend(b);
        }
        out
    }
}

pub fn random_vec(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// A weight the backend computes with, over a copy of `w`'s bytes.
pub fn host(w: &WeightMatrix<'_>) -> HostWeight {
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(w.data.to_vec());
    let bytes = SharedBytes::new(owner, 0..w.data.len()).unwrap();
    HostWeight::new(w.ty, w.rows, w.cols, bytes).unwrap()
}

/// The phase test token `t` has: a mix, so float weights run both summation orders.
pub fn phase_of(t: usize) -> Phase {
    if t % 3 == 2 { Phase::Decode } else { Phase::Prefill }
}
