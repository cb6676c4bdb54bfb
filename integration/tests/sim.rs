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
    let nodes = c.nodes().await;
    let names: HashSet<&str> = nodes.iter().map(|n| n.node_id.as_str()).collect();
    for n in ["prefill-0-0", "prefill-0-1", "decode-0-0", "decode-0-1", "decode-0-2"] {
        assert!(names.contains(n), "{n} registered: {names:?}");
    }
    // Each node of a fleet is its own peer to the router (a loopback address of its own), so
    // a fleet of a thousand stays under the router's per-address connection limit.
    for (role, n) in [("prefill", 2), ("decode", 3)] {
        let hosts: HashSet<&str> = nodes
            .iter()
            .filter(|x| x.node_id.starts_with(role))
            .filter_map(|x| x.address.rsplit_once(':'))
            .map(|(h, _)| h)
            .collect();
        assert_eq!(hosts.len(), n, "{role}: {nodes:?}");
        assert!(hosts.iter().all(|h| h.starts_with("127.1.")), "{hosts:?}");
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

/// `pdmesh replay` sends a conversation's next turn only once the turn before it is answered
/// (its prompt contains that answer), so the turn finds the earlier turn's prefix cached; with
/// `--no-turn-order` both go out at their shared timestamp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_conversation_turn_waits_for_the_answer_before_it() {
    let mut c = Cluster::builder().insecure().prefill(0).decode(0).start().await;
    let fleet = ["--engine", "sim", "--kv-transport", "grpc", "--sim-nodes", "1"];
    c.add_prefill(&fleet);
    c.add_decode(&fleet);
    c.wait_nodes(1, 1).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("trace.jsonl");
    // The second request is the first's next turn (all of its full blocks, 0 and 1, lead it),
    // in the trace at the same millisecond: only the order of a conversation keeps them apart.
    let line = |input: u32, ids: &[u32]| {
        format!(
            r#"{{"timestamp": 0, "input_length": {input}, "output_length": 640, "hash_ids": {ids:?}}}"#
        )
    };
    std::fs::write(&trace, [line(1100, &[0, 1, 2]), line(2000, &[0, 1, 3, 4])].join("\n"))
        .expect("trace written");
    let replay = |extra: &[&str]| {
        let schedule = dir.path().join("schedule.jsonl");
        let mut cmd = std::process::Command::new(pdmesh_integration::pdmesh_bin());
        cmd.args(["replay", "--insecure", "--json", "--target", &c.router.addr, "--trace"])
            .arg(&trace)
            .args(["--token-scale", "0.03125", "--schedule"])
            .arg(&schedule)
            .args(extra);
        let (code, out, err) = run(cmd);
        assert_eq!(code, 0, "{err}");
        let report: serde_json::Value =
            serde_json::from_str(out.lines().last().expect("a report")).expect("json");
        assert_eq!(report["results"]["ok"], 2, "{report}");
        let sent: Vec<f64> = std::fs::read_to_string(&schedule)
            .expect("schedule")
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["at_s"].as_f64().unwrap()
            })
            .collect();
        (report, sent[1] - sent[0])
    };
    let (report, gap) = replay(&[]);
    // 20 output tokens at the sim's decode pace take well over 20 ms.
    assert!(gap > 0.02, "the next turn went out {gap} s after the first, before its answer");
    assert_eq!(report["cached_tokens"], 32, "it found the first turn's two blocks: {report}");
    assert!(report["reachable_hit_rate"].as_f64().unwrap() > 0.0, "{report}");
    let (_, gap) = replay(&["--no-turn-order"]);
    assert!(gap < 0.02, "without turn order both go out at once: {gap} s apart");
}
