//! The router: the public `pdmesh.v1.Generation` API. It validates and tokenizes requests,
//! sheds load beyond a bounded in-flight budget, places each request on a prefill and a decode
//! node, relays the token stream with the client's deadline, and keeps the membership of the
//! mesh from node registrations and heartbeats. `api::Router` is the request path as a library
//! (a prepared request in, plain events out); the gRPC service is one adapter over it.

pub mod api;
mod attempt;
pub mod classifier;
pub mod coalesce;
pub mod config;
pub mod error;
pub mod events;
pub mod index;
pub mod members;
pub mod mesh;
pub mod metrics;
pub mod placement;
pub mod planner;
pub mod pool;
pub mod queue;
pub mod registry;
mod relay;
pub mod request;
pub mod service;
mod stage;
mod tiers;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_common::apikey::KeyRing;
use pdmesh_model::ModelCard;
use pdmesh_proto::v1::generation_server::GenerationServer;
use pdmesh_proto::v1::membership_server::MembershipServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use api::{Admitted, Event, Events, Finished, Router, Timings, Usage};
pub use config::{RouterConfig, RouterFlags};
pub use error::{RequestError, RouterError};

use crate::mesh::Mesh;
use crate::service::RouterService;

/// How often the API key file is checked for changes.
const KEYS_RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Another frontend over the library API (the OpenAI HTTP API): given the router, its API keys
/// (None: anonymous) and a token cancelled at shutdown, it serves until that token is
/// cancelled and its requests drained; an error stops the router too.
pub type Frontend = Box<
    dyn FnOnce(
            Router,
            Option<Arc<KeyRing>>,
            CancellationToken,
        ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>>
        + Send,
>;

/// Serves the router until `shutdown` completes: the public API on `public`, membership on
/// `internal`.
pub async fn run(
    config: RouterConfig,
    public: TcpListener,
    internal: TcpListener,
    metrics: pdmesh_common::metrics::Metrics,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RouterError> {
    run_with(config, public, internal, metrics, shutdown, None).await
}

/// `run`, with another frontend served beside the gRPC API, under one shutdown.
pub async fn run_with(
    config: RouterConfig,
    public: TcpListener,
    internal: TcpListener,
    metrics: pdmesh_common::metrics::Metrics,
    shutdown: impl Future<Output = ()> + Send,
    frontend: Option<Frontend>,
) -> Result<(), RouterError> {
    config.validate()?;
    let keys = match &config.api_keys {
        Some(path) => {
            let ring = KeyRing::load(path)
                .map_err(|e| pdmesh_common::InvalidConfig::new("api_keys", e.to_string()))?;
            tracing::info!(keys = ring.len(), file = %path.display(), "API keys loaded");
            Some(Arc::new(ring))
        }
        None => {
            tracing::warn!(
                "allow_anonymous: no API keys; every caller is tenant \"anonymous\", sharing \
                 one in-flight limit, one prefix cache (cached_tokens tells one caller of \
                 another's prompts) and one space of request ids (one may cancel another's)"
            );
            None
        }
    };
    let _watch = keys.as_ref().map(|k| k.watch(KEYS_RELOAD_EVERY));
    let mut models: Vec<(String, Arc<ModelCard>)> = Vec::new();
    for (i, (id, path)) in config.served().into_iter().enumerate() {
        let key = if i == 0 { "model" } else { "models" };
        if !path.exists() {
            let problem =
                format!("{} not found (run `just fetch-model` or set the path)", path.display());
            return Err(pdmesh_common::InvalidConfig::new(key, problem).into());
        }
        let card = Arc::new(ModelCard::load(&path)?);
        // One pool per model: two names for one model's weights would split its nodes.
        if let Some((other, _)) = models.iter().find(|(_, m)| m.fingerprint == card.fingerprint) {
            let problem = format!("{id:?} and {other:?} are the same model ({})", path.display());
            return Err(pdmesh_common::InvalidConfig::new(key, problem).into());
        }
        models.push((id, card));
    }
    let drain = Duration::from_millis(config.drain_ms);
    let ttl = Duration::from_millis(u64::from(config.node_ttl_ms));
    let mut classifier = None;
    if let Some(t) = &config.tiers
        && let Some(path) = &t.classifier
    {
        let c = classifier::Classifier::load(path, &t.ladder)
            .map_err(|e| pdmesh_common::InvalidConfig::new("tiers.classifier", e))?;
        tracing::info!(file = %path.display(), "tier classifier loaded");
        classifier = Some(c);
    }
    let mesh = Arc::new(Mesh::new(config, models));
    let mut router = Router::new(Arc::clone(&mesh));
    if let Some(c) = classifier {
        router = router.with_classifier(c);
    }
    mesh.metrics.register(&metrics, Arc::clone(&mesh), Arc::clone(router.admission()));
    let reaper = tokio::spawn({
        let mesh = Arc::clone(&mesh);
        async move {
            let mut tick = tokio::time::interval(ttl / 4);
            loop {
                tick.tick().await;
                let dropped = mesh.registry().expire(Instant::now());
                for id in dropped {
                    mesh.index.forget(&id);
                    tracing::warn!(node = id, "node missed its heartbeats; dropped");
                }
                mesh.replan();
            }
        }
    });
    let service = RouterService { router: router.clone(), keys: keys.clone() };
    let check = service::KeyCheck::new(keys.clone());
    let public_routes =
        tonic::service::Routes::new(GenerationServer::with_interceptor(service.clone(), check));
    let internal_routes = tonic::service::Routes::new(MembershipServer::new(service));
    let (bound, bound_internal) = (public.local_addr().ok(), internal.local_addr().ok());
    tracing::info!(?bound, ?bound_internal, "router serving");
    // One shutdown for both listeners: when either server fails, the other stops too.
    let stop = CancellationToken::new();
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
    let other = async {
        match frontend {
            Some(f) => f(router, keys, stop.clone()).await.map_err(RouterError::Frontend),
            None => Ok(()),
        }
    };
    let (r, _) = tokio::join!(
        async {
            let r = tokio::try_join!(
                async { serve_public.await.map_err(RouterError::from) },
                async { serve_internal.await.map_err(RouterError::from) },
                async {
                    let r = other.await;
                    if r.is_err() {
                        stop.cancel();
                    }
                    r
                },
            );
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
