//! One attempt at a request on the nodes placement chose: reserve its KV on the decode node,
//! have the prefill node compute it (or the decode node, colocated) and push its KV, then
//! relay the decode node's stream. Each step returns a typed `Failure`; whether to try again
//! elsewhere is decided once, by the caller, from it. Every wait is bounded by the request's
//! deadline, its cancellation, its client, and the nodes it runs on: one that leaves the mesh
//! fails the attempt at once, through its cancellation token.

use std::collections::VecDeque;
use std::future::Future;
use std::time::{Duration, Instant};

use pdmesh_common::convert::ms;
use pdmesh_common::trace;
use pdmesh_model::TokenLogprobs;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{
    DecodeRequest, HandOffRequest, KvTarget, PrefillRequest, ReleaseRequest, ReserveRequest, Role,
    decode_event, decode_request, prefill_event,
};
use pdmesh_wire::{logprobs_from_wire, sampler_state};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::{Instrument, Span};

use crate::api::{Event, Timings};
use crate::coalesce::Coalesce;
use crate::config::RouterConfig;
use pdmesh_kv_types::BlockHash;

use crate::error::RequestError;
use crate::mesh::Mesh;
use crate::placement::{Ask, blocks_needed, place};
use crate::registry::Node;
use crate::request::Prepared;

mod failure;
pub(crate) use failure::{Failure, Phase, failure_text};

/// What every attempt of one request shares.
pub(crate) struct Request<'a> {
    pub mesh: &'a Mesh,
    pub id: &'a str,
    pub prep: &'a Prepared,
    /// The tenant it runs for: what a cancel names, with its id.
    pub owner: &'a str,
    /// The tenant's prefix-cache space.
    pub salt: [u8; 16],
    /// The prompt's block chain, hashed once.
    pub chain: crate::index::ChainCache,
    pub deadline: Instant,
    pub t0: Instant,
    pub out: &'a mpsc::Sender<Result<Event, RequestError>>,
    pub cancel: &'a CancellationToken,
}

impl Request<'_> {
    /// The prompt's chain under `layout`.
    pub(crate) fn chain(&self, layout: &pdmesh_kv_types::KvLayout) -> std::sync::Arc<[BlockHash]> {
        self.chain.get(layout, &self.salt, &self.prep.prompt)
    }

    /// Sends an event to the client, which gets `client_stall_ms` to make room: one that
    /// reads nothing for that long has stopped reading (an SSE client that never consumes
    /// its stream), and is treated as gone rather than holding its place and its KV until
    /// the deadline.
    pub(crate) async fn to_client(&self, ev: Result<Event, RequestError>) -> Result<(), Failure> {
        let most = Duration::from_millis(self.mesh.config.client_stall_ms);
        match tokio::time::timeout(most, self.out.send(ev)).await {
            Ok(sent) => sent.map_err(|_| Failure::Abandoned),
            Err(_) => {
                tracing::warn!(request = self.id, "the client read nothing for {most:?}; ended");
                Err(Failure::Abandoned)
            }
        }
    }
}

/// What the request has learned so far: its timings, and where its stream stands.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub timings: Timings,
    /// Prompt tokens the prefill node took from the prefix cache.
    pub cached_tokens: u32,
    pub first_sent: bool,
    /// Where the client's stream stands: what a migrated request continues from.
    pub resume: Resume,
    /// Logprob reports (when asked for) of tokens generated but not yet sent in a delta, in
    /// order: text lags tokens, so a report waits here until its token's text goes out.
    pub logprobs: VecDeque<TokenLogprobs>,
    /// Leading the computation of its prompt's new blocks: held until they are computed.
    pub leading: Option<crate::coalesce::Lead>,
}

impl Report {
    /// A delta for the client, with the reports of its tokens.
    pub fn delta(&mut self, text: String, tokens: Vec<u32>) -> Event {
        let n = tokens.len().min(self.logprobs.len());
        Event::Delta { text, tokens, logprobs: self.logprobs.drain(..n).collect() }
    }
}

/// Every token generated up to the last output the client was sent (text can lag them), and
/// the sampler's random stream after them: with the prompt, all a decode node needs to
/// continue the request exactly there.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Resume {
    pub tokens: Vec<u32>,
    pub rng_position: u128,
}

/// How decoding ended: the decode node's finish.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub reason: pdmesh_model::FinishReason,
    pub completion_tokens: u32,
}

/// Output tokens a decode reservation promises up front (`RouterConfig::reserve_tokens`): the
/// `resumed` ones a moved or preempted stream recomputes there, and that many more; None (all
/// of `max_tokens`) when reservations do not grow.
pub(crate) fn up_front(cfg: &RouterConfig, max_tokens: usize, resumed: usize) -> Option<usize> {
    match cfg.reserve_tokens {
        0 => None,
        n => Some((resumed + n).min(max_tokens)),
    }
}

/// Releases a reservation on drop unless a decode stream took it over.
struct Reservation {
    client: DecodeClient<trace::Channel>,
    target: KvTarget,
    /// When the node frees it by itself.
    lapses: Instant,
    armed: bool,
}

/// How long one Release may take, and the pause before it is sent again.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
const RELEASE_RETRY: Duration = Duration::from_secs(1);

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.armed {
            let mut c = self.client.clone();
            let (id, lapses) = (self.target.reservation_id.clone(), self.lapses);
            // A node that cannot be reached now (hung, cut off) is sent the release again until
            // it answers, so its blocks come back as soon as it does rather than at the lease's
            // end; a node that is gone took the reservation with it.
            let release = async move {
                loop {
                    let mut r = tonic::Request::new(ReleaseRequest { reservation_id: id.clone() });
                    r.set_timeout(RELEASE_TIMEOUT);
                    match c.release(r).await {
                        Ok(_) => return,
                        Err(s)
                            if !matches!(
                                s.code(),
                                Code::Unavailable | Code::DeadlineExceeded | Code::Unknown
                            ) =>
                        {
                            return;
                        }
                        Err(_) if Instant::now() + RELEASE_RETRY >= lapses => return,
                        Err(_) => tokio::time::sleep(RELEASE_RETRY).await,
                    }
                }
            };
            tokio::spawn(release.in_current_span());
        }
    }
}

/// Undoes the router-side load accounting of a node when its part of the attempt ends.
struct Assigned<'a> {
    mesh: &'a Mesh,
    node: String,
    tokens: u64,
}

impl<'a> Assigned<'a> {
    /// `blocks` reserved on a decode node, or `tokens` of prompt for a prefill node to compute.
    fn new(mesh: &'a Mesh, node: &Node, blocks: u32, tokens: u64) -> Self {
        mesh.registry().assign(&node.id, blocks, tokens);
        Self { mesh, node: node.id.clone(), tokens }
    }
}

impl Drop for Assigned<'_> {
    fn drop(&mut self) {
        self.mesh.registry().unassign(&self.node, self.tokens);
    }
}

fn with_timeout<T>(msg: T, until: Instant) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
    r
}

/// One attempt on a decode node and, unless colocated, a prefill node.
pub(crate) struct Attempt<'a> {
    pub req: &'a Request<'a>,
    pub report: &'a mut Report,
    pub decode: Node,
    pub prefill: Option<Node>,
    /// Blocks the decode node was counted for.
    pub blocks: u32,
    /// Prompt tokens the prefill node is expected to compute (the index's hits left out).
    pub prefill_tokens: u32,
}

impl<'a> Attempt<'a> {
    /// Waits for `fut`, or fails when the deadline passes (in `phase` on `node`), the request
    /// is cancelled, its client leaves, or one of `watched` leaves the mesh.
    async fn bounded<T>(
        &self,
        phase: Phase,
        node: &Node,
        watched: &[&Node],
        fut: impl Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        tokio::select! {
            // What a node already sent counts, even if it left since: relayed first, a moved
            // stream resumes as late as it can (and a reply that is there is not discarded).
            biased;
            r = fut => r,
            () = tokio::time::sleep_until(self.req.deadline.into()) => {
                Err(Failure::Deadline { phase, node: Some(node.id.clone()) })
            }
            () = self.req.cancel.cancelled() => Err(Failure::Cancelled),
            () = self.req.out.closed() => Err(Failure::Abandoned),
            gone = first_to_leave(watched) => Err(Failure::lost(
                &gone,
                "left the mesh (deregistered, or its heartbeats stopped)",
            )),
        }
    }

    /// Runs the attempt to the decode node's finish.
    pub async fn run(mut self) -> Result<Decoded, Failure> {
        let mesh = self.req.mesh;
        let decode = self.decode.clone();
        let assigned = Assigned::new(mesh, &decode, self.blocks, 0);
        let client = DecodeClient::new(channel(mesh, &decode)?);
        self.report.timings.decode_node = decode.id.clone();
        // A retry starts over: what an earlier attempt took from the cache is not what this one
        // does. A moved stream keeps the account of its prompt.
        if !self.report.first_sent {
            self.report.cached_tokens = 0;
        }
        let prep = self.req.prep;
        let resumed = self.report.resume.tokens.len();
        let up = up_front(&mesh.config, prep.max_tokens, resumed);
        let ask = (prep.prompt.len(), prep.max_tokens, up);
        let reservation = self.reserve(&client, &decode, ask, self.prefill.is_some()).await?;
        let (start, rng_position) = match self.prefill.clone() {
            Some(p) => {
                let p = self.coalesce(p, reservation.lapses).await?;
                self.prefill(&p, &reservation.target).await?
            }
            None => {
                self.report.timings.prefill_node = "colocated".into();
                self.report.timings.kv_transport = "local".into();
                (decode_request::Start::PrefillLocally(true), 0)
            }
        };
        let mut leg =
            Leg { node: decode, client, reservation, start, rng_position, _assigned: assigned };
        loop {
            match self.relay(leg).await? {
                Relayed::Finished(d) => return Ok(d),
                Relayed::Moved(next) => leg = *next,
            }
        }
    }

    /// In-flight prefix coalescing (`coalesce.rs`), as the prompt is about to go to prefill
    /// node `p`: while another request's prefill computes leading blocks of this prompt that
    /// no prefill node held when it started, waits for it, then prefills on the node that
    /// computed them (they are in its cache) instead of `p`. Otherwise leads the blocks it
    /// computes itself (`report.leading`) for later prompts to wait on. The wait ends by
    /// `coalesce_wait_ms`, half of what is left of the deadline or of the reservation's lease.
    async fn coalesce(&mut self, p: Node, lease_lapses: Instant) -> Result<Node, Failure> {
        let req = self.req;
        let mesh = req.mesh;
        // What an earlier attempt led is over: it must not wait on itself.
        self.report.leading = None;
        let wait = mesh.config.coalesce_wait_ms;
        if wait == 0 || !p.load.publishes {
            return Ok(p);
        }
        let t0 = Instant::now();
        let half = |until: Instant| until.saturating_duration_since(t0) / 2;
        let until =
            t0 + half(req.deadline).min(half(lease_lapses)).min(Duration::from_millis(wait));
        let mut on = p;
        let mut waited = false;
        loop {
            // The same exact index placement reads: blocks some prefill node can take from a
            // cache are not led, and not waited for.
            let c = (on.layout, req.chain(&on.layout));
            let held = {
                let reg = mesh.registry();
                let prefills = reg.live_refs(Role::Prefill, Instant::now());
                let hits = crate::relay::hits_of(mesh, req.prep.prompt.len(), &c, &prefills);
                hits.values().map(|h| h.total()).max().unwrap_or(0)
            };
            let next = mesh.computing.lead_or_follow(&on.layout, &c.1, held);
            let (mut leader, tokens) = match next {
                None => break,
                Some(Coalesce::Lead(l)) => {
                    self.report.leading = Some(l);
                    break;
                }
                Some(Coalesce::Follow { leader, tokens }) => (leader, tokens),
            };
            if Instant::now() >= until {
                break;
            }
            if !std::mem::replace(&mut waited, true) {
                mesh.metrics.coalesced();
                tracing::debug!(request = req.id, tokens, "waiting for a prefix being computed");
            }
            tokio::select! {
                _ = leader.changed() => {}
                () = tokio::time::sleep_until(until.into()) => break,
                () = req.cancel.cancelled() => return Err(Failure::Cancelled),
                () = req.out.closed() => return Err(Failure::Abandoned),
            }
            // Where the leader computed it: its own cache holds the blocks for certain.
            let computed_on = leader.borrow().clone();
            if let Some(n) = computed_on.and_then(|id| mesh.registry().get(&id).cloned())
                && n.load.cache_blocks > 0
                && !n.load.draining
            {
                on = n;
            }
        }
        if waited {
            trace::attr(&Span::current(), "coalesce_wait_ms", ms(t0.elapsed()));
        }
        Ok(on)
    }

    /// Reserves KV blocks on decode node `d` for `(prompt_tokens, max_tokens, up_front)`
    /// (`Ask`); with `remote_kv` the prompt's blocks are allocated for a transport to write
    /// into.
    async fn reserve(
        &self,
        client: &DecodeClient<trace::Channel>,
        d: &Node,
        (prompt_tokens, max_tokens, up_front): (usize, usize, Option<usize>),
        remote_kv: bool,
    ) -> Result<Reservation, Failure> {
        let req = self.req;
        let cfg = &req.mesh.config;
        let until =
            req.deadline.min(Instant::now() + Duration::from_millis(cfg.node_call_timeout_ms));
        let msg = ReserveRequest {
            request_id: req.id.to_string(),
            prompt_tokens: prompt_tokens as u32,
            max_tokens: max_tokens as u32,
            lease_ms: cfg.lease_ms,
            remote_kv,
            owner: req.owner.to_string(),
            // Never 0 when growing: 0 asks for all of max_tokens.
            reserve_tokens: up_front.map_or(0, |u| u.max(1) as u32),
        };
        let mut c = client.clone();
        let call = async {
            let answer = tokio::time::timeout_at(until.into(), c.reserve(with_timeout(msg, until)))
                .await
                .map_err(|_| Failure::lost(&d.id, "no answer to Reserve in time"))?
                .map_err(|s| Failure::from_node(&d.id, &s))?;
            let answer = answer.into_inner();
            let lease = Duration::from_millis(u64::from(answer.lease_ms));
            let target = answer.target.ok_or_else(|| {
                Failure::from_node(&d.id, &Status::internal("Reserve answered without a target"))
            })?;
            Ok((target, lease))
        };
        let (target, lease) = self.bounded(Phase::Queued, d, &[d], call).await?;
        let lapses = Instant::now() + lease;
        Ok(Reservation { client: client.clone(), target, lapses, armed: true })
    }

    /// Has the prefill node compute the prompt and push its KV into the reservation; returns
    /// how decoding starts (the first token and the sampler's position).
    async fn prefill(
        &mut self,
        p: &Node,
        target: &KvTarget,
    ) -> Result<(decode_request::Start, u128), Failure> {
        let req = self.req;
        let cfg = &req.mesh.config;
        // The prefill node's share ends with its part (the KV is complete), not the request's.
        let _assigned = Assigned::new(req.mesh, p, 0, u64::from(self.prefill_tokens));
        // A moved stream's prompt is prefilled as it was the first time (and its first token
        // sampled again); the decode node recomputes the rest as it was first computed.
        let chain = req.chain(&p.layout);
        req.mesh.index.sent(&p.id, &chain, p.load.cache_blocks as usize);
        self.report.timings.prefill_node = p.id.clone();
        let mut client = PrefillClient::new(channel(req.mesh, p)?);
        let msg = PrefillRequest {
            request_id: req.id.to_string(),
            prompt: req.prep.prompt.clone(),
            sampler: Some(sampler_state(&req.prep.sampling, 0)),
            cache_salt: bytes::Bytes::copy_from_slice(&req.salt),
            target: Some(target.clone()),
        };
        let queued_at_router = req.t0.elapsed();
        if !self.report.first_sent {
            req.mesh.metrics.dispatched(queued_at_router.as_secs_f64());
        }
        let watched = [p, &self.decode];
        // The prefill node losing the decode node is the decode node's failure: the retry
        // must avoid it, not the prefill node.
        let d = &self.decode.id;
        let fail = |s: &Status| match pdmesh_common::status::lost_peer(s) {
            Some(lost) if lost == d => Failure::lost(d, s.message()),
            _ => Failure::from_node(&p.id, s),
        };
        let opened =
            async { client.prefill(with_timeout(msg, req.deadline)).await.map_err(|s| fail(&s)) };
        let mut events = self.bounded(Phase::Prefilling, p, &watched, opened).await?.into_inner();
        let first = async {
            match events.message().await.map_err(|s| fail(&s))? {
                Some(pdmesh_proto::v1::PrefillEvent {
                    event: Some(prefill_event::Event::Computed(c)),
                }) => Ok(c),
                _ => Err(Failure::lost(&p.id, "prefill stream ended before the first token")),
            }
        };
        let computed = self.bounded(Phase::Prefilling, p, &watched, first).await?;
        // The prompt is in the node's cache: those waiting for its blocks may go there.
        if let Some(l) = self.report.leading.take() {
            l.computed_on(&p.id);
        }
        if !self.report.first_sent {
            let t = &mut self.report.timings;
            t.queue_ms = ms(queued_at_router) + computed.queue_ms;
            t.prefill_ms = computed.prefill_ms;
            self.report.cached_tokens = computed.cached_tokens;
        }
        let until =
            req.deadline.min(Instant::now() + Duration::from_millis(cfg.transfer_timeout_ms));
        let transferred = async {
            let next = tokio::time::timeout_at(until.into(), events.message())
                .await
                .map_err(|_| Failure::lost(&p.id, "KV transfer did not complete in time"))?
                .map_err(|s| fail(&s))?;
            match next {
                Some(pdmesh_proto::v1::PrefillEvent {
                    event: Some(prefill_event::Event::Transferred(t)),
                }) => Ok(t),
                _ => Err(Failure::lost(&p.id, "prefill stream ended before the KV was complete")),
            }
        };
        let t = self.bounded(Phase::Transferring, p, &watched, transferred).await?;
        let timings = &mut self.report.timings;
        timings.transfer_ms = t.transfer_ms;
        timings.kv_bytes = t.bytes;
        timings.kv_transport = t.transport;
        // The first token's report; a moved stream's first token went out long ago.
        if self.report.resume.tokens.is_empty() {
            self.report.logprobs.clear();
            self.report.logprobs.extend(computed.logprobs.as_ref().map(logprobs_from_wire));
        }
        let pos = pdmesh_wire::rng_position(&computed.rng_position).map_err(|s| fail(&s))?;
        Ok((decode_request::Start::FirstToken(computed.first_token), pos))
    }

    /// Attaches to the leg's reservation and relays its node's stream to the client until it
    /// finishes, or until the node, draining, handed the request off to the next leg.
    async fn relay(&mut self, mut leg: Leg<'a>) -> Result<Relayed<'a>, Failure> {
        let req = self.req;
        let d = leg.node.clone();
        let fail = |s: &Status| Failure::from_node(&d.id, s);
        let resume = &self.report.resume;
        // A moved stream's sampler continues from where its last node's stood.
        let rng = if resume.tokens.is_empty() { leg.rng_position } else { resume.rng_position };
        // A node that prefills the prompt itself sends nothing until its whole prompt is
        // computed, however long that takes (minutes for a long prompt on a slow node), as a
        // prefill node does: its stream counts as silent only from its first message on.
        let mut prefilling = matches!(leg.start, decode_request::Start::PrefillLocally(true));
        let msg = DecodeRequest {
            reservation_id: leg.reservation.target.reservation_id.clone(),
            prompt: req.prep.prompt.clone(),
            sampler: Some(sampler_state(&req.prep.sampling, rng)),
            max_tokens: req.prep.max_tokens as u32,
            stop: req.prep.stop.clone(),
            ignore_eos: req.prep.ignore_eos,
            start: Some(leg.start),
            resumed: resume.tokens.clone(),
        };
        let mut client = leg.client.clone();
        let opened =
            async { client.decode(with_timeout(msg, req.deadline)).await.map_err(|s| fail(&s)) };
        let mut stream = self.bounded(Phase::Decoding, &d, &[&d], opened).await?.into_inner();
        // The stream owns the reservation now: dropping it cancels the request on the node.
        leg.reservation.armed = false;
        let stall = Duration::from_millis(req.mesh.config.stall_timeout_ms);
        // The text flushed as the request ends goes out with its finish: if the node dies in
        // between, the node the request moves to flushes it again.
        let mut tail: Option<pdmesh_proto::v1::Delta> = None;
        // Where the request goes once its node says it moved.
        let mut next: Option<Leg<'a>> = None;
        loop {
            // Past the deadline `bounded` ends it, whatever the stall bound.
            let bound = if prefilling {
                self.req.deadline.saturating_duration_since(Instant::now())
            } else {
                stall
            };
            let message = async {
                tokio::time::timeout(bound, stream.message())
                    .await
                    .map_err(|_| Failure::lost(&d.id, format!("no token for {stall:?}")))?
                    .map_err(|s| fail(&s))?
                    .ok_or_else(|| Failure::lost(&d.id, "decode stream ended without a finish"))
            };
            let ev = self.bounded(Phase::Decoding, &d, &[&d], message).await?;
            prefilling = false;
            if let Some(mark) = &ev.mark {
                let rng = pdmesh_wire::rng_position(&mark.rng_position).map_err(|s| fail(&s))?;
                self.report.resume.rng_position = rng;
            }
            let marked = ev.mark.map(|m| {
                self.report.logprobs.extend(m.logprobs.iter().map(logprobs_from_wire));
                m.tokens
            });
            match ev.event {
                Some(decode_event::Event::Delta(delta)) => {
                    let Some(tokens) = marked else {
                        tail = Some(delta);
                        continue;
                    };
                    let out = self.report.delta(delta.text, delta.token_ids);
                    if !self.report.first_sent {
                        self.report.first_sent = true;
                        self.report.timings.ttft_ms = ms(req.t0.elapsed());
                    }
                    self.send(&d, out).await?;
                    self.report.resume.tokens.extend(tokens);
                }
                Some(decode_event::Event::Moving(m)) => {
                    self.report.resume.tokens.extend(marked.unwrap_or_default());
                    match self.hand_off(&leg, m.kv_tokens as usize).await {
                        Ok(to) => next = Some(to),
                        Err(why) => {
                            tracing::warn!(request = req.id, node = d.id, "not moved: {why}");
                            self.stay(&leg).await;
                        }
                    }
                }
                Some(decode_event::Event::Moved(_)) => {
                    let to = next.take().ok_or_else(|| {
                        Failure::lost(&d.id, "ended the stream as moved, but nothing took it")
                    })?;
                    return Ok(Relayed::Moved(Box::new(to)));
                }
                Some(decode_event::Event::Finished(f)) => {
                    if let Some(t) = tail.take() {
                        let out = self.report.delta(t.text, t.token_ids);
                        self.send(&d, out).await?;
                    }
                    if self.prefill.is_none() && self.report.timings.migrations == 0 {
                        self.report.timings.queue_ms = f.queue_ms;
                        self.report.timings.prefill_ms = f.prefill_ms;
                    }
                    return Ok(Relayed::Finished(Decoded {
                        reason: pdmesh_wire::finish_from(f.reason),
                        completion_tokens: f.completion_tokens,
                    }));
                }
                None => return Err(fail(&Status::internal("empty decode event"))),
            }
        }
    }

    /// The node of `from` is draining: finds another decode node with room, reserves the
    /// request's KV there, and has `from`'s node push it (`HandOff`). The request then goes on
    /// there from its last token, nothing recomputed. On failure the caller lets it stay.
    async fn hand_off(&mut self, from: &Leg<'a>, kv_tokens: usize) -> Result<Leg<'a>, String> {
        let (req, mesh) = (self.req, self.req.mesh);
        let cfg = &mesh.config;
        let generated = self.report.resume.tokens.len();
        if generated == 0 || kv_tokens + 1 != req.prep.prompt.len() + generated {
            return Err(format!("it holds {kv_tokens} tokens of KV after {generated} generated"));
        }
        // The tokens it holds KV for, and the rest of the request's output but the last.
        let ask = Ask {
            prompt_tokens: kv_tokens,
            max_tokens: req.prep.max_tokens + 1 - generated,
            up_front: up_front(cfg, req.prep.max_tokens + 1 - generated, 0),
            colocate_below: 0,
            colocate_when_prefill_busy: 0,
            policy: cfg.prefill_policy,
            turn: mesh.next_turn(),
            seed: fastrand::u64(..),
            hits: Default::default(),
            store_cost: cfg.kvstore_read_cost,
            max_imbalance: cfg.prefix_max_imbalance,
        };
        let others = std::slice::from_ref(&from.node.id);
        // As placement does: in the registry, under its lock, copying only the node chosen.
        let node = {
            let reg = mesh.registry();
            let decodes = reg.live_refs(Role::Decode, Instant::now());
            let placed = place(&[], &decodes, &ask, others).map_err(|e| e.to_string())?;
            reg.get(&placed.decode).cloned().ok_or("the node chosen left the mesh")?
        };
        let assigned = Assigned::new(mesh, &node, blocks_needed(&node, &ask) as u32, 0);
        let client = DecodeClient::new(channel(mesh, &node).map_err(|f| failure_text(&f))?);
        let reservation = self
            .reserve(&client, &node, (ask.prompt_tokens, ask.max_tokens, ask.up_front), true)
            .await
            .map_err(|f| failure_text(&f))?;
        let until =
            req.deadline.min(Instant::now() + Duration::from_millis(cfg.transfer_timeout_ms));
        let call = HandOffRequest {
            reservation_id: from.reservation.target.reservation_id.clone(),
            target: Some(reservation.target.clone()),
        };
        let mut c = from.client.clone();
        let pushed = async {
            let r = c.hand_off(with_timeout(call, until)).await;
            r.map_err(|s| Failure::from_node(&from.node.id, &s))
        };
        let done = self
            .bounded(Phase::Transferring, &from.node, &[&from.node, &node], pushed)
            .await
            .map_err(|f| failure_text(&f))?
            .into_inner();
        let t = &mut self.report.timings;
        t.migrations += 1;
        t.decode_node = node.id.clone();
        mesh.metrics.migrated();
        tracing::info!(
            request = req.id,
            from = from.node.id,
            to = node.id,
            bytes = done.bytes,
            transport = done.transport,
            transfer_ms = done.transfer_ms,
            "moved with its KV"
        );
        let start = decode_request::Start::HandedOff(true);
        Ok(Leg { node, client, reservation, start, rng_position: 0, _assigned: assigned })
    }

    /// Tells a draining node to keep the request it asked to move (best effort: if the node
    /// cannot be told, its stream fails and the request moves by recomputing).
    async fn stay(&self, leg: &Leg<'_>) {
        let call = HandOffRequest {
            reservation_id: leg.reservation.target.reservation_id.clone(),
            target: None,
        };
        let cfg = &self.req.mesh.config;
        let until = Instant::now() + Duration::from_millis(cfg.node_call_timeout_ms);
        if let Err(s) = leg.client.clone().hand_off(with_timeout(call, until)).await {
            tracing::warn!(node = leg.node.id, "could not keep the request there: {}", s.message());
        }
    }
}

/// One decode node's part of an attempt: the reservation it runs the request in, how the
/// request starts there, and the node's share of the router's load accounting.
struct Leg<'a> {
    node: Node,
    client: DecodeClient<trace::Channel>,
    reservation: Reservation,
    start: decode_request::Start,
    /// Where the prefill node's sampler stood after the first token.
    rng_position: u128,
    _assigned: Assigned<'a>,
}

/// How a leg ended.
enum Relayed<'a> {
    Finished(Decoded),
    /// Its node handed the request off: it goes on in this leg.
    Moved(Box<Leg<'a>>),
}

impl Attempt<'_> {
    /// Sends an event to the client, waiting for room while the node `d` stays.
    async fn send(&self, d: &Node, ev: Event) -> Result<(), Failure> {
        self.bounded(Phase::Decoding, d, &[d], self.req.to_client(Ok(ev))).await
    }
}

/// The shared channel to `node`.
fn channel(mesh: &Mesh, node: &Node) -> Result<trace::Channel, Failure> {
    mesh.channel(&node.address, node.role)
        .map_err(|e| Failure::lost(&node.id, format!("bad address {}: {e}", node.address)))
}

/// The id of the first of `watched` (a request's one or two nodes) to leave the mesh.
async fn first_to_leave(watched: &[&Node]) -> String {
    debug_assert!(watched.len() <= 2, "a request runs on at most two nodes");
    let leaves = |i: usize| async move {
        match watched.get(i) {
            Some(n) => {
                n.left.cancelled().await;
                n.id.clone()
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        id = leaves(0) => id,
        id = leaves(1) => id,
    }
}
