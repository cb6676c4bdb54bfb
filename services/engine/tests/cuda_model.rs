//! The whole CUDA backend — kernels, launch geometry, buffers, weights uploaded from the GGUF,
//! the paged KV pool and block tables — running SmolLM2-135M-Instruct on its emulated device
//! (or on GPU 0 with `PDMESH_CUDA_TEST_DEVICE=gpu`, as `just test-gpu` runs it):
//! for 12 prompts batched together, greedy generation gives the CPU backend's tokens and every
//! logit it sampled from agrees (bit for bit, but for RMSNorm's f64 sum order, see
//! `pdmesh_kernels::cuda`); the same with a q8_0 KV cache; and with nobody observing the
//! logits, greedy and top-k samplers picking from the candidates the device cuts the logits
//! to give the tokens the CPU backend samples from whole logits; and with the bounded kernels
//! (tensor-core prompt matmuls, flash attention), logits near the CPU's.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use pdmesh_engine::{
    BackendKind, CudaOptions, Engine, EngineConfig, GenerateParams, Model, SamplingParams,
    generate_batch, generate_batch_observed,
};
use pdmesh_kernels::KvDtype;

const PROMPTS: [&str; 12] = [
    "The capital of France is",
    "Water boils at",
    "def fibonacci(n):",
    "Once upon a time, a",
    "The three primary colors are",
    "2 + 2 =",
    "Bees make honey by",
    "In 1492, Columbus",
    "The opposite of hot is",
    "A haiku about the sea:",
    "SELECT name FROM",
    "Photosynthesis turns light into",
];

/// SmolLM2, or the file `PDMESH_TEST_MODEL` names (the GPU tier's synthetic SmolLM2, its shapes
/// and vocabulary with random weights, where the real file cannot travel).
fn model() -> Arc<Model> {
    let path = std::env::var_os("PDMESH_TEST_MODEL").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(pdmesh_engine::DEFAULT_MODEL_PATH)
        },
        PathBuf::from,
    );
    assert!(path.exists(), "{} is missing: run `just fetch-model`", path.display());
    Arc::new(Model::load(&path).unwrap())
}

/// The emulated device runs one launch at a time; two models at once only thrash it.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Tokens each prompt generates: `n`, or under a sanitizer (`just test-emu-asan`) two — the
/// prompt's step and one decode step of the whole batch. That runs every kernel at every shape
/// the longer run does (the sanitizer checks each launch's accesses; more steps repeat the same
/// launches on a cache one token longer) in a fraction of the time, which there is minutes.
/// Attention across many KV blocks is the 300-token prompts' (the engine's unit tests, which
/// the sanitizer runs also run).
fn steps(n: usize) -> usize {
    if std::env::var_os("PDMESH_EMU_SANITIZE").is_some() { n.min(2) } else { n }
}

/// The backend the CUDA side of each comparison runs on.
fn cuda() -> BackendKind {
    match std::env::var("PDMESH_CUDA_TEST_DEVICE").as_deref() {
        Ok("gpu") => BackendKind::Cuda { device: 0, opts: CudaOptions::default() },
        _ => BackendKind::CudaEmu { opts: CudaOptions::default() },
    }
}

/// The first `prompts` prompts' greedy tokens (`max_tokens` each) and the logits each was
/// picked from.
fn run(
    model: &Arc<Model>,
    backend: BackendKind,
    kv_dtype: KvDtype,
    prompts: usize,
    max_tokens: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let cfg = EngineConfig {
        kv_blocks: 64,
        max_batch_tokens: 256,
        kv_dtype,
        backend,
        ..Default::default()
    };
    let mut e = Engine::new(Arc::clone(model), cfg).unwrap();
    let reqs: Vec<(Vec<u32>, GenerateParams)> = PROMPTS[..prompts]
        .iter()
        .map(|p| {
            let ids = model.tokenizer.encode(p).unwrap();
            (ids, GenerateParams { max_tokens, ignore_eos: true, ..Default::default() })
        })
        .collect();
    let mut logits = vec![Vec::new(); prompts];
    let out = generate_batch_observed(
        &mut e,
        &reqs,
        prompts,
        |i, l| logits[i].push(l.to_vec()),
        |_, _| true,
    )
    .unwrap();
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks(), "leaked KV blocks");
    (out.into_iter().map(|g| g.tokens).collect(), logits)
}

/// Runs both backends and compares: the same tokens, and logits within the bound (all
/// bit-identical so far; RMSNorm's sum order may cost one ulp of a row's scale).
fn compare(kv_dtype: KvDtype, prompts: usize, max_tokens: usize) {
    let _one = one_at_a_time();
    let m = model();
    let start = std::time::Instant::now();
    let (want, want_logits) =
        run(&m, BackendKind::Cpu { simd: None }, kv_dtype, prompts, max_tokens);
    let cpu_time = start.elapsed();
    let start = std::time::Instant::now();
    let (got, got_logits) = run(&m, cuda(), kv_dtype, prompts, max_tokens);
    eprintln!("{kv_dtype} KV: cpu {cpu_time:?}, {:?} {:?}", cuda(), start.elapsed());
    let (mut exact, mut total, mut worst) = (0usize, 0usize, 0f32);
    for (i, (g, w)) in got_logits.iter().zip(&want_logits).enumerate() {
        assert_eq!(g.len(), w.len(), "prompt {i}: steps");
        for (gs, ws) in g.iter().zip(w) {
            for (a, b) in gs.iter().zip(ws) {
                total += 1;
                exact += usize::from(a.to_bits() == b.to_bits());
                worst = worst.max((a - b).abs());
            }
        }
    }
    eprintln!("logits: {exact} of {total} bit-identical, largest difference {worst:e}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g,
            w,
            "{kv_dtype} KV, prompt {i} ({:?}): {:?} vs the CPU's {:?}",
            PROMPTS[i],
            m.tokenizer.decode(g),
            m.tokenizer.decode(w)
        );
    }
    assert!(worst < 1e-3, "logits differ by up to {worst}");
}

#[test]
fn cuda_backend_generates_the_cpu_backends_tokens_on_smollm2() {
    compare(KvDtype::F16, PROMPTS.len(), steps(8));
}

/// q8_0 KV: the Hadamard rotations around attention and llama.cpp's flash-attention numerics,
/// end to end (six prompts: the emulated device is slow).
#[test]
fn cuda_backend_with_q8_0_kv_generates_the_cpu_backends_tokens() {
    compare(KvDtype::Q8_0, 6, steps(6));
}

/// The bounded kernels end to end (`--cuda-mma --cuda-flash`: prompt matmuls on the int8
/// tensor cores, prompt attention with flash attention's running softmax): three prompts
/// batched into one prefill step, each one's logits against the CPU backend's. Both round
/// differently (`cuda_backend.rs` bounds each kernel), and a flipped quant in a layer's
/// requantized input travels, so this is loose — within 2^-3 of each row's largest — and
/// catches a broken kernel (a wrong fragment layout, scale or rescale is off by whole terms),
/// not rounding. The hardware tier runs it on the 1B-shaped model too, whose K-quant weights
/// take `mm_mma`'s sub-block path (SmolLM2's are Q4_1 and Q8_0).
#[test]
fn bounded_kernels_stay_near_the_cpu_backends_logits() {
    let _one = one_at_a_time();
    let m = model();
    let opts = CudaOptions { mma: true, flash: true };
    let bounded = match cuda() {
        BackendKind::Cuda { device, .. } => BackendKind::Cuda { device, opts },
        _ => BackendKind::CudaEmu { opts },
    };
    let start = std::time::Instant::now();
    let (_, want) = run(&m, BackendKind::Cpu { simd: None }, KvDtype::F16, 3, 1);
    let cpu_time = start.elapsed();
    let (_, got) = run(&m, bounded.clone(), KvDtype::F16, 3, 1);
    eprintln!("cpu {cpu_time:?}, {bounded:?} {:?}", start.elapsed() - cpu_time);
    let (mut rows, mut exact, mut worst) = (0usize, 0usize, 0f32);
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        let top = w.iter().fold(0f32, |a, v| a.max(v.abs()));
        let diff = g.iter().zip(w).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        worst = worst.max(diff / top);
        rows += 1;
        exact += usize::from(g.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    eprintln!(
        "bounded kernels: {exact} of {rows} rows bit-identical, worst {worst:e} of a row's largest"
    );
    assert_eq!(rows, 3, "one row per prompt");
    assert!(exact < rows, "every row the CPU's bits: the bounded kernels did not run");
    assert!(worst <= 2f32.powi(-3), "logits differ by {worst} of the row's largest");
}

/// Unobserved generation: each step's logits are cut on the device (`candidates_rows`) to
/// what the samplers pick from — the greedy maximum, or a top-k under a temperature — and
/// only those read back; the CPU reference samples from whole logits (observed). Five
/// prompts: a decode step of up to four tokens takes the matmuls' `_lanes` shape, whose warp
/// shuffles the emulator pays for in barriers (minutes here; the kernel tests cover it).
#[test]
fn samplers_picking_from_device_candidates_give_the_cpu_backends_tokens() {
    let _one = one_at_a_time();
    let m = model();
    let sampling = |i: usize| SamplingParams {
        temperature: [0.0, 0.8, 1.2][i % 3],
        top_k: [0, 20, 60][i % 3],
        top_p: [1.0, 1.0, 0.9][i % 3],
        seed: i as u64,
        ..Default::default()
    };
    let reqs: Vec<(Vec<u32>, GenerateParams)> = PROMPTS[..5]
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ids = m.tokenizer.encode(p).unwrap();
            let params = GenerateParams { sampling: sampling(i), ..Default::default() };
            (ids, GenerateParams { max_tokens: steps(6), ignore_eos: true, ..params })
        })
        .collect();
    let tokens = |backend, whole: bool| {
        let cfg =
            EngineConfig { kv_blocks: 64, max_batch_tokens: 256, backend, ..Default::default() };
        let mut e = Engine::new(Arc::clone(&m), cfg).unwrap();
        let out = if whole {
            generate_batch_observed(&mut e, &reqs, reqs.len(), |_, _| {}, |_, _| true)
        } else {
            generate_batch(&mut e, &reqs, reqs.len(), |_, _| true)
        };
        out.unwrap().into_iter().map(|g| g.tokens).collect::<Vec<_>>()
    };
    let start = std::time::Instant::now();
    let want = tokens(BackendKind::Cpu { simd: None }, true);
    let cpu_time = start.elapsed();
    let got = tokens(cuda(), false);
    eprintln!("cpu {cpu_time:?}, {:?} {:?}", cuda(), start.elapsed() - cpu_time);
    assert_eq!(got, want);
}

/// The tiny Gemma 3, whose layer 0 attends through a window of 8 tokens in a KV group of its
/// own: by the end of its 300-token prompts the blocks that layer's window left are gone from
/// its tables (a released entry is `u32::MAX`, uploaded with the rest of the table), and the
/// device, reading only the window's entries, gives the CPU backend's tokens and logits.
#[test]
fn a_windowed_model_whose_local_blocks_left_gives_the_cpu_backends_tokens() {
    use pdmesh_model::testing::{TinyArch, TinyModel};
    let _one = one_at_a_time();
    let tiny = TinyModel { arch: TinyArch::Gemma3, context: 512, ..TinyModel::default() };
    let m = Arc::new(Model::from_gguf(tiny.file(), "tiny.gguf".into()).unwrap());
    let run = |backend| {
        let cfg =
            EngineConfig { kv_blocks: 128, max_batch_tokens: 128, backend, ..Default::default() };
        let mut e = Engine::new(Arc::clone(&m), cfg).unwrap();
        assert_eq!(e.kv().groups().count(), 2);
        let reqs: Vec<(Vec<u32>, GenerateParams)> = (0..3u32)
            .map(|p| {
                let ids = (0..300).map(|i| 33 + (i * 7 + p * 13) % 150).collect();
                (
                    ids,
                    GenerateParams {
                        max_tokens: steps(12),
                        ignore_eos: true,
                        ..Default::default()
                    },
                )
            })
            .collect();
        let mut logits = vec![Vec::new(); reqs.len()];
        let out = generate_batch_observed(
            &mut e,
            &reqs,
            3,
            |i, l| logits[i].push(l.to_vec()),
            |_, _| true,
        )
        .unwrap();
        assert_eq!(e.kv().free_blocks(), e.kv().total_blocks(), "leaked KV blocks");
        (out.into_iter().map(|g| g.tokens).collect::<Vec<_>>(), logits)
    };
    let (want, want_logits) = run(BackendKind::Cpu { simd: None });
    let (got, got_logits) = run(cuda());
    assert_eq!(got, want);
    for (g, w) in got_logits.iter().flatten().zip(want_logits.iter().flatten()) {
        let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-3, "logits differ by up to {worst}");
    }
}
