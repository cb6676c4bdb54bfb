//! One request, one trace: every service exports its spans over OTLP/gRPC to a collector run
//! inside the test, and the spans of a request share one trace id across the router, the
//! prefill node, the KV transfer, the KV-store and the decode node, nested as the request
//! flowed (router → prefill → transfer → decode), with the attributes a user debugging latency
//! needs. A failed request's spans carry its error; a caller's `traceparent` is continued.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Duration;

use pdmesh_common::collector::{Collector, SpanRecord};
use pdmesh_integration::{Cluster, eventually, per_transport};
use pdmesh_proto::v1::{Finished, GenerateRequest, TokenIds, generate_request, generate_response};

/// The clusters are heavy for two cores: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const WAIT: Duration = Duration::from_secs(30);

struct Sent {
    request_id: String,
    /// From the `Started` message.
    trace_id: String,
    result: Result<Finished, tonic::Status>,
}

async fn send(
    client: &mut pdmesh_integration::Client,
    prompt: Vec<u32>,
    max_tokens: u32,
    traceparent: Option<&str>,
    timeout: Option<Duration>,
) -> Sent {
    let mut req = tonic::Request::new(GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: prompt })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    });
    if let Some(tp) = traceparent {
        req.metadata_mut().insert("traceparent", tp.parse().unwrap());
    }
    if let Some(t) = timeout {
        req.set_timeout(t);
    }
    let mut sent = Sent {
        request_id: String::new(),
        trace_id: String::new(),
        result: Err(tonic::Status::unknown("no finish")),
    };
    let mut stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => {
            sent.result = Err(e);
            return sent;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(m)) => match m.event {
                Some(generate_response::Event::Started(s)) => {
                    sent.request_id = s.request_id;
                    sent.trace_id = s.trace_id;
                }
                Some(generate_response::Event::Finished(f)) => {
                    sent.result = Ok(f);
                    return sent;
                }
                _ => {}
            },
            Ok(None) => return sent,
            Err(e) => {
                sent.result = Err(e);
                return sent;
            }
        }
    }
}

/// The spans of `trace`, once every name in `names` has arrived.
async fn trace_of(collector: &Collector, trace: &str, names: &[&str]) -> Vec<SpanRecord> {
    eventually(WAIT, &format!("spans {names:?} of trace {trace}"), || async {
        let got: HashSet<String> =
            collector.spans().into_iter().filter(|s| s.trace_id == trace).map(|s| s.name).collect();
        names.iter().all(|n| got.contains(*n))
    })
    .await;
    collector.spans().into_iter().filter(|s| s.trace_id == trace).collect()
}

fn one<'a>(spans: &'a [SpanRecord], name: &str) -> &'a SpanRecord {
    let found: Vec<&SpanRecord> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "{name}: {found:#?}");
    found[0]
}

fn child_of(child: &SpanRecord, parent: &SpanRecord) {
    assert_eq!(
        child.parent_id, parent.span_id,
        "{} should be a child of {}:\n{child}\n{parent}",
        child.name, parent.name
    );
}

/// A 100-token prompt: six full 16-token blocks and a tail.
fn prompt(seed: u32) -> Vec<u32> {
    (0..100).map(|i| 500 + (i * 37 + seed * 101) % 20_000).collect()
}

per_transport!(one_request_is_one_trace_across_the_mesh);

async fn one_request_is_one_trace_across_the_mesh(transport: &str) {
    let _serial = SERIAL.lock().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::default();
    tokio::spawn(collector.clone().serve(listener));
    let mut c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .kvstore()
        .transport(transport)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .start()
        .await;
    let mut client = c.client().await;

    // A request through every service.
    let first = send(&mut client, prompt(1), 4, None, None).await;
    let fin = first.result.as_ref().expect("the first request finishes").clone();
    assert_eq!(first.trace_id.len(), 32, "Started carries the trace id: {:?}", first.trace_id);
    let spans = trace_of(
        &collector,
        &first.trace_id,
        &[
            "router.generate",
            "router.admission",
            "router.placement",
            "decode.reserve",
            "prefill.prefill",
            "prefill.cache_match",
            "kvstore.match",
            "prefill.queue_wait",
            "prefill.compute",
            "prefill.kv_transfer",
            "decode.kv_receive",
            "prefill.publish",
            "kvstore.write",
            "decode.decode",
            "decode.queue_wait",
            "decode.batch",
        ],
    )
    .await;
    let services: HashSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services,
        HashSet::from(["pdmesh-router", "pdmesh-prefill", "pdmesh-decode", "pdmesh-kvstore"]),
    );

    // The tree: router → prefill → transfer → decode, and the router → decode leg.
    let root = one(&spans, "router.generate");
    assert!(root.parent_id.is_empty(), "an untraced caller's request is a root: {root}");
    assert_eq!(root.kind, 2, "server span");
    let prefill = one(&spans, "prefill.prefill");
    let transfer = one(&spans, "prefill.kv_transfer");
    let receive = one(&spans, "decode.kv_receive");
    let decode = one(&spans, "decode.decode");
    let cache = one(&spans, "prefill.cache_match");
    let publish = one(&spans, "prefill.publish");
    for s in ["router.admission", "router.placement", "decode.reserve"] {
        child_of(one(&spans, s), root);
    }
    child_of(prefill, root);
    child_of(transfer, prefill);
    child_of(receive, transfer);
    child_of(decode, root);
    child_of(one(&spans, "decode.queue_wait"), decode);
    child_of(one(&spans, "decode.batch"), decode);
    child_of(cache, prefill);
    child_of(one(&spans, "kvstore.match"), cache);
    child_of(one(&spans, "prefill.queue_wait"), prefill);
    child_of(publish, prefill);
    child_of(one(&spans, "kvstore.write"), publish);
    for s in spans.iter().filter(|s| s.name == "prefill.compute") {
        child_of(s, prefill);
    }

    // What each says.
    let t = fin.timings.clone().unwrap();
    assert_eq!(root.str("request_id"), Some(first.request_id.as_str()));
    assert_eq!(root.int("prompt_tokens"), Some(100));
    assert_eq!(root.int("cached_tokens"), Some(0));
    assert_eq!(root.str("prefill_node"), Some("prefill-0"));
    assert_eq!(root.str("decode_node"), Some("decode-0"));
    assert_eq!(root.str("kv_transport"), Some(transport));
    assert_eq!(root.str("finish_reason"), Some("FINISH_REASON_LENGTH"));
    assert_eq!(root.int("rpc.grpc.status_code"), Some(0));
    assert!(!root.error, "{root}");
    let placement = one(&spans, "router.placement");
    assert_eq!(placement.str("prefill_node"), Some("prefill-0"));
    assert_eq!(placement.str("policy"), Some("prefix-aware"));
    assert_eq!(transfer.str("transport"), Some(transport));
    assert_eq!(transfer.int("blocks"), Some(7));
    assert_eq!(transfer.int("layers"), Some(30));
    assert_eq!(transfer.int("bytes"), Some(t.kv_bytes as i64));
    assert!(
        transfer.attr("bandwidth_mb_s").is_some() && transfer.attr("tail_ms").is_some(),
        "{transfer}"
    );
    assert_eq!(receive.str("transport"), Some(transport));
    // How the KV reached the pool: a CPU pool in host memory takes UCX puts itself.
    let path = if transport == "ucx" { "direct-host" } else { "stream" };
    assert_eq!(receive.str("kv_path"), Some(path));
    assert_eq!(receive.int("bytes"), Some(t.kv_bytes as i64));
    assert_eq!(receive.str("prefill_node"), Some("prefill-0"));
    let computed: i64 = spans
        .iter()
        .filter(|s| s.name == "prefill.compute")
        .map(|s| s.int("tokens").unwrap())
        .sum();
    assert_eq!(computed, 100, "every prompt token computed once");
    assert_eq!(cache.int("cached_tokens"), Some(0));
    assert_eq!(publish.int("blocks"), Some(6));
    assert_eq!(one(&spans, "kvstore.write").int("stored"), Some(6));
    let batch = one(&spans, "decode.batch");
    // The first token comes from the prefill node; the decode node generates the rest.
    assert_eq!(batch.int("tokens"), Some(4));
    assert_eq!(batch.str("finish_reason"), Some("FINISH_REASON_LENGTH"));
    for s in &spans {
        assert!(s.start_unix_nanos >= root.start_unix_nanos, "{s} starts before the root");
    }
    // Whoever reads the trace store holds no capability: a reservation's id (32 hex digits,
    // key and secret) once went out whole, and with a node's certificate that was enough to
    // push KV into another tenant's reservation. Only its key is said.
    let key = transfer.str("reservation").expect("the transfer names its reservation");
    assert_eq!(receive.str("reservation"), Some(key), "{receive}");
    assert!(key.len() == 19 && key.ends_with('…'), "the key alone: {transfer}");
    for s in &spans {
        for (k, v) in &s.attributes {
            let v = v.to_string();
            let capability = v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit());
            assert!(!capability || k == "trace_id", "{} carries a capability in {k}: {v}", s.name);
        }
    }
    // A streaming call's span lasts as long as its stream, not just its handler.
    assert!(decode.end_unix_nanos > batch.start_unix_nanos, "{decode}\n{batch}");
    assert!(root.end_unix_nanos > batch.start_unix_nanos, "{root}\n{batch}");

    // The same prompt again: its prefix comes from the node's own cache, and says so.
    let second = send(&mut client, prompt(1), 4, None, None).await;
    assert_ne!(second.trace_id, first.trace_id, "a new request, a new trace");
    let spans2 =
        trace_of(&collector, &second.trace_id, &["router.generate", "prefill.cache_match"]).await;
    assert_eq!(one(&spans2, "router.generate").int("cached_tokens"), Some(96));
    assert_eq!(one(&spans2, "prefill.cache_match").int("own_blocks"), Some(6));

    // A caller's trace is continued.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let tp = format!("00-{caller_trace}-{caller_span}-01");
    let third = send(&mut client, prompt(2), 2, Some(&tp), None).await;
    third.result.as_ref().expect("the traced request finishes");
    assert_eq!(third.trace_id, caller_trace);
    let spans3 =
        trace_of(&collector, caller_trace, &["router.generate", "prefill.prefill", "decode.batch"])
            .await;
    assert_eq!(one(&spans3, "router.generate").parent_id, caller_span);

    // A failed request: its deadline passes while the prefill node computes a long prompt.
    let long: Vec<u32> = (0..1500).map(|i| 1000 + (i * 13) % 20_000).collect();
    let failed = send(&mut client, long, 4, None, Some(Duration::from_millis(200))).await;
    let err = failed.result.expect_err("the deadline passes");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    let spans4 =
        trace_of(&collector, &failed.trace_id, &["router.generate", "prefill.prefill"]).await;
    let root4 = one(&spans4, "router.generate");
    assert!(root4.error, "{root4}");
    assert_eq!(root4.int("rpc.grpc.status_code"), Some(tonic::Code::DeadlineExceeded as i64));
    assert!(root4.status_message.contains("deadline passed"), "{root4}");
    let prefill4 = one(&spans4, "prefill.prefill");
    assert!(prefill4.error, "the prefill leg ended with the request: {prefill4}");

    // A clean stop exports what is still buffered and exits 0 (`stop` asserts it).
    for s in c.decodes.iter_mut().chain(c.prefills.iter_mut()) {
        s.stop();
    }
    c.kvstore.as_mut().unwrap().stop();
    c.router.stop();

    // Nothing left the trace it belongs to: every span exported anywhere is in the trace of
    // a request the router served (the hop that breaks traces elsewhere).
    let all = collector.spans();
    for (trace, ok) in [
        (&first.trace_id, true),
        (&second.trace_id, true),
        (&third.trace_id, true),
        (&failed.trace_id, false),
    ] {
        let received: Vec<&SpanRecord> =
            all.iter().filter(|s| &s.trace_id == trace && s.name == "decode.kv_receive").collect();
        if ok {
            assert_eq!(received.len(), 1, "one transfer in {trace}: {received:#?}");
            assert!(!received[0].error, "{}", received[0]);
        } else {
            // Opened before the deadline passed (or not at all): then it ended in error.
            assert!(received.iter().all(|s| s.error), "{received:#?}");
        }
    }
    let roots: HashSet<&str> =
        all.iter().filter(|s| s.name == "router.generate").map(|s| s.trace_id.as_str()).collect();
    assert_eq!(roots.len(), 4, "four requests, four traces");
    for s in &all {
        assert!(roots.contains(s.trace_id.as_str()), "a span outside every request's trace: {s}");
    }
}

/// With no OTLP endpoint configured nothing is exported and nothing is announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_there_is_no_trace() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).start().await;
    let mut client = c.client().await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let sent = send(&mut client, prompt(3), 2, Some(tp), None).await;
    sent.result.expect("finishes");
    assert_eq!(sent.trace_id, "", "no trace id when nothing is exported");
}

/// `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_TRACES_SAMPLER` apply, and a call
/// refused at once (a trailers-only error) has its code on its span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_otel_variables_apply() {
    use pdmesh_integration::cluster::Service;
    use pdmesh_proto::v1::KvMatchRequest;
    use pdmesh_proto::v1::kv_store_client::KvStoreClient;

    let _serial = SERIAL.lock().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::default();
    tokio::spawn(collector.clone().serve(listener));
    let model = pdmesh_integration::model_path().display().to_string();
    let args: Vec<String> = ["--insecure", "--listen", "127.0.0.1:0", "--model", &model]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let env = |extra: &[(&str, &str)]| {
        let mut e = vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".to_string(), endpoint.clone()),
            ("OTEL_BSP_SCHEDULE_DELAY".to_string(), "100".to_string()),
        ];
        e.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        e
    };
    let named = Service::start_with_env(
        "kvstore",
        "named",
        &args,
        &env(&[
            ("OTEL_SERVICE_NAME", "kv-east"),
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,service.name=ignored"),
        ]),
    );
    let silent = Service::start_with_env(
        "kvstore",
        "silent",
        &args,
        &env(&[("OTEL_TRACES_SAMPLER", "always_off")]),
    );
    for (s, trace) in [
        (&named, "0af7651916cd43dd8448eb211c80319c"),
        (&silent, "1af7651916cd43dd8448eb211c80319c"),
    ] {
        let mut client = KvStoreClient::connect(format!("http://{}", s.addr)).await.unwrap();
        let mut req = tonic::Request::new(KvMatchRequest::default());
        let tp = format!("00-{trace}-b7ad6b7169203331-01");
        req.metadata_mut().insert("traceparent", tp.parse().unwrap());
        let err = client.r#match(req).await.expect_err("a match without a layout is refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
    }
    let spans = trace_of(&collector, "0af7651916cd43dd8448eb211c80319c", &["kvstore.match"]).await;
    let m = one(&spans, "kvstore.match");
    assert_eq!(m.service, "kv-east", "OTEL_SERVICE_NAME wins over the attribute");
    assert_eq!(
        m.resource.get("deployment.environment").map(|a| a.to_string()).as_deref(),
        Some("test")
    );
    assert_eq!(m.parent_id, "b7ad6b7169203331");
    assert!(m.error, "{m}");
    assert_eq!(m.int("rpc.grpc.status_code"), Some(tonic::Code::InvalidArgument as i64));
    // The sampler said no: after a clean stop has flushed everything, nothing came from it.
    drop(named);
    let mut silent = silent;
    silent.stop();
    assert!(
        collector.spans().iter().all(|s| s.trace_id != "1af7651916cd43dd8448eb211c80319c"),
        "always_off exported spans"
    );
}
