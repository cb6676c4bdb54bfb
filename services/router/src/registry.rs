//! Which nodes exist and how loaded they are: registrations, heartbeats, expiry of silent
//! nodes, and the router's own count of requests it sent to each node since its last
//! heartbeat. A plain struct; the service wraps it in a mutex.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pdmesh_kv_types::KvLayout;
use pdmesh_proto::v1::{NodeLoad, Role};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone)]
pub struct Node {
    pub id: String,
    pub role: Role,
    pub address: String,
    pub layout: KvLayout,
    pub load: NodeLoad,
    pub last_seen: Instant,
    /// Requests this router placed on the node that are still running.
    pub assigned: u32,
    /// Of those, prompt tokens a prefill node is computing for this router (cache hits left
    /// out): the node's reported backlog lags, this does not.
    pub assigned_tokens: u64,
    /// Requests this router ever placed on the node. Among nodes equally loaded the one given
    /// the fewest goes first: in a quiet mesh every node is idle, and ties picked at random
    /// pile up as chance does (the busiest of 500 decode nodes took 3× the mean).
    pub placed: u64,
    /// Blocks this router reserved on the node since its last heartbeat reported them.
    pub pending_blocks: u32,
    /// Set when a call to the node failed as unreachable: skipped until then.
    pub suspect_until: Option<Instant>,
    /// How often the node was last told to heartbeat: its TTL stretches with it.
    pub every: Duration,
    /// Cancelled when the node leaves the mesh (deregistered, or its heartbeats lapsed): the
    /// requests running on it fail at once, without polling the registry.
    pub left: CancellationToken,
}

#[derive(Debug, Default)]
pub struct Registry {
    /// By id, so every listing is in id order without sorting.
    nodes: BTreeMap<String, Node>,
    ttl: Duration,
    /// The heartbeat interval of a small mesh, which `ttl` is the TTL for.
    every: Duration,
    /// Most heartbeats a second from all nodes together.
    beats_per_s: u32,
}

impl Registry {
    /// Nodes heartbeat every `every` and are dropped after `ttl` of silence, until the mesh
    /// is so large that they would send more than `beats_per_s` heartbeats a second together;
    /// then each heartbeats less often, and its TTL stretches in proportion.
    pub fn new(ttl: Duration, every: Duration, beats_per_s: u32) -> Self {
        Self { nodes: BTreeMap::new(), ttl, every, beats_per_s: beats_per_s.max(1) }
    }

    /// How often each node should heartbeat, at the mesh's size now: at 1,000 nodes a unary
    /// heartbeat every 500 ms cost the router a fifth of a core before any request came.
    pub fn beat_every(&self) -> Duration {
        let spread = Duration::from_secs_f64(self.nodes.len() as f64 / f64::from(self.beats_per_s));
        self.every.max(spread)
    }

    /// How long `n` may stay silent: the TTL, stretched as its interval was.
    pub fn ttl_of(&self, n: &Node) -> Duration {
        let stretch = n.every.as_secs_f64() / self.every.as_secs_f64().max(1e-9);
        self.ttl.mul_f64(stretch.max(1.0))
    }

    /// Adds or replaces a node; it takes traffic at once.
    pub fn register(
        &mut self,
        id: &str,
        role: Role,
        address: &str,
        layout: KvLayout,
        load: NodeLoad,
        now: Instant,
    ) {
        let (assigned, assigned_tokens, placed) =
            self.nodes.get(id).map_or((0, 0, 0), |n| (n.assigned, n.assigned_tokens, n.placed));
        // A node registering again (its session with this router broke) is the same node:
        // what runs on it keeps running.
        let left = self.nodes.get(id).map_or_else(CancellationToken::new, |n| n.left.clone());
        let every = self.every;
        self.nodes.insert(
            id.to_string(),
            Node {
                id: id.to_string(),
                role,
                address: address.to_string(),
                layout,
                load,
                last_seen: now,
                assigned,
                assigned_tokens,
                placed,
                pending_blocks: 0,
                suspect_until: None,
                every,
                left,
            },
        );
        let every = self.beat_every();
        if let Some(n) = self.nodes.get_mut(id) {
            n.every = every;
        }
    }

    /// Records a heartbeat; returns how often the node should heartbeat from now on, or None
    /// if the node is unknown (it must register again).
    pub fn heartbeat(&mut self, id: &str, load: NodeLoad, now: Instant) -> Option<Duration> {
        let every = self.beat_every();
        let n = self.nodes.get_mut(id)?;
        n.load = load;
        n.last_seen = now;
        n.pending_blocks = 0;
        n.suspect_until = None;
        n.every = every;
        Some(every)
    }

    /// Drops nodes silent for longer than the TTL; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let dead: Vec<String> = self
            .nodes
            .values()
            .filter(|n| now.duration_since(n.last_seen) > self.ttl_of(n))
            .map(|n| n.id.clone())
            .collect();
        for id in &dead {
            self.remove(id);
        }
        dead
    }

    /// Takes a node out of the mesh; false if it was unknown.
    pub fn remove(&mut self, id: &str) -> bool {
        match self.nodes.remove(id) {
            Some(n) => {
                n.left.cancel();
                true
            }
            None => false,
        }
    }

    /// A call to the node failed as unreachable: avoid it until it heartbeats again (or for
    /// one TTL, after which it is dropped anyway if it stays silent).
    pub fn suspect(&mut self, id: &str, now: Instant) {
        if let Some(n) = self.nodes.get_mut(id) {
            n.suspect_until = Some(now + self.ttl);
        }
    }

    /// Usable nodes of a role serving model `model` (its fingerprint): not suspect, not draining (a draining node's requests still
    /// run there until they move or finish; new ones go elsewhere).
    ///
    /// Read in place, under the registry's lock: copying a thousand nodes for each request
    /// was most of the router's time per request.
    pub fn live_refs(&self, model: u64, role: Role, now: Instant) -> Vec<&Node> {
        self.nodes
            .values()
            .filter(|n| n.role == role && n.layout.model_fingerprint == model)
            .filter(|n| n.suspect_until.is_none_or(|t| t <= now) && !n.load.draining)
            .collect()
    }

    /// How many `live_refs` would list.
    pub fn live_count(&self, model: u64, role: Role, now: Instant) -> usize {
        self.live_refs(model, role, now).len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Node> {
        self.nodes.values()
    }

    pub fn all(&self) -> Vec<Node> {
        self.nodes.values().cloned().collect()
    }

    pub fn get(&self, id: &str) -> Option<&Node> {
        self.nodes.get(id)
    }

    pub fn assign(&mut self, id: &str, blocks: u32, tokens: u64) {
        if let Some(n) = self.nodes.get_mut(id) {
            n.assigned += 1;
            n.placed += 1;
            n.assigned_tokens += tokens;
            n.pending_blocks += blocks;
        }
    }

    pub fn unassign(&mut self, id: &str, tokens: u64) {
        if let Some(n) = self.nodes.get_mut(id) {
            n.assigned = n.assigned.saturating_sub(1);
            n.assigned_tokens = n.assigned_tokens.saturating_sub(tokens);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use pdmesh_kv_types::{KvDtype, KvGeometry};

    /// A node's layout in tests: SmolLM2's shape under `fingerprint` and `block_size`.
    pub(crate) fn layout(fingerprint: u64, block_size: usize) -> KvLayout {
        let geometry =
            KvGeometry { layers: 30, kv_heads: 3, head_dim: 64, block_size, dtype: KvDtype::F16 };
        KvLayout { model_fingerprint: fingerprint, geometry, window: None }
    }

    fn load() -> NodeLoad {
        NodeLoad { free_blocks: 10, total_blocks: 10, ..Default::default() }
    }

    #[test]
    fn silent_nodes_expire_and_late_nodes_join() {
        let t0 = Instant::now();
        let mut r = Registry::new(Duration::from_secs(2), Duration::from_millis(500), 1_000);
        r.register("d1", Role::Decode, "a:1", layout(0, 16), load(), t0);
        assert_eq!(r.live_refs(0, Role::Decode, t0).len(), 1);
        assert_eq!(r.heartbeat("d1", load(), t0 + Duration::from_secs(1)), Some(ms(500)));
        assert!(r.expire(t0 + Duration::from_millis(2500)).is_empty());
        assert_eq!(r.expire(t0 + Duration::from_millis(3100)), vec!["d1".to_string()]);
        assert_eq!(
            r.heartbeat("d1", load(), t0 + Duration::from_secs(4)),
            None,
            "dropped, unknown"
        );
        r.register("d2", Role::Decode, "a:2", layout(0, 16), load(), t0 + Duration::from_secs(4));
        assert_eq!(r.live_refs(0, Role::Decode, t0 + Duration::from_secs(4))[0].id, "d2");
        assert!(r.live_refs(0, Role::Prefill, t0).is_empty());
    }

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn a_large_mesh_heartbeats_less_often_and_waits_longer_for_each() {
        let t0 = Instant::now();
        let mut r = Registry::new(Duration::from_secs(2), ms(500), 1_000);
        r.register("early", Role::Decode, "a:0", layout(0, 16), load(), t0);
        assert_eq!(r.get("early").unwrap().every, ms(500), "a small mesh keeps the interval");
        for i in 0..1999 {
            r.register(&format!("n{i}"), Role::Decode, "a:1", layout(0, 16), load(), t0);
        }
        // 2,000 nodes at 1,000 heartbeats a second: each every 2 s, and 8 s of silence allowed
        // (the same four missed heartbeats as 2 s at 500 ms). Each node is told so at its
        // next heartbeat; until then it keeps what it was told, and the TTL that goes with it.
        assert_eq!(r.beat_every(), ms(2000));
        assert_eq!(r.get("n0").unwrap().every, ms(500), "told when the mesh was small");
        assert_eq!(r.get("n1998").unwrap().every, ms(2000));
        for i in 0..1999 {
            assert_eq!(r.heartbeat(&format!("n{i}"), load(), t0 + ms(1000)), Some(ms(2000)));
        }
        assert_eq!(r.expire(t0 + ms(2500)), vec!["early".to_string()], "its 2 s TTL");
        assert!(r.expire(t0 + ms(8900)).is_empty(), "8 s since their last heartbeat");
        assert_eq!(r.heartbeat("n0", load(), t0 + ms(8900)), Some(ms(1999)), "one fewer node");
        assert_eq!(r.expire(t0 + ms(9100)).len(), 1998, "all but n0, which heartbeat");
        assert_eq!(r.beat_every(), ms(500), "one node left: the configured interval again");
    }

    #[test]
    fn a_node_that_leaves_cancels_its_token_and_one_that_registers_again_keeps_it() {
        let t0 = Instant::now();
        let mut r = Registry::new(Duration::from_secs(2), Duration::from_millis(500), 1_000);
        r.register("d1", Role::Decode, "a:1", layout(0, 16), load(), t0);
        let left = r.get("d1").expect("registered").left.clone();
        r.register("d1", Role::Decode, "a:1", layout(0, 16), load(), t0);
        assert!(!left.is_cancelled(), "registering again is not leaving");
        assert!(r.remove("d1"));
        assert!(left.is_cancelled());
        assert!(!r.remove("d1"));
        r.register("d2", Role::Decode, "a:2", layout(0, 16), load(), t0);
        let left = r.get("d2").expect("registered").left.clone();
        assert_eq!(r.expire(t0 + Duration::from_secs(3)), vec!["d2".to_string()]);
        assert!(left.is_cancelled(), "lapsed heartbeats are leaving");
    }

    #[test]
    fn suspect_nodes_are_skipped_until_they_heartbeat() {
        let t0 = Instant::now();
        let mut r = Registry::new(Duration::from_secs(2), Duration::from_millis(500), 1_000);
        r.register("p1", Role::Prefill, "a:1", layout(0, 16), load(), t0);
        r.suspect("p1", t0);
        assert!(r.live_refs(0, Role::Prefill, t0 + Duration::from_millis(10)).is_empty());
        r.heartbeat("p1", load(), t0 + Duration::from_millis(20));
        assert_eq!(r.live_refs(0, Role::Prefill, t0 + Duration::from_millis(30)).len(), 1);
    }
}
