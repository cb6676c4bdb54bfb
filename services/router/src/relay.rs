//! One request's life on the router: attempts (`attempt.rs`) until one finishes it or a
//! failure is final (what each failure leads to is `stage::decide`'s), then one `Finished` or
//! one error to the client. A failure before the
//! first token reaches the client is retried on other nodes (once, or up to `max_migrations`
//! times). A decode node lost after
//! that (dead, hung, gone from the mesh) does not end the stream: the request moves to another
//! decode node with its prompt and the tokens generated so far, and continues from the same
//! sampler position, so the client sees one unbroken stream, the same one it would have seen
//! without the failure (up to `max_migrations` times). A node that was unreachable is avoided
//! until it heartbeats again. Dropping the request (the client left) drops the attempt's
//! streams, which aborts them on their nodes and releases what they reserved.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdmesh_common::convert::ms;
use pdmesh_common::trace;
use pdmesh_kv_types::{BlockHash, KvLayout};
use pdmesh_model::FinishReason;
use pdmesh_proto::v1::Role;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Span;
use tracing::field::Empty;

use pdmesh_common::apikey::Tenant;

use crate::api::{Event, Finished, Usage};
use crate::attempt::{Attempt, Decoded, Failure, Phase, Report, Request, failure_text};
use crate::error::RequestError;
use crate::index::Hits;
use crate::mesh::Mesh;
use crate::placement::{Ask, PlaceError, PrefillPolicy, place};
use crate::request::Prepared;
use crate::stage::{Action, Fault, Limits, Stage, Wait, decide};

/// Runs an admitted request to its end, sending everything to `out`.
pub(crate) async fn run(
    mesh: &Mesh,
    id: String,
    prep: Prepared,
    tenant: &Tenant,
    deadline: Instant,
    out: mpsc::Sender<Result<Event, RequestError>>,
    cancel: CancellationToken,
) {
    let t0 = Instant::now();
    // Admission checked the name; the default pool serves one that names none.
    let pool = mesh.pool_named(&prep.model).unwrap_or_else(|| mesh.pool());
    let started = Event::Started {
        request_id: id.clone(),
        prompt_tokens: prep.prompt.len() as u32,
        trace_id: trace::trace_id(),
        model: pool.id.clone(),
    };
    if out.send(Ok(started)).await.is_err() {
        return;
    }
    let req = Request {
        mesh,
        pool,
        id: &id,
        prep: &prep,
        owner: &tenant.tenant,
        salt: tenant.cache_salt(),
        chain: Default::default(),
        deadline,
        t0,
        out: &out,
        cancel: &cancel,
    };
    let mut report = Report::default();
    let outcome = attempts(&req, &mut report).await;
    let retry_after = Duration::from_millis(mesh.config.retry_after_ms);
    let end = match outcome {
        Ok(d) => Ok(finished(&req, report, d.reason, d.completion_tokens)),
        Err(Failure::Cancelled) => Ok(finished(&req, report, FinishReason::Cancelled, 0)),
        Err(Failure::Abandoned) => {
            mesh.metrics.abandoned(&req.pool.id);
            tracing::info!(request = id, "client went away; aborting both legs");
            return;
        }
        Err(f) => Err(f.into_error(retry_after)),
    };
    match &end {
        Ok(Event::Finished(f)) => {
            mesh.metrics.finished(&req.pool.id, f);
            if f.reason != FinishReason::Cancelled {
                req.pool.observe(f);
            }
        }
        Ok(_) => {}
        Err(e) => {
            mesh.metrics.failed(Some(&req.pool.id), e.code());
            tracing::warn!(request = id, code = ?e.code(), "request failed: {e}");
        }
    }
    // Bounded like every event: a client that stopped reading does not keep the request's
    // place past its last word.
    let _ = req.to_client(end).await;
}

/// The one `Finished` a request ends with, and the root span's account of it.
fn finished(req: &Request<'_>, report: Report, reason: FinishReason, completion: u32) -> Event {
    let mut timings = report.timings;
    if !report.first_sent && reason != FinishReason::Cancelled {
        timings.ttft_ms = ms(req.t0.elapsed());
    }
    timings.total_ms = ms(req.t0.elapsed());
    let usage = Usage {
        prompt_tokens: req.prep.prompt.len() as u32,
        cached_tokens: report.cached_tokens,
        completion_tokens: completion,
        cached_by_tier: report.cached_by_tier.map(|t| crate::events::CachedTiers {
            node_ram: t.node_ram,
            node_disk: t.node_disk,
            kvstore_ram: t.kvstore_ram,
            kvstore_disk: t.kvstore_disk,
        }),
        kv_policy: req.prep.kv_policy,
        kv_evicted_tokens: report.kv_evicted_tokens,
    };
    let root = Span::current();
    if !root.is_disabled() {
        let wire = pdmesh_wire::finish_reason(reason);
        trace::attr(&root, "finish_reason", wire.as_str_name());
        trace::attr(&root, "completion_tokens", i64::from(completion));
        trace::attr(&root, "attempts", i64::from(timings.attempts));
        trace::attr(&root, "migrations", i64::from(timings.migrations));
        trace::attr(&root, "preemptions", i64::from(timings.preemptions));
        trace::attr(&root, "prefill_node", timings.prefill_node.clone());
        trace::attr(&root, "decode_node", timings.decode_node.clone());
        trace::attr(&root, "kv_transport", timings.kv_transport.clone());
        trace::attr(&root, "kv_bytes", timings.kv_bytes as i64);
        trace::attr(&root, "ttft_ms", timings.ttft_ms);
        trace::attr(&root, "cached_tokens", i64::from(usage.cached_tokens));
        if usage.kv_policy.is_some() {
            trace::attr(&root, "kv_evicted_tokens", i64::from(usage.kv_evicted_tokens));
        }
    }
    Event::Finished(Finished { reason, usage, timings, model: req.pool.id.clone() })
}

/// Attempts the request until one finishes it or a failure is final: each failure goes
/// through `stage::decide`, and this carries out what it says.
async fn attempts(req: &Request<'_>, report: &mut Report) -> Result<Decoded, Failure> {
    let mesh = req.mesh;
    let limits = Limits::new(mesh.config.max_migrations);
    let mut stage = Stage::default();
    let mut exclude: Vec<String> = Vec::new();
    // The last failure that counted: the answer when no other node can take the request.
    let mut last: Option<Failure> = None;
    loop {
        if let Some(done) = ended_before_moving(req, report).await? {
            return Ok(done);
        }
        let wait = stage.wait(report.first_sent);
        let placed = match place_or_wait(req, &exclude, wait, report.resume.tokens.len()).await {
            Ok(p) => p,
            Err(e) => return Err(last.unwrap_or(e)),
        };
        report.timings.attempts += 1;
        let decode_node = placed.decode.id.clone();
        let a = Attempt {
            req,
            report: &mut *report,
            decode: placed.decode,
            prefill: placed.prefill,
            blocks: placed.blocks,
            prefill_tokens: placed.prefill_tokens,
        };
        let failure = match a.run().await {
            Ok(d) => return Ok(d),
            Err(f) => f,
        };
        if let (Some(n), Failure::Lost { .. }) = (failure.node(), &failure) {
            mesh.registry().suspect(n, Instant::now());
        }
        let (next, action) =
            decide(stage, Fault::of(&failure, &decode_node), report.first_sent, &limits);
        stage = next;
        report.timings.migrations = stage.spent.migrations;
        report.timings.preemptions = stage.spent.preemptions;
        let attempt = report.timings.attempts;
        let (id, tokens, why) = (req.id, report.resume.tokens.len(), failure_text(&failure));
        match action {
            Action::AwaitRoom => {
                tracing::debug!(request = id, node = decode_node, "decode node full; waiting");
            }
            Action::Preempted => {
                mesh.metrics.preempted();
                tracing::info!(
                    request = id,
                    node = decode_node,
                    tokens,
                    "preempted; waiting for room to continue"
                );
            }
            Action::Migrate => {
                mesh.metrics.migrated();
                tracing::warn!(
                    request = id,
                    tokens,
                    "attempt {attempt} failed mid-stream ({why}); moving the stream to another \
                     node"
                );
            }
            Action::Recompute => tracing::warn!(
                request = id,
                tokens,
                "attempt {attempt} could not re-prefill the moving stream ({why}); computing it \
                 elsewhere"
            ),
            Action::Retry => tracing::warn!(
                request = id,
                "attempt {attempt} failed ({why}); retrying on other nodes"
            ),
            Action::Fail => return Err(failure),
        }
        if action.counts() {
            exclude.extend(failure.node().map(str::to_string));
            last = Some(failure);
        }
    }
}

/// Before a stream moves: whether what the client already has ends the request (its last
/// node finished it and died before saying so). The finish rules a node would apply next,
/// applied here, with the text a node would flush.
async fn ended_before_moving(
    req: &Request<'_>,
    report: &Report,
) -> Result<Option<Decoded>, Failure> {
    let generated = &report.resume.tokens;
    if generated.is_empty() {
        return Ok(None);
    }
    let tokenizer = &req.pool.model.tokenizer;
    let mut text = pdmesh_model::TextStream::new(req.prep.stop.clone());
    for &t in generated {
        if let pdmesh_model::Pushed::Stopped(_) = text.push(tokenizer, t) {
            return Ok(Some(Decoded {
                reason: FinishReason::Stop,
                completion_tokens: generated.len() as u32,
            }));
        }
    }
    let reason = if generated.len() >= req.prep.max_tokens {
        FinishReason::Length
    } else if req.prep.prompt.len() + generated.len() >= req.pool.model.config.context {
        FinishReason::ContextFull
    } else {
        return Ok(None);
    };
    let tail = text.finish();
    if !tail.is_empty() {
        let n = tail.tokens.len().min(report.logprobs.len());
        let logprobs = report.logprobs.iter().take(n).cloned().collect();
        let ev = Event::Delta { text: tail.text, tokens: tail.tokens, logprobs };
        req.to_client(Ok(ev)).await?;
    }
    Ok(Some(Decoded { reason, completion_tokens: generated.len() as u32 }))
}

/// How often a request waiting for room looks again without being woken (a missed wake costs
/// at most this).
const RECHECK: Duration = Duration::from_millis(250);

/// `placement`; when no decode node has room and `wait` allows, waits in the router's queue
/// for room (first come first served within a tenant, tenants taking turns; arrivals also
/// queue behind requests already waiting) until the request's deadline, its cancellation or
/// its client leaving.
async fn place_or_wait(
    req: &Request<'_>,
    exclude: &[String],
    wait: Wait,
    resumed: usize,
) -> Result<Placed, Failure> {
    let queue = &req.pool.queue;
    let full = || Failure::QueueFull { waiting: queue.len() };
    let may_wait = wait != Wait::Never;
    let mut ticket = None;
    if wait == Wait::First || (may_wait && !queue.is_empty()) {
        ticket = Some(queue.join(req.owner).ok_or_else(full)?);
        req.mesh.metrics.queued();
    }
    // Waiting for room first: the look comes after a change.
    let mut look = wait != Wait::First;
    loop {
        let changed = queue.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if std::mem::replace(&mut look, true) && ticket.as_ref().is_none_or(|t| t.is_first()) {
            match placement(req, exclude, resumed) {
                // Leaving the queue (the ticket drops) lets the next one try.
                Ok(p) => return Ok(p),
                Err(Failure::Place(why @ PlaceError::NoCapacity { .. })) if may_wait => {
                    if ticket.is_none() {
                        ticket = Some(queue.join(req.owner).ok_or_else(full)?);
                        req.mesh.metrics.queued();
                        tracing::debug!(request = req.id, "no room: {why}; queued");
                    }
                }
                Err(e) => return Err(e),
            }
        }
        tokio::select! {
            () = &mut changed => {}
            () = tokio::time::sleep(RECHECK) => {}
            () = tokio::time::sleep_until(req.deadline.into()) => {
                return Err(Failure::Deadline { phase: Phase::Queued, node: None });
            }
            () = req.cancel.cancelled() => return Err(Failure::Cancelled),
            () = req.out.closed() => return Err(Failure::Abandoned),
        }
    }
}

/// Where an attempt runs.
struct Placed {
    decode: crate::registry::Node,
    /// None: colocated on the decode node.
    prefill: Option<crate::registry::Node>,
    /// Blocks the decode node is counted for.
    blocks: u32,
    /// Prompt tokens the prefill node is counted for: those its cache hits leave to compute.
    prefill_tokens: u32,
}

/// Picks the decode (and prefill) node for an attempt, never one in `exclude`.
fn placement(req: &Request<'_>, exclude: &[String], resumed: usize) -> Result<Placed, Failure> {
    let mesh = req.mesh;
    let cfg = &mesh.config;
    // Hashed before the registry's lock: a long prompt must not hold up the nodes' reports.
    let chain = req.pool.layout().map(|l| (l, req.chain(&l)));
    // Placement reads the registry in place, under its lock, and copies only the nodes chosen.
    let reg = mesh.registry();
    let now = Instant::now();
    let model = req.pool.fingerprint();
    let prefills = reg.live_refs(model, Role::Prefill, now);
    let span = pdmesh_common::span!(
        "router.placement",
        policy = %cfg.prefill_policy,
        attempt = exclude.len() as i64 + 1,
        prefill_nodes = prefills.len() as i64,
        prefill_node = Empty,
        decode_node = Empty,
        matched_tokens = Empty,
    );
    let _entered = span.enter();
    let ask = ask_of(mesh, req.prep, chain.as_ref(), &prefills, resumed);
    let placed = place(&prefills, &reg.live_refs(model, Role::Decode, now), &ask, exclude)
        .map_err(|e| {
            let retry_after = Duration::from_millis(cfg.retry_after_ms);
            let status: tonic::Status = Failure::Place(e.clone()).into_error(retry_after).into();
            trace::fail(&span, &status);
            Failure::Place(e)
        })?;
    span.record("decode_node", placed.decode.as_str());
    let prefill_name = placed.prefill.as_deref().unwrap_or("colocated");
    span.record("prefill_node", prefill_name);
    let bs = chain.as_ref().map_or(0, |(l, _)| l.block_size());
    let hit = ask.hits.get(prefill_name).map_or(0, |h| h.total());
    span.record("matched_tokens", (hit * bs) as i64);
    let prefill_tokens =
        u32::try_from(ask.prompt_tokens.saturating_sub(hit * bs)).unwrap_or(u32::MAX);
    let gone = |id: &str| Failure::Lost { node: id.to_string(), why: "left the mesh".into() };
    let decode = reg.get(&placed.decode).cloned().ok_or_else(|| gone(&placed.decode))?;
    let prefill = match &placed.prefill {
        Some(p) => Some(reg.get(p).cloned().ok_or_else(|| gone(p))?),
        None => None,
    };
    drop(reg);
    let blocks = crate::placement::blocks_needed(&decode, &ask) as u32;
    Ok(Placed { decode, prefill, blocks, prefill_tokens })
}

/// Prompt blocks each of `prefill` would read from a cache: the exact index's hits, over the
/// blocks a prefill node may take from one (its last token is always computed).
pub(crate) fn hits_of(
    mesh: &Mesh,
    prompt_len: usize,
    (layout, chain): &(KvLayout, std::sync::Arc<[BlockHash]>),
    prefill: &[&crate::registry::Node],
) -> HashMap<String, Hits> {
    let usable = prompt_len.saturating_sub(1) / layout.block_size().max(1);
    let ids = prefill.iter().filter(|n| n.layout == *layout).map(|n| n.id.as_str());
    mesh.index.hits(chain, usable, ids)
}

/// What placement is asked for; `resumed` tokens of the request's output (a moved or
/// preempted stream's) are recomputed on its decode node.
fn ask_of(
    mesh: &Mesh,
    prep: &Prepared,
    chain: Option<&(KvLayout, std::sync::Arc<[BlockHash]>)>,
    prefill: &[&crate::registry::Node],
    resumed: usize,
) -> Ask {
    let cfg = &mesh.config;
    let hits = match chain {
        Some(c) if cfg.prefill_policy == PrefillPolicy::PrefixAware => {
            hits_of(mesh, prep.prompt.len(), c, prefill)
        }
        _ => HashMap::new(),
    };
    Ask {
        prompt_tokens: prep.prompt.len(),
        max_tokens: prep.max_tokens,
        up_front: crate::attempt::up_front(cfg, prep.max_tokens, resumed),
        colocate_below: cfg.colocate_below_tokens,
        colocate_when_prefill_busy: cfg.colocate_when_prefill_busy,
        policy: cfg.prefill_policy,
        turn: mesh.next_turn(),
        seed: fastrand::u64(..),
        hits,
        store_cost: cfg.kvstore_read_cost,
        max_imbalance: cfg.prefix_max_imbalance,
    }
}
