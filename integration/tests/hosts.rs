//! KV between hosts: prefill and decode nodes each on a network-namespace host of its own
//! (with its own IPC namespace, so nothing is shared but the network), moving KV over UCX —
//! TCP between the namespaces, as between machines without an RDMA NIC. Needs root.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use pdmesh_integration::netns::{FABRIC_DEVICE, Netns};
use pdmesh_integration::reference::{reference, request};
use pdmesh_integration::{Cluster, ClusterBuilder, collect, eventually};
use pdmesh_proto::v1::TransportStats;

const MAX_TOKENS: u32 = 16;

fn hosts() -> Arc<Netns> {
    let names = ["router", "prefill-0", "decode-0"];
    Arc::new(Netns::new(&names).unwrap_or_else(|e| panic!("network namespaces (root): {e}")))
}

/// Runs reference prompt `i` through the mesh and checks `pdmesh run`'s tokens.
async fn served(c: &Cluster, i: usize) {
    let want = tokio::task::spawn_blocking(move || reference(i, MAX_TOKENS)).await.unwrap();
    let mut r = tonic::Request::new(request(i, MAX_TOKENS));
    r.set_timeout(Duration::from_secs(60));
    let stream = c.client().await.generate(r).await.unwrap().into_inner();
    let (tokens, _) = collect(stream).await.unwrap();
    assert_eq!(tokens, want, "prompt {i} differs from `pdmesh run`");
}

fn sent(c: &[TransportStats], transport: &str) -> TransportStats {
    c.iter().find(|t| t.transport == transport).cloned().unwrap_or_default()
}

fn builder(hosts: &Arc<Netns>) -> ClusterBuilder {
    let mut b = Cluster::builder().netns(Arc::clone(hosts)).prefill(1).decode(1);
    // UCX_* from the test's environment reach the nodes (UCX_LOG_LEVEL=info shows lanes).
    for (k, v) in std::env::vars().filter(|(k, _)| k.starts_with("UCX_")) {
        b = b.env(&k, &v);
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_crosses_hosts_over_ucx() {
    let hosts = hosts();
    let c = builder(&hosts).transport("ucx").start().await;
    for i in [3, 7] {
        served(&c, i).await;
    }
    // Both transfers went by UCX puts over the link: none mapped (no memory is shared with
    // another host), none failed, none retried.
    let p = sent(&c.prefill_stats(0).await.transports, "ucx");
    assert_eq!((p.transfers, p.failures, p.fallbacks, p.mapped), (2, 0, 0, 0), "{p:?}");
    assert_eq!(c.received(0, "ucx").await, 2);
}

/// Hosts on separate networks that share memory (one IPC namespace) are what UCX cannot
/// tell apart from one host: it picked shared memory, lost every wake-up, and each transfer
/// crawled to its 30 s timeout. Such a peer is now refused before a byte moves, so `auto`
/// takes gRPC for it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_refuses_a_peer_sharing_memory_across_networks() {
    let hosts = hosts();
    let c = builder(&hosts).shared_ipc().transport("auto").start().await;
    served(&c, 3).await;
    let p = c.prefill_stats(0).await.transports;
    let (ucx, grpc) = (sent(&p, "ucx"), sent(&p, "grpc"));
    assert_eq!(
        (ucx.transfers, ucx.fallbacks, grpc.transfers, grpc.failures),
        (0, 1, 1, 0),
        "{p:?}"
    );
    assert_eq!(c.received(0, "grpc").await, 1);
}

/// A session cut mid-transfer (the decode host's fabric, which UCX runs on, goes down; the
/// front-end network and gRPC stay up) completes nothing; the prefill node gives it up within
/// its bound, the decode node moves the reservation out of the session's reach, and the KV
/// goes again over gRPC into the same reservation: the request ends with `pdmesh run`'s
/// tokens, not at the 30 s transfer timeout nor by a retry. Once the fabric is back the
/// abandoned session ends and every block is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_cut_mid_transfer_falls_back_to_grpc() {
    let names = ["router", "prefill-0", "decode-0"];
    let hosts = Arc::new(Netns::with_fabric(&names).unwrap());
    let c = builder(&hosts)
        .env("UCX_NET_DEVICES", FABRIC_DEVICE)
        .transport("ucx")
        // Each piece waits 40 ms before it is sent: the transfer is still running when the
        // cut comes.
        .prefill_args(&["--fault-transfer-delay-ms", "40", "--kv-stall-ms", "500"])
        .start()
        .await;
    served(&c, 0).await; // warm: the endpoint exists before the cut
    let cut = async {
        eventually(Duration::from_secs(30), "the KV on its way", || async {
            c.prefill_stats(0).await.transferring > 0
        })
        .await;
        hosts.connect_fabric("decode-0", false);
    };
    tokio::join!(served(&c, 3), cut);
    let p = c.prefill_stats(0).await.transports;
    let (ucx, grpc) = (sent(&p, "ucx"), sent(&p, "grpc"));
    assert_eq!((ucx.transfers, ucx.fallbacks, ucx.stalls), (1, 1, 1), "{p:?}");
    assert_eq!((grpc.transfers, grpc.failures, ucx.failures), (1, 0, 0), "{p:?}");
    assert_eq!(c.received(0, "grpc").await, 1);
    // The request is over, but the abandoned session's puts may still land (the fabric is
    // down, they sit in the prefill host's kernel): its blocks stay parked, not reused by the
    // next request, until the session ends. (The fallback stream's end once freed them, and
    // the late puts then corrupted other requests' KV.)
    let load = c.decode_stats(0).await.load.unwrap_or_default();
    assert!(load.free_blocks < load.total_blocks, "parked blocks were let go: {load:?}");
    served(&c, 7).await;
    hosts.connect_fabric("decode-0", true);
    c.wait_blocks_free().await;
}
