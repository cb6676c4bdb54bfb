//! The OpenAI HTTP API with the official `openai` Python SDK as the client, against a real
//! mesh (router, prefill and decode processes, TLS, API keys): this starts the mesh and runs
//! `openai_sdk.py`, which does the checking. Greedy output over HTTP must be `pdmesh run`'s
//! for 12 prompts, which this computes first. The SDK comes from PyPI, pinned, into
//! `.bench/venv` (`just test` installs it).

#![allow(clippy::unwrap_used)]

use std::process::Command;

use pdmesh_integration::reference::{PROMPTS, run_json};
use pdmesh_integration::{Cluster, repo_root};

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

    let max_in_flight = MAX_IN_FLIGHT.to_string();
    let c = Cluster::builder()
        .metrics()
        .router_args(&["--http-listen", "127.0.0.1:0", "--max-in-flight", &max_in_flight])
        .start()
        .await;
    let http = c.router.http.clone().expect("the router serves HTTP");
    let metrics: Vec<String> =
        c.prefills.iter().chain(&c.decodes).map(|n| n.metrics.clone().unwrap()).collect();
    let script = repo_root().join("integration/tests/openai_sdk.py");
    let out = tokio::task::spawn_blocking({
        let ca = c.credentials().join("ca.pem");
        let key = c.api_key("test").to_string();
        move || {
            Command::new(python)
                .arg(script)
                .env("OPENAI_BASE_URL", format!("https://{http}/v1"))
                .env("OPENAI_API_KEY", key)
                .env("SSL_CERT_FILE", ca)
                .env("PDMESH_MODEL_ID", "SmolLM2-135M-Instruct.Q4_1")
                .env("PDMESH_REFERENCE", reference_file)
                .env("PDMESH_METRICS", metrics.join(","))
                .env("PDMESH_MAX_IN_FLIGHT", max_in_flight)
                .status()
        }
    })
    .await
    .unwrap()
    .unwrap();
    assert!(out.success(), "openai_sdk.py failed (its output is above)");
    c.wait_blocks_free().await;
}
