//! One mesh of real processes serving two models: SmolLM2 (the default, one prefill and one
//! decode node) and Gemma 3 270M (a second architecture with a pool of its own: one prefill
//! and two decode nodes). Each answers by name, over gRPC and over the OpenAI API with the
//! official SDK, with the tokens `pdmesh run` gives on that model; a Gemma stream whose decode
//! node is killed moves to the other Gemma node and continues bit-identically, and once Gemma
//! has no decode node left its stream ends UNAVAILABLE: never on SmolLM2's node.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pdmesh_integration::{Cluster, collect, eventually, pdmesh_bin, repo_root, run, scrape};
use pdmesh_proto::v1::{GenerateRequest, SamplingParams, generate_request, generate_response};
use tonic::Code;

const GEMMA: &str = "gemma3";
const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1";
const PROMPT: &str = "The lighthouse keeper climbed the stairs and";
/// Long enough to kill a decode node mid-stream.
const LONG: u32 = 160;

fn gemma_path() -> PathBuf {
    let m = repo_root().join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(m.exists(), "{} is missing: run `just fetch-gemma3`", m.display());
    m
}

/// `pdmesh run --raw`'s greedy answer on `model` (end of text ignored): its ids and text.
fn run_raw(model: &Path, max_tokens: u32) -> (Vec<u32>, String) {
    let mut c = Command::new(pdmesh_bin());
    c.args(["run", "--raw", "--prompt", PROMPT, "--temperature", "0", "--json"]);
    c.args(["--ignore-eos", "--threads", "2", "--max-tokens", &max_tokens.to_string()]);
    c.arg("--model").arg(model);
    let (code, out, err) = run(c);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let ids = v["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32);
    (ids.collect(), v["text"].as_str().unwrap().to_string())
}

fn request(model: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Prompt(PROMPT.into())),
        max_tokens,
        ignore_eos: true,
        sampling: Some(SamplingParams { temperature: 0.0, ..Default::default() }),
        model: model.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_in_one_mesh_each_by_name_and_moves_stay_in_their_pool() {
    let gemma = gemma_path();
    let (g, s) = (gemma.clone(), pdmesh_integration::model_path());
    let (want_gemma, want_smol, want_long) = tokio::task::spawn_blocking(move || {
        (run_raw(&g, 24), run_raw(&s, 24), run_raw(&g, LONG).0)
    })
    .await
    .unwrap();
    assert_ne!(want_gemma.0[..8], want_smol.0[..8], "the two models' answers must differ");
    let mut c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .also_serve(&gemma, GEMMA, 1, 2)
        // `auto` climbs from SmolLM2 to Gemma below a threshold no answer reaches.
        .tiers(&[SMOL, GEMMA], 0.0)
        .router_args(&["--http-listen", "127.0.0.1:0"])
        .metrics()
        .start()
        .await;
    let mut client = c.client().await;

    // By name over gRPC, and the default for a request that names none.
    for (model, want) in [(GEMMA, &want_gemma), (SMOL, &want_smol), ("", &want_smol)] {
        let s = client.generate(request(model, 24)).await.unwrap().into_inner();
        let (tokens, fin) = collect(s).await.unwrap();
        assert_eq!(tokens, want.0, "{model:?} through the mesh differs from `pdmesh run`");
        let node = fin.unwrap().timings.unwrap().decode_node;
        let gemma_node = node == "decode-1" || node == "decode-2";
        assert_eq!(gemma_node, model == GEMMA, "{model:?} decoded on {node}");
    }
    // `auto`: SmolLM2's answer falls short, Gemma's is kept, and the response says so.
    let s = client.generate(request("auto", 24)).await.unwrap().into_inner();
    let (tokens, fin) = collect(s).await.unwrap();
    let fin = fin.unwrap();
    assert_eq!((tokens, fin.model.as_str()), (want_gemma.0.clone(), GEMMA));
    assert_eq!(fin.timings.unwrap().escalations, 1);
    let e = client.generate(request("llama-70b", 8)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains(GEMMA) && e.message().contains(SMOL), "{e:?}");
    // The router's metrics say which model served what, and each pool's nodes.
    let (m, raw) = scrape(c.router.metrics.as_deref().unwrap()).await;
    let get = |series: String| m.get(&series).copied().unwrap_or_else(|| panic!("{series}: {raw}"));
    // Every model's runs count, the escalated one too: what each model computed.
    for (model, decode, finished) in [(GEMMA, 2.0, 2.0), (SMOL, 1.0, 3.0)] {
        let nodes = format!("pdmesh_router_nodes{{model=\"{model}\",role=\"decode\"}}");
        assert_eq!(get(nodes), decode, "{model}");
        let labels = format!("model=\"{model}\",outcome=\"finished\",reason=\"length\"");
        assert_eq!(get(format!("pdmesh_router_requests_total{{{labels}}}")), finished);
    }
    let unknown = "pdmesh_router_requests_total{outcome=\"failed\",code=\"NotFound\"}";
    assert_eq!(get(unknown.into()), 1.0);
    let escalated = format!("pdmesh_router_escalations_total{{from=\"{SMOL}\"}}");
    assert_eq!(get(escalated), 1.0);

    // The official SDK: both listed, each answering by name.
    let python = repo_root().join(".bench/venv/bin/python");
    let expect = serde_json::json!([
        {"model": GEMMA, "prompt": PROMPT, "max_tokens": 24, "text": want_gemma.1},
        {"model": SMOL, "prompt": PROMPT, "max_tokens": 24, "text": want_smol.1},
        {"model": "auto", "answers": GEMMA, "prompt": PROMPT, "max_tokens": 24,
         "text": want_gemma.1},
    ]);
    let mut sdk = Command::new(&python);
    sdk.arg(repo_root().join("integration/tests/two_models.py"))
        .env("OPENAI_BASE_URL", format!("https://{}/v1", c.router.http.clone().unwrap()))
        .env("OPENAI_API_KEY", c.api_key("test"))
        .env("SSL_CERT_FILE", c.credentials().join("ca.pem"))
        .env("PDMESH_EXPECT", expect.to_string());
    let ok = tokio::task::spawn_blocking(move || sdk.status().unwrap()).await.unwrap();
    assert!(ok.success(), "two_models.py failed (its output is above)");

    // A Gemma stream whose decode node dies moves to the other Gemma node.
    let before = requests_seen(&c.decode_stats(0).await);
    let (tokens, end) = kill_mid_stream(&mut c, &mut client).await;
    let fin = end.unwrap_or_else(|e| panic!("the moved stream failed: {e:?}"));
    assert_eq!(tokens, want_long, "the moved Gemma stream differs from `pdmesh run`");
    let t = fin.timings.unwrap();
    assert_eq!(t.migrations, 1, "{t:?}");
    assert!(t.decode_node == "decode-1" || t.decode_node == "decode-2", "{t:?}");

    // Now Gemma's only decode node dies: nowhere in its pool to go, and never to SmolLM2's.
    let (_, end) = kill_mid_stream(&mut c, &mut client).await;
    let e = end.expect_err("a stream with no decode node of its model left");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let after = requests_seen(&c.decode_stats(0).await);
    assert_eq!(after, before, "a Gemma stream reached SmolLM2's decode node");
    // SmolLM2 still serves.
    let s = client.generate(request(SMOL, 24)).await.unwrap().into_inner();
    assert_eq!(collect(s).await.unwrap().0, want_smol.0);
}

/// Every request a decode node has held, in any phase or end.
fn requests_seen(s: &pdmesh_proto::v1::NodeStats) -> u64 {
    let now = u64::from(s.reserved + s.transferring + s.decoding);
    now + s.completed + s.cancelled + s.failed + s.moved + s.preempted
}

/// Starts a long Gemma stream, kills (SIGKILL) the Gemma decode node running it once tokens
/// flow, and returns what the stream gave and how it ended.
async fn kill_mid_stream(
    c: &mut Cluster,
    client: &mut pdmesh_integration::Client,
) -> (Vec<u32>, Result<pdmesh_proto::v1::Finished, tonic::Status>) {
    let mut s = client.generate(request(GEMMA, LONG)).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while tokens.len() < 4 {
        match s.message().await.unwrap().unwrap().event.unwrap() {
            generate_response::Event::Delta(d) => tokens.extend(d.token_ids),
            other => assert!(matches!(other, generate_response::Event::Started(_)), "{other:?}"),
        }
    }
    let mut victim = None;
    for i in [1, 2] {
        if c.decodes[i].is_running_ref() && c.decode_stats(i).await.decoding > 0 {
            victim = Some(i);
        }
    }
    let victim = victim.expect("a Gemma decode node runs the stream");
    c.decodes[victim].kill();
    eventually(Duration::from_secs(30), "the router drops the killed node", || async {
        let name = format!("decode-{victim}");
        c.nodes().await.iter().all(|n| n.node_id != name)
    })
    .await;
    let rest = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            match s.message().await {
                Ok(Some(m)) => match m.event.unwrap() {
                    generate_response::Event::Delta(d) => tokens.extend(d.token_ids),
                    generate_response::Event::Finished(f) => return Ok(f),
                    generate_response::Event::Started(_) => {}
                },
                Ok(None) => panic!("the stream ended without a finish"),
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the stream hung after its node died");
    (tokens, rest)
}
