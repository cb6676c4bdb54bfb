//! The engine on the real SmolLM2-135M-Instruct GGUF: tokenizer against llama.cpp's token ids,
//! greedy generation against a golden list produced with llama.cpp, bit-exact batch/chunk/thread/
//! SIMD invariance of logits, seeded sampling independent of batch composition, and no leaked
//! KV blocks. `just fetch-model` provides the model (CI runs it first).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use pdmesh_engine::{
    Engine, EngineConfig, GenerateParams, Logits, Message, Model, SamplingParams, SeqId, StepItem,
    StreamDecoder, generate, generate_batch,
};
use pdmesh_kernels::{Cut, Simd};

fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(pdmesh_engine::DEFAULT_MODEL_PATH);
        assert!(path.exists(), "{} is missing: run `just fetch-model`", path.display());
        Arc::new(Model::load(&path).expect("the default model loads"))
    }))
}

fn engine(threads: usize, simd: Option<Simd>) -> Engine {
    let cfg = EngineConfig {
        threads,
        kv_blocks: 128,
        max_batch_tokens: 256,
        backend: pdmesh_engine::BackendKind::Cpu { simd },
        ..Default::default()
    };
    Engine::new(model(), cfg).unwrap()
}

fn chat_ids(user: &str) -> Vec<u32> {
    let m = model();
    let text =
        m.tokenizer.chat_template().unwrap().render(&[Message::new("user", user)], true).unwrap();
    m.tokenizer.encode(&text).unwrap()
}

/// Token ids llama.cpp (0.3.36) gives for these strings with special-token parsing on.
#[test]
fn tokenizer_matches_llama_cpp() {
    let t = &model().tokenizer;
    let cases: &[(&str, &[u32])] = &[
        ("Hello world", &[19556, 905]),
        ("naïve café 東京 🚀", &[3546, 46494, 37366, 17097, 247, 126, 16736, 122, 15107, 244, 218]),
        ("  spaces\tand\nnewlines  ", &[216, 5600, 197, 397, 198, 2241, 5110, 256]),
        ("1234567890", &[33, 34, 35, 36, 37, 38, 39, 40, 41, 32]),
        ("<|im_start|>user\nHi<|im_end|>", &[1, 4093, 198, 26843, 2]),
        (
            "Ωmega ∑ 😀😃 العربية",
            &[
                153, 119, 93, 9005, 19995, 235, 40303, 218, 10813, 242, 221, 27819, 34966, 20602,
                31462, 23339, 43463,
            ],
        ),
        ("\u{0}\u{1}bytes\u{7f}", &[190, 191, 15829, 217]),
    ];
    for (text, want) in cases {
        assert_eq!(&t.encode(text).unwrap(), want, "{text:?}");
        assert_eq!(t.decode(want), *text, "decode of {text:?}");
    }
    assert_eq!(t.eos(), Some(2));
    assert!(t.is_eog(2) && t.is_eog(0) && !t.is_eog(1));
}

#[test]
fn chat_template_renders_like_llama_cpp() {
    // The prompt llama.cpp tokenizes for this chat (system prompt from the GGUF's template).
    let want: &[u32] = &[
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
        407, 19712, 8182, 2, 198, 1, 4093, 198, 26533, 549, 1296, 5608, 327, 10902, 1365, 30, 2,
        198, 1, 520, 9531, 198,
    ];
    assert_eq!(chat_ids("Give me three tips for sleeping better."), want);
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let t = &model().tokenizer;
    let text = "naïve café 東京 🚀 😀😃 العربية";
    let ids = t.encode(text).unwrap();
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        // Each chunk is a String, so it is valid UTF-8 by construction; check nothing is lost.
        out.push_str(&dec.push(t, id));
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);
    // "🚀" is split over byte tokens: the decoder must hold the first ones back.
    let rocket = t.encode("🚀").unwrap();
    assert!(rocket.len() > 1, "expected byte-level pieces, got {rocket:?}");
    let mut dec = StreamDecoder::new();
    for &id in &rocket[..rocket.len() - 1] {
        assert_eq!(dec.push(t, id), "", "emitted part of a character");
    }
    assert_eq!(dec.push(t, rocket[rocket.len() - 1]), "🚀");
    // A dangling partial character at the end becomes U+FFFD, not a panic or garbage bytes.
    let mut dec = StreamDecoder::new();
    dec.push(t, rocket[0]);
    assert_eq!(dec.finish(), "\u{FFFD}");
}

/// Greedy generations produced with llama.cpp (llama-cpp-python 0.3.36) on the same GGUF.
#[test]
fn greedy_generation_matches_llama_cpp_golden() {
    let goldens: &[(&str, &[u32])] = &[
        (
            "Give me three tips for sleeping better.",
            &[
                4590, 359, 1296, 5608, 288, 724, 346, 1947, 469, 2801, 2174, 42, 1116, 33, 30,
                1903, 22834, 274, 340, 39750, 284, 11540, 16350, 3967, 340, 39750, 284, 19206, 416,
                14527, 351, 2801,
            ],
        ),
        (
            "What causes the seasons on Earth?",
            &[
                504, 2591, 506, 12064, 335, 624, 6867, 359, 2952, 411, 260, 27067, 282, 624, 6867,
                30, 378, 2591, 506, 6867, 314, 37929, 418, 354, 7256, 282, 4723, 216, 34, 35, 30,
                37,
            ],
        ),
    ];
    let mut e = engine(2, None);
    for (prompt, want) in goldens {
        let params = GenerateParams { max_tokens: want.len(), ..Default::default() };
        let g = generate(&mut e, &chat_ids(prompt), &params, |_| true).unwrap();
        assert_eq!(&g.tokens, want, "{prompt:?}: {:?}", model().tokenizer.decode(&g.tokens));
    }
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks(), "generation leaked KV blocks");
}

/// All logits of `tokens` fed to a fresh sequence in the given chunk sizes.
fn logits_chunked(e: &mut Engine, tokens: &[u32], chunks: &[usize]) -> Vec<Vec<f32>> {
    let seq = e.create_sequence();
    let mut out = Vec::new();
    let mut at = 0;
    for &c in chunks {
        let l = e.step(&[StepItem::prefill(seq, &tokens[at..at + c], Logits::All)]).unwrap();
        for i in 0..l.len() {
            out.push(l.row(i).1.to_vec());
        }
        at += c;
    }
    assert_eq!(at, tokens.len());
    e.free_sequence(seq).unwrap();
    out
}

fn assert_bits_eq(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: row count");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{what}: logits of position {i} differ");
    }
}

#[test]
fn logits_are_chunk_invariant() {
    let tokens = chat_ids("Explain what a hash table is in two sentences.");
    let n = tokens.len();
    let mut e = engine(2, None);
    let whole = logits_chunked(&mut e, &tokens, &[n]);
    assert_bits_eq(
        &whole,
        &logits_chunked(&mut e, &tokens, &[7, 1, 20, n - 28]),
        "chunks 7/1/20/rest",
    );
    let ones = vec![1; n];
    assert_bits_eq(
        &whole,
        &logits_chunked(&mut e, &tokens, &ones),
        "one token per step (decode path)",
    );
}

#[test]
fn logits_are_batch_invariant() {
    let a = chat_ids("What is 17 times 23?");
    let b = chat_ids("Write a haiku about the ocean.");
    let mut e = engine(2, None);
    let alone = logits_chunked(&mut e, &a, &[a.len()]);

    // The same prompt sharing its steps with another prompt's chunks and with decodes.
    let sa = e.create_sequence();
    let sb = e.create_sequence();
    let sc = e.create_sequence();
    e.step(&[StepItem::prefill(sc, &b[..5], Logits::None)]).unwrap();
    let mut got = Vec::new();
    let split = 13;
    let l = e
        .step(&[
            StepItem::prefill(sb, &b[..9], Logits::All),
            StepItem::prefill(sa, &a[..split], Logits::All),
            StepItem::prefill(sc, &b[5..6], Logits::Last),
        ])
        .unwrap();
    for i in 0..l.len() {
        let ((item, _), row) = l.row(i);
        if item == 1 {
            got.push(row.to_vec());
        }
    }
    let l = e
        .step(&[
            StepItem::prefill(sc, &b[6..7], Logits::Last),
            StepItem::prefill(sa, &a[split..], Logits::All),
        ])
        .unwrap();
    for i in 0..l.len() {
        let ((item, _), row) = l.row(i);
        if item == 1 {
            got.push(row.to_vec());
        }
    }
    assert_bits_eq(&alone, &got, "in a mixed batch");
    for s in [sa, sb, sc] {
        e.free_sequence(s).unwrap();
    }
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks());
}

#[test]
fn logits_are_thread_and_simd_invariant() {
    let tokens = chat_ids("Who wrote Pride and Prejudice?");
    let reference = logits_chunked(&mut engine(2, None), &tokens, &[tokens.len()]);
    assert_bits_eq(
        &reference,
        &logits_chunked(&mut engine(1, None), &tokens, &[tokens.len()]),
        "1 thread",
    );
    assert_bits_eq(
        &reference,
        &logits_chunked(&mut engine(3, None), &tokens, &[tokens.len()]),
        "3 threads",
    );
    for simd in Simd::available() {
        let got = logits_chunked(&mut engine(2, Some(simd)), &tokens, &[tokens.len()]);
        assert_bits_eq(&reference, &got, simd.name());
    }
}

#[test]
fn forked_prefix_continues_like_a_fresh_sequence() {
    let tokens = chat_ids("List the planets of the solar system in order.");
    let mut e = engine(2, None);
    let fresh = logits_chunked(&mut e, &tokens, &[tokens.len()]);
    // Share the first 21 tokens (one full block + a partial one) and continue on a fork.
    let base = e.create_sequence();
    e.step(&[StepItem::prefill(base, &tokens[..21], Logits::None)]).unwrap();
    let used = e.kv().total_blocks() - e.kv().free_blocks();
    let fork: SeqId = e.fork_sequence(base).unwrap();
    assert_eq!(e.kv().total_blocks() - e.kv().free_blocks(), used, "fork copied blocks eagerly");
    let l = e.step(&[StepItem::prefill(fork, &tokens[21..], Logits::All)]).unwrap();
    let got: Vec<Vec<f32>> = (0..l.len()).map(|i| l.row(i).1.to_vec()).collect();
    assert_bits_eq(&fresh[21..], &got, "continuation on a fork");
    // The original still sees its own (unmodified) partial block.
    let l = e.step(&[StepItem::prefill(base, &tokens[21..22], Logits::Last)]).unwrap();
    assert_bits_eq(&fresh[21..22], &[l.row(0).1.to_vec()], "original after fork");
    e.free_sequence(fork).unwrap();
    e.free_sequence(base).unwrap();
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks());
}

#[test]
fn seeded_sampling_is_independent_of_batch_composition() {
    let sampling = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: 1234,
        ..Default::default()
    };
    let target = (
        chat_ids("Describe the color blue to someone who cannot see."),
        GenerateParams {
            sampling: sampling.clone(),
            max_tokens: 24,
            ignore_eos: true,
            ..Default::default()
        },
    );
    let mut e = engine(2, None);
    let alone = generate_batch(&mut e, std::slice::from_ref(&target), 4, |_, _| true).unwrap();
    let others: Vec<(Vec<u32>, GenerateParams)> = ["Hi", "What is 2+2?", "Name a colour."]
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let s = SamplingParams { temperature: 1.0, seed: i as u64, ..Default::default() };
            (
                chat_ids(p),
                GenerateParams { sampling: s, max_tokens: 10 + 5 * i, ..Default::default() },
            )
        })
        .collect();
    let mut batch = others.clone();
    batch.insert(2, target.clone());
    let together = generate_batch(&mut e, &batch, 4, |_, _| true).unwrap();
    assert_eq!(alone[0].tokens, together[2].tokens);
    assert_eq!(alone[0].tokens.len(), 24);
    // A different seed gives a different continuation (the seed is really used).
    let mut other = target.clone();
    other.1.sampling.seed = 99;
    let diff = generate_batch(&mut e, &[other], 1, |_, _| true).unwrap();
    assert_ne!(diff[0].tokens, alone[0].tokens);
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks(), "leaked KV blocks");
}

#[test]
fn step_validation_changes_nothing() {
    let mut e = engine(2, None);
    let s = e.create_sequence();
    let vocab = [model().config.vocab as u32];
    let cases: Vec<(Vec<StepItem<'_>>, &str)> = vec![
        (vec![], "at least one item"),
        (vec![StepItem::prefill(s, &[], Logits::Last)], "no tokens"),
        (vec![StepItem::prefill(s, &vocab, Logits::Last)], "outside the vocabulary"),
        (vec![StepItem::prefill(SeqId(999), &[1], Logits::Last)], "unknown sequence"),
        (
            vec![
                StepItem::prefill(s, &[1], Logits::Last),
                StepItem::prefill(s, &[2], Logits::Last),
            ],
            "twice",
        ),
    ];
    let mut cases = cases;
    for (scale, margin) in [(0.0, 30.0), (f32::NAN, 30.0), (1.0, -1.0), (1.0, f32::INFINITY)] {
        let cut = Logits::Cut(Cut { scale, margin, top_k: 0 });
        cases.push((vec![StepItem::prefill(s, &[1], cut)], "the scale must be finite and > 0"));
    }
    for (items, want) in cases {
        let err = e.step(&items).unwrap_err().to_string();
        assert!(err.contains(want), "{err} (wanted {want:?})");
    }
    let too_many = vec![1u32; 257];
    let err = e.step(&[StepItem::prefill(s, &too_many, Logits::None)]).unwrap_err().to_string();
    assert!(err.contains("budget"), "{err}");
    assert_eq!(e.seq_len(s).unwrap(), 0);
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks());

    // KV exhaustion is reported as such and leaves the pool untouched.
    let cfg = EngineConfig { threads: 1, kv_blocks: 2, max_batch_tokens: 64, ..Default::default() };
    let mut small = Engine::new(model(), cfg).unwrap();
    let s = small.create_sequence();
    let err = small.step(&[StepItem::prefill(s, &[1; 40], Logits::None)]).unwrap_err();
    assert!(matches!(err, pdmesh_engine::Error::KvExhausted { needed: 3, free: 2 }), "{err}");
    assert_eq!(small.kv().free_blocks(), 2);
}

/// Logits llama.cpp (llama-cpp-python 0.3.36, CPU, flash attention off) computes for this chat
/// prompt, then after two generated tokens, as exact f32 bit patterns: pdmesh reproduces its
/// arithmetic operation for operation, so these match bit for bit.
#[test]
fn logits_equal_llama_cpp_bit_for_bit() {
    let ids = [60usize, 504, 15319, 2, 0, 23];
    let want: [[u32; 6]; 3] = [
        [0x41c5eb37, 0x41c53532, 0x41c3300c, 0x40b375f6, 0x411597c4, 0x4188e042],
        [0x408749f4, 0x411141be, 0x40bfefc9, 0xc0b99546, 0xc024fea4, 0x41ac9b4c],
        [0x414da5f0, 0x415680da, 0x41096dcc, 0xbfdb26c8, 0xbea6d590, 0x40ee342a],
    ];
    let prompt = chat_ids("What is the capital of France?");
    let mut e = engine(2, None);
    let seq = e.create_sequence();
    let bits = |row: &[f32]| ids.map(|i| row[i].to_bits());
    let l = e.step(&[StepItem::prefill(seq, &prompt, Logits::Last)]).unwrap();
    assert_eq!(bits(l.last_of(0).unwrap()), want[0], "prompt logits");
    let l = e.step(&[StepItem::decode(seq, &[60])]).unwrap();
    assert_eq!(bits(l.last_of(0).unwrap()), want[1], "first decode step");
    let l = e.step(&[StepItem::decode(seq, &[23])]).unwrap();
    assert_eq!(bits(l.last_of(0).unwrap()), want[2], "second decode step");
}

#[test]
fn decode_logits_are_batch_invariant() {
    let a = chat_ids("What is the capital of France?");
    let b = chat_ids("Write a haiku about the ocean.");
    let mut e = engine(2, None);
    let run = |e: &mut Engine, crowd: bool| -> Vec<Vec<f32>> {
        let sa = e.create_sequence();
        let sb = e.create_sequence();
        e.step(&[StepItem::prefill(sa, &a, Logits::None)]).unwrap();
        e.step(&[StepItem::prefill(sb, &b[..10], Logits::None)]).unwrap();
        let mut rows = Vec::new();
        for (i, tok) in [60u32, 23, 39614].iter().enumerate() {
            let t = [*tok];
            let other = [b[10 + i]];
            let items = if crowd {
                vec![
                    StepItem::prefill(sb, &b[11 + i..12 + i], Logits::All),
                    StepItem::decode(sa, &t),
                    StepItem::decode(e.create_sequence(), &other),
                ]
            } else {
                vec![StepItem::decode(sa, &t)]
            };
            let idx = usize::from(crowd);
            let l = e.step(&items).unwrap();
            rows.push(l.last_of(idx).unwrap().to_vec());
        }
        rows
    };
    let alone = run(&mut e, false);
    let crowded = run(&mut e, true);
    assert_bits_eq(
        &alone,
        &crowded,
        "decode tokens sharing steps with a prefill and other decodes",
    );
}

#[test]
fn generation_ends_on_stop_tokens_and_eos() {
    let mut e = engine(2, None);
    let prompt = chat_ids("What causes the seasons on Earth?");
    // Greedy starts 504, 2591, 506, 12064 (golden above): stop on the fourth.
    let params = GenerateParams { max_tokens: 32, stop_tokens: vec![12064], ..Default::default() };
    let g = generate(&mut e, &prompt, &params, |_| true).unwrap();
    assert_eq!(g.tokens, [504, 2591, 506]);
    assert_eq!((g.finish, g.stop_token), (pdmesh_engine::FinishReason::Stop, Some(12064)));
    // This prompt's greedy answer ends by itself with <|im_end|> after 26 tokens (llama.cpp agrees).
    let prompt = chat_ids("List the planets of the solar system in order.");
    let params = GenerateParams { max_tokens: 48, ..Default::default() };
    let g = generate(&mut e, &prompt, &params, |_| true).unwrap();
    assert_eq!(
        (g.finish, g.stop_token, g.tokens.len()),
        (pdmesh_engine::FinishReason::Eos, Some(2), 26)
    );
    // ignore_eos keeps going to the length limit.
    let params = GenerateParams { max_tokens: 30, ignore_eos: true, ..Default::default() };
    let g = generate(&mut e, &prompt, &params, |_| true).unwrap();
    assert_eq!((g.finish, g.tokens.len()), (pdmesh_engine::FinishReason::Length, 30));
    // A callback that says stop cancels the request and frees its blocks.
    let mut seen = 0;
    let g = generate(&mut e, &prompt, &params, |_| {
        seen += 1;
        seen < 5
    })
    .unwrap();
    assert_eq!((g.finish, g.tokens.len()), (pdmesh_engine::FinishReason::Cancelled, 5));
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks());
}

/// The disaggregation contract at engine level: KV computed on one engine, copied block by block
/// into another engine's pool (different block ids), continues there exactly as on the first.
#[test]
fn kv_moved_between_engines_decodes_identically() {
    let tokens = chat_ids("Why is the sky blue?");
    let mut a = engine(1, None);
    let mut b = engine(1, None);
    // Occupy b's first blocks so the copy lands on other block ids than on a.
    let filler = b.create_sequence();
    b.extend_sequence(filler, 40).unwrap();

    let sa = a.create_sequence();
    let first = {
        let l = a.step(&[StepItem::prefill(sa, &tokens, Logits::Last)]).unwrap();
        let row = l.last_of(0).unwrap();
        row.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).unwrap().0 as u32
    };
    let sb = b.create_sequence();
    b.extend_sequence(sb, tokens.len()).unwrap();
    assert_eq!(b.sequence_blocks(sb).unwrap(), a.sequence_blocks(sa).unwrap());
    let mut bytes = Vec::new();
    for i in 0..a.sequence_blocks(sa).unwrap() {
        bytes.clear();
        a.read_block(sa, i, &mut bytes).unwrap();
        b.write_block(sb, i, &bytes).unwrap();
    }
    let mut tok = [first];
    for step in 0..8 {
        let la = a.step(&[StepItem::decode(sa, &tok)]).unwrap().last_of(0).unwrap().to_vec();
        let lb = b.step(&[StepItem::decode(sb, &tok)]).unwrap().last_of(0).unwrap().to_vec();
        assert_bits_eq(
            std::slice::from_ref(&la),
            &[lb],
            &format!("decode step {step} after the move"),
        );
        tok = [la.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).unwrap().0 as u32];
    }
    assert!(b.write_block(sb, 99, &bytes).is_err(), "wrote past the sequence's blocks");
    assert!(b.extend_sequence(sb, 1 << 20).is_err(), "extended past the context");
}
