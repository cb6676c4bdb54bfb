//! The router's gRPC services: the public `Generation` API, an adapter over the library API
//! (`api::Router`: a prepared request in, plain events out), and the `Membership` nodes call.
//! Authenticate, validate, hand over, map; nothing else happens here. Every public call names
//! its tenant by API key; with TLS, every membership call comes from a node that speaks only
//! for itself (its certificate's name and role).

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_proto::v1::generation_server::Generation;
use pdmesh_proto::v1::{
    CancelRequest, CancelResponse, GenerateRequest, GenerateResponse, ModelInfoRequest,
    ModelInfoResponse, TokenizeRequest, TokenizeResponse, generate_request, generate_response,
    tokenize_request,
};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing::Span;
use tracing::field::Empty;

use pdmesh_common::apikey::{KeyRing, Tenant};
use pdmesh_common::gate::{Quota, Slot};
use pdmesh_common::trace;

use crate::api::{Event, Router};
use crate::config::AUTO_MODEL;
use crate::mesh::Mesh;
use crate::request::{Prepared, classified_message, prepare, tokenize};
use pdmesh_model::ModelCard;

#[derive(Debug, Clone)]
pub struct RouterService {
    pub router: Router,
    /// The API keys; None: `allow_anonymous`.
    pub keys: Option<Arc<KeyRing>>,
}

/// The public API's interceptor: a call's API key is checked from its headers, before its
/// message is read or decoded (a stranger makes the router hold and parse nothing), and the
/// tenant it names rides in the call's extensions to the handler. Calls whose message has
/// not yet arrived are bounded per tenant (`Arriving`): admission counts a request only once
/// it is read, and a tenant that opened streams and sent no message held one each, without
/// limit.
#[derive(Debug, Clone)]
pub struct KeyCheck {
    keys: Option<Arc<KeyRing>>,
    arriving: Quota<String, String>,
}

/// Calls whose message is still arriving, in all and per tenant: far above what a client
/// sends at once (a message is read as soon as it arrives), far below the streams the public
/// port's connections allow.
pub const MOST_ARRIVING: usize = 4096;
pub const MOST_ARRIVING_PER_TENANT: usize = 64;

/// A call's place among those arriving, given back when the handler has its message (or the
/// call ends before).
#[derive(Debug, Clone)]
struct Arriving {
    _place: Arc<Slot<String, String>>,
}

impl KeyCheck {
    pub fn new(keys: Option<Arc<KeyRing>>) -> Self {
        let arriving = Quota::new(
            MOST_ARRIVING,
            MOST_ARRIVING_PER_TENANT,
            format!("{MOST_ARRIVING} calls are still sending their message"),
            format!(
                "{MOST_ARRIVING_PER_TENANT} of this tenant's calls are still sending their message"
            ),
        );
        Self { keys, arriving }
    }
}

/// The tenant whose API key `metadata` carries (anonymous in a mesh without keys).
fn tenant_of(
    keys: Option<&KeyRing>,
    metadata: &tonic::metadata::MetadataMap,
) -> Result<Arc<Tenant>, Status> {
    let Some(keys) = keys else { return Ok(Arc::new(Tenant::anonymous())) };
    keys.authenticate(metadata).map_err(|e| Status::unauthenticated(e.to_string()))
}

impl tonic::service::Interceptor for KeyCheck {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let tenant = tenant_of(self.keys.as_deref(), req.metadata())?;
        let place =
            self.arriving.take(tenant.tenant.clone()).map_err(Status::resource_exhausted)?;
        req.extensions_mut().insert(Arriving { _place: Arc::new(place) });
        req.extensions_mut().insert(tenant);
        Ok(req)
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

impl RouterService {
    pub(crate) fn mesh(&self) -> &Arc<Mesh> {
        self.router.mesh()
    }

    /// The tenant a public call is made for, by its API key (as `KeyCheck` found it).
    fn tenant<T>(&self, req: &Request<T>) -> Result<Arc<Tenant>, Status> {
        if let Some(t) = req.extensions().get::<Arc<Tenant>>() {
            return Ok(Arc::clone(t));
        }
        tenant_of(self.keys.as_deref(), req.metadata())
    }

    async fn start_generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<ResponseStream>, Status> {
        let cfg = &self.mesh().config;
        let deadline = pdmesh_common::deadline::deadline_of(
            req.metadata(),
            Instant::now(),
            Duration::from_millis(cfg.request_timeout_ms),
        );
        let tenant = self.tenant(&req)?;
        let r = req.into_inner();
        let admission = pdmesh_common::span!("router.admission", in_flight = Empty);
        // The server layer's `router.generate` span: the request's root.
        let root = Span::current();
        trace::in_span(&admission, self.admit(tenant, r, deadline, root)).await
    }

    /// Validates (template, tokenizer, limits) and starts the request on the library API.
    async fn admit(
        &self,
        tenant: Arc<Tenant>,
        r: GenerateRequest,
        deadline: Instant,
        root: Span,
    ) -> Result<Response<ResponseStream>, Status> {
        let served = || {
            let mut ids: Vec<&str> = self.mesh().pools().iter().map(|p| &p.id[..]).collect();
            if self.mesh().config.tiers.is_some() {
                ids.push(AUTO_MODEL);
            }
            ids.join(", ")
        };
        // The models to prepare it for: the one it names (or its tenant's default), or those
        // `auto` may run.
        let asked = self.router.resolve_model(&r.model, tenant.default_model.as_deref());
        let models: Vec<(String, Arc<ModelCard>)> = match asked.as_str() {
            AUTO_MODEL => {
                self.router.tier_models(&classified_words(&r), &root).ok_or_else(|| {
                    Status::not_found(format!(
                        "model \"auto\" is not served here (the router declares no [tiers]); \
                     served: {}",
                        served()
                    ))
                })?
            }
            name => {
                let pool = self.mesh().pool_named(name).ok_or_else(|| {
                    Status::not_found(format!(
                        "model {name:?} is not served here; served: {}",
                        served()
                    ))
                })?;
                vec![(pool.id.clone(), Arc::clone(&pool.model))]
            }
        };
        trace::attr(&root, "model", asked.clone());
        // A place first: a full router refuses before it tokenizes (the costly part of checking).
        trace::attr(&root, "tenant", tenant.tenant.clone());
        let tenant_policy = tenant.kv_policy;
        let admitted = self.router.admit(tenant)?;
        let request_id = (!r.request_id.is_empty()).then(|| r.request_id.clone());
        // Token ids are only checked against the vocabulary: microseconds, less than the
        // hand-off to a blocking thread and back. Text is tokenized (and a chat rendered) off
        // the async threads, which a long prompt would hold up.
        let auto = asked == AUTO_MODEL;
        if auto && matches!(r.input, Some(generate_request::Input::TokenIds(_))) {
            return Err(Status::invalid_argument(
                "token_ids: ids are one tokenizer's, and `auto` may run several models; send a \
                 prompt or a chat",
            ));
        }
        let ids_only = matches!(r.input, Some(generate_request::Input::TokenIds(_))) && !auto;
        let prepare_all = move || -> Result<Vec<Prepared>, String> {
            let prepare_for = |(id, model): &(String, Arc<ModelCard>)| {
                let mut prep = prepare(model, &r).map_err(|e| match models.len() {
                    1 => e,
                    _ => format!("for {id}: {e}"),
                })?;
                prep.model.clone_from(id);
                prep.kv_policy = prep.kv_policy.or(tenant_policy);
                Ok(prep)
            };
            models.iter().map(prepare_for).collect()
        };
        let mut preps = if ids_only {
            prepare_all()
        } else {
            tokio::task::spawn_blocking(prepare_all)
                .await
                .map_err(|e| Status::internal(format!("validation task: {e}")))?
        }
        .map_err(Status::invalid_argument)?;
        if let Some(p) = preps[0].kv_policy {
            trace::attr(&root, "kv_policy", p.to_string());
        }
        trace::attr(&root, "prompt_tokens", preps[0].prompt.len() as i64);
        trace::attr(&root, "max_tokens", preps[0].max_tokens as i64);
        Span::current().record("in_flight", self.router.in_flight() as i64);
        let (id, events) = if auto {
            self.router.generate_tiered(admitted, request_id, preps, deadline, root.clone())?
        } else {
            let prep = preps.swap_remove(0);
            self.router.generate_admitted(admitted, request_id, prep, deadline, root.clone())?
        };
        trace::attr(&root, "request_id", id);
        let stream = tokio_stream::wrappers::ReceiverStream::new(events).map(|ev| {
            ev.map(|e| GenerateResponse { event: Some(to_wire(e)) }).map_err(Status::from)
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// A library event as the wire carries it.
fn to_wire(e: Event) -> generate_response::Event {
    use pdmesh_proto::v1 as w;
    match e {
        Event::Started { request_id, prompt_tokens, trace_id, model } => {
            generate_response::Event::Started(w::Started {
                request_id,
                prompt_tokens,
                trace_id: trace_id.unwrap_or_default(),
                model,
            })
        }
        Event::Delta { text, tokens, logprobs } => generate_response::Event::Delta(w::Delta {
            text,
            token_ids: tokens,
            logprobs: logprobs.iter().map(pdmesh_wire::logprobs_to_wire).collect(),
        }),
        Event::Finished(f) => {
            let t = f.timings;
            generate_response::Event::Finished(w::Finished {
                reason: pdmesh_wire::finish_reason(f.reason) as i32,
                usage: Some(w::Usage {
                    prompt_tokens: f.usage.prompt_tokens,
                    cached_tokens: f.usage.cached_tokens,
                    completion_tokens: f.usage.completion_tokens,
                    cached_by_tier: f.usage.cached_by_tier.map(|t| w::CachedTokens {
                        node_ram: t.node_ram,
                        node_disk: t.node_disk,
                        kvstore_ram: t.kvstore_ram,
                        kvstore_disk: t.kvstore_disk,
                    }),
                    kv_policy: f.usage.kv_policy.map(|p| p.to_string()).unwrap_or_default(),
                    kv_evicted_tokens: f.usage.kv_evicted_tokens,
                }),
                timings: Some(w::Timings {
                    queue_ms: t.queue_ms,
                    prefill_ms: t.prefill_ms,
                    transfer_ms: t.transfer_ms,
                    ttft_ms: t.ttft_ms,
                    total_ms: t.total_ms,
                    prefill_node: t.prefill_node,
                    decode_node: t.decode_node,
                    kv_transport: t.kv_transport,
                    kv_bytes: t.kv_bytes,
                    attempts: t.attempts,
                    migrations: t.migrations,
                    preemptions: t.preemptions,
                    escalations: t.escalations,
                }),
                model: f.model,
            })
        }
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
        // is counted as the request ends.
        if let Err(s) = &started {
            self.mesh().metrics.failed(None, s.code());
        }
        started
    }

    async fn tokenize(
        &self,
        req: Request<TokenizeRequest>,
    ) -> Result<Response<TokenizeResponse>, Status> {
        let tenant = self.tenant(&req)?;
        let input = req.into_inner().input.map(|i| match i {
            tokenize_request::Input::Prompt(p) => generate_request::Input::Prompt(p),
            tokenize_request::Input::Chat(c) => generate_request::Input::Chat(c),
        });
        let model = Arc::clone(&self.mesh().pool().model);
        // Tokenizing is the work a Generate is admitted for: it takes a place too while it runs.
        let _admitted = self.router.admit(tenant)?;
        let ids = tokio::task::spawn_blocking(move || tokenize(&model, input.as_ref()))
            .await
            .map_err(|e| Status::internal(format!("tokenize task: {e}")))?
            .map_err(Status::invalid_argument)?;
        Ok(Response::new(TokenizeResponse { ids }))
    }

    async fn model_info(
        &self,
        req: Request<ModelInfoRequest>,
    ) -> Result<Response<ModelInfoResponse>, Status> {
        self.tenant(&req)?;
        let m = &self.mesh().pool().model;
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
        let tenant = self.tenant(&req)?;
        let id = req.into_inner().request_id;
        if self.router.cancel_anywhere(&tenant, &id).await? {
            Ok(Response::new(CancelResponse {}))
        } else {
            Err(Status::not_found(format!("request_id {id} is not running")))
        }
    }
}

/// The words of `r` `auto`'s classifier reads: the prompt, or the chat's last user message.
fn classified_words(r: &GenerateRequest) -> String {
    match &r.input {
        Some(generate_request::Input::Prompt(p)) => p.clone(),
        Some(generate_request::Input::Chat(c)) => classified_message(&c.messages, |m| &m.role)
            .map(|m| m.content.clone())
            .unwrap_or_default(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tonic::Code;
    use tonic::service::Interceptor;

    /// A tenant with a valid key opened streams that never sent their message: admission
    /// counts a request only once it is read, so each held a stream's memory with no limit
    /// (8,192 of them took 75 MiB of a router). Now a tenant holds 64 at most, and others
    /// are not held up by them.
    #[test]
    fn a_tenant_holds_few_calls_whose_message_has_not_arrived() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("keys.toml");
        let tenant = |name: &str| Tenant {
            tenant: name.into(),
            max_in_flight: Some(2),
            cache_group: None,
            kv_policy: None,
            default_model: None,
        };
        let mallory = pdmesh_common::apikey::add(&f, tenant("mallory")).unwrap();
        let alice = pdmesh_common::apikey::add(&f, tenant("alice")).unwrap();
        let mut check = KeyCheck::new(Some(Arc::new(KeyRing::load(&f).unwrap())));
        let call = |key: &str| {
            let mut r = Request::new(());
            r.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
            r
        };
        let held: Vec<_> =
            (0..MOST_ARRIVING_PER_TENANT).map(|_| check.call(call(&mallory)).unwrap()).collect();
        let e = check.call(call(&mallory)).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        let a = check.call(call(&alice)).unwrap();
        assert_eq!(a.extensions().get::<Arc<Tenant>>().unwrap().tenant, "alice");
        // Read (the handler has its message and the call's extensions are gone): the places
        // come back.
        drop(held);
        check.call(call(&mallory)).unwrap();
        // A stranger is refused as before, and holds nothing.
        let e = check.call(call("pdm_0123456789abcdef")).unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    }
}
