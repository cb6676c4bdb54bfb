//! Every kernel on every backend present, on seeded random data: the SIMD kernels must equal the
//! portable ones bit for bit, both must agree with a naive f64 reference, and results must not
//! depend on batch size or thread count.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::{host, phase_of, random_vec, random_weights};

use half::f16;

use pdmesh_kernels::formats::FloatKind;
use pdmesh_kernels::{
    ActNeeds, Activations, AttnQuery, Backend, CpuBackend, KvBuffer, KvDtype, KvGeometry, KvSlot,
    MatmulJob, Phase, RopeMode, Simd, WeightMatrix, WeightType,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Every backend this machine can run, portable first; a missing one is reported, not hidden.
fn backends(threads: usize) -> Vec<CpuBackend> {
    for s in [Simd::Avx2, Simd::Avx512Vnni] {
        if !s.is_supported() {
            eprintln!("SKIPPED: {} kernels (this CPU lacks them)", s.name());
        }
    }
    Simd::available().into_iter().map(|s| CpuBackend::with_simd(threads, s).unwrap()).collect()
}

/// `w · x` for `tokens` rows of `x`, which are tokens `first..` (for their phases).
fn matmul(
    b: &CpuBackend,
    w: &WeightMatrix<'_>,
    x: &[f32],
    tokens: usize,
    first: usize,
) -> Vec<f32> {
    let mut acts = Activations::default();
    let phases: Vec<Phase> = (first..first + tokens).map(phase_of).collect();
    b.quantize(&x.to_vec(), tokens, w.cols, ActNeeds::of([w.ty]), &phases, &mut acts);
    let mut out = vec![f32::NAN; tokens * w.rows];
    b.matmul(&acts, &mut [MatmulJob { weight: &host(w), out: &mut out }]);
    out
}

#[test]
fn matmul_simd_equals_portable_and_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for &ty in WeightType::ALL {
        // Odd row and token counts exercise every tile edge; row counts of 4 and column counts
        // that are not whole 64s (or 32s) take the float formats down both of llama.cpp's
        // paths and their tails.
        let shapes: [(usize, usize, usize); 5] =
            [(37, 256, 1), (9, 512, 3), (72, 256, 13), (5, 768, 64), (12, 272, 4)];
        for (rows, cols, tokens) in shapes {
            if !cols.is_multiple_of(ty.block_elems()) {
                continue;
            }
            let data = random_weights(&mut rng, ty, rows, cols);
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let x = random_vec(&mut rng, tokens * cols, 2.0);
            let results: Vec<Vec<f32>> =
                backends(2).iter().map(|b| matmul(b, &w, &x, tokens, 0)).collect();
            for r in &results[1..] {
                assert_eq!(
                    r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    results[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{ty} {rows}x{cols} x{tokens}: SIMD differs from portable"
                );
            }
            // Naive reference: dequantized weights against unquantized activations. Int8
            // activations cost ~1% of each dot's magnitude, f16 and bf16 ones 2^-11 and 2^-8
            // of each product; allow for that.
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                for t in 0..tokens {
                    let xs = &x[t * cols..(t + 1) * cols];
                    let exact: f64 =
                        row.iter().zip(xs).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                    let mag: f64 = row
                        .iter()
                        .zip(xs)
                        .map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs())
                        .sum();
                    let got = f64::from(results[0][t * rows + r]);
                    let rel = match ty.float_kind() {
                        None => 0.02,
                        Some(FloatKind::F32) => 1e-5,
                        Some(FloatKind::F16) => 1e-3,
                        Some(FloatKind::BF16) => 8e-3,
                    };
                    let tol = rel * mag + 1e-3;
                    assert!(
                        (got - exact).abs() <= tol,
                        "{ty} r{r} t{t}: {got} vs {exact} (tol {tol})"
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_is_batch_and_thread_invariant() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for &ty in WeightType::ALL {
        let (rows, cols, tokens) = (45, 256, 23);
        let data = random_weights(&mut rng, ty, rows, cols);
        let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
        let x = random_vec(&mut rng, tokens * cols, 1.0);
        for threads in [1, 2, 3] {
            for b in backends(threads) {
                let full = matmul(&b, &w, &x, tokens, 0);
                // Each token alone, and in a batch with a few neighbours.
                for t in 0..tokens {
                    let one = matmul(&b, &w, &x[t * cols..(t + 1) * cols], 1, t);
                    assert_eq!(
                        one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        full[t * rows..(t + 1) * rows]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>(),
                        "{ty} token {t} alone differs from in batch ({})",
                        b.describe()
                    );
                }
                let part = matmul(&b, &w, &x[5 * cols..10 * cols], 5, 5);
                assert_eq!(part, full[5 * rows..10 * rows], "{ty} 5-token batch differs");
            }
        }
    }
}

#[test]
fn quantize_simd_equals_portable() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (rows, cols) = (17, 768);
    let mut x = random_vec(&mut rng, rows * cols, 3.0);
    x[0..32].fill(0.0); // an all-zero block
    x[40] = 1e-30; // a denormal-scale value
    let all: Vec<Activations> = backends(2)
        .iter()
        .map(|b| {
            let mut a = Activations::default();
            let needs = ActNeeds { q8: true, q8k: true, f16: true, bf16: true };
            b.quantize(&x, rows, cols, needs, &vec![Phase::Prefill; rows], &mut a);
            a
        })
        .collect();
    for a in &all[1..] {
        assert_eq!(a.qs, all[0].qs);
        assert_eq!(a.d, all[0].d);
        assert_eq!(a.s, all[0].s);
        assert_eq!(a.kqs, all[0].kqs);
        assert_eq!(
            a.kd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            all[0].kd.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(a.ksums, all[0].ksums);
    }
}

#[allow(clippy::type_complexity)]
fn attention_setup(
    rng: &mut ChaCha8Rng,
    dtype: KvDtype,
) -> (KvGeometry, Vec<Vec<u32>>, Vec<f32>, Vec<f32>, Vec<KvSlot>) {
    // head_dim 80: one 64-wide decode chunk plus a 16-element tail (q8_0 needs whole
    // 32-value blocks: 64).
    let head_dim = if dtype.is_q8_0() { 64 } else { 80 };
    let g = KvGeometry { layers: 2, kv_heads: 2, head_dim, block_size: 4, dtype };
    // Two sequences of 11 and 6 tokens with scattered, non-contiguous blocks.
    let tables = vec![vec![7u32, 2, 9], vec![4u32, 0]];
    let lens = [11usize, 6];
    let mut slots = Vec::new();
    for (tb, &n) in tables.iter().zip(&lens) {
        for p in 0..n {
            slots.push(KvSlot { block: tb[p / 4], slot: (p % 4) as u32 });
        }
    }
    let k = random_vec(rng, slots.len() * g.kv_dim(), 1.0);
    let v = random_vec(rng, slots.len() * g.kv_dim(), 1.0);
    (g, tables, k, v, slots)
}

#[test]
fn attention_matches_reference_on_every_backend() {
    for (dtype, phase) in [
        (KvDtype::F16, Phase::Prefill),
        (KvDtype::F16, Phase::Decode),
        (KvDtype::F32, Phase::Prefill),
        (KvDtype::F32, Phase::Decode),
    ] {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (g, tables, k, v, slots) = attention_setup(&mut rng, dtype);
        let heads = 6; // group of 3 query heads per KV head
        let hd = g.head_dim;
        let queries: Vec<AttnQuery<'_>> = (0..11)
            .map(|p| AttnQuery { pos: p, first: 0, blocks: &tables[0], phase })
            .chain((0..6).map(|p| AttnQuery { pos: p, first: 0, blocks: &tables[1], phase }))
            .collect();
        let q = random_vec(&mut rng, queries.len() * heads * hd, 1.0);
        let mut results = Vec::new();
        for b in backends(2) {
            let mut kv = KvBuffer::new(g, 10).unwrap();
            b.kv_write(&mut kv, 1, &k, &v, &slots);
            let mut out = vec![0f32; q.len()];
            b.attention(&kv, 1, heads, &q, 1.0 / (hd as f32).sqrt(), &queries, &mut out);
            results.push((out, kv));
        }
        for (r, _) in &results[1..] {
            assert_eq!(r, &results[0].0, "{dtype} {phase:?}: SIMD attention differs from portable");
        }
        // Reference in f64 over the values as the kernel rounds them: K, V, q and the
        // probabilities go through the KV type.
        let (out, kv) = &results[0];
        let round = |x: f32| if dtype == KvDtype::F16 { f16::from_f32(x).to_f32() } else { x };
        let base = [0usize, 11];
        for (qi, query) in queries.iter().enumerate() {
            let seq = usize::from(qi >= 11);
            for h in 0..heads {
                let kh = h / 3;
                let qv = &q[(qi * heads + h) * hd..(qi * heads + h + 1) * hd];
                let scores: Vec<f64> = (0..=query.pos)
                    .map(|j| {
                        let kr = &k[(base[seq] + j) * g.kv_dim() + kh * hd..][..hd];
                        qv.iter()
                            .zip(kr)
                            .map(|(&a, &b)| f64::from(round(a)) * f64::from(round(b)))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 = (0..=query.pos)
                        .map(|j| {
                            let p = f64::from(round((e[j] / sum) as f32));
                            p * f64::from(round(v[(base[seq] + j) * g.kv_dim() + kh * hd + d]))
                        })
                        .sum();
                    let got = f64::from(out[(qi * heads + h) * hd + d]);
                    assert!(
                        (got - want).abs() < 2e-5,
                        "{dtype} {phase:?} q{qi} h{h} d{d}: {got} vs {want}"
                    );
                }
            }
        }
        // The write went where the geometry says.
        let s = slots[12];
        let got = kv.get(g.offset(s.block as usize, 1, 1, 1, s.slot as usize) + 3);
        assert_eq!(got, round(v[12 * g.kv_dim() + hd + 3]));
    }
}

/// q8_0 KV: the kernel against an f64 softmax over what it computes from (K and V as stored,
/// q quantized to q8_0), on every backend, GQA groups of 3 over two sequences.
#[test]
fn q8_0_attention_matches_reference_on_every_backend() {
    use pdmesh_kernels::cpu::q8kv::{dequantize_row_q8_0, quantize_row_q8_0};
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (g, tables, k, v, slots) = attention_setup(&mut rng, KvDtype::Q8_0);
    let (heads, hd) = (6, g.head_dim);
    let queries: Vec<AttnQuery<'_>> = (0..11)
        .map(|p| AttnQuery { pos: p, first: 0, blocks: &tables[0], phase: Phase::Prefill })
        .chain((0..6).map(|p| AttnQuery {
            pos: p,
            first: 0,
            blocks: &tables[1],
            phase: Phase::Decode,
        }))
        .collect();
    let q = random_vec(&mut rng, queries.len() * heads * hd, 2.0);
    let through_q8 = |x: &[f32]| {
        let mut b = vec![0u8; x.len() / 32 * 34];
        quantize_row_q8_0(x, &mut b);
        let mut y = vec![0f32; x.len()];
        dequantize_row_q8_0(&b, &mut y);
        y
    };
    let mut results = Vec::new();
    for b in backends(2) {
        let mut kv = KvBuffer::new(g, 10).unwrap();
        b.kv_write(&mut kv, 1, &k, &v, &slots);
        let mut out = vec![0f32; q.len()];
        b.attention(&kv, 1, heads, &q, 1.0 / (hd as f32).sqrt(), &queries, &mut out);
        results.push(out);
    }
    for r in &results[1..] {
        assert_eq!(r, &results[0], "SIMD q8_0 attention differs from portable");
    }
    let base = [0usize, 11];
    for (qi, query) in queries.iter().enumerate() {
        let seq = usize::from(qi >= 11);
        for h in 0..heads {
            let kh = h / 3;
            let qv = through_q8(&q[(qi * heads + h) * hd..][..hd]);
            let row = |x: &[f32], j: usize| {
                through_q8(&x[(base[seq] + j) * g.kv_dim() + kh * hd..][..hd])
            };
            let scores: Vec<f64> = (0..=query.pos)
                .map(|j| {
                    let kr = row(&k, j);
                    qv.iter().zip(&kr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..hd {
                let want: f64 =
                    (0..=query.pos).map(|j| e[j] / sum * f64::from(row(&v, j)[d])).sum();
                let got = f64::from(results[0][(qi * heads + h) * hd + d]);
                assert!((got - want).abs() < 2e-5, "q{qi} h{h} d{d}: {got} vs {want}");
            }
        }
    }
}

/// Contexts long enough for every lane set (16 in prefill, 64 in decode) and more, lengths
/// that are not multiples of 8 or 16, head sizes on and off the batched kernel's 64s, and
/// GQA groups of 1 to 5 and 7 (the batched scores take heads four at a time): every backend agrees
/// with the portable one bit for bit, for each KV type and phase.
#[test]
fn long_context_attention_is_identical_on_every_backend() {
    for (hd, group) in [(64usize, 5usize), (64, 1), (128, 3), (80, 2), (64, 7)] {
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8_0] {
            if dtype.row_bytes(hd).is_none() {
                continue; // q8_0 needs whole 32-value blocks per head
            }
            let mut rng = ChaCha8Rng::seed_from_u64(hd as u64 * 7 + group as u64);
            let g = KvGeometry { layers: 2, kv_heads: 2, head_dim: hd, block_size: 16, dtype };
            let lens = [150usize, 37, 9];
            let n_blocks = 20;
            // Blocks handed out back to front, so no sequence's blocks are contiguous.
            let mut next = n_blocks;
            let tables: Vec<Vec<u32>> = lens
                .iter()
                .map(|&n| {
                    (0..g.blocks_for(n))
                        .map(|_| {
                            next -= 1;
                            next as u32
                        })
                        .collect()
                })
                .collect();
            let mut slots = Vec::new();
            for (tb, &n) in tables.iter().zip(&lens) {
                for p in 0..n {
                    slots.push(KvSlot { block: tb[p / 16], slot: (p % 16) as u32 });
                }
            }
            // Scores spread wide enough that softmax has tiny and dominant probabilities.
            let k = random_vec(&mut rng, slots.len() * g.kv_dim(), 3.0);
            let v = random_vec(&mut rng, slots.len() * g.kv_dim(), 1.0);
            let heads = g.kv_heads * group;
            for phase in [Phase::Prefill, Phase::Decode] {
                let queries: Vec<AttnQuery<'_>> = tables
                    .iter()
                    .zip(&lens)
                    .flat_map(|(tb, &n)| {
                        [0, 7, 8, 15, 16, 63, 64, 65, 100, n - 1]
                            .into_iter()
                            .filter(move |&p| p < n)
                            .map(move |p| AttnQuery { pos: p, first: 0, blocks: tb, phase })
                    })
                    .collect();
                let q = random_vec(&mut rng, queries.len() * heads * hd, 3.0);
                let mut results = Vec::new();
                for b in backends(2) {
                    let mut kv = KvBuffer::new(g, n_blocks).unwrap();
                    b.kv_write(&mut kv, 1, &k, &v, &slots);
                    let mut out = vec![0f32; q.len()];
                    b.attention(&kv, 1, heads, &q, 1.0 / (hd as f32).sqrt(), &queries, &mut out);
                    assert!(out.iter().all(|x| x.is_finite()));
                    results.push(out);
                }
                for r in &results[1..] {
                    let bits = |x: &Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(r),
                        bits(&results[0]),
                        "hd {hd} group {group} {dtype} {phase:?}: SIMD attention differs"
                    );
                }
            }
        }
    }
}

/// A sliding window is a mask: attention over `first..=pos` gives the bits of full attention
/// over `0..=pos` whose keys before `first` score so low (K rows of -100 against positive
/// queries) that their probabilities are exact zeros. So every key in the window keeps its
/// softmax chunk and summation lane, as under llama.cpp's -inf mask. Windows start on and off
/// 16- and 64-key boundaries, for every KV type, both phases and every backend.
#[test]
fn a_window_is_full_attention_with_the_keys_before_it_masked() {
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let (hd, heads, n): (usize, usize, usize) = (64, 2, 150);
    let scale = 1.0 / (hd as f32).sqrt();
    for dtype in KvDtype::ALL {
        let g = KvGeometry { layers: 1, kv_heads: 1, head_dim: hd, block_size: 16, dtype };
        let table: Vec<u32> = (0..n.div_ceil(16) as u32).rev().collect();
        let slots: Vec<KvSlot> =
            (0..n).map(|p| KvSlot { block: table[p / 16], slot: (p % 16) as u32 }).collect();
        let k = random_vec(&mut rng, n * hd, 1.0);
        let v = random_vec(&mut rng, n * hd, 1.0);
        for (pos, first) in [(149, 0), (149, 85), (149, 128), (149, 64), (100, 37), (20, 5)] {
            let mut masked = k.clone();
            masked[..first * hd].fill(-100.0);
            let q: Vec<f32> = (0..heads * hd).map(|_| rng.random_range(0.5..1.5)).collect();
            for phase in [Phase::Prefill, Phase::Decode] {
                let windowed = [AttnQuery { pos, first, blocks: &table, phase }];
                let full = [AttnQuery::full(pos, &table, phase)];
                for b in backends(2) {
                    let run = |keys: &[f32], queries: &[AttnQuery<'_>]| {
                        let mut kv = KvBuffer::new(g, table.len()).unwrap();
                        b.kv_write(&mut kv, 0, &keys.to_vec(), &v, &slots);
                        let mut out = vec![0f32; q.len()];
                        b.attention(&kv, 0, heads, &q, scale, queries, &mut out);
                        out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                    };
                    assert_eq!(
                        run(&k, &windowed),
                        run(&masked, &full),
                        "{dtype} {phase:?} {} keys {first}..={pos}",
                        b.describe()
                    );
                }
            }
        }
    }
}

#[test]
fn elementwise_ops_match_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for b in backends(2) {
        let (rows, n) = (70, 600); // large enough to run in parallel
        let x = random_vec(&mut rng, rows * n, 4.0);
        let w = random_vec(&mut rng, n, 1.0);
        let mut out = vec![0f32; x.len()];
        b.rms_norm(&x, &w, 1e-5, &mut out);
        for r in [0, 33, 69] {
            let xs = &x[r * n..(r + 1) * n];
            let ms: f64 = xs.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n as f64;
            let sc = 1.0 / (ms + 1e-5).sqrt();
            for i in [0, 7, 599] {
                let want = f64::from(xs[i]) * sc * f64::from(w[i]);
                assert!((f64::from(out[r * n + i]) - want).abs() < 1e-5 * want.abs().max(1.0));
            }
        }

        let g = random_vec(&mut rng, 40_000, 20.0);
        let u = random_vec(&mut rng, 40_000, 2.0);
        let mut o = vec![0f32; g.len()];
        b.swiglu(&g, &u, &mut o);
        for i in (0..g.len()).step_by(997) {
            let gf = f64::from(g[i]);
            let want = gf / (1.0 + (-gf).exp()) * f64::from(u[i]);
            assert!(
                (f64::from(o[i]) - want).abs() < 1e-5 * want.abs().max(1e-3),
                "{} vs {want}",
                o[i]
            );
        }

        // GeGLU: GELU's tanh form in f64, its input and output through f16 (the table's),
        // saturating past ±10.
        let mut g = random_vec(&mut rng, 40_000, 12.0);
        g.extend([-10.0, 10.0, -10.5, 11.0]);
        let u = random_vec(&mut rng, g.len(), 2.0);
        let mut o = vec![0f32; g.len()];
        b.geglu(&g, &u, &mut o);
        let f16r = |x: f64| f64::from(f16::from_f64(x).to_f32());
        for i in (0..g.len()).step_by(997).chain(g.len() - 4..g.len()) {
            let x = f64::from(g[i]);
            let gelu = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                let x = f16r(x);
                let inner = 0.797_884_560_802_865_4 * x * (1.0 + 0.044_715 * x * x);
                f16r(0.5 * x * (1.0 + inner.tanh()))
            };
            let want = gelu * f64::from(u[i]);
            let tol = 2f64.powi(-10) * want.abs() + 1e-6;
            assert!((f64::from(o[i]) - want).abs() <= tol, "geglu({x}): {} vs {want}", o[i]);
        }

        let (heads, hd, tokens) = (3, 8, 2);
        let mut x = random_vec(&mut rng, tokens * heads * hd, 1.0);
        let orig = x.clone();
        let angles: Vec<f32> = (0..tokens * hd / 2).map(|i| i as f32 * 0.3).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        b.rope(&mut x, heads, hd, &cos, &sin, RopeMode::Normal);
        let (t, h, i) = (1, 2, 3);
        let base = (t * heads + h) * hd;
        let a = angles[t * hd / 2 + i];
        let (x0, x1) = (orig[base + 2 * i], orig[base + 2 * i + 1]);
        assert!((x[base + 2 * i] - (x0 * a.cos() - x1 * a.sin())).abs() < 1e-6);
        assert!((x[base + 2 * i + 1] - (x0 * a.sin() + x1 * a.cos())).abs() < 1e-6);

        // NEOX pairs dimension i with i + head_dim / 2.
        let mut x = orig.clone();
        b.rope(&mut x, heads, hd, &cos, &sin, RopeMode::Neox);
        let (x0, x1) = (orig[base + i], orig[base + i + hd / 2]);
        assert!((x[base + i] - (x0 * a.cos() - x1 * a.sin())).abs() < 1e-6);
        assert!((x[base + i + hd / 2] - (x0 * a.sin() + x1 * a.cos())).abs() < 1e-6);

        let mut x = random_vec(&mut rng, 5 * 12, 1.0);
        let bias = random_vec(&mut rng, 12, 1.0);
        let before = x.clone();
        b.add_rows(&mut x, &bias);
        for (j, (&got, &was)) in x.iter().zip(&before).enumerate() {
            assert_eq!(got.to_bits(), (was + bias[j % 12]).to_bits());
        }
    }
}

#[test]
fn rope_simd_equals_portable_in_both_modes() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    // Enough tokens to run in parallel; head_dim 128 as Qwen3's.
    let (heads, hd, tokens) = (8, 128, 48);
    let x = random_vec(&mut rng, tokens * heads * hd, 3.0);
    let angles: Vec<f32> = (0..tokens * hd / 2).map(|_| rng.random_range(-40.0f32..40.0)).collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        let outs: Vec<Vec<u32>> = backends(2)
            .iter()
            .map(|b| {
                let mut y = x.clone();
                b.rope(&mut y, heads, hd, &cos, &sin, mode);
                y.iter().map(|v| v.to_bits()).collect()
            })
            .collect();
        for o in &outs[1..] {
            assert!(*o == outs[0], "{mode:?}: a SIMD rope differs from the portable one");
        }
        // Rotation of x0 by angle a: each pair rotated once, every other value untouched.
        let mut y = x.clone();
        CpuBackend::with_simd(1, Simd::Portable).unwrap().rope(&mut y, heads, hd, &cos, &sin, mode);
        let pair = |i: usize| match mode {
            RopeMode::Normal => (2 * i, 2 * i + 1),
            RopeMode::Neox => (i, i + hd / 2),
        };
        for t in [0, 47] {
            for i in [0, 31, 63] {
                let (a, b) = pair(i);
                let base = t * heads * hd + 5 * hd;
                let (x0, x1) = (f64::from(x[base + a]), f64::from(x[base + b]));
                let th = f64::from(angles[t * hd / 2 + i]);
                let (c, s) = (f64::from(th.cos() as f32), f64::from(th.sin() as f32));
                assert!((f64::from(y[base + a]) - (x0 * c - x1 * s)).abs() < 1e-5);
                assert!((f64::from(y[base + b]) - (x0 * s + x1 * c)).abs() < 1e-5);
            }
        }
    }
}

#[test]
fn embed_dequantizes_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let data = random_weights(&mut rng, WeightType::Q8_0, 10, 64);
    let w = WeightMatrix::new(WeightType::Q8_0, 10, 64, &data).unwrap();
    let b = CpuBackend::new(1);
    let mut out = vec![0f32; 2 * 64];
    b.embed(&host(&w), &[3, 9], &mut out);
    let mut row = vec![0f32; 64];
    w.dequantize_row(9, &mut row);
    assert_eq!(&out[64..], &row[..]);
}
