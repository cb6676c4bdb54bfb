//! The KV-store service: holds the KV blocks of shared prompt prefixes once for the whole mesh,
//! addressed by content (`pdmesh_kv_types::BlockHash`). `store` is its state: a byte budget
//! of block slots, matching of hash chains with pins under leases, deduplicating puts, and LRU
//! eviction of what no lease pins. `trace` reads Mooncake workload traces and computes their
//! ideal hit rate.

pub mod config;
pub mod error;
pub mod service;
pub mod store;
pub mod trace;

pub use config::{KvStoreConfig, KvStoreFlags};
pub use error::StartError;
pub use pdmesh_kv_transfer::disk;
pub use service::KvStoreService;
pub use store::{Matched, PutSlot, Store, StoreStats};

use std::future::Future;
use std::time::Duration;

use pdmesh_common::metrics::{Family, Kind, Metrics};
use pdmesh_common::node::{self, Identity, Membership, Worker};
use pdmesh_proto::v1::kv_store_server::KvStoreServer;
use pdmesh_proto::v1::{NodeLoad, Role};
use tokio::net::TcpListener;

/// Works out the mesh's KV layout from the model, allocates the pool, and serves
/// `pdmesh.v1.KvStore` on `listener` until `shutdown` completes.
pub async fn run(
    config: KvStoreConfig,
    listener: TcpListener,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    config.validate()?;
    let me =
        Identity::of(&listener, "kvstore", config.advertise.as_deref(), config.node_id.as_deref())
            .map_err(StartError::Listener)?;
    let node_id = &me.node_id;
    // The layout is the model's fingerprint and shape with the mesh's block size and dtype,
    // exactly as the workers compute it; no engine is needed to know it.
    let dtype: pdmesh_kv_types::KvDtype =
        config.kv_dtype.parse().map_err(|e| pdmesh_common::InvalidConfig::new("kv_dtype", e))?;
    let (model, block_size) = (config.model.clone(), config.block_size);
    let layout = tokio::task::spawn_blocking(move || pdmesh_model::ModelCard::load(&model))
        .await??
        .kv_layout(block_size, dtype);
    // The model may not fit the dtype (q8_0 needs heads of whole 32-value blocks): say so
    // rather than size blocks that cannot exist.
    layout.validate().map_err(|e| pdmesh_common::InvalidConfig::new("kv_dtype", e))?;
    let budget = usize::try_from(config.budget_bytes)
        .map_err(|_| pdmesh_common::InvalidConfig::new("budget_bytes", "is too large"))?;
    let fabric = config.kv_transport.start(node_id).map_err(StartError::Transport)?;
    let disk = match &config.disk_dir {
        Some(dir) => Some(
            disk::DiskTier::open_logged(
                dir,
                &layout,
                config.disk_budget_bytes,
                config.disk_sync,
                "KV-store",
            )
            .await
            .map_err(StartError::Disk)?,
        ),
        None => None,
    };
    let service = KvStoreService::new(
        node_id,
        layout,
        budget,
        Duration::from_millis(config.lease_ms),
        Duration::from_millis(config.max_lease_ms),
        fabric.as_deref(),
        disk,
    )?;
    metrics.register_snapshot({
        let service = service.clone();
        move || metric_families(&service.store_stats())
    });
    tracing::info!(node = node_id, bound = %me.bound, budget_bytes = config.budget_bytes, kv_transport = %config.kv_transport, "kv-store serving");
    let (stats, log) = (service.clone(), service.block_log());
    let routes = tonic::service::Routes::new(
        KvStoreServer::new(service)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20),
    );
    let worker = Worker {
        role: Role::Kvstore,
        names: &["pdmesh.v1.KvStore"],
        routes,
        layout: layout.into(),
        load: std::sync::Arc::new(move || {
            // RAM's counters: the heartbeat need not gather both tiers' blocks.
            let s = stats.ram_stats();
            NodeLoad {
                free_blocks: s.capacity_blocks.saturating_sub(s.blocks) as u32,
                total_blocks: s.capacity_blocks as u32,
                cache_blocks: s.capacity_blocks as u32,
                ..NodeLoad::default()
            }
        }),
        blocks: Some(log),
        kvstore: me.address.clone(),
        fault_skip_event: 0,
        // The store has no engine to lose.
        engine: None,
    };
    let membership =
        Membership { drain: Duration::from_millis(config.drain_ms), routers: &config.routers };
    node::serve(me, worker, listener, membership, shutdown).await?;
    Ok(())
}

/// The store's stats as Prometheus families.
fn metric_families(s: &StoreStats) -> Vec<Family> {
    use Kind::{Counter, Gauge};
    let f = |name: &str, help, kind, v: u64| {
        Family::one(format!("pdmesh_kvstore_{name}"), help, kind, v as f64)
    };
    vec![
        f("blocks", "Blocks held.", Gauge, s.blocks),
        f("bytes", "Bytes of blocks held.", Gauge, s.bytes),
        f("capacity_blocks", "Blocks the budget holds.", Gauge, s.capacity_blocks),
        f("hit_tokens", "Prompt tokens matched.", Counter, s.hit_tokens),
        f("miss_tokens", "Prompt tokens asked for and not held.", Counter, s.miss_tokens),
        f("evictions", "Blocks evicted to make room.", Counter, s.evictions),
        f("dedup", "Puts of a block already held.", Counter, s.dedup),
        f("pinned_blocks", "Blocks pinned by leases.", Gauge, s.pinned_blocks),
        f("leases", "Leases open.", Gauge, s.leases),
        f("leases_expired", "Leases that expired before their release.", Counter, s.leases_expired),
        f("held_blocks", "Blocks held in either tier.", Gauge, s.held_blocks),
        f("disk_blocks", "Blocks on the disk tier.", Gauge, s.disk.blocks),
        f("disk_bytes", "Bytes of blocks on the disk tier.", Gauge, s.disk.bytes),
        f("disk_capacity_blocks", "Blocks the disk budget holds.", Gauge, s.disk.capacity_blocks),
        f("disk_hit_tokens", "Matched tokens read back from disk.", Counter, s.disk_hit_tokens),
        f("disk_writes", "Blocks written to disk.", Counter, s.disk.writes),
        f("disk_evictions", "Block files deleted for room.", Counter, s.disk.evictions),
        f("disk_corrupt", "Torn or foreign block files deleted unserved.", Counter, s.disk.corrupt),
        f("disk_write_errors", "Block writes to disk that failed.", Counter, s.disk.write_errors),
    ]
}
