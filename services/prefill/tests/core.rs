//! The prefill node's core on the tiny seeded model, without any network: in every push mode
//! the pieces it hands the transfer rebuild exactly the KV one engine computes, the first token
//! is generation's first token, a cached prefix gives the same KV and token as computing it,
//! bad jobs are refused, and a caller that leaves frees everything.

#![allow(clippy::unwrap_used)]

use std::time::Instant;

use bytes::Bytes;
use pdmesh_engine::testing::tiny_model;
use pdmesh_engine::{Engine, EngineConfig, GenerateParams, SamplingParams, generate};
use pdmesh_kv_transfer::{KvPiece, PushMode};
use pdmesh_prefill::core::{Done, Job, PrefillCore};
use pdmesh_prefill::error::PrefillError;
use tokio::sync::mpsc;

const BLOCK: usize = 4;

fn engine(blocks: usize) -> Engine {
    let cfg = EngineConfig {
        threads: 1,
        block_size: BLOCK,
        kv_blocks: blocks,
        max_batch_tokens: 8,
        ..Default::default()
    };
    Engine::new(tiny_model(), cfg).unwrap()
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 40 + (i * 7) % 200).collect()
}

fn job(prompt: Vec<u32>, push: PushMode) -> Job {
    Job {
        prompt,
        sampling: SamplingParams::default(),
        rng_position: 0,
        push,
        checksums: true,
        cached: Vec::new(),
        publish: true,
        span: tracing::Span::none(),
    }
}

/// A submitted job's two outputs.
struct Outputs {
    pieces: mpsc::Receiver<KvPiece>,
    done: mpsc::Receiver<Done>,
}

fn submit(c: &mut PrefillCore, j: Job) -> Result<(u64, Outputs), PrefillError> {
    let (ptx, pieces) = mpsc::channel(c.piece_capacity(j.prompt.len()));
    let (dtx, done) = mpsc::channel(1);
    let id = c.submit(j, ptx, Box::new(dtx), Instant::now())?;
    Ok((id, Outputs { pieces, done }))
}

fn run(c: &mut PrefillCore) {
    for _ in 0..1000 {
        if !c.has_work() {
            return;
        }
        c.step(Instant::now());
    }
    panic!("prefill never finished");
}

/// What one engine computes for `p`: its blocks and greedy first token.
fn reference(p: &[u32]) -> (Vec<Vec<u8>>, u32) {
    let mut e = engine(64);
    let params = GenerateParams { max_tokens: 1, ignore_eos: true, ..Default::default() };
    let first = generate(&mut e, p, &params, |_| true).unwrap().tokens[0];
    // A fresh engine: the unused slots of the tail block are zero, as in the prefill node's.
    let mut e = engine(64);
    let seq = e.create_sequence();
    for chunk in p.chunks(8) {
        e.step(&[pdmesh_engine::StepItem::prefill(seq, chunk, pdmesh_engine::Logits::None)])
            .unwrap();
    }
    let blocks = (0..p.len().div_ceil(BLOCK))
        .map(|i| {
            let mut b = Vec::new();
            e.read_block(seq, i, &mut b).unwrap();
            b
        })
        .collect();
    (blocks, first)
}

/// Rebuilds whole blocks from pieces (whole blocks or single layers of a run of blocks).
fn assemble(
    pieces: &mut mpsc::Receiver<KvPiece>,
    blocks: usize,
    bpb: usize,
    layers: usize,
) -> Vec<Vec<u8>> {
    let mut out = vec![vec![0u8; bpb]; blocks];
    let per_layer = bpb / layers;
    while let Ok(p) = pieces.try_recv() {
        let first = p.first_block as usize;
        match p.layer {
            None => {
                for (i, b) in p.data.chunks(bpb).enumerate() {
                    out[first + i].copy_from_slice(b);
                }
            }
            Some(l) => {
                let l = l as usize;
                for (i, b) in p.data.chunks(per_layer).enumerate() {
                    out[first + i][l * per_layer..(l + 1) * per_layer].copy_from_slice(b);
                }
            }
        }
    }
    out
}

#[test]
fn every_push_mode_ships_exactly_the_kv_one_engine_computes() {
    let p = prompt(23); // 6 blocks, the last partial; 3 chunks of 8
    let (want, first) = reference(&p);
    for mode in [PushMode::Layer, PushMode::Chunk, PushMode::Prompt] {
        let mut c = PrefillCore::new(engine(64), 4, 16, 2);
        let bpb = c.engine().kv().geometry().bytes_per_block();
        let layers = c.engine().kv().geometry().layers;
        let (_, mut o) = submit(&mut c, job(p.clone(), mode)).unwrap();
        run(&mut c);
        let got = assemble(&mut o.pieces, want.len(), bpb, layers);
        assert_eq!(got, want, "{mode}: the shipped KV differs");
        let Ok(Done::Computed { first_token, blocks, export, .. }) = o.done.try_recv() else {
            panic!("{mode}: no first token");
        };
        assert_eq!((first_token, blocks), (first, 6), "{mode}");
        let sums: Vec<u64> = want.iter().map(|b| pdmesh_kv_types::block_checksum(b)).collect();
        assert_eq!(export.checksums, sums, "{mode}: checksums");
        assert_eq!(export.computed_blocks.len(), 5, "{mode}: the full blocks, for the cache");
        let k = c.counts();
        assert_eq!((k.completed, k.free_blocks, k.queued, k.prefilling), (1, 64, 0, 0), "{mode}");
    }
}

#[test]
fn a_cached_prefix_gives_the_kv_and_token_of_computing_it() {
    let p = prompt(23);
    let (want, first) = reference(&p);
    let mut c = PrefillCore::new(engine(64), 4, 16, 2);
    let bpb = c.engine().kv().geometry().bytes_per_block();
    let layers = c.engine().kv().geometry().layers;
    let cached: Vec<Bytes> = want[..3].iter().map(|b| Bytes::from(b.clone())).collect();
    let (_, mut o) = submit(&mut c, Job { cached, ..job(p.clone(), PushMode::Chunk) }).unwrap();
    let _other = submit(&mut c, job(prompt(10), PushMode::Chunk)).unwrap();
    // Routers weigh hits against this: the cached blocks are not work left to do.
    assert_eq!(c.counts().backlog_tokens, (23 - 3 * BLOCK + 10) as u64);
    run(&mut c);
    assert_eq!(c.counts().backlog_tokens, 0, "finished prompts leave the backlog");
    assert_eq!(assemble(&mut o.pieces, want.len(), bpb, layers), want);
    let Ok(Done::Computed { first_token, export, .. }) = o.done.try_recv() else { panic!() };
    assert_eq!(first_token, first);
    assert_eq!(export.cached_tokens, 3 * BLOCK);
    assert_eq!(export.computed_blocks.len(), 2, "only what was computed here is published");
}

#[test]
fn bad_jobs_are_refused_and_the_queue_is_bounded() {
    let mut c = PrefillCore::new(engine(8), 1, 1, 2);
    let too_long = prompt(40); // 10 blocks, the pool has 8
    assert!(matches!(
        submit(&mut c, job(too_long, PushMode::Chunk)),
        Err(PrefillError::TooLong { need: 10, total: 8 })
    ));
    assert!(matches!(submit(&mut c, job(vec![], PushMode::Chunk)), Err(PrefillError::Invalid(_))));
    let bad_cache =
        Job { cached: vec![Bytes::from_static(b"short")], ..job(prompt(9), PushMode::Chunk) };
    assert!(matches!(submit(&mut c, bad_cache), Err(PrefillError::Invalid(_))));
    let all_cached = Job {
        cached: vec![Bytes::from(vec![0; c.engine().kv().geometry().bytes_per_block()]); 2],
        ..job(prompt(8), PushMode::Chunk)
    };
    assert!(
        matches!(submit(&mut c, all_cached), Err(PrefillError::Invalid(_))),
        "nothing left to compute"
    );
    let vocab = tiny_model().config.vocab as u32;
    assert!(matches!(
        submit(&mut c, job(vec![vocab], PushMode::Chunk)),
        Err(PrefillError::Engine(_))
    ));
    // One waiting prompt fills the queue of one.
    let (_a, _oa) = submit(&mut c, job(prompt(9), PushMode::Chunk)).unwrap();
    assert!(matches!(
        submit(&mut c, job(prompt(9), PushMode::Chunk)),
        Err(PrefillError::QueueFull(1))
    ));
    assert_eq!(c.counts().queued, 1);
}

#[test]
fn prompts_wait_for_room_in_the_pool_and_a_caller_that_leaves_frees_everything() {
    // Two 5-block prompts and a pool of 8: the second waits for the first.
    let mut c = PrefillCore::new(engine(8), 4, 4, 2);
    let (_, mut a) = submit(&mut c, job(prompt(20), PushMode::Chunk)).unwrap();
    let (_, b) = submit(&mut c, job(prompt(20), PushMode::Chunk)).unwrap();
    c.step(Instant::now());
    let k = c.counts();
    assert_eq!((k.prefilling, k.queued), (1, 1), "the second prompt waits for blocks");
    // The second caller leaves while waiting; the first finishes.
    drop(b);
    c.sweep();
    run(&mut c);
    assert!(matches!(a.done.try_recv(), Ok(Done::Computed { .. })));
    let k = c.counts();
    assert_eq!((k.completed, k.cancelled, k.free_blocks), (1, 1, 8));
    // A caller that leaves mid-prompt: its blocks come back at the next sweep.
    let (_, o) = submit(&mut c, job(prompt(20), PushMode::Chunk)).unwrap();
    c.step(Instant::now());
    assert!(c.counts().free_blocks < 8);
    drop(o);
    c.sweep();
    let k = c.counts();
    assert_eq!((k.cancelled, k.free_blocks, k.prefilling), (2, 8, 0));
    assert!(!c.has_work());
}
