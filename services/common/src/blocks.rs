//! The node side of block events: what a node holds for reuse (its prefix cache, the
//! KV-store's blocks), as numbered changes every router session replays in order.
//!
//! The cache reports each change under its own lock, so the log's order is the cache's. The
//! log mirrors the set it describes: a snapshot is that set at a sequence number, consistent
//! with the changes after it by construction, and a change that changes nothing (a block
//! stored again, or removed twice) is not a change. Recent changes are kept in a bounded
//! ring; a session that falls further behind than the ring reaches sends a snapshot instead.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

/// Changes kept for sessions catching up (17 bytes each on the wire, 32 here).
pub const RING: usize = 1 << 16;

/// A block's hash, as `pdmesh_kv_types::BlockHash` holds it.
pub type Block = u128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub stored: bool,
    pub block: Block,
    /// When it happened, in microseconds since the Unix epoch.
    pub at_us: u64,
}

/// What a session reads next.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Nothing since `from`.
    Nothing,
    /// The changes numbered from `first`.
    Changes { first: u64, changes: Vec<Change> },
    /// `from` is older than the ring: send a snapshot.
    Behind,
}

#[derive(Debug)]
struct Inner {
    /// The number of the last change (0: none yet).
    seq: u64,
    ring: VecDeque<Change>,
    held: HashSet<Block>,
    cap: usize,
}

#[derive(Debug)]
pub struct BlockLog {
    epoch: u64,
    inner: Mutex<Inner>,
    /// The last change's number, for sessions to wait on.
    tx: watch::Sender<u64>,
}

/// Microseconds since the Unix epoch on this node's clock.
pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

impl Default for BlockLog {
    fn default() -> Self {
        Self::new(RING)
    }
}

impl BlockLog {
    /// An empty log under a fresh random epoch, keeping `ring` changes for replay.
    pub fn new(ring: usize) -> Self {
        let mut b = [0u8; 8];
        // A process that cannot draw randomness still needs an epoch unlike its last one.
        let epoch = match getrandom::fill(&mut b) {
            Ok(()) => u64::from_le_bytes(b),
            Err(_) => now_us() ^ u64::from(std::process::id()) << 32,
        };
        let inner = Inner { seq: 0, ring: VecDeque::new(), held: HashSet::new(), cap: ring.max(1) };
        Self { epoch: epoch.max(1), inner: Mutex::new(inner), tx: watch::channel(0).0 }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("block log lock is never poisoned")
    }

    /// Records that the node now holds `stored` and no longer holds `removed`, in that order.
    /// The caller holds its cache's lock, so changes land in the order they happened.
    pub fn record(
        &self,
        stored: impl IntoIterator<Item = Block>,
        removed: impl IntoIterator<Item = Block>,
    ) {
        let at_us = now_us();
        let mut g = self.lock();
        let before = g.seq;
        let changes =
            stored.into_iter().map(|b| (true, b)).chain(removed.into_iter().map(|b| (false, b)));
        for (stored, block) in changes {
            let changed = if stored { g.held.insert(block) } else { g.held.remove(&block) };
            if changed {
                g.seq += 1;
                if g.ring.len() == g.cap {
                    g.ring.pop_front();
                }
                g.ring.push_back(Change { stored, block, at_us });
            }
        }
        let seq = g.seq;
        drop(g);
        if seq != before {
            self.tx.send_replace(seq);
        }
    }

    /// Changes from number `from` on, at most `max` of them.
    pub fn since(&self, from: u64, max: usize) -> Next {
        let g = self.lock();
        if from > g.seq {
            return Next::Nothing;
        }
        // The ring holds changes (seq - len, seq].
        let oldest = g.seq + 1 - g.ring.len() as u64;
        if from < oldest {
            return Next::Behind;
        }
        let skip = (from - oldest) as usize;
        let changes: Vec<Change> = g.ring.iter().skip(skip).take(max.max(1)).copied().collect();
        Next::Changes { first: from, changes }
    }

    /// Every block held, and the number of the last change they include.
    pub fn snapshot(&self) -> (u64, Vec<Block>) {
        let g = self.lock();
        (g.seq, g.held.iter().copied().collect())
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.lock().held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wakes when a change is recorded.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }
}

/// Encodes changes as `BlockEvents.changes`: a kind byte, then the hash's 16 bytes.
pub fn encode(changes: &[Change]) -> Vec<u8> {
    let mut out = Vec::with_capacity(changes.len() * 17);
    for c in changes {
        out.push(u8::from(c.stored));
        out.extend_from_slice(&c.block.to_le_bytes());
    }
    out
}

/// Decodes `BlockEvents.changes` into `(stored, block)`; None if it is not whole records.
pub fn decode(bytes: &[u8]) -> Option<Vec<(bool, Block)>> {
    if !bytes.len().is_multiple_of(17) {
        return None;
    }
    bytes
        .chunks_exact(17)
        .map(|r| {
            let stored = match r[0] {
                0 => false,
                1 => true,
                _ => return None,
            };
            Some((stored, u128::from_le_bytes(r[1..].try_into().ok()?)))
        })
        .collect()
}

/// Decodes `BlockSnapshot.blocks`; None if it is not whole hashes.
pub fn decode_blocks(bytes: &[u8]) -> Option<Vec<Block>> {
    if !bytes.len().is_multiple_of(16) {
        return None;
    }
    Some(bytes.chunks_exact(16).map(|r| u128::from_le_bytes(r.try_into().expect("16"))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_numbered_and_only_real_changes_count() {
        let log = BlockLog::new(8);
        log.record([1, 2, 2], []);
        log.record([], [3, 1]);
        let Next::Changes { first, changes } = log.since(1, 100) else { panic!() };
        assert_eq!(first, 1);
        let kinds: Vec<(bool, u128)> = changes.iter().map(|c| (c.stored, c.block)).collect();
        assert_eq!(kinds, [(true, 1), (true, 2), (false, 1)], "2 twice and 3 never held");
        assert_eq!(log.snapshot(), (3, vec![2]));
        assert_eq!(log.since(4, 10), Next::Nothing);
        let Next::Changes { first: 3, changes } = log.since(3, 10) else { panic!() };
        assert_eq!(changes.len(), 1);
    }

    #[test]
    fn a_session_behind_the_ring_must_take_a_snapshot() {
        let log = BlockLog::new(4);
        log.record(0..10, []);
        assert_eq!(log.since(6, 100), Next::Behind);
        let Next::Changes { first: 7, changes } = log.since(7, 2) else { panic!() };
        assert_eq!(changes.iter().map(|c| c.block).collect::<Vec<_>>(), [6, 7]);
        let (seq, mut held) = log.snapshot();
        held.sort();
        assert_eq!((seq, held), (10, (0..10).collect()));
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let c = [
            Change { stored: true, block: u128::MAX - 5, at_us: 0 },
            Change { stored: false, block: 7, at_us: 0 },
        ];
        assert_eq!(decode(&encode(&c)), Some(vec![(true, u128::MAX - 5), (false, 7)]));
        assert_eq!(decode(&[1; 16]), None);
        let mut bad = encode(&c);
        bad[0] = 9;
        assert_eq!(decode(&bad), None);
        assert_eq!(decode_blocks(&[0; 32]), Some(vec![0, 0]));
        assert_eq!(decode_blocks(&[0; 31]), None);
    }

    #[test]
    fn every_log_has_its_own_epoch() {
        assert_ne!(BlockLog::default().epoch(), BlockLog::default().epoch());
    }
}
