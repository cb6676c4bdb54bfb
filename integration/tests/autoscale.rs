//! `pdmesh up --autoscale` follows the router's planner on the real model: a load step grows
//! both pools (a second prefill and a second decode node start and register), and once the
//! load is gone they shrink back (the extra nodes drain and exit), with every request of the
//! step answered in full. The SLOs are set so tight that any load outgrows one node; what is
//! tested is the loop (measure → plan → start or drain), not the planner's arithmetic (its
//! unit tests). The mesh serves two models, SmolLM2 (the default) and Gemma 3 270M, and the
//! load is Gemma's: its pools grow and shrink by its own planner, while the default model's,
//! with no load, stay as they started.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_integration::{child_pid, collect, greedy, model_path, pdmesh_bin, repo_root, spawn_up};
use pdmesh_proto::v1::GenerateRequest;
use pdmesh_proto::v1::generation_client::GenerationClient;

/// The second model's id: its file's name without `.gguf`.
const GEMMA: &str = "gemma-3-270m-q4_k_m";

async fn until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < end, "{what} did not happen within {within:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_autoscale_grows_and_shrinks_both_pools_without_failing_a_request() {
    let gemma = repo_root().join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(gemma.exists(), "{} is missing: run `just fetch-gemma3`", gemma.display());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut c = std::process::Command::new(pdmesh_bin());
    c.args(["--insecure", "up", "--listen", &addr, "--http-listen", "127.0.0.1:0"])
        .args(["--prefill", "1", "--decode", "1"])
        .args(["--threads", "1", "--kvstore-budget-bytes", "0", "--autoscale"])
        .args(["--max-prefill", "2", "--max-decode", "2", "--itl-slo-ms", "1"])
        .args(["--ttft-slo-ms", "1", "--planner-window-s", "3", "--planner-cooldown-s", "3"])
        .arg("--model")
        .arg(model_path())
        .arg("--model")
        .arg(gemma);
    let mut up = tokio::task::block_in_place(|| spawn_up(c));
    let pid = up.id();
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // The step: 12 clients, each request right after the last, until both pools grew.
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    // The nodes each answered request was prefilled and decoded on.
    let served = Arc::new(Mutex::new(HashSet::new()));
    let prompt: Vec<u32> = (0..48).map(|i| 300 + i * 37).collect();
    let clients: Vec<_> = (0..12)
        .map(|_| {
            let (mut c, stop, answered, served) = (
                GenerationClient::new(ch.clone()),
                Arc::clone(&stop),
                Arc::clone(&answered),
                Arc::clone(&served),
            );
            let prompt = prompt.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let r = GenerateRequest { model: GEMMA.into(), ..greedy(&prompt, 24) };
                    let s = c.generate(r).await?.into_inner();
                    let (tokens, f) = collect(s).await?;
                    assert_eq!((tokens.len(), f.is_some()), (24, true));
                    let t = f.and_then(|f| f.timings).unwrap_or_default();
                    served.lock().unwrap().extend([t.prefill_node, t.decode_node]);
                    answered.fetch_add(1, Ordering::SeqCst);
                }
                Ok::<_, tonic::Status>(())
            })
        })
        .collect();
    until("both pools grew", Duration::from_secs(120), || {
        child_pid(pid, "/m1-prefill-1.toml").is_some()
            && child_pid(pid, "/m1-decode-1.toml").is_some()
    })
    .await;
    // The new nodes registered and took part of the step: each answered a request of it.
    until("the new nodes served part of the step", Duration::from_secs(60), || {
        let s = served.lock().unwrap();
        s.contains("m1-prefill-1") && s.contains("m1-decode-1")
    })
    .await;
    // The default model's planner saw no load: its pools did not grow.
    let idle = ["/prefill-1.toml", "/decode-1.toml"];
    assert!(idle.iter().all(|n| child_pid(pid, n).is_none()), "the idle model's pools grew");
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.unwrap().expect("no request of the step failed");
    }
    assert!(answered.load(Ordering::SeqCst) > 12, "the step was answered");
    // The load is gone: the extra nodes drain and exit, and the mesh still serves.
    until("both pools shrank", Duration::from_secs(90), || {
        child_pid(pid, "/m1-prefill-1.toml").is_none()
            && child_pid(pid, "/m1-decode-1.toml").is_none()
    })
    .await;
    for model in ["", GEMMA] {
        let r = GenerateRequest { model: model.into(), ..greedy(&prompt, 8) };
        let s = GenerationClient::new(ch.clone()).generate(r).await.unwrap().into_inner();
        assert_eq!(collect(s).await.unwrap().0.len(), 8, "{model:?}");
    }
    assert!(up.try_wait().unwrap().is_none(), "up is still running");
    let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = up.wait();
}
