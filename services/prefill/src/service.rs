//! The `pdmesh.v1.Prefill` service: check the request and the KV layout, open the transfer,
//! look the prompt up in the prefix cache, queue it on the engine thread, and relay what it
//! produces — KV pieces to the decode node, then the first token and the transfer's outcome
//! to the caller. If the caller goes away, everything stops: the engine drops the prompt and
//! the transfer is aborted.

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_common::convert::ms;
use pdmesh_common::trace;
use pdmesh_kv_transfer::{KvPiece, KvSink, KvTransport, PrefixCache, PushMode, TransferStats};
use pdmesh_kv_types::{BlockHash, KvLayout};
use pdmesh_proto::v1::prefill_server::Prefill;
use pdmesh_proto::v1::{
    KvTarget, NodeLoad, NodeStats, PrefillComputed, PrefillEvent, PrefillRequest,
    PrefillTransferred, Role, StatsRequest, prefill_event,
};
use pdmesh_wire::{rng_position_bytes, sampling_from};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::core::{Counts, Done, Job};
use crate::error::{PrefillError, to_status};
use crate::worker::Submit;

#[derive(Debug, Clone)]
pub struct PrefillService {
    pub node_id: String,
    /// What computes (`Engine::describe_backend`), for stats.
    pub backend: String,
    pub layout: KvLayout,
    pub tx: mpsc::Sender<Submit>,
    pub transport: Arc<dyn KvTransport>,
    pub stats: Arc<TransferStats>,
    /// When KV goes to the transport (`layer` needs a layered transport, else `chunk`).
    pub push: PushMode,
    /// Send each block's checksum for the decode node to verify.
    pub verify: bool,
    /// The prefix cache: the node's own tier and/or the KV-store.
    pub cache: Option<Arc<PrefixCache>>,
    pub counts: Arc<Mutex<Counts>>,
    pub transferring: Arc<AtomicU32>,
    /// Test-only fault injection: the delay before each KV message (zero in production).
    pub fault_delay: Duration,
    /// Stopping: new prompts are refused (UNAVAILABLE, so routers retry elsewhere).
    pub draining: Arc<std::sync::atomic::AtomicBool>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<PrefillEvent, Status>> + Send>>;

impl PrefillService {
    fn cache_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.local_capacity())
    }

    pub fn load(
        counts: &Counts,
        transferring: u32,
        cache_blocks: usize,
        publishes: bool,
        draining: bool,
    ) -> NodeLoad {
        NodeLoad {
            publishes,
            cache_blocks: u32::try_from(cache_blocks).unwrap_or(u32::MAX),
            queued: counts.queued,
            running: counts.prefilling + transferring,
            backlog_tokens: u32::try_from(counts.backlog_tokens).unwrap_or(u32::MAX),
            free_blocks: counts.free_blocks,
            total_blocks: counts.total_blocks,
            committed_blocks: counts.total_blocks - counts.free_blocks,
            draining,
        }
    }

    fn status(&self, e: &PrefillError) -> Status {
        to_status(e, &self.node_id)
    }

    /// The request's target, checked against this node's layout and the prompt.
    fn check(&self, r: &PrefillRequest) -> Result<KvTarget, Status> {
        let node = &self.node_id;
        let target =
            r.target.clone().ok_or_else(|| Status::invalid_argument("target is missing"))?;
        pdmesh_kv_transfer::check_layout(&self.layout, target.layout.as_ref(), &target.decode_node)
            .map_err(|s| Status::new(s.code(), format!("node {node}: {}", s.message())))?;
        if r.cache_salt.len() > MAX_CACHE_SALT {
            return Err(Status::invalid_argument(format!(
                "cache_salt: {} bytes, at most {MAX_CACHE_SALT}",
                r.cache_salt.len()
            )));
        }
        let blocks = self.layout.geometry.blocks_for(r.prompt.len());
        if target.blocks as usize != blocks || target.prompt_tokens as usize != r.prompt.len() {
            return Err(Status::invalid_argument(format!(
                "target expects {} tokens in {} blocks, the prompt has {} tokens",
                target.prompt_tokens,
                target.blocks,
                r.prompt.len()
            )));
        }
        Ok(target)
    }

    /// Opens the transfer into `target` under `span`.
    async fn open(&self, target: &KvTarget, span: &Span) -> Result<Box<dyn KvSink>, Status> {
        let opened = self.transport.open(target, &self.node_id).instrument(span.clone()).await;
        let sink = opened.map_err(|e| {
            let s = Status::from(e);
            trace::fail(span, &s);
            s
        })?;
        span.record("transport", sink.transport());
        if self.fault_delay.is_zero() {
            Ok(sink)
        } else {
            Ok(pdmesh_kv_transfer::delayed(sink, self.fault_delay))
        }
    }
}

/// The longest prefix-cache salt a request may carry (the router's are 16 bytes).
const MAX_CACHE_SALT: usize = 64;

#[tonic::async_trait]
impl Prefill for PrefillService {
    type PrefillStream = EventStream;

    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(Status::unavailable(format!(
                "node {}: draining (stopping); it takes no new prompts",
                self.node_id
            )));
        }
        let r = req.into_inner();
        let target = self.check(&r)?;
        let (sampling, rng_position) = sampling_from(r.sampler.as_ref())?;
        // The transfer's span runs from opening the sink to the decode node's acknowledgement;
        // the decode node's side of it is its child, through the control messages. `tail_ms`
        // and the bandwidth cover what is left after the first token: what decoding waits for.
        let transfer = pdmesh_common::span!(
            "prefill.kv_transfer",
            decode_node = %target.decode_node,
            reservation = pdmesh_common::ids::redacted(&target.reservation_id),
            transport = Empty,
            push = Empty,
            blocks = i64::from(target.blocks),
            layers = self.layout.geometry.layers as i64,
            bytes = Empty,
            tail_ms = Empty,
            bandwidth_mb_s = Empty,
        );
        let sink = self.open(&target, &transfer).await?;
        let push = match self.push {
            PushMode::Layer if !sink.layered() => PushMode::Chunk,
            p => p,
        };
        transfer.record("push", tracing::field::display(push));
        let lookup = match &self.cache {
            Some(c) => c.lookup(&r.prompt, &r.cache_salt).await,
            None => pdmesh_kv_transfer::Lookup::default(),
        };
        let job = Job {
            sampling,
            rng_position,
            push,
            checksums: self.verify,
            cached: lookup.cached,
            publish: self.cache.is_some(),
            span: Span::current(),
            prompt: r.prompt,
        };
        // Every piece the prompt can produce fits its channel: the engine never waits on it.
        let blocks = self.layout.geometry.blocks_for(job.prompt.len());
        let (pieces, piece_rx) = mpsc::channel(blocks * self.layout.geometry.layers + 1);
        let (done, done_rx) = mpsc::channel(1);
        let (reply, accepted) = oneshot::channel();
        let closed = || self.status(&PrefillError::ShuttingDown);
        self.tx.send(Submit { job, pieces, done, reply }).await.map_err(|_| closed())?;
        accepted.await.map_err(|_| closed())?.map_err(|e| self.status(&e))?;

        let (events, rx) = mpsc::channel::<Result<PrefillEvent, Status>>(4);
        let relay = Relay {
            node: self.node_id.clone(),
            transport: sink.transport(),
            mapped: sink.mapped(),
            sink: Some(sink),
            stats: Arc::clone(&self.stats),
            transferring: Arc::clone(&self.transferring),
            cache: self.cache.clone().map(|c| (c, lookup.chain)),
            tiers: lookup.tiers,
            transfer,
            events,
        };
        tokio::spawn(relay.run(piece_rx, done_rx, r.request_id).in_current_span());
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<NodeStats>, Status> {
        let c = *self.counts.lock().expect("counts lock is never poisoned");
        let transferring = self.transferring.load(Ordering::Relaxed);
        Ok(Response::new(NodeStats {
            node_id: self.node_id.clone(),
            role: Role::Prefill as i32,
            load: Some(Self::load(
                &c,
                transferring,
                self.cache_blocks(),
                self.cache.is_some(),
                self.draining.load(Ordering::Relaxed),
            )),
            layout: Some(self.layout.into()),
            queued: c.queued,
            prefilling: c.prefilling,
            transferring,
            decoding: 0,
            reserved: 0,
            completed: c.completed,
            cancelled: c.cancelled,
            failed: c.failed,
            leases_expired: 0,
            transports: self.stats.snapshot(),
            prefix_cache: self.cache.as_ref().map(|c| c.stats()),
            moved: 0,
            preempted: 0,
            backend: self.backend.clone(),
            ..NodeStats::default()
        }))
    }
}

/// Decrements the transferring gauge however the relay ends.
struct Gauge(Arc<AtomicU32>);

impl Gauge {
    fn up(g: &Arc<AtomicU32>) -> Self {
        g.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(g))
    }
}

impl Drop for Gauge {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One prompt's life after it is queued: its pieces to the decode node, its first token and
/// the transfer's outcome to the caller.
struct Relay {
    node: String,
    /// The transport carrying the transfer.
    transport: &'static str,
    /// Whether the sink copies into the decode node's pool mapped here.
    mapped: bool,
    /// Taken when the relay starts: dropping it unfinished aborts the transfer.
    sink: Option<Box<dyn KvSink>>,
    stats: Arc<TransferStats>,
    transferring: Arc<AtomicU32>,
    /// The prefix cache and the prompt's chain, to publish what was computed.
    cache: Option<(Arc<PrefixCache>, Vec<BlockHash>)>,
    /// Where the cached prefix came from.
    tiers: pdmesh_proto::v1::CachedTokens,
    transfer: Span,
    events: mpsc::Sender<Result<PrefillEvent, Status>>,
}

impl Relay {
    async fn run(
        mut self,
        pieces: mpsc::Receiver<KvPiece>,
        done: mpsc::Receiver<Done>,
        request_id: String,
    ) {
        let events = self.events.clone();
        // The caller leaving ends the relay: dropping the receivers stops the engine work
        // and dropping the sink aborts the transfer.
        let result = tokio::select! {
            r = self.relay(pieces, done) => r,
            () = events.closed() => {
                tracing::info!(request = request_id, "caller went away; prefill aborted");
                Ok(())
            }
        };
        if let Err(s) = result {
            tracing::warn!(request = request_id, "prefill failed: {}", s.message());
            trace::fail(&self.transfer, &s);
            let _ = events.send(Err(s)).await;
        }
    }

    async fn relay(
        &mut self,
        mut pieces: mpsc::Receiver<KvPiece>,
        mut done: mpsc::Receiver<Done>,
    ) -> Result<(), Status> {
        // Pieces go out as the engine produces them; the first token is reported as soon as it
        // exists, while the last pieces may still be in flight.
        let mut sink = self.sink.take().expect("a relay runs once");
        let push = async {
            while let Some(piece) = pieces.recv().await {
                sink.send(piece).await.map_err(Status::from)?;
            }
            Ok::<_, Status>(())
        }
        .instrument(self.transfer.clone());
        let computed = async {
            match done.recv().await {
                Some(Done::Computed {
                    first_token,
                    rng_position,
                    logprobs,
                    queue_ms,
                    prefill_ms,
                    blocks,
                    export,
                }) => {
                    if let Some((c, chain)) = &self.cache {
                        let first = chain.len() - export.computed_blocks.len();
                        c.publish(chain, first, export.computed_blocks);
                    }
                    let gauge = Gauge::up(&self.transferring);
                    let ev = PrefillComputed {
                        first_token,
                        rng_position: rng_position_bytes(rng_position),
                        queue_ms,
                        prefill_ms,
                        cached_tokens: export.cached_tokens as u32,
                        cached_by_tier: Some(self.tiers),
                        logprobs: logprobs.as_ref().map(pdmesh_wire::logprobs_to_wire),
                    };
                    let ev = PrefillEvent { event: Some(prefill_event::Event::Computed(ev)) };
                    // A closed stream is noticed by the caller's select.
                    let _ = self.events.send(Ok(ev)).await;
                    Ok((Instant::now(), blocks, export.checksums, gauge))
                }
                Some(Done::Failed(e)) => Err(to_status(&e, &self.node)),
                None => Err(to_status(&PrefillError::ShuttingDown, &self.node)),
            }
        };
        let ((), (t0, blocks, checksums, _gauge)) = tokio::try_join!(push, computed)?;
        let finished = sink.finish(blocks, checksums).instrument(self.transfer.clone()).await;
        let secs = t0.elapsed().as_secs_f64();
        // What carried it in the end: a stalled UCX session falls back to the stream.
        let transport = finished.as_ref().map_or(self.transport, |f| f.transport);
        self.transfer.record("transport", transport);
        self.stats.record(transport, finished.as_ref().ok().map(|f| f.bytes), secs);
        if self.mapped && transport == self.transport && finished.is_ok() {
            self.stats.mapped(transport);
        }
        let bytes = finished.map_err(Status::from)?.bytes;
        self.transfer.record("bytes", bytes as i64);
        self.transfer.record("tail_ms", secs * 1e3);
        if secs > 0.0 {
            self.transfer.record("bandwidth_mb_s", bytes as f64 / secs / 1e6);
        }
        let ev = PrefillTransferred {
            transfer_ms: ms(t0.elapsed()),
            bytes,
            transport: transport.into(),
        };
        let ev = PrefillEvent { event: Some(prefill_event::Event::Transferred(ev)) };
        let _ = self.events.send(Ok(ev)).await;
        Ok(())
    }
}
