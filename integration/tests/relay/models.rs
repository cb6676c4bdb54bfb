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

/// A text prompt: `auto` may run several models, each tokenizing it its own way.
fn text(model: &str, max_tokens: u32, logprobs: Option<u32>) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Prompt("the one and the two and the".into())),
        sampling: Some(pdmesh_proto::v1::SamplingParams { logprobs, ..Default::default() }),
        ..asking(model, max_tokens)
    }
}

/// A mesh of `tiny` and `other` whose `auto` climbs from `tiny` to `other` below `threshold`.
async fn ladder_mesh(threshold: f32) -> Mesh {
    let mut s = Settings::new(1, 1).serve("other", other(), 1, 1);
    let ladder = vec!["tiny".to_string(), "other".to_string()];
    s.router.tiers = Some(pdmesh_router::config::Tiers::cascade(ladder, threshold));
    s.start().await
}

/// A stream's tokens, the logprobs it carried and its end.
async fn answer(m: &Mesh, r: GenerateRequest) -> (Vec<u32>, Vec<f32>, Finished) {
    let mut s = m.client().await.generate(r).await.unwrap().into_inner();
    let (mut tokens, mut lps) = (Vec::new(), Vec::new());
    while let Some(GenerateResponse { event }) = s.message().await.unwrap() {
        match event {
            Some(Wire::Delta(d)) => {
                tokens.extend(d.token_ids);
                lps.extend(d.logprobs.iter().map(|l| l.logprob));
            }
            Some(Wire::Finished(f)) => return (tokens, lps, f),
            _ => {}
        }
    }
    panic!("the stream ended without a finish")
}

/// `auto` keeps the first model's answer when its mean token log-probability reaches the
/// threshold, and re-runs the request on the next model when it falls short by a hair; the
/// answer is that model's own, and the response names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_escalates_below_the_threshold_and_not_above() {
    let m = ladder_mesh(-1e6).await;
    // Every token's report reaches the client, the last one too (its text held back until
    // the end once lost it).
    let (small, lps, f) = answer(&m, text("tiny", 12, Some(0))).await;
    assert_eq!((small.len(), lps.len(), f.model.as_str()), (12, 12, "tiny"));
    let confidence = lps.iter().sum::<f32>() / lps.len() as f32;
    let (large, _, _) = answer(&m, text("other", 12, None)).await;
    assert_ne!(small, large, "two models, two answers");
    drop(m);

    for (threshold, want, model, escalations) in
        [(confidence - 0.01, &small, "tiny", 0), (confidence + 0.01, &large, "other", 1)]
    {
        let m = ladder_mesh(threshold).await;
        let (tokens, lps, f) = answer(&m, text("auto", 12, None)).await;
        assert_eq!(&tokens, want, "threshold {threshold} (confidence {confidence})");
        assert!(lps.is_empty(), "log-probabilities the client did not ask for");
        assert_eq!(f.model, model);
        let t = f.timings.unwrap();
        assert_eq!(t.escalations, escalations, "{t:?}");
        assert!(t.ttft_ms > 0.0 && t.ttft_ms <= t.total_ms, "{t:?}");
        // Asked for, the kept answer's log-probabilities come as they would without `auto`.
        let (_, lps, _) = answer(&m, text("auto", 12, Some(0))).await;
        assert_eq!(lps.len(), 12);
    }

    // Ids are one tokenizer's: refused for `auto`, which may run several.
    let m = ladder_mesh(-1e6).await;
    let e = generate(&m, asking("auto", 4)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("token_ids"), "{e:?}");
    drop(m);
    // No ladder declared: `auto` is not served.
    let m = Settings::new(1, 1).serve("other", other(), 1, 1).start().await;
    let e = generate(&m, text("auto", 4, None)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
}

/// A mesh of `tiny` and `other` whose `auto` lets a classifier choose: `tiny` for a request
/// that says "easy", `other` for any other.
async fn classified_mesh(dir: &std::path::Path) -> Mesh {
    let file = dir.join("tiers.json");
    // The check text's score, as the router must recompute it: sigmoid(-5 + 10).
    let p = 1.0 / (1.0 + (-5.0f64).exp());
    let json = format!(
        r#"{{"features": "ascii-words+pairs+len/v1",
            "models": {{"tiny": {{"bias": -5.0, "weights": {{"easy": 10.0}}}}}},
            "checks": [{{"text": "an easy one", "p": {{"tiny": {p:?}}}}}]}}"#
    );
    std::fs::write(&file, json).unwrap();
    let mut s = Settings::new(1, 1).serve("other", other(), 1, 1);
    let ladder = vec!["tiny".to_string(), "other".to_string()];
    s.router.tiers = Some(pdmesh_router::config::Tiers::classifier(ladder, file, 0.5));
    s.start().await
}

/// The classifier policy runs one model per request, chosen before any runs: the cheaper one
/// where its predicted chance reaches the threshold, else the last; the answer is that
/// model's own, streamed, on that model's nodes, with no escalation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_by_classifier_runs_the_chosen_model_alone() {
    let dir = tempfile::tempdir().unwrap();
    let m = classified_mesh(dir.path()).await;
    let ask = |words: &str, model: &str| GenerateRequest {
        input: Some(generate_request::Input::Prompt(words.into())),
        ..asking(model, 10)
    };
    for (words, model) in [("an easy one and the two", "tiny"), ("the one and the two", "other")] {
        let (want, _) = generate(&m, ask(words, model)).await.unwrap();
        let (tokens, f) = generate(&m, ask(words, "auto")).await.unwrap();
        assert_eq!((tokens, f.model.as_str()), (want, model), "{words:?}");
        let t = f.timings.unwrap();
        assert_eq!(t.escalations, 0);
        let prefix = if model == "tiny" { "" } else { "other-" };
        assert_eq!(t.decode_node, format!("{prefix}decode-0"), "{t:?}");
    }
}

/// A tenant's `default_model` serves its requests that name none — a served model or `auto`
/// — while a request's own name wins, and other tenants keep the router's default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_default_model_serves_its_requests_that_name_none() {
    use pdmesh_common::apikey::{Bearer, Tenant, add};
    use pdmesh_proto::v1::generation_client::GenerationClient;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    let tenant = |t: &str, model: Option<&str>| Tenant {
        default_model: model.map(String::from),
        ..Tenant::named(t)
    };
    let plain = add(&keys, tenant("plain", None)).unwrap();
    let big = add(&keys, tenant("big", Some("other"))).unwrap();
    let tiered = add(&keys, tenant("tiered", Some("auto"))).unwrap();
    let gone = add(&keys, tenant("gone", Some("retired"))).unwrap();
    let mut s = Settings::new(1, 1).serve("other", other(), 1, 1);
    let ladder = vec!["tiny".to_string(), "other".to_string()];
    // Any answer escalates: `auto` answers with `other`, after one escalation.
    s.router.tiers = Some(pdmesh_router::config::Tiers::cascade(ladder, 0.0));
    let (m, ch) = keyed_mesh(s, keys).await;
    let run = |key: &str, model: &str| {
        let mut c = GenerationClient::with_interceptor(ch.clone(), Bearer::new(Some(key)).unwrap());
        let r = text(model, 8, None);
        async move {
            let (_, f) = pdmesh_integration::collect(c.generate(r).await?.into_inner()).await?;
            let f = f.expect("a finish");
            Ok::<_, tonic::Status>((f.model, f.timings.unwrap_or_default().escalations))
        }
    };
    for (key, asked, model, escalations) in [
        (&plain, "", "tiny", 0),
        (&big, "", "other", 0),
        (&big, "tiny", "tiny", 0),
        (&tiered, "", "other", 1),
    ] {
        let got = run(key, asked).await.unwrap();
        assert_eq!(got, (model.to_string(), escalations), "asked {asked:?}");
    }
    let e = run(&gone, "").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains("\"retired\""), "{}", e.message());
    drop(m);
}
