//! The CUDA backend's kernels, launch geometry and host side against the CPU backend on seeded
//! random data: on the emulated device (`kernels/cuda/*.cu` built for the host), or on GPU 0
//! with `PDMESH_CUDA_TEST_DEVICE=gpu` (`just test-gpu`).
//!
//! Bounds: every kernel sums in the CPU's order, so results must be bit-identical, except
//! `rms_norm`, whose f64 sum of squares is a lane tree instead of a sequence: within one f32
//! ulp of the row scale (2^-23 relative, checked at 2^-22).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::{host, phase_of, random_vec, random_weights};
use pdmesh_kernels::cuda::{CudaBackend, Device, EmuDevice, GpuDevice};
use pdmesh_kernels::formats::{ActForm, FloatFormat, MinTerm, QuantFormat};
use pdmesh_kernels::quant::FormatVisitor;
use pdmesh_kernels::{
    ActNeeds, AttnQuery, Backend, Candidates, CpuBackend, Cut, KvDtype, KvGeometry, KvSlot,
    KvStorage, MAX_CANDIDATES, MatmulJob, Phase, RopeMode, Simd, WeightMatrix, WeightType, argmax,
    argmax_of,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn cpu() -> CpuBackend {
    CpuBackend::with_simd(2, Simd::detect()).unwrap()
}

/// The device under test: the emulated one, or GPU 0 when `PDMESH_CUDA_TEST_DEVICE=gpu` (what
/// `just test-gpu` sets).
fn emu() -> CudaBackend<Box<dyn Device>> {
    let dev: Box<dyn Device> = match std::env::var("PDMESH_CUDA_TEST_DEVICE").as_deref() {
        Ok("gpu") => Box::new(GpuDevice::open(0).unwrap_or_else(|e| panic!("{e}"))),
        Ok("emu") | Err(_) => Box::new(EmuDevice::new()),
        Ok(other) => panic!("PDMESH_CUDA_TEST_DEVICE={other:?}: expected emu or gpu"),
    };
    CudaBackend::new(dev)
}

fn to_dev<B: Backend>(b: &B, v: &[f32]) -> B::Buffer {
    let mut buf = b.buffer();
    b.upload(v, &mut buf);
    buf
}

fn to_host<B: Backend>(b: &B, buf: &B::Buffer) -> Vec<f32> {
    let mut host = Vec::new();
    b.read(buf, &mut host).to_vec()
}

/// Asserts that `got` and `want` hold the same bits, naming the first difference.
fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let diff: Vec<usize> =
        (0..got.len()).filter(|&i| got[i].to_bits() != want[i].to_bits()).collect();
    if let Some(&i) = diff.first() {
        panic!(
            "{what}: {} of {} values differ, first [{i}]: {} vs the CPU's {}",
            diff.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// `w · x` on backend `b` for `tokens` rows of `x`, tokens `first..` (for their phases).
fn matmul<B: Backend>(
    b: &B,
    w: &WeightMatrix<'_>,
    x: &[f32],
    tokens: usize,
    first: usize,
) -> Vec<f32> {
    let phases: Vec<Phase> = (first..first + tokens).map(phase_of).collect();
    let xb = to_dev(b, x);
    let mut acts = b.activations();
    b.quantize(&xb, tokens, w.cols, ActNeeds::of([w.ty]), &phases, &mut acts);
    let weight = b.weight(&host(w));
    let mut out = b.buffer();
    b.resize(&mut out, tokens * w.rows);
    b.matmul(&acts, &mut [MatmulJob { weight: &weight, out: &mut out }]);
    to_host(b, &out)
}

#[test]
fn matmul_equals_cpu_bit_for_bit_in_every_format_and_launch_shape() {
    let (c, e) = (cpu(), emu());
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    for &ty in WeightType::ALL {
        // Columns with a float tail past the last 64 (80), whole K super-blocks (512); rows
        // not a multiple of the launch's 32 or 64, and a multiple of 4 for the tiled float order.
        let cols = match ty.block_elems() {
            256 => 512,
            32 => 96,
            _ => 80,
        };
        for rows in [1, 36, 70] {
            let data = random_weights(&mut rng, ty, rows, cols);
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            // 1..4 tokens: a thread per lane; more: a thread per row over chunks of 8.
            for tokens in [1, 3, 5, 11] {
                let x = random_vec(&mut rng, tokens * cols, 2.0);
                let want = matmul(&c, &w, &x, tokens, 1);
                let got = matmul(&e, &w, &x, tokens, 1);
                same_bits(&got, &want, &format!("{ty} {rows}x{cols}, {tokens} tokens"));
            }
        }
    }
}

/// The sums an output of a quantized matmul is made of, for its rounding bound: per
/// `(token, row)`, `Σ_b |d_w·d_a|·Σ_l |lane_l|` (the CPU's lane products) and the min term's
/// `Σ_b |m·s|` (Q4_1, Q5_1) or `Σ_b |d_a·dmin|·Σ_m |min_lane_m|` (Q4_K, Q5_K), from the CPU's
/// activations.
struct TermSums<'a> {
    w: &'a [u8],
    rows: usize,
    acts: &'a pdmesh_kernels::Activations,
}

impl FormatVisitor for TermSums<'_> {
    type Out = Vec<(f64, f64)>;
    fn float<F: FloatFormat>(self) -> Self::Out {
        unreachable!("quantized formats only")
    }
    fn quant<F: QuantFormat>(self) -> Self::Out {
        let (a, be) = (self.acts, F::BLOCK_ELEMS);
        let nb = a.cols / be;
        let f16_at = |b: &[u8], at| f64::from(half::f16::from_le_bytes([b[at], b[at + 1]]));
        let mut out = Vec::new();
        for t in 0..a.rows {
            for r in 0..self.rows {
                let (mut lanes, mut mins) = (0.0, 0.0);
                for b in 0..nb {
                    let at = (r * nb + b) * F::BLOCK_BYTES;
                    let blk = &self.w[at..at + F::BLOCK_BYTES];
                    let (q, da, sums) = match F::ACT {
                        ActForm::Q8 => {
                            (&a.qs[t * a.cols + b * be..][..be], a.d[b * a.rows + t], &[][..])
                        }
                        ActForm::Q8K => (
                            &a.kqs[t * a.cols + b * be..][..be],
                            a.kd[t * nb + b],
                            &a.ksums[(t * nb + b) * 16..][..16],
                        ),
                    };
                    let da = f64::from(da);
                    let l: i64 = F::lanes(blk, q, sums).iter().map(|&v| i64::from(v).abs()).sum();
                    lanes += (f16_at(blk, F::SCALE_AT) * da).abs() * l as f64;
                    match F::MIN {
                        MinTerm::None => {}
                        MinTerm::PerBlock => {
                            mins += (f16_at(blk, F::MIN_AT) * f64::from(a.s[b * a.rows + t])).abs()
                        }
                        MinTerm::SuperQuad | MinTerm::SuperScalar => {
                            let p: i64 =
                                F::min_lanes(blk, sums).iter().map(|&v| i64::from(v).abs()).sum();
                            mins += (f16_at(blk, F::MIN_AT) * da).abs() * p as f64;
                        }
                    }
                }
                out.push((lanes, mins));
            }
        }
        out
    }
}

/// Prompt matmuls on the int8 tensor cores (`with_mma`), every quantized format: each
/// block's integer dot is exact (the K-quants' sub-block dots weighted by their scales in
/// integers) and its float steps are the CPU's, but one FMA per block where the CPU has one
/// per lane, so the two round differently within `(2·nb + 8)·2^-24·(T + M)` (`TermSums`: the
/// CPU's eight lane sums each err by at most `nb + 5` roundings of `T` counting the lanes'
/// conversion to float, the block sums by `nb + 2`; the min terms by at most `nb + 3` of `M`
/// in either). Partial row and token tiles, several super-blocks; a mutated fragment layout,
/// scale or half is off by whole terms.
#[test]
fn mma_matmul_is_within_its_rounding_bound_of_the_cpu() {
    let (c, e) = (cpu(), emu().with_mma(true));
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let mut worst = 0.0f64;
    for &ty in WeightType::ALL.iter().filter(|t| t.float_kind().is_none()) {
        let shapes: &[(usize, usize, usize)] = if ty.block_elems() == 256 {
            &[(16, 256, 5), (70, 512, 37), (130, 256, 9)]
        } else {
            &[(16, 256, 5), (70, 256, 37), (130, 64, 9), (256, 96, 63)]
        };
        for &(rows, cols, tokens) in shapes {
            let nb = (cols / ty.block_elems()) as f64;
            let data = random_weights(&mut rng, ty, rows, cols);
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let x = random_vec(&mut rng, tokens * cols, 2.0);
            let want = matmul(&c, &w, &x, tokens, 0);
            let got = matmul(&e, &w, &x, tokens, 0);
            let mut acts = c.activations();
            let phases = vec![Phase::Prefill; tokens];
            c.quantize(&x, tokens, cols, ActNeeds::of([ty]), &phases, &mut acts);
            let sums = ty.visit(TermSums { w: &data, rows, acts: &acts });
            let mut differ = 0;
            for (i, ((g, w), (t, m))) in got.iter().zip(&want).zip(&sums).enumerate() {
                let bound = (2.0 * nb + 8.0) * 2f64.powi(-24) * (t + m);
                let err = (f64::from(*g) - f64::from(*w)).abs();
                assert!(err <= bound, "{ty} {rows}x{cols}, {tokens} tokens [{i}]: {g} vs {w}");
                worst = worst.max(err / bound);
                differ += usize::from(g.to_bits() != w.to_bits());
            }
            // The tensor-core path ran: its rounding shows somewhere.
            assert!(differ > 0, "{ty} {rows}x{cols}, {tokens} tokens: the CPU's bits exactly");
        }
    }
    eprintln!("mma matmul: worst error {worst:.3} of its bound");
}

#[test]
fn embed_equals_cpu_in_every_format() {
    let (c, e) = (cpu(), emu());
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for &ty in WeightType::ALL {
        let cols = if ty.block_elems() == 256 { 256 } else { 64 };
        let data = random_weights(&mut rng, ty, 9, cols);
        let w = WeightMatrix::new(ty, 9, cols, &data).unwrap();
        let tokens = [8u32, 0, 3, 3];
        let mut want = vec![0f32; tokens.len() * cols];
        c.embed(&c.weight(&host(&w)), &tokens, &mut want);
        let mut out = e.buffer();
        e.embed(&e.weight(&host(&w)), &tokens, &mut out);
        same_bits(&to_host(&e, &out), &want, &format!("{ty}"));
    }
}

#[test]
fn elementwise_ops_equal_cpu() {
    let (c, e) = (cpu(), emu());
    let mut rng = ChaCha8Rng::seed_from_u64(23);

    // RMSNorm: within one f32 ulp of the row scale (see the module doc).
    let (rows, n) = (13, 600);
    let x = random_vec(&mut rng, rows * n, 4.0);
    let w = random_vec(&mut rng, n, 1.0);
    let mut want = vec![0f32; x.len()];
    c.rms_norm(&x, &w, 1e-5, &mut want);
    let mut o = e.buffer();
    e.rms_norm(&to_dev(&e, &x), &to_dev(&e, &w), 1e-5, &mut o);
    let got = to_host(&e, &o);
    let mut exact = 0;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= w.abs() * 2f32.powi(-22), "rms_norm [{i}]: {g} vs {w}");
        exact += usize::from(g.to_bits() == w.to_bits());
    }
    assert!(exact * 10 >= got.len() * 9, "rms_norm: only {exact} of {} exact", got.len());

    // SwiGLU, including saturated and underflowing exponents.
    let mut g = random_vec(&mut rng, 5000, 20.0);
    g.extend([-200.0, 200.0, 0.0, -0.0, 88.7, -88.7]);
    let u = random_vec(&mut rng, g.len(), 2.0);
    let mut want = vec![0f32; g.len()];
    c.swiglu(&g, &u, &mut want);
    let mut o = e.buffer();
    e.swiglu(&to_dev(&e, &g), &to_dev(&e, &u), &mut o);
    same_bits(&to_host(&e, &o), &want, "swiglu");

    // GeGLU through the same table, past both ends of it; and a scale.
    let mut g = random_vec(&mut rng, 5000, 12.0);
    g.extend([-10.0, 10.0, -10.001, 10.001, 0.0, -0.0, 1e-8, -65504.0, 70000.0]);
    let u = random_vec(&mut rng, g.len(), 2.0);
    let mut want = vec![0f32; g.len()];
    c.geglu(&g, &u, &mut want);
    let mut o = e.buffer();
    e.geglu(&to_dev(&e, &g), &to_dev(&e, &u), &mut o);
    same_bits(&to_host(&e, &o), &want, "geglu");
    let mut want = g.clone();
    c.scale(&mut want, 25.298_222);
    let mut gb = to_dev(&e, &g);
    e.scale(&mut gb, 25.298_222);
    same_bits(&to_host(&e, &gb), &want, "scale");

    // RoPE in both modes, with angles of every size.
    let (heads, hd, tokens) = (3, 64, 5);
    let x = random_vec(&mut rng, tokens * heads * hd, 3.0);
    let angles: Vec<f32> = (0..tokens * hd / 2).map(|_| rng.random_range(-40.0f32..40.0)).collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        let mut want = x.clone();
        c.rope(&mut want, heads, hd, &cos, &sin, mode);
        let mut xb = to_dev(&e, &x);
        e.rope(&mut xb, heads, hd, &to_dev(&e, &cos), &to_dev(&e, &sin), mode);
        same_bits(&to_host(&e, &xb), &want, &format!("rope {mode:?}"));
    }

    // Residual adds, biases, row gathers and the Hadamard rotation.
    let a = random_vec(&mut rng, 7 * 24, 1.0);
    let bias = random_vec(&mut rng, 24, 1.0);
    let mut want = a.clone();
    c.add_assign(&mut want, &bias.repeat(7));
    c.add_rows(&mut want, &bias);
    let mut ab = to_dev(&e, &a);
    e.add_assign(&mut ab, &to_dev(&e, &bias.repeat(7)));
    e.add_rows(&mut ab, &to_dev(&e, &bias));
    same_bits(&to_host(&e, &ab), &want, "add_assign + add_rows");

    let rows = [6usize, 0, 6, 2];
    let mut want = Vec::new();
    c.gather_rows(&a, &rows, 24, &mut want);
    let mut o = e.buffer();
    e.gather_rows(&to_dev(&e, &a), &rows, 24, &mut o);
    same_bits(&to_host(&e, &o), &want, "gather_rows");

    for n in [64, 128] {
        let mut want = random_vec(&mut rng, 3 * n, 2.0);
        let mut xb = to_dev(&e, &want);
        c.fwht(&mut want, n);
        e.fwht(&mut xb, n);
        same_bits(&to_host(&e, &xb), &want, &format!("fwht {n}"));
    }
}

/// Sequences of the given lengths over scattered, shuffled blocks of `bs` slots (the last
/// block of each partly filled): their block tables and each token's slot.
fn ragged_tables(
    rng: &mut ChaCha8Rng,
    lens: &[usize],
    bs: usize,
    pool: usize,
) -> (Vec<Vec<u32>>, Vec<KvSlot>) {
    let mut free: Vec<u32> = (0..pool as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.random_range(0..=i));
    }
    let mut tables = Vec::new();
    let mut slots = Vec::new();
    for &n in lens {
        let table: Vec<u32> = (0..n.div_ceil(bs)).map(|_| free.pop().unwrap()).collect();
        for p in 0..n {
            slots.push(KvSlot { block: table[p / bs], slot: (p % bs) as u32 });
        }
        tables.push(table);
    }
    (tables, slots)
}

/// A CPU and a device KV pool of geometry `g`, each given the same random K and V at `layer`
/// for sequences of `lens` over scattered blocks (`ragged_tables`, 3 blocks to spare).
struct Pools {
    tables: Vec<Vec<u32>>,
    blocks: usize,
    v: Vec<f32>,
    kc: <CpuBackend as Backend>::Kv,
    ke: <CudaBackend<Box<dyn Device>> as Backend>::Kv,
}

fn filled_pools(
    c: &CpuBackend,
    e: &CudaBackend<Box<dyn Device>>,
    rng: &mut ChaCha8Rng,
    g: KvGeometry,
    lens: &[usize],
    layer: usize,
) -> Pools {
    let bs = g.block_size;
    let blocks = lens.iter().map(|n| n.div_ceil(bs)).sum::<usize>() + 3;
    let (tables, slots) = ragged_tables(rng, lens, bs, blocks);
    let k = random_vec(rng, slots.len() * g.kv_dim(), 1.5);
    let v = random_vec(rng, slots.len() * g.kv_dim(), 1.5);
    let mut kc = c.kv(g, blocks).unwrap();
    let mut ke = e.kv(g, blocks).unwrap();
    c.kv_write(&mut kc, layer, &k, &v, &slots);
    e.kv_write(&mut ke, layer, &to_dev(e, &k), &to_dev(e, &v), &slots);
    Pools { tables, blocks, v, kc, ke }
}

#[test]
fn kv_write_and_paged_attention_equal_cpu_over_ragged_tables_and_gqa() {
    let (c, e) = (cpu(), emu());
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    // (dtype, head_dim, kv_heads, query heads, block size): GQA groups of 1, 2 and 3; a head
    // of 80 has a decode tail past the last 64; q8_0 rows are whole 32-value blocks.
    let cases = [
        (KvDtype::F16, 64, 2, 6, 4),
        (KvDtype::F32, 80, 1, 2, 16),
        (KvDtype::F16, 80, 3, 3, 3),
        (KvDtype::F32, 64, 2, 4, 5),
        (KvDtype::Q8_0, 64, 2, 6, 4),
        (KvDtype::Q8_0NoRot, 96, 1, 2, 16),
        (KvDtype::Q8_0, 128, 3, 3, 5),
    ];
    for (case, &(dtype, head_dim, kv_heads, heads, bs)) in cases.iter().enumerate() {
        let g = KvGeometry { layers: 2, kv_heads, head_dim, block_size: bs, dtype };
        let lens: [usize; 3] = [rng.random_range(1..40), rng.random_range(1..9), 37];
        let Pools { tables, blocks: pool, kc, ke, .. } =
            filled_pools(&c, &e, &mut rng, g, &lens, 1);
        for blk in 0..pool {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            kc.read_block(blk, &mut a);
            ke.read_block(blk, &mut b);
            assert!(a == b, "case {case}: KV block {blk} differs after kv_write");
        }
        // Every position of every sequence, mixing sequences in one call (prompt-like runs: the
        // tiled kernel for f16/f32), then only each sequence's last (a decode batch: a block
        // per query); each in full and through sliding windows (one shorter than a softmax
        // chunk, one longer), whose keys start at different offsets within one tile.
        let scale = 1.0 / (head_dim as f32).sqrt();
        for window in [None, Some(5), Some(20)] {
            let every = |phase| -> Vec<AttnQuery<'_>> {
                lens.iter()
                    .zip(&tables)
                    .flat_map(|(&n, t)| {
                        (0..n).map(move |pos| AttnQuery::full(pos, t, phase).windowed(window))
                    })
                    .collect()
            };
            let last = |phase| -> Vec<AttnQuery<'_>> {
                lens.iter()
                    .zip(&tables)
                    .map(|(&n, t)| AttnQuery::full(n - 1, t, phase).windowed(window))
                    .collect()
            };
            for (phase, queries) in [
                (Phase::Prefill, every(Phase::Prefill)),
                (Phase::Decode, every(Phase::Decode)),
                (Phase::Decode, last(Phase::Decode)),
                (Phase::Prefill, last(Phase::Prefill)),
            ] {
                let q = random_vec(&mut rng, queries.len() * heads * head_dim, 2.0);
                let mut want = vec![0f32; q.len()];
                c.attention(&kc, 1, heads, &q, scale, &queries, &mut want);
                let mut out = e.buffer();
                e.attention(&ke, 1, heads, &to_dev(&e, &q), scale, &queries, &mut out);
                let what =
                    format!("case {case} {phase:?} window {window:?}, {} queries", queries.len());
                same_bits(&to_host(&e, &out), &want, &what);
            }
        }
    }
}

/// Prompt attention with flash attention's running softmax (`with_flash`), f16/f32 KV over
/// ragged tables, GQA and several 16-key tiles per query (so the running maximum grows and
/// the outputs are rescaled): each output within `(u + 2^-17)·max|V|` of the CPU's, `u` the
/// CPU's rounding of its probabilities to the KV type (2^-10 for f16, twice f16's unit
/// roundoff for the probability and its normalization; 0 for f32), 2^-17 for the f32
/// roundings of the exponentials' arguments and results across a few rescales. A missed
/// rescale is off by a whole share of the weights. Batches of generated tokens alone keep
/// the exact kernel: the CPU's bits.
#[test]
fn flash_attention_is_within_its_bound_of_the_cpu() {
    let (c, e) = (cpu(), emu().with_flash(true));
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    // (dtype, head_dim, kv_heads, query heads, block size)
    let cases = [
        (KvDtype::F16, 64, 2, 6, 4),
        (KvDtype::F32, 80, 1, 2, 16),
        (KvDtype::F16, 256, 1, 2, 16),
        (KvDtype::F32, 64, 3, 3, 5),
    ];
    let mut worst = [0.0f64; 2];
    for (case, &(dtype, head_dim, kv_heads, heads, bs)) in cases.iter().enumerate() {
        let g = KvGeometry { layers: 1, kv_heads, head_dim, block_size: bs, dtype };
        let lens: [usize; 3] = [rng.random_range(40..80), rng.random_range(1..9), 37];
        let Pools { tables, v, kc, ke, .. } = filled_pools(&c, &e, &mut rng, g, &lens, 0);
        let vmax = f64::from(v.iter().fold(0f32, |m, x| m.max(x.abs())));
        let u = if dtype == KvDtype::F16 { 2f64.powi(-10) } else { 0.0 };
        let bound = (u + 2f64.powi(-17)) * vmax;
        let scale = 1.0 / (head_dim as f32).sqrt();
        // The first sequence through a window of 24 (several tiles of each query masked).
        let window = |s: usize| (s == 0).then_some(24);
        let query = |s: usize, pos: usize, phase| {
            AttnQuery::full(pos, &tables[s], phase).windowed(window(s))
        };
        let every = |phase| -> Vec<AttnQuery<'_>> {
            (0..3).flat_map(|s| (0..lens[s]).map(move |p| query(s, p, phase))).collect()
        };
        // A prompt chunk of the first sequence beside the others' next tokens.
        let mixed: Vec<AttnQuery<'_>> = (20..lens[0])
            .map(|p| query(0, p, Phase::Prefill))
            .chain((1..3).map(|s| query(s, lens[s] - 1, Phase::Decode)))
            .collect();
        let last: Vec<AttnQuery<'_>> =
            (0..3).map(|s| query(s, lens[s] - 1, Phase::Decode)).collect();
        for (name, queries) in [
            ("prompts", every(Phase::Prefill)),
            ("decode-phase runs", every(Phase::Decode)),
            ("mixed", mixed),
            ("generated alone", last),
        ] {
            let q = random_vec(&mut rng, queries.len() * heads * head_dim, 2.0);
            let mut want = vec![0f32; q.len()];
            c.attention(&kc, 0, heads, &q, scale, &queries, &mut want);
            let mut out = e.buffer();
            e.attention(&ke, 0, heads, &to_dev(&e, &q), scale, &queries, &mut out);
            let got = to_host(&e, &out);
            let what = format!("case {case} {name}, {} queries", queries.len());
            if name == "generated alone" {
                same_bits(&got, &want, &what);
                continue;
            }
            let mut differ = 0;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let err = (f64::from(*g) - f64::from(*w)).abs();
                assert!(err <= bound, "{what} [{i}]: {g} vs the CPU's {w}, bound {bound:e}");
                let at = usize::from(dtype == KvDtype::F32);
                worst[at] = worst[at].max(err / bound);
                differ += usize::from(g.to_bits() != w.to_bits());
            }
            // The flash kernel ran: its rounding shows somewhere.
            assert!(differ > 0, "{what}: the CPU's bits exactly");
        }
    }
    eprintln!("flash attention: worst error f16 {:.3}, f32 {:.3} of the bound", worst[0], worst[1]);
}

/// The fused RMSNorm + Q8 quantization gives the activations of the two kernels run apart,
/// in every form at once (Q8 from the fused pass, the others from its normalized rows):
/// every matmul reading them is bit-identical. Shapes the fused kernel does not take (no
/// Q8 form, a width not of whole 32-blocks) fall back to the two kernels.
#[test]
fn fused_norm_quantize_gives_the_activations_of_norm_then_quantize() {
    let e = emu();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    use WeightType::{F16, F32, Q4_0, Q4_1, Q4_K, Q8_0};
    let cases: [(usize, usize, &[WeightType]); 4] = [
        (5, 512, &[Q4_0, Q4_1, Q8_0, Q4_K, F16, F32]),
        (9, 96, &[Q8_0, Q4_1, F32]),
        (3, 80, &[Q8_0, F16]),
        (2, 256, &[F32]),
    ];
    for (rows, cols, types) in cases {
        let needs = ActNeeds::of(types.iter().copied());
        let phases: Vec<Phase> = (0..rows).map(phase_of).collect();
        let x = to_dev(&e, &random_vec(&mut rng, rows * cols, 3.0));
        let w = to_dev(&e, &random_vec(&mut rng, cols, 1.0));
        let (mut apart, mut fused) = (e.activations(), e.activations());
        let (mut xn, mut scratch) = (e.buffer(), e.buffer());
        e.resize(&mut xn, rows * cols);
        e.resize(&mut scratch, rows * cols);
        e.rms_norm(&x, &w, 1e-6, &mut xn);
        e.quantize(&xn, rows, cols, needs, &phases, &mut apart);
        e.norm_quantize(&x, &w, 1e-6, (rows, cols), needs, &phases, &mut scratch, &mut fused);
        for &ty in types {
            if !cols.is_multiple_of(ty.block_elems()) {
                continue;
            }
            let data = random_weights(&mut rng, ty, 33, cols);
            let wm = WeightMatrix::new(ty, 33, cols, &data).unwrap();
            let weight = e.weight(&host(&wm));
            let run = |acts| {
                let mut out = e.buffer();
                e.resize(&mut out, rows * 33);
                e.matmul(acts, &mut [MatmulJob { weight: &weight, out: &mut out }]);
                to_host(&e, &out)
            };
            same_bits(&run(&fused), &run(&apart), &format!("{ty} on {rows}x{cols}"));
        }
    }
}

/// RoPE of Q and K fused with the KV append stores what RoPE then `kv_write` store, over
/// scattered slots, GQA groups and both rotation modes, and leaves Q rotated as RoPE does.
#[test]
fn fused_rope_kv_write_equals_rope_then_kv_write() {
    use pdmesh_kernels::Rope;
    let (c, e) = (cpu(), emu());
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    for (dtype, kv_heads, heads, hd, mode) in [
        (KvDtype::F16, 2, 6, 64, RopeMode::Neox),
        (KvDtype::F32, 1, 3, 80, RopeMode::Normal),
        (KvDtype::F16, 3, 3, 32, RopeMode::Normal),
        (KvDtype::Q8_0NoRot, 2, 4, 64, RopeMode::Neox),
    ] {
        let g = KvGeometry { layers: 3, kv_heads, head_dim: hd, block_size: 4, dtype };
        let (_, slots) = ragged_tables(&mut rng, &[7, 2, 5], 4, 9);
        let n = slots.len();
        let q = random_vec(&mut rng, n * heads * hd, 2.0);
        let k = random_vec(&mut rng, n * kv_heads * hd, 2.0);
        let v = random_vec(&mut rng, n * kv_heads * hd, 2.0);
        let angles: Vec<f32> = (0..n * hd / 2).map(|_| rng.random_range(-30.0f32..30.0)).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let (mut qc, mut kc) = (q.clone(), k.clone());
        let mut kvc = c.kv(g, 9).unwrap();
        let rope = Rope { cos: &cos, sin: &sin, mode };
        c.rope_kv_write(&mut kvc, 2, &mut qc, &mut kc, &v, heads, rope, &slots);
        let (mut qe, mut ke) = (to_dev(&e, &q), to_dev(&e, &k));
        let mut kve = e.kv(g, 9).unwrap();
        let (ce, se) = (to_dev(&e, &cos), to_dev(&e, &sin));
        let rope = Rope { cos: &ce, sin: &se, mode };
        e.rope_kv_write(&mut kve, 2, &mut qe, &mut ke, &to_dev(&e, &v), heads, rope, &slots);
        let what = format!("{dtype:?} {kv_heads}/{heads} heads of {hd}, {mode:?}");
        same_bits(&to_host(&e, &qe), &qc, &format!("{what}: Q"));
        for blk in 0..9 {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            kvc.read_block(blk, &mut a);
            kve.read_block(blk, &mut b);
            assert!(a == b, "{what}: KV block {blk} differs");
        }
    }
}

/// Rows cut to their sampler's candidates on the device hold the host rule's set
/// (`Cut::apply`): greedy ties, NaN never, -inf rows, the temperature's margin on scaled
/// values, top-k with ties at the k-th and -0 below +0; rows narrower and far wider than a
/// block; a row over `MAX_CANDIDATES` sends the step back whole on both.
#[test]
fn candidates_are_the_host_rules_set() {
    let (c, e) = (cpu(), emu());
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let by_id = |mut v: Vec<(u32, f32)>| {
        v.sort_by_key(|p| p.0);
        v.into_iter().map(|(i, x)| (i, x.to_bits())).collect::<Vec<_>>()
    };
    let sampled = |t: f32, top_k| Cut { scale: 1.0 / t, margin: 30.0, top_k };
    for cols in [1usize, 7, 300, 49_152] {
        let mut rows: Vec<Vec<f32>> = (0..8).map(|_| random_vec(&mut rng, cols, 10.0)).collect();
        // Ties: the maximum again further on (and first where the row has room).
        let m = rows[1].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        rows[1][cols - 1] = m;
        rows[1][cols / 2] = m;
        rows[2].iter_mut().step_by(3).for_each(|v| *v = f32::NAN);
        rows[3].fill(f32::NEG_INFINITY);
        rows[3][0] = f32::NAN;
        if cols > MAX_CANDIDATES {
            // Otherwise every -inf is a candidate, more than fit.
            rows[3][5] = 1.0;
            rows[3][cols - 2] = 1.0;
        }
        rows[4].fill(f32::NAN);
        // Ties at the k-th: values on a grid.
        rows[5].iter_mut().for_each(|v| *v = (*v * 20.0).round());
        // A spread wide enough that the margin cuts, all below zero.
        rows[6].iter_mut().for_each(|v| *v = *v * 40.0 - 500.0);
        // Signed zeros tied at the top: total_cmp ranks -0 below +0.
        if cols <= 300 {
            rows[7] = (0..cols).map(|i| [0.0, -0.0, -1.0][i % 3]).collect();
        } else {
            rows[7].iter_mut().for_each(|v| *v = (*v * 20.0).round() * 0.25);
        }
        let cuts = [
            Cut::GREEDY,
            Cut::GREEDY,
            sampled(0.7, 40),
            sampled(1.0, 5),
            sampled(0.5, 1),
            sampled(1.0, 7),
            sampled(0.3, if cols < 300 { 0 } else { 50 }),
            if cols <= 300 { sampled(1.0, 1) } else { sampled(1.3, 64) },
        ];
        let flat: Vec<f32> = rows.concat();
        let mut host = Candidates::default();
        assert!(c.candidates(&flat, cols, &cuts, &mut host), "{cols} columns on the CPU");
        let mut got = Candidates::default();
        assert!(e.candidates(&to_dev(&e, &flat), cols, &cuts, &mut got), "{cols} columns");
        assert_eq!(got.rows(), cuts.len());
        for (r, (row, cut)) in rows.iter().zip(&cuts).enumerate() {
            let mut want = Vec::new();
            cut.apply(row, &mut want);
            assert_eq!(by_id(host.row(r).to_vec()), by_id(want.clone()), "CPU row {r}");
            assert_eq!(by_id(got.row(r).to_vec()), by_id(want.clone()), "{cols} columns, row {r}");
            if *cut == Cut::GREEDY {
                assert_eq!(argmax_of(got.row(r)), argmax(row), "{cols} columns, row {r}");
            }
        }
        if cols > MAX_CANDIDATES {
            // Every value of a -inf row is its maximum's tie; a loose cut keeps most of a row.
            let loose = [Cut::GREEDY, sampled(1.0, 0)];
            let two: Vec<f32> = [vec![f32::NEG_INFINITY; cols], rows[0].clone()].concat();
            assert!(!c.candidates(&two, cols, &loose, &mut host), "over the cap on the CPU");
            assert!(!e.candidates(&to_dev(&e, &two), cols, &loose, &mut got), "over the cap");
        }
    }
}

#[test]
fn device_kv_pool_moves_blocks_like_the_host_pool() {
    let e = emu();
    let g = KvGeometry { layers: 3, kv_heads: 2, head_dim: 16, block_size: 4, dtype: KvDtype::F16 };
    let mut kv = e.kv(g, 5).unwrap();
    let block: Vec<u8> = (0..g.bytes_per_block()).map(|i| (i * 7 % 251) as u8).collect();
    kv.write_block(2, &block).unwrap();
    kv.copy_block(2, 4);
    let mut back = Vec::new();
    kv.read_block(4, &mut back);
    assert_eq!(back, block);
    let mut layer = Vec::new();
    kv.read_layer(2, 1, &mut layer);
    assert_eq!(layer, block[g.bytes_per_layer()..2 * g.bytes_per_layer()]);
    assert!(kv.write_block(5, &block).is_err(), "a block past the pool");
    assert!(kv.write_block(0, &block[1..]).is_err(), "a short block");
    let mut zero = Vec::new();
    kv.read_block(0, &mut zero);
    assert!(zero.iter().all(|&b| b == 0), "a rejected write changed the pool");
    assert_eq!(kv.region().len(), 5 * g.bytes_per_block());
}

/// Launches of different block sizes in turn, each checked: a thread of the emulator's team
/// that takes no part in a launch must not look at it, for the launch may end (and its
/// record with it) the moment its own threads are done. Reading the launch's size outside
/// the team's lock once let such a thread run a finished launch's blocks again (CI's SIGFPE
/// on a garbage block size).
#[test]
fn launches_of_alternating_block_sizes_each_run_once() {
    use pdmesh_kernels::cuda::{Arg, Dims};
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    let x = random_vec(&mut rng, 64 * 3, 1.0);
    let mut want = x.clone();
    cpu().fwht(&mut want, 64);
    // A launch run twice can also leave the team waiting forever: a hang fails too.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let dev = EmuDevice::new();
        let mem = dev.alloc(x.len() * 4).unwrap();
        let mut got = vec![0f32; x.len()];
        // Launches of 32 and 256 threads in turn: most of the team wakes for each small one
        // and takes no part in it, and the big one that follows may reuse its record's memory.
        for i in 0..4000 {
            let block = if i % 2 == 0 { 32 } else { 256 };
            dev.htod(bytemuck::cast_slice(&x), &mem, 0).unwrap();
            let args = [Arg::ptr(&mem), Arg::long(3), Arg::int(64)];
            dev.launch("fwht", Dims { grid: [1, 1, 1], block: [block, 1, 1] }, &args).unwrap();
            dev.dtoh(&mem, 0, bytemuck::cast_slice_mut(&mut got)).unwrap();
            same_bits(&got, &want, &format!("launch {i} of {block} threads"));
        }
        done.send(()).unwrap();
    });
    finished
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("4,000 small launches did not finish in 2 minutes: the team hung (or failed)");
}

/// `write_blocks` checks every write before it makes any, on the host pool and the device's.
#[test]
fn write_blocks_writes_all_or_nothing() {
    let g = KvGeometry { layers: 2, kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 };
    let bytes = |seed: u8| -> Vec<u8> {
        (0..g.bytes_per_block()).map(|i| (i as u8).wrapping_mul(seed).wrapping_add(1)).collect()
    };
    let (a, b) = (bytes(3), bytes(5));
    let check = |kv: &mut dyn KvStorage, what: &str| {
        let read = |kv: &dyn KvStorage, i| {
            let mut v = Vec::new();
            kv.read_block(i, &mut v);
            v
        };
        let zero = vec![0u8; g.bytes_per_block()];
        assert!(kv.write_blocks(&[(1, &a), (4, &b)]).is_err(), "{what}: block 4 of 4");
        assert!(kv.write_blocks(&[(1, &a), (2, &b[1..])]).is_err(), "{what}: a short block");
        assert_eq!((read(kv, 1), read(kv, 2)), (zero.clone(), zero), "{what}: partly written");
        kv.write_blocks(&[(3, &a), (0, &b)]).unwrap();
        assert_eq!((read(kv, 3), read(kv, 0)), (a.clone(), b.clone()), "{what}");
    };
    check(&mut cpu().kv(g, 4).unwrap(), "host pool");
    check(&mut emu().kv(g, 4).unwrap(), "device pool");
}

/// The recorder behind the CUDA backend turns a repeated list of launches into a graph: a
/// "step" of norms and matmuls over new inputs in the same buffers, run five times, is captured
/// the second time and replayed after, every result still the CPU's (no stale inputs).
#[test]
fn repeated_steps_replay_as_graphs_with_fresh_inputs() {
    let (c, e) = (cpu(), emu());
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let (tokens, cols) = (5, 96);
    let data = random_weights(&mut rng, WeightType::Q4_1, cols, cols);
    let w = WeightMatrix::new(WeightType::Q4_1, cols, cols, &data).unwrap();
    let (wc, we) = (c.weight(&host(&w)), e.weight(&host(&w)));
    let norm = random_vec(&mut rng, cols, 1.0);
    let norm_e = to_dev(&e, &norm);
    let needs = ActNeeds::of([WeightType::Q4_1]);
    let phases = vec![Phase::Decode; tokens];
    let (mut xe, mut ne, mut acts_e) = (e.buffer(), e.buffer(), e.activations());
    let before = e.graph_stats();
    for step in 0..5 {
        let x = random_vec(&mut rng, tokens * cols, 2.0);
        // Four layers of norm, quantize, matmul: twelve launches per step.
        let mut want = x.clone();
        for _ in 0..4 {
            let mut n = vec![0f32; want.len()];
            c.rms_norm(&want, &norm, 1e-5, &mut n);
            let mut acts = c.activations();
            c.quantize(&n, tokens, cols, needs, &phases, &mut acts);
            c.matmul(&acts, &mut [MatmulJob { weight: &wc, out: &mut want }]);
        }
        e.upload(&x, &mut xe);
        for _ in 0..4 {
            e.rms_norm(&xe, &norm_e, 1e-5, &mut ne);
            e.quantize(&ne, tokens, cols, needs, &phases, &mut acts_e);
            e.matmul(&acts_e, &mut [MatmulJob { weight: &we, out: &mut xe }]);
        }
        same_bits(&to_host(&e, &xe), &want, &format!("step {step}"));
    }
    // New values copied into a buffer that a held launch reads: the launch runs first.
    let (a, b) =
        (random_vec(&mut rng, tokens * cols, 2.0), random_vec(&mut rng, tokens * cols, 2.0));
    let mut want = vec![0f32; a.len()];
    c.rms_norm(&a, &norm, 1e-5, &mut want);
    e.upload(&a, &mut xe);
    e.rms_norm(&xe, &norm_e, 1e-5, &mut ne);
    e.upload(&b, &mut xe);
    same_bits(&to_host(&e, &ne), &want, "a copy overtook the launch reading its buffer");
    let s = e.graph_stats();
    assert_eq!(s.captured - before.captured, 1, "{s:?}");
    assert!(s.replayed - before.replayed >= 3, "{s:?}");
}
