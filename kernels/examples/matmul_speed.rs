//! Quantized matmul throughput of every kernel set this CPU has, at decode- and prefill-sized
//! batches, relative to the portable reference measured in the same run:
//! `cargo run --release -p pdmesh-kernels --example matmul_speed [threads] [format] [rows cols]`.

use std::sync::Arc;

use pdmesh_kernels::{
    Activations, Backend, CpuBackend, HostWeight, MatmulJob, SharedBytes, Simd, WeightType,
};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let ty: WeightType = match std::env::args().nth(2) {
        Some(s) => s.parse().unwrap_or_else(|e| panic!("{e}")),
        None => WeightType::Q4_1,
    };
    // Default: an FFN-down sized matrix of SmolLM2 (1536 columns: a whole number of every block
    // size); `rows cols` after the format measure another (a large one streams from memory).
    let dim =
        |i: usize, d: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, cols) = (dim(3, 576), dim(4, 1536));
    let rb = ty.row_bytes(cols).expect("columns must be a whole number of blocks");
    let mut data = vec![0u8; rows * rb];
    let mut x = 12345u32;
    for b in data.iter_mut() {
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        // Bytes below 0x3c keep every f16 scale finite and small; speed is what is measured.
        *b = ((x >> 24) as u8) % 0x3c;
    }
    let len = data.len();
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(data);
    let bytes = SharedBytes::new(owner, 0..len).expect("in range");
    let w = HostWeight::new(ty, rows, cols, bytes).expect("sizes match");
    println!(
        "{ty} {rows}x{cols}, {threads} thread(s): ns per 32 elements of dot (speed-up vs portable)"
    );
    let sizes: &[usize] = if rows * cols > 1 << 26 { &[1, 16] } else { &[1, 4, 16, 64, 512] };
    for &tokens in sizes {
        let xs: Vec<f32> =
            (0..tokens * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut line = format!("T={tokens:<4}");
        let mut reference = None;
        for simd in Simd::available() {
            let be = CpuBackend::with_simd(threads, simd).expect("available levels are supported");
            let mut acts = Activations::default();
            let needs = pdmesh_kernels::ActNeeds::of([ty]);
            let phases = vec![pdmesh_kernels::Phase::Prefill; tokens];
            be.quantize(&xs, tokens, cols, needs, &phases, &mut acts);
            let mut out = vec![0f32; tokens * rows];
            // About 2·10^8 block dots per measurement (a tenth for portable), at least 3 passes.
            let dots = rows * tokens * cols / 32;
            let budget = if simd == Simd::Portable { 20_000_000 } else { 200_000_000 };
            let iters = (budget / dots).max(3);
            let t = Instant::now();
            for _ in 0..iters {
                be.matmul(&acts, &mut [MatmulJob { weight: &w, out: &mut out }]);
            }
            let ns = t.elapsed().as_secs_f64() / (rows * tokens * cols / 32 * iters) as f64 * 1e9;
            let r = *reference.get_or_insert(ns);
            line += &format!("  {}: {ns:.2} ns ({:.1}x)", simd.name(), r / ns);
        }
        println!("{line}");
    }
}
