//! Seeded random weights and activations shared by the kernel test suites.

#![allow(clippy::unwrap_used, dead_code)] // helpers; each suite uses its own subset

use std::sync::Arc;

use pdmesh_kernels::{HostWeight, Phase, SharedBytes, WeightMatrix, WeightType};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub fn random_weights(rng: &mut ChaCha8Rng, ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    pdmesh_kernels::random::random_blocks(rng, ty, rows * cols / ty.block_elems())
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
