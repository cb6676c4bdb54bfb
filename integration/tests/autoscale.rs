//! `pdmesh up --autoscale` follows the router's planner on the real model: a load step grows
//! both pools (a second prefill and a second decode node start and register), and once the
//! load is gone they shrink back (the extra nodes drain and exit), with every request of the
//! step answered in full. The SLOs are set so tight that any load outgrows one node; what is
//! tested is the loop (measure → plan → start or drain), not the planner's arithmetic (its
//! unit tests).

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_integration::{child_pid, collect, greedy, model_path, pdmesh_bin, spawn_up};
use pdmesh_proto::v1::generation_client::GenerationClient;

async fn until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < end, "{what} did not happen within {within:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_autoscale_grows_and_shrinks_both_pools_without_failing_a_request() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut c = std::process::Command::new(pdmesh_bin());
    c.args(["--insecure", "up", "--listen", &addr, "--http-listen", "127.0.0.1:0"])
        .args(["--prefill", "1", "--decode", "1"])
        .args(["--threads", "1", "--kvstore-budget-bytes", "0", "--autoscale"])
        .args(["--max-prefill", "2", "--max-decode", "2", "--itl-slo-ms", "1"])
        .args(["--ttft-slo-ms", "1", "--planner-window-s", "3", "--planner-cooldown-s", "3"])
        .arg("--model")
        .arg(model_path());
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
                    let s = c.generate(greedy(&prompt, 24)).await?.into_inner();
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
        child_pid(pid, "/prefill-1.toml").is_some() && child_pid(pid, "/decode-1.toml").is_some()
    })
    .await;
    // The new nodes registered and took part of the step: each answered a request of it.
    until("the new nodes served part of the step", Duration::from_secs(60), || {
        let s = served.lock().unwrap();
        s.contains("prefill-1") && s.contains("decode-1")
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.unwrap().expect("no request of the step failed");
    }
    assert!(answered.load(Ordering::SeqCst) > 12, "the step was answered");
    // The load is gone: the extra nodes drain and exit, and the mesh still serves.
    until("both pools shrank", Duration::from_secs(90), || {
        child_pid(pid, "/prefill-1.toml").is_none() && child_pid(pid, "/decode-1.toml").is_none()
    })
    .await;
    let s = GenerationClient::new(ch).generate(greedy(&prompt, 8)).await.unwrap().into_inner();
    assert_eq!(collect(s).await.unwrap().0.len(), 8);
    assert!(up.try_wait().unwrap().is_none(), "up is still running");
    let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = up.wait();
}
