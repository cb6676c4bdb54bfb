//! The endpoints: authenticate, check, hand the request to the router's library API, and
//! turn its events into the API's bodies — one JSON object, or server-sent events ending in
//! `data: [DONE]`. The response starts only once the first token (or the failure) is known, so
//! a request that cannot run gets its HTTP status; dropping the response (the client hung up)
//! drops the router's event stream, which cancels the request on every node.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::sse::{Event as Sse, Sse as SseBody};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use http::{HeaderMap, HeaderValue};
use pdmesh_common::apikey::{KeyRing, Tenant};
use pdmesh_common::trace;
use pdmesh_model::{FinishReason, TokenLogprobs};
use pdmesh_router::config::AUTO_MODEL;
use pdmesh_router::{Event, Events, Finished, Router};
use serde::de::DeserializeOwned;
use tracing::Span;
use tracing::field::Empty;

use crate::error::ApiError;
use crate::prepare::{self, Plan};
use crate::schema::*;

/// The header a client sets to bound a request's time, in seconds (the router's
/// `request_timeout_ms` bounds it anyway).
pub const TIMEOUT_HEADER: &str = "x-request-timeout";
/// The response header naming the request's trace.
pub const TRACE_ID_HEADER: &str = "x-trace-id";
/// The response header naming the request, as `Cancel` takes it.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// The largest request body taken (a prompt and its parameters, with room for a long
/// context); nothing of a body is read before its caller's key is checked.
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// Time a caller gets to send its whole body once its headers are in.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct AppState {
    pub router: Router,
    /// None: anonymous callers (the router runs `allow_anonymous`).
    pub keys: Option<Arc<KeyRing>>,
    /// When this server started: `created` of its model card.
    pub started: u64,
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl AppState {
    pub fn new(router: Router, keys: Option<Arc<KeyRing>>) -> Self {
        Self { router, keys, started: now_s() }
    }

    fn tenant(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
        let Some(keys) = &self.keys else { return Ok(Arc::new(Tenant::anonymous())) };
        keys.authenticate_http(headers).map_err(|e| ApiError::unauthenticated(e.to_string()))
    }

    fn card(&self, id: &str, model: &pdmesh_model::ModelCard) -> ModelCard {
        ModelCard {
            id: id.to_string(),
            object: "model",
            created: self.started,
            owned_by: "pdmesh",
            max_model_len: model.config.context as u32,
        }
    }

    /// `auto`'s card where the router declares a ladder: its context is the least of the
    /// ladder's, which every model it may run can take.
    fn auto_card(&self) -> Option<ModelCard> {
        let ladder = self.router.ladder()?;
        let (_, smallest) = ladder.iter().min_by_key(|(_, m)| m.config.context)?;
        Some(self.card(AUTO_MODEL, smallest))
    }

    /// The served model `asked` names, with its card; else 404 naming those served.
    fn pick(&self, asked: &str) -> Result<Arc<pdmesh_model::ModelCard>, ApiError> {
        self.router.model_named(asked).ok_or_else(|| self.unknown(asked))
    }

    fn unknown(&self, asked: &str) -> ApiError {
        let mut served: Vec<String> = self.router.models().into_iter().map(|(id, _)| id).collect();
        if self.router.ladder().is_some() {
            served.push(AUTO_MODEL.into());
        }
        ApiError::unknown_model(asked, &served.join("`, `"))
    }

    /// What a request for `asked` is prepared for: that model (for none, the tenant's
    /// `default_model` or the router's default), or those `auto` may run, chosen by the
    /// request's `words` (`Router::tier_models`).
    fn models_for(
        &self,
        asked: &str,
        tenant_default: Option<&str>,
        words: &str,
        span: &Span,
    ) -> Result<Vec<(String, Arc<pdmesh_model::ModelCard>)>, ApiError> {
        let asked = &self.router.resolve_model(asked, tenant_default)[..];
        if asked == AUTO_MODEL {
            return self.router.tier_models(words, span).ok_or_else(|| self.unknown(asked));
        }
        Ok(vec![(asked.to_string(), self.pick(asked)?)])
    }
}

/// `GET /health`: 200 while a decode node can take requests, 503 otherwise (no key needed:
/// load balancers probe it).
pub async fn health(State(s): State<AppState>) -> Response {
    let live = s.router.live_decode_nodes();
    let status =
        if live > 0 { http::StatusCode::OK } else { http::StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(serde_json::json!({ "status": if live > 0 { "ok" } else { "no decode node" }, "decode_nodes": live })))
        .into_response()
}

pub async fn models(State(s): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    s.tenant(&headers)?;
    let mut data: Vec<ModelCard> = s.router.models().iter().map(|(id, m)| s.card(id, m)).collect();
    data.extend(s.auto_card());
    Ok(axum::Json(ModelList { object: "list", data }).into_response())
}

pub async fn model(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    s.tenant(&headers)?;
    if let Some(auto) = s.auto_card().filter(|c| c.id == id) {
        return Ok(axum::Json(auto).into_response());
    }
    let model = s.pick(&id)?;
    Ok(axum::Json(s.card(&id, &model)).into_response())
}

pub async fn not_found(uri: http::Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

/// Which endpoint a request came in on: the shape of its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

pub async fn chat(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    generate(s, headers, body, Kind::Chat).await
}

pub async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    generate(s, headers, body, Kind::Completion).await
}

/// The body, read whole within `MAX_BODY_BYTES` and `BODY_TIMEOUT`: a body announced too
/// large is refused unread, one that grows too large or trickles is cut off.
pub(crate) async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let announced = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(ApiError::too_large(MAX_BODY_BYTES));
    }
    let read = http_body_util::BodyExt::collect(http_body_util::Limited::new(body, MAX_BODY_BYTES));
    match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Err(_) => Err(ApiError::body_timeout(BODY_TIMEOUT)),
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            Err(ApiError::too_large(MAX_BODY_BYTES))
        }
        Ok(Err(e)) => Err(ApiError::malformed(format!("reading the request body: {e}"))),
    }
}

/// A JSON body as `T`; a bad or missing field is a 400 naming it.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::malformed(format!("the body is not valid JSON: {inner}"));
        }
        let text = inner.to_string();
        // serde says "missing field `name` at line ..": the field is the parameter.
        let missing = text.strip_prefix("missing field `").and_then(|r| r.split_once('`'));
        match missing {
            Some((field, _)) if path == "." => ApiError::invalid(field, "is required"),
            _ if path == "." => ApiError::malformed(format!("the body is not a request: {text}")),
            _ => ApiError::invalid(path, text),
        }
    })
}

async fn generate(s: AppState, headers: HeaderMap, body: Body, kind: Kind) -> Response {
    let root = pdmesh_common::span!(
        "router.openai",
        http.route = match kind {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        },
        request_id = Empty,
    );
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        trace::continue_from(&root, tp);
    }
    let started = start(&s, &headers, body, kind, root.clone()).await;
    let trace_id = trace_id_of(&root, &headers);
    let mut response = match started {
        Ok(r) => r,
        Err(Refused { error: e, counted }) => {
            trace::record_status(&root, code_of(&e), &e.message);
            // A request that failed on the mesh was counted as it ended; one refused before
            // it started (invalid, over the limit) is counted here, as gRPC's are.
            if !counted {
                s.router.count_refused(code_of(&e));
            }
            e.into_response()
        }
    };
    if let Some(t) = trace_id.and_then(|t| HeaderValue::from_str(&t).ok()) {
        response.headers_mut().insert(TRACE_ID_HEADER, t);
    }
    response
}

/// The trace a request is in: its own span's when spans are exported, else the caller's.
fn trace_id_of(root: &Span, headers: &HeaderMap) -> Option<String> {
    let _in = root.enter();
    trace::trace_id().or_else(|| {
        let tp = headers.get("traceparent")?.to_str().ok()?;
        let id = tp.split('-').nth(1)?;
        (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_string())
    })
}

/// The gRPC code an API error corresponds to (for the router's metrics and the trace).
fn code_of(e: &ApiError) -> tonic::Code {
    use http::StatusCode as S;
    match e.status {
        S::BAD_REQUEST => tonic::Code::InvalidArgument,
        S::UNAUTHORIZED => tonic::Code::Unauthenticated,
        S::FORBIDDEN => tonic::Code::PermissionDenied,
        S::NOT_FOUND => tonic::Code::NotFound,
        S::CONFLICT => tonic::Code::AlreadyExists,
        S::TOO_MANY_REQUESTS => tonic::Code::ResourceExhausted,
        S::SERVICE_UNAVAILABLE => tonic::Code::Unavailable,
        S::GATEWAY_TIMEOUT => tonic::Code::DeadlineExceeded,
        _ => tonic::Code::Internal,
    }
}

/// The deadline the client asked for with `x-request-timeout` (seconds), within `most` (the
/// router's bound).
pub(crate) fn deadline(
    most: Duration,
    headers: &HeaderMap,
    now: Instant,
) -> Result<Instant, ApiError> {
    let Some(v) = headers.get(TIMEOUT_HEADER) else { return Ok(now + most) };
    let secs = v.to_str().ok().and_then(|v| v.trim().parse::<f64>().ok());
    match secs {
        // Past what a Duration holds (1e20 s) is past the router's bound too: capped, never
        // a panic.
        Some(t) if t.is_finite() && t > 0.0 => {
            Ok(now + Duration::try_from_secs_f64(t).map_or(most, |t| t.min(most)))
        }
        _ => {
            Err(ApiError::invalid(TIMEOUT_HEADER, "must be a positive number of seconds (header)"))
        }
    }
}

/// Why a request got no answer: the error, and whether the router already counted it (it
/// failed on the mesh, after it started).
struct Refused {
    error: ApiError,
    counted: bool,
}

impl From<ApiError> for Refused {
    fn from(error: ApiError) -> Self {
        Self { error, counted: false }
    }
}

impl From<pdmesh_router::RequestError> for Refused {
    fn from(e: pdmesh_router::RequestError) -> Self {
        ApiError::from(e).into()
    }
}

/// An error the mesh reported for a started request (the router counted it).
fn on_mesh(e: impl Into<ApiError>) -> Refused {
    Refused { error: e.into(), counted: true }
}

async fn start(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
    kind: Kind,
    root: Span,
) -> Result<Response, Refused> {
    let now = Instant::now();
    // The key before anything else: a stranger's body is never read.
    let tenant = s.tenant(headers)?;
    let most = s.router.request_timeout();
    let deadline = deadline(most, headers, now)?;
    trace::attr(&root, "tenant", tenant.tenant.clone());
    let tenant_policy = tenant.kv_policy;
    let tenant_model = tenant.default_model.clone();
    // A place first: a full router refuses before it reads, parses and tokenizes.
    let admitted = s.router.admit(tenant)?;
    let body = read_body(headers, body).await?;
    let state = s.clone();
    let span = root.clone();
    // The body names the model, whose tokenizer and template check the rest;
    // `auto` is prepared for each model of its ladder, by that model's tokenizer and template.
    let plans = tokio::task::spawn_blocking(move || -> Result<Vec<Plan>, ApiError> {
        match kind {
            Kind::Chat => {
                let r: ChatCompletionRequest = parse_body(&body)?;
                let common = parse_body(&body)?;
                let each = |(id, model): &(String, Arc<pdmesh_model::ModelCard>)| {
                    prepare::chat(model, id, &r, &common)
                };
                let words = prepare::chat_words(&r);
                let models = state.models_for(&r.model, tenant_model.as_deref(), &words, &span)?;
                models.iter().map(each).collect()
            }
            Kind::Completion => {
                let r: CompletionRequest = parse_body(&body)?;
                let common = parse_body(&body)?;
                let each = |(id, model): &(String, Arc<pdmesh_model::ModelCard>)| {
                    prepare::completion(model, id, &r, &common)
                };
                let words = prepare::completion_words(&r);
                let models = state.models_for(&r.model, tenant_model.as_deref(), &words, &span)?;
                models.iter().map(each).collect()
            }
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("validation task: {e}")))??;
    let auto = plans.len() > 1;
    let mut plans: Vec<Plan> = plans
        .into_iter()
        .map(|mut p| {
            p.prep.kv_policy = p.prep.kv_policy.or(tenant_policy);
            p
        })
        .collect();
    let ladder: Vec<_> = plans.iter().map(|p| p.prep.clone()).collect();
    let plan = &plans[0];
    if let Some(p) = plan.prep.kv_policy {
        trace::attr(&root, "kv_policy", p.to_string());
    }
    trace::attr(&root, "prompt_tokens", plan.prep.prompt.len() as i64);
    trace::attr(&root, "max_tokens", plan.prep.max_tokens as i64);
    if let Some(u) = &plan.user {
        trace::attr(&root, "user", u.clone());
    }
    let (request_id, mut events) = if auto {
        s.router.generate_tiered(admitted, None, ladder, deadline, root.clone())?
    } else {
        s.router.generate_admitted(admitted, None, plan.prep.clone(), deadline, root.clone())?
    };
    root.record("request_id", request_id.as_str());
    // Started (naming the model that answers), then the first token or why there is none:
    // the status is known before the response begins.
    let mut answering = plan.prep.model.clone();
    let first = loop {
        match next_event(&mut None, &mut events).await.map_err(on_mesh)? {
            Event::Started { model, .. } => answering = model,
            ev => break ev,
        }
    };
    // The answering model's own plan: its prompt ids are its tokenizer's.
    let at = plans.iter().position(|p| p.prep.model == answering).unwrap_or(0);
    let plan = plans.swap_remove(at);
    let mut answer = Answer::new(s, kind, plan, &answering, &request_id);
    let mut response = if answer.plan.stream {
        let body = answer.stream(first, events);
        SseBody::new(body).into_response()
    } else {
        answer.whole(first, events).await.map_err(on_mesh)?
    };
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    Ok(response)
}

/// The event held back (`held`, taken once), else the request's next one.
async fn next_event(held: &mut Option<Event>, events: &mut Events) -> Result<Event, ApiError> {
    if let Some(ev) = held.take() {
        return Ok(ev);
    }
    match events.recv().await {
        Some(ev) => Ok(ev?),
        None => Err(ApiError::internal("the request ended without a finish")),
    }
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        // Cancelled through the API (`Cancel`): vLLM's word for it.
        FinishReason::Cancelled => "abort",
    }
}

fn usage(f: &Finished) -> Usage {
    Usage {
        prompt_tokens: f.usage.prompt_tokens,
        completion_tokens: f.usage.completion_tokens,
        total_tokens: f.usage.prompt_tokens + f.usage.completion_tokens,
        prompt_tokens_details: PromptTokensDetails { cached_tokens: f.usage.cached_tokens },
        kv_policy: f.usage.kv_policy.map(|p| p.to_string()),
        kv_evicted_tokens: f.usage.kv_policy.map(|_| f.usage.kv_evicted_tokens),
    }
}

/// One request's answer being built: ids, and what has been said so far.
struct Answer {
    kind: Kind,
    plan: Plan,
    model: Arc<pdmesh_model::ModelCard>,
    id: String,
    created: u64,
    model_id: String,
    fingerprint: String,
    /// Bytes of text sent so far (the legacy logprobs' `text_offset`).
    offset: usize,
}

impl Answer {
    /// The answer of `model_id` (for `auto`, the ladder's model that answers) to `plan`.
    fn new(s: &AppState, kind: Kind, plan: Plan, model_id: &str, request_id: &str) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        let model_id = model_id.to_string();
        let model = s.router.model_named(&model_id).unwrap_or_else(|| Arc::clone(s.router.model()));
        let fingerprint = format!("fp_{:016x}", model.fingerprint);
        Self {
            kind,
            plan,
            model,
            id: format!("{prefix}-{request_id}"),
            created: now_s(),
            model_id,
            fingerprint,
            offset: 0,
        }
    }

    fn piece(&self, id: u32) -> (String, Vec<u8>) {
        let b = self.model.tokenizer.token_bytes(id).unwrap_or_default().to_vec();
        (String::from_utf8_lossy(&b).into_owned(), b)
    }

    fn chat_logprobs(&self, l: &[TokenLogprobs]) -> Option<ChatLogprobs> {
        self.plan.logprobs?;
        let content = l
            .iter()
            .map(|t| {
                let (token, bytes) = self.piece(t.token);
                let top = t
                    .top
                    .iter()
                    .map(|&(id, logprob)| {
                        let (token, bytes) = self.piece(id);
                        TopLogprob { token, logprob, bytes }
                    })
                    .collect();
                ChatTokenLogprob { token, logprob: t.logprob, bytes, top_logprobs: Some(top) }
            })
            .collect();
        Some(ChatLogprobs { content, refusal: None })
    }

    /// The legacy shape; `text` is the delta's text, for the offsets.
    fn completion_logprobs(
        &mut self,
        l: &[TokenLogprobs],
        text: &str,
    ) -> Option<CompletionLogprobs> {
        self.plan.logprobs?;
        let mut out = CompletionLogprobs::default();
        for t in l {
            let (token, _) = self.piece(t.token);
            out.text_offset.push(self.offset);
            self.offset += token.len();
            out.tokens.push(token);
            out.token_logprobs.push(t.logprob);
            let mut top = serde_json::Map::new();
            for &(id, lp) in &t.top {
                top.insert(self.piece(id).0, serde_json::json!(lp));
            }
            out.top_logprobs.push(top);
        }
        // Offsets follow the text actually sent, which held-back text can shift.
        self.offset = self.offset.max(text.len());
        Some(out)
    }

    fn ids(&self, tokens: &[u32]) -> Option<Vec<u32>> {
        self.plan.return_token_ids.then(|| tokens.to_vec())
    }

    fn head(&self, object: &'static str) -> Head {
        Head {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model_id.clone(),
            system_fingerprint: self.fingerprint.clone(),
        }
    }

    /// The whole answer, once the request finished.
    async fn whole(&mut self, first: Event, mut events: Events) -> Result<Response, ApiError> {
        let (mut text, mut tokens, mut logprobs) = (String::new(), Vec::new(), Vec::new());
        let mut first = Some(first);
        let finished = loop {
            match next_event(&mut first, &mut events).await? {
                Event::Started { .. } => {}
                Event::Delta { text: t, tokens: ids, logprobs: l } => {
                    text.push_str(&t);
                    tokens.extend(ids);
                    logprobs.extend(l);
                }
                Event::Finished(f) => break f,
            }
        };
        let usage = usage(&finished);
        let reason = Some(finish_reason(finished.reason));
        let prompt_ids = self.plan.return_token_ids.then(|| self.plan.prep.prompt.clone());
        // Serialized as themselves (not through a JSON value, which widens every f32
        // logprob to f64 digits the stream would not show).
        Ok(match self.kind {
            Kind::Chat => axum::Json(ChatCompletion {
                head: self.head("chat.completion"),
                choices: vec![ChatChoice {
                    index: 0,
                    message: AssistantMessage { role: "assistant", content: text, refusal: None },
                    logprobs: self.chat_logprobs(&logprobs),
                    finish_reason: reason,
                    token_ids: self.ids(&tokens),
                }],
                usage,
                prompt_token_ids: prompt_ids,
            })
            .into_response(),
            Kind::Completion => {
                let lp = self.completion_logprobs(&logprobs, &text);
                axum::Json(Completion {
                    head: self.head("text_completion"),
                    choices: vec![CompletionChoice {
                        index: 0,
                        text,
                        logprobs: lp,
                        finish_reason: reason,
                        token_ids: self.ids(&tokens),
                    }],
                    usage: Some(Some(usage)),
                    prompt_token_ids: prompt_ids,
                })
                .into_response()
            }
        })
    }

    /// One streamed chunk: `text` and its tokens, or the finish.
    fn chunk(
        &mut self,
        text: Option<String>,
        tokens: &[u32],
        l: &[TokenLogprobs],
        reason: Option<&'static str>,
        role: bool,
    ) -> Sse {
        let usage = self.plan.include_usage.then_some(None);
        // The finish carries no tokens of its own.
        let token_ids = if tokens.is_empty() && reason.is_some() { None } else { self.ids(tokens) };
        let v = match self.kind {
            Kind::Chat => serde_json::to_string(&ChatChunk {
                head: self.head("chat.completion.chunk"),
                choices: vec![ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta { role: role.then_some("assistant"), content: text },
                    logprobs: if l.is_empty() { None } else { self.chat_logprobs(l) },
                    finish_reason: reason,
                    token_ids: token_ids.clone(),
                }],
                usage,
            }),
            Kind::Completion => {
                let text = text.unwrap_or_default();
                let lp = if l.is_empty() { None } else { self.completion_logprobs(l, &text) };
                serde_json::to_string(&Completion {
                    head: self.head("text_completion"),
                    choices: vec![CompletionChoice {
                        index: 0,
                        text,
                        logprobs: lp,
                        finish_reason: reason,
                        token_ids,
                    }],
                    usage,
                    prompt_token_ids: None,
                })
            }
        };
        Sse::default().data(v.unwrap_or_else(|e| format!("{{\"error\":\"encoding: {e}\"}}")))
    }

    /// The last chunk of a stream with `include_usage`: no choices, the usage.
    fn usage_chunk(&self, f: &Finished) -> Sse {
        let usage = Some(Some(usage(f)));
        let v = match self.kind {
            Kind::Chat => serde_json::to_string(&ChatChunk {
                head: self.head("chat.completion.chunk"),
                choices: Vec::new(),
                usage,
            }),
            Kind::Completion => serde_json::to_string(&Completion {
                head: self.head("text_completion"),
                choices: Vec::new(),
                usage,
                prompt_token_ids: None,
            }),
        };
        Sse::default().data(v.unwrap_or_default())
    }

    /// The answer as server-sent events. The stream owns the router's events: dropping it
    /// (the client went away) cancels the request on every node.
    fn stream(
        self,
        first: Event,
        events: Events,
    ) -> impl Stream<Item = Result<Sse, Infallible>> + Send + 'static {
        let mut me = self;
        let mut out: Vec<Sse> = Vec::new();
        if me.kind == Kind::Chat {
            out.push(me.chunk(Some(String::new()), &[], &[], None, true));
        }
        struct St {
            me: Answer,
            events: Events,
            queued: std::collections::VecDeque<Sse>,
            first: Option<Event>,
            done: bool,
        }
        let st = St { me, events, queued: out.into(), first: Some(first), done: false };
        stream::unfold(st, |mut st| async move {
            loop {
                if let Some(ev) = st.queued.pop_front() {
                    return Some((Ok(ev), st));
                }
                if st.done {
                    return None;
                }
                match next_event(&mut st.first, &mut st.events).await {
                    Ok(Event::Started { .. }) => {}
                    Ok(Event::Delta { text, tokens, logprobs }) => {
                        let c = st.me.chunk(Some(text), &tokens, &logprobs, None, false);
                        st.queued.push_back(c);
                    }
                    Ok(Event::Finished(f)) => {
                        let reason = Some(finish_reason(f.reason));
                        let c = match st.me.kind {
                            Kind::Chat => st.me.chunk(None, &[], &[], reason, false),
                            Kind::Completion => {
                                st.me.chunk(Some(String::new()), &[], &[], reason, false)
                            }
                        };
                        st.queued.push_back(c);
                        if st.me.plan.include_usage {
                            st.queued.push_back(st.me.usage_chunk(&f));
                        }
                        st.queued.push_back(Sse::default().data("[DONE]"));
                        st.done = true;
                    }
                    Err(e) => {
                        // Mid-stream, the status line is long gone: the error object is the
                        // last event (the SDK raises it).
                        let body = serde_json::to_string(&e.body()).unwrap_or_default();
                        st.queued.push_back(Sse::default().data(body));
                        st.done = true;
                    }
                }
            }
        })
    }
}
