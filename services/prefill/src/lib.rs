//! The prefill worker: batches concurrent prompts (chunked prefill under a token budget),
//! computes their KV, pushes each completed block to the decode node's reservation while the
//! rest of the prompt is still computing, and samples the first token.

pub mod config;
pub mod core;
pub mod error;
pub mod service;
pub mod worker;

use std::future::Future;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_common::metrics::{Family, Kind, Metrics};
use pdmesh_common::node::{self, Identity, Membership, Worker};
use pdmesh_common::worker::{COMMAND_QUEUE, Faults};
use pdmesh_kv_transfer::PrefixCache;
use pdmesh_proto::v1::Role;
use pdmesh_proto::v1::prefill_server::PrefillServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{PrefillConfig, PrefillFlags};
pub use error::{PrefillError, StartError};

use crate::core::PrefillCore;
use crate::service::PrefillService;

/// Loads the engine, serves `pdmesh.v1.Prefill` on `listener`, registers with the configured
/// routers, and runs until `shutdown` completes.
pub async fn run(
    config: PrefillConfig,
    listener: TcpListener,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    config.validate()?;
    let me =
        Identity::of(&listener, "prefill", config.advertise.as_deref(), config.node_id.as_deref())
            .map_err(StartError::Listener)?;
    let node_id = me.node_id.clone();
    let engine = tokio::task::spawn_blocking({
        let s = config.engine.clone();
        move || s.load()
    })
    .await??;
    let layout = engine.kv_layout();
    let backend = engine.describe_backend();
    let core =
        PrefillCore::new(engine, config.max_running, config.max_queued, config.blocks_per_message);
    let counts = Arc::new(Mutex::new(core.counts()));
    let (tx, rx) = tokio::sync::mpsc::channel(COMMAND_QUEUE);
    let died = CancellationToken::new();
    let faults = Faults { panic_at_step: config.fault_engine_panic_at_step, ..Faults::default() };
    let worker = pdmesh_common::worker::spawn(
        "prefill-engine",
        core,
        rx,
        Arc::clone(&counts),
        died.clone(),
        faults,
    )
    .map_err(StartError::Thread)?;
    let transferring = Arc::new(AtomicU32::new(0));
    let draining = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fabric = config.kv_transport.start(&node_id).map_err(StartError::Transport)?;
    let stats = Arc::new(pdmesh_kv_transfer::TransferStats::new());
    let disk = match &config.cache_disk_dir {
        Some(dir) => Some(
            pdmesh_kv_transfer::DiskTier::open_logged(
                dir,
                &layout,
                config.cache_disk_bytes,
                true,
                "prefix cache",
            )
            .await
            .map_err(StartError::Disk)?,
        ),
        None => None,
    };
    let cache = PrefixCache::new(
        layout,
        &node_id,
        config.cache_bytes,
        disk,
        config.kvstore.as_deref(),
        Duration::from_millis(config.kvstore_timeout_ms),
        fabric.as_ref().map(|f| f.reader()),
    )?
    .map(Arc::new);
    let block_log = cache.as_ref().and_then(|c| c.block_log());
    let cache_blocks = cache.as_ref().map_or(0, |c| c.local_capacity());
    let publishes = cache.is_some();
    metrics.register_snapshot({
        let (counts, transferring) = (Arc::clone(&counts), Arc::clone(&transferring));
        let (stats, cache) = (Arc::clone(&stats), cache.clone());
        move || {
            let c = *counts.lock().expect("never poisoned");
            let t = transferring.load(std::sync::atomic::Ordering::Relaxed);
            let mut v = metric_families(&c, t, cache.as_ref().map(|c| c.stats()));
            v.extend(stats.metric_families("prefill"));
            v
        }
    });
    // Checked by `validate`.
    let stall = config.stall().unwrap_or_default();
    let transport = pdmesh_kv_transfer::AutoTransport::with_stall(
        config.kv_transport.clone(),
        fabric.as_ref(),
        Arc::clone(&stats),
        stall,
    );
    let service = PrefillService {
        node_id: node_id.clone(),
        backend,
        layout,
        tx,
        transport: Arc::new(transport),
        stats,
        push: config.kv_push,
        cache,
        verify: config.kv_verify,
        counts: Arc::clone(&counts),
        transferring: Arc::clone(&transferring),
        fault_delay: Duration::from_millis(config.fault_transfer_delay_ms),
        draining: Arc::clone(&draining),
    };
    let load_counts = Arc::clone(&counts);
    let load_draining = Arc::clone(&draining);
    let busy_transfers = Arc::clone(&transferring);
    tracing::info!(node = node_id, bound = %me.bound, kv_transport = %config.kv_transport, kv_push = %config.kv_push, "prefill node serving");
    let worker = Worker {
        role: Role::Prefill,
        names: &["pdmesh.v1.Prefill"],
        routes: tonic::service::Routes::new(PrefillServer::new(service)),
        layout: layout.into(),
        load: Arc::new(move || {
            let c = *load_counts.lock().expect("never poisoned");
            let t = transferring.load(std::sync::atomic::Ordering::Relaxed);
            let draining = load_draining.load(std::sync::atomic::Ordering::Relaxed);
            PrefillService::load(&c, t, cache_blocks, publishes, draining)
        }),
        // Only the node's own tier: the KV-store reports its blocks itself.
        blocks: block_log,
        kvstore: config.kvstore.clone().unwrap_or_default(),
        fault_skip_event: config.fault_skip_block_event,
        engine: Some((worker, died)),
    };
    let grace = Duration::from_millis(config.drain_grace_ms);
    let stopping = async move {
        shutdown.await;
        // Heartbeats go on saying so while the prompts it has finish.
        draining.store(true, std::sync::atomic::Ordering::Relaxed);
        pdmesh_common::serve::drain_until_idle("prompts", grace, || {
            let c = *counts.lock().expect("never poisoned");
            c.queued + c.prefilling + busy_transfers.load(std::sync::atomic::Ordering::Relaxed)
        })
        .await;
    };
    let membership =
        Membership { drain: Duration::from_millis(config.drain_ms), routers: &config.routers };
    Ok(node::serve(me, worker, listener, membership, stopping).await?)
}

/// The node's counts and prefix-cache stats as Prometheus families.
fn metric_families(
    c: &core::Counts,
    transferring: u32,
    cache: Option<pdmesh_proto::v1::PrefixCacheStats>,
) -> Vec<Family> {
    use Kind::{Counter, Gauge};
    let g = |name: &str, help, v: u32| {
        Family::one(format!("pdmesh_prefill_{name}"), help, Gauge, f64::from(v))
    };
    let labelled = |name: &str, help, label, kind, vals: &[(&str, u64)]| {
        let vals: Vec<(&str, f64)> = vals.iter().map(|&(l, n)| (l, n as f64)).collect();
        Family::labelled(format!("pdmesh_prefill_{name}"), help, kind, label, &vals)
    };
    let mut v = vec![
        g("queued_requests", "Prompts waiting for the engine.", c.queued),
        g("running_prompts", "Prompts being computed.", c.prefilling),
        g("transferring_prompts", "Prompts whose KV is still being sent.", transferring),
        g(
            "kv_blocks_used",
            "KV blocks held by prompts.",
            c.total_blocks.saturating_sub(c.free_blocks),
        ),
        g("kv_blocks_free", "KV blocks free.", c.free_blocks),
        labelled(
            "requests",
            "Prompts ended, by outcome.",
            "outcome",
            Counter,
            &[("completed", c.completed), ("cancelled", c.cancelled), ("failed", c.failed)],
        ),
    ];
    if let Some(p) = cache {
        v.push(labelled(
            "prefix_hit_tokens",
            "Prompt tokens whose KV came from a cache, by tier.",
            "tier",
            Counter,
            &[
                ("own", p.local_hit_tokens - p.local_disk_hit_tokens),
                ("own_disk", p.local_disk_hit_tokens),
                ("kvstore", p.store_hit_tokens - p.store_disk_hit_tokens),
                ("kvstore_disk", p.store_disk_hit_tokens),
            ],
        ));
        v.push(Family::one(
            "pdmesh_prefill_prefix_cache_disk_blocks",
            "Blocks on the node's own prefix cache's disk tier.",
            Gauge,
            p.disk_blocks as f64,
        ));
        v.push(Family::one(
            "pdmesh_prefill_prefix_cache_disk_corrupt",
            "Torn or foreign block files the disk tier found and deleted, never served.",
            Counter,
            p.disk_corrupt as f64,
        ));
        v.push(Family::one(
            "pdmesh_prefill_prefix_miss_tokens",
            "Prompt tokens computed because no cache held them.",
            Counter,
            p.miss_tokens as f64,
        ));
        v.push(labelled(
            "prefix_read_blocks",
            "Blocks read from the KV-store, by transport.",
            "transport",
            Counter,
            &[("remote", p.remote_blocks), ("grpc", p.grpc_blocks)],
        ));
        v.push(Family::one(
            "pdmesh_prefill_prefix_cache_blocks",
            "Blocks in the node's own prefix cache.",
            Gauge,
            p.local_blocks as f64,
        ));
        v.push(Family::one(
            "pdmesh_prefill_kvstore_failures",
            "Lookups that gave up on the KV-store.",
            Counter,
            p.store_failures as f64,
        ));
    }
    v
}
