//! Sliding-window layers' KV in the runner: once a step is done, the blocks a local layer's
//! window has moved past leave the pool, with no token changed.

use super::*;
use crate::testing::TINY_WINDOW;

/// A connector that reads nothing but keeps every block (the default): the reference run.
struct KeepsBlocks;

impl KvConnector for KeepsBlocks {}

/// What a run gave: its tokens, the most pool blocks a local group held after any step, and
/// the blocks the global group held when the last step began.
fn run(
    model: &std::sync::Arc<Model>,
    prompt: &[u32],
    n: usize,
    kv_blocks: usize,
    c: &mut dyn KvConnector,
) -> Result<Run> {
    let mut e = engine_with(model, BS, kv_blocks, 512);
    let groups = e.kv().groups().clone();
    assert_eq!(groups.count(), 2, "one local layer and one global one, a group each");
    let local = (0..2).find(|&g| groups.window(g).is_some()).expect("a local group");
    let mut runner = BatchRunner::new(&e, 4, true);
    let mut outs = runner.add(&mut e, c, 1, spec(prompt, &params(n), Role::Generate))?;
    let mut r = Run { tokens: Vec::new(), most_local: 0, global: 0, kv_len: 0 };
    loop {
        for o in outs.drain(..) {
            match o.event {
                Event::Delta(p, _) => r.tokens.extend(p.tokens),
                Event::Done { .. } => {
                    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks(), "leak");
                    return Ok(r);
                }
            }
        }
        if let Some(&seq) = e.kv().seqs.keys().next() {
            r.most_local = r.most_local.max(e.kv().group_blocks(seq, local).unwrap());
            r.global = e.kv().group_blocks(seq, 1 - local).unwrap();
            r.kv_len = e.kv().len(seq).unwrap();
        }
        outs = runner.step(&mut e, c).expect("step");
    }
}

const BS: usize = 16;

struct Run {
    tokens: Vec<u32>,
    most_local: usize,
    global: usize,
    kv_len: usize,
}

/// The count: over a 4,096-token sequence (a 4,000-token prompt in chunks of 512,
/// then decoding) the local layer never holds more blocks than its window spans plus the one
/// being filled once a step is done, while the global layer holds all 256; the tokens are
/// those of a run that keeps every block, whose local layer holds all 256 too. So the pool
/// need not hold 256 blocks of every layer: 150 logical blocks (the memory of 150 × 2 layers)
/// run it, where keeping every block is refused at once.
#[test]
fn a_local_layers_kv_blocks_follow_the_window() {
    let model = TinyModel { arch: TinyArch::Gemma3, context: 4200, ..TinyModel::default() }.build();
    let prompt: Vec<u32> = (0..4000u32).map(|i| 33 + (i * 7) % 150).collect();
    let freed = run(&model, &prompt, 98, 150, &mut NoConnector).expect("runs in 150 blocks");
    let kept = run(&model, &prompt, 98, 300, &mut KeepsBlocks).expect("runs in 300 blocks");
    assert_eq!(freed.tokens, kept.tokens, "letting go of what no query reads changes no token");
    assert_eq!(freed.tokens.len(), 98);
    assert_eq!(freed.kv_len, 4096, "the KV when the last step began");
    assert_eq!((freed.global, kept.global), (4096 / BS, 4096 / BS));
    assert_eq!(kept.most_local, 4096 / BS);
    assert!(
        freed.most_local <= TINY_WINDOW.div_ceil(BS) + 1,
        "a local layer held {} blocks of {BS} for a window of {TINY_WINDOW}",
        freed.most_local
    );
    let refused = run(&model, &prompt, 98, 150, &mut KeepsBlocks).err().expect("refused");
    assert!(matches!(refused, Error::KvExhausted { needed: 257, free: 150 }), "{refused}");
}
