//! Several routers over one pool of nodes: every node registers with each router, each router
//! places on every node, any router cancels a request another relays (its tenant's only), and
//! losing a router costs only the streams it was relaying: the other's streams finish with
//! `pdmesh run`'s tokens, new requests go to it, and no KV block is left behind on any node.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use pdmesh_common::apikey::Tenant;
use pdmesh_integration::reference::{reference, request};
use pdmesh_integration::{Cluster, collect, eventually};
use pdmesh_proto::v1::{CancelRequest, FinishReason, GenerateRequest, generate_response};

const MAX_TOKENS: u32 = 64;
const WAIT: Duration = Duration::from_secs(60);

/// Clusters are heavy on two cores: one test at a time in this binary.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn expected(n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| reference(i, MAX_TOKENS)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_registers_with_each_router_and_each_places_on_it() {
    let _serial = SERIAL.lock().await;
    let want = tokio::task::spawn_blocking(|| expected(2)).await.unwrap();
    let c = Cluster::builder().routers(2).prefill(1).decode(1).start().await;
    for r in 0..2 {
        let ids: Vec<String> = c.nodes_at(r).await.into_iter().map(|n| n.node_id).collect();
        assert_eq!(ids, ["decode-0", "prefill-0"], "router {r}");
        let mut client = c.client_at(r).await;
        for (i, w) in want.iter().enumerate() {
            let s = client.generate(request(i, MAX_TOKENS)).await.unwrap().into_inner();
            let (tokens, f) = collect(s).await.unwrap();
            assert_eq!(&tokens, w, "router {r}, prompt {i}");
            let t = f.unwrap().timings.unwrap();
            assert_eq!(
                (t.prefill_node.as_str(), t.decode_node.as_str()),
                ("prefill-0", "decode-0")
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_router_costs_only_its_own_streams() {
    let _serial = SERIAL.lock().await;
    let n = 8;
    let want = tokio::task::spawn_blocking(move || expected(n)).await.unwrap();
    let mut c = Cluster::builder().routers(2).prefill(1).decode(2).start().await;
    // Half the streams through each router, all running when router 0 dies.
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut client = c.client_at(i % 2).await;
        tasks.push(tokio::spawn(async move {
            let s = client.generate(request(i, MAX_TOKENS)).await?.into_inner();
            collect(s).await
        }));
    }
    eventually(WAIT, "every stream decoding", || async {
        let mut decoding = 0;
        for d in 0..2 {
            decoding += c.decode_stats(d).await.decoding;
        }
        decoding as usize >= n / 2
    })
    .await;
    c.router.kill();
    let mut cut = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        let r = tokio::time::timeout(WAIT, t).await.expect("a stream hung").unwrap();
        match r {
            // Relayed by the dead router: its client sees the connection go.
            Err(_) if i % 2 == 0 => cut += 1,
            Err(e) => panic!("stream {i} on the surviving router failed: {e:?}"),
            Ok((tokens, f)) => {
                assert!(f.is_some(), "stream {i} finished");
                assert_eq!(tokens, want[i], "stream {i}");
            }
        }
    }
    assert!(cut > 0, "no stream of router 0 was running when it died");
    // The dead router's requests were cancelled on the nodes with its connections.
    c.wait_blocks_free().await;
    // New requests go to the survivor and run on the same nodes.
    let mut client = c.client_at(1).await;
    let s = client.generate(request(0, MAX_TOKENS)).await.unwrap().into_inner();
    assert_eq!(collect(s).await.unwrap().0, want[0]);
    c.wait_nodes_at(1, 1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_router_cancels_a_request_another_relays_for_its_tenant_only() {
    let _serial = SERIAL.lock().await;
    let other = Tenant {
        tenant: "other".into(),
        max_in_flight: None,
        cache_group: None,
        kv_policy: None,
        default_model: None,
    };
    let c = Cluster::builder().routers(2).prefill(1).decode(1).tenant(other).start().await;
    let mut at0 = c.client_at(0).await;
    let req = GenerateRequest {
        request_id: "long-one".into(),
        ..pdmesh_integration::greedy(&[1, 2, 3, 4, 5, 6, 7, 8], 2000)
    };
    let mut s = at0.generate(req).await.unwrap().into_inner();
    loop {
        let m = s.message().await.unwrap().unwrap();
        if let Some(generate_response::Event::Delta(_)) = m.event {
            break;
        }
    }
    // Another tenant, through the other router: the request is not there for it.
    let mut intruder = c.client_at_as(1, "other").await;
    let cancel = || CancelRequest { request_id: "long-one".into() };
    let err = intruder.cancel(cancel()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    // Its own tenant, through the other router: cancelled on the node, ended by router 0.
    c.client_at(1).await.cancel(cancel()).await.unwrap();
    let (_, f) = tokio::time::timeout(WAIT, collect(s)).await.expect("the stream ended").unwrap();
    let reason = FinishReason::try_from(f.expect("a finish").reason).unwrap();
    assert_eq!(reason, FinishReason::Cancelled);
    c.wait_blocks_free().await;
    // Nothing left to cancel anywhere.
    let err = c.client_at(1).await.cancel(cancel()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
}
