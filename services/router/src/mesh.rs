//! What the router shares between requests: the node registry, one gRPC channel per node
//! address, the model (for validation), the config, and the running requests by id.

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
use crate::planner::{Plan, Planner, Pools, Sample};
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
    pub model: Arc<ModelCard>,
    pub registry: Mutex<Registry>,
    /// Channels to node addresses (only registered nodes are ever dialled); nodes come and
    /// go, so the least recently used is dropped past `MAX_CHANNELS`.
    channels: ChannelCache<Channel>,
    /// Running requests by (owning tenant, request id): ids are unique within a tenant, and
    /// a tenant can neither see nor cancel another's.
    active: Mutex<HashMap<(String, String), CancellationToken>>,
    /// Which node holds which KV block, from the nodes' block events.
    pub index: KvIndex,
    /// The KV layout of the mesh's nodes (registration keeps it one): prompts are hashed in
    /// it before placement takes the registry's lock.
    layout: Mutex<Option<pdmesh_kv_types::KvLayout>>,
    /// Prompts a prefill node is computing now, for others sharing their prefix to wait on.
    pub computing: crate::coalesce::Computing,
    pub metrics: RouterMetrics,
    turn: AtomicUsize,
    /// The planner, and its latest plan (`replan`).
    planner: Mutex<(Planner, Option<Plan>)>,
    /// Requests waiting for room on a decode node.
    pub queue: crate::queue::RoomQueue,
}

impl Mesh {
    pub fn new(config: RouterConfig, model: Arc<ModelCard>) -> Self {
        let ttl = Duration::from_millis(u64::from(config.node_ttl_ms));
        let every = Duration::from_millis(u64::from(config.heartbeat_interval_ms));
        Self {
            model,
            registry: Mutex::new(Registry::new(ttl, every, config.max_heartbeats_per_s)),
            channels: ChannelCache::new(MAX_CHANNELS),
            active: Mutex::new(HashMap::new()),
            index: KvIndex::default(),
            layout: Mutex::new(None),
            computing: crate::coalesce::Computing::new(config.coalesce_min_tokens),
            metrics: RouterMetrics::default(),
            turn: AtomicUsize::new(0),
            planner: Mutex::new((Planner::new(config.planner.clone()), None)),
            queue: crate::queue::RoomQueue::new(config.max_queued),
            config,
        }
    }

    /// The nodes' KV layout, once one has joined.
    pub fn layout(&self) -> Option<pdmesh_kv_types::KvLayout> {
        *self.layout.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_layout(&self, layout: pdmesh_kv_types::KvLayout) {
        *self.layout.lock().unwrap_or_else(|p| p.into_inner()) = Some(layout);
    }

    /// Tells the planner how a finished request went.
    pub fn observe(&self, f: &crate::api::Finished) {
        let (t, u) = (&f.timings, &f.usage);
        let itl = if u.completion_tokens > 1 {
            (t.total_ms - t.ttft_ms) / f64::from(u.completion_tokens - 1)
        } else {
            0.0
        };
        let now = Instant::now();
        let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1e3);
        // Admission was `total_ms` ago; prefill compute began `queue_ms` after it.
        let admitted = now.checked_sub(ms(t.total_ms)).unwrap_or(now);
        let sample = Sample {
            at: now,
            prefill_from: admitted + ms(t.queue_ms),
            prefill_node: t.prefill_node.clone(),
            computed_tokens: u.prompt_tokens.saturating_sub(u.cached_tokens),
            prefill_ms: t.prefill_ms,
            queue_ms: t.queue_ms,
            ttft_ms: t.ttft_ms,
            completion_tokens: u.completion_tokens,
            itl_ms: itl,
            decode_node: t.decode_node.clone(),
        };
        self.planner.lock().expect("planner lock is never poisoned").0.observe(sample);
    }

    /// Plans again from the window and the nodes registered now; logs a changed decision.
    pub fn replan(&self) -> Plan {
        let current = Pools {
            prefill: self.live_count(Role::Prefill) as u32,
            decode: self.live_count(Role::Decode) as u32,
        };
        let mut p = self.planner.lock().expect("planner lock is never poisoned");
        let plan = p.0.plan(Instant::now(), current);
        if p.1.as_ref().is_none_or(|last| last.desired != plan.desired) {
            tracing::info!(
                prefill = plan.desired.prefill,
                decode = plan.desired.decode,
                prefill_demand_tps = plan.prefill_demand_tps,
                decode_demand_tps = plan.decode_demand_tps,
                "planner: the load needs this many nodes"
            );
        }
        p.1 = Some(plan.clone());
        plan
    }

    /// The latest plan (`replan`).
    pub fn plan(&self) -> Option<Plan> {
        self.planner.lock().expect("planner lock is never poisoned").1.clone()
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

    pub fn live_count(&self, role: Role) -> usize {
        self.registry().live_count(role, Instant::now())
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
        self.queue.wake();
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
