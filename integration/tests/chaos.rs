//! Chaos: a mesh of real processes, each on a host of its own (network namespaces joined by a
//! bridge), serves a steady mixed load (the 20 reference chat prompts, greedy and seeded) while
//! its nodes are killed and restarted (a decode node alone, or with the prefill node as when a
//! host holding both dies), hung, cut off the network and slowed, one fault at a time at
//! random (seeded). Afterwards: every request ended with `pdmesh run`'s tokens or with a precise
//! status (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) within its deadline; every node's
//! KV blocks are back to free; no process is left. `PDMESH_SOAK_S` sets the duration (CI runs
//! the default; `just soak` runs longer) and `PDMESH_SOAK_SEED` the seed. Needs root (CI has
//! it). Routers are not killed here: `routers.rs` shows what that costs.
//!
//! KV moves over UCX (the default transport; `PDMESH_SOAK_TRANSPORT=grpc` for the stream),
//! kept on a second network between the hosts (`Netns::with_fabric`, as an RDMA fabric beside
//! the front-end network), and one more fault cuts a decode host's fabric, which cuts its UCX
//! sessions mid-transfer and nothing else; those transfers fall back to gRPC within their
//! stall bound. No request may run into the router's 30 s transfer timeout.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_integration::netns::{FABRIC_DEVICE, Netns};
use pdmesh_integration::reference::{PROMPTS, reference, request};
use pdmesh_integration::{Cluster, collect};
use pdmesh_proto::v1::Timings;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng as StdRng;
use tonic::Code;

const MAX_TOKENS: u32 = 32;
/// Each request's deadline.
const DEADLINE: Duration = Duration::from_secs(60);
const CLIENTS: usize = 4;

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// How one request ended.
#[derive(Debug)]
struct Ended {
    prompt: usize,
    /// When it started, from the start of the load (to find it in the nodes' logs).
    at: Duration,
    took: Duration,
    /// Tokens, migrations and the final timings (which nodes, which transport).
    outcome: Result<(Vec<u32>, u32, Option<Timings>), tonic::Status>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_survives_kills_hangs_partitions_and_slowness() {
    let soak = Duration::from_secs(env_or("PDMESH_SOAK_S", 40));
    let seed = env_or("PDMESH_SOAK_SEED", 7);
    eprintln!("chaos: {soak:?}, seed {seed}");
    let want = tokio::task::spawn_blocking(|| {
        (0..PROMPTS.len()).map(|i| reference(i, MAX_TOKENS)).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let hosts = Netns::with_fabric(&["router", "prefill-0", "decode-0", "decode-1"])
        .unwrap_or_else(|e| panic!("network namespaces (this test needs root and iproute2): {e}"));
    let hosts = Arc::new(hosts);
    let ucx = std::env::var("PDMESH_SOAK_TRANSPORT").map_or(true, |t| t != "grpc");
    let mut c = Cluster::builder()
        .netns(Arc::clone(&hosts))
        .env("UCX_NET_DEVICES", FABRIC_DEVICE)
        .transport(if ucx { "ucx" } else { "grpc" })
        .prefill(1)
        .decode(2)
        .start()
        .await;
    let mut pids: Vec<u32> =
        [&c.router, &c.prefills[0], &c.decodes[0], &c.decodes[1]].iter().map(|s| s.pid()).collect();

    // The load: CLIENTS loops, each request right after the last, prompts drawn at random.
    let stop = Arc::new(AtomicBool::new(false));
    let ended = Arc::new(Mutex::new(Vec::<Ended>::new()));
    let mut clients = Vec::new();
    let began = Instant::now();
    for k in 0..CLIENTS {
        let mut client = c.client().await;
        let (stop, ended) = (Arc::clone(&stop), Arc::clone(&ended));
        clients.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed * 100 + k as u64);
            while !stop.load(Ordering::SeqCst) {
                let i = rng.random_range(0..PROMPTS.len());
                let mut r = tonic::Request::new(request(i, MAX_TOKENS));
                r.set_timeout(DEADLINE);
                let t0 = Instant::now();
                let outcome = match client.generate(r).await {
                    Ok(s) => collect(s.into_inner()).await.map(|(tokens, f)| {
                        let timings = f.and_then(|f| f.timings);
                        (tokens, timings.as_ref().map_or(0, |t| t.migrations), timings)
                    }),
                    Err(e) => Err(e),
                };
                let (at, took) = (t0 - began, t0.elapsed());
                ended.lock().unwrap().push(Ended { prompt: i, at, took, outcome });
            }
        }));
    }

    // The chaos: one fault at a time on a random node, then a pause to recover.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut faults: BTreeMap<&str, u32> = BTreeMap::new();
    let until = Instant::now() + soak;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1500..3000))).await;
        let d = rng.random_range(0..2);
        match rng.random_range(0..if ucx { 7 } else { 6 }) {
            0 => {
                *faults.entry("decode killed and restarted").or_default() += 1;
                c.decodes[d].kill();
                tokio::time::sleep(Duration::from_secs(2)).await;
                tokio::task::block_in_place(|| c.restart_decode(d));
                pids.push(c.decodes[d].pid());
            }
            1 => {
                *faults.entry("decode hung (SIGSTOP 2 s)").or_default() += 1;
                c.decodes[d].pause();
                tokio::time::sleep(Duration::from_secs(2)).await;
                c.decodes[d].resume();
            }
            2 => {
                *faults.entry("decode cut off the network 3 s").or_default() += 1;
                let name = format!("decode-{d}");
                hosts.connect(&name, false);
                tokio::time::sleep(Duration::from_secs(3)).await;
                hosts.connect(&name, true);
            }
            3 => {
                *faults.entry("prefill cut off the network 3 s").or_default() += 1;
                hosts.connect("prefill-0", false);
                tokio::time::sleep(Duration::from_secs(3)).await;
                hosts.connect("prefill-0", true);
            }
            6 if ucx => {
                *faults.entry("decode's fabric (UCX) cut 3 s").or_default() += 1;
                let name = format!("decode-{d}");
                hosts.connect_fabric(&name, false);
                tokio::time::sleep(Duration::from_secs(3)).await;
                hosts.connect_fabric(&name, true);
            }
            5 => {
                // As a host holding both dies: the streams moving off the decode node find
                // their re-prefill's node dead too.
                *faults.entry("decode and prefill killed at once, restarted").or_default() += 1;
                c.decodes[d].kill();
                c.prefills[0].kill();
                tokio::time::sleep(Duration::from_secs(2)).await;
                tokio::task::block_in_place(|| {
                    c.restart_decode(d);
                    c.restart_prefill(0);
                });
                pids.extend([c.decodes[d].pid(), c.prefills[0].pid()]);
            }
            _ => {
                *faults.entry("decode slowed (paused half of 2 s)").or_default() += 1;
                for _ in 0..10 {
                    c.decodes[d].pause();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    c.decodes[d].resume();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        // Let the mesh settle: every node registered again before the next fault.
        c.wait_nodes(1, 2).await;
    }
    stop.store(true, Ordering::SeqCst);
    for t in clients {
        tokio::time::timeout(DEADLINE + Duration::from_secs(10), t)
            .await
            .expect("a client outlived its deadline")
            .unwrap();
    }

    // Every request: the reference tokens, or a precise status in time.
    let ended = std::mem::take(&mut *ended.lock().unwrap());
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    let mut moved = 0;
    for e in &ended {
        assert!(e.took <= DEADLINE + Duration::from_secs(5), "took {:?}: {e:?}", e.took);
        match &e.outcome {
            Ok((tokens, m, timings)) => {
                assert_eq!(
                    tokens, &want[e.prompt],
                    "prompt {} differs from `pdmesh run` (started {:?} into the load, took \
                     {:?}; {timings:?})",
                    e.prompt, e.at, e.took
                );
                moved += m;
                *by.entry("ok".into()).or_default() += 1;
            }
            Err(s) => {
                let precise = [Code::Unavailable, Code::DeadlineExceeded, Code::ResourceExhausted];
                assert!(precise.contains(&s.code()), "an imprecise status: {s:?}");
                assert!(!s.message().is_empty(), "a status without a reason: {s:?}");
                *by.entry(format!("{:?}", s.code())).or_default() += 1;
            }
        }
    }
    // No transfer ran into the router's transfer timeout: a stalled session is given up
    // within its bound (each request here has one transfer, or a few when it moved).
    let timed_out = ended.iter().filter(|e| e.took >= Duration::from_secs(30)).count();
    let mut stalls = 0;
    if c.prefills[0].is_running_ref() {
        let t = c.prefill_stats(0).await.transports;
        stalls = t.iter().map(|t| t.stalls).sum::<u64>();
        eprintln!("chaos: prefill transports {t:?}");
    }
    assert_eq!(timed_out, 0, "requests that took the transfer timeout or longer");
    let mut took: Vec<Duration> = ended.iter().map(|e| e.took).collect();
    took.sort();
    let median = took.get(took.len() / 2).copied().unwrap_or_default();
    eprintln!(
        "chaos: {} requests ({by:?}, median {median:?}), {moved} streams moved, {stalls} \
         transfers fell back from stalled UCX sessions, faults {faults:?}",
        ended.len()
    );
    assert!(ended.len() >= CLIENTS, "the load ran");
    assert!(by.contains_key("ok"), "the mesh served through the chaos: {by:?}");

    // Every node's blocks back to free.
    c.wait_blocks_free().await;

    // No process left once the cluster is gone.
    drop(c);
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next());
        assert!(matches!(state, None | Some("Z")), "process {pid} is still running: {stat}");
    }
}
