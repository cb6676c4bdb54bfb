//! The paged KV cache's bookkeeping: one allocator with reference counts over the pool's blocks
//! (so sequences can share a prefix's blocks), and per-sequence block tables. The blocks' memory
//! belongs to the backend. Every block is handed out and returned
//! through `BlockAllocator`, whose free count tests assert to prove nothing leaks.

use std::collections::HashMap;

use pdmesh_kernels::{KvGeometry, KvSlot, KvStorage};
use pdmesh_kv_types::KvLayout;

use crate::error::{Error, Result};
use crate::kv_policy::KvPolicy;

mod groups;
pub use groups::KvGroups;

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

/// A table entry whose block a sliding window let go of: no query reads it again. A valid
/// `u32`, since a device may copy a whole table while reading only the window's entries.
const RELEASED: u32 = u32::MAX;

#[derive(Debug, Clone, Default)]
pub(crate) struct Sequence {
    /// One block table per group (`KvGroups`), all as long: entry `i` holds the group's part
    /// of tokens `i * bs..(i + 1) * bs`, or `RELEASED` once the window has moved past it.
    pub tables: Vec<Vec<u32>>,
    /// Tokens the blocks hold (slots, not positions: see `evicted`).
    pub len: usize,
    /// Tokens a lossy KV policy dropped: the next token's position is `evicted + len`.
    pub evicted: usize,
    /// Table entries below which every windowed group's blocks are released.
    pub released: usize,
    /// Attention each block has received, summed over heads, layers and probed queries, while
    /// a score-driven policy tracks it (one entry per block).
    pub mass: Option<Vec<f32>>,
    /// The lossy policy the sequence's KV follows, if it opted in to one.
    pub policy: Option<KvPolicy>,
}

impl Sequence {
    /// Logical blocks: entries of each table.
    fn blocks(&self) -> usize {
        self.tables.first().map_or(0, Vec::len)
    }

    /// Every live pool block the sequence refers to, once per reference.
    fn live(&self) -> impl Iterator<Item = u32> + '_ {
        self.tables.iter().flatten().copied().filter(|&b| b != RELEASED)
    }
}

/// The bookkeeping of a paged KV pool: which sequence owns which blocks, and how many of its
/// tokens they hold. The pool's memory is the backend's (`KvStorage`); what needs it takes it
/// as an argument, and `KvView` pairs the two for readers.
///
/// Counts and indices in its interface are of logical blocks (every layer of `block_size`
/// tokens); the allocator's are of pool blocks, `groups.count()` of them per logical block.
#[derive(Debug)]
pub struct KvCache {
    geometry: KvGeometry,
    /// The geometry of one pool block: `groups.unit()` layers.
    pool: KvGeometry,
    groups: KvGroups,
    pub(crate) alloc: BlockAllocator,
    pub(crate) seqs: HashMap<SeqId, Sequence>,
    next_id: u64,
    /// The most pool blocks in use at once so far.
    peak: usize,
}

impl KvCache {
    /// A pool of `n_blocks` blocks of every layer.
    pub fn new(geometry: KvGeometry, n_blocks: usize) -> Result<Self> {
        Self::grouped(geometry, KvGroups::whole(geometry.layers), n_blocks)
    }

    /// A pool with the memory of `n_blocks` logical blocks, cut into `groups`.
    pub fn grouped(geometry: KvGeometry, groups: KvGroups, n_blocks: usize) -> Result<Self> {
        if groups.layers() != geometry.layers {
            return Err(Error::invalid(format!(
                "KV groups place {} layers, the model has {}",
                groups.layers(),
                geometry.layers
            )));
        }
        let total = n_blocks.checked_mul(groups.count()).filter(|&t| t < RELEASED as usize);
        let Some(total) = total.filter(|_| n_blocks > 0) else {
            return Err(Error::KvAlloc(format!("{n_blocks} blocks is out of range")));
        };
        let pool = KvGeometry { layers: groups.unit(), ..geometry };
        Ok(Self {
            geometry,
            pool,
            groups,
            alloc: BlockAllocator::new(total),
            seqs: HashMap::new(),
            next_id: 0,
            peak: 0,
        })
    }

    /// The geometry of a logical block.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The geometry of one of the pool's blocks (the backend's).
    pub fn pool_geometry(&self) -> &KvGeometry {
        &self.pool
    }

    /// Pool blocks in all.
    pub fn pool_blocks(&self) -> usize {
        self.alloc.total()
    }

    pub fn groups(&self) -> &KvGroups {
        &self.groups
    }

    /// The entry of `group`'s table for the sequence's `index`-th block (`RELEASED` or a pool
    /// block).
    fn entry(&self, id: SeqId, group: usize, index: usize) -> Result<u32> {
        let s = self.seq(id)?;
        s.tables[group].get(index).copied().ok_or_else(|| {
            Error::invalid(format!("sequence {id} has {} blocks, not {}", s.blocks(), index + 1))
        })
    }

    /// The pool block of the sequence's `index`-th block, in a pool of whole blocks.
    pub(crate) fn block(&self, id: SeqId, index: usize) -> Result<usize> {
        if !self.groups.is_whole() {
            return Err(Error::invalid(format!(
                "this pool keeps a block's layers in {} groups: no one pool block holds {id}'s \
                 block {index}",
                self.groups.count()
            )));
        }
        Ok(self.entry(id, 0, index)? as usize)
    }

    /// Logical blocks free (whole ones: each needs a pool block of every group).
    pub fn free_blocks(&self) -> usize {
        self.alloc.free_count() / self.groups.count()
    }

    /// Logical blocks the pool's memory holds.
    pub fn total_blocks(&self) -> usize {
        self.alloc.total() / self.groups.count()
    }

    /// The most memory the pool's blocks held at once so far, in logical blocks (rounded up):
    /// the least pool the same work runs in.
    pub fn peak_blocks(&self) -> usize {
        self.peak.div_ceil(self.groups.count())
    }

    /// A new, empty sequence.
    pub fn create(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let tables = vec![Vec::new(); self.groups.count()];
        self.seqs.insert(id, Sequence { tables, ..Sequence::default() });
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
                Some(s.mass.take().unwrap_or_else(|| vec![0.0; s.blocks()]))
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
            for table in &mut s.tables {
                let b = table.remove(i);
                if b != RELEASED {
                    self.alloc.release(b);
                }
            }
            if let Some(m) = s.mass.as_mut() {
                m.remove(i);
            }
        }
        s.released -= which.iter().filter(|&&i| i < s.released).count();
        s.len -= which.len() * bs;
        s.evicted += which.len() * bs;
        self.seqs.insert(id, s);
        Ok(())
    }

    /// The first group's table (every block's, in a pool of whole blocks).
    pub fn blocks(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.tables[0])
    }

    /// `group`'s table for the sequence, `u32::MAX` where a block was released.
    pub fn table(&self, id: SeqId, group: usize) -> Result<&[u32]> {
        let s = self.seq(id)?;
        s.tables.get(group).map(Vec::as_slice).ok_or_else(|| {
            Error::invalid(format!("the pool has {} KV groups, not {}", s.tables.len(), group + 1))
        })
    }

    /// Logical blocks the sequence spans (released parts included).
    pub fn block_count(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.blocks())
    }

    /// Pool blocks `group` holds for the sequence now.
    pub fn group_blocks(&self, id: SeqId, group: usize) -> Result<usize> {
        Ok(self.table(id, group)?.iter().filter(|&&b| b != RELEASED).count())
    }

    /// Logical blocks some of whose groups the window let go of: the sequence's KV before
    /// them is no longer whole (see `KvView::read_block`).
    pub fn released_blocks(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.released)
    }

    /// Lets go of every windowed group's blocks that no later query of the sequence reads:
    /// those wholly before the window of its next token. Returns the pool blocks released.
    /// Only for a sequence whose blocks no one reads whole again (a connector that publishes
    /// or ships its prompt after the step reads them).
    pub fn release_window(&mut self, id: SeqId) -> Result<usize> {
        let bs = self.geometry.block_size;
        let s = self.seq(id)?;
        // The next query (slot `len`) attends to slots from `len + 1 - window` on.
        let Some(&window) = self.groups.windows.iter().flatten().min() else { return Ok(0) };
        let cut = (s.len + 1).saturating_sub(window) / bs;
        if cut <= s.released {
            return Ok(0);
        }
        let mut s = self.seqs.remove(&id).expect("sequence checked above");
        let mut freed = 0;
        for (table, w) in s.tables.iter_mut().zip(&self.groups.windows) {
            if w.is_none() {
                continue;
            }
            for b in &mut table[s.released..cut] {
                if *b != RELEASED {
                    self.alloc.release(*b);
                    *b = RELEASED;
                    freed += 1;
                }
            }
        }
        s.released = cut;
        self.seqs.insert(id, s);
        Ok(freed)
    }

    /// A new sequence sharing all of `src`'s KV (by reference; a shared partial block is copied
    /// when either side first writes to it).
    pub fn fork(&mut self, src: SeqId) -> Result<SeqId> {
        let s = self.seq(src)?.clone();
        for b in s.live() {
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
        for b in s.live() {
            self.alloc.release(b);
        }
        Ok(())
    }

    /// The most logical blocks a sequence of `tokens` tokens holds at once when it steps at
    /// most `step` tokens at a time: all of them, unless its windowed groups let go of what
    /// their windows left after each step (`release`, as `release_window`). Then a local
    /// group holds at most the blocks of its window and one step, plus the one being filled:
    /// before a step of `c` tokens at length `L`, entries from `(L + 1 - w) / bs` on are
    /// live, and the step fills up to `ceil((L + c) / bs)`, which is at most
    /// `ceil((w + c) / bs) + 1` entries.
    pub fn blocks_to_hold(&self, tokens: usize, step: usize, release: bool) -> usize {
        let bs = self.geometry.block_size;
        let all = tokens.div_ceil(bs);
        if !release {
            return all;
        }
        let pool: usize = self
            .groups
            .windows
            .iter()
            .map(|w| w.map_or(all, |w| all.min((w + step).div_ceil(bs) + 1)))
            .sum();
        pool.div_ceil(self.groups.count())
    }

    /// Logical blocks that appending `n` tokens to `id` would take from the pool (a pool block
    /// of one group, for a copy-on-write, counts as a whole one).
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> Result<usize> {
        Ok(self.pool_blocks_needed(id, n)?.div_ceil(self.groups.count()))
    }

    /// Pool blocks that appending `n` tokens to `id` would take.
    pub(crate) fn pool_blocks_needed(&self, id: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(self.needed(s, n))
    }

    /// Free pool blocks.
    pub(crate) fn free_pool_blocks(&self) -> usize {
        self.alloc.free_count()
    }

    fn needed(&self, s: &Sequence, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let bs = self.geometry.block_size;
        let fresh = (s.len + n).div_ceil(bs).saturating_sub(s.blocks()) * s.tables.len();
        let cow = if s.len.is_multiple_of(bs) {
            0
        } else {
            s.tables
                .iter()
                .filter(|t| t.last().is_some_and(|&b| b != RELEASED && self.alloc.refcount(b) > 1))
                .count()
        };
        fresh + cow
    }

    /// Reserves room for `n` more tokens of `id` and returns where each goes (copying a shared
    /// partial block in `store` first), group by group: group `g`'s slot of token `t` is
    /// `[g * n + t]`. The sequence's length advances; the caller must write the KV of those
    /// slots.
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
            for table in &mut s.tables {
                let last = table.last_mut().expect("a partial block exists");
                if *last != RELEASED && self.alloc.refcount(*last) > 1 {
                    let fresh = self.alloc.alloc().expect("counted in `needed`");
                    store.copy_block(*last as usize, fresh as usize);
                    self.alloc.release(*last);
                    *last = fresh;
                }
            }
        }
        let first = s.blocks();
        for _ in first..(s.len + n).div_ceil(bs) {
            for table in &mut s.tables {
                table.push(self.alloc.alloc().expect("counted in `needed`"));
            }
            if let Some(m) = s.mass.as_mut() {
                m.push(0.0);
            }
        }
        let mut slots = Vec::with_capacity(n * s.tables.len());
        for table in &s.tables {
            slots.extend(
                (s.len..s.len + n)
                    .map(|pos| KvSlot { block: table[pos / bs], slot: (pos % bs) as u32 }),
            );
        }
        s.len += n;
        self.seqs.insert(id, s);
        self.peak = self.peak.max(self.alloc.total() - self.alloc.free_count());
        Ok(slots)
    }

    /// Pool writes that put logical blocks `blocks` at the sequence's blocks from `first` on:
    /// each split into its groups' parts (whole blocks go as they are). Blocks before `thin`
    /// are in their thin wire form (`KvLayout::wire_layer_offset` of `layout`): only the groups
    /// whose layers they carry are written. A pool of whole blocks takes no thin block.
    pub(crate) fn scatter<'d>(
        &self,
        id: SeqId,
        first: usize,
        (layout, thin): (&KvLayout, usize),
        blocks: impl IntoIterator<Item = &'d [u8]>,
    ) -> Result<Vec<(usize, std::borrow::Cow<'d, [u8]>)>> {
        let groups = &self.groups;
        let bpl = self.geometry.bytes_per_layer();
        let mut writes = Vec::new();
        for (i, d) in blocks.into_iter().enumerate() {
            let index = first + i;
            let want = layout.wire_block_bytes(index, thin);
            if d.len() != want {
                return Err(Error::invalid(format!(
                    "KV block {index} is {want} bytes on the wire, not {}",
                    d.len()
                )));
            }
            if groups.is_whole() {
                if index < thin {
                    return Err(Error::invalid("a pool of whole blocks takes no thin block"));
                }
                writes.push((self.block(id, index)?, std::borrow::Cow::Borrowed(d)));
                continue;
            }
            for (g, layers) in groups.members.iter().enumerate() {
                let at: Option<Vec<usize>> =
                    layers.iter().map(|&l| layout.wire_layer_offset(l, index, thin)).collect();
                // A thin block carries none of a local group's layers.
                let Some(at) = at else { continue };
                let b = self.entry(id, g, index)?;
                if b == RELEASED {
                    return Err(Error::invalid(format!(
                        "{id}'s block {index} is past a window its layers have let go of"
                    )));
                }
                let part: Vec<u8> = at.iter().flat_map(|&o| &d[o..o + bpl]).copied().collect();
                writes.push((b as usize, std::borrow::Cow::Owned(part)));
            }
        }
        Ok(writes)
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

    /// The geometry of a logical block.
    pub fn geometry(&self) -> &KvGeometry {
        self.cache.geometry()
    }

    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.cache.len(id)
    }

    /// Logical blocks the sequence spans.
    pub fn block_count(&self, id: SeqId) -> Result<usize> {
        self.cache.block_count(id)
    }

    /// Appends the bytes of the sequence's `index`-th block (every layer, in layer order) to
    /// `out`. A layer whose window has moved past the block reads as zeros: no query of the
    /// sequence reads it again, so a continuation elsewhere needs nothing there.
    pub fn read_block(&self, id: SeqId, index: usize, out: &mut Vec<u8>) -> Result<()> {
        let groups = &self.cache.groups;
        if groups.is_whole() {
            let b = self.cache.entry(id, 0, index)?;
            if b != RELEASED {
                self.store.read_block(b as usize, out);
                return Ok(());
            }
        }
        // One read per group (a device copies each pool block once), its layers put in place.
        let entries = (0..groups.count())
            .map(|g| self.cache.entry(id, g, index))
            .collect::<Result<Vec<_>>>()?;
        let bpl = self.geometry().bytes_per_layer();
        let start = out.len();
        out.resize(start + self.geometry().bytes_per_block(), 0);
        let mut part = Vec::new();
        for (layers, b) in groups.members.iter().zip(entries) {
            if b == RELEASED {
                continue;
            }
            part.clear();
            self.store.read_block(b as usize, &mut part);
            for (at, &l) in layers.iter().enumerate() {
                out[start + l * bpl..][..bpl].copy_from_slice(&part[at * bpl..][..bpl]);
            }
        }
        Ok(())
    }

    /// Appends block `index`'s wire form to `out`: the whole block, or, before `thin`, its
    /// layers `layout` says a thin block carries, in layer order.
    pub fn read_wire_block(
        &self,
        id: SeqId,
        index: usize,
        (layout, thin): (&KvLayout, usize),
        out: &mut Vec<u8>,
    ) -> Result<()> {
        if index >= thin {
            return self.read_block(id, index, out);
        }
        for l in 0..self.geometry().layers {
            if layout.wire_layer_offset(l, index, thin).is_some() {
                self.read_block_layer(id, index, l, out)?;
            }
        }
        Ok(())
    }

    /// Appends layer `layer`'s part of the sequence's `index`-th block to `out` (zeros where
    /// the window has let it go, as `read_block`).
    pub fn read_block_layer(
        &self,
        id: SeqId,
        index: usize,
        layer: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        if layer >= self.geometry().layers {
            return Err(Error::invalid(format!("layer {layer} is past the model's layers")));
        }
        let (g, at) = self.cache.groups.place(layer);
        match self.cache.entry(id, g, index)? {
            RELEASED => out.resize(out.len() + self.geometry().bytes_per_layer(), 0),
            b => self.store.read_layer(b as usize, at, out),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
