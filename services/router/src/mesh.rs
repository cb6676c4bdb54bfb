//! What the router shares between requests: the node registry, one gRPC channel per node
//! address, the served models' pools (`pool`), the config, and the running requests by id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_common::channels::ChannelCache;
use pdmesh_common::tls::MeshRole;
use pdmesh_common::trace::Channel;
use pdmesh_model::ModelCard;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{NodeCancelRequest, Role, StatsRequest};
use tokio_util::sync::CancellationToken;

use crate::config::RouterConfig;
use crate::index::KvIndex;
use crate::metrics::RouterMetrics;
use crate::planner::Pools;
use crate::pool::Pool;
use crate::registry::{Node, Registry};

/// How long a decode node gets to answer a cancel for another router's request.
const NODE_CANCEL_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the call that opens a new node's channel may take.
const WARM_TIMEOUT: Duration = Duration::from_secs(5);

/// Node channels the router keeps at most.
pub const MAX_CHANNELS: usize = 1024;

#[derive(Debug)]
pub struct Mesh {
    pub config: RouterConfig,
    /// The models served, each with its nodes' layout, planner and queue; the first is the
    /// default. Fixed at start.
    pools: Vec<Arc<Pool>>,
    pub registry: Mutex<Registry>,
    /// Channels to node addresses (only registered nodes are ever dialled); nodes come and
    /// go, so the least recently used is dropped past `MAX_CHANNELS`.
    channels: ChannelCache<Channel>,
    /// Running requests by (owning tenant, request id): ids are unique within a tenant, and
    /// a tenant can neither see nor cancel another's.
    active: Mutex<HashMap<(String, String), CancellationToken>>,
    /// Which node holds which KV block, from the nodes' block events.
    pub index: KvIndex,
    /// Prompts a prefill node is computing now, for others sharing their prefix to wait on.
    pub computing: crate::coalesce::Computing,
    pub metrics: RouterMetrics,
    turn: AtomicUsize,
}

impl Mesh {
    /// A mesh that serves `models` (id and card, the default first).
    pub fn new(config: RouterConfig, models: Vec<(String, Arc<ModelCard>)>) -> Self {
        assert!(!models.is_empty(), "a mesh serves at least one model");
        let pools = models
            .into_iter()
            .map(|(id, m)| Arc::new(Pool::new(id, m, config.planner.clone(), config.max_queued)))
            .collect();
        let ttl = Duration::from_millis(u64::from(config.node_ttl_ms));
        let every = Duration::from_millis(u64::from(config.heartbeat_interval_ms));
        Self {
            pools,
            registry: Mutex::new(Registry::new(ttl, every, config.max_heartbeats_per_s)),
            channels: ChannelCache::new(MAX_CHANNELS),
            active: Mutex::new(HashMap::new()),
            index: KvIndex::default(),
            computing: crate::coalesce::Computing::new(config.coalesce_min_tokens),
            metrics: RouterMetrics::default(),
            turn: AtomicUsize::new(0),
            config,
        }
    }

    /// The default model's pool (what a request that names no model is served by).
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pools[0]
    }

    /// The pool of the model whose fingerprint is `fingerprint`, if it is served.
    pub fn pool_of(&self, fingerprint: u64) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| p.fingerprint() == fingerprint)
    }

    /// The pool of the model requests call `id`.
    pub fn pool_named(&self, id: &str) -> Option<&Arc<Pool>> {
        self.pools.iter().find(|p| p.id == id)
    }

    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Plans every pool again from its window and the nodes registered now.
    pub fn replan(&self) {
        for p in &self.pools {
            let fp = p.fingerprint();
            let current = Pools {
                prefill: self.live_count(fp, Role::Prefill) as u32,
                decode: self.live_count(fp, Role::Decode) as u32,
            };
            p.replan(current);
        }
    }

    /// Room may have changed (a node joined or reported, a request ended): every pool's
    /// waiting requests look again.
    pub fn wake(&self) {
        for p in &self.pools {
            p.queue.wake();
        }
    }

    pub fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().expect("registry lock is never poisoned")
    }

    /// A lazily connected channel to the node of `role` at `address`, shared by every
    /// request to that node; its certificate must be of that role.
    pub fn channel(&self, address: &str, role: Role) -> Result<Channel, tonic::transport::Error> {
        let serves = if role == Role::Prefill { MeshRole::Prefill } else { MeshRole::Decode };
        self.channels.get(address, || {
            let c = pdmesh_common::tls::endpoint(address, serves)?
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true)
                .connect_lazy();
            Ok(pdmesh_common::trace::channel(c))
        })
    }

    /// Asks every decode node to cancel `owner`'s request `request_id` (it runs through
    /// another router); true if one held it. Each node gets `NODE_CANCEL_TIMEOUT`.
    pub async fn cancel_on_nodes(&self, owner: &str, request_id: &str) -> bool {
        let decodes = self.registry().all().into_iter().filter(|n| n.role == Role::Decode);
        let mut asks = tokio::task::JoinSet::new();
        for n in decodes {
            let Ok(ch) = self.channel(&n.address, n.role) else { continue };
            let msg = NodeCancelRequest { request_id: request_id.into(), owner: owner.into() };
            asks.spawn(async move {
                let mut client = DecodeClient::new(ch);
                match tokio::time::timeout(NODE_CANCEL_TIMEOUT, client.cancel_request(msg)).await {
                    Ok(Ok(r)) => r.into_inner().found,
                    Ok(Err(s)) => {
                        tracing::warn!(node = n.id, "cancel on the node: {}", s.message());
                        false
                    }
                    Err(_) => false,
                }
            });
        }
        let mut found = false;
        while let Some(r) = asks.join_next().await {
            found |= r.unwrap_or(false);
        }
        found
    }

    /// Forgets a channel whose node went away (a new node may reuse the address).
    pub fn drop_channel(&self, address: &str) {
        self.channels.forget(address);
    }

    /// Opens the channel to a node that joined, with one `Stats` call, in the background: a
    /// lazy channel made the first request placed on each node pay the TCP (and TLS)
    /// handshake in its dispatch, and at 1,000 nodes that was most requests of a short burst.
    /// A node that does not answer is left to its first request, as before.
    pub fn warm_channel(&self, node_id: &str, address: &str, role: Role) {
        let Ok(ch) = self.channel(address, role) else { return };
        let node = node_id.to_string();
        tokio::spawn(async move {
            let call = async {
                match role {
                    Role::Prefill => PrefillClient::new(ch).stats(StatsRequest {}).await.map(drop),
                    _ => DecodeClient::new(ch).stats(StatsRequest {}).await.map(drop),
                }
            };
            match tokio::time::timeout(WARM_TIMEOUT, call).await {
                Ok(Ok(())) => {}
                Ok(Err(s)) => tracing::debug!(node, "channel not warmed: {}", s.message()),
                Err(_) => tracing::debug!(node, "channel not warmed: no answer in time"),
            }
        });
    }

    /// Advances with every placement (round-robin position, tie rotation).
    pub fn next_turn(&self) -> usize {
        self.turn.fetch_add(1, Ordering::Relaxed)
    }

    pub fn node(&self, id: &str) -> Option<Node> {
        self.registry().get(id).cloned()
    }

    /// Usable nodes of `role` serving the model `fingerprint`.
    pub fn live_count(&self, fingerprint: u64, role: Role) -> usize {
        self.registry().live_count(fingerprint, role, Instant::now())
    }

    /// Registers `owner`'s running request for `Cancel`; None if it already runs one with
    /// this id.
    pub fn start(&self, id: &str, owner: &str) -> Option<CancellationToken> {
        let mut a = self.active.lock().expect("active map lock is never poisoned");
        let key = (owner.to_string(), id.to_string());
        if a.contains_key(&key) {
            return None;
        }
        let t = CancellationToken::new();
        a.insert(key, t.clone());
        Some(t)
    }

    pub fn finish(&self, id: &str, owner: &str) {
        let key = (owner.to_string(), id.to_string());
        self.active.lock().expect("active map lock is never poisoned").remove(&key);
        // Its blocks are free again (the node's next heartbeat says how many).
        self.wake();
    }

    pub fn cancel(&self, id: &str, owner: &str) -> bool {
        let key = (owner.to_string(), id.to_string());
        match self.active.lock().expect("active map lock is never poisoned").get(&key) {
            Some(t) => {
                t.cancel();
                true
            }
            None => false,
        }
    }
}
