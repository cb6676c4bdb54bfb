//! Fuzzing every internal RPC handler on stable Rust: the real router (membership), prefill,
//! decode and KV-store services run in this process on the tiny model, and each handler is
//! fed requests mutated from seeds (bit flips, inserted, deleted and overwritten bytes,
//! truncation, spliced varints) at the protobuf byte level, so field values, lengths and
//! nesting go wrong in every way a decoder still accepts. Streaming handlers (PushKv,
//! KvSession, Write: the KV session messages) get sequences of such messages; ids are swapped
//! for live ones half the time so the mutations reach past the capability check.
//!
//! The property: every call ends in a status a client can act on (never INTERNAL, UNKNOWN or
//! UNAVAILABLE, never a hung call), and afterwards the mesh still answers an honest request
//! with the same tokens as before and holds no leaked KV. Seeds come from the code below and
//! from `integration/fuzz/corpus/<rpc>/*.pb` (regressions: a failing input, hex-decoded, goes
//! there). `PDMESH_FUZZ_CASES` sets the cases per handler (CI runs the default).

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use pdmesh_integration::inprocess::{Mesh, Settings};
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::kv_store_server::KvStoreServer;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{
    DecodeRequest, DeregisterRequest, HandOffRequest, HeartbeatRequest, KvBlocks, KvChunk, KvEnd,
    KvHeader, KvLayout, KvMatchRequest, KvReadRequest, KvReleaseMatchRequest, KvSessionRequest,
    KvStoreBlock, KvTarget, KvWriteChunk, KvWriteHeader, NodeLoad, PrefillRequest, RegisterRequest,
    ReleaseRequest, ReserveRequest, Role, SamplerState, StatsRequest, decode_request, kv_chunk,
    kv_session_request, kv_write_chunk,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

/// Longest any fuzzed call may take before it counts as hung.
const CALL_LIMIT: Duration = Duration::from_secs(10);

fn cases() -> u32 {
    std::env::var("PDMESH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
}

/// One edit of an encoded message.
#[derive(Debug, Clone)]
enum Op {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
    /// A maximal varint (a huge length or value) at a position.
    Varint(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, b)| Op::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Op::Set(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Op::Insert(i, b)),
        any::<usize>().prop_map(Op::Delete),
        any::<usize>().prop_map(Op::Truncate),
        any::<usize>().prop_map(Op::Varint),
    ]
}

fn mutate(seed: &[u8], ops: &[Op]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for o in ops {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
        match *o {
            Op::Flip(i, x) if !b.is_empty() => {
                let i = at(i, b.len());
                b[i] ^= x;
            }
            Op::Set(i, x) if !b.is_empty() => {
                let i = at(i, b.len());
                b[i] = x;
            }
            Op::Insert(i, x) => {
                let i = at(i, b.len() + 1);
                b.insert(i, x);
            }
            Op::Delete(i) if !b.is_empty() => {
                let i = at(i, b.len());
                b.remove(i);
            }
            Op::Truncate(i) => b.truncate(at(i, b.len() + 1)),
            Op::Varint(i) => {
                let i = at(i, b.len() + 1);
                b.splice(i..i, [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
            }
            _ => {}
        }
    }
    b
}

/// Seeds of one message type: the built-in ones and the corpus files of `rpc`.
fn seeds<M: Message + Default>(rpc: &str, built_in: Vec<M>) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = built_in.iter().map(Message::encode_to_vec).collect();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(rpc);
    if let Ok(entries) = std::fs::read_dir(&dir) {
        let mut files: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        out.extend(files.iter().map(|f| std::fs::read(f).unwrap()));
    }
    if std::env::var_os("PDMESH_FUZZ_WRITE_CORPUS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        for (i, m) in built_in.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}.pb")), m.encode_to_vec()).unwrap();
        }
    }
    out
}

/// A fuzz case for one message: which seed, which edits, whether to plant a live id.
fn case() -> impl Strategy<Value = (usize, Vec<Op>, bool)> {
    // Few edits per case: most inputs should still decode, and go wrong in one place.
    (any::<usize>(), proptest::collection::vec(op(), 0..3), any::<bool>())
}

/// How a fuzzed call ended: fine, or the status that should never happen.
fn judge(
    rpc: &str,
    input: &[u8],
    r: Result<Result<(), tonic::Status>, tokio::time::error::Elapsed>,
) {
    let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
    match r {
        Err(_) => panic!("{rpc} hung on input {hex}"),
        Ok(Ok(())) => {}
        Ok(Err(s)) => assert!(
            !matches!(s.code(), Code::Internal | Code::Unknown | Code::Unavailable),
            "{rpc} answered {s:?} to input {hex}"
        ),
    }
}

/// Drains a server stream, ending in its first error.
async fn drain<T>(mut s: tonic::Streaming<T>) -> Result<(), tonic::Status> {
    while s.message().await?.is_some() {}
    Ok(())
}

struct Target {
    rt: tokio::runtime::Runtime,
    mesh: Mesh,
    store: String,
    layout: KvLayout,
    _stop: tokio_util::sync::CancellationToken,
    /// The store's disk tier's directory, removed with the target.
    _disk: tempfile::TempDir,
}

impl Target {
    fn start() -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let disk = tempfile::tempdir().unwrap();
        let (mesh, store, layout) = rt.block_on(async {
            let mesh = Settings::new(1, 1).start().await;
            let mut d = DecodeClient::new(ch(&mesh.decode[0]).await);
            let layout = d.stats(StatsRequest {}).await.unwrap().into_inner().layout.unwrap();
            let svc = pdmesh_kvstore::KvStoreService::new(
                "fuzz-store",
                pdmesh_proto::layout_from_wire(&layout).unwrap(),
                4 << 20,
                Duration::from_secs(5),
                Duration::from_secs(30),
                None,
                // A disk tier too: fuzzed writes and matches go through it.
                Some(
                    pdmesh_kvstore::disk::DiskTier::open(
                        disk.path(),
                        &pdmesh_proto::layout_from_wire(&layout).unwrap(),
                        8 << 20,
                        false,
                    )
                    .unwrap(),
                ),
            )
            .unwrap();
            let (l, addr) = pdmesh_common::bind("127.0.0.1:0").await.unwrap();
            let routes = tonic::service::Routes::new(
                KvStoreServer::new(svc).max_decoding_message_size(64 << 20),
            );
            let done = stop.clone().cancelled_owned();
            tokio::spawn(pdmesh_common::serve(
                routes,
                &["pdmesh.v1.KvStore"],
                l,
                pdmesh_common::Exposure::Internal,
                done,
                Duration::from_secs(1),
            ));
            (mesh, addr.to_string(), layout)
        });
        Self { rt, mesh, store, layout, _stop: stop, _disk: disk }
    }

    /// Greedy tokens of an honest request.
    fn honest(&self) -> Vec<u32> {
        self.rt.block_on(async {
            let mut c = self.mesh.client().await;
            let ids: Vec<u32> = (1..30).collect();
            let s = c.generate(pdmesh_integration::greedy(&ids, 6)).await.unwrap().into_inner();
            pdmesh_integration::collect(s).await.unwrap().0
        })
    }

    /// A live reservation's id on the decode node (with its prompt's blocks).
    async fn reservation(&self, remote_kv: bool) -> String {
        let mut d = DecodeClient::new(ch(&self.mesh.decode[0]).await);
        let r = ReserveRequest {
            request_id: "fuzz".into(),
            prompt_tokens: 9,
            max_tokens: 4,
            // Short: an attach that waits for KV that never comes waits this long.
            lease_ms: 300,
            remote_kv,
            owner: String::new(),
            reserve_tokens: 0,
        };
        d.reserve(r).await.unwrap().into_inner().target.unwrap().reservation_id
    }

    /// Runs `cases()` cases of `rpc`: a seed of type M, mutated, decoded, maybe given a live
    /// id by `plant`, then sent by `call`.
    fn fuzz<M, P, C, F>(&self, rpc: &str, seeds: Vec<Vec<u8>>, plant: P, call: C)
    where
        M: Message + Default + Clone + 'static,
        P: Fn(&mut M, String),
        C: Fn(M) -> F,
        F: Future<Output = Result<(), tonic::Status>>,
    {
        let mut runner = TestRunner::new(Config {
            cases: cases(),
            failure_persistence: None,
            ..Config::default()
        });
        let (sent, undecodable) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0u32));
        let result = runner.run(&case(), |(seed, ops, live)| {
            let input = mutate(&seeds[seed % seeds.len()], &ops);
            let Ok(mut msg) = M::decode(input.as_slice()) else {
                undecodable.set(undecodable.get() + 1);
                return Ok(());
            };
            sent.set(sent.get() + 1);
            self.rt.block_on(async {
                let planted = if live {
                    let id = self.reservation(true).await;
                    plant(&mut msg, id.clone());
                    Some(id)
                } else {
                    None
                };
                judge(rpc, &input, tokio::time::timeout(CALL_LIMIT, call(msg)).await);
                // Whatever the call left of it is given back, so the pool never fills up.
                if let Some(id) = planted {
                    let mut d = DecodeClient::new(ch(&self.mesh.decode[0]).await);
                    let _ = d.release(ReleaseRequest { reservation_id: id }).await;
                }
            });
            Ok(())
        });
        if let Err(e) = result {
            panic!("{rpc}: {e}");
        }
        let (sent, undecodable) = (sent.get(), undecodable.get());
        eprintln!("fuzz {rpc}: {sent} calls, {undecodable} inputs that do not decode");
    }
}

async fn ch(addr: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn sampler() -> SamplerState {
    SamplerState { top_p: 1.0, repetition_penalty: 1.0, ..Default::default() }
}

#[test]
fn every_internal_handler_survives_malformed_input() {
    let t = Target::start();
    let want = t.honest();
    let layout = t.layout.clone();
    let (decode, prefill, members, store) = (
        t.mesh.decode[0].clone(),
        t.mesh.prefill[0].clone(),
        t.mesh.members.clone(),
        t.store.clone(),
    );

    // Membership (the router).
    let reg = RegisterRequest {
        node_id: "fuzz-node".into(),
        role: Role::Prefill as i32,
        address: "127.0.0.1:9".into(),
        layout: Some(layout.clone()),
        load: Some(NodeLoad { cache_blocks: 100, free_blocks: 10, ..Default::default() }),
    };
    let register = seeds("register", vec![reg]);
    t.fuzz(
        "Register",
        register,
        |_: &mut RegisterRequest, _| {},
        |m| {
            let a = members.clone();
            async move { MembershipClient::new(ch(&a).await).register(m).await.map(|_| ()) }
        },
    );
    let hb = HeartbeatRequest { node_id: "fuzz-node".into(), load: Some(NodeLoad::default()) };
    t.fuzz(
        "Heartbeat",
        seeds("heartbeat", vec![hb]),
        |_: &mut HeartbeatRequest, _| {},
        |m| {
            let a = members.clone();
            async move { MembershipClient::new(ch(&a).await).heartbeat(m).await.map(|_| ()) }
        },
    );
    let dereg = DeregisterRequest { node_id: "fuzz-node".into(), reason: "fuzz".into() };
    t.fuzz(
        "Deregister",
        seeds("deregister", vec![dereg]),
        |_: &mut DeregisterRequest, _| {},
        |m| {
            let a = members.clone();
            async move { MembershipClient::new(ch(&a).await).deregister(m).await.map(|_| ()) }
        },
    );

    // Decode.
    let reserve = ReserveRequest {
        request_id: "r".into(),
        prompt_tokens: 9,
        max_tokens: 4,
        lease_ms: 1_000,
        remote_kv: true,
        owner: String::new(),
        reserve_tokens: 0,
    };
    t.fuzz(
        "Reserve",
        seeds("reserve", vec![reserve]),
        |_: &mut ReserveRequest, _| {},
        |m| {
            let a = decode.clone();
            async move {
                let mut d = DecodeClient::new(ch(&a).await);
                let r = d.reserve(m).await?.into_inner();
                // Whatever was reserved is given back, so the pool never fills up.
                if let Some(t) = r.target {
                    d.release(ReleaseRequest { reservation_id: t.reservation_id }).await?;
                }
                Ok(())
            }
        },
    );
    let release = ReleaseRequest { reservation_id: "0".repeat(32) };
    t.fuzz(
        "Release",
        seeds("release", vec![release]),
        |m: &mut ReleaseRequest, id| m.reservation_id = id,
        |m| {
            let a = decode.clone();
            async move { DecodeClient::new(ch(&a).await).release(m).await.map(|_| ()) }
        },
    );
    let attach = DecodeRequest {
        reservation_id: "0".repeat(32),
        prompt: (1..10).collect(),
        sampler: Some(sampler()),
        max_tokens: 3,
        stop: vec!["x".into()],
        ignore_eos: true,
        start: Some(decode_request::Start::PrefillLocally(true)),
        resumed: Vec::new(),
        kv_policy: "sinks:64".into(),
    };
    let mut first = attach.clone();
    first.start = Some(decode_request::Start::FirstToken(5));
    // A stream moved here from another node, with two tokens of its own output.
    let moved = DecodeRequest { resumed: vec![5, 6], ..first.clone() };
    // ... or with its KV.
    let handed = DecodeRequest {
        start: Some(decode_request::Start::HandedOff(true)),
        resumed: vec![5, 6],
        ..attach.clone()
    };
    t.fuzz(
        "Decode",
        seeds("decode", vec![attach, first, moved, handed]),
        |m: &mut DecodeRequest, id| m.reservation_id = id,
        |m| {
            let a = decode.clone();
            async move { drain(DecodeClient::new(ch(&a).await).decode(m).await?.into_inner()).await }
        },
    );
    // A router answering a drain: keep it here, or push it to a target.
    let stay = HandOffRequest { reservation_id: "0".repeat(32), target: None };
    let to = HandOffRequest {
        target: Some(KvTarget {
            reservation_id: "1".repeat(32),
            decode_node: "decode-0".into(),
            address: decode.clone(),
            layout: Some(layout.clone()),
            blocks: 1,
            prompt_tokens: 9,
            remote: None,
        }),
        ..stay.clone()
    };
    t.fuzz(
        "HandOff",
        seeds("hand_off", vec![stay, to]),
        |m: &mut HandOffRequest, id| m.reservation_id = id,
        |m| {
            let a = decode.clone();
            async move { DecodeClient::new(ch(&a).await).hand_off(m).await.map(|_| ()) }
        },
    );
    let header = |id: String| KvHeader {
        reservation_id: id,
        layout: Some(layout.clone()),
        prefill_node: "fuzz".into(),
        traceparent: String::new(),
        grant: 0,
    };
    let chunks = vec![
        KvChunk { chunk: Some(kv_chunk::Chunk::Header(header("0".repeat(32)))) },
        KvChunk {
            chunk: Some(kv_chunk::Chunk::Blocks(KvBlocks {
                first_block: 0,
                data: Bytes::from(vec![1u8; 64]),
            })),
        },
        KvChunk {
            chunk: Some(kv_chunk::Chunk::End(KvEnd { blocks: 3, checksums: vec![1, 2], bytes: 0 })),
        },
    ];
    // A stream is a header (kept whole half the time, so the rest gets past it), then the
    // mutated messages.
    let push_seeds = seeds("push_kv", chunks);
    t.fuzz(
        "PushKv",
        push_seeds.clone(),
        |m: &mut KvChunk, id| {
            if let Some(kv_chunk::Chunk::Header(h)) = &mut m.chunk {
                h.reservation_id = id;
            }
        },
        |m| {
            let a = decode.clone();
            let layout = layout.clone();
            async move {
                let mut d = DecodeClient::new(ch(&a).await);
                let id = match &m.chunk {
                    Some(kv_chunk::Chunk::Header(h)) => h.reservation_id.clone(),
                    _ => String::new(),
                };
                let head = KvChunk {
                    chunk: Some(kv_chunk::Chunk::Header(KvHeader {
                        reservation_id: id,
                        layout: Some(layout),
                        prefill_node: "fuzz".into(),
                        traceparent: String::new(),
                        grant: 0,
                    })),
                };
                d.push_kv(tokio_stream::iter([head, m.clone(), m])).await.map(|_| ())
            }
        },
    );
    let session = vec![
        KvSessionRequest { msg: Some(kv_session_request::Msg::Open(header("0".repeat(32)))) },
        KvSessionRequest {
            msg: Some(kv_session_request::Msg::Commit(KvEnd {
                blocks: 3,
                checksums: vec![],
                bytes: 0,
            })),
        },
    ];
    t.fuzz(
        "KvSession",
        seeds("kv_session", session),
        |m: &mut KvSessionRequest, id| {
            if let Some(kv_session_request::Msg::Open(h)) = &mut m.msg {
                h.reservation_id = id;
            }
        },
        |m| {
            let a = decode.clone();
            async move {
                let mut d = DecodeClient::new(ch(&a).await);
                let (tx, rx) = tokio::sync::mpsc::channel(4);
                tx.send(m.clone()).await.unwrap();
                tx.send(m).await.unwrap();
                drop(tx);
                let s = d.kv_session(tokio_stream::wrappers::ReceiverStream::new(rx)).await?;
                drain(s.into_inner()).await
            }
        },
    );

    // Prefill.
    let pre = PrefillRequest {
        request_id: "p".into(),
        prompt: (1..10).collect(),
        sampler: Some(sampler()),
        target: None,
        cache_salt: Bytes::from_static(b"salt"),
    };
    t.fuzz(
        "Prefill",
        seeds("prefill", vec![pre]),
        |m: &mut PrefillRequest, id| {
            m.target = Some(KvTarget {
                reservation_id: id,
                ..Default::default()
            });
        },
        |m| {
            let a = prefill.clone();
            async move { drain(PrefillClient::new(ch(&a).await).prefill(m).await?.into_inner()).await }
        },
    );

    // KV-store.
    let hashes: Vec<Bytes> = (1..4u8).map(|i| Bytes::from(vec![i; 16])).collect();
    let m = KvMatchRequest {
        layout: Some(layout.clone()),
        hashes,
        lease_ms: 500,
        transports: vec!["ucx".into()],
    };
    t.fuzz(
        "Match",
        seeds("kv_match", vec![m]),
        |_: &mut KvMatchRequest, _| {},
        |m| {
            let a = store.clone();
            async move { KvStoreClient::new(ch(&a).await).r#match(m).await.map(|_| ()) }
        },
    );
    let lease = "0".repeat(32);
    t.fuzz(
        "Read",
        seeds("kv_read", vec![KvReadRequest { lease: lease.clone() }]),
        |_: &mut KvReadRequest, _| {},
        |m| {
            let a = store.clone();
            async move { drain(KvStoreClient::new(ch(&a).await).read(m).await?.into_inner()).await }
        },
    );
    t.fuzz(
        "ReleaseMatch",
        seeds("kv_release", vec![KvReleaseMatchRequest { lease }]),
        |_: &mut KvReleaseMatchRequest, _| {},
        |m| {
            let a = store.clone();
            async move { KvStoreClient::new(ch(&a).await).release_match(m).await.map(|_| ()) }
        },
    );
    let bpb = pdmesh_proto::layout_from_wire(&layout).unwrap().bytes_per_block();
    let writes = vec![
        KvWriteChunk {
            chunk: Some(kv_write_chunk::Chunk::Header(KvWriteHeader {
                layout: Some(layout.clone()),
                from: "fuzz".into(),
            })),
        },
        KvWriteChunk {
            chunk: Some(kv_write_chunk::Chunk::Block(KvStoreBlock {
                hash: Bytes::from(vec![7u8; 16]),
                data: Bytes::from(vec![3u8; bpb]),
            })),
        },
    ];
    t.fuzz(
        "Write",
        seeds("kv_write", writes),
        |_: &mut KvWriteChunk, _| {},
        |m| {
            let a = store.clone();
            let layout = layout.clone();
            async move {
                let head = KvWriteChunk {
                    chunk: Some(kv_write_chunk::Chunk::Header(KvWriteHeader {
                        layout: Some(layout),
                        from: "fuzz".into(),
                    })),
                };
                let mut k = KvStoreClient::new(ch(&a).await);
                k.write(tokio_stream::iter([head, m])).await.map(|_| ())
            }
        },
    );

    // The mesh is unharmed: the same tokens, and no KV held once the fuzzed reservations'
    // leases lapse.
    assert_eq!(t.honest(), want);
    t.rt.block_on(pdmesh_integration::eventually(
        Duration::from_secs(20),
        "every fuzzed reservation's blocks are freed",
        || async {
            let mut d = DecodeClient::new(ch(&decode).await);
            let s = d.stats(StatsRequest {}).await.unwrap().into_inner();
            s.reserved == 0 && s.load.unwrap().committed_blocks == 0
        },
    ));
}
