//! The router's estimate of which prompt blocks each prefill node holds in its own cache:
//! the hash chains of the prompts it sent there, least recently sent forgotten first once a
//! node's advertised cache size is reached. Nodes evict on their own, so this is a guess that
//! placement weighs against load, never a fact it relies on.

use std::collections::HashMap;
use std::sync::Mutex;

use lru::LruCache;
use pdmesh_kv_types::{BlockHash, BlockHasher, KvLayout};

use crate::registry::Node;

/// The most blocks remembered for one node, whatever it claims: 2^20 blocks are 16M tokens
/// at 16 per block, past any node's cache, and about 50 MB of router memory.
pub const MAX_TRACKED_BLOCKS: usize = 1 << 20;

#[derive(Debug, Default)]
pub struct PrefixIndex {
    nodes: Mutex<HashMap<String, LruCache<BlockHash, ()>>>,
}

/// A prompt's chain under one KV layout (nodes of one mesh share it; a node that differs gets
/// its own) in the space of one cache group (`salt`).
pub fn chain(layout: &KvLayout, salt: &[u8], prompt: &[u32]) -> Vec<BlockHash> {
    BlockHasher::new(layout).map_or_else(Vec::new, |h| h.salted(salt).chain(prompt))
}

impl PrefixIndex {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, LruCache<BlockHash, ()>>> {
        self.nodes.lock().expect("prefix index lock is never poisoned")
    }

    /// Prompt tokens of `prompt` each of `nodes` is thought to hold, by node id (absent: none).
    pub fn matched(&self, nodes: &[&Node], salt: &[u8], prompt: &[u32]) -> HashMap<String, usize> {
        let mut chains: Vec<(&KvLayout, Vec<BlockHash>)> = Vec::new();
        let mut out = HashMap::new();
        let index = self.lock();
        for n in nodes {
            let Some(held) = index.get(&n.id) else { continue };
            if !chains.iter().any(|(l, _)| **l == n.layout) {
                chains.push((&n.layout, chain(&n.layout, salt, prompt)));
            }
            let c = &chains.iter().find(|(l, _)| **l == n.layout).expect("just added").1;
            // A look does not count as use: only the node a prompt is sent to refreshes it.
            let blocks = c.iter().take_while(|h| held.contains(*h)).count();
            if blocks > 0 {
                out.insert(n.id.clone(), blocks * n.layout.block_size());
            }
        }
        out
    }

    /// `node` was sent `prompt`: it will hold its full blocks (if it has a cache at all).
    pub fn record(&self, node: &Node, salt: &[u8], prompt: &[u32]) {
        let mut index = self.lock();
        // The size is the node's own claim: it bounds what is remembered for it, and is never
        // allocated up front (a claim of 4 billion blocks once made the router allocate them).
        let cap = (node.load.cache_blocks as usize).min(MAX_TRACKED_BLOCKS);
        if cap == 0 {
            index.remove(&node.id);
            return;
        }
        let held = index.entry(node.id.clone()).or_insert_with(LruCache::unbounded);
        for h in chain(&node.layout, salt, prompt) {
            held.put(h, ());
        }
        while held.len() > cap {
            held.pop_lru();
        }
    }

    /// Forgets nodes that left or registered anew (a restarted node's cache is empty).
    pub fn forget(&self, node: &str) {
        self.lock().remove(node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_proto::v1::{NodeLoad, Role};
    use std::time::Instant;

    fn node(id: &str, cache_blocks: u32) -> Node {
        Node {
            id: id.into(),
            role: Role::Prefill,
            address: String::new(),
            layout: crate::registry::tests::layout(7, 4),
            load: NodeLoad { cache_blocks, ..Default::default() },
            last_seen: Instant::now(),
            assigned: 0,
            pending_blocks: 0,
            suspect_until: None,
            every: std::time::Duration::from_millis(500),
            left: Default::default(),
        }
    }

    const S: &[u8] = b"tenant";

    #[test]
    fn another_tenants_prompt_matches_nothing() {
        let idx = PrefixIndex::default();
        let a = node("a", 100);
        let p: Vec<u32> = (0..16).collect();
        idx.record(&a, b"tenant-1", &p);
        assert_eq!(idx.matched(&[&a], b"tenant-1", &p)["a"], 16);
        assert!(idx.matched(&[&a], b"tenant-2", &p).is_empty());
    }

    #[test]
    fn matches_leading_blocks_of_what_each_node_was_sent() {
        let idx = PrefixIndex::default();
        let (a, b) = (node("a", 100), node("b", 100));
        let sys: Vec<u32> = (0..12).collect();
        let p1: Vec<u32> = sys.iter().copied().chain([50, 51, 52, 53, 54]).collect();
        idx.record(&a, S, &p1);
        let p2: Vec<u32> = sys.iter().copied().chain([60, 61, 62, 63]).collect();
        let m = idx.matched(&[&a, &b], S, &p2);
        // 3 shared blocks of 4 tokens; the 4th block differs; b was sent nothing.
        assert_eq!(m, HashMap::from([("a".to_string(), 12)]));
        // The same tokens at another position are another block.
        let shifted: Vec<u32> = [9].into_iter().chain(sys.iter().copied()).collect();
        assert!(idx.matched(&[&a], S, &shifted).is_empty());
        idx.forget("a");
        assert!(idx.matched(&[&a], S, &p2).is_empty());
    }

    #[test]
    fn a_node_holds_at_most_its_advertised_blocks() {
        let idx = PrefixIndex::default();
        let a = node("a", 2);
        let p: Vec<u32> = (0..16).collect();
        idx.record(&a, S, &p);
        // Blocks 0 and 1 were forgotten first, so the prompt's start is no longer held.
        assert!(idx.matched(&[&a], S, &p).is_empty());
        let none = node("a", 0);
        idx.record(&none, S, &p);
        assert!(idx.matched(&[&a], S, &p).is_empty(), "a node without a cache holds nothing");
    }

    /// A node claiming 2^32 - 1 cache blocks made the router allocate that many entries and
    /// abort; the claim now bounds only what is remembered.
    #[test]
    fn a_huge_claimed_cache_allocates_nothing_up_front() {
        let idx = PrefixIndex::default();
        let liar = node("liar", u32::MAX);
        let p: Vec<u32> = (0..64).collect();
        idx.record(&liar, S, &p);
        assert_eq!(idx.matched(&[&liar], S, &p)["liar"], 64);
        // And it still forgets past the cap: a bigger prompt than the cap keeps only its end.
        let small = node("liar", 3);
        let q: Vec<u32> = (100..132).collect();
        idx.record(&small, S, &q);
        assert_eq!(idx.lock()["liar"].len(), 3);
    }
}
