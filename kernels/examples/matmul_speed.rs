//! Quick matmul throughput probe: `cargo run --release -p pdmesh-kernels --example matmul_speed`.
use pdmesh_kernels::{Activations, Backend, CpuBackend, MatmulJob, WeightMatrix, WeightType};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let (rows, cols) = (1536usize, 576usize);
    let rb = WeightType::Q4_1.row_bytes(cols).unwrap();
    let mut data = vec![0u8; rows * rb];
    let mut x = 12345u32;
    for (i, b) in data.iter_mut().enumerate() {
        x = x.wrapping_mul(1664525).wrapping_add(1013904223);
        *b = if i % 20 < 4 { [0x00, 0x20, 0x00, 0xa0][i % 4] } else { (x >> 24) as u8 };
    }
    let w = WeightMatrix::new(WeightType::Q4_1, rows, cols, &data).unwrap();
    let be = CpuBackend::new(threads);
    for tokens in [1usize, 4, 16, 64, 512] {
        let xs: Vec<f32> =
            (0..tokens * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut acts = Activations::default();
        be.quantize(&xs, tokens, cols, &mut acts);
        let mut out = vec![0f32; tokens * rows];
        let iters = (20000 / tokens).max(20);
        let t = Instant::now();
        for _ in 0..iters {
            be.matmul(&acts, &mut [MatmulJob { weight: w, out: &mut out }]);
        }
        let dt = t.elapsed().as_secs_f64();
        let pairs = (rows * tokens * cols / 32 * iters) as f64;
        println!(
            "T={tokens:<4} {:.2} ns/block-pair  {:.1} GMAC/s",
            dt / pairs * 1e9,
            pairs * 32.0 / dt / 1e9
        );
    }
}
