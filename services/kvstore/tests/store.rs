//! The KV-store's bookkeeping: longest-prefix matches, dedup, LRU eviction that never touches
//! a pinned or arriving block, and pins that end with their lease.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use pdmesh_kv_types::BlockHash;
use pdmesh_kvstore::{PutSlot, Store};

const LEASE: Duration = Duration::from_secs(10);

fn h(i: u128) -> BlockHash {
    BlockHash(i)
}

/// Stores blocks `ids` (each in a fresh slot, committed).
fn put_all(s: &mut Store, ids: &[u128]) -> Vec<u32> {
    ids.iter()
        .map(|&i| match s.reserve_put(h(i)) {
            PutSlot::Write(slot) => {
                assert!(s.commit_put(h(i)));
                slot
            }
            other => panic!("block {i}: {other:?}"),
        })
        .collect()
}

#[test]
fn match_returns_the_longest_stored_prefix_and_counts_tokens() {
    let mut s = Store::new(8 * 100, 100, 16);
    assert_eq!(s.capacity(), 8);
    let slots = put_all(&mut s, &[1, 2, 3]);
    let now = Instant::now();
    let m = s.match_prefix(&[h(1), h(2), h(9), h(3)], LEASE, now);
    assert_eq!(m.blocks, vec![(h(1), slots[0]), (h(2), slots[1])], "stops at the first miss");
    assert!(m.lease.is_some());
    let none = s.match_prefix(&[h(7), h(1)], LEASE, now);
    assert_eq!((none.lease, none.blocks.len()), (None, 0), "a prefix starts at the first block");
    let st = s.stats();
    assert_eq!((st.hit_tokens, st.miss_tokens), (2 * 16, 4 * 16));
    assert_eq!((st.blocks, st.bytes, st.pinned_blocks), (3, 300, 2));
}

#[test]
fn a_block_put_twice_is_stored_once() {
    let mut s = Store::new(4 * 10, 10, 16);
    put_all(&mut s, &[5]);
    assert_eq!(s.reserve_put(h(5)), PutSlot::Duplicate);
    // Arriving (not yet committed) counts too: two nodes racing to publish store it once.
    let PutSlot::Write(_) = s.reserve_put(h(6)) else { panic!() };
    assert_eq!(s.reserve_put(h(6)), PutSlot::Duplicate);
    let st = s.stats();
    assert_eq!((st.dedup, st.blocks), (2, 1), "the pending block is not matchable yet");
    assert!(s.match_prefix(&[h(6)], LEASE, Instant::now()).blocks.is_empty());
    assert!(s.commit_put(h(6)));
    assert_eq!(s.match_prefix(&[h(6)], LEASE, Instant::now()).blocks.len(), 1);
}

#[test]
fn eviction_is_lru_and_never_drops_a_pinned_or_arriving_block() {
    let mut s = Store::new(3 * 10, 10, 16);
    let now = Instant::now();
    let slots = put_all(&mut s, &[1, 2, 3]);
    // Block 1 is used again, so 2 is now the least recently used; pin 3 under a lease.
    let m1 = s.match_prefix(&[h(1)], LEASE, now);
    s.release(m1.lease.unwrap());
    let m3 = s.match_prefix(&[h(3)], LEASE, now);
    let slot2 = slots[1];
    assert_eq!(s.reserve_put(h(4)), PutSlot::Write(slot2), "the LRU unpinned block goes first");
    assert!(s.commit_put(h(4)));
    assert!(s.match_prefix(&[h(2)], LEASE, now).blocks.is_empty(), "block 2 was evicted");
    // 3 is pinned; 4 is newer than 1: 1 goes next, then nothing is left to evict.
    let PutSlot::Write(_) = s.reserve_put(h(5)) else { panic!("block 1 was evictable") };
    let m4 = s.match_prefix(&[h(4)], LEASE, now);
    assert_eq!(s.reserve_put(h(6)), PutSlot::Full, "3 and 4 pinned, 5 arriving");
    assert_eq!(s.match_prefix(&[h(3)], LEASE, now).blocks.len(), 1, "the pinned block stayed");
    assert_eq!(s.stats().evictions, 2);
    // Releasing the pins makes room again.
    s.release(m3.lease.unwrap());
    s.release(m4.lease.unwrap());
    assert!(matches!(s.reserve_put(h(6)), PutSlot::Write(_)));
}

#[test]
fn expired_leases_release_their_pins() {
    let mut s = Store::new(2 * 10, 10, 16);
    let t0 = Instant::now();
    put_all(&mut s, &[1, 2]);
    let m = s.match_prefix(&[h(1), h(2)], Duration::from_millis(100), t0);
    assert_eq!(s.reserve_put(h(3)), PutSlot::Full);
    assert_eq!(s.sweep(t0 + Duration::from_millis(99)), 0, "expired early");
    assert_eq!(s.sweep(t0 + Duration::from_millis(100)), 1);
    assert!(!s.release(m.lease.unwrap()), "an expired lease is gone");
    let st = s.stats();
    assert_eq!((st.pinned_blocks, st.leases, st.leases_expired), (0, 0, 1));
    assert!(matches!(s.reserve_put(h(3)), PutSlot::Write(_)));
}

#[test]
fn an_aborted_put_frees_its_slot() {
    let mut s = Store::new(10, 10, 16);
    let PutSlot::Write(slot) = s.reserve_put(h(1)) else { panic!() };
    assert_eq!(s.reserve_put(h(2)), PutSlot::Full, "the arriving block is not evictable");
    assert!(s.abort_put(h(1)));
    assert!(!s.commit_put(h(1)), "an aborted put cannot be committed");
    assert_eq!(s.reserve_put(h(2)), PutSlot::Write(slot));
    assert_eq!(Store::new(5, 10, 16).capacity(), 0, "a budget under one block holds nothing");
}
