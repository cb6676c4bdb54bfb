//! The decode node's core and text streaming on the real model, without any network: local
//! prefill gives `generate`'s tokens, stop strings never leak, leases free reservations, bad KV
//! is refused, and a closed output frees the request.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pdmesh_decode::core::{Attach, DecodeCore, Event, Output, Start};
use pdmesh_decode::error::DecodeError;
use pdmesh_decode::text::{Pushed, TextStream};
use pdmesh_engine::{Engine, EngineConfig, GenerateParams, Model, SamplingParams, generate};

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(M.get_or_init(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(pdmesh_engine::DEFAULT_MODEL_PATH);
        Arc::new(Model::load(&p).expect("run `just fetch-model`"))
    }))
}

fn engine(blocks: usize) -> Engine {
    let cfg = EngineConfig { threads: 1, kv_blocks: blocks, ..Default::default() };
    Engine::new(model(), cfg).unwrap()
}

fn core(blocks: usize) -> DecodeCore {
    DecodeCore::new(engine(blocks), 8, Duration::from_millis(200), Duration::from_secs(10))
}

#[derive(Clone, Default)]
struct Sink {
    events: Arc<Mutex<Vec<Event>>>,
    closed: Arc<Mutex<bool>>,
}

impl Output for Sink {
    fn send(&mut self, e: Event) -> bool {
        self.events.lock().unwrap().push(e);
        !*self.closed.lock().unwrap()
    }
    fn is_closed(&self) -> bool {
        *self.closed.lock().unwrap()
    }
}

impl Sink {
    fn tokens(&self) -> Vec<u32> {
        let mut t = Vec::new();
        for e in self.events.lock().unwrap().iter() {
            if let Event::Delta(p) = e {
                t.extend(&p.tokens);
            }
        }
        t
    }
    fn finished(&self) -> bool {
        self.events.lock().unwrap().iter().any(|e| matches!(e, Event::Finished { .. }))
    }
}

fn prompt(text: &str) -> Vec<u32> {
    model().tokenizer.encode(text).unwrap()
}

fn attach(prompt: Vec<u32>, max_tokens: usize, start: Start) -> Attach {
    Attach {
        prompt,
        sampling: SamplingParams::default(),
        rng_position: 0,
        max_tokens,
        stops: Vec::new(),
        ignore_eos: true,
        start,
    }
}

fn run_until_done(c: &mut DecodeCore, sinks: &[&Sink]) {
    for _ in 0..10_000 {
        if sinks.iter().all(|s| s.finished()) {
            return;
        }
        c.step(Instant::now()).unwrap();
    }
    panic!("requests never finished");
}

#[test]
fn colocated_requests_give_generates_tokens_and_free_their_blocks() {
    let prompts = [prompt("The capital of France is"), prompt("One, two, three,")];
    let mut want = Vec::new();
    for p in &prompts {
        let params = GenerateParams { max_tokens: 12, ignore_eos: true, ..Default::default() };
        want.push(generate(&mut engine(64), p, &params, |_| true).unwrap().tokens);
    }
    let mut c = core(64);
    let now = Instant::now();
    let sinks = [Sink::default(), Sink::default()];
    for (p, s) in prompts.iter().zip(&sinks) {
        let (id, _, _) = c.reserve(p.len(), 12, None, now).unwrap();
        c.attach(id, attach(p.clone(), 12, Start::Local), Box::new(s.clone()), now).unwrap();
    }
    run_until_done(&mut c, &[&sinks[0], &sinks[1]]);
    assert_eq!(sinks[0].tokens(), want[0]);
    assert_eq!(sinks[1].tokens(), want[1]);
    let k = c.counts();
    assert_eq!((k.free_blocks, k.committed_blocks, k.completed), (64, 0, 2));
}

#[test]
fn reservations_are_bounded_leased_and_released() {
    let mut c = core(10);
    let t0 = Instant::now();
    // 10 blocks of 16 tokens: 100 + 50 tokens take all 10.
    let (a, blocks, lease) = c.reserve(100, 50, None, t0).unwrap();
    assert_eq!((blocks, lease), (7, Duration::from_millis(200)));
    assert!(matches!(c.reserve(1, 1, None, t0), Err(DecodeError::NoBlocks { need: 1, free: 0 })));
    assert!(c.release(a));
    assert!(!c.release(a), "released twice");
    let (b, _, _) = c.reserve(10, 10, Some(Duration::from_millis(50)), t0).unwrap();
    c.kv_begin(b).unwrap();
    assert_eq!(c.counts().transferring, 1);
    c.sweep(t0 + Duration::from_millis(49));
    assert_eq!(c.counts().transferring, 1, "expired early");
    c.sweep(t0 + Duration::from_millis(51));
    let k = c.counts();
    assert_eq!(
        (k.transferring, k.leases_expired, k.free_blocks, k.committed_blocks),
        (0, 1, 10, 0)
    );
    assert!(matches!(c.kv_end(b, 1), Err(DecodeError::UnknownReservation(_))));
    // Out-of-range and malformed requests.
    assert!(matches!(c.reserve(0, 5, None, t0), Err(DecodeError::Invalid(_))));
    assert!(matches!(c.reserve(5, 0, None, t0), Err(DecodeError::Invalid(_))));
    assert!(matches!(c.reserve(8000, 500, None, t0), Err(DecodeError::Invalid(_))));
}

#[test]
fn bad_kv_is_refused_and_frees_nothing_twice() {
    let mut c = core(16);
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let (id, blocks, _) = c.reserve(40, 8, None, t0).unwrap();
    assert_eq!(blocks, 3);
    assert!(
        matches!(c.kv_write(id, 0, &vec![0; bpb]), Err(DecodeError::Invalid(_))),
        "before begin"
    );
    c.kv_begin(id).unwrap();
    assert!(matches!(c.kv_begin(id), Err(DecodeError::Invalid(_))));
    assert!(c.kv_write(id, 0, &vec![0; bpb - 1]).is_err(), "partial block");
    assert!(c.kv_write(id, 1, &vec![0; bpb]).is_err(), "out of order");
    assert!(c.kv_write(id, 2, &vec![0; 2 * bpb]).is_err(), "past the prompt");
    c.kv_write(id, 0, &vec![0; 2 * bpb]).unwrap();
    assert!(c.kv_end(id, 3).is_err(), "ended one block short");
    c.kv_write(id, 2, &vec![0; bpb]).unwrap();
    c.kv_end(id, 3).unwrap();
    let sink = Sink::default();
    let p = vec![1u32; 40];
    assert!(
        matches!(
            c.attach(id, attach(p.clone(), 9, Start::FirstToken(5)), Box::new(sink.clone()), t0),
            Err(DecodeError::Invalid(_))
        ),
        "max_tokens past the reservation"
    );
    c.attach(id, attach(p, 8, Start::FirstToken(5)), Box::new(sink.clone()), t0).unwrap();
    run_until_done(&mut c, &[&sink]);
    assert_eq!(sink.tokens().len(), 8);
    assert_eq!(sink.tokens()[0], 5, "the prefill node's first token comes first");
    assert_eq!(c.counts().free_blocks, 16);
}

#[test]
fn closed_output_cancels_and_frees() {
    let mut c = core(32);
    let t0 = Instant::now();
    let p = prompt("Count to one hundred:");
    let (id, _, _) = c.reserve(p.len(), 200, None, t0).unwrap();
    let sink = Sink::default();
    c.attach(id, attach(p, 200, Start::Local), Box::new(sink.clone()), t0).unwrap();
    for _ in 0..3 {
        c.step(Instant::now()).unwrap();
    }
    *sink.closed.lock().unwrap() = true;
    c.sweep(Instant::now());
    let k = c.counts();
    assert_eq!((k.decoding, k.cancelled, k.free_blocks, k.committed_blocks), (0, 1, 32, 0));
    assert!(!c.has_work());
}

#[test]
fn stop_strings_across_tokens_never_leak() {
    let m = model();
    let text = "The quick brown fox jumps over the lazy dog. The end.";
    let ids = m.tokenizer.encode(text).unwrap();
    for stop in ["lazy dog", "x jumps", "end.", "The quick", "o"] {
        let mut ts = TextStream::new(vec![stop.to_string(), "never seen".into()]);
        let mut out = String::new();
        let mut stopped = false;
        for &id in &ids {
            match ts.push(&m.tokenizer, id) {
                Pushed::Text(p) => out.push_str(&p.text),
                Pushed::Stopped(p) => {
                    out.push_str(&p.text);
                    stopped = true;
                    break;
                }
            }
            assert!(!out.contains(stop), "{stop:?} leaked: {out:?}");
        }
        assert!(stopped, "{stop:?} not found");
        assert_eq!(out, text[..text.find(stop).unwrap()], "stop {stop:?}");
    }
    // Without a match everything comes out, tokens included, by the end.
    let mut ts = TextStream::new(vec!["lazy cat".into()]);
    let (mut out, mut toks) = (String::new(), Vec::new());
    for &id in &ids {
        if let Pushed::Text(p) = ts.push(&m.tokenizer, id) {
            out.push_str(&p.text);
            toks.extend(p.tokens);
        }
    }
    let tail = ts.finish();
    out.push_str(&tail.text);
    toks.extend(tail.tokens);
    assert_eq!(out, text);
    assert_eq!(toks, ids);
}
