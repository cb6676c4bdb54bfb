//! The KV-store's state, free of gRPC and UCX: which block lives in which slot of the pool,
//! which blocks a lease pins, and which to evict. The service moves the bytes; this decides.
//!
//! - A block is *pending* from `reserve_put` until `commit_put` (its bytes are arriving): it
//!   cannot be matched, evicted or reserved again, and `abort_put` frees its slot.
//! - `match_prefix` returns the longest stored prefix of a hash chain and pins it under a
//!   lease, so the caller can read the blocks; `release` or the lease's expiry unpins them.
//! - Only blocks that are ready and unpinned are evicted, least recently used first.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use std::sync::Arc;

use pdmesh_common::blocks::BlockLog;
use pdmesh_common::ids::Capability;
use pdmesh_kv_types::BlockHash;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    Ready,
}

#[derive(Debug)]
struct Entry {
    slot: u32,
    state: State,
    pins: u32,
    /// Last use; the key of this entry in `lru` while it is ready and unpinned.
    tick: u64,
}

#[derive(Debug)]
struct Lease {
    cap: Capability,
    blocks: Vec<BlockHash>,
    expires: Instant,
}

/// Counters for stats and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Ready blocks held.
    pub blocks: u64,
    pub bytes: u64,
    pub capacity_blocks: u64,
    /// Matched and missed prompt tokens (full blocks only).
    pub hit_tokens: u64,
    pub miss_tokens: u64,
    pub evictions: u64,
    /// Puts of a block already stored (or arriving): stored once.
    pub dedup: u64,
    pub pinned_blocks: u64,
    pub leases: u64,
    pub leases_expired: u64,
    /// `pdmesh_kv_types::digest` of the ready blocks (with a disk tier: of every block either
    /// tier holds).
    pub digest: u64,
    /// Matched tokens whose blocks were read back from the disk tier for the match.
    pub disk_hit_tokens: u64,
    /// Blocks either tier holds.
    pub held_blocks: u64,
    /// The disk tier's counters (zero without one).
    pub disk: pdmesh_kv_transfer::disk::DiskStats,
}

/// A match: the stored prefix, as `(hash, slot)` in chain order, pinned under `lease`
/// (`None` when nothing matched, so there is nothing to release).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    pub lease: Option<Capability>,
    pub blocks: Vec<(BlockHash, u32)>,
}

/// Where a put goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutSlot {
    /// Write the block's bytes into this slot, then `commit_put` (or `abort_put`).
    Write(u32),
    /// The block is stored or arriving already: nothing to write.
    Duplicate,
    /// Every slot is pinned or pending: the block is not stored.
    Full,
}

#[derive(Debug)]
pub struct Store {
    block_bytes: usize,
    tokens_per_block: usize,
    free: Vec<u32>,
    capacity: usize,
    index: HashMap<BlockHash, Entry>,
    lru: BTreeMap<u64, BlockHash>,
    /// Keyed by the lease capability's key; the capability itself is checked on use.
    leases: HashMap<u64, Lease>,
    tick: u64,
    stats: StoreStats,
    /// Blocks becoming ready and evicted, for the routers' indexes.
    log: Option<Arc<BlockLog>>,
    /// Blocks evicted since `take_evicted`, kept instead of logged when another tier may
    /// still hold them (`backed`).
    evicted: Option<Vec<BlockHash>>,
}

impl Store {
    /// A store of `budget_bytes / block_bytes` slots.
    pub fn new(budget_bytes: usize, block_bytes: usize, tokens_per_block: usize) -> Self {
        let capacity = budget_bytes.checked_div(block_bytes).unwrap_or(0);
        Self {
            block_bytes,
            tokens_per_block,
            // Popped from the end: slot 0 first.
            free: (0..capacity as u32).rev().collect(),
            capacity,
            index: HashMap::new(),
            lru: BTreeMap::new(),
            leases: HashMap::new(),
            tick: 0,
            stats: StoreStats { capacity_blocks: capacity as u64, ..Default::default() },
            log: None,
            evicted: None,
        }
    }

    /// Another tier backs this one: an evicted block is kept for `take_evicted` (whoever knows
    /// whether it is still held elsewhere logs its removal), not logged as gone.
    pub fn backed(mut self) -> Self {
        self.evicted = Some(Vec::new());
        self
    }

    /// The blocks evicted since the last call (`backed` stores only).
    pub fn take_evicted(&mut self) -> Vec<BlockHash> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Whether block `h` is stored and ready.
    pub fn is_ready(&self, h: &BlockHash) -> bool {
        self.index.get(h).is_some_and(|e| e.state == State::Ready)
    }

    /// Makes the ready, unpinned blocks among `hashes` the most recently used, in order: what
    /// a match is about to read stays while room is made for the rest of its chain.
    pub fn touch_ready(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            let tick = self.tick + 1;
            if let Some(e) = self.index.get_mut(h)
                && e.state == State::Ready
                && e.pins == 0
            {
                self.lru.remove(&e.tick);
                e.tick = tick;
                self.tick = tick;
                self.lru.insert(tick, *h);
            }
        }
    }

    /// Every ready block.
    pub fn ready(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.index.iter().filter(|(_, e)| e.state == State::Ready).map(|(h, _)| *h)
    }

    /// Tells `log` of every block that becomes matchable or is evicted, from now on.
    pub fn with_log(mut self, log: Arc<BlockLog>) -> Self {
        self.log = Some(log);
        self
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn touch(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn pin(&mut self, h: BlockHash) {
        let e = self.index.get_mut(&h).expect("pinned blocks are indexed");
        if e.pins == 0 && e.state == State::Ready {
            self.lru.remove(&e.tick);
        }
        e.pins += 1;
    }

    fn unpin(&mut self, h: BlockHash) {
        let tick = self.tick + 1;
        let Some(e) = self.index.get_mut(&h) else { return };
        e.pins = e.pins.saturating_sub(1);
        if e.pins == 0 && e.state == State::Ready {
            self.tick = tick;
            e.tick = tick;
            self.lru.insert(tick, h);
        }
    }

    /// The longest stored prefix of `chain`, pinned until `now + lease` (or `release`).
    /// Counts the chain's blocks as hit or missed tokens.
    pub fn match_prefix(&mut self, chain: &[BlockHash], lease: Duration, now: Instant) -> Matched {
        let mut blocks = Vec::new();
        for &h in chain {
            match self.index.get(&h) {
                Some(e) if e.state == State::Ready => blocks.push((h, e.slot)),
                _ => break,
            }
        }
        let tpb = self.tokens_per_block as u64;
        self.stats.hit_tokens += blocks.len() as u64 * tpb;
        self.stats.miss_tokens += (chain.len() - blocks.len()) as u64 * tpb;
        if blocks.is_empty() {
            return Matched { lease: None, blocks };
        }
        for &(h, _) in &blocks {
            self.pin(h);
        }
        let cap = Capability::fresh(|k| self.leases.contains_key(&k));
        let held = blocks.iter().map(|&(h, _)| h).collect();
        self.leases.insert(cap.key(), Lease { cap, blocks: held, expires: now + lease });
        Matched { lease: Some(cap), blocks }
    }

    /// The live lease `cap` names, if `cap` is its capability.
    fn lease(&self, cap: &Capability) -> Option<&Lease> {
        self.leases.get(&cap.key()).filter(|l| l.cap.admits(cap))
    }

    /// The blocks a live lease pins, as `(hash, slot)` in chain order.
    pub fn lease_blocks(&self, lease: Capability) -> Option<Vec<(BlockHash, u32)>> {
        let l = self.lease(&lease)?;
        Some(l.blocks.iter().map(|h| (*h, self.index[h].slot)).collect())
    }

    /// Whether a lease with this key is live (it may be expired but not yet swept).
    pub fn has_lease(&self, key: u64) -> bool {
        self.leases.contains_key(&key)
    }

    /// Whether `lease` still pins its blocks.
    pub fn holds(&self, lease: Capability) -> bool {
        self.lease(&lease).is_some()
    }

    /// Unpins a lease's blocks. False when the lease is unknown (released or expired) or
    /// `lease` is not its capability.
    pub fn release(&mut self, lease: Capability) -> bool {
        if self.lease(&lease).is_none() {
            return false;
        }
        let l = self.leases.remove(&lease.key()).expect("looked up above");
        for h in l.blocks {
            self.unpin(h);
        }
        true
    }

    /// Releases every lease expired at `now`; returns how many.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let expired: Vec<Capability> =
            self.leases.values().filter(|l| l.expires <= now).map(|l| l.cap).collect();
        for &cap in &expired {
            self.release(cap);
        }
        self.stats.leases_expired += expired.len() as u64;
        expired.len()
    }

    /// Finds room for block `h`: a free slot, else the least recently used unpinned block's.
    pub fn reserve_put(&mut self, h: BlockHash) -> PutSlot {
        if self.index.contains_key(&h) {
            self.stats.dedup += 1;
            return PutSlot::Duplicate;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let Some((_, victim)) = self.lru.pop_first() else { return PutSlot::Full };
                let e = self.index.remove(&victim).expect("LRU entries are indexed");
                self.stats.evictions += 1;
                match (&mut self.evicted, &self.log) {
                    (Some(kept), _) => kept.push(victim),
                    (None, Some(log)) => log.record([], [victim.0]),
                    (None, None) => {}
                }
                e.slot
            }
        };
        let tick = self.touch();
        self.index.insert(h, Entry { slot, state: State::Pending, pins: 0, tick });
        PutSlot::Write(slot)
    }

    /// The bytes of pending block `h` are in its slot: it can be matched from now on.
    pub fn commit_put(&mut self, h: BlockHash) -> bool {
        let tick = self.touch();
        match self.index.get_mut(&h) {
            Some(e) if e.state == State::Pending => {
                e.state = State::Ready;
                e.tick = tick;
                if e.pins == 0 {
                    self.lru.insert(tick, h);
                }
                if let Some(log) = &self.log {
                    log.record([h.0], []);
                }
                true
            }
            _ => false,
        }
    }

    /// The bytes of pending block `h` never arrived: its slot is free again.
    pub fn abort_put(&mut self, h: BlockHash) -> bool {
        match self.index.get(&h) {
            Some(e) if e.state == State::Pending => {
                let slot = e.slot;
                self.index.remove(&h);
                self.free.push(slot);
                true
            }
            _ => false,
        }
    }

    /// Counts `blocks` of a match as read back from disk.
    pub fn count_disk_hits(&mut self, blocks: u64) {
        self.stats.disk_hit_tokens += blocks * self.tokens_per_block as u64;
    }

    pub fn stats(&self) -> StoreStats {
        let mut s = self.stats;
        let ready = self.index.values().filter(|e| e.state == State::Ready).count() as u64;
        s.blocks = ready;
        s.bytes = ready * self.block_bytes as u64;
        s.pinned_blocks = self.index.values().filter(|e| e.pins > 0).count() as u64;
        s.leases = self.leases.len() as u64;
        let ready = self.index.iter().filter(|(_, e)| e.state == State::Ready);
        s.digest = pdmesh_kv_types::digest(ready.map(|(h, _)| *h));
        s
    }
}
