//! Streams that outlive their decode node: 20 chat requests (half greedy, half seeded) run on
//! a mesh of real processes with two decode nodes; one decode node is killed (`kill -9`), hung
//! (SIGSTOP) or stopped (SIGTERM: it drains, handing each request off with its KV) while they
//! stream. Every client still gets exactly the tokens `pdmesh run` gives, in one unbroken
//! stream with no error, the moved ones continued on the survivor from where they stood; and no
//! KV block is left behind. With no migration budget the old behaviour holds: the stream ends
//! with UNAVAILABLE naming the node.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pdmesh_integration::reference::{PROMPTS, reference, request};
use pdmesh_integration::{Cluster, eventually, per_transport};
use pdmesh_proto::v1::{Finished, generate_response};
use tonic::Code;

/// Long enough that a node is lost mid-stream.
const MAX_TOKENS: u32 = 64;
const WAIT: Duration = Duration::from_secs(60);

/// Clusters are heavy on two cores: one test at a time in this binary.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn expected() -> &'static [Vec<u32>] {
    static E: std::sync::OnceLock<Vec<Vec<u32>>> = std::sync::OnceLock::new();
    E.get_or_init(|| (0..PROMPTS.len()).map(|i| reference(i, MAX_TOKENS)).collect())
}

/// One stream's tokens, in the order they arrived, and its end.
type Outcome = (Vec<u32>, Result<Finished, tonic::Status>);

/// Starts every prompt at once; `started` counts streams that have had a token.
async fn start_all(
    c: &Cluster,
    started: &Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Outcome>> {
    let mut clients = Vec::new();
    for _ in 0..PROMPTS.len() {
        clients.push(c.client().await);
    }
    clients
        .into_iter()
        .enumerate()
        .map(|(i, mut client)| {
            let started = Arc::clone(started);
            tokio::spawn(async move {
                let mut s = client.generate(request(i, MAX_TOKENS)).await.unwrap().into_inner();
                let mut tokens = Vec::new();
                loop {
                    match s.message().await {
                        Ok(Some(m)) => match m.event.unwrap() {
                            generate_response::Event::Delta(d) => {
                                if tokens.is_empty() && !d.token_ids.is_empty() {
                                    started.fetch_add(1, Ordering::SeqCst);
                                }
                                tokens.extend(d.token_ids);
                            }
                            generate_response::Event::Finished(f) => return (tokens, Ok(f)),
                            generate_response::Event::Started(_) => {}
                        },
                        Ok(None) => panic!("stream {i} ended without a finish"),
                        Err(e) => return (tokens, Err(e)),
                    }
                }
            })
        })
        .collect()
}

/// Waits until half the streams have tokens; returns the decode node running the most.
async fn mid_stream(c: &Cluster, started: &AtomicUsize) -> usize {
    eventually(WAIT, "half the streams started", || async {
        started.load(Ordering::SeqCst) >= PROMPTS.len() / 2
    })
    .await;
    let mut decoding = Vec::new();
    for i in 0..c.decodes.len() {
        decoding.push(c.decode_stats(i).await.decoding);
    }
    assert!(decoding.iter().sum::<u32>() > 0, "nothing decoding: the streams finished first");
    (0..decoding.len()).max_by_key(|&i| (decoding[i], std::cmp::Reverse(i))).unwrap()
}

/// Every stream gave `pdmesh run`'s tokens and finished; returns how many moved.
async fn all_match(tasks: Vec<tokio::task::JoinHandle<Outcome>>, victim: &str) -> u32 {
    let expected = tokio::task::spawn_blocking(expected).await.unwrap();
    let mut moved = 0;
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(tokio::time::timeout(WAIT, t).await.expect("a stream hung").unwrap());
    }
    for (i, (tokens, end)) in outs.into_iter().enumerate() {
        let f = end.unwrap_or_else(|e| panic!("stream {i} failed: {e:?}"));
        assert_eq!(tokens, expected[i], "prompt {i} ({:?}) differs from `pdmesh run`", PROMPTS[i]);
        assert_eq!(f.usage.unwrap().completion_tokens as usize, tokens.len(), "prompt {i}");
        let t = f.timings.unwrap();
        if t.migrations > 0 {
            assert_ne!(t.decode_node, victim, "prompt {i} moved but ended on the lost node");
            moved += t.migrations;
        }
    }
    moved
}

per_transport!(killed_decode_node_streams_continue_bit_identically);

async fn killed_decode_node_streams_continue_bit_identically(transport: &str) {
    let _serial = SERIAL.lock().await;
    tokio::task::spawn_blocking(expected).await.unwrap();
    let mut c = Cluster::builder().prefill(1).decode(2).transport(transport).start().await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    let victim = mid_stream(&c, &started).await;
    c.decodes[victim].kill();
    let moved = all_match(tasks, &format!("decode-{victim}")).await;
    assert!(moved > 0, "no stream was on decode-{victim} when it died");
    c.wait_blocks_free().await;
    // The survivor received the moved streams' KV over the transport the mesh uses.
    assert!(c.received(1 - victim, transport).await > 0, "the survivor received no KV");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_decode_node_streams_continue_bit_identically() {
    let _serial = SERIAL.lock().await;
    tokio::task::spawn_blocking(expected).await.unwrap();
    // What reaches the hung node only once it is back, after its caller gave up (a Reserve
    // answered into the void, a transfer's end), is freed by a lease or a short grace past
    // it, so the lease is kept well under the 30 s the test waits for free blocks.
    let c =
        Cluster::builder().prefill(1).decode(2).router_args(&["--lease-ms", "10000"]).start().await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    let victim = mid_stream(&c, &started).await;
    c.decodes[victim].pause();
    let moved = all_match(tasks, &format!("decode-{victim}")).await;
    assert!(moved > 0, "no stream was on decode-{victim} when it hung");
    // Back, the node finds its streams cancelled, frees their blocks and rejoins.
    c.decodes[victim].resume();
    c.wait_nodes(1, 2).await;
    c.wait_blocks_free().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_migration_budget_a_lost_node_ends_its_streams() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::builder()
        .prefill(1)
        .decode(2)
        .router_args(&["--max-migrations", "0"])
        .start()
        .await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    let victim = mid_stream(&c, &started).await;
    c.decodes[victim].kill();
    let mut failed = 0;
    for t in tasks {
        let (tokens, end) = tokio::time::timeout(WAIT, t).await.expect("a stream hung").unwrap();
        match end {
            Ok(f) => assert_eq!(f.timings.unwrap().migrations, 0),
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                assert!(e.message().contains(&format!("decode-{victim}")), "{e:?}");
                assert!(!tokens.is_empty(), "a stream failed before its first token: {e:?}");
                failed += 1;
            }
        }
    }
    assert!(failed > 0, "no stream was on decode-{victim} when it died");
    c.wait_blocks_free().await;
}

per_transport!(a_draining_decode_node_hands_its_streams_off_with_their_kv);

async fn a_draining_decode_node_hands_its_streams_off_with_their_kv(transport: &str) {
    let _serial = SERIAL.lock().await;
    tokio::task::spawn_blocking(expected).await.unwrap();
    let mut c = Cluster::builder().prefill(1).decode(2).transport(transport).start().await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    let victim = mid_stream(&c, &started).await;
    c.decodes[victim].terminate();
    let moved = all_match(tasks, &format!("decode-{victim}")).await;
    assert!(moved > 0, "no stream was on decode-{victim} when it drained");
    let status = tokio::task::block_in_place(|| c.decodes[victim].exited(WAIT));
    assert!(status.is_some_and(|s| s.success()), "the drained node exited with {status:?}");
    c.wait_blocks_free().await;
    // Moved, not recomputed: the prefill node computed each prompt once, and the survivor
    // received one transfer per request that ended there (placed there, or handed to it).
    let sent: u64 = c.prefill_stats(0).await.transports.iter().map(|t| t.transfers).sum();
    assert_eq!(sent, PROMPTS.len() as u64, "a moved request was prefilled again");
    let completed = c.decode_stats(1 - victim).await.completed;
    assert_eq!(c.received(1 - victim, transport).await, completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_with_nowhere_to_go_finishes_its_streams_then_exits() {
    let _serial = SERIAL.lock().await;
    tokio::task::spawn_blocking(expected).await.unwrap();
    let mut c = Cluster::builder().prefill(1).decode(1).start().await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    mid_stream(&c, &started).await;
    c.decodes[0].terminate();
    assert_eq!(all_match(tasks, "decode-0").await, 0, "there was nowhere to move to");
    let status = tokio::task::block_in_place(|| c.decodes[0].exited(WAIT));
    assert!(status.is_some_and(|s| s.success()), "the drained node exited with {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_prefill_node_finishes_its_prompts_and_takes_no_new_ones() {
    let _serial = SERIAL.lock().await;
    tokio::task::spawn_blocking(expected).await.unwrap();
    // Transfers slowed, so prompts are in flight on both prefill nodes when one stops.
    let mut c = Cluster::builder()
        .prefill(2)
        .decode(2)
        .prefill_args(&["--fault-transfer-delay-ms", "100"])
        .start()
        .await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    eventually(WAIT, "prefill-0 busy", || async {
        let s = c.prefill_stats(0).await;
        s.prefilling + s.transferring + s.queued > 0
    })
    .await;
    c.prefills[0].terminate();
    assert_eq!(all_match(tasks, "none").await, 0, "nothing had to move");
    let status = tokio::task::block_in_place(|| c.prefills[0].exited(WAIT));
    assert!(status.is_some_and(|s| s.success()), "the drained node exited with {status:?}");
    c.wait_blocks_free().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_drain_rpc_moves_streams_and_no_one_else_may_call_it() {
    use pdmesh_common::tls::MeshRole;
    use pdmesh_integration::cluster::{endpoint_as, pki};
    use pdmesh_proto::v1::DrainRequest;
    use pdmesh_proto::v1::decode_client::DecodeClient;
    let _serial = SERIAL.lock().await;
    tokio::task::spawn_blocking(expected).await.unwrap();
    let mut c = Cluster::builder().prefill(1).decode(2).start().await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    let victim = mid_stream(&c, &started).await;
    let addr = c.decodes[victim].addr.clone();
    let as_role = |name: &str, role| {
        let ep = endpoint_as(&addr, &pki().identity(name, role), MeshRole::Decode);
        async move { DecodeClient::new(ep.connect().await.unwrap()) }
    };
    // A router, a prefill node or another decode node cannot stop a node.
    for (name, role) in [
        ("rogue-router", MeshRole::Router),
        ("rogue-prefill", MeshRole::Prefill),
        ("rogue-decode", MeshRole::Decode),
    ] {
        let err = as_role(name, role).await.drain(DrainRequest::default()).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{name}: {err:?}");
    }
    let drained = as_role("ops", MeshRole::Admin).await.drain(DrainRequest::default()).await;
    assert!(drained.unwrap().into_inner().requests > 0, "it held streams");
    let moved = all_match(tasks, &format!("decode-{victim}")).await;
    assert!(moved > 0, "no stream moved");
    let status = tokio::task::block_in_place(|| c.decodes[victim].exited(WAIT));
    assert!(status.is_some_and(|s| s.success()), "the drained node exited with {status:?}");
    c.wait_blocks_free().await;
}

/// A whole host lost: a decode node and the prefill node die together, so the streams moving
/// off the decode node find their re-prefill's node dead too. That failure is not a loss of
/// the stream's node and spends no migration: the re-prefill goes elsewhere (here, with no
/// prefill node left, onto the new decode node itself). Then the node the streams moved to
/// dies as well. With a budget of 2 every stream still gets `pdmesh run`'s tokens (it took 3
/// when the failed re-prefill counted, and the streams that moved twice ended UNAVAILABLE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_outlive_a_whole_host_then_their_next_decode_node() {
    let _serial = SERIAL.lock().await;
    tokio::task::spawn_blocking(expected).await.unwrap();
    let mut c = Cluster::builder()
        .prefill(1)
        .decode(3)
        .router_args(&["--max-migrations", "2"])
        .start()
        .await;
    let started = Arc::new(AtomicUsize::new(0));
    let tasks = start_all(&c, &started).await;
    let first = mid_stream(&c, &started).await;
    // The host: its decode node and the prefill node, at once.
    c.decodes[first].kill();
    c.prefills[0].kill();
    // Every stream under way again (the moved ones recomputed elsewhere); then the busiest
    // node left, which holds some of the moved ones, dies too.
    eventually(WAIT, "every stream under way", || async {
        started.load(Ordering::SeqCst) == PROMPTS.len()
    })
    .await;
    // The moved streams on the nodes left: every stream not yet over is recomputed (no
    // prefill node is left) or decoding on one of them.
    let left: Vec<usize> = (0..c.decodes.len()).filter(|&i| i != first).collect();
    eventually(WAIT, "every moved stream placed again", || async {
        let mut placed = 0;
        for &i in &left {
            let s = c.decode_stats(i).await;
            placed += (s.prefilling + s.decoding) as usize;
        }
        placed + tasks.iter().filter(|t| t.is_finished()).count() >= PROMPTS.len()
    })
    .await;
    let mut second = (0, 0);
    for &i in &left {
        let d = c.decode_stats(i).await.decoding;
        if d >= second.1 {
            second = (i, d);
        }
    }
    let second = second.0;
    c.decodes[second].kill();
    let expected = tokio::task::spawn_blocking(expected).await.unwrap();
    let (mut twice, mut recomputed) = (0, 0);
    for (i, t) in tasks.into_iter().enumerate() {
        let (tokens, end) = tokio::time::timeout(WAIT, t).await.expect("a stream hung").unwrap();
        let f = end.unwrap_or_else(|e| panic!("stream {i} failed: {e:?}"));
        assert_eq!(tokens, expected[i], "prompt {i} differs from `pdmesh run`");
        let t = f.timings.unwrap();
        assert!(t.migrations <= 2, "prompt {i}: {t:?}");
        twice += usize::from(t.migrations == 2);
        recomputed += usize::from(t.migrations > 0 && t.prefill_node == "colocated");
    }
    assert!(twice > 0, "no stream lost both its decode nodes");
    assert!(recomputed > 0, "no moved stream was recomputed on its new decode node");
    c.wait_blocks_free().await;
}
