//! The router: the public `pdmesh.v1.Generation` API. It validates and tokenizes requests,
//! sheds load beyond a bounded in-flight budget, places each request on a prefill and a decode
//! node, relays the token stream with the client's deadline, and keeps the membership of the
//! mesh from node registrations and heartbeats. `api::Router` is the request path as a library
//! (a prepared request in, plain events out); the gRPC service is one adapter over it.

pub mod api;
mod attempt;
pub mod config;
pub mod error;
pub mod mesh;
pub mod metrics;
pub mod placement;
pub mod planner;
pub mod prefix;
pub mod registry;
mod relay;
pub mod request;
pub mod service;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_engine::Model;
use pdmesh_proto::v1::generation_server::GenerationServer;
use pdmesh_proto::v1::membership_server::MembershipServer;
use tokio::net::TcpListener;

pub use api::{Admitted, Event, Events, Finished, Router, Timings, Usage};
pub use config::RouterConfig;
pub use error::{RequestError, RouterError};

use crate::mesh::Mesh;
use crate::service::RouterService;

/// How often the API key file is checked for changes.
const KEYS_RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Serves the router until `shutdown` completes: the public API on `public`, membership on
/// `internal`.
pub async fn run(
    config: RouterConfig,
    public: TcpListener,
    internal: TcpListener,
    metrics: pdmesh_common::metrics::Metrics,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RouterError> {
    config.validate()?;
    let keys = match &config.api_keys {
        Some(path) => {
            let ring = pdmesh_common::apikey::KeyRing::load(path)
                .map_err(|e| pdmesh_common::InvalidConfig::new("api_keys", e.to_string()))?;
            tracing::info!(keys = ring.len(), file = %path.display(), "API keys loaded");
            Some(Arc::new(ring))
        }
        None => None,
    };
    let _watch = keys.as_ref().map(|k| k.watch(KEYS_RELOAD_EVERY));
    if !config.model.exists() {
        let problem = format!(
            "{} not found (run `just fetch-model` or set the path)",
            config.model.display()
        );
        return Err(pdmesh_common::InvalidConfig::new("model", problem).into());
    }
    let model = Arc::new(Model::load(&config.model)?);
    let drain = Duration::from_millis(config.drain_ms);
    let ttl = Duration::from_millis(u64::from(config.node_ttl_ms));
    let mesh = Arc::new(Mesh::new(config, model));
    let router = Router::new(Arc::clone(&mesh));
    mesh.metrics.register(&metrics, Arc::clone(&mesh), Arc::clone(router.admission()));
    let reaper = tokio::spawn({
        let mesh = Arc::clone(&mesh);
        async move {
            let mut tick = tokio::time::interval(ttl / 4);
            loop {
                tick.tick().await;
                let dropped = mesh.registry().expire(Instant::now());
                for id in dropped {
                    mesh.prefixes.forget(&id);
                    tracing::warn!(node = id, "node missed its heartbeats; dropped");
                }
                mesh.replan();
            }
        }
    });
    let service = RouterService { router, keys };
    let public_routes = tonic::service::Routes::new(GenerationServer::new(service.clone()));
    let internal_routes = tonic::service::Routes::new(MembershipServer::new(service));
    let (bound, bound_internal) = (public.local_addr().ok(), internal.local_addr().ok());
    tracing::info!(?bound, ?bound_internal, "router serving");
    // One shutdown for both listeners: when either server fails, the other stops too.
    let stop = tokio_util::sync::CancellationToken::new();
    let stopping = stop.clone();
    let serve_public = pdmesh_common::serve(
        public_routes,
        &["pdmesh.v1.Generation"],
        public,
        pdmesh_common::Exposure::Public,
        stop.clone().cancelled_owned(),
        drain,
    );
    let serve_internal = pdmesh_common::serve(
        internal_routes,
        &["pdmesh.v1.Membership"],
        internal,
        pdmesh_common::Exposure::Internal,
        stop.clone().cancelled_owned(),
        drain,
    );
    let signal = async move {
        shutdown.await;
        stopping.cancel();
    };
    let (r, _) = tokio::join!(
        async {
            let r = tokio::try_join!(serve_public, serve_internal);
            stop.cancel();
            r
        },
        async {
            tokio::select! {
                () = signal => {}
                () = stop.cancelled() => {}
            }
        }
    );
    reaper.abort();
    r?;
    Ok(())
}
