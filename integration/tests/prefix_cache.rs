//! The prefix cache end to end with real processes: a prompt served from cached KV gives the
//! same tokens bit for bit, a prompt sharing a system prompt reuses it, two prefill nodes that
//! compute the same prompt store it once, a herd sharing a new prefix computes it once, a dead
//! KV-store only costs the cache, a KV-store killed and started again serves its prefixes from
//! its disk tier (and drops a torn block file unserved), and prefix-aware placement sends a
//! shared prefix back to the node that holds it.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use pdmesh_integration::{Cluster, eventually, per_transport};
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::{
    Finished, GenerateRequest, Role, SamplingParams, StatsRequest, TokenIds, generate_request,
    generate_response,
};
use tonic::transport::Channel;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const WAIT: Duration = Duration::from_secs(30);

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 200 + (i * 7919 + seed * 104_729) % 30_000).collect()
}

async fn generate(
    c: &mut pdmesh_integration::Client,
    prompt: Vec<u32>,
    seed: u64,
) -> (Vec<u32>, Finished) {
    let req = GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: prompt })),
        max_tokens: 12,
        ignore_eos: true,
        sampling: Some(SamplingParams {
            temperature: if seed == 0 { 0.0 } else { 0.8 },
            seed: Some(seed),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut s = c.generate(req).await.unwrap().into_inner();
    let (mut toks, mut fin) = (Vec::new(), None);
    while let Some(m) = s.message().await.unwrap() {
        match m.event.unwrap() {
            generate_response::Event::Delta(d) => toks.extend(d.token_ids),
            generate_response::Event::Finished(f) => fin = Some(f),
            generate_response::Event::Started(_) => {}
        }
    }
    (toks, fin.unwrap())
}

async fn store_client(c: &Cluster) -> KvStoreClient<Channel> {
    let addr = &c.kvstore.as_ref().unwrap().addr;
    KvStoreClient::new(c.channel(addr).await)
}

async fn stored_blocks(c: &Cluster) -> u64 {
    store_client(c).await.stats(StatsRequest {}).await.unwrap().into_inner().blocks
}

/// `transport` is how the prefill node reads the KV-store's blocks (and ships KV to the decode
/// node): UCX gets from the store's registered pool, or the gRPC stream.
async fn cached_prefixes_give_the_same_tokens_bit_for_bit(transport: &str) {
    let _serial = SERIAL.lock().await;
    // The node keeps no blocks itself: every hit comes from the KV-store.
    let mut c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .transport(transport)
        .prefill_args(&["--cache-bytes", "0"])
        .kvstore()
        .start()
        .await;
    let mut client = c.client().await;
    let system = tokens(1, 100); // 6 full blocks of 16
    for seed in [0, 7] {
        let mut a = system.clone();
        a.extend(tokens(2 + seed as u32, 30));
        let before = stored_blocks(&c).await;
        let (cold, f) = generate(&mut client, a.clone(), seed).await;
        let usage = f.usage.unwrap();
        assert_eq!(usage.cached_tokens, if seed == 0 { 0 } else { 96 }, "{usage:?}");
        // Publishing runs after the response: wait until the prompt's 8 full blocks are in.
        eventually(WAIT, "blocks published", || async {
            stored_blocks(&c).await >= before + if seed == 0 { 8 } else { 2 }
        })
        .await;
        let (warm, f) = generate(&mut client, a.clone(), seed).await;
        // 130 tokens: 8 full blocks, and the 2-token tail is computed.
        assert_eq!(f.usage.unwrap().cached_tokens, 128);
        assert_eq!(warm, cold, "seed {seed}: the cached prompt's tokens differ");
    }
    // Another question after the same system prompt reuses its 6 blocks.
    let mut b = system.clone();
    b.extend(tokens(40, 20));
    let (_, f) = generate(&mut client, b, 0).await;
    assert_eq!(f.usage.unwrap().cached_tokens, 96);

    // Without the KV-store every request still succeeds, computing its whole prompt.
    let mut a = system.clone();
    a.extend(tokens(2, 30));
    let (cached, _) = generate(&mut client, a.clone(), 0).await;
    let node = c.nodes().await.into_iter().find(|n| n.node_id.starts_with("prefill")).unwrap();
    let s = prefill_stats(&c, &node.node_id).await;
    // Blocks read: 0 + 8 (seed 0), 6 + 8 (seed 7), 6 (another question), 8 (just now).
    let by = if transport == "ucx" { (36, 0) } else { (0, 36) };
    assert_eq!((s.remote_blocks, s.grpc_blocks, s.remote_fallbacks), (by.0, by.1, 0), "{s:?}");
    assert_eq!((s.local_hit_tokens, s.store_hit_tokens), (0, 36 * 16), "{s:?}");
    c.kvstore.as_mut().unwrap().kill();
    let (cold, f) = tokio::time::timeout(WAIT, generate(&mut client, a, 0)).await.unwrap();
    assert_eq!(f.usage.unwrap().cached_tokens, 0);
    assert_eq!(cold, cached);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefill_nodes_computing_one_prompt_store_it_once() {
    let _serial = SERIAL.lock().await;
    // Without in-flight coalescing the second request would compute the prompt too: this is
    // also the control for `a_herd_sharing_a_new_prefix_computes_it_once`.
    let c = Cluster::builder()
        .prefill(2)
        .decode(1)
        .router_args(&["--prefill-policy", "least-load", "--coalesce-wait-ms", "0"])
        .kvstore()
        .start()
        .await;
    // Long enough (62 full blocks) that the first is still computing when the second arrives.
    let prompt = tokens(5, 1000);
    let mut tasks = Vec::new();
    for i in 0..2 {
        let mut client = c.client().await;
        let p = prompt.clone();
        tasks.push(tokio::spawn(async move { generate(&mut client, p, 0).await }));
        if i == 0 {
            // The router sees the first node busy before the second request is placed, so
            // both compute the prompt (neither has published it yet).
            eventually(WAIT, "first prompt running", || async {
                c.nodes().await.iter().any(|n| n.load.as_ref().is_some_and(|l| l.running > 0))
            })
            .await;
        }
    }
    let mut nodes = std::collections::BTreeSet::new();
    for t in tasks {
        let (_, f) = t.await.unwrap();
        assert_eq!(f.usage.unwrap().cached_tokens, 0);
        nodes.insert(f.timings.unwrap().prefill_node);
    }
    assert_eq!(nodes.len(), 2, "both prefill nodes should have computed it: {nodes:?}");
    let mut k = store_client(&c).await;
    eventually(WAIT, "both publishes done", || {
        let mut k = k.clone();
        async move {
            let s = k.stats(StatsRequest {}).await.unwrap().into_inner();
            s.blocks + s.dedup >= 124
        }
    })
    .await;
    let s = k.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.blocks, s.dedup), (62, 62), "stored once: {s:?}");
}

per_transport!(cached_prefixes_give_the_same_tokens_bit_for_bit);

/// A herd: requests sharing a new 1,024-token system prompt arrive together. One computes it
/// and the others wait for it (in-flight coalescing), then take it from the cache of the
/// prefill node that computed it, so the prefill nodes' counters show it computed once. With
/// `--coalesce-wait-ms 0` all four compute it (cached: [0, 0, 0, 0]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_herd_sharing_a_new_prefix_computes_it_once() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(2).decode(1).kvstore().start().await;
    let system = tokens(11, 1024);
    let herd: Vec<Vec<u32>> =
        (0..4).map(|q| system.iter().copied().chain(tokens(70 + q, 20)).collect()).collect();
    let mut tasks = Vec::new();
    for p in herd.clone() {
        let mut client = c.client().await;
        tasks.push(tokio::spawn(async move { generate(&mut client, p, 0).await }));
    }
    let mut cached = Vec::new();
    for t in tasks {
        let (_, f) = tokio::time::timeout(2 * WAIT, t).await.unwrap().unwrap();
        cached.push(f.usage.unwrap().cached_tokens);
    }
    cached.sort_unstable();
    assert_eq!(cached, [0, 1024, 1024, 1024], "one leader, three followers");
    // The nodes' own counters: every prompt token not taken from a cache was computed once
    // (the last token of each prompt is always computed and not counted).
    let mut computed = 0;
    for n in c.nodes().await.into_iter().filter(|n| n.role == Role::Prefill as i32) {
        computed += prefill_stats(&c, &n.node_id).await.miss_tokens;
    }
    let want: u64 = herd.iter().map(|p| p.len() as u64 - 1).sum::<u64>() - 3 * 1024;
    assert_eq!(computed, want, "the system prompt computed once");
}

async fn prefill_stats(c: &Cluster, node: &str) -> pdmesh_proto::v1::PrefixCacheStats {
    use pdmesh_proto::v1::prefill_client::PrefillClient;
    let n = c.nodes().await.into_iter().find(|n| n.node_id == node).unwrap();
    let mut p = PrefillClient::new(c.channel(&n.address).await);
    p.stats(StatsRequest {}).await.unwrap().into_inner().prefix_cache.unwrap()
}

/// Without a KV-store each prefill node has only its own cache. Prefix-aware placement sends
/// every prompt sharing a system prompt to the node that computed it, so all but the first
/// reuse it; round-robin alternates, so each node computes it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_placement_finds_the_node_that_holds_the_prefix() {
    let _serial = SERIAL.lock().await;
    let system = tokens(9, 100); // 6 full blocks of 16
    for (policy, want) in [("prefix-aware", [0, 96, 96, 96]), ("round-robin", [0, 0, 96, 96])] {
        let c = Cluster::builder()
            .prefill(2)
            .decode(1)
            .router_args(&["--prefill-policy", policy])
            .start()
            .await;
        let mut client = c.client().await;
        let (mut cached, mut nodes) = (Vec::new(), Vec::new());
        for q in 0..4 {
            let mut p = system.clone();
            p.extend(tokens(50 + q, 20));
            let (_, f) = generate(&mut client, p, 0).await;
            cached.push(f.usage.unwrap().cached_tokens);
            nodes.push(f.timings.unwrap().prefill_node);
        }
        assert_eq!(cached, want, "{policy}: prefill nodes {nodes:?}");
        let distinct: std::collections::BTreeSet<_> = nodes.iter().collect();
        assert_eq!(
            distinct.len(),
            if policy == "round-robin" { 2 } else { 1 },
            "{policy}: {nodes:?}"
        );
        // The node's own counters agree: its hits came from its own cache.
        let s = prefill_stats(&c, &nodes[1]).await;
        let own: u64 = nodes
            .iter()
            .zip(&cached)
            .filter(|(n, _)| **n == nodes[1])
            .map(|(_, &t)| u64::from(t))
            .sum();
        assert_eq!((s.local_hit_tokens, s.store_hit_tokens), (own, 0), "{policy}: {s:?}");
        assert!(s.local_blocks >= 7, "{policy}: {s:?}");
    }
}

async fn store_stats(c: &Cluster) -> pdmesh_proto::v1::KvStoreStats {
    store_client(c).await.stats(StatsRequest {}).await.unwrap().into_inner()
}

/// A KV-store with a disk tier, killed (SIGKILL) and started again on its directory, serves
/// the prefix it held from disk: the cached prompt gives the tokens it gave computed, bit for
/// bit. Killed again, and one block's file torn meanwhile (its tail cut, as a crash mid-write
/// without the sync would leave it): the match ends before that block, the file is deleted
/// unserved, the rest of the prompt is computed (and stored again), and the tokens are still
/// the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_kvstore_restarts_serving_its_prefixes_from_disk() {
    let _serial = SERIAL.lock().await;
    let disk = tempfile::tempdir().unwrap();
    let dir = disk.path().display().to_string();
    let mut c = Cluster::builder()
        .prefill(1)
        .decode(1)
        // The node keeps no blocks itself: every hit comes from the KV-store.
        .prefill_args(&["--cache-bytes", "0"])
        .kvstore()
        .kvstore_args(&["--disk-dir", &dir])
        .start()
        .await;
    let mut client = c.client().await;
    let prompt = tokens(5, 130); // 8 full blocks of 16
    let (cold, f) = generate(&mut client, prompt.clone(), 0).await;
    assert_eq!(f.usage.unwrap().cached_tokens, 0);
    eventually(WAIT, "blocks published to RAM and disk", || async {
        store_stats(&c).await.disk_blocks >= 8
    })
    .await;

    c.restart_kvstore();
    let s = store_stats(&c).await;
    assert_eq!((s.blocks, s.held_blocks, s.disk_recovered), (0, 8, 8), "{s:?}");
    let (warm, f) = generate(&mut client, prompt.clone(), 0).await;
    let usage = f.usage.unwrap();
    assert_eq!(usage.cached_tokens, 128);
    let tiers = usage.cached_by_tier.unwrap();
    assert_eq!((tiers.kvstore_disk, tiers.kvstore_ram, tiers.node_ram), (128, 0, 0), "{tiers:?}");
    assert_eq!(warm, cold, "the prefix served from disk gives other tokens");
    assert_eq!(store_stats(&c).await.disk_hit_tokens, 128);

    c.restart_kvstore();
    // The sixth block's file loses its tail.
    let layout = c.decode_stats(0).await.layout.unwrap();
    let layout = pdmesh_proto::layout_from_wire(&layout).unwrap();
    // Hashed as the mesh hashes the prompts of the harness's tenant, "test".
    let tenant = pdmesh_common::apikey::Tenant {
        tenant: "test".into(),
        max_in_flight: None,
        cache_group: None,
        kv_policy: None,
        default_model: None,
    };
    let hasher = pdmesh_kv_types::BlockHasher::new(&layout).unwrap();
    let sixth = hasher.salted(&tenant.cache_salt()).chain(&prompt)[5];
    let files: Vec<_> = std::fs::read_dir(disk.path())
        .unwrap()
        .map(|d| d.unwrap().path().join(format!("{:032x}.kv", sixth.0)))
        .filter(|p| p.exists())
        .collect();
    assert_eq!(files.len(), 1, "the sixth block's file");
    let len = std::fs::metadata(&files[0]).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&files[0]).unwrap().set_len(len / 2).unwrap();
    let (again, f) = generate(&mut client, prompt, 0).await;
    assert_eq!(f.usage.unwrap().cached_tokens, 80, "five blocks before the torn one");
    assert_eq!(again, cold);
    let s = store_stats(&c).await;
    assert_eq!((s.disk_corrupt, s.disk_hit_tokens), (1, 80), "{s:?}");
    // The torn file was deleted; the block the prefill node computed instead is stored and
    // written anew, whole.
    let whole = || std::fs::metadata(&files[0]).is_ok_and(|m| m.len() == len);
    eventually(WAIT, "the recomputed block on disk", || async { whole() }).await;
}

/// The prefix cache stats of the (one) prefill node.
async fn prefill_node(c: &Cluster) -> pdmesh_proto::v1::PrefixCacheStats {
    use pdmesh_proto::v1::prefill_client::PrefillClient;
    let mut p = PrefillClient::new(c.channel(&c.prefills[0].addr).await);
    p.stats(StatsRequest {}).await.unwrap().into_inner().prefix_cache.unwrap()
}

/// A prefill node with a disk tier under its own cache, killed (SIGKILL) and started again on
/// the same directory (a reclaimed instance replaced), resumes with its prefixes: the prompt
/// it computed before is served from its disk, the tier named in the usage, with the same
/// tokens bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_prefill_node_resumes_with_its_prefixes_from_disk() {
    let _serial = SERIAL.lock().await;
    let disk = tempfile::tempdir().unwrap();
    let dir = disk.path().display().to_string();
    let mut c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .prefill_args(&["--cache-disk-dir", &dir])
        .start()
        .await;
    let mut client = c.client().await;
    let prompt = tokens(9, 130); // 8 full blocks of 16
    let (cold, f) = generate(&mut client, prompt.clone(), 0).await;
    assert_eq!(f.usage.unwrap().cached_tokens, 0);
    eventually(WAIT, "the prompt's blocks on disk", || async {
        prefill_node(&c).await.disk_blocks >= 8
    })
    .await;

    c.restart_prefill(0);
    // The router has the restarted node (same name, new address) before the prompt comes.
    let addr = c.prefills[0].addr.clone();
    eventually(WAIT, "the restarted node registered", || async {
        c.nodes().await.iter().any(|n| n.address == addr)
    })
    .await;
    let s = prefill_node(&c).await;
    assert_eq!((s.local_blocks, s.disk_blocks, s.disk_recovered), (0, 8, 8), "{s:?}");
    let (warm, f) = generate(&mut client, prompt, 0).await;
    let usage = f.usage.unwrap();
    assert_eq!(usage.cached_tokens, 128);
    let tiers = usage.cached_by_tier.unwrap();
    assert_eq!((tiers.node_disk, tiers.node_ram), (128, 0), "{tiers:?}");
    assert_eq!(warm, cold, "the prefix served from the node's disk gives other tokens");
    let s = prefill_node(&c).await;
    assert_eq!((s.local_disk_hit_tokens, s.local_blocks), (128, 8), "{s:?}");
}
