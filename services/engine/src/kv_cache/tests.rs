//! The KV cache's bookkeeping on a host pool: allocation, sharing, eviction, groups and
//! windows, and refcounts that stay exact under random operations.

use super::*;
use pdmesh_kernels::{KvBuffer, KvDtype};
use rand::{Rng, SeedableRng};

/// The bookkeeping with a host pool for its copies.
struct Cache {
    c: KvCache,
    store: KvBuffer,
}

impl std::ops::Deref for Cache {
    type Target = KvCache;
    fn deref(&self) -> &KvCache {
        &self.c
    }
}

impl std::ops::DerefMut for Cache {
    fn deref_mut(&mut self) -> &mut KvCache {
        &mut self.c
    }
}

impl Cache {
    fn append(&mut self, id: SeqId, n: usize) -> Result<Vec<KvSlot>> {
        self.c.append(id, n, &mut self.store)
    }
}

fn cache(blocks: usize) -> Cache {
    let g = KvGeometry { layers: 1, kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F32 };
    Cache { c: KvCache::new(g, blocks).unwrap(), store: KvBuffer::new(g, blocks).unwrap() }
}

/// Four layers, 1 and 3 global, 0 and 2 through a window of 6 tokens: two groups of two.
fn windowed(blocks: usize) -> Cache {
    let g = KvGeometry { layers: 4, kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F32 };
    let groups = KvGroups::windowed(&[true, false, true, false], 6);
    let c = KvCache::grouped(g, groups, blocks).unwrap();
    let store = KvBuffer::new(*c.pool_geometry(), c.pool_blocks()).unwrap();
    Cache { c, store }
}

/// `windowed`'s layout: layers 0 and 2 through the window.
fn windowed_layout(c: &KvCache) -> KvLayout {
    let local = pdmesh_kv_types::LayerMask::from_layers([0, 2]).unwrap();
    KvLayout {
        model_fingerprint: 1,
        geometry: *c.geometry(),
        window: Some(pdmesh_kv_types::KvWindow { tokens: 6, local }),
    }
}

/// Gemma 3's pattern (five local layers, then a global one) in its sizes' groups.
#[test]
fn groups_hold_layers_of_one_kind_in_units_of_their_gcd() {
    let pattern = |n: usize| (0..n).map(|l| (l + 1) % 6 != 0).collect::<Vec<_>>();
    for (layers, unit, count) in [(18, 3, 6), (26, 2, 13), (34, 1, 34), (48, 8, 6)] {
        let local = pattern(layers);
        let g = KvGroups::windowed(&local, 512);
        assert_eq!((g.unit(), g.count()), (unit, count), "{layers} layers");
        for (l, &is_local) in local.iter().enumerate() {
            let (group, at) = g.place(l);
            assert_eq!(g.window(group).is_some(), is_local, "layer {l}");
            assert_eq!(g.members[group][at], l);
        }
    }
    assert!(KvGroups::windowed(&[false, false], 512).is_whole(), "no local layer");
    let all = KvGroups::windowed(&[true; 4], 512);
    assert_eq!((all.count(), all.window(0)), (1, Some(512)), "every layer local");
}

/// Logical blocks go in and out in layer order whatever the groups; what the window let
/// go of reads as zeros and takes no write.
#[test]
fn grouped_blocks_scatter_gather_and_release() {
    let mut c = windowed(8);
    assert_eq!((c.total_blocks(), c.pool_blocks()), (8, 16));
    let s = c.create();
    let slots = c.append(s, 10).unwrap(); // 3 blocks, each in both groups
    assert_eq!(slots.len(), 20, "a slot per token per group");
    assert_eq!((c.free_blocks(), c.block_count(s).unwrap()), (5, 3));
    let bpb = c.geometry().bytes_per_block();
    let data: Vec<u8> = (0..3 * bpb).map(|i| (i % 251) as u8).collect();
    let layout = windowed_layout(&c);
    let writes = c.scatter(s, 0, (&layout, 0), data.chunks(bpb)).unwrap();
    assert_eq!(writes.len(), 6);
    let refs: Vec<(usize, &[u8])> = writes.iter().map(|(b, d)| (*b, &d[..])).collect();
    c.store.write_blocks(&refs).unwrap();
    let read = |c: &Cache, i: usize| {
        let mut out = Vec::new();
        KvView::new(&c.c, &c.store).read_block(s, i, &mut out).unwrap();
        out
    };
    assert_eq!(read(&c, 1), &data[bpb..2 * bpb]);
    // The next query (slot 10) sees slots 5..=10: block 0 (slots 0..4) has left.
    assert_eq!(c.release_window(s).unwrap(), 1);
    assert_eq!(c.release_window(s).unwrap(), 0, "once");
    assert_eq!((c.group_blocks(s, 0).unwrap(), c.group_blocks(s, 1).unwrap()), (2, 3));
    let bpl = c.geometry().bytes_per_layer();
    let zeroed: Vec<u8> = data[..bpb]
        .chunks(bpl)
        .enumerate()
        .flat_map(|(l, part)| if l % 2 == 0 { vec![0; bpl] } else { part.to_vec() })
        .collect();
    assert_eq!(read(&c, 0), zeroed, "local layers read as zeros, global ones as written");
    let e = c.scatter(s, 0, (&layout, 0), [&data[..bpb]]).unwrap_err();
    assert!(e.to_string().contains("let go"), "{e}");
    let e = c.scatter(s, 1, (&layout, 0), [&data[..bpb - 1]]).unwrap_err();
    assert!(e.to_string().contains("bytes"), "{e}");
    c.free(s).unwrap();
    assert_eq!(c.free_blocks(), 8);
    assert_eq!(c.peak_blocks(), 3, "six pool blocks at most: three logical ones");
}

/// A thin block (before the window) goes in as its global layers only and comes out the
/// same; the local group's block is not written, so it may be gone; a whole-sized or torn
/// thin block is refused.
#[test]
fn thin_blocks_carry_the_global_layers() {
    let mut c = windowed(8);
    let layout = windowed_layout(&c);
    let s = c.create();
    c.append(s, 10).unwrap();
    assert_eq!(layout.thin_blocks(10), 1, "the token at 10 sees 5..=10: block 0 is thin");
    let bpl = c.geometry().bytes_per_layer();
    let thin: Vec<u8> = (0..2 * bpl).map(|i| (i % 13) as u8 + 1).collect();
    assert_eq!(layout.wire_block_bytes(0, 1), thin.len());
    assert_eq!(c.release_window(s).unwrap(), 1, "block 0's local part is gone");
    let writes = c.scatter(s, 0, (&layout, 1), [&thin[..]]).unwrap();
    assert_eq!(writes.len(), 1, "the global group only");
    let refs: Vec<(usize, &[u8])> = writes.iter().map(|(b, d)| (*b, &d[..])).collect();
    c.store.write_blocks(&refs).unwrap();
    let mut out = Vec::new();
    KvView::new(&c.c, &c.store).read_wire_block(s, 0, (&layout, 1), &mut out).unwrap();
    assert_eq!(out, thin);
    let mut whole = Vec::new();
    KvView::new(&c.c, &c.store).read_block(s, 0, &mut whole).unwrap();
    assert_eq!((&whole[bpl..2 * bpl], &whole[3 * bpl..]), (&thin[..bpl], &thin[bpl..]));
    let e = c.scatter(s, 0, (&layout, 1), [&whole[..]]).unwrap_err();
    assert!(e.to_string().contains("on the wire"), "{e}");
    assert!(c.scatter(s, 0, (&layout, 1), [&thin[1..]]).is_err());
    // Past the cut, a block is whole again.
    let mut b1 = Vec::new();
    KvView::new(&c.c, &c.store).read_wire_block(s, 1, (&layout, 1), &mut b1).unwrap();
    assert_eq!(b1.len(), c.geometry().bytes_per_block());
}

#[test]
fn append_allocates_blocks_lazily() {
    let mut c = cache(8);
    let s = c.create();
    let slots = c.append(s, 5).unwrap();
    assert_eq!(c.blocks(s).unwrap().len(), 2);
    assert_eq!(slots[4], KvSlot { block: c.blocks(s).unwrap()[1], slot: 0 });
    assert_eq!(c.free_blocks(), 6);
    c.append(s, 3).unwrap();
    assert_eq!(c.free_blocks(), 6);
    c.append(s, 1).unwrap();
    assert_eq!(c.free_blocks(), 5);
    c.free(s).unwrap();
    assert_eq!(c.free_blocks(), 8);
}

#[test]
fn exhaustion_changes_nothing() {
    let mut c = cache(2);
    let s = c.create();
    c.append(s, 6).unwrap();
    let e = c.append(s, 3).unwrap_err();
    assert!(matches!(e, Error::KvExhausted { needed: 1, free: 0 }), "{e}");
    assert_eq!(c.len(s).unwrap(), 6);
}

#[test]
fn fork_shares_then_copies_partial_block_on_write() {
    let mut c = cache(8);
    let a = c.create();
    c.append(a, 6).unwrap(); // blocks: full, partial(2/4)
    let b = c.fork(a).unwrap();
    assert_eq!(c.free_blocks(), 6);
    assert_eq!(c.blocks_needed(b, 1).unwrap(), 1); // copy-on-write of the partial block
    let slots = c.append(b, 1).unwrap();
    assert_ne!(slots[0].block, c.blocks(a).unwrap()[1], "wrote into a shared block");
    assert_eq!(c.blocks(a).unwrap()[0], c.blocks(b).unwrap()[0], "full block not shared");
    // `a` is now the only owner of its partial block: no copy needed.
    assert_eq!(c.blocks_needed(a, 1).unwrap(), 0);
    c.free(a).unwrap();
    c.free(b).unwrap();
    assert_eq!(c.free_blocks(), 8);
}

#[test]
fn eviction_closes_the_gap_and_counts_the_tokens() {
    let mut c = cache(8);
    let s = c.create();
    c.append(s, 14).unwrap(); // 3 full blocks and 2 tokens
    let before = c.blocks(s).unwrap().to_vec();
    let e = c.evict(s, &[3]).unwrap_err();
    assert!(e.to_string().contains("3 full blocks"), "the block being filled stays: {e}");
    c.evict(s, &[1, 0, 1]).unwrap();
    assert_eq!(c.blocks(s).unwrap(), &before[2..]);
    assert_eq!((c.len(s).unwrap(), c.evicted(s).unwrap(), c.position(s).unwrap()), (6, 8, 14));
    assert_eq!(c.free_blocks(), 6);
    // New tokens go on after the kept ones.
    let slots = c.append(s, 3).unwrap();
    assert_eq!(slots[0], KvSlot { block: before[3], slot: 2 });
    assert_eq!(c.position(s).unwrap(), 17);
}

#[test]
fn unknown_sequence_is_invalid_request() {
    let mut c = cache(2);
    assert!(matches!(c.free(SeqId(42)), Err(Error::InvalidRequest(_))));
    assert!(matches!(c.append(SeqId(42), 1), Err(Error::InvalidRequest(_))));
}

/// Random add/fork/append/free sequences never leak or double-free a block, and refcounts
/// always equal the number of table entries pointing at a block.
#[test]
fn no_leak_after_random_operations() {
    for seed in 0..40 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        // Odd seeds: two groups, one windowed, whose releases count too.
        let mut c = if seed % 2 == 0 { cache(64) } else { windowed(32) };
        let mut live: Vec<SeqId> = Vec::new();
        for _ in 0..400 {
            match rng.random_range(0..6) {
                0 => live.push(c.create()),
                1 if !live.is_empty() => {
                    let s = live[rng.random_range(0..live.len())];
                    live.push(c.fork(s).unwrap());
                }
                2 if !live.is_empty() => {
                    let s = live[rng.random_range(0..live.len())];
                    let _ = c.append(s, rng.random_range(1..9));
                }
                3 if !live.is_empty() => {
                    let s = live.swap_remove(rng.random_range(0..live.len()));
                    c.free(s).unwrap();
                }
                // A policy's eviction of some full block (shared ones included).
                4 if !live.is_empty() => {
                    let s = live[rng.random_range(0..live.len())];
                    let full = c.len(s).unwrap() / 4;
                    if full > 0 {
                        c.evict(s, &[rng.random_range(0..full)]).unwrap();
                    }
                }
                5 if !live.is_empty() => {
                    let s = live[rng.random_range(0..live.len())];
                    c.release_window(s).unwrap();
                }
                _ => {}
            }
            let mut counts = vec![0u32; 64];
            for s in c.seqs.values() {
                for b in s.live() {
                    counts[b as usize] += 1;
                }
            }
            for (b, &n) in counts.iter().enumerate() {
                assert_eq!(c.alloc.refcount(b as u32), n, "seed {seed}: block {b}");
            }
            assert_eq!(c.free_pool_blocks(), counts.iter().filter(|&&n| n == 0).count());
        }
        for s in live {
            c.free(s).unwrap();
        }
        assert_eq!(c.free_pool_blocks(), 64, "seed {seed}: leaked blocks");
    }
}
