//! Marks and moves: a sequence resumed from any mark, or paused and moved with its KV,
//! continues bit-identically, and resumed tokens are checked.

use super::*;

/// Every output of one sequence's run, in order, and how it ended.
fn run_marked(
    model: &std::sync::Arc<Model>,
    s: SeqSpec,
) -> (Vec<(Piece, Option<Mark>)>, FinishReason) {
    run_marked_with(model, s, &mut NoConnector)
}

/// `run_marked` with the prompt's KV from `connector`.
fn run_marked_with(
    model: &std::sync::Arc<Model>,
    s: SeqSpec,
    connector: &mut dyn KvConnector,
) -> (Vec<(Piece, Option<Mark>)>, FinishReason) {
    let mut e = engine(model);
    let mut runner = BatchRunner::new(&e, 4, false);
    let mut outs = runner.add(&mut e, connector, 1, s).expect("add");
    let mut events = Vec::new();
    loop {
        for o in outs.drain(..) {
            match o.event {
                Event::Delta(p, m) => events.push((p, m)),
                Event::Done { end: End::Finished { reason, .. }, .. } => return (events, reason),
                Event::Done { end, .. } => panic!("ended with {end:?}"),
            }
        }
        outs = runner.step(&mut e, connector).expect("step");
    }
}

#[test]
fn a_sequence_resumed_at_any_mark_continues_bit_identically() {
    let model = TinyModel::default().build();
    let prompt = model.tokenizer.encode(PROMPT).expect("tokenizes");
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.9,
            seed: 11,
            repetition_penalty: 1.2,
            ..Default::default()
        },
    ] {
        let p = GenerateParams { sampling, ..params(24) };
        let (plain, _) = run_marked(&model, spec(&prompt, &p, Role::Generate));
        // A stop string that begins with a character of the output and never completes holds
        // text back wherever that character comes out, so marks fall where text lags tokens.
        let c = plain.iter().flat_map(|(p, _)| p.text.chars()).nth(2).expect("long enough");
        let stops = vec![format!("{c}\u{1}"), "never in the output \u{2}".to_string()];
        let p = GenerateParams { stop_strings: stops, ..p };
        let whole = spec(&prompt, &p, Role::Generate);
        let (events, reason) = run_marked(&model, whole.clone());
        let text = |e: &[(Piece, Option<Mark>)]| e.iter().map(|(p, _)| p.text.clone()).collect();
        let tokens = |e: &[(Piece, Option<Mark>)]| -> Vec<u32> {
            e.iter().flat_map(|(_, m)| m.iter().flat_map(|m| m.tokens.clone())).collect()
        };
        let (want_text, want_tokens): (String, Vec<u32>) = (text(&events), tokens(&events));
        for (i, (_, mark)) in events.iter().enumerate() {
            let Some(mark) = mark else { continue };
            let sent = &events[..=i];
            let generated = tokens(sent);
            if generated.len() >= p.max_tokens || i + 1 == events.len() {
                continue;
            }
            let resumed = SeqSpec {
                rng_position: mark.rng_position,
                ..from(
                    whole.clone(),
                    Origin::Resumed { tokens: generated.clone(), first_token: None },
                )
            };
            // Prefilled here, or the prompt's KV and first token from a prefill run.
            let (Ended::Prefilled { first_token }, blocks) =
                prefill_run(&model, &prompt, &Case::plain(&model, p.clone()))
            else {
                panic!("prefill did not prefill");
            };
            let mut pushed = Pushed { prompt_len: prompt.len(), blocks };
            let again =
                Origin::Resumed { tokens: generated.clone(), first_token: Some(first_token) };
            let moved = from(resumed.clone(), again);
            for (how, (rest, r)) in [
                ("prefilled here", run_marked(&model, resumed)),
                ("pushed", run_marked_with(&model, moved, &mut pushed)),
            ] {
                let got_text: String = text(sent) + &text(&rest);
                assert_eq!(got_text, want_text, "text resumed after event {i}, {how}");
                let got = [generated.clone(), tokens(&rest)].concat();
                assert_eq!(got, want_tokens, "tokens after event {i}, {how}");
                assert_eq!(r, reason, "finish after event {i}, {how}");
            }
        }
        // Held text (a stop string's first character, an incomplete character) comes out with
        // the next token: the replay must have rebuilt that state to match.
        assert!(events.iter().any(|(p, _)| p.tokens.len() > 1), "no text held: {events:?}");
    }
}

#[test]
fn resumed_tokens_are_checked() {
    let model = TinyModel::default().build();
    let mut e = engine(&model);
    let mut runner = BatchRunner::new(&e, 4, true);
    let p = params(4);
    let ok = spec(&[1, 2, 3], &p, Role::Generate);
    let vocab = model.config.vocab as u32;
    let resumed = |tokens: Vec<u32>, first_token| Origin::Resumed { tokens, first_token };
    for (s, want) in [
        (from(ok.clone(), resumed(vec![5; 4], None)), "leave none of max_tokens"),
        (from(ok.clone(), resumed(vec![5, vocab], None)), "outside the vocabulary"),
        (from(ok.clone(), resumed(vec![5], Some(6))), "not the resumed"),
        (from(ok.clone(), resumed(vec![], None)), "no resumed tokens"),
        (from(ok.clone(), Origin::HandedOff { tokens: vec![] }), "no resumed tokens"),
        (
            SeqSpec {
                prompt: vec![1; 254],
                params: params(8),
                ..from(ok.clone(), resumed(vec![5; 3], None))
            },
            "context",
        ),
    ] {
        let err = runner.add(&mut e, &mut NoConnector, 9, s).expect_err(want).to_string();
        assert!(err.contains(want), "{err}");
    }
}

/// Also for a model with a sliding window, whose local layers let go of the blocks the window
/// left before the move: they go as zeros that no later query reads.
#[test]
fn a_paused_sequence_moves_with_its_kv_or_stays_and_continues_bit_identically() {
    for arch in [TinyArch::Llama, TinyArch::Gemma3] {
        moves_or_stays(arch);
    }
}

fn moves_or_stays(arch: TinyArch) {
    let model = TinyModel { arch, ..TinyModel::default() }.build();
    let prompt = model.tokenizer.encode(PROMPT).expect("tokenizes");
    let sampling = SamplingParams { temperature: 0.9, seed: 5, ..Default::default() };
    let p = GenerateParams { sampling, ..params(20) };
    let whole = spec(&prompt, &p, Role::Generate);
    let (events, reason) = run_marked(&model, whole.clone());
    let tokens = |e: &[(Piece, Option<Mark>)]| -> Vec<u32> {
        e.iter().flat_map(|(_, m)| m.iter().flat_map(|m| m.tokens.clone())).collect()
    };
    let want = tokens(&events);
    for at in [1, 4, 9] {
        let mut e = engine(&model);
        let mut runner = BatchRunner::new(&e, 4, false);
        let mut outs = runner.add(&mut e, &mut NoConnector, 1, whole.clone()).expect("add");
        let mut got: Vec<(Piece, Option<Mark>)> = Vec::new();
        while got.len() < at {
            got.extend(outs.drain(..).map(|o| match o.event {
                Event::Delta(p, m) => (p, m),
                Event::Done { .. } => panic!("ended before event {at}"),
            }));
            outs = runner.step(&mut e, &mut NoConnector).expect("step");
        }
        got.extend(outs.drain(..).filter_map(|o| match o.event {
            Event::Delta(p, m) => Some((p, m)),
            Event::Done { .. } => None,
        }));
        let paused = runner.pause(1).expect("decoding");
        let seq = *e.kv().seqs.keys().next().expect("one sequence");
        let released = e.kv().released_blocks(seq).expect("live");
        assert_eq!(released > 0, arch == TinyArch::Gemma3, "{arch:?}: {released} released");
        assert!(runner.pause(1).is_none(), "paused twice");
        let mut generated = tokens(&got);
        generated.extend(&paused.mark.tokens);
        assert_eq!(paused.kv_tokens, prompt.len() + generated.len() - 1);
        // Nothing runs while it is paused.
        assert!(runner.step(&mut e, &mut NoConnector).expect("step").is_empty());
        // Moved: a new engine gets its KV and continues from its tokens.
        let blocks = runner.export(&e, 1).expect("paused");
        // What left the window moves as its global layers only.
        let layout = e.kv_layout();
        let thin = layout.thin_blocks(paused.kv_tokens);
        assert_eq!(thin > 0, arch == TinyArch::Gemma3, "{arch:?}: {thin} thin blocks");
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(b.len(), layout.wire_block_bytes(i, thin), "{arch:?} block {i}");
        }
        assert!(thin == 0 || blocks[0].len() < layout.bytes_per_block());
        let mut pushed = Pushed { prompt_len: paused.kv_tokens, blocks };
        let moved = SeqSpec {
            rng_position: paused.mark.rng_position,
            ..from(whole.clone(), Origin::HandedOff { tokens: generated.clone() })
        };
        let (rest, r) = run_marked_with(&model, moved, &mut pushed);
        assert_eq!(
            [generated.clone(), tokens(&rest)].concat(),
            want,
            "{arch:?} moved at event {at}"
        );
        assert_eq!(r, reason);
        // Stayed: unpaused, it goes on where it stood.
        runner.unpause(1).expect("paused");
        let mut after = Vec::new();
        loop {
            let outs = runner.step(&mut e, &mut NoConnector).expect("step");
            let done = outs.iter().any(|o| matches!(o.event, Event::Done { .. }));
            after.extend(outs.into_iter().filter_map(|o| match o.event {
                Event::Delta(p, m) => Some((p, m)),
                Event::Done { .. } => None,
            }));
            if done {
                break;
            }
        }
        assert_eq!([generated, tokens(&after)].concat(), want, "{arch:?} stayed at event {at}");
    }
}
