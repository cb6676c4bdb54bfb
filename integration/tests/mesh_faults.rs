//! The mesh under cancellation, node loss, lease expiry, membership changes, bad input,
//! overload and configuration mismatch — each with real processes and the real model. Every
//! test ends by checking that no KV block is left behind.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use pdmesh_integration::{Cluster, eventually, per_transport, scrape};
use pdmesh_proto::v1::{
    CancelRequest, Chat, ChatMessage, FinishReason, Finished, GenerateRequest, GenerateResponse,
    ReserveRequest, Role, SamplingParams, TokenIds, TokenizeRequest, generate_request,
    generate_response,
};
use tonic::{Code, Streaming};

/// Clusters are heavy on two cores: one test at a time in this binary.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const WAIT: Duration = Duration::from_secs(30);

/// A prompt of `n` ordinary token ids.
fn tokens(n: usize) -> Vec<u32> {
    (0..n).map(|i| 200 + (i as u32 * 7919) % 30_000).collect()
}

fn req(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: prompt })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

async fn start(
    client: &mut pdmesh_integration::Client,
    r: GenerateRequest,
) -> Streaming<GenerateResponse> {
    client.generate(r).await.unwrap().into_inner()
}

/// Reads a stream to its end: the deltas' tokens and the finish message, or the error.
async fn finish(mut s: Streaming<GenerateResponse>) -> Result<(Vec<u32>, Finished), tonic::Status> {
    let mut toks = Vec::new();
    loop {
        match s.message().await? {
            Some(GenerateResponse { event: Some(generate_response::Event::Delta(d)) }) => {
                toks.extend(d.token_ids)
            }
            Some(GenerateResponse { event: Some(generate_response::Event::Finished(f)) }) => {
                return Ok((toks, f));
            }
            Some(_) => {}
            None => panic!("stream ended without a finish message"),
        }
    }
}

async fn next_delta(s: &mut Streaming<GenerateResponse>) {
    loop {
        match s.message().await.unwrap().unwrap().event.unwrap() {
            generate_response::Event::Delta(_) => return,
            generate_response::Event::Finished(f) => panic!("finished early: {f:?}"),
            generate_response::Event::Started(_) => {}
        }
    }
}

per_transport!(cancellation_in_every_phase_frees_every_block);

async fn cancellation_in_every_phase_frees_every_block(transport: &str) {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .transport(transport)
        // B shares A's leading blocks: with in-flight coalescing it would wait for A at the
        // router, not in the prefill node's queue this test cancels it from.
        .router_args(&["--coalesce-wait-ms", "0"])
        // One prompt at a time, in small chunks (so a second prompt is seen waiting between
        // them), with KV messages slowed so a transfer outlasts the compute.
        .prefill_args(&[
            "--max-running",
            "1",
            "--max-batch-tokens",
            "128",
            "--fault-transfer-delay-ms",
            "500",
        ])
        .start()
        .await;
    let mut client = c.client().await;

    // Queued: B waits behind A on the prefill node (one prompt at a time).
    let a = start(&mut client, req(tokens(700), 4)).await;
    eventually(WAIT, "A prefilling", || async { c.prefill_stats(0).await.prefilling == 1 }).await;
    let b = start(&mut client, req(tokens(300), 4)).await;
    eventually(WAIT, "B queued", || async { c.prefill_stats(0).await.queued == 1 }).await;
    drop(b);
    eventually(WAIT, "B dropped from the queue", || async {
        let s = c.prefill_stats(0).await;
        s.queued == 0 && s.cancelled == 1
    })
    .await;

    // Prefilling: A is still computing.
    assert_eq!(c.prefill_stats(0).await.prefilling, 1, "A finished prefill too soon");
    drop(a);
    c.wait_blocks_free().await;
    assert!(c.prefill_stats(0).await.cancelled >= 2);

    // Transferring: compute is done, KV messages are still in flight (slowed by the fault knob).
    let t = start(&mut client, req(tokens(600), 4)).await;
    eventually(WAIT, "transfer in flight", || async {
        c.prefill_stats(0).await.transferring == 1 && c.decode_stats(0).await.transferring == 1
    })
    .await;
    drop(t);
    c.wait_blocks_free().await;

    // Decoding.
    let mut d = start(&mut client, req(tokens(20), 400)).await;
    next_delta(&mut d).await;
    next_delta(&mut d).await;
    assert_eq!(c.decode_stats(0).await.decoding, 1);
    drop(d);
    c.wait_blocks_free().await;
    let s = c.decode_stats(0).await;
    assert_eq!((s.decoding, s.reserved, s.transferring), (0, 0, 0));
    // Four requests ended early. Each counts once on the decode node: as cancelled when the
    // router's release (or the closed stream) got there first, as failed when the aborted KV
    // stream did — which one wins is a race, that each counts exactly once is not.
    assert_eq!(s.cancelled + s.failed, 4, "decode node counted {s:?}");
    assert_eq!(s.completed, 0);
}

per_transport!(killed_prefill_node_is_retried_on_another);

async fn killed_prefill_node_is_retried_on_another(transport: &str) {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::builder().prefill(2).decode(1).transport(transport).start().await;
    let mut client = c.client().await;
    let s = start(&mut client, req(tokens(700), 8)).await;
    let until = Instant::now() + WAIT;
    let mut victim = None;
    while victim.is_none() {
        assert!(Instant::now() < until, "no prefill node started working");
        for i in 0..2 {
            if c.prefill_stats(i).await.prefilling == 1 {
                victim = Some(i);
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let victim = victim.unwrap();
    c.prefills[victim].kill();
    let (toks, f) = tokio::time::timeout(WAIT, finish(s)).await.expect("no hang").expect("retried");
    assert_eq!(toks.len(), 8);
    let t = f.timings.unwrap();
    assert_eq!(t.attempts, 2);
    assert_eq!(t.prefill_node, format!("prefill-{}", 1 - victim));
    c.wait_blocks_free().await;
}

/// 1 prefill + 1 decode node and one request whose KV is moving (its pieces slowed by the
/// fault knob, so the transfer outlasts the compute).
async fn transfer_in_flight(
    transport: &str,
) -> (Cluster, pdmesh_integration::Client, Streaming<GenerateResponse>) {
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .transport(transport)
        .prefill_args(&["--fault-transfer-delay-ms", "300"])
        .start()
        .await;
    let mut client = c.client().await;
    let s = start(&mut client, req(tokens(200), 4)).await;
    eventually(WAIT, "transfer in flight", || async {
        c.prefill_stats(0).await.transferring == 1 && c.decode_stats(0).await.transferring == 1
    })
    .await;
    (c, client, s)
}

per_transport!(prefill_killed_mid_transfer_fails_the_request_and_frees_the_reservation);

/// The transfer is in flight (the first token already went out, KV pieces are slowed) when the
/// prefill node dies: the decode node's reservation ends, its blocks are freed, and the client
/// gets UNAVAILABLE naming the prefill node.
async fn prefill_killed_mid_transfer_fails_the_request_and_frees_the_reservation(transport: &str) {
    let _serial = SERIAL.lock().await;
    let (mut c, _client, s) = transfer_in_flight(transport).await;
    c.prefills[0].kill();
    // Whether the first token had reached the client decides between the two correct ends:
    // it had, so the request fails naming the dead node; it had not, so it is retried once
    // elsewhere (here: prefilled on the decode node itself).
    match tokio::time::timeout(WAIT, finish(s)).await.expect("hung") {
        Err(err) => {
            assert_eq!(err.code(), Code::Unavailable, "{err:?}");
            assert!(err.message().contains("prefill-0"), "status does not name the node: {err:?}");
        }
        Ok((toks, f)) => {
            let t = f.timings.unwrap();
            assert_eq!((toks.len(), t.attempts), (4, 2), "{t:?}");
            assert_ne!(t.prefill_node, "prefill-0");
        }
    }
    c.wait_blocks_free().await;
    let d = c.decode_stats(0).await;
    assert_eq!((d.transferring, d.reserved), (0, 0), "{d:?}");
    // The broken transfer's reservation ended exactly once (failed, or released by the router).
    assert_eq!(d.failed + d.cancelled, 1, "{d:?}");
}

per_transport!(decode_killed_mid_transfer_fails_the_request_and_frees_the_prefill_node);

/// The decode node dies while KV is being pushed into it: the prefill node's transfer ends
/// with an error, it holds no blocks and no transfer afterwards, and it serves the next request
/// on a new decode node.
async fn decode_killed_mid_transfer_fails_the_request_and_frees_the_prefill_node(transport: &str) {
    let _serial = SERIAL.lock().await;
    let (mut c, mut client, s) = transfer_in_flight(transport).await;
    c.decodes[0].kill();
    let err = tokio::time::timeout(WAIT, finish(s)).await.expect("the stream hung").unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // The dead node is named, or (when the retry found no decode node left) that is said.
    let m = err.message();
    assert!(m.contains("decode-0") || m.contains("no decode node"), "unclear status: {err:?}");
    eventually(WAIT, "prefill node idle", || async {
        let p = c.prefill_stats(0).await;
        (p.transferring, p.prefilling, p.queued) == (0, 0, 0)
    })
    .await;
    c.wait_blocks_free().await;
    // A new decode node joins; the same prefill node moves KV into it.
    c.add_decode(&[]);
    eventually(WAIT, "only decode-1 registered", || async {
        let decodes: Vec<String> = c
            .nodes()
            .await
            .into_iter()
            .filter(|n| n.role == Role::Decode as i32)
            .map(|n| n.node_id)
            .collect();
        decodes == ["decode-1"]
    })
    .await;
    let (toks, f) = finish(start(&mut client, req(tokens(40), 4)).await).await.unwrap();
    assert_eq!(toks.len(), 4);
    let t = f.timings.unwrap();
    assert_eq!((t.decode_node.as_str(), t.kv_transport.as_str()), ("decode-1", transport));
    c.wait_blocks_free().await;
}

per_transport!(killed_decode_node_ends_the_stream_with_unavailable);

async fn killed_decode_node_ends_the_stream_with_unavailable(transport: &str) {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::builder().prefill(1).decode(1).transport(transport).start().await;
    let mut client = c.client().await;
    let mut s = start(&mut client, req(tokens(30), 1000)).await;
    next_delta(&mut s).await;
    c.decodes[0].kill();
    let err = tokio::time::timeout(WAIT, finish(s)).await.expect("the stream hung").unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("decode-0"), "status does not name the node: {err:?}");
    c.wait_blocks_free().await;
    // With no decode node left, a new request fails at once with a clear status.
    c.wait_nodes(1, 0).await;
    let err = finish(start(&mut client, req(tokens(10), 4)).await).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(err.message().contains("no decode node"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_decode_node_is_dropped_and_its_stream_fails() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(0).decode(1).start().await;
    let mut client = c.client().await;
    let mut s = start(&mut client, req(tokens(30), 1000)).await;
    next_delta(&mut s).await;
    c.decodes[0].pause();
    let err = tokio::time::timeout(WAIT, finish(s)).await.expect("the stream hung").unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("decode-0") && err.message().contains("heartbeat"), "{err:?}");
    // Back from the dead, the node notices the cancelled stream, frees it, and rejoins.
    c.decodes[0].resume();
    c.wait_nodes(0, 1).await;
    c.wait_blocks_free().await;
    let (toks, _) = finish(start(&mut client, req(tokens(10), 4)).await).await.unwrap();
    assert_eq!(toks.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservation_whose_kv_never_arrives_is_freed_at_lease_expiry() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(0).decode(1).start().await;
    let mut d = c.decode_client(0).await;
    let r = ReserveRequest {
        request_id: "orphan".into(),
        prompt_tokens: 100,
        max_tokens: 50,
        lease_ms: 400,
        remote_kv: true,
        owner: String::new(),
        reserve_tokens: 0,
    };
    let target = d.reserve(r).await.unwrap().into_inner().target.unwrap();
    assert_eq!(target.blocks, 7);
    let s = c.decode_stats(0).await;
    assert_eq!((s.reserved, s.load.unwrap().committed_blocks), (1, 10));
    eventually(WAIT, "lease expiry", || async {
        let s = c.decode_stats(0).await;
        s.leases_expired == 1 && s.reserved == 0
    })
    .await;
    c.wait_blocks_free().await;
    // The expired reservation can no longer be used.
    let err = d
        .decode(pdmesh_proto::v1::DecodeRequest {
            reservation_id: target.reservation_id,
            prompt: tokens(100),
            sampler: Some(pdmesh_proto::v1::SamplerState {
                top_p: 1.0,
                repetition_penalty: 1.0,
                ..Default::default()
            }),
            max_tokens: 5,
            start: Some(pdmesh_proto::v1::decode_request::Start::FirstToken(5)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_nodes_join_and_leave_while_the_router_runs() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::builder().prefill(0).decode(1).start().await;
    let mut client = c.client().await;
    // A bigger node registered later: placement prefers it at once.
    c.add_decode(&["--kv-blocks", "2048"]);
    c.wait_nodes(0, 2).await;
    let (_, f) = finish(start(&mut client, req(tokens(10), 4)).await).await.unwrap();
    assert_eq!(f.timings.unwrap().decode_node, "decode-1");
    // A stopped node is dropped; traffic goes on.
    c.decodes[1].stop();
    c.wait_nodes(0, 1).await;
    let (_, f) = finish(start(&mut client, req(tokens(10), 4)).await).await.unwrap();
    assert_eq!(f.timings.unwrap().decode_node, "decode-0");
    c.wait_blocks_free().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_gets_invalid_argument_naming_the_field() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(0).decode(1).start().await;
    let mut client = c.client().await;
    let chat = |role: &str| {
        Some(generate_request::Input::Chat(Chat {
            messages: vec![ChatMessage { role: role.into(), content: "hi".into() }],
        }))
    };
    let ok = req(tokens(5), 4);
    let sampling = |s: SamplingParams| GenerateRequest { sampling: Some(s), ..ok.clone() };
    let cases: Vec<(GenerateRequest, &str)> = vec![
        (GenerateRequest { input: None, ..ok.clone() }, "input"),
        (
            GenerateRequest {
                input: Some(generate_request::Input::Prompt(String::new())),
                ..ok.clone()
            },
            "prompt",
        ),
        (
            GenerateRequest {
                input: Some(generate_request::Input::Chat(Chat::default())),
                ..ok.clone()
            },
            "chat.messages",
        ),
        (GenerateRequest { input: chat("robot"), ..ok.clone() }, "chat.messages[0].role"),
        (
            GenerateRequest {
                input: Some(generate_request::Input::TokenIds(TokenIds::default())),
                ..ok.clone()
            },
            "token_ids",
        ),
        (req(vec![5, 999_999], 4), "token_ids[1]"),
        (req(tokens(8192), 4), "prompt"),
        (req(tokens(5), 0), "max_tokens"),
        (req(tokens(5000), 4000), "max_tokens"),
        (
            sampling(SamplingParams { temperature: f32::NAN, ..Default::default() }),
            "sampling.temperature",
        ),
        (
            sampling(SamplingParams { temperature: -0.5, ..Default::default() }),
            "sampling.temperature",
        ),
        (sampling(SamplingParams { top_p: Some(0.0), ..Default::default() }), "sampling.top_p"),
        (sampling(SamplingParams { top_p: Some(1.5), ..Default::default() }), "sampling.top_p"),
        (sampling(SamplingParams { min_p: 2.0, ..Default::default() }), "sampling.min_p"),
        (
            sampling(SamplingParams { repetition_penalty: Some(0.0), ..Default::default() }),
            "sampling.repetition_penalty",
        ),
        (GenerateRequest { stop: vec!["ok".into(), String::new()], ..ok.clone() }, "stop[1]"),
        (GenerateRequest { request_id: "has space".into(), ..ok.clone() }, "request_id"),
    ];
    for (r, field) in cases {
        let err = client.generate(r.clone()).await.map(|_| ()).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(err.message().contains(field), "{field} not named in {:?}", err.message());
    }
    let err = client.tokenize(TokenizeRequest { input: None }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // Nothing above reached a node, and the mesh still serves.
    let (toks, _) = finish(start(&mut client, ok).await).await.unwrap();
    assert_eq!(toks.len(), 4);
    c.wait_blocks_free().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_at_once_while_admitted_requests_finish() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder()
        .prefill(0)
        .decode(1)
        .router_args(&["--max-in-flight", "2"])
        .start()
        .await;
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let mut client = c.client().await;
        tasks.push(tokio::spawn(async move {
            let r = match client.generate(req(tokens(40), 24)).await {
                Ok(s) => finish(s.into_inner()).await.map(|_| ()),
                Err(e) => Err(e),
            };
            (r, Instant::now())
        }));
    }
    let (mut done, mut refused) = (Vec::new(), Vec::new());
    for t in tasks {
        match t.await.unwrap() {
            (Ok(()), at) => done.push(at),
            (Err(e), at) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                assert!(e.metadata().get("retry-after-ms").is_some(), "no retry hint: {e:?}");
                refused.push(at);
            }
        }
    }
    assert_eq!((done.len(), refused.len()), (2, 18));
    assert!(
        refused.iter().max() < done.iter().min(),
        "a refusal waited for an admitted request to finish"
    );
    c.wait_blocks_free().await;
}

per_transport!(kv_layout_mismatch_is_refused);

/// A node keeping KV in another layout (here f32 where the mesh keeps f16) is refused at
/// registration, so no request is ever placed across the mismatch; the mesh serves on. (A
/// transfer between mismatched nodes is refused too: kv-transfer's layout check.)
async fn kv_layout_mismatch_is_refused(transport: &str) {
    let _serial = SERIAL.lock().await;
    let mut c =
        Cluster::builder().prefill(0).decode(1).transport(transport).metrics().start().await;
    c.add_prefill(&["--kv-dtype", "f32"]);
    // Waits for the refusal itself: a node merely slow to start must not pass as refused.
    let router = c.router.metrics.clone().unwrap();
    let refused = "pdmesh_router_nodes_refused_total{reason=\"layout\"}";
    eventually(WAIT, "the router refuses the f32 node", || async {
        scrape(&router).await.0.get(refused).copied().unwrap_or(0.0) >= 1.0
    })
    .await;
    let nodes = c.nodes().await;
    assert!(nodes.iter().all(|n| n.role != Role::Prefill as i32), "{nodes:?}");
    let mut client = c.client().await;
    let (toks, _) = finish(start(&mut client, req(tokens(40), 4)).await).await.unwrap();
    assert_eq!(toks.len(), 4, "the decode node serves alone");
    c.wait_blocks_free().await;
}

per_transport!(deadline_and_cancel_end_requests_and_free_blocks);

async fn deadline_and_cancel_end_requests_and_free_blocks(transport: &str) {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).transport(transport).start().await;
    let mut client = c.client().await;
    let mut r = tonic::Request::new(req(tokens(30), 4000));
    r.set_timeout(Duration::from_millis(1500));
    let err = finish(client.generate(r).await.unwrap().into_inner()).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("decoding"), "{err:?}");
    c.wait_blocks_free().await;

    let r = GenerateRequest { request_id: "cancel-me".into(), ..req(tokens(30), 4000) };
    let mut s = start(&mut client, r.clone()).await;
    next_delta(&mut s).await;
    let dup = client.generate(r).await.map(|_| ()).unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists);
    client.cancel(CancelRequest { request_id: "cancel-me".into() }).await.unwrap();
    let (_, f) = finish(s).await.unwrap();
    assert_eq!(FinishReason::try_from(f.reason).unwrap(), FinishReason::Cancelled);
    c.wait_blocks_free().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_serves_health_and_reflection() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).start().await;
    let internal = c.router.internal.clone().unwrap();
    for (addr, service) in [
        (&c.router.addr, "pdmesh.v1.Generation"),
        (&internal, "pdmesh.v1.Membership"),
        (&c.prefills[0].addr, "pdmesh.v1.Prefill"),
        (&c.decodes[0].addr, "pdmesh.v1.Decode"),
    ] {
        let ch = c.channel(addr).await;
        let mut h = HealthClient::new(ch.clone());
        let r = h.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        assert_eq!(r.status, 1, "{service} on {addr} is not SERVING"); // 1 = SERVING
        let mut refl = ServerReflectionClient::new(ch);
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut s =
            refl.server_reflection_info(tokio_stream::iter([req])).await.unwrap().into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            s.message().await.unwrap().unwrap().message_response
        else {
            panic!("no service list from {addr}")
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(
            names.iter().any(|n| n == service),
            "{service} not listed by reflection: {names:?}"
        );
        // The public port served the internal services' whole schema to anyone who asked
        // (reflection needs no key): now it describes the public API alone.
        if addr == &c.router.addr {
            assert!(names.iter().all(|n| !n.contains("Decode")), "{names:?}");
            let mut refl = ServerReflectionClient::new(c.channel(addr).await);
            let ask = |symbol: &str| ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::FileContainingSymbol(symbol.into())),
            };
            for symbol in ["pdmesh.v1.Decode", "pdmesh.v1.ReserveRequest"] {
                let asks = tokio_stream::iter([ask(symbol)]);
                let mut s = refl.server_reflection_info(asks).await.unwrap().into_inner();
                let e = s.message().await.expect_err("an internal symbol is not described");
                assert_eq!(e.code(), Code::NotFound, "{symbol}: {e:?}");
            }
            let mut s = refl
                .server_reflection_info(tokio_stream::iter([ask("pdmesh.v1.Generation")]))
                .await
                .unwrap()
                .into_inner();
            let r = s.message().await.unwrap().unwrap().message_response;
            assert!(matches!(r, Some(MessageResponse::FileDescriptorResponse(_))), "{r:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_falls_back_to_grpc_and_ucx_refuses_a_decode_node_without_it() {
    let _serial = SERIAL.lock().await;
    // The decode node offers no UCX: `auto` moves the KV over gRPC and counts a fallback.
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .prefill_args(&["--kv-transport", "auto"])
        .decode_args(&["--kv-transport", "grpc"])
        .start()
        .await;
    let mut client = c.client().await;
    let (toks, f) = finish(start(&mut client, req(tokens(40), 4)).await).await.unwrap();
    assert_eq!(toks.len(), 4);
    assert_eq!(f.timings.unwrap().kv_transport, "grpc");
    let t = c.prefill_stats(0).await.transports;
    let ucx = t.iter().find(|t| t.transport == "ucx").expect("the fallback is counted");
    let grpc = t.iter().find(|t| t.transport == "grpc").expect("the transfer is counted");
    assert_eq!((ucx.fallbacks, ucx.transfers, grpc.transfers), (1, 0, 1), "{t:?}");
    drop(c);

    // `ucx` on the prefill node with the same decode node: a precise refusal, nothing leaks.
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .prefill_args(&["--kv-transport", "ucx"])
        .decode_args(&["--kv-transport", "grpc"])
        .start()
        .await;
    let mut client = c.client().await;
    let err = finish(start(&mut client, req(tokens(40), 4)).await).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("UCX") && err.message().contains("decode-0"), "{err:?}");
    c.wait_blocks_free().await;
}

/// A node that dies after it listens — its engine cannot load: here a CUDA backend with no
/// device to use, driver or not — fails the mesh's start at once, naming the node, instead of
/// after the wait for nodes to register: the GPU tier's mixed-mesh step spent its whole time
/// limit that way when no driver loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_dies_at_start_fails_the_start_naming_it() {
    let _serial = SERIAL.lock().await;
    let start = Cluster::builder()
        .prefill(1)
        .decode(1)
        .decode_args(&["--backend", "cuda"])
        .env("CUDA_VISIBLE_DEVICES", "")
        .start();
    let err = tokio::spawn(start).await.expect_err("a mesh with a node that cannot start");
    let panic = err.into_panic();
    let msg = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains("decode-0 exited while the mesh was starting"), "{msg}");
}
