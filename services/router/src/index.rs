//! Which node holds which KV block, from the nodes' own reports: every node that keeps blocks
//! for reuse (a prefill node's cache, the KV-store) sends this router a snapshot and then each
//! block it stores or removes (`Attach`), so the index is the nodes' caches, late by the
//! events in flight. Every router subscribes to every node, so all hold the same index.
//!
//! - **Epochs.** A node's blocks belong to its epoch (its process, or its cache since it was
//!   last wiped). A new epoch drops the old one's blocks at once, before its snapshot comes.
//! - **Sequence numbers.** Events are numbered; one that does not follow the last is a gap,
//!   and the node is asked for a snapshot (`resync`) that replaces what was held.
//! - **Sessions.** A node's session that ends takes its blocks out: nothing vouches for them
//!   until it attaches again and sends a snapshot.
//! - **Estimates.** A node that registered without events (`Register`, no `Attach`) is
//!   estimated as before: the chains of the prompts this router sent it, forgotten least
//!   recently sent first at its advertised cache size. Its status says "estimate".
//!
//! Blocks are by hash, each naming the holders' slots; a lookup walks a prompt's chain once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use lru::LruCache;
use pdmesh_kv_types::{BlockHash, BlockHasher, KvLayout};

/// A prompt's chain under one KV layout in the space of one cache group (`salt`).
pub fn chain(layout: &KvLayout, salt: &[u8], prompt: &[u32]) -> Vec<BlockHash> {
    BlockHasher::new(layout).map_or_else(Vec::new, |h| h.salted(salt).chain(prompt))
}

/// A request's chain, hashed once: placement, coalescing and every retry read it, and none
/// of them under the registry's lock.
#[derive(Debug, Default)]
pub struct ChainCache(Mutex<Option<(KvLayout, Arc<[BlockHash]>)>>);

impl ChainCache {
    pub fn get(&self, layout: &KvLayout, salt: &[u8], prompt: &[u32]) -> Arc<[BlockHash]> {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Some((l, c)) if l == layout => Arc::clone(c),
            _ => {
                let c: Arc<[BlockHash]> = chain(layout, salt, prompt).into();
                *g = Some((*layout, Arc::clone(&c)));
                c
            }
        }
    }
}

/// The most blocks estimated for one node, whatever it claims: 2^20 blocks are 16M tokens at
/// 16 per block, past any node's cache, and about 50 MB of router memory.
pub const MAX_ESTIMATED_BLOCKS: usize = 1 << 20;

/// The most blocks one node may report: past it the node is not indexed (a node claiming
/// more than any cache holds is lying or broken, and must not take the router's memory).
pub const MAX_REPORTED_BLOCKS: usize = 1 << 22;

/// What the index knows of a node's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// It holds nothing for reuse.
    None,
    /// Its blocks, from its events.
    Exact,
    /// It has just attached or a gap was seen: its snapshot is awaited.
    Resyncing,
    /// It sends no events: what this router sent it.
    Estimate,
    /// Its session ended; nothing is known until it attaches again.
    Detached,
}

impl State {
    pub const ALL: [State; 5] =
        [Self::Exact, Self::Resyncing, Self::Estimate, Self::Detached, Self::None];

    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Exact => "exact",
            Self::Resyncing => "resyncing",
            Self::Estimate => "estimate",
            Self::Detached => "detached",
        }
    }
}

/// Prompt blocks a prefill node would take from each tier rather than compute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hits {
    /// From its own cache.
    pub own: usize,
    /// From its KV-store, after what its own cache holds.
    pub store: usize,
}

impl Hits {
    pub fn total(self) -> usize {
        self.own + self.store
    }
}

/// Why events were not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// A snapshot is needed: the node should be asked for one.
    #[error("{0}")]
    Resync(String),
    /// The session is not the node's current one (a newer one replaced it): ignored.
    #[error("a newer session of the node replaced this one")]
    Stale,
    /// The node reported more blocks than any cache holds: it is not indexed.
    #[error("more than {MAX_REPORTED_BLOCKS} blocks reported; the node is not indexed")]
    TooMany,
}

#[derive(Debug)]
struct Holder {
    epoch: u64,
    session: u64,
    state: State,
    /// The next event's number (while exact).
    next: u64,
    /// A snapshot is arriving: its first part clears what was held.
    snapshot_started: bool,
    held: HashSet<u128>,
    /// Estimate mode: what this router sent it, least recently sent first.
    estimate: Option<LruCache<u128, ()>>,
    /// The KV-store this node reads from, or is (by address).
    kvstore: String,
    is_store: bool,
}

#[derive(Debug, Default)]
struct Inner {
    slots: HashMap<String, u32>,
    holders: Vec<Option<Holder>>,
    free: Vec<u32>,
    /// Block → slots of the holders whose exact state holds it.
    blocks: HashMap<u128, Vec<u32>>,
    /// The KV-store's slot by its address.
    stores: HashMap<String, u32>,
    sessions: u64,
}

impl Inner {
    fn slot(&mut self, id: &str) -> u32 {
        if let Some(&s) = self.slots.get(id) {
            return s;
        }
        let s = self.free.pop().unwrap_or_else(|| {
            self.holders.push(None);
            (self.holders.len() - 1) as u32
        });
        self.slots.insert(id.to_string(), s);
        s
    }

    fn holder(&mut self, id: &str) -> Option<(u32, &mut Holder)> {
        let s = *self.slots.get(id)?;
        self.holders[s as usize].as_mut().map(|h| (s, h))
    }

    /// Takes every block of slot `s` out of the index.
    fn clear(&mut self, s: u32) {
        let Some(h) = self.holders[s as usize].as_mut() else { return };
        if let Some(e) = h.estimate.as_mut() {
            e.clear();
        }
        for b in std::mem::take(&mut h.held) {
            self.unlink(s, b);
        }
    }

    /// Block `b` is no longer held by slot `s`.
    fn unlink(&mut self, s: u32, b: u128) {
        if let Some(v) = self.blocks.get_mut(&b) {
            v.retain(|&x| x != s);
            if v.is_empty() {
                self.blocks.remove(&b);
            }
        }
    }

    fn add(&mut self, s: u32, b: u128) {
        let h = self.holders[s as usize].as_mut().expect("slot in use");
        if h.held.insert(b) {
            self.blocks.entry(b).or_default().push(s);
        }
    }

    fn remove(&mut self, s: u32, b: u128) {
        let h = self.holders[s as usize].as_mut().expect("slot in use");
        if h.held.remove(&b) {
            self.unlink(s, b);
        }
    }

    /// Slot `s` reported more blocks than any cache holds: it is not indexed (until a
    /// snapshot of a believable size), rather than take the router's memory.
    fn overflow(&mut self, s: u32) -> Refused {
        self.clear(s);
        let h = self.holders[s as usize].as_mut().expect("slot in use");
        h.state = State::Detached;
        h.snapshot_started = false;
        Refused::TooMany
    }

    fn holds(&self, s: u32, b: &BlockHash) -> bool {
        self.blocks.get(&b.0).is_some_and(|v| v.contains(&s))
    }
}

/// The index. Reads (placement) share it; node reports take it briefly.
#[derive(Debug, Default)]
pub struct KvIndex {
    inner: RwLock<Inner>,
}

/// How a node attaches.
#[derive(Debug, Clone, Default)]
pub struct Attaching {
    pub epoch: u64,
    /// It will report its blocks; false: estimate it (when it has a cache at all).
    pub events: bool,
    pub has_cache: bool,
    pub kvstore: String,
    pub is_store: bool,
}

impl KvIndex {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A node attached (or registered without events); returns its session. Whatever was held
    /// for it goes at once: a new epoch's blocks are not the old one's, and the same epoch's
    /// come again in the snapshot that follows.
    pub fn attach(&self, id: &str, a: &Attaching) -> u64 {
        let mut g = self.write();
        g.sessions += 1;
        let session = g.sessions;
        let s = g.slot(id);
        g.clear(s);
        let state = match (a.events, a.has_cache || a.is_store) {
            (true, _) => State::Resyncing,
            (false, true) => State::Estimate,
            (false, false) => State::None,
        };
        let old_store =
            g.holders[s as usize].as_ref().filter(|h| h.is_store).map(|h| h.kvstore.clone());
        if let Some(k) = old_store {
            g.stores.remove(&k);
        }
        g.holders[s as usize] = Some(Holder {
            epoch: a.epoch,
            session,
            state,
            next: 0,
            snapshot_started: false,
            held: HashSet::new(),
            estimate: (state == State::Estimate).then(LruCache::unbounded),
            kvstore: a.kvstore.clone(),
            is_store: a.is_store,
        });
        if a.is_store && !a.kvstore.is_empty() {
            g.stores.insert(a.kvstore.clone(), s);
        }
        session
    }

    /// A part of a snapshot. The first part replaces what was held; the last makes the node
    /// exact, with events going on from `seq + 1`.
    pub fn snapshot(
        &self,
        id: &str,
        session: u64,
        epoch: u64,
        seq: u64,
        blocks: &[u128],
        more: bool,
    ) -> Result<(), Refused> {
        let mut g = self.write();
        let (s, h) = g.holder(id).ok_or(Refused::Stale)?;
        if h.session != session {
            return Err(Refused::Stale);
        }
        // A snapshot under another epoch is a wiped cache: the old blocks go with the old
        // epoch, and this snapshot is the new one's.
        if h.epoch != epoch {
            h.epoch = epoch;
            h.snapshot_started = false;
        }
        let first = !h.snapshot_started;
        let after = if first { 0 } else { h.held.len() } + blocks.len();
        if after > MAX_REPORTED_BLOCKS {
            return Err(g.overflow(s));
        }
        if first {
            g.clear(s);
        }
        let h = g.holders[s as usize].as_mut().expect("slot in use");
        h.snapshot_started = more;
        if more {
            h.state = State::Resyncing;
        } else {
            h.state = State::Exact;
            h.next = seq + 1;
        }
        for &b in blocks {
            g.add(s, b);
        }
        Ok(())
    }

    /// Events numbered from `first`, in order: `(stored, block)`. Those of a node awaiting
    /// a snapshot are dropped (the snapshot covers them); a gap asks for one.
    pub fn events(
        &self,
        id: &str,
        session: u64,
        epoch: u64,
        first: u64,
        changes: &[(bool, u128)],
    ) -> Result<(), Refused> {
        let mut g = self.write();
        let (s, h) = g.holder(id).ok_or(Refused::Stale)?;
        if h.session != session {
            return Err(Refused::Stale);
        }
        match h.state {
            State::Exact => {}
            // The snapshot on its way covers them; an overflowed node is not indexed.
            State::Resyncing | State::Detached => return Ok(()),
            State::None | State::Estimate => {
                return Err(Refused::Resync("events from a node that said it sends none".into()));
            }
        }
        if epoch != h.epoch {
            h.state = State::Resyncing;
            return Err(Refused::Resync(format!(
                "events of epoch {epoch:016x}; the node's is {:016x}",
                h.epoch
            )));
        }
        if first != h.next {
            let want = h.next;
            h.state = State::Resyncing;
            return Err(Refused::Resync(format!("event {first} came where {want} was due")));
        }
        h.next = first + changes.len() as u64;
        for &(stored, b) in changes {
            if stored {
                g.add(s, b);
            } else {
                g.remove(s, b);
            }
        }
        if g.holders[s as usize].as_ref().is_some_and(|h| h.held.len() > MAX_REPORTED_BLOCKS) {
            return Err(g.overflow(s));
        }
        Ok(())
    }

    /// The node's session ended: its blocks leave the index until it attaches again.
    pub fn detach(&self, id: &str, session: u64) {
        let mut g = self.write();
        let Some((s, h)) = g.holder(id) else { return };
        if h.session != session {
            return;
        }
        h.state = State::Detached;
        g.clear(s);
    }

    /// The node left the mesh.
    pub fn forget(&self, id: &str) {
        let mut g = self.write();
        let Some(s) = g.slots.remove(id) else { return };
        g.clear(s);
        if let Some(h) = g.holders[s as usize].take()
            && h.is_store
        {
            g.stores.remove(&h.kvstore);
        }
        g.free.push(s);
    }

    /// This router sent `chain` to `id`: an estimated node will hold it (at most `cap`
    /// blocks, least recently sent forgotten first). Exact nodes report it themselves.
    pub fn sent(&self, id: &str, chain: &[BlockHash], cap: usize) {
        let mut g = self.write();
        let Some((_, h)) = g.holder(id) else { return };
        let Some(e) = h.estimate.as_mut() else { return };
        let cap = cap.min(MAX_ESTIMATED_BLOCKS);
        for b in chain {
            e.put(b.0, ());
        }
        while e.len() > cap {
            e.pop_lru();
        }
    }

    /// What each of `nodes` (prefill node ids with their KV-store) would take from a cache
    /// of `chain`'s first `usable` blocks; nodes with no hits are left out.
    pub fn hits<'n>(
        &self,
        chain: &[BlockHash],
        usable: usize,
        nodes: impl Iterator<Item = &'n str>,
    ) -> HashMap<String, Hits> {
        let chain = &chain[..usable.min(chain.len())];
        let mut out = HashMap::new();
        if chain.is_empty() {
            return out;
        }
        let g = self.read();
        // Runs of leading blocks per exact holder: those holding block 0, narrowed block by
        // block.
        let mut runs: HashMap<u32, usize> = HashMap::new();
        if let Some(first) = g.blocks.get(&chain[0].0) {
            let mut alive: Vec<u32> = first.clone();
            for (i, b) in chain.iter().enumerate().skip(1) {
                let holders = g.blocks.get(&b.0);
                alive.retain(|s| {
                    let keep = holders.is_some_and(|v| v.contains(s));
                    if !keep {
                        runs.insert(*s, i);
                    }
                    keep
                });
                if alive.is_empty() {
                    break;
                }
            }
            for s in alive {
                runs.insert(s, chain.len());
            }
        }
        // A store's run from where a node's own ends, by that point.
        let mut store_runs: HashMap<(u32, usize), usize> = HashMap::new();
        for id in nodes {
            let Some(&s) = g.slots.get(id) else { continue };
            let Some(h) = g.holders[s as usize].as_ref() else { continue };
            let own = match (&h.estimate, h.state) {
                (Some(e), State::Estimate) => chain.iter().take_while(|b| e.contains(&b.0)).count(),
                _ => runs.get(&s).copied().unwrap_or(0),
            };
            let store = match g.stores.get(&h.kvstore) {
                Some(&k) if !h.kvstore.is_empty() && own < chain.len() => *store_runs
                    .entry((k, own))
                    .or_insert_with(|| chain[own..].iter().take_while(|b| g.holds(k, b)).count()),
                _ => 0,
            };
            if own + store > 0 {
                out.insert(id.to_string(), Hits { own, store });
            }
        }
        out
    }

    /// The index's view of a node: its state, blocks, their digest and its epoch.
    pub fn status(&self, id: &str) -> (State, usize, u64, u64) {
        let g = self.read();
        let Some(h) = g.slots.get(id).and_then(|&s| g.holders[s as usize].as_ref()) else {
            return (State::None, 0, 0, 0);
        };
        let (n, digest) = match &h.estimate {
            Some(e) => (e.len(), pdmesh_kv_types::digest(e.iter().map(|(b, _)| BlockHash(*b)))),
            None => (h.held.len(), pdmesh_kv_types::digest(h.held.iter().map(|b| BlockHash(*b)))),
        };
        (h.state, n, digest, h.epoch)
    }

    /// Distinct blocks indexed, and node-held entries (a block two nodes hold counts twice).
    pub fn size(&self) -> (usize, usize) {
        let g = self.read();
        (g.blocks.len(), g.blocks.values().map(Vec::len).sum())
    }

    /// Nodes in each state.
    pub fn states(&self) -> HashMap<State, usize> {
        let g = self.read();
        let mut out = HashMap::new();
        for h in g.holders.iter().flatten() {
            *out.entry(h.state).or_default() += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u128) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(1000 + i)).collect()
    }

    fn raw(c: &[BlockHash]) -> Vec<u128> {
        c.iter().map(|b| b.0).collect()
    }

    fn attach(idx: &KvIndex, id: &str, epoch: u64, kvstore: &str, is_store: bool) -> u64 {
        let a =
            Attaching { epoch, events: true, has_cache: true, kvstore: kvstore.into(), is_store };
        idx.attach(id, &a)
    }

    fn hits(idx: &KvIndex, c: &[BlockHash], nodes: &[&str]) -> HashMap<String, Hits> {
        idx.hits(c, c.len(), nodes.iter().copied())
    }

    #[test]
    fn leading_runs_per_node_and_the_store_after_them() {
        let idx = KvIndex::default();
        let c = chain(6);
        let a = attach(&idx, "a", 1, "kv:1", false);
        let b = attach(&idx, "b", 2, "", false);
        let k = attach(&idx, "store", 3, "kv:1", true);
        idx.snapshot("a", a, 1, 0, &raw(&c[..2]), false).unwrap();
        // b holds blocks 0, 1, 2 and 4: its run stops at the missing 3.
        let bs: Vec<u128> = [0, 1, 2, 4].iter().map(|&i| c[i].0).collect();
        idx.snapshot("b", b, 2, 0, &bs, false).unwrap();
        idx.snapshot("store", k, 3, 0, &raw(&c[1..5]), false).unwrap();
        let h = hits(&idx, &c, &["a", "b", "nobody"]);
        assert_eq!(h["a"], Hits { own: 2, store: 3 }, "the store continues a's run from block 2");
        assert_eq!(h["b"], Hits { own: 3, store: 0 }, "b reads from no store");
        assert_eq!(h.len(), 2);
        // Only the usable blocks count (the prompt's last token is always computed).
        assert_eq!(idx.hits(&c, 1, ["a"].into_iter())["a"], Hits { own: 1, store: 0 });
    }

    #[test]
    fn events_apply_in_order_and_a_gap_asks_for_a_snapshot() {
        let idx = KvIndex::default();
        let c = chain(3);
        let s = attach(&idx, "a", 7, "", false);
        assert!(hits(&idx, &c, &["a"]).is_empty());
        // Events before the snapshot are covered by it.
        idx.events("a", s, 7, 1, &[(true, c[0].0)]).unwrap();
        idx.snapshot("a", s, 7, 4, &[c[0].0], false).unwrap();
        idx.events("a", s, 7, 5, &[(true, c[1].0), (true, c[2].0), (false, c[2].0)]).unwrap();
        assert_eq!(hits(&idx, &c, &["a"])["a"].own, 2);
        let e = idx.events("a", s, 7, 9, &[(false, c[0].0)]).unwrap_err();
        assert!(matches!(e, Refused::Resync(ref m) if m.contains("event 9 came where 8")), "{e}");
        assert_eq!(idx.status("a").0, State::Resyncing);
        // Until the snapshot, later events are dropped; then it replaces everything.
        idx.events("a", s, 7, 10, &[(true, 5)]).unwrap();
        idx.snapshot("a", s, 7, 10, &[c[2].0], true).unwrap();
        idx.snapshot("a", s, 7, 10, &[], false).unwrap();
        let (state, n, digest, epoch) = idx.status("a");
        assert_eq!((state, n, epoch), (State::Exact, 1, 7));
        assert_eq!(digest, pdmesh_kv_types::digest([c[2]]));
        assert!(hits(&idx, &c, &["a"]).is_empty(), "block 0 is gone, so no run");
        idx.events("a", s, 7, 11, &[(true, c[0].0)]).unwrap();
        assert_eq!(hits(&idx, &c, &["a"])["a"].own, 1);
    }

    #[test]
    fn a_new_epoch_or_session_end_drops_the_blocks_at_once() {
        let idx = KvIndex::default();
        let c = chain(2);
        let s1 = attach(&idx, "a", 1, "", false);
        idx.snapshot("a", s1, 1, 0, &raw(&c), false).unwrap();
        assert_eq!(hits(&idx, &c, &["a"])["a"].own, 2);
        // Restarted: a new session under a new epoch, before its snapshot.
        let s2 = attach(&idx, "a", 2, "", false);
        assert!(hits(&idx, &c, &["a"]).is_empty());
        assert_eq!(idx.size(), (0, 0));
        // The old session's late report and its end change nothing.
        assert_eq!(idx.events("a", s1, 1, 1, &[(true, 9)]), Err(Refused::Stale));
        idx.detach("a", s1);
        idx.snapshot("a", s2, 2, 0, &raw(&c), false).unwrap();
        assert_eq!(idx.status("a").0, State::Exact);
        idx.detach("a", s2);
        assert_eq!((idx.status("a").0, idx.size()), (State::Detached, (0, 0)));
        idx.forget("a");
        assert_eq!(idx.status("a").0, State::None);
    }

    #[test]
    fn a_node_without_events_is_estimated_from_what_was_sent_to_it() {
        let idx = KvIndex::default();
        let c = chain(4);
        let a = Attaching { has_cache: true, ..Attaching::default() };
        idx.attach("a", &a);
        idx.sent("a", &c, 100);
        assert_eq!(hits(&idx, &c, &["a"])["a"].own, 4);
        assert_eq!(idx.status("a").0, State::Estimate);
        // At most its advertised size: the oldest blocks (the prompt's start) go first.
        idx.sent("a", &c, 2);
        assert!(hits(&idx, &c, &["a"]).is_empty());
        // A node without a cache holds nothing, whatever it is sent.
        idx.attach("b", &Attaching::default());
        idx.sent("b", &c, 100);
        assert!(hits(&idx, &c, &["b"]).is_empty());
    }

    /// A node claiming more blocks than any cache holds is not indexed, rather than taking the
    /// router's memory.
    #[test]
    fn a_flood_of_blocks_is_not_indexed() {
        let idx = KvIndex::default();
        let s = attach(&idx, "liar", 1, "", false);
        let flood: Vec<u128> = (0..MAX_REPORTED_BLOCKS as u128 + 1).collect();
        assert_eq!(idx.snapshot("liar", s, 1, 0, &flood, false), Err(Refused::TooMany));
        assert_eq!(idx.size(), (0, 0));
        assert_eq!(idx.status("liar").0, State::Detached);
    }
}
