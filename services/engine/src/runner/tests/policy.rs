//! Lossy KV policies in the runner: where they start, and what they forbid.

use super::*;

/// A lossy KV policy goes on once the prompt is whole, wherever it was computed: generating
/// here (the prompt in chunks of 8) and decoding after a prefill node give the same tokens and
/// evict the same KV; the first token saw the whole prompt, and later ones part from full
/// attention's once past the budget.
#[test]
fn a_kv_policy_starts_with_the_whole_prompt_wherever_it_was_computed() {
    let model = TinyModel::default().build();
    let prompt = model.tokenizer.encode(PROMPT).expect("tokenizes");
    assert!(prompt.len() > 16, "the prompt alone is past the budget");
    for policy in ["sinks:16:4", "h2o:16:8"] {
        let policy: KvPolicy = policy.parse().unwrap();
        let case = |p| Case::plain(&model, GenerateParams { kv_policy: p, ..params(40) });
        let full = generate_run(&model, &prompt, &case(None));
        let here = generate_run(&model, &prompt, &case(Some(policy)));
        let there = decode_run(&model, &prompt, &case(Some(policy)));
        assert_eq!(here, there, "{policy}");
        let (
            Ended::Finished { tokens: f, evicted: 0, .. },
            Ended::Finished { tokens: h, evicted, .. },
        ) = (&full, &here)
        else {
            panic!("{policy}: {full:?} / {here:?}");
        };
        // Whole blocks of 4 go as soon as the budget of 16 is passed: 13 to 16 tokens stay
        // of the prompt and every generated token but the last.
        let held = prompt.len() + 40 - 1;
        assert!((held - 16..=held - 13).contains(evicted), "{policy}: {evicted} of {held}");
        assert_eq!(f[0], h[0], "{policy}: the first token sees the whole prompt");
        assert_ne!(f, h, "{policy}: 40 tokens past a 16-token budget change nothing");
    }
}

/// A sequence whose policy evicted KV cannot be exported for a move (its blocks are no longer
/// its tokens' prefix); a budget its blocks cannot hold is refused when it is added.
#[test]
fn evicted_kv_never_moves_and_bad_budgets_are_refused_on_add() {
    let model = TinyModel::default().build();
    let prompt = model.tokenizer.encode(PROMPT).expect("tokenizes");
    let mut e = engine(&model);
    let mut runner = BatchRunner::new(&e, 4, true);
    let bad = GenerateParams { kv_policy: Some("sinks:8:4".parse().unwrap()), ..params(8) };
    let err = runner
        .add(&mut e, &mut NoConnector, 1, spec(&prompt, &bad, Role::Generate))
        .unwrap_err()
        .to_string();
    assert!(err.contains("kv_policy") && err.contains("12 tokens"), "{err}");
    let p = GenerateParams { kv_policy: Some("sinks:16:4".parse().unwrap()), ..params(8) };
    let mut out =
        runner.add(&mut e, &mut NoConnector, 2, spec(&prompt, &p, Role::Generate)).unwrap();
    while runner.status(2) != Some(SeqStatus::Decoding) {
        out.extend(runner.step(&mut e, &mut NoConnector).expect("step"));
    }
    runner.pause(2).expect("pauses");
    let err = runner.export(&e, 2).unwrap_err().to_string();
    assert!(err.contains("cannot move"), "{err}");
}
