//! The decode node's core and text streaming on the tiny seeded model, without any network:
//! local prefill gives `generate`'s tokens, stop strings never leak, leases free reservations,
//! bad KV is refused, and a closed output frees the request.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_decode::core::{Attach, DecodeCore, Event, Output, Start};
use pdmesh_decode::error::DecodeError;
use pdmesh_engine::testing::tiny_model;
use pdmesh_engine::{
    Engine, EngineConfig, GenerateParams, Model, Pushed, SamplingParams, TextStream, generate,
};

fn model() -> Arc<Model> {
    tiny_model()
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
            if let Event::Delta(p, _) = e {
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
        kv_policy: None,
        start,
        resumed: Vec::new(),
        span: tracing::Span::none(),
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
        let id = c.reserve(p.len(), 12, None, false, now).unwrap().id();
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
    let r = c.reserve(100, 50, None, false, t0).unwrap();
    let (a, blocks, lease) = (r.id(), r.prompt_blocks, r.lease);
    assert_eq!((blocks, lease), (7, Duration::from_millis(200)));
    assert!(matches!(
        c.reserve(1, 1, None, false, t0),
        Err(DecodeError::NoBlocks { need: 1, free: 0 })
    ));
    assert!(c.release(a));
    assert!(!c.release(a), "released twice");
    let b = c.reserve(10, 10, Some(Duration::from_millis(50)), false, t0).unwrap().id();
    c.sweep(t0 + Duration::from_millis(49));
    assert_eq!(c.counts().reserved, 1, "expired early");
    c.sweep(t0 + Duration::from_millis(51));
    let k = c.counts();
    assert_eq!((k.reserved, k.leases_expired, k.free_blocks, k.committed_blocks), (0, 1, 10, 0));
    assert!(matches!(c.kv_begin(b, false), Err(DecodeError::UnknownReservation(_))));
    // Once its transfer has begun, the stream holds the reservation however long the prompt
    // waits in the prefill node's queue; the stream's end settles it.
    let b = c.reserve(10, 10, Some(Duration::from_millis(50)), false, t0).unwrap().id();
    c.kv_begin(b, false).unwrap();
    assert_eq!(c.sweep(t0 + Duration::from_secs(60)), None, "no lease left to wait for");
    assert_eq!((c.counts().transferring, c.counts().leases_expired), (1, 1));
    c.kv_abort(b, DecodeError::Invalid("the stream broke".into()));
    let k = c.counts();
    assert_eq!((k.transferring, k.free_blocks, k.committed_blocks), (0, 10, 0));
    // Out-of-range and malformed requests.
    assert!(matches!(c.reserve(0, 5, None, false, t0), Err(DecodeError::Invalid(_))));
    assert!(matches!(c.reserve(5, 0, None, false, t0), Err(DecodeError::Invalid(_))));
    assert!(matches!(c.reserve(8000, 500, None, false, t0), Err(DecodeError::Invalid(_))));
}

#[test]
fn bad_kv_is_refused_and_frees_nothing_twice() {
    let mut c = core(16);
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let r = c.reserve(40, 8, None, false, t0).unwrap();
    let (id, blocks) = (r.id(), r.prompt_blocks);
    assert_eq!(blocks, 3);
    assert!(
        matches!(c.kv_write(id, 0, &vec![0; bpb]), Err(DecodeError::Invalid(_))),
        "before begin"
    );
    c.kv_begin(id, false).unwrap();
    assert!(matches!(c.kv_begin(id, false), Err(DecodeError::Invalid(_))));
    assert!(c.kv_write(id, 0, &vec![0; bpb - 1]).is_err(), "partial block");
    assert!(c.kv_write(id, 1, &vec![0; bpb]).is_err(), "out of order");
    assert!(c.kv_write(id, 2, &vec![0; 2 * bpb]).is_err(), "past the prompt");
    c.kv_write(id, 0, &vec![0; 2 * bpb]).unwrap();
    assert!(c.kv_end(id, 3, &[], t0).is_err(), "ended one block short");
    c.kv_write(id, 2, &vec![0; bpb]).unwrap();
    c.kv_end(id, 3, &[], t0).unwrap();
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
fn remote_writers_get_preallocated_blocks_and_quarantine_them() {
    let mut c = core(16);
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    // Without remote_kv the blocks have no addresses, so a writer is refused.
    let plain = c.reserve(40, 8, None, false, t0).unwrap();
    assert!(plain.pool_blocks.is_empty());
    assert!(matches!(c.kv_begin(plain.id(), true), Err(DecodeError::Invalid(_))));
    assert!(c.release(plain.id()));

    let r = c.reserve(40, 8, Some(Duration::from_millis(50)), true, t0).unwrap();
    assert_eq!(r.pool_blocks.len(), 3, "the prompt's blocks are allocated at once");
    assert_eq!(c.counts().free_blocks, 13);
    c.kv_begin(r.id(), true).unwrap();
    assert!(c.kv_write(r.id(), 0, &vec![0; bpb]).is_err(), "a writer's KV does not come by stream");
    // The router gives up on the reservation while the writer may still be putting: it is
    // gone but its blocks stay out of the pool until the writer's session ends.
    c.sweep(t0 + Duration::from_millis(60));
    assert_eq!(c.counts().leases_expired, 0, "an open session holds the reservation");
    assert!(c.release(r.id()));
    let k = c.counts();
    assert_eq!((k.cancelled, k.quarantined, k.free_blocks), (2, 1, 13));
    // 14 blocks: they fit the pool only once the 3 quarantined ones are back.
    assert!(c.reserve(120, 100, None, false, t0).is_err(), "quarantined blocks stay committed");
    c.writer_closed(r.id(), "p");
    let k = c.counts();
    assert_eq!((k.quarantined, k.free_blocks, k.committed_blocks), (0, 16, 0));

    // A session that ends without its commit fails the reservation and frees its blocks.
    let r = c.reserve(40, 8, None, true, t0).unwrap();
    c.kv_begin(r.id(), true).unwrap();
    c.writer_closed(r.id(), "p");
    let k = c.counts();
    assert_eq!((k.failed, k.free_blocks, k.transferring), (1, 16, 0));
}

#[test]
fn a_writer_that_gives_up_leaves_its_blocks_parked_and_the_kv_comes_by_stream() {
    let mut c = core(8);
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let r = c.reserve(40, 1, None, true, t0).unwrap();
    // Not before a writer's session is open.
    assert!(matches!(c.writer_abandoned(r.id()), Err(DecodeError::Invalid(_))));
    c.kv_begin(r.id(), true).unwrap();
    let old = r.pool_blocks.clone();
    c.writer_abandoned(r.id()).unwrap();
    let k = c.counts();
    assert_eq!((k.free_blocks, k.committed_blocks), (2, 6), "fresh blocks, old ones parked");
    assert!(matches!(c.writer_abandoned(r.id()), Err(DecodeError::Invalid(_))), "once only");
    // The stream writes the fresh blocks, which none of the writer's late puts can reach.
    c.kv_begin(r.id(), false).unwrap();
    let data: Vec<u8> = (0..3 * bpb).map(|i| (i % 251) as u8).collect();
    c.kv_write(r.id(), 0, &data).unwrap();
    c.kv_end(r.id(), 3, &[], t0).unwrap();
    let now: Vec<u32> =
        (0..3).map(|i| c.engine().pool_block(c.seq_of(r.id()).unwrap(), i).unwrap()).collect();
    assert!(now.iter().all(|b| !old.contains(b)), "{now:?} vs {old:?}");
    // The writer's session ends: the parked blocks come back, the KV stays.
    c.writer_closed(r.id(), "p");
    let k = c.counts();
    assert_eq!((k.free_blocks, k.committed_blocks, k.failed), (5, 3, 0));
    assert!(c.release(r.id()));
    assert_eq!(c.counts().free_blocks, 8);

    // No room for a second copy: refused, and the reservation is left as it was.
    let big = c.reserve(70, 1, None, true, t0).unwrap();
    c.kv_begin(big.id(), true).unwrap();
    assert!(matches!(c.writer_abandoned(big.id()), Err(DecodeError::NoBlocks { .. })));
    c.writer_closed(big.id(), "p");
    assert_eq!(c.counts().free_blocks, 8);
}

/// Plays the remote writer: puts `data` (whole blocks) into a reservation's staging blocks,
/// as a UCX put from another process would.
#[allow(unsafe_code)]
fn put_staged(staged: &pdmesh_kv_transfer::StagedBlocks, data: &[u8], bpb: usize) {
    for (i, block) in data.chunks_exact(bpb).enumerate() {
        // SAFETY: `addr(i)` starts one block of `bpb` bytes that the staging area keeps
        // allocated while `staged` lives, and nothing in this process reads it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(block.as_ptr(), staged.addr(i) as *mut u8, bpb) };
    }
}

/// A staged pool (a GPU's, where UCX cannot reach it): the writer's puts land in staging
/// blocks, the commit copies them into the reservation's own blocks (checked by verify
/// mode), and the staging blocks go back only once no writer can reach them.
#[test]
fn staged_kv_is_copied_in_at_the_commit_and_its_blocks_wait_for_the_writer() {
    use pdmesh_kv_transfer::StagingArea;
    let mut c = core(16);
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let area =
        StagingArea::new(pdmesh_kv_types::HostMemory::zeroed(4 * bpb).unwrap(), bpb).unwrap();
    let data: Vec<u8> = (0..2 * bpb).map(|i| (i % 239) as u8).collect();
    let sums: Vec<u64> = data.chunks(bpb).map(pdmesh_kv_types::block_checksum).collect();

    let r = c.reserve(20, 4, None, true, t0).unwrap();
    let staged = area.take(r.pool_blocks.len()).unwrap();
    put_staged(&staged, &data, bpb);
    assert!(c.stage(r.id(), staged));
    c.kv_begin(r.id(), true).unwrap();
    // Verify mode checks the pool's blocks: they hold what was put into the staging ones.
    let took = c.kv_end(r.id(), 2, &sums, t0).unwrap();
    assert!(took.is_some(), "the copy out of staging is reported");
    assert_eq!(area.free_blocks(), 2, "the writer's session is still open");
    c.writer_closed(r.id(), "p");
    assert_eq!(area.free_blocks(), 4);

    // A staged block corrupted on its way fails the reservation at the commit.
    let r = c.reserve(20, 4, None, true, t0).unwrap();
    let staged = area.take(2).unwrap();
    let mut bad = data.clone();
    bad[bpb + 3] ^= 1;
    put_staged(&staged, &bad, bpb);
    assert!(c.stage(r.id(), staged));
    c.kv_begin(r.id(), true).unwrap();
    assert!(matches!(c.kv_end(r.id(), 2, &sums, t0), Err(DecodeError::Corrupt { block: 1 })));
    c.writer_closed(r.id(), "p");
    assert_eq!(area.free_blocks(), 4);

    // Ended while its writer may still put: the staging blocks wait with the quarantine.
    let r = c.reserve(20, 4, None, true, t0).unwrap();
    assert!(c.stage(r.id(), area.take(2).unwrap()));
    c.kv_begin(r.id(), true).unwrap();
    assert!(c.release(r.id()));
    assert_eq!((c.counts().quarantined, area.free_blocks()), (1, 2));
    c.writer_closed(r.id(), "p");
    assert_eq!((c.counts().quarantined, area.free_blocks()), (0, 4));

    // KV that comes over a stream instead has no use for them.
    let r = c.reserve(20, 4, None, true, t0).unwrap();
    assert!(c.stage(r.id(), area.take(2).unwrap()));
    c.kv_begin(r.id(), false).unwrap();
    assert_eq!(area.free_blocks(), 4);
    assert!(!c.stage(12345, area.take(1).unwrap()), "no such reservation");
    assert_eq!(area.free_blocks(), 4, "dropped at once");
}

#[test]
fn verify_mode_catches_a_corrupted_block() {
    let mut c = core(16);
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let data: Vec<u8> = (0..2 * bpb).map(|i| (i % 251) as u8).collect();
    let sums: Vec<u64> = data.chunks(bpb).map(pdmesh_kv_types::block_checksum).collect();
    let r = c.reserve(20, 4, None, true, t0).unwrap();
    c.kv_begin(r.id(), false).unwrap();
    c.kv_write(r.id(), 0, &data).unwrap();
    c.kv_end(r.id(), 2, &sums, t0).unwrap();

    let r = c.reserve(20, 4, None, true, t0).unwrap();
    c.kv_begin(r.id(), false).unwrap();
    let mut bad = data.clone();
    bad[bpb + 7] ^= 0x40;
    c.kv_write(r.id(), 0, &bad).unwrap();
    assert!(matches!(c.kv_end(r.id(), 2, &sums, t0), Err(DecodeError::Corrupt { block: 1 })));
    let k = c.counts();
    // The good reservation (24 tokens, 2 blocks) is still held; the bad one is freed.
    assert_eq!((k.failed, k.committed_blocks), (1, 2));
}

#[test]
fn closed_output_cancels_and_frees() {
    let mut c = core(32);
    let t0 = Instant::now();
    let p = prompt("Count to one hundred:");
    let id = c.reserve(p.len(), 200, None, false, t0).unwrap().id();
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

#[test]
fn complete_kv_that_no_request_attaches_to_is_freed_at_its_lease() {
    // A router that died between the KV's commit and its Decode call must not strand the
    // blocks: complete KV waits for its request only a lease long.
    let mut c = core(16);
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let r = c.reserve(8, 4, None, false, t0).unwrap();
    c.kv_begin(r.id(), false).unwrap();
    c.kv_write(r.id(), 0, &vec![0; bpb]).unwrap();
    c.kv_end(r.id(), 1, &[], t0).unwrap();
    assert_eq!(c.sweep(t0 + Duration::from_millis(100)), Some(t0 + Duration::from_millis(200)));
    assert_eq!(c.counts().reserved, 1, "held until the lease runs out");
    c.sweep(t0 + Duration::from_millis(201));
    let k = c.counts();
    assert_eq!((k.reserved, k.leases_expired, k.free_blocks, k.committed_blocks), (0, 1, 16, 0));
}

/// Dropped when the core lets go of it: stands in for a transport's registration.
#[derive(Debug)]
struct Grant(Arc<AtomicBool>, u64);

impl pdmesh_kv_transfer::Grant for Grant {
    fn digest(&self) -> u64 {
        self.1
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

fn grant(digest: u64) -> (Box<dyn pdmesh_kv_transfer::Grant>, Arc<AtomicBool>) {
    let dropped = Arc::new(AtomicBool::new(false));
    (Box::new(Grant(dropped.clone(), digest)), dropped)
}

/// A reservation's remote access (its blocks registered for peers to write) lasts exactly
/// until its KV is complete, or until it ends, even while a writer holds its blocks
/// quarantined; an unknown reservation's grant is dropped at once.
#[test]
fn remote_access_is_revoked_at_commit_and_at_the_end() {
    use std::sync::atomic::Ordering::SeqCst;
    let mut c = core(16);
    let t0 = Instant::now();
    let r = c.reserve(40, 8, None, true, t0).unwrap();
    let (g, revoked) = grant(77);
    assert!(c.hold(r.id(), g));
    assert!(c.grants_remote(r.id()));
    // A session naming another grant's memory is refused; its own is accepted.
    assert!(matches!(c.check_grant(r.id(), 78), Err(DecodeError::Forbidden(_))));
    c.check_grant(r.id(), 77).unwrap();
    c.kv_begin(r.id(), true).unwrap();
    assert!(!revoked.load(SeqCst), "revoked while the writer puts");
    c.kv_end(r.id(), 3, &[], t0).unwrap();
    assert!(!c.grants_remote(r.id()));
    c.revoke_completed();
    assert!(revoked.load(SeqCst), "still writable after the commit");
    assert!(c.release(r.id()));

    let r = c.reserve(40, 8, None, true, t0).unwrap();
    let (g, revoked) = grant(1);
    assert!(c.hold(r.id(), g));
    c.kv_begin(r.id(), true).unwrap();
    assert!(c.release(r.id()));
    assert_eq!(c.counts().quarantined, 1);
    assert!(revoked.load(SeqCst), "a quarantined reservation stays writable");
    c.writer_closed(r.id(), "p");

    let (g, revoked) = grant(1);
    assert!(!c.hold(12345, g));
    assert!(revoked.load(SeqCst));
}

/// Every token a request generated, from its marks (its text may lag them).
/// Every token a request generated: those its marks carry, then those flushed at its end.
fn marked(s: &Sink) -> Vec<u32> {
    let mut t = Vec::new();
    for e in s.events.lock().unwrap().iter() {
        match e {
            Event::Delta(_, Some(m)) | Event::Moving { mark: m, .. } => t.extend(&m.tokens),
            Event::Delta(p, None) => t.extend(&p.tokens),
            _ => {}
        }
    }
    t
}

#[test]
fn a_draining_node_hands_one_request_off_with_its_kv_and_keeps_the_other() {
    let prompts = [prompt("The capital of France is"), prompt("One, two, three,")];
    let sampling = SamplingParams { temperature: 0.8, seed: 3, ..Default::default() };
    let mut want = Vec::new();
    for p in &prompts {
        let params = GenerateParams {
            max_tokens: 16,
            ignore_eos: true,
            sampling: sampling.clone(),
            ..Default::default()
        };
        want.push(generate(&mut engine(64), p, &params, |_| true).unwrap().tokens);
    }
    let now = Instant::now();
    let (mut a, mut b) = (core(64), core(64));
    let sinks = [Sink::default(), Sink::default()];
    let mut ids = Vec::new();
    for (p, s) in prompts.iter().zip(&sinks) {
        let id = a.reserve(p.len(), 16, None, false, now).unwrap().id();
        let at = Attach { sampling: sampling.clone(), ..attach(p.clone(), 16, Start::Local) };
        a.attach(id, at, Box::new(s.clone()), now).unwrap();
        ids.push(id);
    }
    for _ in 0..6 {
        a.step(now).unwrap();
    }
    assert_eq!(a.drain(), 2);
    assert!(matches!(a.reserve(4, 4, None, false, now), Err(DecodeError::Draining)));
    assert!(a.counts().draining);
    let moving = |s: &Sink| {
        s.events.lock().unwrap().iter().find_map(|e| match e {
            Event::Moving { mark, kv_tokens } => Some((mark.rng_position, *kv_tokens)),
            _ => None,
        })
    };
    let (rng, kv_tokens) = moving(&sinks[0]).expect("asked to move");
    assert!(moving(&sinks[1]).is_some(), "both were decoding");
    // Paused: nothing more comes out while they wait.
    let before = marked(&sinks[0]);
    a.step(now).unwrap();
    assert_eq!(marked(&sinks[0]), before);
    assert_eq!(kv_tokens, prompts[0].len() + before.len() - 1);

    // The first goes to node B with its KV, as a transport would deliver it.
    let (blocks, n) = a.export(ids[0]).unwrap();
    assert_eq!(n, kv_tokens);
    let to = b.reserve(kv_tokens, 16 + 1 - before.len(), None, true, now).unwrap().id();
    b.kv_begin(to, false).unwrap();
    for (i, block) in blocks.iter().enumerate() {
        b.kv_write(to, i, block).unwrap();
    }
    b.kv_end(to, blocks.len(), &[], now).unwrap();
    let moved = Sink::default();
    let at = Attach {
        sampling: sampling.clone(),
        rng_position: rng,
        resumed: before.clone(),
        ..attach(prompts[0].clone(), 16, Start::HandedOff)
    };
    b.attach(to, at, Box::new(moved.clone()), now).unwrap();
    a.moved(ids[0]);
    assert!(sinks[0].events.lock().unwrap().iter().any(|e| matches!(e, Event::Moved)));
    // The second stays: no node had room.
    a.stay(ids[1]).unwrap();
    assert!(a.stay(ids[1]).is_err(), "it stays once");
    run_until_done(&mut b, &[&moved]);
    run_until_done(&mut a, &[&sinks[1]]);
    assert_eq!([before, marked(&moved)].concat(), want[0], "moved with its KV");
    assert_eq!(marked(&sinks[1]), want[1], "stayed");
    assert!(a.is_empty());
    let k = a.counts();
    assert_eq!((k.moved, k.completed, k.committed_blocks), (1, 1, 0));
}

#[test]
fn a_request_is_cancelled_by_its_owner_and_id_attached_or_not_yet() {
    let now = Instant::now();
    let mut c = core(64);
    let p = prompt("The capital of France is");
    let running = c.reserve(p.len(), 50, None, false, now).unwrap().id();
    c.name(running, "acme".into(), "req-1".into());
    let sink = Sink::default();
    c.attach(running, attach(p.clone(), 50, Start::Local), Box::new(sink.clone()), now).unwrap();
    c.step(now).unwrap();
    let waiting = c.reserve(p.len(), 50, None, false, now).unwrap().id();
    c.name(waiting, "acme".into(), "req-2".into());
    // Another tenant's cancel of the same id finds nothing.
    assert!(!c.cancel("intruder", "req-1"));
    assert!(c.cancel("acme", "req-1"));
    let reason = |s: &Sink| {
        s.events.lock().unwrap().iter().find_map(|e| match e {
            Event::Finished { reason, .. } => Some(*reason),
            _ => None,
        })
    };
    assert_eq!(reason(&sink), Some(pdmesh_engine::FinishReason::Cancelled));
    // Not attached yet: it ends as soon as its request attaches.
    assert!(c.cancel("acme", "req-2"));
    let late = Sink::default();
    c.attach(waiting, attach(p, 50, Start::Local), Box::new(late.clone()), now).unwrap();
    assert_eq!(reason(&late), Some(pdmesh_engine::FinishReason::Cancelled));
    assert!(c.is_empty());
    assert!(!c.cancel("acme", "req-2"), "already gone");
    // Cancels find their request through an index, which forgets each request with it.
    assert_eq!(c.named_requests(), 0, "the index outlived its reservations");
    let again = c.reserve(3, 5, None, false, now).unwrap().id();
    c.name(again, "acme".into(), "req-3".into());
    c.name(again, "acme".into(), "req-4".into());
    assert!(!c.cancel("acme", "req-3"), "renamed: the old name is gone");
    assert_eq!(c.named_requests(), 1);
    assert!(c.release(again));
    assert_eq!(c.named_requests(), 0);
}

/// Growing reservations are promised blocks as tokens come. When the pool runs out, the
/// youngest is preempted (its stream ends `Preempted` mid-way and its blocks are freed) and
/// the older one finishes; the preempted one, recomputed from its prompt and its output so
/// far, finishes with exactly the tokens it would have had.
#[test]
fn a_growing_reservation_that_runs_out_is_preempted_and_recomputed_identically() {
    let prompts = [prompt("The capital of France is"), prompt("One, two, three,")];
    let sampling = SamplingParams { temperature: 0.8, seed: 5, ..Default::default() };
    let max = 40;
    let mut want = Vec::new();
    for p in &prompts {
        let params = GenerateParams {
            max_tokens: max,
            ignore_eos: true,
            sampling: sampling.clone(),
            ..Default::default()
        };
        want.push(generate(&mut engine(64), p, &params, |_| true).unwrap().tokens);
    }
    let bs = engine(1).config().block_size;
    let full: Vec<usize> = prompts.iter().map(|p| (p.len() + max).div_ceil(bs)).collect();
    // Each alone fits; both at full length do not.
    let pool = full[0].max(full[1]) + 1;
    let mut c = core(pool);
    let t0 = Instant::now();
    let sinks = [Sink::default(), Sink::default()];
    for (i, (p, s)) in prompts.iter().zip(&sinks).enumerate() {
        let at = t0 + Duration::from_millis(i as u64);
        let id = c.reserve_growing(p.len(), max, 4, None, false, at).unwrap().id();
        let a = Attach { sampling: sampling.clone(), ..attach(p.clone(), max, Start::Local) };
        c.attach(id, a, Box::new(s.clone()), at).unwrap();
    }
    let up_front: u32 = prompts.iter().map(|p| (p.len() + 4).div_ceil(bs) as u32).sum();
    assert_eq!(c.counts().committed_blocks, up_front, "only the first slice is promised");
    let preempted = |s: &Sink| {
        s.events
            .lock()
            .unwrap()
            .iter()
            .any(|e| matches!(e, Event::Failed(DecodeError::Preempted { .. })))
    };
    for _ in 0..10_000 {
        if sinks[0].finished() && preempted(&sinks[1]) {
            break;
        }
        c.step(Instant::now()).unwrap();
    }
    assert_eq!(sinks[0].tokens(), want[0], "the older one finishes undisturbed");
    assert!(preempted(&sinks[1]), "the younger one is preempted");
    let so_far = marked(&sinks[1]);
    assert!(!so_far.is_empty() && so_far.len() < max, "mid-stream: {} tokens", so_far.len());
    let k = c.counts();
    assert_eq!((k.preempted, k.failed, k.completed, k.committed_blocks), (1, 0, 1, 0));

    // Its caller continues it: the prompt and its output so far recomputed, the sampler where
    // its last mark left it.
    let rng = sinks[1]
        .events
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find_map(|e| match e {
            Event::Delta(_, Some(m)) => Some(m.rng_position),
            _ => None,
        })
        .unwrap();
    let p = &prompts[1];
    let id = c.reserve_growing(p.len(), max, so_far.len() + 4, None, false, t0).unwrap().id();
    let again = Sink::default();
    let a = Attach {
        sampling: sampling.clone(),
        rng_position: rng,
        resumed: so_far.clone(),
        ..attach(p.clone(), max, Start::Local)
    };
    c.attach(id, a, Box::new(again.clone()), t0).unwrap();
    run_until_done(&mut c, &[&again]);
    assert_eq!([so_far, marked(&again)].concat(), want[1], "recomputed bit-identically");
    let k = c.counts();
    assert_eq!((k.preempted, k.completed, k.committed_blocks), (1, 2, 0));
}

/// A Reserve whose caller gave up before the engine thread got to it (its reply has nowhere
/// to go: the call timed out while this node was hung) is freed at once, not at its lease:
/// nobody could ever name it to release it.
#[test]
fn a_reservation_whose_caller_left_is_freed_at_once() {
    use pdmesh_common::worker::Core;
    use pdmesh_decode::worker::{Command, Worker};
    let mut w = Worker::new(core(16));
    let reserve = |name: &str, reply| Command::Reserve {
        prompt_len: 20,
        max_tokens: 20,
        up_front: 20,
        lease: None,
        remote_kv: false,
        grant: None,
        request: ("alice".into(), name.into()),
        reply,
    };
    let (reply, gone) = tokio::sync::oneshot::channel();
    drop(gone);
    w.handle(reserve("r1", reply), Instant::now());
    let k = w.counts();
    assert_eq!((k.reserved, k.committed_blocks, k.free_blocks), (0, 0, 16));
    // A caller that waits gets its reservation, and it stays.
    let (reply, answer) = tokio::sync::oneshot::channel();
    w.handle(reserve("r2", reply), Instant::now());
    assert!(answer.blocking_recv().unwrap().is_ok());
    assert_eq!((w.counts().reserved, w.counts().committed_blocks), (1, 3));
}

/// Complete KV waits for its request at most a short grace, however long the node's default
/// lease: KV that completes long after its caller gave up (this node was hung) would otherwise
/// hold its blocks a whole lease, while the caller stopped releasing it at the lease it was
/// granted.
#[test]
fn complete_kv_past_its_granted_lease_waits_only_a_grace() {
    let mut c = DecodeCore::new(engine(16), 8, Duration::from_secs(60), Duration::from_secs(300));
    let t0 = Instant::now();
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let r = c.reserve(8, 4, Some(Duration::from_secs(1)), false, t0).unwrap();
    c.kv_begin(r.id(), false).unwrap();
    c.kv_write(r.id(), 0, &vec![0; bpb]).unwrap();
    let done = t0 + Duration::from_secs(20);
    c.kv_end(r.id(), 1, &[], done).unwrap();
    assert_eq!(c.sweep(done), Some(done + Duration::from_secs(10)));
    c.sweep(done + Duration::from_millis(10_001));
    let k = c.counts();
    assert_eq!((k.reserved, k.leases_expired, k.committed_blocks), (0, 1, 0));
}
