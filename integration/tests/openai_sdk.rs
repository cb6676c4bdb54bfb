//! The OpenAI HTTP API with the official `openai` Python SDK as the client, against a real
//! mesh (router, prefill and decode processes, TLS, API keys): this starts the mesh and runs
//! `openai_sdk.py`, which does the checking. Greedy output over HTTP must be `pdmesh run`'s
//! for 12 prompts, which this computes first; a caller's `traceparent` must continue into
//! the mesh's spans (collected here). The SDK comes from PyPI, pinned, into
//! `.bench/venv` (`just test` installs it).

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use pdmesh_common::collector::Collector;
use pdmesh_integration::reference::{PROMPTS, run_json};
use pdmesh_integration::{Cluster, eventually, repo_root};
use pdmesh_proto::v1::Role;

/// The router's admission limit in this mesh: the overload check fills it.
const MAX_IN_FLIGHT: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_sdk_against_a_real_mesh() {
    let python = repo_root().join(".bench/venv/bin/python");
    let has_sdk = Command::new(&python).args(["-c", "import openai"]).status();
    assert!(
        has_sdk.is_ok_and(|s| s.success()),
        "{} cannot import openai: run `just test` (it installs the pinned SDK there)",
        python.display()
    );
    // What `pdmesh run` gives greedily, the reference for the mesh's HTTP answers.
    let reference: Vec<serde_json::Value> = PROMPTS[..12]
        .iter()
        .map(|p| {
            let v = run_json(p, 24, (0.0, 1.0, 0));
            serde_json::json!({
                "prompt": p,
                "max_tokens": 24,
                "tokens": v["token_ids"],
                "text": v["text"],
            })
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let reference_file = dir.path().join("reference.json");
    std::fs::write(&reference_file, serde_json::to_vec(&reference).unwrap()).unwrap();

    // Spans go to a collector here: a caller's traceparent must continue into the mesh.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::default();
    tokio::spawn(collector.clone().serve(listener));
    let max_in_flight = MAX_IN_FLIGHT.to_string();
    let mut c = Cluster::builder()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .metrics()
        .router_args(&["--http-listen", "127.0.0.1:0", "--max-in-flight", &max_in_flight])
        .start()
        .await;
    let http = c.router.http.clone().expect("the router serves HTTP");
    let metrics: Vec<String> =
        c.prefills.iter().chain(&c.decodes).map(|n| n.metrics.clone().unwrap()).collect();
    let script = repo_root().join("integration/tests/openai_sdk.py");
    let mut sdk = Command::new(python);
    sdk.arg(script)
        .env("OPENAI_BASE_URL", format!("https://{http}/v1"))
        .env("OPENAI_API_KEY", c.api_key("test"))
        .env("SSL_CERT_FILE", c.credentials().join("ca.pem"))
        .env("PDMESH_MODEL_ID", "SmolLM2-135M-Instruct.Q4_1")
        .env("PDMESH_REFERENCE", reference_file)
        .env("PDMESH_METRICS", metrics.join(","))
        .env("PDMESH_MAX_IN_FLIGHT", max_in_flight);
    let run = |mut cmd: Command, args: &[&str]| {
        cmd.args(args);
        tokio::task::spawn_blocking(move || cmd.status().unwrap())
    };
    let out = run(clone(&sdk), &[]).await.unwrap();
    assert!(out.success(), "openai_sdk.py failed (its output is above)");
    c.wait_blocks_free().await;

    // The request sent with `traceparent: 00-TRACE-00f067aa0ba902b7-01`: its root span is the
    // caller's span's child, and the nodes' spans are in the same trace.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let names = ["router.openai", "prefill.prefill", "decode.decode"];
    eventually(Duration::from_secs(30), "the traced request's spans", || async {
        let got: HashSet<String> =
            collector.spans().into_iter().filter(|s| s.trace_id == trace).map(|s| s.name).collect();
        names.iter().all(|n| got.contains(*n))
    })
    .await;
    let spans: Vec<_> = collector.spans().into_iter().filter(|s| s.trace_id == trace).collect();
    let root = spans.iter().find(|s| s.name == "router.openai").unwrap();
    assert_eq!(root.parent_id, "00f067aa0ba902b7", "{root}");
    assert!(root.str("request_id").is_some_and(|r| r.starts_with("req-")), "{root}");
    for n in ["prefill.prefill", "decode.decode"] {
        let s = spans.iter().find(|s| s.name == n).unwrap();
        assert_eq!(s.parent_id, root.span_id, "{n} under the HTTP request's root: {s}");
    }

    // No decode node left: health and requests say 503.
    for d in &mut c.decodes {
        d.stop();
    }
    eventually(Duration::from_secs(30), "the router drops the decode node", || async {
        c.nodes().await.iter().all(|n| n.role != Role::Decode as i32)
    })
    .await;
    let out = run(sdk, &["after_every_decode_node_left"]).await.unwrap();
    assert!(out.success(), "openai_sdk.py after_every_decode_node_left failed (output above)");
}

/// The same command again (its program, arguments and environment).
fn clone(c: &Command) -> Command {
    let mut n = Command::new(c.get_program());
    n.args(c.get_args());
    for (k, v) in c.get_envs() {
        if let Some(v) = v {
            n.env(k, v);
        }
    }
    n
}
