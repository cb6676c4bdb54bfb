//! The decode worker: reserves KV blocks for requests under leases, receives their KV from
//! prefill nodes (or computes it itself in colocated mode), runs continuous batching over all
//! of them on one engine, and streams their tokens with stop strings applied.

pub mod config;
pub mod core;
pub mod error;
pub mod service;
pub mod worker;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_common::metrics::{Family, Kind, Metrics};
use pdmesh_common::node::{self, Identity, Membership, Worker};
use pdmesh_common::worker::{COMMAND_QUEUE, Faults};
use pdmesh_engine::Engine;
use pdmesh_kv_transfer::{Fabric, PoolOffer, PoolOptions, StagingArea, TransportKind};
use pdmesh_proto::v1::Role;
use pdmesh_proto::v1::decode_server::DecodeServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{DecodeConfig, DecodeFlags};
pub use error::{DecodeError, StartError};

use crate::core::DecodeCore;
use crate::service::DecodeService;

/// Loads the engine, serves `pdmesh.v1.Decode` on `listener`, registers with the configured
/// routers, and runs until `shutdown` completes.
pub async fn run(
    config: DecodeConfig,
    listener: TcpListener,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    config.validate()?;
    let me =
        Identity::of(&listener, "decode", config.advertise.as_deref(), config.node_id.as_deref())
            .map_err(StartError::Listener)?;
    let node_id = me.node_id.clone();
    let mut engine = tokio::task::spawn_blocking({
        let s = config.engine.clone();
        move || s.load()
    })
    .await??;
    let fabric = config.kv_transport.start(&node_id).map_err(StartError::Transport)?;
    let pool = match &fabric {
        Some(f) => offer_pool(&config, &**f, &mut engine)?,
        None => None,
    };
    let kv_path = pool.as_ref().map_or("", |p| p.path().name());
    let layout = engine.kv_layout();
    let backend = engine.describe_backend();
    let context = engine.max_seq_len();
    let mut core = DecodeCore::new(
        engine,
        config.max_running,
        Duration::from_millis(config.lease_ms),
        Duration::from_millis(config.max_lease_ms),
    );
    core.set_itl_target(
        (config.itl_target_ms > 0).then(|| Duration::from_millis(config.itl_target_ms)),
    );
    let counts = Arc::new(Mutex::new(core.counts()));
    let (tx, rx) = tokio::sync::mpsc::channel(COMMAND_QUEUE);
    let died = CancellationToken::new();
    let faults = Faults {
        panic_at_step: config.fault_engine_panic_at_step,
        step_delay: Duration::from_millis(config.fault_step_delay_ms),
    };
    let worker = pdmesh_common::worker::spawn(
        "decode-engine",
        worker::Worker::new(core),
        rx,
        Arc::clone(&counts),
        died.clone(),
        faults,
    )
    .map_err(StartError::Thread)?;

    let stats = Arc::new(pdmesh_kv_transfer::TransferStats::new());
    metrics.register_snapshot({
        let (counts, stats) = (Arc::clone(&counts), Arc::clone(&stats));
        let staging = pool.as_ref().and_then(|p| p.staging().cloned());
        move || {
            let c = *counts.lock().expect("never poisoned");
            let mut v = metric_families(&c);
            v.extend(stats.metric_families("decode"));
            v.extend(staging.as_deref().map(staging_families).into_iter().flatten());
            v
        }
    });
    // What a draining node hands off is counted apart from what it receives.
    let sent = Arc::new(pdmesh_kv_transfer::TransferStats::new());
    let transport =
        pdmesh_kv_transfer::AutoTransport::new(config.kv_transport.clone(), fabric.as_ref(), sent);
    let inbox =
        service::Inbox { node_id: node_id.clone(), backend, layout, tx: tx.clone(), stats, pool };
    let drain = CancellationToken::new();
    let service = DecodeService {
        inbox: Arc::new(inbox),
        address: me.address.clone(),
        context,
        counts: Arc::clone(&counts),
        transport: Arc::new(transport),
        drain: drain.clone(),
    };
    let load_counts = Arc::clone(&counts);
    tracing::info!(node = node_id, bound = %me.bound, kv_transport = %config.kv_transport, kv_path, "decode node serving");
    let worker = Worker {
        role: Role::Decode,
        names: &["pdmesh.v1.Decode"],
        routes: tonic::service::Routes::new(
            DecodeServer::new(service)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20),
        ),
        layout: layout.into(),
        load: Arc::new(move || DecodeService::load(&load_counts.lock().expect("never poisoned"))),
        // Decode nodes keep no KV for reuse after a request: nothing to report but load.
        blocks: None,
        kvstore: String::new(),
        fault_skip_event: 0,
        engine: Some((worker, died)),
    };
    let grace = Duration::from_millis(config.drain_grace_ms);
    let stopping = async move {
        tokio::select! {
            () = shutdown => {}
            () = drain.cancelled() => {}
        }
        drained(&tx, &counts, grace).await;
    };
    let membership =
        Membership { drain: Duration::from_millis(config.drain_ms), routers: &config.routers };
    Ok(node::serve(me, worker, listener, membership, stopping).await?)
}

/// Drains the node: no new work, running requests asked to move (the router hands each off
/// to another decode node with its KV, or lets it finish here); returns once none is left, or
/// after `grace`.
async fn drained(
    tx: &tokio::sync::mpsc::Sender<worker::Command>,
    counts: &Mutex<core::Counts>,
    grace: Duration,
) {
    let (reply, rx) = tokio::sync::oneshot::channel();
    if tx.send(worker::Command::Drain { reply }).await.is_err() {
        return;
    }
    if rx.await.is_err() {
        return;
    }
    pdmesh_common::serve::drain_until_idle("requests", grace, || {
        let c = *counts.lock().expect("never poisoned");
        c.reserved + c.transferring + c.queued + c.prefilling + c.decoding
    })
    .await;
}

/// Offers the KV pool to `fabric`'s writers, as `kv_staging` and `kv_shared_pool` ask.
/// Failing is fatal when the transport was named; for `auto` the KV arrives over gRPC.
fn offer_pool(
    config: &DecodeConfig,
    fabric: &dyn Fabric,
    engine: &mut Engine,
) -> Result<Option<Arc<dyn PoolOffer>>, StartError> {
    let options = PoolOptions {
        staging: config.kv_staging,
        staging_bytes: config.kv_staging_mb.saturating_mul(1 << 20),
        same_host: config.kv_shared_pool,
    };
    match fabric.offer_pool(engine, &options) {
        Ok(pool) => Ok(Some(pool)),
        Err(why) if config.kv_transport != TransportKind::Auto => {
            Err(StartError::Pool { transport: fabric.name().into(), why })
        }
        Err(e) => {
            let name = fabric.name();
            tracing::warn!("cannot offer the KV pool to {name} writers, KV arrives over gRPC: {e}");
            Ok(None)
        }
    }
}

/// The staging area's occupancy as Prometheus families.
fn staging_families(area: &StagingArea) -> Vec<Family> {
    vec![
        Family::one(
            "pdmesh_decode_kv_staging_free_blocks",
            "Host staging blocks free for incoming KV.",
            Kind::Gauge,
            area.free_blocks() as f64,
        ),
        Family::one(
            "pdmesh_decode_kv_staging_full",
            "Reservations that found every staging block taken and took their KV over gRPC.",
            Kind::Counter,
            area.full() as f64,
        ),
    ]
}

/// The node's counts as Prometheus families.
fn metric_families(c: &core::Counts) -> Vec<Family> {
    use Kind::{Counter, Gauge};
    let g = |name: &str, help, v: u32| {
        Family::one(format!("pdmesh_decode_{name}"), help, Gauge, f64::from(v))
    };
    vec![
        g("queued_requests", "Requests waiting for a place in the batch.", c.queued),
        g(
            "running_sequences",
            "Sequences in the batch (decoding or prefilling here).",
            c.decoding + c.prefilling,
        ),
        g(
            "reservations",
            "Reservations waiting for their KV (reserved or receiving).",
            c.reserved + c.transferring,
        ),
        g(
            "kv_blocks_used",
            "KV blocks promised to reservations and running requests.",
            c.committed_blocks,
        ),
        g("kv_blocks_free", "KV blocks free.", c.total_blocks.saturating_sub(c.committed_blocks)),
        g(
            "kv_blocks_quarantined",
            "Blocks of ended reservations a remote writer may still reach.",
            c.quarantined,
        ),
        Family::labelled(
            "pdmesh_decode_requests",
            "Requests ended, by outcome.",
            Counter,
            "outcome",
            &[
                ("completed", c.completed as f64),
                ("cancelled", c.cancelled as f64),
                ("failed", c.failed as f64),
                ("lease_expired", c.leases_expired as f64),
                ("preempted", c.preempted as f64),
            ],
        ),
    ]
}
