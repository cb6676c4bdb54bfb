//! In-flight prefix coalescing. When many requests that share a prefix nothing has cached yet
//! arrive together (a new system prompt), only the first computes it: as it is sent to its
//! prefill node it becomes the prefix's leader, and the others, each about to be sent to a
//! prefill node in turn, wait until the leader's node has computed (and cached) its prompt,
//! then prefill on that node, where only their own tails are left to compute. Without this,
//! every request of the herd computes the same blocks on whichever node it lands on.
//!
//! A leader registers the blocks of its prompt's chain that no prefill node was thought to
//! hold; a later prompt waits on the leader whose chain shares the longest run of leading
//! blocks with its own, past those. Leaders register only once dispatched, so nobody waits on
//! a request that is itself still waiting for room. The wait is bounded by the router's
//! `coalesce_wait_ms`, and by half of what is left of the request's deadline and of its
//! decode reservation's lease, so a slow leader never holds its followers past either; a
//! leader that fails or goes away wakes them at once. This router's requests only: another
//! router's leaders are not seen.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pdmesh_kv_types::{BlockHash, KvLayout};
use tokio::sync::watch;

#[derive(Debug, Default)]
pub struct Computing {
    leaders: Arc<Mutex<Leaders>>,
    /// Fewest shared tokens worth waiting for (whole blocks count).
    min_tokens: usize,
}

#[derive(Debug, Default)]
struct Leaders {
    next: u64,
    by_id: HashMap<u64, Leader>,
    /// Leaders by their chain's first block: chained hashes make two chains that share any
    /// leading block share the first, so a prompt looks only at leaders it could follow.
    by_first: HashMap<BlockHash, Vec<u64>>,
}

impl Leaders {
    fn remove(&mut self, id: u64) {
        let Some(l) = self.by_id.remove(&id) else { return };
        if let Some(first) = l.chain.first()
            && let Some(ids) = self.by_first.get_mut(first)
        {
            ids.retain(|i| *i != id);
            if ids.is_empty() {
                self.by_first.remove(first);
            }
        }
    }
}

#[derive(Debug)]
struct Leader {
    layout: KvLayout,
    chain: Vec<BlockHash>,
    /// Leading blocks of `chain` that were held somewhere already: not computed by it.
    held: usize,
    /// Closed when the leader's prompt is computed (naming the prefill node that holds it
    /// now), or it gave up (naming none).
    done: watch::Receiver<Option<String>>,
}

/// What a request does about its prefix.
#[derive(Debug)]
pub enum Coalesce {
    /// Nothing another request is computing: compute it, as the leader of its blocks.
    Lead(Lead),
    /// Another request is computing `tokens` of its prompt's leading tokens: wait for it.
    Follow { leader: watch::Receiver<Option<String>>, tokens: usize },
}

/// A leader's registration; dropping it (its prompt computed, or the request over) wakes
/// the requests waiting on it.
#[derive(Debug)]
pub struct Lead {
    leaders: Arc<Mutex<Leaders>>,
    id: u64,
    done: watch::Sender<Option<String>>,
}

impl Lead {
    /// The prompt is computed and cached on prefill node `node`: its followers may go, and
    /// had best go there.
    pub fn computed_on(self, node: &str) {
        self.done.send_replace(Some(node.to_string()));
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        self.leaders.lock().unwrap_or_else(|p| p.into_inner()).remove(self.id);
    }
}

impl Computing {
    /// Prompts wait only for a leader computing at least `min_tokens` of their leading
    /// tokens: sharing a short one (a chat template's few tokens) saves little and would send
    /// a whole burst to the leader's prefill node after it.
    pub fn new(min_tokens: usize) -> Self {
        Self { leaders: Arc::default(), min_tokens }
    }

    /// Under one lock, so two requests of a herd never both lead: the leader computing the
    /// longest run of `prompt`'s leading blocks past the `held` (thought cached somewhere),
    /// or else a registration of this prompt's unheld blocks as computing. None when its
    /// unheld blocks come to fewer than `min_tokens` (nobody would wait for them) and it has
    /// nobody to follow.
    pub fn lead_or_follow(
        &self,
        layout: &KvLayout,
        chain: &[BlockHash],
        held: usize,
    ) -> Option<Coalesce> {
        let bs = layout.block_size();
        // Too short to save min_tokens by following anyone, or to be worth following.
        let first = chain.first()?;
        if chain.len() * bs < self.min_tokens {
            return None;
        }
        let mut leaders = self.leaders.lock().unwrap_or_else(|p| p.into_inner());
        let mut best: Option<(usize, &Leader)> = None;
        let candidates = leaders.by_first.get(first).map_or(&[][..], Vec::as_slice);
        // Blocks of one layout only: another's are not this prompt's KV.
        for l in candidates.iter().filter_map(|id| leaders.by_id.get(id)) {
            if l.layout != *layout {
                continue;
            }
            let common = chain.iter().zip(&l.chain).take_while(|(a, b)| a == b).count();
            // Not the caller's `held`: the leader's own, what was cached when it started.
            let saved = common.saturating_sub(l.held) * bs;
            if common > l.held && saved >= self.min_tokens && best.is_none_or(|(c, _)| common > c) {
                best = Some((common, l));
            }
        }
        if let Some((blocks, l)) = best {
            let tokens = blocks * bs;
            return Some(Coalesce::Follow { leader: l.done.clone(), tokens });
        }
        // A later prompt follows only for min_tokens past what was held when this one began.
        if chain.len().saturating_sub(held) * bs < self.min_tokens.max(1) {
            return None;
        }
        let (tx, rx) = watch::channel(None);
        let id = leaders.next;
        leaders.next += 1;
        leaders.by_first.entry(*first).or_default().push(id);
        let chain = chain.to_vec();
        leaders.by_id.insert(id, Leader { layout: *layout, chain, held, done: rx });
        Some(Coalesce::Lead(Lead { leaders: Arc::clone(&self.leaders), id, done: tx }))
    }

    /// Prompts being computed by a leader now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.leaders.lock().unwrap_or_else(|p| p.into_inner()).by_id.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::chain;

    fn layout() -> KvLayout {
        crate::registry::tests::layout(7, 4)
    }

    fn lead(c: &Computing, prompt: &[u32], held: usize) -> Lead {
        match c.lead_or_follow(&layout(), &chain(&layout(), b"t", prompt), held) {
            Some(Coalesce::Lead(l)) => l,
            other => panic!("expected to lead, got {other:?}"),
        }
    }

    fn follows(c: &Computing, salt: &[u8], prompt: &[u32], held: usize) -> Option<usize> {
        match c.lead_or_follow(&layout(), &chain(&layout(), salt, prompt), held)? {
            Coalesce::Follow { tokens, .. } => Some(tokens),
            Coalesce::Lead(_) => None,
        }
    }

    #[test]
    fn a_herd_sharing_a_new_prefix_has_one_leader_until_it_is_done() {
        let c = Computing::default();
        let bs = layout().block_size();
        let system: Vec<u32> = (0..4 * bs as u32).collect();
        let with = |q: u32| system.iter().copied().chain(vec![q; bs + 1]).collect::<Vec<_>>();
        let leader = lead(&c, &with(900), 0);
        // The rest of the herd waits for the system prompt's blocks.
        assert_eq!(follows(&c, b"t", &with(901), 0), Some(4 * bs));
        assert_eq!(follows(&c, b"t", &with(902), 0), Some(4 * bs));
        let Some(Coalesce::Follow { leader: rx, .. }) =
            c.lead_or_follow(&layout(), &chain(&layout(), b"t", &with(903)), 0)
        else {
            panic!("expected to follow")
        };
        // Another tenant's prompt shares nothing; its own blocks make it a leader.
        assert!(follows(&c, b"other tenant", &with(901), 0).is_none());
        assert_eq!(c.len(), 1);
        leader.computed_on("prefill-1");
        assert!(rx.has_changed().is_err(), "the leader's end wakes its followers");
        assert_eq!(rx.borrow().as_deref(), Some("prefill-1"), "and says where the prefix is");
        assert!(c.is_empty());
        // The system prompt is held now: the next request leads its own blocks.
        let _next = lead(&c, &with(904), 4);
        assert_eq!(follows(&c, b"t", &with(904), 4), Some(5 * bs));
    }

    #[test]
    fn a_short_shared_prefix_is_not_waited_for() {
        let bs = layout().block_size();
        let c = Computing::new(3 * bs);
        let shared: Vec<u32> = (0..2 * bs as u32).collect();
        let a: Vec<u32> = shared.iter().copied().chain(100..100 + 3 * bs as u32).collect();
        let b: Vec<u32> = shared.iter().copied().chain(500..500 + 3 * bs as u32).collect();
        let _l = lead(&c, &a, 0);
        assert!(follows(&c, b"t", &b, 0).is_none(), "two shared blocks: under the minimum");
        assert_eq!(follows(&c, b"t", &a, 0), Some(5 * bs), "the whole prompt: over it");
    }

    #[test]
    fn prompts_nobody_could_follow_lead_nothing_and_leaders_leave_no_trace() {
        let bs = layout().block_size();
        let c = Computing::new(3 * bs);
        let short: Vec<u32> = (0..2 * bs as u32).collect();
        assert!(follows(&c, b"t", &short, 0).is_none(), "two blocks: under the minimum");
        assert!(c.is_empty(), "and not registered: nobody would ever wait for it");
        let long: Vec<u32> = (0..4 * bs as u32).collect();
        assert!(follows(&c, b"t", &long, 2).is_none(), "two unheld blocks: the same");
        assert!(c.is_empty());
        // Leaders sharing a first block, leaving in any order, leave the index empty.
        let a = lead(&c, &long, 0);
        let b: Vec<u32> = long.iter().copied().chain(900..900 + 2 * bs as u32).collect();
        let two = match c.lead_or_follow(&layout(), &chain(&layout(), b"u", &b), 0) {
            Some(Coalesce::Lead(l)) => l,
            other => panic!("another tenant's prompt leads, got {other:?}"),
        };
        assert_eq!(follows(&c, b"t", &b, 0), Some(4 * bs), "follows the one it shares with");
        drop(a);
        assert!(follows(&c, b"t", &b, 0).is_none(), "its leader gone, it leads itself");
        drop(two);
        let leaders = c.leaders.lock().unwrap();
        assert!(leaders.by_id.is_empty() && leaders.by_first.is_empty(), "{leaders:?}");
    }

    #[test]
    fn only_blocks_not_held_are_waited_for() {
        let c = Computing::default();
        let bs = layout().block_size() as u32;
        let system: Vec<u32> = (0..3 * bs).collect();
        let mut a = system.clone();
        a.extend(100..100 + 2 * bs);
        // The leader found the system prompt held: it computes only its own two blocks.
        let _l = lead(&c, &a, 3);
        let mut b = system.clone();
        b.extend(500..500 + 2 * bs);
        assert!(follows(&c, b"t", &b, 0).is_none(), "the shared blocks are cached already");
        // The same prompt again waits for the leader's blocks.
        assert_eq!(follows(&c, b"t", &a, 3), Some(5 * bs as usize));
        // A prompt shorter than a block has nothing to lead.
        assert!(c.lead_or_follow(&layout(), &chain(&layout(), b"t", &[1, 2]), 0).is_none());
    }
}
