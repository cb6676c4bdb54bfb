//! The router's gRPC services: the public `Generation` API and the `Membership` nodes call.
//! Validate, admit, hand to the relay; nothing else happens here.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_common::status::exhausted;
use pdmesh_proto::v1::generation_server::Generation;
use pdmesh_proto::v1::membership_server::Membership;
use pdmesh_proto::v1::{
    CancelRequest, CancelResponse, GenerateRequest, GenerateResponse, HeartbeatRequest,
    HeartbeatResponse, ListNodesRequest, ListNodesResponse, ModelInfoRequest, ModelInfoResponse,
    NodeStatus, RegisterRequest, RegisterResponse, Role, TokenizeRequest, TokenizeResponse,
    generate_request, tokenize_request,
};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use pdmesh_common::trace;

use crate::mesh::Mesh;
use crate::relay;
use crate::request::{prepare, tokenize};

/// Messages buffered towards a slow client before the relay waits.
const CLIENT_BUFFER: usize = 32;

#[derive(Debug, Clone)]
pub struct RouterService {
    pub mesh: Arc<Mesh>,
    pub admission: Arc<Semaphore>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

impl RouterService {
    async fn start_generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<ResponseStream>, Status> {
        let cfg = &self.mesh.config;
        let deadline = pdmesh_common::deadline::deadline_of(
            req.metadata(),
            Instant::now(),
            Duration::from_millis(cfg.request_timeout_ms),
        );
        let r = req.into_inner();
        let admission = pdmesh_common::span!("router.admission", in_flight = Empty);
        // The server layer's `router.generate` span: the request's root.
        let root = Span::current();
        trace::in_span(&admission, self.admit(r, deadline, root)).await
    }

    /// Validates (template, tokenizer, limits), takes an admission permit and starts the relay.
    async fn admit(
        &self,
        r: GenerateRequest,
        deadline: Instant,
        root: Span,
    ) -> Result<Response<ResponseStream>, Status> {
        let cfg = &self.mesh.config;
        let id = if r.request_id.is_empty() {
            pdmesh_common::ids::new_request_id()
        } else {
            pdmesh_common::ids::check_request_id(&r.request_id)
                .map_err(Status::invalid_argument)?;
            r.request_id.clone()
        };
        let model = Arc::clone(&self.mesh.model);
        let prep = tokio::task::spawn_blocking(move || prepare(&model, &r))
            .await
            .map_err(|e| Status::internal(format!("validation task: {e}")))?
            .map_err(Status::invalid_argument)?;
        trace::attr(&root, "request_id", id.clone());
        trace::attr(&root, "prompt_tokens", prep.prompt.len() as i64);
        trace::attr(&root, "max_tokens", prep.max_tokens as i64);
        let in_flight = cfg.max_in_flight.saturating_sub(self.admission.available_permits());
        Span::current().record("in_flight", in_flight as i64);
        let permit = Arc::clone(&self.admission).try_acquire_owned().map_err(|_| {
            exhausted(
                format!("router at its limit of {} requests in flight", cfg.max_in_flight),
                Duration::from_millis(cfg.retry_after_ms),
            )
        })?;
        let cancel = self
            .mesh
            .start(&id)
            .ok_or_else(|| Status::already_exists(format!("request_id {id} is already running")))?;
        let (tx, rx) = mpsc::channel(CLIENT_BUFFER);
        let mesh = Arc::clone(&self.mesh);
        let relay = async move {
            relay::run(Arc::clone(&mesh), id.clone(), prep, deadline, tx, cancel).await;
            mesh.finish(&id);
            drop(permit);
        };
        // The relay outlives this call; it runs in the request's span, not admission's.
        tokio::spawn(relay.instrument(root));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

#[tonic::async_trait]
impl Generation for RouterService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let started = self.start_generate(req).await;
        // Refused before it started (invalid, over the limit): counted here; everything later
        // is counted by the relay.
        if let Err(s) = &started {
            self.mesh.metrics.failed(s.code());
        }
        started
    }

    async fn tokenize(
        &self,
        req: Request<TokenizeRequest>,
    ) -> Result<Response<TokenizeResponse>, Status> {
        let input = req.into_inner().input.map(|i| match i {
            tokenize_request::Input::Prompt(p) => generate_request::Input::Prompt(p),
            tokenize_request::Input::Chat(c) => generate_request::Input::Chat(c),
        });
        let model = Arc::clone(&self.mesh.model);
        let ids = tokio::task::spawn_blocking(move || tokenize(&model, input.as_ref()))
            .await
            .map_err(|e| Status::internal(format!("tokenize task: {e}")))?
            .map_err(Status::invalid_argument)?;
        Ok(Response::new(TokenizeResponse { ids }))
    }

    async fn model_info(
        &self,
        _: Request<ModelInfoRequest>,
    ) -> Result<Response<ModelInfoResponse>, Status> {
        let m = &self.mesh.model;
        Ok(Response::new(ModelInfoResponse {
            name: m.config.name.clone(),
            architecture: m.config.arch.clone(),
            context_length: m.config.context as u32,
            vocab_size: m.tokenizer.vocab_size() as u32,
            layers: m.config.layers as u32,
            fingerprint: m.fingerprint,
            eos_token_ids: m.tokenizer.eog_tokens().to_vec(),
            has_chat_template: m.tokenizer.chat_template().is_ok(),
        }))
    }

    async fn cancel(
        &self,
        req: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        let id = req.into_inner().request_id;
        if self.mesh.cancel(&id) {
            Ok(Response::new(CancelResponse {}))
        } else {
            Err(Status::not_found(format!("request_id {id} is not running")))
        }
    }
}

#[tonic::async_trait]
impl Membership for RouterService {
    async fn register(
        &self,
        req: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let r = req.into_inner();
        let role = Role::try_from(r.role).unwrap_or(Role::Unspecified);
        if role == Role::Unspecified {
            return Err(Status::invalid_argument("role: must be prefill or decode"));
        }
        if r.node_id.is_empty() || r.address.is_empty() {
            return Err(Status::invalid_argument("node_id and address are required"));
        }
        let layout = r.layout.ok_or_else(|| Status::invalid_argument("layout is required"))?;
        if layout.model_fingerprint != self.mesh.model.fingerprint {
            tracing::warn!(
                node = r.node_id,
                "node serves model {:016x}, this router validates for {:016x}",
                layout.model_fingerprint,
                self.mesh.model.fingerprint
            );
        }
        let now = Instant::now();
        {
            let mut reg = self.mesh.registry();
            // A new node at an address that a departed node used: its old channel is stale.
            if reg.get(&r.node_id).is_none() {
                self.mesh.drop_channel(&r.address);
            }
            reg.register(&r.node_id, role, &r.address, layout, r.load.unwrap_or_default(), now);
        }
        // Registering (first or again after a restart) means an empty cache.
        self.mesh.prefixes.forget(&r.node_id);
        tracing::info!(
            node = r.node_id,
            role = role.as_str_name(),
            address = r.address,
            "node joined"
        );
        let cfg = &self.mesh.config;
        Ok(Response::new(RegisterResponse {
            heartbeat_interval_ms: cfg.heartbeat_interval_ms,
            node_ttl_ms: cfg.node_ttl_ms,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let r = req.into_inner();
        let known =
            self.mesh.registry().heartbeat(&r.node_id, r.load.unwrap_or_default(), Instant::now());
        Ok(Response::new(HeartbeatResponse { known }))
    }

    async fn list_nodes(
        &self,
        _: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let now = Instant::now();
        let nodes = self
            .mesh
            .registry()
            .all()
            .into_iter()
            .map(|n| NodeStatus {
                node_id: n.id,
                role: n.role as i32,
                address: n.address,
                layout: Some(n.layout),
                load: Some(n.load),
                since_heartbeat_ms: now.duration_since(n.last_seen).as_millis() as u64,
            })
            .collect();
        Ok(Response::new(ListNodesResponse { nodes }))
    }
}
