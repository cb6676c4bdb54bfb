//! The router as a library: a prepared request in, plain Rust events out. The gRPC
//! `Generation` service is one adapter over it (`service.rs`); an HTTP frontend is another,
//! never a copy of the request path. Admission (the in-flight bound, unique request ids), the
//! request's life on the mesh and its cancellation all live behind `Router`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_common::apikey::Tenant;
use pdmesh_common::gate::Quota;
use pdmesh_common::trace;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span};

use crate::classifier::Classifier;
use crate::error::RequestError;
pub use crate::events::{Event, Finished, Timings, Usage};
use crate::mesh::Mesh;
use crate::request::Prepared;

/// Events buffered towards a slow client before the request waits for it.
const CLIENT_BUFFER: usize = 32;
/// Cancels of requests this router does not run, asking every decode node at once: at most
/// this many under way, and this many of one tenant's. A cancel of a request it runs costs a
/// map lookup and is never refused.
pub const MAX_CANCEL_FANOUTS: usize = 8;
pub const MAX_CANCEL_FANOUTS_PER_TENANT: usize = 2;

/// A request's events; dropping it cancels the request on every node.
pub type Events = mpsc::Receiver<Result<Event, RequestError>>;
type EventSender = mpsc::Sender<Result<Event, RequestError>>;

/// A request's place among those in flight (`Router::admit`), on the router and among its
/// tenant's; dropping it gives both back.
#[derive(Debug)]
pub struct Admitted {
    _router: tokio::sync::OwnedSemaphorePermit,
    _tenant: Option<tokio::sync::OwnedSemaphorePermit>,
    tenant: Arc<Tenant>,
}

/// The router's library API.
#[derive(Debug, Clone)]
pub struct Router {
    pub(crate) mesh: Arc<Mesh>,
    admission: Arc<Semaphore>,
    /// Each tenant's places, for tenants with a limit of their own.
    tenants: Arc<Mutex<HashMap<String, TenantPlaces>>>,
    /// Cancels being asked of every decode node, by tenant.
    fanouts: Quota<String, String>,
    /// `auto`'s classifier, loaded where `[tiers] policy = "classifier"` (the config allows a
    /// file under no other policy).
    classifier: Option<Arc<Classifier>>,
}

/// A tenant's limit and its places under it.
type TenantPlaces = (usize, Arc<Semaphore>);

impl Router {
    pub fn new(mesh: Arc<Mesh>) -> Self {
        let admission = Arc::new(Semaphore::new(mesh.config.max_in_flight));
        let fanouts = Quota::new(
            MAX_CANCEL_FANOUTS,
            MAX_CANCEL_FANOUTS_PER_TENANT,
            format!("{MAX_CANCEL_FANOUTS} cancels of other routers' requests under way"),
            format!("{MAX_CANCEL_FANOUTS_PER_TENANT} of this tenant's cancels under way"),
        );
        Self { mesh, admission, tenants: Arc::default(), fanouts, classifier: None }
    }

    /// This router, choosing `auto`'s model up front with `classifier`.
    pub fn with_classifier(mut self, classifier: Classifier) -> Self {
        self.classifier = Some(Arc::new(classifier));
        self
    }

    /// The mesh behind the API, for the router's own gRPC adapter; frontends use the
    /// methods below.
    pub(crate) fn mesh(&self) -> &Arc<Mesh> {
        &self.mesh
    }

    /// The model the mesh serves by default (its context length, tokenizer and chat
    /// template).
    pub fn model(&self) -> &Arc<pdmesh_model::ModelCard> {
        &self.mesh.pool().model
    }

    /// Every served model, the default first: its id and card.
    pub fn models(&self) -> Vec<(String, Arc<pdmesh_model::ModelCard>)> {
        self.mesh.pools().iter().map(|p| (p.id.clone(), Arc::clone(&p.model))).collect()
    }

    /// The model a request asking for `asked` runs on: `asked` itself, or for a request that
    /// names none its tenant's `default_model`, else the router's default model.
    pub fn resolve_model(&self, asked: &str, tenant_default: Option<&str>) -> String {
        match (asked, tenant_default) {
            ("", Some(d)) => d.to_string(),
            ("", None) => self.mesh.pool().id.clone(),
            (a, _) => a.to_string(),
        }
    }

    /// The card of the model requests call `id`, if it is served.
    pub fn model_named(&self, id: &str) -> Option<Arc<pdmesh_model::ModelCard>> {
        self.mesh.pool_named(id).map(|p| Arc::clone(&p.model))
    }

    /// Decode nodes alive now: none, and no request can be served.
    pub fn live_decode_nodes(&self) -> usize {
        let model = self.mesh.pool().fingerprint();
        self.mesh.registry().live_count(model, pdmesh_proto::v1::Role::Decode, Instant::now())
    }

    /// The longest a request may take, the client's own deadline aside.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.mesh.config.request_timeout_ms)
    }

    /// Counts a request a frontend refused before it reached the mesh (invalid, over a
    /// limit), as the router counts its own: one `failed` by status code.
    pub fn count_refused(&self, code: tonic::Code) {
        self.mesh.metrics.failed(None, code);
    }

    /// Requests admitted and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.mesh.config.max_in_flight.saturating_sub(self.admission.available_permits())
    }

    pub(crate) fn admission(&self) -> &Arc<Semaphore> {
        &self.admission
    }

    /// A place among the requests in flight, taken before any work is done for a request
    /// (tokenizing a prompt is work); refused at once when the router, or `tenant`'s own
    /// limit, is full.
    pub fn admit(&self, tenant: Arc<Tenant>) -> Result<Admitted, RequestError> {
        let cfg = &self.mesh.config;
        let full = |message: String| RequestError::Overloaded {
            message,
            retry_after: Duration::from_millis(cfg.retry_after_ms),
        };
        let own = match tenant.max_in_flight {
            Some(limit) => {
                let places = {
                    let mut t = self.tenants.lock().expect("tenant map lock is never poisoned");
                    let e = t
                        .entry(tenant.tenant.clone())
                        .or_insert_with(|| (limit, Arc::new(Semaphore::new(limit))));
                    if e.0 != limit {
                        // The key file changed the limit: new places from now on (requests
                        // running keep theirs).
                        *e = (limit, Arc::new(Semaphore::new(limit)));
                    }
                    Arc::clone(&e.1)
                };
                Some(places.try_acquire_owned().map_err(|_| {
                    full(format!(
                        "tenant {} at its limit of {limit} requests in flight",
                        tenant.tenant
                    ))
                })?)
            }
            None => None,
        };
        let router = Arc::clone(&self.admission).try_acquire_owned().map_err(|_| {
            full(format!("router at its limit of {} requests in flight", cfg.max_in_flight))
        })?;
        Ok(Admitted { _router: router, _tenant: own, tenant })
    }

    /// Admits a prepared request and starts it on the mesh, running until `deadline`; its
    /// events come back on the returned receiver, under `span` (the request's root span).
    /// Refused at once (never queued without bound) when the router is full or the id runs.
    pub fn generate(
        &self,
        request_id: Option<String>,
        prep: Prepared,
        deadline: Instant,
        span: Span,
    ) -> Result<(String, Events), RequestError> {
        let admitted = self.admit(Arc::new(Tenant::anonymous()))?;
        self.generate_admitted(admitted, request_id, prep, deadline, span)
    }

    /// `generate` for a request already admitted (`admit`), whose place it keeps until it ends.
    pub fn generate_admitted(
        &self,
        admitted: Admitted,
        request_id: Option<String>,
        prep: Prepared,
        deadline: Instant,
        span: Span,
    ) -> Result<(String, Events), RequestError> {
        self.start(admitted, request_id, span, move |mesh, id, tenant, tx, cancel| async move {
            crate::relay::run(&mesh, id, prep, &tenant, deadline, tx, cancel).await;
        })
    }

    /// Registers the request's id and runs `body` for it in a task of its own, in `span`; the
    /// id and the admitted place are let go when `body` ends.
    fn start<F, Fut>(
        &self,
        admitted: Admitted,
        request_id: Option<String>,
        span: Span,
        body: F,
    ) -> Result<(String, Events), RequestError>
    where
        F: FnOnce(Arc<Mesh>, String, Arc<Tenant>, EventSender, CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let id = match request_id {
            Some(id) => {
                pdmesh_common::ids::check_request_id(&id).map_err(RequestError::Invalid)?;
                id
            }
            None => pdmesh_common::ids::new_request_id(),
        };
        let owner = admitted.tenant.tenant.clone();
        let cancel =
            self.mesh.start(&id, &owner).ok_or_else(|| RequestError::Duplicate(id.clone()))?;
        let (tx, rx) = mpsc::channel(CLIENT_BUFFER);
        let mesh = Arc::clone(&self.mesh);
        let work = body(Arc::clone(&mesh), id.clone(), Arc::clone(&admitted.tenant), tx, cancel);
        let run_id = id.clone();
        let run = async move {
            work.await;
            mesh.finish(&run_id, &owner);
            drop(admitted);
        };
        // The request outlives the call that started it; it runs in the request's span.
        tokio::spawn(run.instrument(span));
        Ok((id, rx))
    }

    /// `generate_admitted` for a request for `auto`: `ladder` is the request prepared for each
    /// model `Router::tier_models` gave, in order, run as a cascade (the classifier's choice
    /// is a ladder of one, which simply runs).
    pub fn generate_tiered(
        &self,
        admitted: Admitted,
        request_id: Option<String>,
        ladder: Vec<Prepared>,
        deadline: Instant,
        span: Span,
    ) -> Result<(String, Events), RequestError> {
        let Some(tiers) = self.mesh.config.tiers.clone() else {
            return Err(RequestError::Invalid("this router declares no ladder for `auto`".into()));
        };
        self.start(admitted, request_id, span, move |mesh, id, tenant, tx, cancel| async move {
            let threshold = tiers.min_mean_logprob;
            crate::tiers::run(&mesh, id, ladder, threshold, &tenant, deadline, tx, cancel).await;
        })
    }

    /// The models a request for `auto` is prepared for, cheapest first: the whole ladder for
    /// a cascade; under the classifier, the one model it chooses from `words` (the prompt, or
    /// the chat's last user message), so no other model's tokenizer runs. None where the
    /// router declares no ladder.
    pub fn tier_models(
        &self,
        words: &str,
        span: &Span,
    ) -> Option<Vec<(String, Arc<pdmesh_model::ModelCard>)>> {
        let ladder = self.ladder()?;
        let (Some(c), Some(tiers)) = (&self.classifier, &self.mesh.config.tiers) else {
            return Some(ladder);
        };
        let (k, chances) = c.choose(&tiers.ladder, words, f64::from(tiers.min_p_correct));
        trace::attr(span, "tier_chances", format!("{chances:.3?}"));
        self.mesh.metrics.tier_chosen(&tiers.ladder[k]);
        ladder.into_iter().nth(k).map(|m| vec![m])
    }

    /// The ladder of `auto` (`[tiers]`): each model's id and card, cheapest first; None where
    /// the router declares none.
    pub fn ladder(&self) -> Option<Vec<(String, Arc<pdmesh_model::ModelCard>)>> {
        let tiers = self.mesh.config.tiers.as_ref()?;
        tiers.ladder.iter().map(|id| Some((id.clone(), self.model_named(id)?))).collect()
    }

    /// Cancels `tenant`'s running request: it ends with `Finished(Cancelled)` and frees its
    /// KV on every node. False when `tenant` runs no request with this id (another tenant's
    /// request is as absent as one that never ran).
    pub fn cancel(&self, tenant: &Tenant, request_id: &str) -> bool {
        self.mesh.cancel(request_id, &tenant.tenant)
    }

    /// `cancel`, for a request this router may not run: one another router relays (several
    /// routers share the nodes) is cancelled on the decode node holding it, and its own router
    /// ends it with `Finished(Cancelled)`. False when no router's node holds it for `tenant`.
    /// Asking every node is bounded (`MAX_CANCEL_FANOUTS`, and per tenant): past it the
    /// cancel is refused at once (`Overloaded`), so a flood of cancels of unknown ids fills no
    /// node's command queue and slows no one's decoding.
    pub async fn cancel_anywhere(
        &self,
        tenant: &Tenant,
        request_id: &str,
    ) -> Result<bool, RequestError> {
        if self.cancel(tenant, request_id) {
            return Ok(true);
        }
        let _asking =
            self.fanouts.take(tenant.tenant.clone()).map_err(|why| RequestError::Overloaded {
                message: format!("cancel of {request_id} refused: {why}"),
                retry_after: Duration::from_millis(self.mesh.config.retry_after_ms),
            })?;
        Ok(self.mesh.cancel_on_nodes(&tenant.tenant, request_id).await)
    }
}
