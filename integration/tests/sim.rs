//! Simulated nodes (`--engine sim`) behind the real router: one process hosting several nodes,
//! each registered under its own name, served with the sim's deterministic tokens and its KV
//! moved between processes; and the flags that may not be combined with it refused.

use std::collections::HashSet;

use pdmesh_engine::sim::sim_token;
use pdmesh_integration::cluster::Cluster;
use pdmesh_integration::{collect, greedy, pdmesh, run};

/// What the sim answers to `prompt`: each token a function of the one before and its position.
fn sim_chain(prompt: &[u32], n: usize, vocab: usize, eog: &[u32]) -> Vec<u32> {
    let (mut last, mut pos) = (*prompt.last().expect("a prompt"), prompt.len() - 1);
    (0..n)
        .map(|_| {
            last = sim_token(last, pos, vocab, eog);
            pos += 1;
            last
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleets_of_simulated_nodes_serve_the_sims_tokens_through_the_router() {
    let mut c = Cluster::builder().insecure().prefill(0).decode(0).start().await;
    let fleet = ["--engine", "sim", "--kv-transport", "grpc", "--sim-nodes"];
    c.add_prefill(&[&fleet[..], &["2"]].concat());
    c.add_decode(&[&fleet[..], &["3"]].concat());
    c.wait_nodes(2, 3).await;
    let names: HashSet<String> = c.nodes().await.into_iter().map(|n| n.node_id).collect();
    for n in ["prefill-0-0", "prefill-0-1", "decode-0-0", "decode-0-1", "decode-0-2"] {
        assert!(names.contains(n), "{n} registered: {names:?}");
    }

    let model = pdmesh_engine::Model::load(&pdmesh_integration::model_path()).expect("model");
    let (vocab, eog) = (model.config.vocab, model.tokenizer.eog_tokens().to_vec());
    let client = c.client().await;
    let mut tasks = Vec::new();
    for i in 0..12u32 {
        let prompt: Vec<u32> = (0..20 + i).map(|k| 300 + 7 * k + i).collect();
        let mut cl = client.clone();
        tasks.push(tokio::spawn(async move {
            let s = cl.generate(greedy(&prompt, 16)).await.expect("accepted").into_inner();
            (prompt, collect(s).await.expect("served"))
        }));
    }
    let mut decode_nodes = HashSet::new();
    for t in tasks {
        let (prompt, (tokens, finished)) = t.await.expect("task");
        assert_eq!(tokens, sim_chain(&prompt, 16, vocab, &eog), "the sim's tokens, in order");
        let t = finished.expect("finished").timings.expect("timings");
        assert_eq!(t.kv_transport, "grpc");
        assert!(t.kv_bytes > 0, "the KV moved from prefill to decode node");
        decode_nodes.insert(t.decode_node);
    }
    assert!(decode_nodes.len() > 1, "requests spread over the fleet: {decode_nodes:?}");
    c.wait_blocks_free().await;
}

#[test]
fn sim_fleets_refuse_what_they_cannot_honour() {
    let cases: [(&[&str], &str); 4] = [
        (&["decode", "--insecure", "--sim-nodes", "2"], "add --engine sim"),
        (&["decode", "--sim-nodes", "2", "--engine", "sim"], "--insecure"),
        (&["prefill", "--insecure", "--engine", "sim", "--sim-nodes", "0"], "must be in 1..=10000"),
        (&["decode", "--insecure", "--sim-profile", "/nonexistent.json"], "sim_profile"),
    ];
    for (args, want) in cases {
        let mut c = pdmesh(args);
        c.args(["--listen", "127.0.0.1:0"]);
        let (code, _, err) = run(c);
        assert_ne!(code, 0, "{args:?} must fail");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
