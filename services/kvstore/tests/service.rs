//! The KvStore gRPC service in-process: two writers of the same blocks store them once, a
//! match pins the stored prefix and streamed reads give back the bytes written, and every
//! bad input gets a precise status; with a disk tier, what RAM evicted and what a restart
//! finds is served from disk. (Reads by UCX get: kv-ucx's `tests/store.rs`.)

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use pdmesh_kv_types::{BlockHash, BlockHasher, KvDtype, KvGeometry, KvLayout};
use pdmesh_kvstore::KvStoreService;
use pdmesh_kvstore::disk::DiskTier;
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::kv_store_server::KvStoreServer;
use pdmesh_proto::v1::kv_write_chunk::Chunk;
use pdmesh_proto::v1::{
    KvMatchRequest, KvMatchResponse, KvReadRequest, KvReleaseMatchRequest, KvStoreBlock,
    KvWriteChunk, KvWriteHeader, StatsRequest,
};
use tonic::Code;
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

async fn serve(budget_blocks: usize) -> KvStoreClient<Channel> {
    serve_with(budget_blocks, None).await
}

/// A store of `budget_blocks` in RAM, with `disk` as its disk tier.
async fn serve_with(budget_blocks: usize, disk: Option<DiskTier>) -> KvStoreClient<Channel> {
    let svc = KvStoreService::new(
        "kvstore-0",
        layout(),
        budget_blocks * 256,
        Duration::from_secs(10),
        Duration::from_secs(60),
        None,
        disk,
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

#[tokio::test]
async fn blocks_written_twice_are_stored_once_and_read_back() {
    let mut c = serve(8).await;
    let system: Vec<u32> = (0..12).collect(); // 3 full blocks
    let hashes = chain(&system);
    let data: Vec<Bytes> = (1..=3).map(block).collect();
    let first = c.write(tokio_stream::iter(write_msgs(&hashes, &data))).await.unwrap().into_inner();
    let second =
        c.write(tokio_stream::iter(write_msgs(&hashes, &data))).await.unwrap().into_inner();
    assert_eq!((first.stored, first.duplicates), (3, 0));
    assert_eq!((second.stored, second.duplicates), (0, 3), "the second writer stores nothing");

    // A prompt with the same 3 blocks and one more matches the 3.
    let mut longer = system.clone();
    longer.extend(100..104);
    let m = c
        .r#match(KvMatchRequest {
            layout: Some(wire()),
            hashes: chain(&longer),
            lease_ms: 0,
            transports: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.blocks, 3);
    let mut read = c.read(KvReadRequest { lease: m.lease.clone() }).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(b) = read.message().await.unwrap() {
        got.push((b.hash, b.data));
    }
    assert_eq!(got, hashes.into_iter().zip(data).collect::<Vec<_>>());
    let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.blocks, s.dedup, s.hit_tokens, s.miss_tokens, s.pinned_blocks), (3, 3, 12, 4, 3));
    let r = c
        .release_match(KvReleaseMatchRequest { lease: m.lease.clone() })
        .await
        .unwrap()
        .into_inner();
    assert!(r.released);
    assert_eq!(c.stats(StatsRequest {}).await.unwrap().into_inner().pinned_blocks, 0);
    let err = c.read(KvReadRequest { lease: m.lease.clone() }).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
}

#[tokio::test]
async fn bad_input_gets_a_precise_status() {
    let mut c = serve(2).await;
    let other = pdmesh_proto::v1::KvLayout { dtype: "f32".into(), ..wire() };
    let err = c
        .r#match(KvMatchRequest {
            layout: Some(other.clone()),
            hashes: vec![],
            lease_ms: 0,
            transports: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("dtype"), "{err:?}");
    let err = c
        .r#match(KvMatchRequest {
            layout: Some(wire()),
            hashes: vec![Bytes::from_static(&[0; 16]), Bytes::from_static(&[1; 3])],
            lease_ms: 0,
            transports: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("hashes[1]"), "{err:?}");

    let short = write_msgs(&chain(&[1, 2, 3, 4]), &[Bytes::from_static(&[0; 255])]);
    let err = c.write(tokio_stream::iter(short)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("block 0") && err.message().contains("256"), "{err:?}");
    let headless = write_msgs(&chain(&[1, 2, 3, 4]), &[block(1)]).split_off(1);
    let err = c.write(tokio_stream::iter(headless)).await.unwrap_err();
    assert!(err.message().contains("header"), "{err:?}");
    let mut wrong = write_msgs(&[], &[]);
    wrong[0] = KvWriteChunk {
        chunk: Some(Chunk::Header(KvWriteHeader { layout: Some(other), from: "p".into() })),
    };
    let err = c.write(tokio_stream::iter(wrong)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    // Two slots: the third block evicts the least recently used one.
    let hashes = chain(&(0..12).collect::<Vec<u32>>());
    let m = write_msgs(&hashes, &[block(1), block(2), block(3)]);
    let r = c.write(tokio_stream::iter(m)).await.unwrap().into_inner();
    assert_eq!((r.stored, r.full), (3, 0));
    let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.blocks, s.evictions), (2, 1));
    // With both stored blocks pinned by a match, a new block finds no room: refused, not
    // failed, and nothing pinned is dropped.
    let tail = chain(&[50, 51, 52, 53]);
    let tail_match = KvMatchRequest {
        layout: Some(wire()),
        hashes: tail.clone(),
        lease_ms: 0,
        transports: Vec::new(),
    };
    let r = c.write(tokio_stream::iter(write_msgs(&tail, &[block(4)]))).await.unwrap();
    assert_eq!(r.into_inner().stored, 1, "evicts the older of the two");
    let pin = c.r#match(tail_match).await.unwrap().into_inner();
    let last = KvMatchRequest {
        layout: Some(wire()),
        hashes: hashes.clone(),
        lease_ms: 0,
        transports: Vec::new(),
    };
    let m2 = c.r#match(last).await.unwrap().into_inner();
    assert_eq!((pin.blocks, m2.blocks), (1, 0), "block 0 of the chain was evicted");
    let other = chain(&[60, 61, 62, 63, 64]);
    let r = c.write(tokio_stream::iter(write_msgs(&other, &[block(5)]))).await.unwrap();
    assert_eq!(r.into_inner().stored, 1, "one slot was still unpinned");
    let again = chain(&[70, 71, 72, 73]);
    let pin2 = KvMatchRequest {
        layout: Some(wire()),
        hashes: other.clone(),
        lease_ms: 0,
        transports: Vec::new(),
    };
    c.r#match(pin2).await.unwrap();
    let r = c.write(tokio_stream::iter(write_msgs(&again, &[block(6)]))).await.unwrap();
    assert_eq!(r.into_inner().full, 1, "every slot pinned: refused");
    assert_eq!(c.stats(StatsRequest {}).await.unwrap().into_inner().pinned_blocks, 2);
}

async fn matched(c: &mut KvStoreClient<Channel>, hashes: &[Bytes]) -> KvMatchResponse {
    let m = KvMatchRequest {
        layout: Some(wire()),
        hashes: hashes.to_vec(),
        lease_ms: 0,
        transports: Vec::new(),
    };
    c.r#match(m).await.unwrap().into_inner()
}

async fn read_all(c: &mut KvStoreClient<Channel>, lease: &str) -> Vec<Bytes> {
    let mut s = c.read(KvReadRequest { lease: lease.into() }).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(b) = s.message().await.unwrap() {
        got.push(b.data);
    }
    got
}

/// With a disk tier, RAM is a cache of it: a chain RAM evicted is read back from disk for a
/// match (counted as disk hits) with the bytes written; a store started again on the
/// directory (the last one killed) serves every block from disk; and a block whose file was
/// torn ends the match before it, is deleted and counted, and is never read.
#[tokio::test]
async fn a_disk_tier_serves_what_ram_evicted_and_what_a_restart_finds() {
    let root = tempfile::tempdir().unwrap();
    let tier = || DiskTier::open(root.path(), &layout(), 1 << 20, true).unwrap();
    let mut c = serve_with(4, Some(tier())).await;
    let a_tokens: Vec<u32> = (0..16).collect();
    let b_tokens: Vec<u32> = (100..116).collect();
    let (a, b) = (chain(&a_tokens), chain(&b_tokens));
    let (a_data, b_data): (Vec<Bytes>, Vec<Bytes>) =
        ((1..=4).map(block).collect(), (11..=14).map(block).collect());
    c.write(tokio_stream::iter(write_msgs(&a, &a_data))).await.unwrap();
    // B fills RAM: A is on disk only.
    c.write(tokio_stream::iter(write_msgs(&b, &b_data))).await.unwrap();
    let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.blocks, s.disk_blocks, s.held_blocks, s.evictions), (4, 8, 8, 4), "{s:?}");

    let m = matched(&mut c, &a).await;
    assert_eq!((m.blocks, m.disk_blocks), (4, 4));
    assert_eq!(read_all(&mut c, &m.lease).await, a_data, "A read back from disk");
    c.release_match(KvReleaseMatchRequest { lease: m.lease }).await.unwrap();
    let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.disk_hit_tokens, s.hit_tokens), (16, 16), "{s:?}");
    drop(c);

    // Restarted on the same directory: nothing in RAM, all 8 blocks held.
    let disk = tier();
    let torn = disk.dir().join(format!("{:032x}.kv", BlockHash::from_bytes(&b[2]).unwrap().0));
    let mut c = serve_with(8, Some(disk)).await;
    let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.blocks, s.held_blocks, s.disk_recovered), (0, 8, 8), "{s:?}");
    // B's third block's file loses its tail: B matches up to it.
    let len = std::fs::metadata(&torn).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&torn).unwrap().set_len(len - 1).unwrap();
    let m = matched(&mut c, &b).await;
    assert_eq!((m.blocks, m.disk_blocks), (2, 2));
    assert_eq!(read_all(&mut c, &m.lease).await, b_data[..2].to_vec());
    let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.disk_corrupt, s.held_blocks), (1, 7), "{s:?}");
    assert!(!torn.exists(), "the torn file is deleted");
    let m = matched(&mut c, &a).await;
    assert_eq!(read_all(&mut c, &m.lease).await, a_data, "A after the restart");
}
