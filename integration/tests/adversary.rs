//! The mesh against callers who try to take what is not theirs, with real processes and the
//! real model: each test plays the attacker, asserts the precise status it gets, and checks
//! that honest work alongside it is unharmed. Attackers hold real certificates of the mesh's
//! CA where the hole needs one (a compromised node), or only what a client has.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use pdmesh_common::apikey::Tenant;
use pdmesh_common::tls::MeshRole;
use pdmesh_integration::cluster::pki;
use pdmesh_integration::{Cluster, collect, eventually, greedy};
use pdmesh_kv_types::BlockHasher;
use pdmesh_kv_ucx::descriptor::{self, UcxTarget};
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::kv_chunk::Chunk as PushChunk;
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::kv_write_chunk::Chunk;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{
    CancelRequest, DecodeRequest, GenerateRequest, HeartbeatRequest, KvBlocks, KvChunk, KvEnd,
    KvHeader, KvMatchRequest, KvReadRequest, KvReleaseMatchRequest, KvStoreBlock, KvWriteChunk,
    KvWriteHeader, NodeLoad, RegisterRequest, ReleaseRequest, ReserveRequest, Role, SamplerState,
    decode_request, generate_response,
};
use tonic::Code;
use tonic::transport::Channel;

/// A channel to `addr` holding a real certificate of the mesh for `name` in `role`.
async fn as_node(c: &Cluster, addr: &str, name: &str, role: MeshRole) -> Channel {
    c.endpoint_as(addr, &pki().identity(name, role)).connect().await.unwrap()
}

/// Clusters are heavy on two cores: one test at a time in this binary.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const WAIT: Duration = Duration::from_secs(30);

/// `wire` with its last hex digit changed: the same table key, another secret.
fn forge(wire: &str) -> String {
    let mut b = wire.as_bytes().to_vec();
    let last = b.len() - 1;
    b[last] = if b[last] == b'0' { b'1' } else { b'0' };
    String::from_utf8(b).unwrap()
}

/// Greedy tokens of one request through the router.
async fn generate(client: &mut pdmesh_integration::Client, prompt: &[u32]) -> Vec<u32> {
    generate_full(client, prompt).await.0
}

/// Greedy tokens of one request, and the prompt tokens it found cached.
async fn generate_full(client: &mut pdmesh_integration::Client, prompt: &[u32]) -> (Vec<u32>, u32) {
    let s = client.generate(greedy(prompt, 8)).await.unwrap().into_inner();
    let (toks, finished) = collect(s).await.unwrap();
    (toks, finished.expect("a finish message").usage.unwrap().cached_tokens)
}

fn attach(reservation_id: &str) -> DecodeRequest {
    DecodeRequest {
        reservation_id: reservation_id.into(),
        prompt: (0..40).map(|i| 300 + i).collect(),
        sampler: Some(SamplerState { top_p: 1.0, repetition_penalty: 1.0, ..Default::default() }),
        max_tokens: 5,
        start: Some(decode_request::Start::FirstToken(5)),
        ..Default::default()
    }
}

/// Reservation ids were 1, 2, 3…: anyone could attach to, release or push KV into another
/// request's reservation. Now a counter is not even an id, and the right key with a wrong
/// secret is answered exactly as an unknown reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessed_and_forged_reservation_ids_are_refused() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(0).decode(1).start().await;
    let mut d = c.decode_client(0).await;
    let layout = c.decode_stats(0).await.layout;
    let victim = ReserveRequest {
        request_id: "victim".into(),
        prompt_tokens: 40,
        max_tokens: 10,
        lease_ms: 60_000,
        remote_kv: false,
        owner: String::new(),
        reserve_tokens: 0,
    };
    let target = d.reserve(victim).await.unwrap().into_inner().target.unwrap();
    let id = target.reservation_id.clone();
    assert_eq!(id.len(), 32, "a reservation id is 128 bits: {id}");
    let forged = forge(&id);

    for guess in ["1", "2", "0"] {
        let e = d.decode(attach(guess)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let e = d.release(ReleaseRequest { reservation_id: guess.into() }).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let e = d.decode(attach(&forged)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(!e.message().contains(&id[16..]), "the error echoes the real secret: {e:?}");
    let r = d.release(ReleaseRequest { reservation_id: forged.clone() }).await.unwrap();
    assert!(!r.into_inner().released, "a forged id released the reservation");
    // Pushing KV into it takes a prefill node's certificate: the router's is refused, and a
    // (compromised) prefill node still needs the reservation's secret.
    let mut as_prefill =
        DecodeClient::new(as_node(&c, &c.decodes[0].addr, "p", MeshRole::Prefill).await);
    let header = KvChunk {
        chunk: Some(PushChunk::Header(KvHeader {
            reservation_id: forged,
            layout,
            prefill_node: "mallory".into(),
            traceparent: String::new(),
            grant: 0,
        })),
    };
    let e = d.push_kv(tokio_stream::iter([header.clone()])).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = as_prefill.push_kv(tokio_stream::iter([header])).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // Nor can a prefill node do the router's part: attach, release, reserve.
    let e = as_prefill.decode(attach(&id)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = as_prefill.release(ReleaseRequest { reservation_id: id.clone() }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    // Even the holder is held to the bounds the router checks: a decode node re-checks them.
    let mut flood = attach(&id);
    flood.stop = (0..1000).map(|i| format!("stop{i}")).collect();
    let e = d.decode(flood).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mut huge = attach(&id);
    huge.stop = vec!["x".repeat(1 << 20)];
    let e = d.decode(huge).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // The victim's reservation is untouched: still reserved, and its holder releases it.
    assert_eq!(c.decode_stats(0).await.reserved, 1);
    let r = d.release(ReleaseRequest { reservation_id: id }).await.unwrap();
    assert!(r.into_inner().released);
    eventually(WAIT, "blocks free", || async {
        let l = c.decode_stats(0).await.load.unwrap();
        l.committed_blocks == 0
    })
    .await;
}

/// Only nodes join, each only as itself: the router's certificate may not register, a prefill
/// node may not register as a decode node or under another's name, nor heartbeat for one
/// (a spoofed `free_blocks = 0` would refuse every client; a dead node's would keep it
/// placed). A node of another model is refused (its tokens would be wrong answers); a node
/// claiming a 2^32-block prefix cache no longer makes the router allocate it and abort.
/// Honest requests before, during and after give the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_refuses_another_model_and_survives_a_huge_cache_claim() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).start().await;
    c.wait_nodes(1, 1).await;
    let mut client = c.client().await;
    let prompt: Vec<u32> = (0..48).map(|i| 400 + i * 3).collect();
    let want = generate(&mut client, &prompt).await;

    let real = c.nodes().await.into_iter().find(|n| n.role == Role::Prefill as i32).unwrap();
    let internal = c.router.internal.clone().unwrap();
    let register = |node_id: &str, role: Role, load: Option<NodeLoad>| RegisterRequest {
        node_id: node_id.into(),
        role: role as i32,
        address: real.address.clone(),
        layout: real.layout.clone(),
        load,
    };
    // The public port does not serve membership at all, even to a node.
    let mut public =
        MembershipClient::new(as_node(&c, &c.router.addr, "mallory", MeshRole::Prefill).await);
    let e = public.register(register("mallory", Role::Prefill, None)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    // A router's certificate is not a node's.
    let mut as_router = MembershipClient::new(c.channel(&internal).await);
    let e = as_router.register(register("router", Role::Prefill, None)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Mallory holds a real prefill certificate, in her own name.
    let mut mallory =
        MembershipClient::new(as_node(&c, &internal, "mallory", MeshRole::Prefill).await);
    for (id, role) in [("prefill-0", Role::Prefill), ("mallory", Role::Decode)] {
        let e = mallory.register(register(id, role, None)).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{id} as {role:?}: {e:?}");
    }
    let full = NodeLoad { free_blocks: 0, ..Default::default() };
    let e = mallory
        .heartbeat(HeartbeatRequest { node_id: "decode-0".into(), load: Some(full) })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(generate(&mut client, &prompt).await, want, "a spoofed heartbeat took effect");
    // A certificate of another role that carries the node's name (a KV-store or an admin
    // named "decode-0") spoke for the node in heartbeats and departures: the name was
    // checked, the role was not.
    for role in [MeshRole::KvStore, MeshRole::Prefill] {
        let mut twin = MembershipClient::new(as_node(&c, &internal, "decode-0", role).await);
        let r = HeartbeatRequest { node_id: "decode-0".into(), load: Some(full) };
        let e = twin.heartbeat(r).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{role} heartbeat: {e:?}");
        let r = pdmesh_proto::v1::DeregisterRequest {
            node_id: "decode-0".into(),
            reason: "gone".into(),
        };
        let e = twin.deregister(r).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{role} deregister: {e:?}");
    }
    assert!(c.nodes().await.iter().any(|n| n.node_id == "decode-0"), "the decode node left");
    assert_eq!(generate(&mut client, &prompt).await, want, "a twin's heartbeat took effect");

    let mut m =
        MembershipClient::new(as_node(&c, &internal, "other-model", MeshRole::Prefill).await);
    let mut other = real.layout.clone().unwrap();
    other.model_fingerprint ^= 1;
    let e = m
        .register(RegisterRequest {
            node_id: "other-model".into(),
            role: Role::Prefill as i32,
            address: real.address.clone(),
            layout: Some(other),
            load: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(c.nodes().await.iter().all(|n| n.node_id != "other-model"));

    // The liar sits at the real node's address, so requests placed on it are served; it keeps
    // its claim fresh while honest requests run.
    let huge = NodeLoad { cache_blocks: u32::MAX, ..Default::default() };
    let mut m = MembershipClient::new(as_node(&c, &internal, "liar", MeshRole::Prefill).await);
    m.register(RegisterRequest {
        node_id: "liar".into(),
        role: Role::Prefill as i32,
        address: real.address.clone(),
        layout: real.layout,
        load: Some(huge),
    })
    .await
    .unwrap();
    let mut hb = m.clone();
    let beat = tokio::spawn(async move {
        loop {
            let r = HeartbeatRequest { node_id: "liar".into(), load: Some(huge) };
            let _ = hb.heartbeat(r).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    for i in 0..4u32 {
        let p: Vec<u32> = prompt.iter().map(|t| t + i).collect();
        let got = generate(&mut client, &p).await;
        assert_eq!(got.len(), 8);
    }
    assert_eq!(generate(&mut client, &prompt).await, want);
    beat.abort();
    assert!(c.router.is_running_ref(), "the router died");
}

/// KV-store leases were 1, 2, 3…: any caller could read another's matched blocks or unpin
/// them. A lease is now a capability like a reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvstore_leases_cannot_be_guessed_or_forged() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(0).decode(1).kvstore().start().await;
    let layout = c.decode_stats(0).await.layout.unwrap();
    let store = c.kvstore.as_ref().unwrap();
    let ch = as_node(&c, &store.addr, "p", MeshRole::Prefill).await;
    let mut k = KvStoreClient::new(ch).max_decoding_message_size(64 << 20);
    let domain = pdmesh_proto::layout_from_wire(&layout).unwrap();
    let tokens: Vec<u32> = (0..32).map(|i| 700 + i).collect();
    let chain = BlockHasher::new(&domain).unwrap().chain(&tokens);
    let data = Bytes::from(vec![9u8; domain.bytes_per_block()]);
    let mut msgs = vec![KvWriteChunk {
        chunk: Some(Chunk::Header(KvWriteHeader {
            layout: Some(layout.clone()),
            from: "t".into(),
        })),
    }];
    msgs.extend(chain.iter().map(|h| KvWriteChunk {
        chunk: Some(Chunk::Block(KvStoreBlock {
            hash: Bytes::copy_from_slice(&h.to_bytes()),
            data: data.clone(),
        })),
    }));
    // Only prefill nodes fill the store: the router's certificate (the harness's) may not.
    let mut as_router = KvStoreClient::new(c.channel(&store.addr).await);
    let e = as_router.write(tokio_stream::iter(msgs.clone())).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let mut twice = msgs.clone();
    assert_eq!(k.write(tokio_stream::iter(msgs)).await.unwrap().into_inner().stored, 2);
    // A write that repeats a block is not a chain.
    twice.push(twice[1].clone());
    let e = k.write(tokio_stream::iter(twice)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let hashes = chain.iter().map(|h| Bytes::copy_from_slice(&h.to_bytes())).collect();
    let m = k
        .r#match(KvMatchRequest {
            layout: Some(layout),
            hashes,
            lease_ms: 60_000,
            transports: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((m.blocks, m.lease.len()), (2, 32), "lease {:?}", m.lease);

    for guess in ["1", "2"] {
        let e = k.read(KvReadRequest { lease: guess.into() }).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let e = k.release_match(KvReleaseMatchRequest { lease: guess.into() }).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let forged = forge(&m.lease);
    let e = k.read(KvReadRequest { lease: forged.clone() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let r = k.release_match(KvReleaseMatchRequest { lease: forged }).await.unwrap();
    assert!(!r.into_inner().released, "a forged lease unpinned the blocks");
    // The holder still reads its blocks, then releases them.
    let mut s = k.read(KvReadRequest { lease: m.lease.clone() }).await.unwrap().into_inner();
    let mut n = 0;
    while let Some(b) = s.message().await.unwrap() {
        assert_eq!(b.data, data);
        n += 1;
    }
    assert_eq!(n, 2);
    let r = k.release_match(KvReleaseMatchRequest { lease: m.lease }).await.unwrap();
    assert!(r.into_inner().released);
}

/// The router dies between "the KV arrived" and "attach the request": nobody will ever
/// attach. The reservation must not hold its blocks forever: completing the KV re-arms the
/// node's lease, and its expiry frees them. (We play the router and a prefill node, and
/// vanish.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_that_no_request_ever_attaches_to_is_freed() {
    let _serial = SERIAL.lock().await;
    let c =
        Cluster::builder().prefill(0).decode(1).decode_args(&["--lease-ms", "500"]).start().await;
    let mut d = c.decode_client(0).await;
    let layout = c.decode_stats(0).await.layout.unwrap();
    let bpb = pdmesh_proto::layout_from_wire(&layout).unwrap().bytes_per_block();
    let r = ReserveRequest {
        request_id: "orphaned".into(),
        prompt_tokens: 40,
        max_tokens: 8,
        lease_ms: 60_000,
        remote_kv: false,
        owner: String::new(),
        reserve_tokens: 0,
    };
    let target = d.reserve(r).await.unwrap().into_inner().target.unwrap();
    let blocks = target.blocks as usize;
    let data = vec![0u8; blocks * bpb];
    let checksums = data.chunks(bpb).map(pdmesh_kv_types::block_checksum).collect();
    let msgs = [
        PushChunk::Header(KvHeader {
            reservation_id: target.reservation_id,
            layout: Some(layout),
            prefill_node: "router-that-dies".into(),
            traceparent: String::new(),
            grant: 0,
        }),
        PushChunk::Blocks(KvBlocks { first_block: 0, data: data.into() }),
        PushChunk::End(KvEnd { blocks: blocks as u32, checksums, bytes: 0 }),
    ]
    .map(|c| KvChunk { chunk: Some(c) });
    let mut p = DecodeClient::new(as_node(&c, &c.decodes[0].addr, "p", MeshRole::Prefill).await);
    p.push_kv(tokio_stream::iter(msgs)).await.unwrap();
    let s = c.decode_stats(0).await;
    assert!(s.load.unwrap().committed_blocks > 0, "the KV is held for its request");
    eventually(WAIT, "the orphaned KV's lease to free it", || async {
        let s = c.decode_stats(0).await;
        s.leases_expired == 1 && s.load.unwrap().committed_blocks == 0
    })
    .await;
}

/// The public API by API key: a tenant cancels only its own requests (another tenant's id is
/// as unknown as one never used, and its request runs on), and a tenant over its own
/// in-flight limit is refused while other tenants are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_cancel_only_their_own_and_hold_only_their_share() {
    let _serial = SERIAL.lock().await;
    let limited = Tenant {
        tenant: "small".into(),
        max_in_flight: Some(1),
        cache_group: None,
        kv_policy: None,
        default_model: None,
    };
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .tenant(Tenant {
            tenant: "alice".into(),
            max_in_flight: None,
            cache_group: None,
            kv_policy: None,
            default_model: None,
        })
        .tenant(limited)
        .start()
        .await;
    let (mut alice, mut bob) = (c.client_as("alice").await, c.client().await);
    let ids: Vec<u32> = (0..40).map(|i| 900 + i).collect();
    let long = GenerateRequest { request_id: "shared-name".into(), ..greedy(&ids, 200) };
    let mut s = alice.generate(long.clone()).await.unwrap().into_inner();
    s.message().await.unwrap();
    // Bob guesses the id: not his, so not found, and Alice's request goes on.
    let e = bob.cancel(CancelRequest { request_id: "shared-name".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // Ids are per tenant: Bob may use the same one for a request of his own.
    let mut short = long.clone();
    short.max_tokens = 2;
    let mut b = bob.generate(short).await.unwrap().into_inner();
    while b.message().await.unwrap().is_some() {}
    let (mut n, mut cancelled) = (0, false);
    let mut reason = None;
    while let Some(m) = s.message().await.unwrap() {
        match m.event {
            Some(generate_response::Event::Delta(d)) => n += d.token_ids.len(),
            Some(generate_response::Event::Finished(f)) => reason = Some(f.reason),
            _ => {}
        }
        if n >= 20 && !cancelled {
            // Alice cancels her own.
            alice.cancel(CancelRequest { request_id: "shared-name".into() }).await.unwrap();
            cancelled = true;
        }
    }
    assert!(n < 200, "the cancel stopped it");
    assert_eq!(reason, Some(pdmesh_proto::v1::FinishReason::Cancelled as i32));

    // "small" may have one request in flight.
    let mut small = c.client_as("small").await;
    let mut first = small.generate(long.clone()).await.unwrap().into_inner();
    first.message().await.unwrap();
    let e = small.generate(long.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("small"), "{e:?}");
    // Others are not held to its limit.
    assert_eq!(generate(&mut bob, &(0..40).collect::<Vec<_>>()).await.len(), 8);
    drop(first);
}

/// The prefix cache is per tenant: a prompt Alice sent is cached for Alice, but Bob sending
/// the same prompt finds nothing cached (`cached_tokens` 0), so he learns nothing of what
/// others asked, and gets the same tokens. Tenants of one cache group share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_reveal_only_the_callers_own_prompts() {
    let _serial = SERIAL.lock().await;
    let group = |name: &str| Tenant {
        tenant: name.into(),
        max_in_flight: None,
        cache_group: Some("shared-system-prompt".into()),
        kv_policy: None,
        default_model: None,
    };
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .kvstore()
        .tenant(Tenant {
            tenant: "alice".into(),
            max_in_flight: None,
            cache_group: None,
            kv_policy: None,
            default_model: None,
        })
        .tenant(group("carol"))
        .tenant(group("dave"))
        .start()
        .await;
    let (mut alice, mut bob) = (c.client_as("alice").await, c.client().await);
    let secret: Vec<u32> = (0..96).map(|i| 1000 + 7 * i).collect();
    let (want, cached) = generate_full(&mut alice, &secret).await;
    assert_eq!(cached, 0);
    let (again, cached) = generate_full(&mut alice, &secret).await;
    assert!(cached >= 64, "Alice's own prefix is cached for her: {cached}");
    assert_eq!(again, want);
    let (bobs, cached) = generate_full(&mut bob, &secret).await;
    assert_eq!(cached, 0, "Bob saw Alice's prompt in the cache");
    assert_eq!(bobs, want);
    // Carol and Dave share a group: Dave finds Carol's prefix.
    let (carols, _) = generate_full(&mut c.client_as("carol").await, &secret).await;
    let (daves, cached) = generate_full(&mut c.client_as("dave").await, &secret).await;
    assert!(cached >= 64, "a cache group shares: {cached}");
    assert_eq!((carols, daves), (want.clone(), want));
}

/// CPU time (user + system) of a process so far, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = stat.rsplit_once(')').unwrap().1;
    let f: Vec<u64> =
        after.split_whitespace().skip(11).take(2).map(|v| v.parse().unwrap()).collect();
    f[0] + f[1]
}

/// Sends a whole scrape on a fresh connection and returns the status line.
async fn scrape(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).lines().next().unwrap_or_default().to_string()
}

/// `/metrics` under attack, on real processes. Slowloris: more connections than the port
/// serves at once, each sending half a request and nothing more; the gRPC API is unaffected
/// and an honest scrape is served once the header timeout cuts the slow ones. Exhaustion: a
/// process whose file descriptors are all taken by idle connections fails to accept, backs
/// off instead of spinning on EMFILE, and serves again once they close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_port_survives_slowloris_and_fd_exhaustion() {
    use tokio::io::AsyncWriteExt;
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(0).decode(1).metrics().start().await;
    let metrics = c.router.metrics.clone().unwrap();
    let mut slow = Vec::new();
    for _ in 0..40 {
        let mut s = tokio::net::TcpStream::connect(&metrics).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        slow.push(s);
    }
    let mut client = c.client().await;
    let t = std::time::Instant::now();
    assert_eq!(generate(&mut client, &(0..40).collect::<Vec<_>>()).await.len(), 8);
    assert!(t.elapsed() < Duration::from_secs(10), "gRPC waited on the metrics port");
    let honest = tokio::time::timeout(Duration::from_secs(20), scrape(&metrics)).await;
    assert_eq!(honest.expect("an honest scrape is served").split(' ').nth(1), Some("200"));
    drop(slow);

    // A KV-store with 64 file descriptors, its gRPC port flooded with idle connections.
    let model = pdmesh_integration::model_path().display().to_string();
    let args: Vec<String> = [
        "--insecure",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--model",
        &model,
        "--kv-transport",
        "grpc",
        "--budget-bytes",
        "10000000",
    ]
    .map(String::from)
    .to_vec();
    let store =
        pdmesh_integration::cluster::Service::start_with_fd_limit("kvstore", "kvstore", &args, 64);
    let mut flood = Vec::new();
    for _ in 0..150 {
        match tokio::net::TcpStream::connect(&store.addr).await {
            Ok(s) => flood.push(s),
            Err(_) => break,
        }
    }
    // The kernel completes connections into the backlog; the process accepts them until it
    // has no descriptor left.
    let pid = store.pid();
    let fds = || std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    eventually(WAIT, "the store out of descriptors", || async { fds() >= 64 }).await;
    // The descriptors really are gone: a new caller is not served.
    let stats = async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", store.addr))
            .unwrap()
            .connect()
            .await?;
        KvStoreClient::new(ch).stats(pdmesh_proto::v1::StatsRequest {}).await.map_err(Into::into)
    };
    let served: Result<_, Box<dyn std::error::Error + Send + Sync>> =
        match tokio::time::timeout(Duration::from_secs(2), stats).await {
            Ok(r) => r,
            Err(e) => Err(e.into()),
        };
    assert!(served.is_err(), "the store still had descriptors to serve a new caller");
    let before = cpu_ticks(store.pid());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent = cpu_ticks(store.pid()) - before;
    // Spinning on EMFILE takes a whole core: ~200 ticks in 2 s.
    assert!(spent < 60, "the store spent {spent} ticks of CPU in 2 s with no fds left");
    drop(flood);
    let addr = store.addr.clone();
    eventually(WAIT, "the store serves gRPC again", || async {
        let Ok(ch) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
        else {
            return false;
        };
        KvStoreClient::new(ch).stats(pdmesh_proto::v1::StatsRequest {}).await.is_ok()
    })
    .await;
    let m = store.metrics.clone().unwrap();
    eventually(WAIT, "the store serves /metrics again", || async {
        tokio::time::timeout(Duration::from_secs(2), scrape(&m))
            .await
            .is_ok_and(|l| l.contains("200"))
    })
    .await;
}

/// Reserve in a loop with the longest lease (a router gone rogue): the node fills, says
/// RESOURCE_EXHAUSTED at once rather than queueing, and caps every lease at its own maximum;
/// an honest request waits at the router for room (never served from the full pool) and is
/// served with the same tokens once the flood's leases lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_flood_is_refused_and_lapses() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .env("PDMESH_DECODE_MAX_LEASE_MS", "1500")
        .decode_args(&["--lease-ms", "1000", "--kv-blocks", "64"])
        .start()
        .await;
    let mut client = c.client().await;
    let prompt: Vec<u32> = (0..40).map(|i| 300 + i).collect();
    let want = generate(&mut client, &prompt).await;
    let mut d = c.decode_client(0).await;
    let mut held = 0;
    let refused = loop {
        let r = ReserveRequest {
            request_id: format!("flood-{held}"),
            prompt_tokens: 40,
            max_tokens: 8,
            lease_ms: 300_000,
            remote_kv: true,
            owner: String::new(),
            reserve_tokens: 0,
        };
        match d.reserve(r).await {
            Ok(r) => {
                assert!(r.into_inner().lease_ms <= 1500, "a lease past the node's maximum");
                held += 1;
                assert!(held < 1000, "the pool never filled");
            }
            Err(e) => break e,
        }
    };
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(held > 0);
    // An honest request waits for room rather than being refused: one that cannot wait for
    // the flood's leases to lapse ends at its deadline, never served from a full pool...
    let mut r = tonic::Request::new(greedy(&prompt, 8));
    r.set_timeout(Duration::from_millis(300));
    let e = match client.generate(r).await {
        Err(e) => e,
        Ok(s) => collect(s.into_inner()).await.expect_err("served while the pool was full"),
    };
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("queued"), "{e:?}");
    // ...and one that can is served once they lapse, with the same tokens.
    let s = client.generate(greedy(&prompt, 8)).await.unwrap();
    let (toks, _) = collect(s.into_inner()).await.expect("served once the flood lapsed");
    assert_eq!(toks, want);
}

/// The first status of a Prefill call: its own, or the stream's first error.
async fn prefill_status(
    p: &mut pdmesh_proto::v1::prefill_client::PrefillClient<Channel>,
    target: pdmesh_proto::v1::KvTarget,
) -> Result<(), tonic::Status> {
    let req = pdmesh_proto::v1::PrefillRequest {
        request_id: "forged".into(),
        prompt: (0..40).map(|i| 300 + i).collect(),
        sampler: Some(SamplerState { top_p: 1.0, repetition_penalty: 1.0, ..Default::default() }),
        target: Some(target),
        cache_salt: Bytes::new(),
    };
    let mut s = p.prefill(req).await?.into_inner();
    while s.message().await?.is_some() {}
    Ok(())
}

/// UCX access is scoped to one reservation: its prompt's blocks alone are registered, for
/// remote write, under keys of its own. A router gone rogue assembles targets from two
/// reservations — another's block addresses under its own ranges, another's ranges and keys
/// under its own reservation, a range stretched over the pool, bytes that are no descriptor,
/// another transport's name — and the prefill node (which
/// checks every address against the ranges) or the decode node (which accepts a session only
/// for the memory it granted that reservation) refuses each before a byte moves. The victim's
/// reservation is untouched, and honest requests give the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_ucx_targets_are_refused_before_a_byte_moves() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).transport("ucx").start().await;
    let mut client = c.client().await;
    let prompt: Vec<u32> = (0..40).map(|i| 300 + i).collect();
    let want = generate(&mut client, &prompt).await;
    let mut d = c.decode_client(0).await;
    let reserve = |id: &str| ReserveRequest {
        request_id: id.into(),
        prompt_tokens: 40,
        max_tokens: 8,
        lease_ms: 60_000,
        remote_kv: true,
        owner: String::new(),
        reserve_tokens: 0,
    };
    let victim = d.reserve(reserve("victim")).await.unwrap().into_inner().target.unwrap();
    let mine = d.reserve(reserve("mallory")).await.unwrap().into_inner().target.unwrap();
    let open = |t: &pdmesh_proto::v1::KvTarget| -> UcxTarget {
        descriptor::open(t.remote.as_ref().unwrap()).unwrap()
    };
    let (vu, mu) = (open(&victim), open(&mine));
    assert_ne!(vu.ranges, mu.ranges, "each reservation has its own keys");
    let mut p =
        pdmesh_proto::v1::prefill_client::PrefillClient::new(c.channel(&c.prefills[0].addr).await);

    // The victim's addresses under Mallory's ranges: outside every range she holds.
    let mut t = mine.clone();
    t.remote =
        Some(descriptor::wrap(&UcxTarget { block_addrs: vu.block_addrs.clone(), ..mu.clone() }));
    let e = prefill_status(&mut p, t).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("outside every range"), "{e:?}");
    // The victim's ranges, keys and addresses under Mallory's reservation: the decode node
    // granted her reservation other memory.
    let mut t = mine.clone();
    t.remote = Some(descriptor::wrap(&vu));
    let e = prefill_status(&mut p, t).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Her own key with its range stretched over the whole pool.
    let mut t = mine.clone();
    let mut u = mu.clone();
    u.ranges.truncate(1);
    u.ranges[0].base = 0;
    u.ranges[0].len = u64::MAX / 2;
    t.remote = Some(descriptor::wrap(&u));
    let e = prefill_status(&mut p, t).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Bytes that are no UCX descriptor at all, under UCX's name: refused as a bad target.
    let mut t = mine.clone();
    t.remote.as_mut().unwrap().sealed = Bytes::from_static(&[0xff; 7]);
    let e = prefill_status(&mut p, t).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("malformed"), "{e:?}");
    // A descriptor of a transport this prefill node does not run: with kv_transport = ucx
    // there is no endpoint to use, and it says so.
    let mut t = mine.clone();
    t.remote.as_mut().unwrap().transport = "nixl".into();
    let e = prefill_status(&mut p, t).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    // Nothing reached the victim: still reserved, never transferring, released by its holder.
    let s = c.decode_stats(0).await;
    assert_eq!(s.reserved, 2, "{s:?}");
    let r = d.release(ReleaseRequest { reservation_id: victim.reservation_id }).await.unwrap();
    assert!(r.into_inner().released);
    d.release(ReleaseRequest { reservation_id: mine.reservation_id }).await.unwrap();
    assert_eq!(generate(&mut client, &prompt).await, want);
}

/// Sockets from `from` (a loopback address of its own) to `to` that connect and never say a
/// word: a TLS handshake each server side, never finished.
async fn stalled(from: &str, to: &str, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{from}:0").parse().unwrap()).unwrap();
        held.push(s.connect(to.parse().unwrap()).await.unwrap());
    }
    held
}

/// The handshake cap was one per listener (256, 10 s each): about 26 sockets a second that
/// never speak, from one address and with no certificate, kept every slot full, and then no
/// one connected — clients to the public port, nodes to the router's internal one. Now one
/// address holds its own share of the handshakes (and of the connections) and no more: with
/// 300 stalled sockets from 127.0.0.2 on each port, a client from 127.0.0.1 is served at
/// once, and a node still reaches membership.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_from_one_address_lock_no_one_else_out() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).start().await;
    c.wait_nodes(1, 1).await;
    let prompt: Vec<u32> = (0..24).map(|i| 500 + i).collect();
    let want = generate(&mut c.client().await, &prompt).await;
    let internal = c.router.internal.clone().unwrap();
    let mut held = stalled("127.0.0.2", &c.router.addr, 300).await;
    held.extend(stalled("127.0.0.2", &internal, 300).await);
    // Each of these is a new connection, well within the stalled sockets' 10 s.
    let t0 = std::time::Instant::now();
    let served = tokio::time::timeout(Duration::from_secs(5), async {
        generate(&mut c.client().await, &prompt).await
    })
    .await
    .expect("a client from another address is served while the sockets stall");
    assert_eq!(served, want);
    let mut ops = MembershipClient::new(as_node(&c, &internal, "ops", MeshRole::Admin).await);
    let nodes = ops.list_nodes(pdmesh_proto::v1::ListNodesRequest {}).await.unwrap();
    assert_eq!(nodes.into_inner().nodes.len(), 2);
    assert!(t0.elapsed() < Duration::from_secs(8), "served only once the stalls timed out");
    drop(held);
    assert!(c.router.is_running_ref(), "the router died");
}
