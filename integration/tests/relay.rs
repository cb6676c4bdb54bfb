//! The router's request path on an in-process mesh of the real services and the tiny model
//! (seconds, not minutes): requests flow through the library API and the gRPC adapter with the
//! tokens one engine gives, an unreachable node before the first token is retried elsewhere, a
//! failure after it is not, and a node whose engine thread dies leaves the mesh at once — its
//! requests fail with a status naming it and no more work goes to it.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_common::apikey::Tenant;
use pdmesh_engine::testing::{BuildModel, TinyModel};
use pdmesh_engine::{Engine, EngineConfig, GenerateParams, SamplingParams};
use pdmesh_integration::eventually;
use pdmesh_integration::inprocess::{Mesh, Settings};
use pdmesh_proto::v1::generate_response::Event as Wire;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{
    FinishReason, Finished, GenerateRequest, GenerateResponse, RegisterRequest, Role, TokenIds,
    generate_request,
};
use pdmesh_router::api::{Event, Router};
use pdmesh_router::request::Prepared;
use tonic::Code;

#[path = "relay/models.rs"]
mod models;
#[path = "relay/window.rs"]
mod window;

fn prompt() -> Vec<u32> {
    (0..21u32).map(|i| 33 + (i * 11) % 150).collect()
}

fn req(max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: prompt() })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// What one engine generates for `prompt()`, greedily.
fn reference(n: usize) -> Vec<u32> {
    let cfg = EngineConfig { threads: 1, kv_blocks: 64, ..Default::default() };
    let mut e = Engine::new(TinyModel::default().build(), cfg).unwrap();
    let p = GenerateParams { max_tokens: n, ignore_eos: true, ..Default::default() };
    pdmesh_engine::generate(&mut e, &prompt(), &p, |_| true).unwrap().tokens
}

/// Runs a request to its end: its tokens and `Finished`, or its status.
async fn generate(m: &Mesh, r: GenerateRequest) -> Result<(Vec<u32>, Finished), tonic::Status> {
    let mut s = m.client().await.generate(r).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(GenerateResponse { event }) = s.message().await? {
        match event {
            Some(Wire::Delta(d)) => tokens.extend(d.token_ids),
            Some(Wire::Finished(f)) => return Ok((tokens, f)),
            _ => {}
        }
    }
    panic!("the stream ended without a finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_give_one_engines_tokens_disaggregated_and_colocated() {
    let want = reference(12);
    let m = Settings::new(1, 1).start().await;
    let (tokens, f) = generate(&m, req(12)).await.unwrap();
    assert_eq!(tokens, want, "disaggregated");
    let t = f.timings.unwrap();
    assert_eq!(
        (t.prefill_node.as_str(), t.decode_node.as_str(), t.attempts),
        ("prefill-0", "decode-0", 1)
    );
    assert_eq!(f.reason, FinishReason::Length as i32);
    // Without a prefill node the decode node prefills it itself: the same tokens.
    let m = Settings::new(0, 1).start().await;
    let (tokens, f) = generate(&m, req(12)).await.unwrap();
    assert_eq!(tokens, want, "colocated");
    assert_eq!(f.timings.unwrap().prefill_node, "colocated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_api_yields_plain_events() {
    let m = Settings::new(1, 1).start().await;
    // A second router, as a library: its mesh knows the same nodes.
    let model = TinyModel::default().card();
    let mesh =
        Arc::new(pdmesh_router::mesh::Mesh::new(Default::default(), vec![("tiny".into(), model)]));
    for n in m.nodes().await {
        let layout = pdmesh_proto::layout_from_wire(&n.layout.unwrap()).unwrap();
        let role = Role::try_from(n.role).unwrap();
        mesh.registry().register(
            &n.node_id,
            role,
            &n.address,
            layout,
            n.load.unwrap(),
            Instant::now(),
        );
    }
    let router = Router::new(mesh);
    let prep = Prepared {
        prompt: prompt(),
        max_tokens: 8,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        ignore_eos: true,
        kv_policy: None,
        model: String::new(),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    // A request that stays in flight while the dup check runs: its reader reads nothing, so
    // its stream stops at the client buffer long before 200 tokens (an 8-token one could
    // finish between the two calls on a loaded machine, and the id would be free again).
    let held = Prepared { max_tokens: 200, ..prep.clone() };
    let (_, mut held_events) = router
        .generate(Some("lib-held".into()), held.clone(), deadline, tracing::Span::none())
        .unwrap();
    let dup = router.generate(Some("lib-held".into()), held, deadline, tracing::Span::none());
    assert_eq!(dup.unwrap_err().code(), Code::AlreadyExists, "one id, one request");
    assert!(router.cancel(&Tenant::anonymous(), "lib-held"), "still running");
    let mut last = None;
    while let Some(ev) = held_events.recv().await {
        last = Some(ev.unwrap());
    }
    match last {
        Some(Event::Finished(f)) => {
            assert_eq!(f.reason, pdmesh_engine::FinishReason::Cancelled)
        }
        other => panic!("the held request ended with {other:?}"),
    }
    let (id, mut events) =
        router.generate(Some("lib-1".into()), prep, deadline, tracing::Span::none()).unwrap();
    assert_eq!(id, "lib-1");
    let mut tokens = Vec::new();
    let mut seen = Vec::new();
    while let Some(ev) = events.recv().await {
        match ev.unwrap() {
            Event::Started { request_id, prompt_tokens, .. } => {
                assert_eq!((request_id.as_str(), prompt_tokens), ("lib-1", 21));
                seen.push("started");
            }
            Event::Delta { tokens: t, .. } => tokens.extend(t),
            Event::Finished(f) => {
                assert_eq!(f.reason, pdmesh_engine::FinishReason::Length);
                assert_eq!(f.usage.completion_tokens, 8);
                seen.push("finished");
            }
        }
    }
    assert_eq!(seen, ["started", "finished"]);
    assert_eq!(tokens, reference(8));
}

/// Registers a prefill node at an address where nothing listens.
async fn register_dead_prefill(m: &Mesh, id: &str) {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let nodes = m.nodes().await;
    let layout = nodes.iter().find(|n| n.role == Role::Prefill as i32).unwrap().layout.clone();
    let mut c = MembershipClient::connect(format!("http://{}", m.members)).await.unwrap();
    let reg = RegisterRequest {
        node_id: id.into(),
        role: Role::Prefill as i32,
        address: dead.to_string(),
        layout,
        load: Some(Default::default()),
    };
    c.register(reg).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_prefill_node_is_retried_on_another_before_the_first_token() {
    let mut s = Settings::new(1, 1);
    s.router.prefill_policy = pdmesh_router::placement::PrefillPolicy::RoundRobin;
    s.router.node_ttl_ms = 60_000; // only the failure can take it out of rotation
    let m = s.start().await;
    register_dead_prefill(&m, "prefill-dead").await;
    let want = reference(6);
    let mut retried = 0;
    for _ in 0..4 {
        let (tokens, f) = generate(&m, req(6)).await.unwrap();
        assert_eq!(tokens, want);
        let t = f.timings.unwrap();
        assert_eq!(t.prefill_node, "prefill-0", "the dead node never serves");
        if t.attempts == 2 {
            retried += 1;
        }
    }
    // Round-robin sends one of the first two requests there; once it failed it is suspect and
    // skipped, so exactly one request needed its retry.
    assert_eq!(retried, 1);
}

/// Two decode nodes, decode-0's engine set to die at its tenth step, well into its first
/// 16-token stream (its first text has reached the client: the tiny model's first tokens can
/// be incomplete characters, held back); heartbeats would take a minute to lapse, so only
/// deregistration can take it out quickly.
async fn dying_decode_mesh(max_migrations: u32) -> Mesh {
    let mut s = Settings::new(1, 2);
    s.router.node_ttl_ms = 60_000;
    s.router.max_migrations = max_migrations;
    s.decode[0].fault_engine_panic_at_step = Some(10);
    s.start().await
}

/// After decode-0 left: no more work goes to it, every request lands on decode-1.
async fn only_decode_1_serves(m: &Mesh) {
    eventually(Duration::from_secs(5), "decode-0 deregisters", || async {
        !m.nodes().await.iter().any(|n| n.node_id == "decode-0")
    })
    .await;
    for _ in 0..4 {
        let (tokens, f) = generate(m, req(8)).await.unwrap();
        assert_eq!(tokens, reference(8));
        assert_eq!(f.timings.unwrap().decode_node, "decode-1");
    }
}

// Which way the one request that runs into the panic recovers is a race: its node's last
// deltas and its leaving the mesh arrive on different paths. If a delta reached the client
// first, the stream moves mid-way; if none had, the request is retried from scratch. Either
// way the client sees one stream with one engine's tokens.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_decode_engine_dies_moves_and_continues_bit_identically() {
    let m = dying_decode_mesh(3).await;
    // Requests go to both decode nodes until decode-0's engine panics under one of them.
    let mut hit = 0;
    for _ in 0..6 {
        let (tokens, f) = generate(&m, req(16)).await.expect("no request fails");
        assert_eq!(tokens, reference(16));
        let t = f.timings.unwrap();
        if t.migrations > 0 || t.attempts > 1 {
            assert_eq!(t.decode_node, "decode-1", "{t:?}");
            assert!(t.migrations <= 1 && t.attempts <= 2, "{t:?}");
            hit += 1;
        }
    }
    assert_eq!(hit, 1, "exactly one stream ran into the panic");
    only_decode_1_serves(&m).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_migration_budget_a_decode_engine_death_ends_its_stream() {
    let m = dying_decode_mesh(0).await;
    let mut hit = 0;
    for _ in 0..6 {
        match generate(&m, req(16)).await {
            Ok((tokens, f)) => {
                assert_eq!(tokens, reference(16));
                let t = f.timings.unwrap();
                assert_eq!(t.migrations, 0, "a stream moved without a budget: {t:?}");
                // Retried before its first token reached the client.
                hit += usize::from(t.attempts > 1);
            }
            Err(st) => {
                assert_eq!(st.code(), Code::Unavailable, "{st:?}");
                assert!(st.message().contains("decode-0"), "the status names the node: {st:?}");
                hit += 1;
            }
        }
    }
    assert_eq!(hit, 1, "exactly one request ran into the panic");
    only_decode_1_serves(&m).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_node_whose_engine_dies_before_the_first_token_is_retried_elsewhere() {
    let mut s = Settings::new(2, 1);
    s.router.prefill_policy = pdmesh_router::placement::PrefillPolicy::RoundRobin;
    s.router.node_ttl_ms = 60_000;
    s.prefill[0].fault_engine_panic_at_step = Some(1);
    let m = s.start().await;
    let want = reference(6);
    for _ in 0..3 {
        let (tokens, f) = generate(&m, req(6)).await.unwrap();
        assert_eq!(tokens, want, "a prefill failure before the first token costs a retry only");
        assert_eq!(f.timings.unwrap().prefill_node, "prefill-1");
    }
    eventually(Duration::from_secs(5), "prefill-0 deregisters", || async {
        !m.nodes().await.iter().any(|n| n.node_id == "prefill-0")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_and_cancel_end_requests_with_their_status() {
    let mut s = Settings::new(1, 1);
    s.router.max_in_flight = 1;
    let m = s.start().await;
    let mut c = m.client().await;
    let r = GenerateRequest { request_id: "long".into(), ..req(200) };
    let mut long = c.generate(r).await.unwrap().into_inner();
    let first = long.message().await.unwrap();
    assert!(matches!(first, Some(GenerateResponse { event: Some(Wire::Started(_)) })));
    let over = generate(&m, req(4)).await.unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted);
    assert!(over.metadata().get(pdmesh_common::status::RETRY_AFTER_MS).is_some());
    // Admission comes before any work on the request: a full router refuses even a request
    // it would find invalid, without tokenizing it, and a Tokenize call too.
    let invalid = GenerateRequest { max_tokens: 1 << 30, ..req(4) };
    let e = generate(&m, invalid).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let t = pdmesh_proto::v1::TokenizeRequest {
        input: Some(pdmesh_proto::v1::tokenize_request::Input::Prompt("x ".repeat(100_000))),
    };
    let e = c.tokenize(t).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    c.cancel(pdmesh_proto::v1::CancelRequest { request_id: "long".into() }).await.unwrap();
    let mut end = None;
    while let Some(GenerateResponse { event }) = long.message().await.unwrap() {
        if let Some(Wire::Finished(f)) = event {
            end = Some(f);
        }
    }
    assert_eq!(end.unwrap().reason, FinishReason::Cancelled as i32);
    // The permit came back with the cancelled request.
    eventually(Duration::from_secs(5), "the router admits again", || async {
        generate(&m, req(4)).await.is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_node_that_leaves_after_its_part_does_not_fail_the_decode() {
    let mut s = Settings::new(1, 1);
    s.router.node_ttl_ms = 60_000;
    // The second prompt it computes kills its engine.
    s.prefill[0].fault_engine_panic_at_step = Some(2);
    // A slow decode node: A is still decoding when the prefill node goes.
    s.decode[0].fault_step_delay_ms = 20;
    let m = s.start().await;
    let mut c = m.client().await;
    let mut a = c.generate(req(100)).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    // A's first token arrived: its prefill node's part is done.
    while tokens.is_empty() {
        if let Some(GenerateResponse { event: Some(Wire::Delta(d)) }) = a.message().await.unwrap() {
            tokens.extend(d.token_ids);
        }
    }
    // B's prompt kills the prefill node's engine: B is retried without it (colocated) ...
    let (b, f) = generate(&m, req(6)).await.unwrap();
    assert_eq!(b, reference(6));
    let t = f.timings.unwrap();
    assert_eq!((t.prefill_node.as_str(), t.attempts), ("colocated", 2));
    eventually(Duration::from_secs(5), "prefill-0 deregisters", || async {
        !m.nodes().await.iter().any(|n| n.node_id == "prefill-0")
    })
    .await;
    // ... and A, which needs only its decode node now, finishes.
    let mut end = None;
    while let Some(GenerateResponse { event }) = a.message().await.unwrap() {
        match event {
            Some(Wire::Delta(d)) => tokens.extend(d.token_ids),
            Some(Wire::Finished(f)) => end = Some(f),
            _ => {}
        }
    }
    assert_eq!(end.unwrap().reason, FinishReason::Length as i32);
    assert_eq!(tokens, reference(100));
}

/// Tokens of a request that takes a quarter of a decode node's KV (256 blocks of 4): four
/// fit on the node at once.
const QUARTER: u32 = 256 * 4 / 4 - 21;

/// A request's tokens and finish, or its status.
type Generated = Result<(Vec<u32>, Finished), tonic::Status>;

/// `n` requests of `QUARTER` tokens sent at once, each in its own task.
fn spawn_many(m: &Arc<Mesh>, n: usize) -> Vec<tokio::task::JoinHandle<Generated>> {
    (0..n)
        .map(|_| {
            let m = Arc::clone(m);
            tokio::spawn(async move { generate(&m, req(QUARTER)).await })
        })
        .collect()
}

/// A burst of three times what the decode node's KV holds: the requests that find no room
/// wait for it, first come first served, and every one finishes with one engine's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_the_kv_waits_for_room_and_all_of_it_finishes() {
    let want = reference(QUARTER as usize);
    let m = Arc::new(Settings::new(1, 1).start().await);
    let burst: Vec<_> = spawn_many(&m, 12);
    for r in burst {
        let (tokens, f) = r.await.unwrap().expect("a request of the burst failed");
        assert_eq!(tokens, want);
        assert_eq!(f.reason, FinishReason::Length as i32);
    }
}

/// Growing reservations: twelve requests that each end up taking a quarter of the decode
/// node's KV start together (each is promised its prompt and 8 tokens), outgrow the node, and
/// the youngest are preempted; each waits for room and continues, recomputed, so every one
/// finishes with one engine's tokens. Heartbeats a second apart keep the router's view of the
/// node's room stale, so a preempted request is also turned down as full: it waits again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_reservations_are_preempted_and_finish_with_the_same_tokens() {
    let want = reference(QUARTER as usize);
    let mut s = Settings::new(1, 1);
    s.router.reserve_tokens = 8;
    (s.router.heartbeat_interval_ms, s.router.node_ttl_ms) = (1_000, 5_000);
    let m = Arc::new(s.start().await);
    let burst: Vec<_> = spawn_many(&m, 12);
    let mut preemptions = 0;
    for r in burst {
        let (tokens, f) = r.await.unwrap().expect("a growing request failed");
        assert_eq!(tokens, want);
        assert_eq!(f.reason, FinishReason::Length as i32);
        preemptions += f.timings.unwrap().preemptions;
    }
    assert!(preemptions > 0, "twelve requests of a quarter each never outgrew the node");
}

/// Past `max_queued` a request is refused at once, with a retry hint; a queued request
/// whose deadline passes before room appears ends with DEADLINE_EXCEEDED saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_and_a_queued_deadline_is_kept() {
    let mut s = Settings::new(1, 1);
    s.router.max_queued = 2;
    // Each request takes ~1 s, so the burst's arrival and the short deadline below fall
    // well inside the first requests' time.
    s.decode[0].fault_step_delay_ms = 5;
    let m = Arc::new(s.start().await);
    let burst: Vec<_> = spawn_many(&m, 12);
    let (mut done, mut shed) = (0, 0);
    for r in burst {
        match r.await.unwrap() {
            Ok(_) => done += 1,
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                assert!(e.message().contains("max_queued"), "{e:?}");
                assert!(e.metadata().get(pdmesh_common::status::RETRY_AFTER_MS).is_some());
                shed += 1;
            }
        }
    }
    // Four run, two wait, the rest are shed (the first four outlast the burst's arrival).
    assert_eq!((done, shed), (6, 6), "{done} done, {shed} shed");
    // The node full again, and a request that cannot wait long enough.
    let long: Vec<_> = spawn_many(&m, 4);
    // Full as the router sees it: no room left for another quarter.
    eventually(Duration::from_secs(10), "the four fill the decode node", || async {
        m.nodes()
            .await
            .iter()
            .filter_map(|n| n.load.filter(|_| n.role == Role::Decode as i32))
            .any(|l| l.total_blocks > 0 && l.committed_blocks + l.total_blocks / 4 > l.total_blocks)
    })
    .await;
    let mut r = tonic::Request::new(req(QUARTER));
    r.set_timeout(Duration::from_millis(300));
    let e = m.client().await.generate(r).await;
    let e = match e {
        Err(e) => e,
        Ok(s) => {
            let mut s = s.into_inner();
            loop {
                match s.message().await {
                    Err(e) => break e,
                    Ok(Some(GenerateResponse { event: Some(Wire::Finished(_)) })) | Ok(None) => {
                        panic!("served in 300 ms while the node was full")
                    }
                    Ok(_) => {}
                }
            }
        }
    };
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("queued"), "{e:?}");
    for r in long {
        r.await.unwrap().expect("the long requests finish");
    }
}

/// A message that is not a `GenerateRequest` (field 1 with the wrong wire type).
#[derive(Clone, PartialEq, prost::Message)]
struct NotARequest {
    #[prost(fixed64, tag = "1")]
    x: u64,
}

/// A stranger's `Generate` was decoded before its key was checked: up to 4 MB parsed for no
/// one. Now the key is checked from the headers and the message is never read: a body that is
/// not even a request gets UNAUTHENTICATED, not a decoding error — which is what the same body
/// gets once its caller holds a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strangers_message_is_never_decoded() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    let tenant = Tenant {
        tenant: "t".into(),
        max_in_flight: None,
        cache_group: None,
        kv_policy: None,
        default_model: None,
    };
    let key = pdmesh_common::apikey::add(&keys, tenant).unwrap();
    let (_m, ch) = keyed_mesh(Settings::new(0, 1), keys).await;
    let call = |key: Option<String>| {
        let ch = ch.clone();
        async move {
            let mut g = tonic::client::Grpc::new(ch);
            g.ready().await.unwrap();
            let mut r = tonic::Request::new(NotARequest { x: 7 });
            if let Some(k) = key {
                r.metadata_mut().insert("authorization", format!("Bearer {k}").parse().unwrap());
            }
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(
                "/pdmesh.v1.Generation/Generate",
            );
            let codec = tonic_prost::ProstCodec::<NotARequest, GenerateResponse>::default();
            g.server_streaming(r, path, codec).await.map(|_| ()).unwrap_err()
        }
    };
    for key in [None, Some("pdm_0123".to_string())] {
        let e = call(key.clone()).await;
        assert_eq!(e.code(), Code::Unauthenticated, "{key:?}: {e:?}");
    }
    let e = call(Some(key)).await;
    assert_ne!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("decode"), "the keyed call's body is read: {e:?}");
}

/// `Cancel` of an id the router does not run asks every decode node, and took no place
/// anywhere: a tenant's flood of cancels of made-up ids filled every node's command queue
/// and held decoding up for everyone. Now such fan-outs are bounded, in all and per tenant:
/// the flooding tenant's third at once is refused on the spot, another tenant's still goes
/// out, and the flooder's places come back when its fan-outs end. A decode node that never
/// answers holds each fan-out for the node timeout (2 s), so the overlap is certain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_cancels_is_bounded_per_tenant() {
    use pdmesh_common::apikey::{Bearer, Tenant, add};
    use pdmesh_proto::v1::generation_client::GenerationClient;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    let tenant = |t: &str| Tenant {
        tenant: t.into(),
        max_in_flight: None,
        cache_group: None,
        kv_policy: None,
        default_model: None,
    };
    let (flooder, other) = (add(&keys, tenant("flood")).unwrap(), add(&keys, tenant("b")).unwrap());
    let mut s = Settings::new(0, 1);
    s.router.allow_anonymous = false;
    s.router.api_keys = Some(keys);
    s.router.node_ttl_ms = 60_000;
    let m = s.start().await;
    // A decode node that accepts connections and never says a word.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let layout = m.nodes().await[0].layout.clone();
    let mut members = MembershipClient::connect(format!("http://{}", m.members)).await.unwrap();
    let reg = RegisterRequest {
        node_id: "silent".into(),
        role: Role::Decode as i32,
        address: silent.local_addr().unwrap().to_string(),
        layout,
        load: Some(Default::default()),
    };
    members.register(reg).await.unwrap();
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", m.router))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let cancel = |key: &str, id: &str| {
        let bearer = Bearer::new(Some(key)).unwrap();
        let mut c = GenerationClient::with_interceptor(ch.clone(), bearer);
        let r = pdmesh_proto::v1::CancelRequest { request_id: id.into() };
        async move { c.cancel(r).await.map(|_| ()).unwrap_err().code() }
    };
    // The silent node reads what it is sent, and so sees when both fan-outs are out.
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listening = tokio::spawn(count_grpc_messages(silent, Arc::clone(&asked)));
    let held: Vec<_> =
        (0..2).map(|i| tokio::spawn(cancel(&flooder, &format!("made-up-{i}")))).collect();
    eventually(Duration::from_secs(5), "both cancels reach the silent node", || async {
        asked.load(std::sync::atomic::Ordering::Relaxed) >= 2
    })
    .await;
    let t0 = Instant::now();
    assert_eq!(cancel(&flooder, "made-up-2").await, Code::ResourceExhausted);
    assert!(t0.elapsed() < Duration::from_secs(1), "refused at once, not after the nodes");
    assert_eq!(cancel(&other, "made-up-3").await, Code::NotFound, "another tenant goes out");
    for h in held {
        assert_eq!(h.await.unwrap(), Code::NotFound);
    }
    assert_eq!(cancel(&flooder, "made-up-4").await, Code::NotFound, "its places came back");
    listening.abort();
}

/// Accepts every connection to `listener` and counts the gRPC messages with a body that arrive
/// on them (HTTP/2 DATA frames longer than gRPC's 5-byte message header: a cancel carries its
/// id; the empty probe a new channel sends does not), never answering a byte: a node that has
/// hung.
async fn count_grpc_messages(
    listener: tokio::net::TcpListener,
    asked: Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::AsyncReadExt;
    const PREFACE: usize = 24;
    const DATA: u8 = 0x0;
    const EMPTY_MESSAGE: usize = 5;
    let mut connections = tokio::task::JoinSet::new();
    while let Ok((mut tcp, _)) = listener.accept().await {
        let asked = Arc::clone(&asked);
        connections.spawn(async move {
            let mut preface = [0u8; PREFACE];
            if tcp.read_exact(&mut preface).await.is_err() {
                return;
            }
            let mut head = [0u8; 9];
            while tcp.read_exact(&mut head).await.is_ok() {
                let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                let mut payload = vec![0u8; len];
                if tcp.read_exact(&mut payload).await.is_err() {
                    return;
                }
                if head[3] == DATA && len > EMPTY_MESSAGE {
                    asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
    }
}

/// A client that starts a stream and never reads it (an SSE client that stops consuming)
/// held its place among the requests in flight, and its KV, until the deadline (600 s by
/// default). Now a client that makes no room for `client_stall_ms` is treated as gone: the
/// request ends, and its place comes back, long before the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_lets_go_of_its_place() {
    let m = Settings::new(1, 1).start().await;
    let model = TinyModel::default().card();
    let config = pdmesh_router::RouterConfig { client_stall_ms: 300, ..Default::default() };
    let mesh = Arc::new(pdmesh_router::mesh::Mesh::new(config, vec![("tiny".into(), model)]));
    for n in m.nodes().await {
        let layout = pdmesh_proto::layout_from_wire(&n.layout.unwrap()).unwrap();
        let role = Role::try_from(n.role).unwrap();
        let load = n.load.unwrap();
        mesh.registry().register(&n.node_id, role, &n.address, layout, load, Instant::now());
    }
    let router = Router::new(mesh);
    // More tokens than the events buffered towards a client.
    let prep = Prepared {
        prompt: prompt(),
        max_tokens: 200,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        ignore_eos: true,
        kv_policy: None,
        model: String::new(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let (_, mut events) = router.generate(None, prep, deadline, tracing::Span::none()).unwrap();
    assert_eq!(router.in_flight(), 1);
    eventually(Duration::from_secs(20), "the stalled request ends", || async {
        router.in_flight() == 0
    })
    .await;
    // What it had buffered is still there; then it ends without finishing.
    let mut tokens = 0;
    while let Some(ev) = events.recv().await {
        match ev.unwrap() {
            Event::Delta { tokens: t, .. } => tokens += t.len(),
            Event::Started { .. } => {}
            Event::Finished(f) => panic!("a stalled request finished: {f:?}"),
        }
    }
    assert!(tokens < 200, "{tokens} tokens reached a client that read none");
}

/// A colocated request's decode node sends nothing until it has prefilled the whole prompt:
/// the bound on a silent stream (`stall_timeout_ms`) counts from its first message, so a
/// prefill that outlasts it is not taken for a hung node. Measuring the 1B model's
/// 2,048-token prompt on one thread (157 s) failed every colocated request with "no token for
/// 60s".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_prefill_longer_than_the_stall_bound_is_not_a_hung_node() {
    let mut s = Settings::new(0, 1);
    s.router.stall_timeout_ms = 300;
    // 32-token chunks at 100 ms a step: 160 tokens prefill in 5 steps (500 ms and more),
    // while each later step (one token) stays well inside the bound.
    s.decode[0].fault_step_delay_ms = 100;
    let m = s.start().await;
    let ids: Vec<u32> = (0..160u32).map(|i| 33 + (i * 7) % 150).collect();
    let r = GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: ids.clone() })),
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    let (tokens, f) = generate(&m, r).await.unwrap();
    let t = f.timings.unwrap();
    assert_eq!((t.prefill_node.as_str(), t.attempts), ("colocated", 1));
    let cfg = EngineConfig { threads: 1, kv_blocks: 64, ..Default::default() };
    let mut e = Engine::new(TinyModel::default().build(), cfg).unwrap();
    let p = GenerateParams { max_tokens: 4, ignore_eos: true, ..Default::default() };
    assert_eq!(tokens, pdmesh_engine::generate(&mut e, &ids, &p, |_| true).unwrap().tokens);
}

/// A lossy KV policy through the mesh (prefill node, KV transfer, decode node): the usage
/// names it with the KV it evicted, a tenant's applies when a request names none and a
/// request's own wins, and nonsense is refused naming the field: by the router, or by the
/// decode node for a budget its blocks (4 tokens here) cannot hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_policy_is_applied_named_and_checked() {
    use pdmesh_common::apikey::{Bearer, Tenant, add};
    use pdmesh_proto::v1::generation_client::GenerationClient;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    let tenant = |t: &str, p: Option<&str>| Tenant {
        kv_policy: p.map(|p| p.parse().unwrap()),
        ..Tenant::named(t)
    };
    let plain = add(&keys, tenant("plain", None)).unwrap();
    let streaming = add(&keys, tenant("streaming", Some("sinks:16"))).unwrap();
    let (m, ch) = keyed_mesh(Settings::new(1, 1), keys).await;
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 200).collect();
    let run = |key: &str, policy: &str| {
        let mut c = GenerationClient::with_interceptor(ch.clone(), Bearer::new(Some(key)).unwrap());
        let mut r = pdmesh_integration::greedy(&ids, 24);
        r.kv_policy = policy.into();
        async move {
            let (tokens, f) =
                pdmesh_integration::collect(c.generate(r).await?.into_inner()).await?;
            Ok::<_, tonic::Status>((tokens, f.and_then(|f| f.usage).expect("a usage")))
        }
    };
    let (full, u) = run(&plain, "").await.unwrap();
    assert_eq!((u.kv_policy.as_str(), u.kv_evicted_tokens), ("", 0));
    let (sinks, u) = run(&plain, "sinks:16:4").await.unwrap();
    assert_eq!(u.kv_policy, "sinks:16:4");
    // The KV held the prompt and all but the last of 24 tokens, less 13 to 16 kept.
    let held = 40 + 23;
    assert!((held - 16..=held - 13).contains(&u.kv_evicted_tokens), "{u:?}");
    assert_eq!(full[0], sinks[0], "the first token saw the whole prompt");
    assert_ne!(full, sinks, "24 tokens past a budget of 16 changed nothing");
    let (by_tenant, u) = run(&streaming, "").await.unwrap();
    assert_eq!((u.kv_policy.as_str(), &by_tenant), ("sinks:16:4", &sinks));
    let (_, u) = run(&streaming, "h2o:16:8").await.unwrap();
    assert_eq!(u.kv_policy, "h2o:16:8");
    for bad in ["lru:16", "sinks:0", "sinks:10:4"] {
        let e = run(&plain, bad).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad}: {e:?}");
        assert!(e.message().contains("kv_policy"), "{bad}: {}", e.message());
    }
    drop(m);
}

/// A mesh that takes only the API keys in `keys`, and a channel to its router.
async fn keyed_mesh(
    mut s: Settings,
    keys: std::path::PathBuf,
) -> (Mesh, tonic::transport::Channel) {
    s.router.allow_anonymous = false;
    s.router.api_keys = Some(keys);
    let m = s.start().await;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", m.router))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (m, ch)
}
