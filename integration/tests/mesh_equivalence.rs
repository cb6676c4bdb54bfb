//! The disaggregation contract end to end: prompts through a mesh of 2 prefill and 2 decode
//! processes, 8 at a time, give exactly the tokens `pdmesh run` gives on one engine — greedy and
//! seeded sampling — over each KV transport (with every block checksummed and verified), and
//! every node's KV blocks are back to free afterwards. The same holds for the models people
//! run: SmolLM2 in llama.cpp's `Q4_K_M` and a model of Llama 3.2 1B's shapes.

#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;
use std::time::Duration;

use pdmesh_integration::reference::{PROMPTS, reference, reference_with, request};
use pdmesh_integration::{Cluster, collect, eventually, pdmesh_bin, per_transport, repo_root, run};
use pdmesh_proto::v1::{
    FinishReason, GenerateRequest, SamplingParams, generate_request, generate_response,
};

const MAX_TOKENS: u32 = 24;

/// The single-engine tokens, computed once for both transports.
fn expected() -> &'static [Vec<u32>] {
    static E: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    E.get_or_init(|| (0..PROMPTS.len()).map(|i| reference(i, MAX_TOKENS)).collect())
}

/// Four node processes are all two cores take: one mesh at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

per_transport!(disaggregated_mesh_gives_the_tokens_of_one_engine);

async fn disaggregated_mesh_gives_the_tokens_of_one_engine(transport: &str) {
    let _serial = SERIAL.lock().await;
    let expected = tokio::task::spawn_blocking(expected).await.unwrap();
    let cluster = Cluster::builder()
        .prefill(2)
        .decode(2)
        .transport(transport)
        .prefill_args(&["--kv-verify"])
        .start()
        .await;
    let baseline: Vec<u32> = {
        let mut v = Vec::new();
        for i in 0..2 {
            v.push(cluster.decode_stats(i).await.load.unwrap().free_blocks);
        }
        v
    };
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(8));
    let mut tasks = Vec::new();
    for i in 0..PROMPTS.len() {
        let mut client = cluster.client().await;
        let sem = std::sync::Arc::clone(&sem);
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire().await.unwrap();
            let req = request(i, MAX_TOKENS);
            let mut s = client.generate(req).await.unwrap().into_inner();
            let mut tokens = Vec::new();
            let mut finished = None;
            while let Some(m) = s.message().await.unwrap() {
                match m.event.unwrap() {
                    generate_response::Event::Started(st) => assert!(st.prompt_tokens > 0),
                    generate_response::Event::Delta(d) => tokens.extend(d.token_ids),
                    generate_response::Event::Finished(f) => finished = Some(f),
                }
            }
            (i, tokens, finished.expect("a finish message"))
        }));
    }
    let mut nodes_used = std::collections::BTreeSet::new();
    for t in tasks {
        let (i, tokens, f) = t.await.unwrap();
        assert_eq!(tokens, expected[i], "prompt {i} ({:?}) differs from `pdmesh run`", PROMPTS[i]);
        let reason = FinishReason::try_from(f.reason).unwrap();
        assert!(matches!(reason, FinishReason::Length | FinishReason::Eos), "{reason:?}");
        let timings = f.timings.unwrap();
        assert_eq!(timings.kv_transport, transport);
        assert!(timings.kv_bytes > 0);
        assert_eq!(f.usage.unwrap().completion_tokens as usize, tokens.len());
        nodes_used.insert(timings.prefill_node);
        nodes_used.insert(timings.decode_node);
    }
    assert_eq!(nodes_used.len(), 4, "load-aware placement used only {nodes_used:?}");
    let mut sent = 0;
    for i in 0..2 {
        for t in cluster.prefill_stats(i).await.transports {
            assert_eq!(t.transport, transport, "{t:?}");
            assert_eq!((t.failures, t.fallbacks), (0, 0), "{t:?}");
            // On one host UCX writers map the decode pool and copy into it.
            let mapped = if transport == "ucx" { t.transfers } else { 0 };
            assert_eq!(t.mapped, mapped, "{t:?}");
            sent += t.transfers;
        }
    }
    assert_eq!(sent, PROMPTS.len() as u64, "every transfer is counted under its transport");
    for (i, &want) in baseline.iter().enumerate() {
        eventually(Duration::from_secs(10), "decode blocks back to baseline", || {
            let c = &cluster;
            async move {
                let s = c.decode_stats(i).await;
                let l = s.load.unwrap();
                l.free_blocks == want && l.committed_blocks == 0
            }
        })
        .await;
    }
}

per_transport!(q8_0_kv_through_the_mesh_gives_the_tokens_of_one_engine);

/// With `--kv-dtype q8_0` everywhere, the blocks prefill ships are q8_0 (34 bytes per 32
/// values, rotated), verified on arrival, and decode continues from them to exactly the tokens
/// of `pdmesh run --kv-dtype q8_0`, greedy and seeded. The decode node keeps its pool private
/// (`--kv-shared-pool false`), so UCX carries the blocks by puts, as between hosts.
async fn q8_0_kv_through_the_mesh_gives_the_tokens_of_one_engine(transport: &str) {
    const Q8: [&str; 2] = ["--kv-dtype", "q8_0"];
    // SmolLM2: 30 layers x (K+V) x 3 KV heads x 16 slots x 2 blocks of 34 bytes.
    const Q8_BLOCK_BYTES: u64 = 195_840;
    let _serial = SERIAL.lock().await;
    let n = 6;
    let expected = tokio::task::spawn_blocking(move || {
        (0..n).map(|i| reference_with(i, MAX_TOKENS, &Q8)).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let cluster = Cluster::builder()
        .prefill(1)
        .decode(1)
        .transport(transport)
        .prefill_args(&["--kv-verify", Q8[0], Q8[1]])
        .decode_args(&[Q8[0], Q8[1], "--kv-shared-pool", "false"])
        .start()
        .await;
    let mut client = cluster.client().await;
    for (i, want) in expected.iter().enumerate() {
        let mut s = client.generate(request(i, MAX_TOKENS)).await.unwrap().into_inner();
        let (mut tokens, mut finished) = (Vec::new(), None);
        while let Some(m) = s.message().await.unwrap() {
            match m.event.unwrap() {
                generate_response::Event::Delta(d) => tokens.extend(d.token_ids),
                generate_response::Event::Finished(f) => finished = Some(f),
                generate_response::Event::Started(_) => {}
            }
        }
        assert_eq!(&tokens, want, "prompt {i}: q8_0 KV through the mesh differs from one engine");
        let t = finished.expect("a finish message").timings.unwrap();
        assert_eq!(t.kv_transport, transport);
        assert!(
            t.kv_bytes > 0 && t.kv_bytes % Q8_BLOCK_BYTES == 0,
            "prompt {i}: {} KV bytes are not whole q8_0 blocks",
            t.kv_bytes
        );
    }
    let stats = cluster.prefill_stats(0).await;
    for t in stats.transports {
        assert_eq!((t.failures, t.fallbacks, t.mapped), (0, 0, 0), "{t:?}");
        assert_eq!(t.transfers, n as u64, "{t:?}");
    }
}

/// The CUDA backend the mixed-mesh test runs: emulated, or the GPU when
/// `PDMESH_CUDA_TEST_DEVICE=gpu` (`just test-gpu`).
fn cuda_backend() -> &'static str {
    match std::env::var("PDMESH_CUDA_TEST_DEVICE").as_deref() {
        Ok("gpu") => "cuda",
        _ => "cuda-emu",
    }
}

per_transport!(cuda_prefill_feeds_a_cpu_decode_node);

/// A prefill node on the CUDA backend (its emulated device: the same kernels and host side as
/// on a GPU) hands its KV to a CPU decode node: both keep f16 paged blocks of one shape, the
/// layout handshake accepts them, and the tokens are those of one CPU engine.
async fn cuda_prefill_feeds_a_cpu_decode_node(transport: &str) {
    let _serial = SERIAL.lock().await;
    let expected = tokio::task::spawn_blocking(expected).await.unwrap();
    let cluster = Cluster::builder()
        .prefill(1)
        .decode(1)
        .transport(transport)
        .prefill_args(&["--kv-verify", "--backend", cuda_backend()])
        .start()
        .await;
    let (p, d) = (cluster.prefill_stats(0).await, cluster.decode_stats(0).await);
    assert!(p.backend.starts_with("cuda/"), "{}", p.backend);
    assert!(d.backend.starts_with("cpu/"), "{}", d.backend);
    assert_eq!(p.layout, d.layout, "the two backends' KV layouts differ");
    let mut client = cluster.client().await;
    // The emulated device is slow: three prompts (greedy and sampled) make the point.
    for (i, want) in expected.iter().enumerate().take(3) {
        let s = client.generate(request(i, MAX_TOKENS)).await.unwrap().into_inner();
        let (tokens, finished) = collect(s).await.unwrap();
        assert_eq!(&tokens, want, "prompt {i}: cuda prefill + cpu decode differs");
        let t = finished.expect("a finish message").timings.unwrap();
        assert_eq!(t.kv_transport, transport);
        assert!(t.kv_bytes > 0);
    }
    let stats = cluster.prefill_stats(0).await;
    for t in stats.transports {
        assert_eq!((t.failures, t.fallbacks), (0, 0), "{t:?}");
    }
}

/// A decode node whose pool UCX writers must not reach directly (`--kv-staging staged`, what
/// a GPU's pool gets from a UCX without CUDA) takes its KV through host staging blocks: in
/// shared memory that a prefill node on this host maps, or by UCX puts; a reservation that
/// finds the staging area full takes its KV over gRPC. Every path gives one engine's tokens,
/// and stats name the path and count each use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_decode_pool_gives_the_tokens_of_one_engine() {
    let _serial = SERIAL.lock().await;
    let expected = tokio::task::spawn_blocking(expected).await.unwrap();
    let by = |v: &[pdmesh_proto::v1::TransportStats], name: &str| {
        v.iter().find(|t| t.transport == name).cloned().unwrap_or_default()
    };

    // Staged through shared memory: four prompts at once, over UCX only.
    let cluster = Cluster::builder()
        .prefill(1)
        .decode(1)
        .transport("ucx")
        .prefill_args(&["--kv-verify"])
        .decode_args(&["--kv-staging", "staged"])
        .start()
        .await;
    let d = cluster.decode_stats(0).await;
    assert_eq!(d.kv_path, "staged-host");
    assert!(d.kv_staging_blocks > 0);
    let mut tasks = Vec::new();
    for i in 0..4 {
        let mut client = cluster.client().await;
        tasks.push(tokio::spawn(async move {
            let s = client.generate(request(i, MAX_TOKENS)).await.unwrap().into_inner();
            collect(s).await.unwrap().0
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), expected[i], "prompt {i} through staging differs");
    }
    let ucx = by(&cluster.decode_stats(0).await.transports, "ucx");
    assert_eq!((ucx.transfers, ucx.staged, ucx.failures), (4, 4, 0), "{ucx:?}");
    assert_eq!(by(&cluster.prefill_stats(0).await.transports, "ucx").mapped, 4);
    eventually(Duration::from_secs(10), "the staging blocks are back", || async {
        let d = cluster.decode_stats(0).await;
        d.kv_staging_free_blocks == d.kv_staging_blocks
    })
    .await;
    drop(cluster);

    // Staged through UCX puts, in a staging area of 5 blocks (2 MiB of 360 KiB blocks): a
    // prompt of 3 blocks is put there, one of 7 finds it full and comes over gRPC (auto).
    let cluster = Cluster::builder()
        .prefill(1)
        .decode(1)
        .transport("auto")
        .prefill_args(&["--kv-verify"])
        .decode_args(&["--kv-staging", "staged", "--kv-shared-pool", "false"])
        .decode_args(&["--kv-staging-mb", "2"])
        .start()
        .await;
    assert_eq!(cluster.decode_stats(0).await.kv_staging_blocks, 5);
    let mut client = cluster.client().await;
    let s = client.generate(request(0, MAX_TOKENS)).await.unwrap().into_inner();
    assert_eq!(collect(s).await.unwrap().0, expected[0], "a staged put differs");
    let long =
        "The lighthouse keeper climbed the stairs and looked out over the grey sea. ".repeat(6);
    let want = tokio::task::spawn_blocking({
        let long = long.clone();
        move || run_raw(&pdmesh_integration::model_path(), &long)
    })
    .await
    .unwrap();
    let req = GenerateRequest {
        input: Some(generate_request::Input::Prompt(long)),
        max_tokens: MAX_TOKENS,
        sampling: Some(SamplingParams { temperature: 0.0, ..Default::default() }),
        ..Default::default()
    };
    let s = client.generate(req).await.unwrap().into_inner();
    assert_eq!(collect(s).await.unwrap().0, want, "a prompt past the staging area differs");
    let d = cluster.decode_stats(0).await;
    let (ucx, grpc) = (by(&d.transports, "ucx"), by(&d.transports, "grpc"));
    assert_eq!((ucx.transfers, ucx.staged, grpc.transfers), (1, 1, 1), "{:?}", d.transports);
    assert_eq!(d.kv_staging_full, 1);
    let p = by(&cluster.prefill_stats(0).await.transports, "ucx");
    assert_eq!((p.mapped, p.fallbacks), (0, 1), "{p:?}");
}

per_transport!(gemma3_past_its_window_through_the_mesh);

/// Gemma 3 270M (`just fetch-gemma3`), whose window layers attend to the last 512 tokens only:
/// the 2,560-token prompt of its llama.cpp reference (`just test-models`), through one prefill
/// and one decode node, its KV shipped thin (a block before the window carries only the
/// global layers) and verified, continues with llama.cpp's 32 greedy tokens.
async fn gemma3_past_its_window_through_the_mesh(transport: &str) {
    let _serial = SERIAL.lock().await;
    let model = repo_root().join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(model.exists(), "{} is missing: run `just fetch-gemma3`", model.display());
    let at = repo_root().join("models/test/gemma-3-270m-q4_k_m.long2560.ubatch4.json");
    let meta = std::fs::read_to_string(&at)
        .unwrap_or_else(|e| panic!("{}: {e}; run `just test-models`", at.display()));
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        meta[key].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let (prompt, greedy) = (ids("prompt_tokens"), ids("greedy"));
    let cluster = Cluster::builder()
        .prefill(1)
        .decode(1)
        .model(&model)
        .transport(transport)
        .prefill_args(&["--kv-verify"])
        .start()
        .await;
    let mut client = cluster.client().await;
    let req = pdmesh_integration::greedy(&prompt, greedy.len() as u32);
    let s = client.generate(req).await.unwrap().into_inner();
    let (tokens, finished) = collect(s).await.unwrap();
    assert_eq!(tokens, greedy, "Gemma 3 through the mesh differs from llama.cpp");
    let t = finished.expect("a finish message").timings.unwrap();
    assert_eq!(t.kv_transport, transport);
    // Blocks of 16 tokens, each layer's part (K + V) x 256 x f16 per token. Those wholly
    // before the window of the token after the prompt travel as their 3 global layers only,
    // the rest as all 18.
    let (blocks, thin) = (prompt.len().div_ceil(16), (prompt.len() + 1 - 512) / 16);
    let layer_part = 16 * 2 * 256 * 2;
    assert_eq!(thin, 128);
    assert_eq!(t.kv_bytes, ((thin * 3 + (blocks - thin) * 18) * layer_part) as u64);
}

/// Greedy tokens of `pdmesh run --raw` on one engine for `model`.
fn run_raw(model: &std::path::Path, prompt: &str) -> Vec<u32> {
    let mut c = std::process::Command::new(pdmesh_bin());
    c.args(["run", "--raw", "--prompt", prompt, "--max-tokens", &MAX_TOKENS.to_string()])
        .args(["--temperature", "0", "--json", "--threads", "2", "--model"])
        .arg(model);
    let (code, out, err) = run(c);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// SmolLM2 re-quantized to `Q4_K_M` by llama.cpp (Q5_0, Q8_0, Q4_K and Q6_K tensors) and the
/// synthetic model with Llama 3.2 1B's shapes (16 layers, 2,048 wide, 32 KB of f16 KV per
/// token; both from `just test-models`): two raw prompts each through 1 prefill and 1 decode
/// node give `pdmesh run`'s greedy tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_quant_and_1b_models_through_the_mesh() {
    let _serial = SERIAL.lock().await;
    let prompts = ["The lighthouse keeper climbed the stairs and", "fn main() {\n    let x ="];
    for name in ["smollm2-Q4_K_M", "synth-llama3-1b-Q4_K_M"] {
        let model = repo_root().join(format!("models/test/{name}.gguf"));
        assert!(model.exists(), "{} is missing: run `just test-models`", model.display());
        let m = model.clone();
        let expected = tokio::task::spawn_blocking(move || {
            prompts.iter().map(|p| run_raw(&m, p)).collect::<Vec<_>>()
        })
        .await
        .unwrap();
        let cluster = Cluster::builder().prefill(1).decode(1).model(&model).start().await;
        let mut client = cluster.client().await;
        for (prompt, want) in prompts.iter().zip(&expected) {
            let req = GenerateRequest {
                input: Some(generate_request::Input::Prompt((*prompt).into())),
                max_tokens: MAX_TOKENS,
                sampling: Some(SamplingParams { temperature: 0.0, ..Default::default() }),
                ..Default::default()
            };
            let mut s = client.generate(req).await.unwrap().into_inner();
            let mut tokens = Vec::new();
            while let Some(m) = s.message().await.unwrap() {
                if let generate_response::Event::Delta(d) = m.event.unwrap() {
                    tokens.extend(d.token_ids);
                }
            }
            assert!(!want.is_empty(), "{name}: `pdmesh run` generated nothing for {prompt:?}");
            assert_eq!(
                &tokens, want,
                "{name}: {prompt:?} through the mesh differs from `pdmesh run`"
            );
        }
    }
}

/// Each transport's run takes over two minutes on two cores (most of it the quadratic
/// attention of the prompt, twice): `just test-long` runs them, not CI.
mod a_32k_token_prompt {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "minutes: `just test-long`"]
    async fn grpc() {
        super::a_32k_token_prompt_through_the_mesh("grpc").await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "minutes: `just test-long`"]
    async fn ucx() {
        super::a_32k_token_prompt_through_the_mesh("ucx").await
    }
}

/// A 32,768-token prompt through one prefill and one decode process, on a tiny model whose
/// context is 40,000: nothing on the way limits a long prompt (the request's size, the
/// router's checks, 2,048 blocks of KV shipped and verified, the decode node's attention over
/// all of them), and the tokens are one engine's.
async fn a_32k_token_prompt_through_the_mesh(transport: &str) {
    use pdmesh_engine::testing::{BuildModel, TinyModel};
    let _serial = SERIAL.lock().await;
    let tiny = TinyModel { context: 40_000, ..Default::default() };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-40k.gguf");
    std::fs::write(&model, tiny.gguf()).unwrap();
    let prompt: Vec<u32> = (0..32_768u32).map(|i| (i * 7919 + 13) % 250).collect();
    let want = {
        let cfg = pdmesh_engine::EngineConfig { threads: 2, kv_blocks: 2100, ..Default::default() };
        let mut e = pdmesh_engine::Engine::new(tiny.build(), cfg).unwrap();
        let greedy = pdmesh_engine::SamplingParams { temperature: 0.0, ..Default::default() };
        let p = pdmesh_engine::GenerateParams {
            sampling: greedy,
            max_tokens: 8,
            ignore_eos: true,
            ..Default::default()
        };
        pdmesh_engine::generate(&mut e, &prompt, &p, |_| true).unwrap().tokens
    };
    let blocks = ["--kv-blocks", "2100"];
    let cluster = Cluster::builder()
        .prefill(1)
        .decode(1)
        .model(&model)
        .transport(transport)
        .prefill_args(&["--kv-blocks", "2100", "--kv-verify"])
        .decode_args(&blocks)
        .start()
        .await;
    let mut client = cluster.client().await;
    let s = client.generate(pdmesh_integration::greedy(&prompt, 8)).await.unwrap().into_inner();
    let (tokens, finished) = collect(s).await.unwrap();
    assert_eq!(tokens, want, "a 32K-token prompt through the mesh differs from one engine");
    let f = finished.expect("a finish message");
    assert_eq!(f.usage.unwrap().prompt_tokens, 32_768);
    assert_eq!(f.timings.unwrap().kv_transport, transport);
}
