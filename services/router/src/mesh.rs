//! What the router shares between requests: the node registry, one gRPC channel per node
//! address, the model (for validation), the config, and the running requests by id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_common::channels::ChannelCache;
use pdmesh_common::trace::Channel;
use pdmesh_engine::Model;
use pdmesh_proto::v1::Role;
use tokio_util::sync::CancellationToken;

use crate::config::RouterConfig;
use crate::metrics::RouterMetrics;
use crate::prefix::PrefixIndex;
use crate::registry::{Node, Registry};

/// Node channels the router keeps at most.
pub const MAX_CHANNELS: usize = 1024;

#[derive(Debug)]
pub struct Mesh {
    pub config: RouterConfig,
    pub model: Arc<Model>,
    pub registry: Mutex<Registry>,
    /// Channels to node addresses (only registered nodes are ever dialled); nodes come and
    /// go, so the least recently used is dropped past `MAX_CHANNELS`.
    channels: ChannelCache<Channel>,
    /// Running requests by (owning tenant, request id): ids are unique within a tenant, and
    /// a tenant can neither see nor cancel another's.
    active: Mutex<HashMap<(String, String), CancellationToken>>,
    /// What each prefill node is thought to hold in its own cache.
    pub prefixes: PrefixIndex,
    pub metrics: RouterMetrics,
    turn: AtomicUsize,
}

impl Mesh {
    pub fn new(config: RouterConfig, model: Arc<Model>) -> Self {
        let ttl = Duration::from_millis(u64::from(config.node_ttl_ms));
        Self {
            config,
            model,
            registry: Mutex::new(Registry::new(ttl)),
            channels: ChannelCache::new(MAX_CHANNELS),
            active: Mutex::new(HashMap::new()),
            prefixes: PrefixIndex::default(),
            metrics: RouterMetrics::default(),
            turn: AtomicUsize::new(0),
        }
    }

    pub fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().expect("registry lock is never poisoned")
    }

    /// A lazily connected channel to `address`, shared by every request to that node.
    pub fn channel(&self, address: &str) -> Result<Channel, tonic::transport::Error> {
        self.channels.get(address, || {
            let c = pdmesh_common::tls::endpoint(address)?
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true)
                .connect_lazy();
            Ok(pdmesh_common::trace::channel(c))
        })
    }

    /// Forgets a channel whose node went away (a new node may reuse the address).
    pub fn drop_channel(&self, address: &str) {
        self.channels.forget(address);
    }

    /// Advances with every placement (round-robin position, tie rotation).
    pub fn next_turn(&self) -> usize {
        self.turn.fetch_add(1, Ordering::Relaxed)
    }

    pub fn node(&self, id: &str) -> Option<Node> {
        self.registry().get(id).cloned()
    }

    pub fn live(&self, role: Role) -> Vec<Node> {
        self.registry().live(role, Instant::now())
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
