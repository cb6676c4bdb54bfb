//! The KV-store's blocks read by UCX get: a match answers a caller that reads by UCX with a
//! descriptor of the pinned blocks alone, and the prefill node's reader gets their bytes.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use pdmesh_kv_transfer::Fabric;
use pdmesh_kv_types::{BlockHasher, KvDtype, KvGeometry, KvLayout};
use pdmesh_kv_ucx::descriptor::{self, UcxTarget};
use pdmesh_kv_ucx::ucx::Peers;
use pdmesh_kv_ucx::{Ucx, UcxNode};
use pdmesh_kvstore::KvStoreService;
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::kv_store_server::KvStoreServer;
use pdmesh_proto::v1::kv_write_chunk::Chunk;
use pdmesh_proto::v1::{
    KvMatchRequest, KvReleaseMatchRequest, KvStoreBlock, KvWriteChunk, KvWriteHeader,
};
use tonic::transport::Channel;

fn layout() -> KvLayout {
    // Small blocks: 2 layers × K|V × 1 head × 4 slots × 8 dims × 2 bytes = 256 bytes.
    let geometry =
        KvGeometry { dtype: KvDtype::F16, block_size: 4, layers: 2, kv_heads: 1, head_dim: 8 };
    KvLayout { model_fingerprint: 42, geometry, window: None }
}

fn wire() -> pdmesh_proto::v1::KvLayout {
    layout().into()
}

async fn serve(budget_blocks: usize, fabric: Option<&dyn Fabric>) -> KvStoreClient<Channel> {
    let svc = KvStoreService::new(
        "kvstore-0",
        layout(),
        budget_blocks * 256,
        Duration::from_secs(10),
        Duration::from_secs(60),
        fabric,
        None,
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvStoreServer::new(svc))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    KvStoreClient::connect(format!("http://{addr}")).await.unwrap()
}

fn block(i: u8) -> Bytes {
    Bytes::from((0..256).map(|j| (j as u8).wrapping_mul(i)).collect::<Vec<u8>>())
}

fn write_msgs(hashes: &[Bytes], blocks: &[Bytes]) -> Vec<KvWriteChunk> {
    let mut v = vec![KvWriteChunk {
        chunk: Some(Chunk::Header(KvWriteHeader { layout: Some(wire()), from: "p".into() })),
    }];
    for (h, d) in hashes.iter().zip(blocks) {
        v.push(KvWriteChunk {
            chunk: Some(Chunk::Block(KvStoreBlock { hash: h.clone(), data: d.clone() })),
        });
    }
    v
}

fn chain(tokens: &[u32]) -> Vec<Bytes> {
    let h = BlockHasher::new(&layout()).unwrap();
    h.chain(tokens).into_iter().map(|x| Bytes::copy_from_slice(&x.to_bytes())).collect()
}

/// A caller that can read by UCX gets the pinned blocks' descriptor and reads the same bytes
/// with one-sided gets under keys registered for that lease alone (read-only ranges covering
/// only its blocks); a caller that does not ask, or a store without UCX, gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matched_blocks_are_read_by_ucx_get() {
    let ucx = Ucx::new(UcxNode::start("kvstore-test").unwrap());
    let mut c = serve(8, Some(&ucx)).await;
    let tokens: Vec<u32> = (0..16).collect(); // 4 full blocks
    let hashes = chain(&tokens);
    let data: Vec<Bytes> = (1..=4).map(block).collect();
    c.write(tokio_stream::iter(write_msgs(&hashes, &data))).await.unwrap();
    let ask = |transports: &[&str]| KvMatchRequest {
        layout: Some(wire()),
        hashes: hashes[..3].to_vec(),
        lease_ms: 0,
        transports: transports.iter().map(|t| t.to_string()).collect(),
    };
    assert!(c.r#match(ask(&[])).await.unwrap().into_inner().remote.is_none());
    assert!(c.r#match(ask(&["nixl"])).await.unwrap().into_inner().remote.is_none());
    let m = c.r#match(ask(&["nixl", "ucx"])).await.unwrap().into_inner();
    let d = m.remote.clone().expect("a store with UCX answers with a descriptor");
    let t: UcxTarget = descriptor::open(&d).unwrap();
    assert_eq!((m.blocks, t.block_addrs.len()), (3, 3));
    // The lease's three blocks are granted, and nothing else: the fourth stored block's
    // address lies outside every range.
    pdmesh_kv_ucx::scope::check(&t.ranges, &t.block_addrs, 256).unwrap();
    let total: u64 = t.ranges.iter().map(|r| r.len).sum();
    assert_eq!(total, 3 * 256, "{:?}", t.ranges);
    let peers = Peers::new(UcxNode::start("reader").unwrap());
    let p = peers.get(&t.worker_address).await.unwrap();
    let keys = pdmesh_kv_ucx::scope::Keys::unpack(&p.ep, &t.ranges).await.unwrap();
    let pending: Vec<_> =
        t.block_addrs.iter().map(|&a| p.ep.get(256, a, keys.key(a, 256).unwrap())).collect();
    for (i, g) in pending.into_iter().enumerate() {
        assert_eq!(g.await.unwrap(), data[i].to_vec(), "block {i}");
    }
    // The reader a prefill node uses gets the same bytes.
    let reader = ucx.reader();
    let read = reader.read(&d, 3, 256).await.unwrap();
    assert_eq!(read, data[..3].to_vec());
    c.release_match(KvReleaseMatchRequest { lease: m.lease.clone() }).await.unwrap();

    let mut plain = serve(8, None).await;
    plain.write(tokio_stream::iter(write_msgs(&hashes, &data))).await.unwrap();
    assert!(plain.r#match(ask(&["ucx"])).await.unwrap().into_inner().remote.is_none());
}
