//! Every service serves Prometheus metrics over HTTP, and its counters move as requests run:
//! the router's latency histograms and outcomes, the prefill and decode nodes' requests,
//! transfers and KV blocks, the prefix cache's hits, and the KV-store's blocks.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use pdmesh_integration::{Cluster, eventually, scrape};
use pdmesh_proto::v1::{GenerateRequest, TokenIds, generate_request, generate_response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn get(m: &HashMap<String, f64>, series: &str) -> f64 {
    m.get(series).copied().unwrap_or(0.0)
}

async fn generate(c: &Cluster, prompt: Vec<u32>, max_tokens: u32) -> Result<(), tonic::Status> {
    let mut client = c.client().await;
    let req = GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: prompt })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = client.generate(req).await?.into_inner();
    while let Some(m) = s.message().await? {
        if let Some(generate_response::Event::Finished(_)) = m.event {
            return Ok(());
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_counts_what_it_does() {
    let c = Cluster::builder().prefill(1).decode(1).kvstore().metrics().start().await;
    let router = c.router.metrics.clone().unwrap();
    let prefill = c.prefills[0].metrics.clone().unwrap();
    let decode = c.decodes[0].metrics.clone().unwrap();
    let kvstore = c.kvstore.as_ref().unwrap().metrics.clone().unwrap();

    let (r0, raw) = scrape(&router).await;
    assert!(raw.contains("# TYPE pdmesh_router_ttft_seconds histogram"), "{raw}");
    assert_eq!(
        get(&r0, "pdmesh_router_nodes{model=\"SmolLM2-135M-Instruct.Q4_1\",role=\"prefill\"}"),
        1.0
    );
    assert_eq!(get(&r0, "pdmesh_router_ttft_seconds_count"), 0.0);
    let (p0, _) = scrape(&prefill).await;
    let free = get(&p0, "pdmesh_prefill_kv_blocks_free");
    assert!(free > 0.0);

    // Two prompts sharing 64 tokens (4 blocks): the second finds them in the prefill node's
    // own cache. And one request the router refuses.
    let shared: Vec<u32> = (0..64).map(|i| 300 + i).collect();
    for tail in [1000u32, 2000] {
        let p: Vec<u32> = shared.iter().copied().chain(tail..tail + 20).collect();
        generate(&c, p, 4).await.unwrap();
    }
    let bad = generate(&c, vec![1, 2, 3], 0).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);

    let (r, _) = scrape(&router).await;
    // By the model that served them; a request refused before it chose one names none.
    let finished = "pdmesh_router_requests_total{model=\"SmolLM2-135M-Instruct.Q4_1\",\
                    outcome=\"finished\",reason=\"length\"}";
    assert_eq!(get(&r, finished), 2.0);
    assert_eq!(
        get(&r, "pdmesh_router_requests_total{outcome=\"failed\",code=\"InvalidArgument\"}"),
        1.0
    );
    assert_eq!(get(&r, "pdmesh_router_ttft_seconds_count"), 2.0);
    assert_eq!(get(&r, "pdmesh_router_tpot_seconds_count"), 2.0);
    assert!(get(&r, "pdmesh_router_e2e_seconds_sum") > 0.0);
    assert_eq!(get(&r, "pdmesh_router_prompt_tokens_total"), 168.0);
    assert_eq!(get(&r, "pdmesh_router_cached_tokens_total"), 64.0);
    // The planner measured the two requests: demand and node speed are there, and one node
    // of each role covers a load this light.
    // Each pool's gauges carry its model.
    let planner = |name: &str, label: &str| {
        format!("pdmesh_planner_{name}{{{label},model=\"SmolLM2-135M-Instruct.Q4_1\"}}")
    };
    eventually(Duration::from_secs(10), "the planner's gauges", || async {
        let (r, _) = scrape(&router).await;
        get(&r, &planner("demand_tokens_per_second", "phase=\"prefill\"")) > 0.0
            && get(&r, &planner("node_tokens_per_second", "phase=\"decode\"")) > 0.0
    })
    .await;
    let (r, raw) = scrape(&router).await;
    assert_eq!(get(&r, &planner("desired_nodes", "role=\"prefill\"")), 1.0, "{raw}");
    assert_eq!(get(&r, &planner("desired_nodes", "role=\"decode\"")), 1.0, "{raw}");

    let (p, raw) = scrape(&prefill).await;
    assert_eq!(get(&p, "pdmesh_prefill_requests_total{outcome=\"completed\"}"), 2.0, "{raw}");
    assert_eq!(get(&p, "pdmesh_prefill_prefix_hit_tokens_total{tier=\"own\"}"), 64.0, "{raw}");
    let sent: f64 = ["ucx", "grpc"]
        .iter()
        .map(|t| get(&p, &format!("pdmesh_prefill_transfer_bytes_total{{transport=\"{t}\"}}")))
        .sum();
    assert!(sent > 0.0, "{raw}");
    assert_eq!(get(&p, "pdmesh_prefill_kv_blocks_free"), free, "blocks come back");

    let (d, raw) = scrape(&decode).await;
    assert_eq!(get(&d, "pdmesh_decode_requests_total{outcome=\"completed\"}"), 2.0, "{raw}");
    assert_eq!(get(&d, "pdmesh_decode_kv_blocks_used"), 0.0, "{raw}");
    assert_eq!(get(&d, "pdmesh_decode_running_sequences"), 0.0, "{raw}");

    // The KV-store gets the published blocks in the background.
    eventually(Duration::from_secs(30), "blocks published", || {
        let kvstore = kvstore.clone();
        async move { get(&scrape(&kvstore).await.0, "pdmesh_kvstore_blocks") >= 6.0 }
    })
    .await;
    let (k, raw) = scrape(&kvstore).await;
    assert!(get(&k, "pdmesh_kvstore_capacity_blocks") > 0.0, "{raw}");

    // Anything but GET /metrics is a 404.
    let mut s = tokio::net::TcpStream::connect(&router).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    assert!(raw.starts_with("HTTP/1.1 404"), "{raw}");
}
