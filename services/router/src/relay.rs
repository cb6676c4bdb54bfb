//! One request's life on the router: queued → prefilling → transferring → decoding →
//! finished / cancelled / failed. Each phase has a deadline, each failure becomes a status that
//! names the node, and a failure before the first token reaches the client is retried once on
//! other nodes. Dropping the relay (the client left) drops both legs' streams, which aborts
//! them on their nodes, and releases a reservation nobody attached to.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_common::convert::{ms, sampler_state};
use pdmesh_common::status::{exhausted, from_peer};
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{
    DecodeRequest, Delta, FinishReason, Finished, GenerateResponse, PrefillRequest, ReleaseRequest,
    ReserveRequest, Started, Timings, Usage, decode_event, decode_request, generate_response,
    prefill_event,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Status, Streaming};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use pdmesh_common::trace;

use crate::mesh::Mesh;
use crate::placement::{Ask, PlaceError, PrefillPolicy, place};
use crate::registry::Node;
use crate::request::Prepared;

pub type ClientTx = mpsc::Sender<Result<GenerateResponse, Status>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queued,
    Prefilling,
    Transferring,
    Decoding,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Queued => "queued",
            Phase::Prefilling => "prefilling",
            Phase::Transferring => "transferring",
            Phase::Decoding => "decoding",
        }
    }
}

/// Where the request stands, for deadline messages and retries.
#[derive(Debug)]
struct State {
    phase: Phase,
    node: String,
    first_sent: bool,
    timings: Timings,
    /// Prompt tokens the prefill node took from the prefix cache.
    cached_tokens: u32,
}

/// A failed attempt: the status, the node that failed (if one did) and whether a retry
/// elsewhere makes sense.
struct Failure {
    status: Status,
    node: Option<String>,
    retry: bool,
}

impl Failure {
    fn from_node(node: &str, s: &Status, first_sent: bool) -> Self {
        let status = from_peer(node, s);
        let retry =
            !first_sent && matches!(status.code(), Code::Unavailable | Code::ResourceExhausted);
        Self { status, node: Some(node.to_string()), retry }
    }
}

fn with_timeout<T>(msg: T, until: Instant) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
    r
}

/// Runs a checked request to its end, sending everything to `out`.
pub async fn run(
    mesh: Arc<Mesh>,
    id: String,
    prep: Prepared,
    deadline: Instant,
    out: ClientTx,
    cancel: CancellationToken,
) {
    let t0 = Instant::now();
    let root = Span::current();
    let started = Started {
        request_id: id.clone(),
        prompt_tokens: prep.prompt.len() as u32,
        trace_id: trace::trace_id().unwrap_or_default(),
    };
    let msg = GenerateResponse { event: Some(generate_response::Event::Started(started)) };
    if out.send(Ok(msg)).await.is_err() {
        return;
    }
    let state = Mutex::new(State {
        phase: Phase::Queued,
        node: String::new(),
        first_sent: false,
        timings: Timings::default(),
        cached_tokens: 0,
    });
    let attempts = async {
        let mut exclude: Vec<String> = Vec::new();
        let mut attempt = 1u32;
        loop {
            state.lock().expect("state lock").timings.attempts = attempt;
            match one_attempt(&mesh, &id, &prep, deadline, &out, &state, t0, &exclude).await {
                Ok(()) => return Ok(()),
                Err(f) => {
                    let failed = f.node.clone();
                    if let Some(n) = &failed
                        && f.status.code() == Code::Unavailable
                    {
                        mesh.registry().suspect(n, Instant::now());
                    }
                    let again = f.retry && attempt < 2 && failed.is_some();
                    if !again {
                        return Err(f.status);
                    }
                    tracing::warn!(
                        request = id,
                        "attempt {attempt} failed ({}); retrying on other nodes",
                        f.status.message()
                    );
                    exclude.extend(failed);
                    // Only retry when some other node can take it.
                    let prefill = mesh.live(pdmesh_proto::v1::Role::Prefill);
                    let ask = ask_of(&mesh, &prep, &prefill);
                    if place(&prefill, &mesh.live(pdmesh_proto::v1::Role::Decode), &ask, &exclude)
                        .is_err()
                    {
                        return Err(f.status);
                    }
                    attempt += 1;
                    let mut s = state.lock().expect("state lock");
                    s.phase = Phase::Queued;
                    s.node.clear();
                }
            }
        }
    };
    let result = tokio::select! {
        r = attempts => r,
        () = out.closed() => {
            mesh.metrics.abandoned();
            tracing::info!(request = id, "client went away; aborting both legs");
            return;
        }
        () = cancel.cancelled() => {
            let mut timings = state.lock().expect("state lock").timings.clone();
            timings.total_ms = ms(t0.elapsed());
            let fin = Finished {
                reason: FinishReason::Cancelled as i32,
                usage: Some(Usage { prompt_tokens: prep.prompt.len() as u32, ..Default::default() }),
                timings: Some(timings),
            };
            if let Some(t) = &fin.timings {
                mesh.metrics.finished(fin.reason, t, prep.prompt.len() as u32, 0, 0);
                finished_attrs(&root, fin.reason, 0, t);
            }
            let _ = out.send(Ok(GenerateResponse { event: Some(generate_response::Event::Finished(fin)) })).await;
            return;
        }
        () = tokio::time::sleep_until(deadline.into()) => {
            let s = state.lock().expect("state lock");
            let at = if s.node.is_empty() { String::new() } else { format!(" on node {}", s.node) };
            Err(Status::deadline_exceeded(format!("deadline passed while {}{at}", s.phase.name())))
        }
    };
    if let Err(s) = result {
        mesh.metrics.failed(s.code());
        tracing::warn!(request = id, code = ?s.code(), "request failed: {}", s.message());
        let _ = out.send(Err(s)).await;
    }
}

/// What the request's root span says about how it ended.
fn finished_attrs(root: &Span, reason: i32, completion_tokens: u32, t: &Timings) {
    if root.is_disabled() {
        return; // nothing is exported: skip the copies
    }
    let reason = FinishReason::try_from(reason).unwrap_or(FinishReason::Unspecified);
    trace::attr(root, "finish_reason", reason.as_str_name());
    trace::attr(root, "completion_tokens", i64::from(completion_tokens));
    trace::attr(root, "attempts", i64::from(t.attempts));
    trace::attr(root, "prefill_node", t.prefill_node.clone());
    trace::attr(root, "decode_node", t.decode_node.clone());
    trace::attr(root, "kv_transport", t.kv_transport.clone());
    trace::attr(root, "kv_bytes", t.kv_bytes as i64);
    trace::attr(root, "ttft_ms", t.ttft_ms);
}

fn ask_of(mesh: &Mesh, prep: &Prepared, prefill: &[Node]) -> Ask {
    let cfg = &mesh.config;
    let matched = if cfg.prefill_policy == PrefillPolicy::PrefixAware {
        mesh.prefixes.matched(prefill, &prep.prompt)
    } else {
        Default::default()
    };
    Ask {
        prompt_tokens: prep.prompt.len(),
        max_tokens: prep.max_tokens,
        colocate_below: cfg.colocate_below_tokens,
        policy: cfg.prefill_policy,
        turn: mesh.next_turn(),
        matched,
        max_imbalance: cfg.prefix_max_imbalance,
    }
}

/// Undoes the router-side load accounting when an attempt ends.
struct Assigned<'a> {
    mesh: &'a Mesh,
    nodes: Vec<String>,
}

impl Drop for Assigned<'_> {
    fn drop(&mut self) {
        let mut r = self.mesh.registry();
        for n in &self.nodes {
            r.unassign(n);
        }
    }
}

/// Releases a reservation on drop unless a decode stream took it over.
struct Reservation {
    client: DecodeClient<trace::Channel>,
    id: String,
    armed: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.armed {
            let mut c = self.client.clone();
            let id = self.id.clone();
            let release = async move {
                let mut r = Request::new(ReleaseRequest { reservation_id: id });
                r.set_timeout(Duration::from_secs(5));
                // If the node is gone, so is the reservation; its lease covers the rest.
                let _ = c.release(r).await;
            };
            tokio::spawn(release.in_current_span());
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn one_attempt(
    mesh: &Mesh,
    id: &str,
    prep: &Prepared,
    deadline: Instant,
    out: &ClientTx,
    state: &Mutex<State>,
    t0: Instant,
    exclude: &[String],
) -> Result<(), Failure> {
    use pdmesh_proto::v1::Role;
    let cfg = &mesh.config;
    let prefills = mesh.live(Role::Prefill);
    let span = pdmesh_common::span!(
        "router.placement",
        policy = %cfg.prefill_policy,
        attempt = exclude.len() as i64 + 1,
        prefill_nodes = prefills.len() as i64,
        prefill_node = Empty,
        decode_node = Empty,
        matched_tokens = Empty,
    );
    let ask = span.in_scope(|| ask_of(mesh, prep, &prefills));
    let placed = span.in_scope(|| place(&prefills, &mesh.live(Role::Decode), &ask, exclude));
    if let Ok(p) = &placed {
        span.record("decode_node", p.decode.as_str());
        let prefill = p.prefill.as_deref().unwrap_or("colocated");
        span.record("prefill_node", prefill);
        let matched = ask.matched.get(prefill).copied().unwrap_or(0);
        span.record("matched_tokens", matched as i64);
    }
    let placement = placed.map_err(|e| {
        let status = match e {
            PlaceError::NoDecodeNode => Status::unavailable(e.to_string()),
            PlaceError::NoCapacity { .. } => {
                exhausted(e.to_string(), Duration::from_millis(cfg.retry_after_ms))
            }
        };
        trace::fail(&span, &status);
        Failure { status, node: None, retry: false }
    })?;
    drop(span);
    let decode = mesh.node(&placement.decode).ok_or_else(|| Failure {
        status: Status::unavailable(format!("node {} left the mesh", placement.decode)),
        node: None,
        retry: false,
    })?;
    let prefill = match &placement.prefill {
        Some(p) => Some(mesh.node(p).ok_or_else(|| Failure {
            status: Status::unavailable(format!("node {p} left the mesh")),
            node: None,
            retry: false,
        })?),
        None => None,
    };
    let blocks = crate::placement::blocks_needed(&decode, &ask) as u32;
    {
        let mut r = mesh.registry();
        r.assign(&decode.id, blocks);
        if let Some(p) = &prefill {
            r.assign(&p.id, 0);
        }
    }
    if let Some(p) = &prefill {
        mesh.prefixes.record(p, &prep.prompt);
    }
    let _decode_assigned = Assigned { mesh, nodes: vec![decode.id.clone()] };
    // The prefill node's share ends with its part (the KV is complete), not the request's.
    let prefill_assigned = Assigned { mesh, nodes: prefill.iter().map(|p| p.id.clone()).collect() };
    let first_sent = || state.lock().expect("state lock").first_sent;
    let watched: Vec<String> =
        std::iter::once(decode.id.clone()).chain(prefill.iter().map(|p| p.id.clone())).collect();
    let legs = async {
        let dfail = |s: &Status| Failure::from_node(&decode.id, s, first_sent());
        let channel = |addr: &str, node: &str| {
            mesh.channel(addr).map_err(|e| Failure {
                status: Status::unavailable(format!("node {node}: {e}")),
                node: Some(node.to_string()),
                retry: true,
            })
        };
        let mut dclient = DecodeClient::new(channel(&decode.address, &decode.id)?);
        {
            let mut s = state.lock().expect("state lock");
            s.node = decode.id.clone();
            s.timings.decode_node = decode.id.clone();
            // A retry starts over: what an earlier attempt took from the cache is not what
            // this one does.
            s.cached_tokens = 0;
        }

        // Reserve the KV blocks on the decode node.
        let call_until =
            deadline.min(Instant::now() + Duration::from_millis(cfg.node_call_timeout_ms));
        let reserve = ReserveRequest {
            request_id: id.to_string(),
            prompt_tokens: prep.prompt.len() as u32,
            max_tokens: prep.max_tokens as u32,
            lease_ms: cfg.lease_ms,
            remote_kv: prefill.is_some(),
        };
        let target = tokio::time::timeout_at(
            call_until.into(),
            dclient.reserve(with_timeout(reserve, call_until)),
        )
        .await
        .map_err(|_| dfail(&Status::unavailable("no answer to Reserve in time")))?
        .map_err(|s| dfail(&s))?
        .into_inner()
        .target
        .ok_or_else(|| dfail(&Status::internal("Reserve answered without a target")))?;
        let mut reservation =
            Reservation { client: dclient.clone(), id: target.reservation_id.clone(), armed: true };

        let sampler = |pos| Some(sampler_state(&prep.sampling, pos));
        let start = if let Some(p) = &prefill {
            {
                let mut s = state.lock().expect("state lock");
                s.phase = Phase::Prefilling;
                s.node = p.id.clone();
                s.timings.prefill_node = p.id.clone();
            }
            let pfail = |s: &Status| Failure::from_node(&p.id, s, false);
            let mut pclient = PrefillClient::new(channel(&p.address, &p.id)?);
            let req = PrefillRequest {
                request_id: id.to_string(),
                prompt: prep.prompt.clone(),
                sampler: sampler(0),
                target: Some(target.clone()),
            };
            let queued_at_router = t0.elapsed();
            let mut events: Streaming<_> = pclient
                .prefill(with_timeout(req, deadline))
                .await
                .map_err(|s| pfail(&s))?
                .into_inner();
            // Until the first token: bounded by the request deadline (the caller's select).
            let computed = match events.message().await.map_err(|s| pfail(&s))? {
                Some(pdmesh_proto::v1::PrefillEvent {
                    event: Some(prefill_event::Event::Computed(c)),
                }) => c,
                _ => {
                    return Err(pfail(&Status::unavailable(
                        "prefill stream ended before the first token",
                    )));
                }
            };
            {
                let mut s = state.lock().expect("state lock");
                s.phase = Phase::Transferring;
                s.timings.queue_ms = ms(queued_at_router) + computed.queue_ms;
                s.timings.prefill_ms = computed.prefill_ms;
                s.cached_tokens = computed.cached_tokens;
            }
            let until =
                deadline.min(Instant::now() + Duration::from_millis(cfg.transfer_timeout_ms));
            let transferred = tokio::time::timeout_at(until.into(), events.message())
                .await
                .map_err(|_| pfail(&Status::unavailable("KV transfer did not complete in time")))?
                .map_err(|s| pfail(&s))?;
            match transferred {
                Some(pdmesh_proto::v1::PrefillEvent {
                    event: Some(prefill_event::Event::Transferred(t)),
                }) => {
                    let mut s = state.lock().expect("state lock");
                    s.timings.transfer_ms = t.transfer_ms;
                    s.timings.kv_bytes = t.bytes;
                    s.timings.kv_transport = t.transport;
                }
                _ => {
                    return Err(pfail(&Status::unavailable(
                        "prefill stream ended before the KV was complete",
                    )));
                }
            }
            drop(prefill_assigned);
            let pos = pdmesh_common::convert::rng_position(&computed.rng_position)
                .map_err(|s| pfail(&s))?;
            (decode_request::Start::FirstToken(computed.first_token), pos)
        } else {
            let mut s = state.lock().expect("state lock");
            s.timings.prefill_node = "colocated".into();
            s.timings.kv_transport = "local".into();
            (decode_request::Start::PrefillLocally(true), 0)
        };

        // Decode: attach to the reservation and relay its stream.
        {
            let mut s = state.lock().expect("state lock");
            s.phase = Phase::Decoding;
            s.node = decode.id.clone();
        }
        let req = DecodeRequest {
            reservation_id: target.reservation_id.clone(),
            prompt: prep.prompt.clone(),
            sampler: sampler(start.1),
            max_tokens: prep.max_tokens as u32,
            stop: prep.stop.clone(),
            ignore_eos: prep.ignore_eos,
            start: Some(start.0),
        };
        let mut stream =
            dclient.decode(with_timeout(req, deadline)).await.map_err(|s| dfail(&s))?.into_inner();
        // The stream owns the reservation now: dropping it cancels the request on the node.
        reservation.armed = false;
        let stall = Duration::from_millis(cfg.stall_timeout_ms);
        loop {
            let ev = tokio::time::timeout(stall, stream.message())
                .await
                .map_err(|_| dfail(&Status::unavailable(format!("no token for {stall:?}"))))?
                .map_err(|s| dfail(&s))?;
            let Some(ev) = ev else {
                return Err(dfail(&Status::unavailable("decode stream ended without a finish")));
            };
            match ev.event {
                Some(decode_event::Event::Delta(Delta { text, token_ids })) => {
                    {
                        let mut s = state.lock().expect("state lock");
                        if !s.first_sent {
                            s.first_sent = true;
                            s.timings.ttft_ms = ms(t0.elapsed());
                        }
                    }
                    let msg = GenerateResponse {
                        event: Some(generate_response::Event::Delta(Delta { text, token_ids })),
                    };
                    if out.send(Ok(msg)).await.is_err() {
                        return Ok(());
                    }
                }
                Some(decode_event::Event::Finished(f)) => {
                    let timings = {
                        let mut s = state.lock().expect("state lock");
                        if prefill.is_none() {
                            s.timings.queue_ms = f.queue_ms;
                            s.timings.prefill_ms = f.prefill_ms;
                        }
                        if !s.first_sent {
                            s.timings.ttft_ms = ms(t0.elapsed());
                        }
                        (s.timings.clone(), s.cached_tokens)
                    };
                    let (mut timings, cached_tokens) = timings;
                    timings.total_ms = ms(t0.elapsed());
                    mesh.metrics.finished(
                        f.reason,
                        &timings,
                        prep.prompt.len() as u32,
                        cached_tokens,
                        f.completion_tokens,
                    );
                    let root = Span::current();
                    finished_attrs(&root, f.reason, f.completion_tokens, &timings);
                    trace::attr(&root, "cached_tokens", i64::from(cached_tokens));
                    let fin = Finished {
                        reason: f.reason,
                        usage: Some(Usage {
                            prompt_tokens: prep.prompt.len() as u32,
                            cached_tokens,
                            completion_tokens: f.completion_tokens,
                        }),
                        timings: Some(timings),
                    };
                    let _ = out
                        .send(Ok(GenerateResponse {
                            event: Some(generate_response::Event::Finished(fin)),
                        }))
                        .await;
                    return Ok(());
                }
                None => return Err(dfail(&Status::internal("empty decode event"))),
            }
        }
    };
    // A node that stops heartbeating (hung, partitioned, killed) fails the attempt as soon as
    // the router drops it, rather than when a TCP or HTTP/2 timeout notices.
    tokio::select! {
        r = legs => r,
        gone = node_dropped(mesh, &watched) => {
            Err(Failure {
                status: Status::unavailable(format!("node {gone} stopped heartbeating and left the mesh")),
                node: Some(gone),
                retry: !first_sent(),
            })
        }
    }
}

/// Completes with the id of the first of `nodes` that is no longer registered.
async fn node_dropped(mesh: &Mesh, nodes: &[String]) -> String {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        let reg = mesh.registry();
        if let Some(n) = nodes.iter().find(|n| reg.get(n).is_none()) {
            return n.clone();
        }
    }
}
