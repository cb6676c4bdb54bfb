//! `pdmesh kvstore` as a real process: it derives the same KV layout as the workers of the mesh
//! from the model, and stores, matches and returns real-sized blocks over gRPC.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use pdmesh_integration::cluster::Service;
use pdmesh_integration::{Cluster, model_path};
use pdmesh_kv_types::BlockHasher;
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::kv_write_chunk::Chunk;
use pdmesh_proto::v1::{
    KvMatchRequest, KvReadRequest, KvStoreBlock, KvWriteChunk, KvWriteHeader, StatsRequest,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvstore_process_shares_the_mesh_layout_and_round_trips_blocks() {
    let c = Cluster::builder().prefill(0).decode(1).start().await;
    let layout = c.decode_stats(0).await.layout.unwrap();
    let model = model_path().display().to_string();
    let args: Vec<String> =
        // A store on its own, plaintext on loopback (the mesh's TLS is mtls.rs's subject).
        ["--insecure", "--listen", "127.0.0.1:0", "--model", &model, "--budget-bytes", "50000000"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let store = Service::start("kvstore", "kvstore", &args);
    let mut k = KvStoreClient::connect(format!("http://{}", store.addr))
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20);
    let s = k.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(s.layout.as_ref(), Some(&layout), "the store and the workers disagree on layout");
    let domain = pdmesh_proto::layout_from_wire(&layout).unwrap();
    let bpb = domain.bytes_per_block();
    assert_eq!(s.capacity_blocks, 50_000_000 / bpb as u64);

    let tokens: Vec<u32> = (0..40).map(|i| 300 + i).collect();
    let chain = BlockHasher::new(&domain).unwrap().chain(&tokens);
    assert_eq!(chain.len(), 2, "40 tokens are two full 16-token blocks");
    let data: Vec<Bytes> = (0..2u8).map(|i| Bytes::from(vec![i + 7; bpb])).collect();
    let mut msgs = vec![KvWriteChunk {
        chunk: Some(Chunk::Header(KvWriteHeader {
            layout: Some(layout.clone()),
            from: "t".into(),
        })),
    }];
    for (h, d) in chain.iter().zip(&data) {
        msgs.push(KvWriteChunk {
            chunk: Some(Chunk::Block(KvStoreBlock {
                hash: Bytes::copy_from_slice(&h.to_bytes()),
                data: d.clone(),
            })),
        });
    }
    let w = k.write(tokio_stream::iter(msgs)).await.unwrap().into_inner();
    assert_eq!(w.stored, 2);
    let hashes = chain.iter().map(|h| Bytes::copy_from_slice(&h.to_bytes())).collect();
    let m = k
        .r#match(KvMatchRequest {
            layout: Some(layout),
            hashes,
            lease_ms: 1000,
            transports: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.blocks, 2);
    let mut r = k.read(KvReadRequest { lease: m.lease.clone() }).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(b) = r.message().await.unwrap() {
        got.push(b.data);
    }
    assert_eq!(got, data);
}
