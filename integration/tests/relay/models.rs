//! Several models in one mesh: each request is served by its model's own nodes with that
//! model's tokens, a request that names none by the default model, an unknown name is
//! NOT_FOUND, and a stream whose decode node dies moves only within its model's pool.

use super::*;

/// Greedy tokens of one engine of `model` for `prompt()`.
fn reference_of(model: TinyModel, n: usize) -> Vec<u32> {
    let cfg = EngineConfig { threads: 1, kv_blocks: 64, ..Default::default() };
    let mut e = Engine::new(model.build(), cfg).unwrap();
    let p = GenerateParams { max_tokens: n, ignore_eos: true, ..Default::default() };
    pdmesh_engine::generate(&mut e, &prompt(), &p, |_| true).unwrap().tokens
}

fn asking(model: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest { model: model.into(), ..req(max_tokens) }
}

/// Seed 8's weights: another fingerprint, the same tokenizer.
fn other() -> TinyModel {
    TinyModel { seed: 8, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_mesh_serves_two_models_each_on_its_own_nodes() {
    let m = Settings::new(1, 1).serve("other", other(), 1, 1).start().await;
    let (tiny, theirs) = (reference(12), reference_of(other(), 12));
    assert_ne!(tiny, theirs, "two models, two answers");
    for (model, want, prefix) in
        [("", &tiny, ""), ("tiny", &tiny, ""), ("other", &theirs, "other-")]
    {
        let (tokens, f) = generate(&m, asking(model, 12)).await.unwrap();
        assert_eq!(&tokens, want, "model {model:?}");
        let t = f.timings.unwrap();
        let nodes = (t.prefill_node.as_str(), t.decode_node.as_str());
        assert_eq!(nodes, (&format!("{prefix}prefill-0")[..], &format!("{prefix}decode-0")[..]));
    }
    let e = generate(&m, asking("nope", 4)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains("tiny") && e.message().contains("other"), "{}", e.message());
}

/// The other model's stream whose decode node dies moves to that model's second decode
/// node, never to the default model's (which is free, and would take it were it one pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_moves_only_within_its_models_pool() {
    let mut s = Settings::new(1, 1).serve("other", other(), 1, 2);
    s.router.node_ttl_ms = 60_000;
    s.extra[0].decode[0].fault_engine_panic_at_step = Some(10);
    let m = s.start().await;
    let want = reference_of(other(), 16);
    let mut hit = 0;
    for _ in 0..6 {
        let (tokens, f) = generate(&m, asking("other", 16)).await.expect("no request fails");
        assert_eq!(tokens, want);
        let t = f.timings.unwrap();
        assert!(t.decode_node.starts_with("other-decode-"), "{t:?}");
        if t.migrations > 0 || t.attempts > 1 {
            assert_eq!(t.decode_node, "other-decode-1", "{t:?}");
            hit += 1;
        }
    }
    assert_eq!(hit, 1, "exactly one stream ran into the panic");
}
