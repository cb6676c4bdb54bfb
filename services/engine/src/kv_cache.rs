//! The paged KV cache's bookkeeping: one allocator with reference counts over the pool's blocks
//! (so sequences can share a prefix's blocks), and per-sequence block tables. The blocks' memory
//! belongs to the backend. Every block is handed out and returned
//! through `BlockAllocator`, whose free count tests assert to prove nothing leaks.

use std::collections::HashMap;

use pdmesh_kernels::{KvGeometry, KvSlot, KvStorage};

use crate::error::{Error, Result};
use crate::kv_policy::KvPolicy;

/// Reference-counted allocation of block ids `0..n`. A plain struct: no I/O, no locking.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    refs: Vec<u32>,
    free: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(n: usize) -> Self {
        // Lowest ids are handed out first (the stack pops from the end).
        Self { refs: vec![0; n], free: (0..n as u32).rev().collect() }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn refcount(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
    }

    /// A fresh block with one reference, or `None` when the pool is empty.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        debug_assert_eq!(self.refs[b as usize], 0);
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Adds a reference to a live block.
    pub fn retain(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "retain of free block {block}");
        *r += 1;
    }

    /// Drops a reference; returns true when that freed the block.
    pub fn release(&mut self, block: u32) -> bool {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "release of free block {block} (double free)");
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
            true
        } else {
            false
        }
    }
}

/// Identifies a sequence in one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq#{}", self.0)
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Sequence {
    pub blocks: Vec<u32>,
    /// Tokens the blocks hold (slots, not positions: see `evicted`).
    pub len: usize,
    /// Tokens a lossy KV policy dropped: the next token's position is `evicted + len`.
    pub evicted: usize,
    /// Attention each block has received, summed over heads, layers and probed queries, while
    /// a score-driven policy tracks it (one entry per block).
    pub mass: Option<Vec<f32>>,
    /// The lossy policy the sequence's KV follows, if it opted in to one.
    pub policy: Option<KvPolicy>,
}

/// The bookkeeping of a paged KV pool: which sequence owns which blocks, and how many of its
/// tokens they hold. The pool's memory is the backend's (`KvStorage`); what needs it takes it
/// as an argument, and `KvView` pairs the two for readers.
#[derive(Debug)]
pub struct KvCache {
    geometry: KvGeometry,
    pub(crate) alloc: BlockAllocator,
    pub(crate) seqs: HashMap<SeqId, Sequence>,
    next_id: u64,
}

impl KvCache {
    pub fn new(geometry: KvGeometry, n_blocks: usize) -> Result<Self> {
        if n_blocks == 0 || n_blocks > u32::MAX as usize {
            return Err(Error::KvAlloc(format!("{n_blocks} blocks is out of range")));
        }
        Ok(Self {
            geometry,
            alloc: BlockAllocator::new(n_blocks),
            seqs: HashMap::new(),
            next_id: 0,
        })
    }

    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The pool block of the sequence's `index`-th block.
    pub(crate) fn block(&self, id: SeqId, index: usize) -> Result<usize> {
        let blocks = self.blocks(id)?;
        let b = *blocks.get(index).ok_or_else(|| {
            Error::invalid(format!("sequence {id} has {} blocks, not {}", blocks.len(), index + 1))
        })?;
        Ok(b as usize)
    }

    pub fn free_blocks(&self) -> usize {
        self.alloc.free_count()
    }

    pub fn total_blocks(&self) -> usize {
        self.alloc.total()
    }

    /// A new, empty sequence.
    pub fn create(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, Sequence::default());
        id
    }

    /// Swaps the blocks (and lengths) of two sequences.
    pub fn swap(&mut self, a: SeqId, b: SeqId) -> Result<()> {
        let sa = self.seq(a)?.clone();
        let sb = std::mem::replace(
            self.seqs.get_mut(&b).ok_or_else(|| Error::invalid(format!("unknown sequence {b}")))?,
            sa,
        );
        *self.seqs.get_mut(&a).expect("looked up above") = sb;
        Ok(())
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&id).ok_or_else(|| Error::invalid(format!("unknown sequence {id}")))
    }

    pub fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    /// The position of the sequence's next token: the tokens it holds plus those a lossy
    /// policy evicted.
    pub fn position(&self, id: SeqId) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(s.evicted + s.len)
    }

    /// Tokens a lossy policy has evicted from the sequence.
    pub fn evicted(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.evicted)
    }

    /// Puts the sequence under a lossy policy (or none), checked against the block size; a
    /// score-driven one starts summing the attention its blocks receive (existing blocks from
    /// zero). The policy evicts after each step the sequence is in (`enforce`).
    pub fn set_policy(&mut self, id: SeqId, policy: Option<KvPolicy>) -> Result<()> {
        if let Some(p) = &policy {
            p.validate(self.geometry.block_size).map_err(Error::invalid)?;
        }
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or_else(|| Error::invalid(format!("unknown sequence {id}")))?;
        s.mass = match policy {
            Some(p) if p.tracks_attention() => {
                Some(s.mass.take().unwrap_or_else(|| vec![0.0; s.blocks.len()]))
            }
            _ => None,
        };
        s.policy = policy;
        Ok(())
    }

    /// Evicts what the sequence's policy says it must to hold its budget; returns the tokens
    /// evicted now.
    pub fn enforce(&mut self, id: SeqId) -> Result<usize> {
        let s = self.seq(id)?;
        let Some(p) = s.policy else { return Ok(0) };
        let bs = self.geometry.block_size;
        let victims = p.victims(s.len, bs, s.mass.as_deref());
        self.evict(id, &victims)?;
        Ok(victims.len() * bs)
    }

    /// The attention mass per block, while tracked.
    pub fn mass(&self, id: SeqId) -> Result<Option<&[f32]>> {
        Ok(self.seq(id)?.mass.as_deref())
    }

    /// Adds `add[i]` to block `i`'s mass (a no-op for an untracked sequence).
    pub(crate) fn add_mass(&mut self, id: SeqId, add: &[f32]) {
        if let Some(m) = self.seqs.get_mut(&id).and_then(|s| s.mass.as_mut()) {
            for (m, a) in m.iter_mut().zip(add) {
                *m += a;
            }
        }
    }

    /// Drops the sequence's blocks at table indices `which` (full blocks only: the one being
    /// filled stays) and closes the gaps, so the blocks after them keep their slots. Their
    /// tokens count as evicted; attention no longer sees them. Nothing changes on error.
    pub fn evict(&mut self, id: SeqId, which: &[usize]) -> Result<()> {
        let bs = self.geometry.block_size;
        let s = self.seq(id)?;
        let full = s.len / bs;
        let mut which = which.to_vec();
        which.sort_unstable();
        which.dedup();
        if let Some(&bad) = which.iter().find(|&&i| i >= full) {
            return Err(Error::invalid(format!(
                "{id} has {full} full blocks: block {bad} cannot be evicted"
            )));
        }
        let mut s = self.seqs.remove(&id).expect("sequence checked above");
        for &i in which.iter().rev() {
            self.alloc.release(s.blocks.remove(i));
            if let Some(m) = s.mass.as_mut() {
                m.remove(i);
            }
        }
        s.len -= which.len() * bs;
        s.evicted += which.len() * bs;
        self.seqs.insert(id, s);
        Ok(())
    }

    pub fn blocks(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.blocks)
    }

    /// A new sequence sharing all of `src`'s KV (by reference; a shared partial block is copied
    /// when either side first writes to it).
    pub fn fork(&mut self, src: SeqId) -> Result<SeqId> {
        let s = self.seq(src)?.clone();
        for &b in &s.blocks {
            self.alloc.retain(b);
        }
        let id = self.create();
        self.seqs.insert(id, s);
        Ok(id)
    }

    /// Drops a sequence and its references to blocks.
    pub fn free(&mut self, id: SeqId) -> Result<()> {
        let s = self
            .seqs
            .remove(&id)
            .ok_or_else(|| Error::invalid(format!("unknown sequence {id}")))?;
        for b in s.blocks {
            self.alloc.release(b);
        }
        Ok(())
    }

    /// Blocks that appending `n` tokens to `id` would take from the pool.
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(self.needed(s, n))
    }

    fn needed(&self, s: &Sequence, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let bs = self.geometry.block_size;
        let fresh = (s.len + n).div_ceil(bs).saturating_sub(s.blocks.len());
        let cow = usize::from(
            !s.len.is_multiple_of(bs)
                && s.blocks.last().is_some_and(|&b| self.alloc.refcount(b) > 1),
        );
        fresh + cow
    }

    /// Reserves room for `n` more tokens of `id` and returns where each goes (copying a shared
    /// partial block in `store` first). The sequence's length advances; the caller must write
    /// the KV of those slots.
    pub fn append(
        &mut self,
        id: SeqId,
        n: usize,
        store: &mut dyn KvStorage,
    ) -> Result<Vec<KvSlot>> {
        let s = self.seq(id)?;
        let needed = self.needed(s, n);
        if needed > self.alloc.free_count() {
            return Err(Error::KvExhausted { needed, free: self.alloc.free_count() });
        }
        let bs = self.geometry.block_size;
        let mut s = self.seqs.remove(&id).expect("sequence checked above");
        if n > 0 && !s.len.is_multiple_of(bs) {
            let last = *s.blocks.last().expect("a partial block exists");
            if self.alloc.refcount(last) > 1 {
                let fresh = self.alloc.alloc().expect("counted in `needed`");
                store.copy_block(last as usize, fresh as usize);
                self.alloc.release(last);
                *s.blocks.last_mut().expect("non-empty") = fresh;
            }
        }
        let mut slots = Vec::with_capacity(n);
        for pos in s.len..s.len + n {
            if pos / bs == s.blocks.len() {
                s.blocks.push(self.alloc.alloc().expect("counted in `needed`"));
                if let Some(m) = s.mass.as_mut() {
                    m.push(0.0);
                }
            }
            slots.push(KvSlot { block: s.blocks[pos / bs], slot: (pos % bs) as u32 });
        }
        s.len += n;
        self.seqs.insert(id, s);
        Ok(slots)
    }
}

/// The KV of the pool's sequences, for reading: the bookkeeping with the backend's memory.
#[derive(Clone, Copy)]
pub struct KvView<'a> {
    cache: &'a KvCache,
    store: &'a dyn KvStorage,
}

impl std::fmt::Debug for KvView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvView").field("cache", self.cache).finish_non_exhaustive()
    }
}

impl<'a> KvView<'a> {
    pub fn new(cache: &'a KvCache, store: &'a dyn KvStorage) -> Self {
        Self { cache, store }
    }

    pub fn geometry(&self) -> &KvGeometry {
        self.cache.geometry()
    }

    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.cache.len(id)
    }

    pub fn blocks(&self, id: SeqId) -> Result<&'a [u32]> {
        self.cache.blocks(id)
    }

    /// Appends the bytes of the sequence's `index`-th block to `out`.
    pub fn read_block(&self, id: SeqId, index: usize, out: &mut Vec<u8>) -> Result<()> {
        self.store.read_block(self.cache.block(id, index)?, out);
        Ok(())
    }

    /// Appends layer `layer`'s part of the sequence's `index`-th block to `out`.
    pub fn read_block_layer(
        &self,
        id: SeqId,
        index: usize,
        layer: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let b = self.cache.block(id, index)?;
        if layer >= self.geometry().layers {
            return Err(Error::invalid(format!("layer {layer} is past the model's layers")));
        }
        self.store.read_layer(b, layer, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
        let g =
            KvGeometry { layers: 1, kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F32 };
        Cache { c: KvCache::new(g, blocks).unwrap(), store: KvBuffer::new(g, blocks).unwrap() }
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
        for seed in 0..20 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut c = cache(64);
            let mut live: Vec<SeqId> = Vec::new();
            for _ in 0..400 {
                match rng.random_range(0..5) {
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
                    _ => {}
                }
                let mut counts = vec![0u32; 64];
                for s in c.seqs.values() {
                    for &b in &s.blocks {
                        counts[b as usize] += 1;
                    }
                }
                for (b, &n) in counts.iter().enumerate() {
                    assert_eq!(c.alloc.refcount(b as u32), n, "seed {seed}: block {b}");
                }
                assert_eq!(c.free_blocks(), counts.iter().filter(|&&n| n == 0).count());
            }
            for s in live {
                c.free(s).unwrap();
            }
            assert_eq!(c.free_blocks(), 64, "seed {seed}: leaked blocks");
        }
    }
}
