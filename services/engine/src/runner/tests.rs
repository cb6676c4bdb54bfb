//! The batch runner's tests on the tiny model. Its finish rules run as one table in all three
//! roles: local generation, decode (KV pushed from a prefill run, first token sampled there)
//! and prefill (which stops at the first token whatever the rules say); decode must end
//! exactly as generation does, because it is the same runner. Resumes and moves are in
//! `resume`, lossy KV policies in `policy`.

use std::collections::HashMap;

use super::*;
use crate::connector::NoConnector;
use crate::engine::EngineConfig;
use crate::kv_cache::KvView;
use crate::testing::{BuildModel, TinyArch, TinyModel};

fn engine(model: &std::sync::Arc<Model>) -> Engine {
    // Small blocks and budget: the prompt spans blocks and is chunked over several steps.
    engine_with(model, 4, 64, 8)
}

/// A one-thread engine with blocks of `block_size`, `kv_blocks` of them, and steps of at most
/// `max_batch_tokens`.
fn engine_with(
    model: &std::sync::Arc<Model>,
    block_size: usize,
    kv_blocks: usize,
    max_batch_tokens: usize,
) -> Engine {
    let cfg =
        EngineConfig { threads: 1, block_size, kv_blocks, max_batch_tokens, ..Default::default() };
    Engine::new(std::sync::Arc::clone(model), cfg).expect("engine")
}

const PROMPT: &str = "<|im_start|>user\nthe one and the two and the one<|im_end|>\n";

/// What a run ended with.
#[derive(Debug, Clone, PartialEq)]
enum Ended {
    /// `evicted`: KV tokens a lossy policy evicted.
    Finished {
        tokens: Vec<u32>,
        reason: FinishReason,
        stop_token: Option<u32>,
        evicted: usize,
    },
    Prefilled {
        first_token: u32,
    },
}

/// A prefill run's export: the prompt's KV blocks, read as the sequence left.
#[derive(Default)]
struct Export {
    blocks: HashMap<u64, Vec<Vec<u8>>>,
}

impl KvConnector for Export {
    fn finished(&mut self, id: u64, seq: SeqId, kv: &KvView<'_>) -> Release {
        let n = kv.block_count(seq).expect("live");
        let blocks = (0..n)
            .map(|i| {
                let mut b = Vec::new();
                kv.read_block(seq, i, &mut b).expect("live");
                b
            })
            .collect();
        self.blocks.insert(id, blocks);
        Release::Free
    }
}

/// Decode's side in miniature: a prompt's KV that arrived from elsewhere.
struct Pushed {
    prompt_len: usize,
    blocks: Vec<Vec<u8>>,
}

impl KvConnector for Pushed {
    fn available(&mut self, _: u64, prompt: &[u32]) -> Option<usize> {
        assert_eq!(prompt.len(), self.prompt_len);
        Some(self.prompt_len)
    }

    fn load(&mut self, _: u64, seq: SeqId, engine: &mut Engine) -> Result<()> {
        engine.extend_sequence(seq, self.prompt_len)?;
        // Whole blocks (a prefill's), or a move's wire form.
        let layout = engine.kv_layout();
        let whole = self.blocks.iter().all(|b| b.len() == layout.bytes_per_block());
        let thin = if whole { 0 } else { layout.thin_blocks(self.prompt_len) };
        engine.write_wire_blocks(seq, 0, thin, self.blocks.iter().map(|b| &b[..]))
    }
}

/// A sequence of `role` from `prompt`; a generating one has text output.
fn spec(prompt: &[u32], params: &GenerateParams, role: Role) -> SeqSpec {
    let kind = match role {
        Role::Prefill => SeqKind::Prefill,
        Role::Generate => SeqKind::Generate { text: true, from: Origin::Here },
    };
    SeqSpec { prompt: prompt.to_vec(), params: params.clone(), rng_position: 0, seq: None, kind }
}

/// Generating sequence `s`, its output starting as `from`.
fn from(s: SeqSpec, from: Origin) -> SeqSpec {
    let SeqKind::Generate { text, .. } = s.kind else { panic!("a prefill sequence") };
    SeqSpec { kind: SeqKind::Generate { text, from }, ..s }
}

/// Steps `runner` until sequence 1 is done, cancelling it once `cancel_after` tokens came out.
fn drive(
    runner: &mut BatchRunner,
    engine: &mut Engine,
    connector: &mut dyn KvConnector,
    mut outputs: Vec<Output>,
    cancel_after: Option<usize>,
) -> Ended {
    let mut tokens = Vec::new();
    for _ in 0..1000 {
        for o in outputs.drain(..) {
            assert_eq!(o.id, 1);
            match o.event {
                Event::Delta(p, _) => tokens.extend(p.tokens),
                Event::Done { end, generated, kept, evicted, .. } => {
                    assert!(kept.is_none());
                    assert!(runner.is_empty());
                    assert_eq!(engine.kv().free_blocks(), engine.kv().total_blocks(), "leak");
                    return match end {
                        End::Finished { reason, stop_token } => {
                            assert_eq!(generated, tokens.len());
                            Ended::Finished { tokens, reason, stop_token, evicted }
                        }
                        End::Prefilled { first_token, .. } => Ended::Prefilled { first_token },
                        End::Failed(e) => panic!("failed: {e}"),
                    };
                }
            }
        }
        if cancel_after.is_some_and(|n| tokens.len() >= n) {
            outputs = runner.cancel(engine, connector, 1);
            continue;
        }
        outputs = runner.step(engine, connector).expect("step");
    }
    panic!("the sequence never ended");
}

fn generate_run(model: &std::sync::Arc<Model>, prompt: &[u32], c: &Case) -> Ended {
    let mut e = engine(model);
    let mut runner = BatchRunner::new(&e, 4, true);
    let out = runner
        .add(&mut e, &mut NoConnector, 1, spec(prompt, &c.params, Role::Generate))
        .expect("add");
    drive(&mut runner, &mut e, &mut NoConnector, out, c.cancel_after)
}

/// Prefill on one engine, then decode from its first token and KV on another.
fn prefill_run(model: &std::sync::Arc<Model>, prompt: &[u32], c: &Case) -> (Ended, Vec<Vec<u8>>) {
    let mut e = engine(model);
    let mut runner = BatchRunner::new(&e, 4, true);
    let mut export = Export::default();
    let out =
        runner.add(&mut e, &mut export, 1, spec(prompt, &c.params, Role::Prefill)).expect("add");
    let ended = drive(&mut runner, &mut e, &mut export, out, c.cancel_after);
    (ended, export.blocks.remove(&1).expect("exported"))
}

fn decode_run(model: &std::sync::Arc<Model>, prompt: &[u32], c: &Case) -> Ended {
    let (Ended::Prefilled { first_token }, blocks) = prefill_run(model, prompt, c) else {
        panic!("prefill did not prefill");
    };
    let mut e = engine(model);
    let mut runner = BatchRunner::new(&e, 4, false);
    let mut pushed = Pushed { prompt_len: prompt.len(), blocks };
    let s = from(spec(prompt, &c.params, Role::Generate), Origin::FirstToken(first_token));
    let out = runner.add(&mut e, &mut pushed, 1, s).expect("add");
    drive(&mut runner, &mut e, &mut pushed, out, c.cancel_after)
}

struct Case {
    name: &'static str,
    model: std::sync::Arc<Model>,
    params: GenerateParams,
    cancel_after: Option<usize>,
    /// What generation and decode end with.
    want: Ended,
}

impl Case {
    /// Runs `params` to its end, expecting nothing in particular.
    fn plain(model: &std::sync::Arc<Model>, params: GenerateParams) -> Self {
        let want = Ended::Prefilled { first_token: 0 };
        Case { name: "plain", model: model.clone(), params, cancel_after: None, want }
    }
}

fn params(max_tokens: usize) -> GenerateParams {
    GenerateParams { max_tokens, ignore_eos: true, ..Default::default() }
}

fn finished(tokens: &[u32], reason: FinishReason, stop_token: Option<u32>) -> Ended {
    Ended::Finished { tokens: tokens.to_vec(), reason, stop_token, evicted: 0 }
}

#[test]
fn one_set_of_finish_rules_for_every_role() {
    let base = TinyModel::default();
    let model = base.build();
    let prompt = model.tokenizer.encode(PROMPT).expect("tokenizes");
    assert!(prompt.len() > 8, "the prompt spans several blocks and steps");
    // The reference: what the model generates, greedily, with no rule but a length.
    let Ended::Finished { tokens: t, .. } = generate_run(
        &model,
        &prompt,
        &Case {
            name: "reference",
            model: model.clone(),
            params: params(8),
            cancel_after: None,
            want: finished(&[], FinishReason::Length, None),
        },
    ) else {
        panic!("no reference");
    };
    assert_eq!(t.len(), 8);
    // A later token that differs from every one before it, to be made EOS or a stop token.
    let k = (1..8).find(|&k| !t[..k].contains(&t[k])).expect("the model repeats itself");
    // A token whose text is one plain character, to be a stop string.
    let text = |id: u32| model.tokenizer.decode(&[id]);
    let s = (1..8)
        .find(|&s| {
            let x = text(t[s]);
            x.len() == 1 && x.is_ascii() && !model.tokenizer.decode(&t[..s]).contains(&x)
        })
        .expect("a token that is one plain character");
    let with_eos = |eos| TinyModel { eos: Some(eos), ..base }.build();
    let short = TinyModel { context: prompt.len() + 3, ..base }.build();

    let cases = vec![
        Case {
            name: "length",
            model: model.clone(),
            params: params(5),
            cancel_after: None,
            want: finished(&t[..5], FinishReason::Length, None),
        },
        Case {
            name: "eos ends it and is not output",
            model: with_eos(t[k]),
            params: GenerateParams { ignore_eos: false, ..params(8) },
            cancel_after: None,
            want: finished(&t[..k], FinishReason::Eos, Some(t[k])),
        },
        Case {
            name: "eos as the very first token",
            model: with_eos(t[0]),
            params: GenerateParams { ignore_eos: false, ..params(8) },
            cancel_after: None,
            want: finished(&[], FinishReason::Eos, Some(t[0])),
        },
        Case {
            name: "ignore_eos generates through it",
            model: with_eos(t[k]),
            params: params(8),
            cancel_after: None,
            want: finished(&t, FinishReason::Length, None),
        },
        Case {
            name: "stop token",
            model: model.clone(),
            params: GenerateParams { stop_tokens: vec![t[k]], ..params(8) },
            cancel_after: None,
            want: finished(&t[..k], FinishReason::Stop, Some(t[k])),
        },
        Case {
            name: "stop string (its token is output, its text never)",
            model: model.clone(),
            params: GenerateParams { stop_strings: vec![text(t[s])], ..params(8) },
            cancel_after: None,
            want: finished(&t[..=s], FinishReason::Stop, None),
        },
        Case {
            name: "context full",
            model: short,
            params: params(8),
            cancel_after: None,
            want: finished(&t[..3], FinishReason::ContextFull, None),
        },
        Case {
            name: "cancelled",
            model: model.clone(),
            params: params(8),
            cancel_after: Some(2),
            want: finished(&t[..2], FinishReason::Cancelled, None),
        },
        Case {
            name: "max_tokens 1",
            model: model.clone(),
            params: params(1),
            cancel_after: None,
            want: finished(&t[..1], FinishReason::Length, None),
        },
    ];
    for c in &cases {
        assert_eq!(generate_run(&c.model, &prompt, c), c.want, "generate: {}", c.name);
        assert_eq!(decode_run(&c.model, &prompt, c), c.want, "decode: {}", c.name);
        let (prefilled, _) = prefill_run(&c.model, &prompt, c);
        assert_eq!(prefilled, Ended::Prefilled { first_token: t[0] }, "prefill: {}", c.name);
    }
}

#[test]
fn stop_string_text_never_leaks_and_the_tail_is_flushed() {
    let model = TinyModel::default().build();
    let prompt = model.tokenizer.encode(PROMPT).expect("tokenizes");
    let mut e = engine(&model);
    let mut runner = BatchRunner::new(&e, 4, true);
    let run = |runner: &mut BatchRunner, e: &mut Engine, p: GenerateParams| {
        let out =
            runner.add(e, &mut NoConnector, 1, spec(&prompt, &p, Role::Generate)).expect("add");
        let mut text = String::new();
        let mut outs = out;
        loop {
            for o in outs.drain(..) {
                match o.event {
                    Event::Delta(p, _) => text.push_str(&p.text),
                    Event::Done { end, .. } => return (text, end),
                }
            }
            outs = runner.step(e, &mut NoConnector).expect("step");
        }
    };
    let (all, _) = run(&mut runner, &mut e, params(8));
    assert_eq!(all, model.tokenizer.decode(&generate_tokens(&model, &prompt, 8)));
    // Any two characters of the output as a stop string: everything before it, nothing of it.
    let chars: Vec<char> = all.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let (text, end) =
        run(&mut runner, &mut e, GenerateParams { stop_strings: vec![stop.clone()], ..params(8) });
    assert_eq!(text, all[..all.find(&stop).expect("in the output")]);
    assert!(matches!(end, End::Finished { reason: FinishReason::Stop, .. }), "{end:?}");
}

fn generate_tokens(model: &std::sync::Arc<Model>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut e = engine(model);
    crate::generate(&mut e, prompt, &params(n), |_| true).expect("generates").tokens
}

#[test]
fn waiting_sequences_do_not_hold_back_others_and_the_pool_bounds_admission() {
    let model = TinyModel::default().build();
    let prompt = model.tokenizer.encode(PROMPT).expect("tokenizes");
    let mut e = engine(&model);
    /// KV for sequence 1 never arrives.
    struct Never;
    impl KvConnector for Never {
        fn available(&mut self, id: u64, _: &[u32]) -> Option<usize> {
            (id != 1).then_some(0)
        }
    }
    let mut runner = BatchRunner::new(&e, 4, true);
    // 64 blocks of 4 tokens: each sequence promises (prompt + 100) / 4 blocks.
    let p = params(100);
    let per = (prompt.len() + 100).div_ceil(4);
    assert!(2 * per <= 64 && 3 * per > 64);
    for id in 1..=4 {
        runner.add(&mut e, &mut Never, id, spec(&prompt, &p, Role::Generate)).expect("add");
    }
    let plan = runner.plan(&mut e, &mut Never);
    // 1 waits for its KV without holding back 2 and 3; 4 waits for room in the pool.
    let status: Vec<_> = (1..=4).map(|id| runner.status(id)).collect();
    use SeqStatus::{Prefilling, Waiting};
    assert_eq!(status, [Some(Waiting), Some(Prefilling), Some(Prefilling), Some(Waiting)]);
    assert_eq!(runner.promised_blocks(), 2 * per);
    runner.run(&plan, &mut e, &mut Never, None).expect("step");
    runner.cancel(&mut e, &mut Never, 2);
    runner.plan(&mut e, &mut Never);
    assert_eq!(runner.status(4), Some(Prefilling), "room made, 4 admitted");
    for id in 1..=4 {
        runner.cancel(&mut e, &mut Never, id);
    }
    assert!(runner.is_empty());
    assert_eq!(e.kv().free_blocks(), 64);
    assert_eq!(runner.promised_blocks(), 0);
}

#[test]
fn bad_sequences_are_refused_before_any_step() {
    let model = TinyModel::default().build();
    let mut e = engine(&model);
    let mut runner = BatchRunner::new(&e, 4, true);
    let ok = spec(&[1, 2, 3], &params(4), Role::Generate);
    let mut add = |s: SeqSpec| runner.add(&mut e, &mut NoConnector, 9, s).map(|_| ()).unwrap_err();
    let vocab = model.config.vocab as u32;
    for (s, want) in [
        (SeqSpec { prompt: vec![], ..ok.clone() }, "empty"),
        (SeqSpec { prompt: vec![vocab], ..ok.clone() }, "outside the vocabulary"),
        (from(ok.clone(), Origin::FirstToken(vocab + 1)), "outside the vocabulary"),
        (SeqSpec { params: params(0), ..ok.clone() }, "max_tokens"),
        (SeqSpec { prompt: vec![1; 256], ..ok.clone() }, "context"),
        (
            SeqSpec {
                params: GenerateParams { stop_strings: vec!["x".into()], ..params(4) },
                kind: SeqKind::Generate { text: false, from: Origin::Here },
                ..ok.clone()
            },
            "text",
        ),
    ] {
        let e = add(s).to_string();
        assert!(e.contains(want), "{e} lacks {want:?}");
    }
}

#[test]
fn a_failed_load_fails_only_its_sequence() {
    let model = TinyModel::default().build();
    let mut e = engine(&model);
    struct Broken;
    impl KvConnector for Broken {
        fn available(&mut self, id: u64, _: &[u32]) -> Option<usize> {
            Some(if id == 1 { 4 } else { 0 })
        }
        fn load(&mut self, id: u64, _: SeqId, _: &mut Engine) -> Result<()> {
            if id == 1 { Err(Error::invalid("the cache went away")) } else { Ok(()) }
        }
    }
    let mut runner = BatchRunner::new(&e, 4, true);
    for id in [1, 2] {
        runner
            .add(&mut e, &mut Broken, id, spec(&[5, 6, 7, 8, 9], &params(2), Role::Generate))
            .expect("add");
    }
    let out = runner.step(&mut e, &mut Broken).expect("step");
    let failed: Vec<u64> = out
        .iter()
        .filter(|o| matches!(&o.event, Event::Done { end: End::Failed(_), .. }))
        .map(|o| o.id)
        .collect();
    assert_eq!(failed, vec![1]);
    assert!(runner.contains(2) && !runner.contains(1));
}

/// Each sampled token's report rides in the mark with the token, in order; a prefill run
/// hands the first token's report over with it; a first token sampled elsewhere gets none.
#[test]
fn logprob_reports_follow_their_tokens() {
    let model = TinyModel::default().build();
    let prompt = model.tokenizer.encode(PROMPT).expect("encodes");
    let params = GenerateParams {
        sampling: SamplingParams { logprobs: Some(3), ..Default::default() },
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    };
    // Generation here, or decoding from a prefill run's first token and KV (`pushed`).
    let run = |first_token: Option<u32>, pushed: Option<Vec<Vec<u8>>>| {
        let mut e = engine(&model);
        let mut runner = BatchRunner::new(&e, 4, pushed.is_none());
        let mut connector: Box<dyn KvConnector> = match pushed {
            Some(blocks) => Box::new(Pushed { prompt_len: prompt.len(), blocks }),
            None => Box::new(NoConnector),
        };
        let s = spec(&prompt, &params, Role::Generate);
        let s = match first_token {
            Some(t) => from(s, Origin::FirstToken(t)),
            None => s,
        };
        let mut out = runner.add(&mut e, connector.as_mut(), 1, s).expect("add");
        let (mut tokens, mut reports) = (Vec::new(), Vec::new());
        for _ in 0..100 {
            for o in out.drain(..) {
                match o.event {
                    Event::Delta(_, Some(mark)) => {
                        tokens.extend(mark.tokens);
                        reports.extend(mark.logprobs);
                    }
                    Event::Delta(_, None) => {}
                    Event::Done { end, .. } => {
                        assert!(matches!(end, End::Finished { .. }), "{end:?}");
                        return (tokens, reports);
                    }
                }
            }
            out = runner.step(&mut e, connector.as_mut()).expect("step");
        }
        panic!("never ended");
    };
    let (tokens, reports) = run(None, None);
    assert_eq!(tokens.len(), 6);
    assert_eq!(reports.iter().map(|r| r.token).collect::<Vec<_>>(), tokens);
    for r in &reports {
        // Greedy: the token is the most likely, first among its alternatives.
        assert_eq!(r.top.len(), 3);
        assert_eq!(r.top[0], (r.token, r.logprob));
        assert!(r.logprob <= 0.0 && r.top[1].1 <= r.top[0].1 && r.top[2].1 <= r.top[1].1);
    }
    // A prefill run reports the first token's.
    let mut e = engine(&model);
    let mut runner = BatchRunner::new(&e, 4, true);
    let mut export = Export::default();
    let mut out =
        runner.add(&mut e, &mut export, 1, spec(&prompt, &params, Role::Prefill)).expect("add");
    let mut prefilled = None;
    for _ in 0..100 {
        for o in out.drain(..) {
            if let Event::Done { end: End::Prefilled { first_token, logprobs, .. }, .. } = o.event {
                prefilled = Some((first_token, logprobs));
            }
        }
        if prefilled.is_some() {
            break;
        }
        out = runner.step(&mut e, &mut export).expect("step");
    }
    let (first, first_report) = prefilled.expect("prefill ended");
    assert_eq!(first, tokens[0]);
    assert_eq!(first_report.as_ref(), Some(&reports[0]));
    // Decoding from that first token: reports for the tokens sampled here only.
    let blocks = export.blocks.remove(&1).expect("exported");
    let (tokens2, reports2) = run(Some(first), Some(blocks));
    assert_eq!(tokens2, tokens);
    assert_eq!(reports2, reports[1..]);
}

/// Stall-free steps: a long prompt added beside a running stream is computed in chunks the
/// pacer sizes (here against a target no step can meet), where without a target it takes the
/// whole step budget; and pacing changes no token of either sequence.
#[test]
fn paced_steps_chunk_a_prompt_beside_a_stream_and_change_no_token() {
    use crate::pacing::{FIRST_CHUNK, MIN_CHUNK};
    let model = TinyModel::default().build();
    let stream = model.tokenizer.encode(PROMPT).expect("tokenizes");
    let long: Vec<u32> = stream.iter().cycle().take(120).copied().collect();
    let run = |target: Option<std::time::Duration>| {
        let mut e = engine_with(&model, 4, 128, 128);
        let mut runner = BatchRunner::new(&e, 4, true);
        runner.set_itl_target(&e, target);
        let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
        let collect = |outs: Vec<Output>, tokens: &mut HashMap<u64, Vec<u32>>| {
            for o in outs {
                if let Event::Delta(p, _) = o.event {
                    tokens.entry(o.id).or_default().extend(p.tokens);
                }
            }
        };
        let p = GenerateParams { ignore_eos: true, ..params(40) };
        let out = runner.add(&mut e, &mut NoConnector, 1, spec(&stream, &p, Role::Generate));
        collect(out.expect("add"), &mut tokens);
        // The stream decodes before the long prompt arrives.
        while tokens.get(&1).is_none_or(|t| t.len() < 2) {
            collect(runner.step(&mut e, &mut NoConnector).expect("step"), &mut tokens);
        }
        let out = runner.add(&mut e, &mut NoConnector, 2, spec(&long, &params(3), Role::Generate));
        collect(out.expect("add"), &mut tokens);
        let mut chunks = Vec::new();
        while !runner.is_empty() {
            let plan = runner.plan(&mut e, &mut NoConnector);
            let streaming = plan.iter().any(|s| s.id == 1 && s.work == Work::Decode);
            for s in &plan {
                if let (2, Work::Prefill { len, .. }, true) = (s.id, s.work, streaming) {
                    chunks.push(len);
                }
            }
            collect(runner.run(&plan, &mut e, &mut NoConnector, None).expect("step"), &mut tokens);
        }
        (chunks, tokens)
    };
    let (whole, plain) = run(None);
    let (paced, same) = run(Some(std::time::Duration::from_nanos(1)));
    assert_eq!(whole, [120], "unpaced: the whole prompt in one step beside the stream");
    // A first cautious chunk, then each step over the target halves it, down to the least.
    assert_eq!(paced, [FIRST_CHUNK, 32, MIN_CHUNK, 8], "paced");
    assert_eq!(plain, same, "pacing changed tokens");
    assert_eq!(plain[&1].len(), 40);
}

mod policy;
mod resume;
mod window;
