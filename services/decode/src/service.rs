//! The `pdmesh.v1.Decode` service: validate, hand to the engine thread, map the result. The KV
//! a transfer brings is taken in by the transports' receiving halves (`pdmesh_kv_transfer`),
//! which deliver into this node through `Inbox`.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use pdmesh_common::ids::Capability;
use pdmesh_kv_transfer::{GrantError, KvInbox, KvPiece, KvTransport, PoolOffer, TransferStats};
use pdmesh_kv_types::KvLayout;
use pdmesh_proto::v1::decode_server::Decode;
use pdmesh_proto::v1::{
    DecodeEvent, DecodeFinished, DecodeMark, DecodeMoved, DecodeMoving, DecodeRequest, Delta,
    DrainRequest, DrainResponse, HandOffRequest, HandOffResponse, KvChunk, KvSessionRequest,
    KvTarget, NodeCancelRequest, NodeCancelResponse, NodeLoad, NodeStats, PushKvResponse,
    ReleaseRequest, ReleaseResponse, ReserveRequest, ReserveResponse, Role, StatsRequest,
    decode_event, decode_request,
};
use pdmesh_wire::{finish_reason, sampling_from};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Span;

use crate::core::{Attach, Counts, Event, Start};
use crate::error::{DecodeError, to_status};
use crate::worker::{ChannelOutput, Command, RemoteGrant};

/// The engine thread as the async side reaches it.
#[derive(Debug, Clone)]
pub struct Inbox {
    pub node_id: String,
    /// What computes (`Engine::describe_backend`), for stats.
    pub backend: String,
    pub layout: KvLayout,
    pub tx: mpsc::Sender<Command>,
    pub stats: Arc<TransferStats>,
    /// The KV pool as a one-sided transport offers it, when this node runs one.
    pub pool: Option<Arc<dyn PoolOffer>>,
}

impl Inbox {
    fn status(&self, e: &DecodeError) -> Status {
        to_status(e, &self.node_id)
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, DecodeError>>) -> Command,
    ) -> Result<T, Status> {
        let (reply, rx) = oneshot::channel();
        let stopped = || self.status(&DecodeError::EngineStopped);
        self.tx.send(make(reply)).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?.map_err(|e| self.status(&e))
    }
}

#[async_trait::async_trait]
impl KvInbox for Inbox {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn stats(&self) -> &TransferStats {
        &self.stats
    }

    async fn begin(&self, cap: Capability, from: &str, writer: Option<u64>) -> Result<u64, Status> {
        let from = from.to_string();
        self.call(|reply| Command::KvBegin { cap, from, writer, reply }).await
    }

    async fn write(&self, id: u64, first_block: usize, data: Bytes) -> Result<(), Status> {
        let cmd = Command::KvWrite { id, first_block, data };
        self.tx.send(cmd).await.map_err(|_| self.status(&DecodeError::EngineStopped))
    }

    async fn end(
        &self,
        id: u64,
        blocks: usize,
        checksums: Vec<u64>,
    ) -> Result<Option<Duration>, Status> {
        self.call(|reply| Command::KvEnd { id, blocks, checksums, reply }).await
    }

    async fn writer_abandoned(&self, id: u64) -> Result<(), Status> {
        self.call(|reply| Command::KvWriterAbandoned { id, reply }).await
    }

    async fn abort(&self, id: u64, from: &str, why: String) {
        let why = DecodeError::TransferBroken { from: from.to_string(), why };
        let _ = self.tx.send(Command::KvAbort { id, why }).await;
    }

    fn pool(&self) -> Option<&Arc<dyn PoolOffer>> {
        self.pool.as_ref()
    }

    fn closed(&self, id: u64) {
        let tx = self.tx.clone();
        if tx.try_send(Command::WriterClosed { id }).is_err() {
            // The queue is full: send from a task rather than lose the notice (it frees blocks).
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = tx.send(Command::WriterClosed { id }).await;
                });
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct DecodeService {
    pub inbox: Arc<Inbox>,
    pub address: String,
    pub context: usize,
    pub counts: Arc<Mutex<Counts>>,
    /// Moves a draining node's requests' KV to other decode nodes.
    pub transport: Arc<dyn KvTransport>,
    /// Cancelled to drain the node (`Drain`); the node then exits.
    pub drain: tokio_util::sync::CancellationToken,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<DecodeEvent, Status>> + Send>>;

impl DecodeService {
    fn node_id(&self) -> &str {
        &self.inbox.node_id
    }

    fn parse_id(&self, s: &str) -> Result<Capability, Status> {
        pdmesh_kv_transfer::parse_reservation(self.node_id(), s)
    }

    pub fn load(counts: &Counts) -> NodeLoad {
        NodeLoad {
            queued: counts.queued + counts.reserved + counts.transferring,
            running: counts.decoding + counts.prefilling,
            free_blocks: counts.total_blocks.saturating_sub(counts.committed_blocks),
            total_blocks: counts.total_blocks,
            committed_blocks: counts.committed_blocks,
            cache_blocks: 0,
            publishes: false,
            draining: counts.draining,
            // Its prompts are computed in chunks beside its streams; routers place them by
            // room, not by a prefill backlog.
            backlog_tokens: 0,
        }
    }
}

/// A request's events as the wire carries them. A stream that ends without its end event (the
/// engine thread died and dropped it) ends with UNAVAILABLE naming the node.
struct Events {
    rx: mpsc::Receiver<Event>,
    node: String,
    /// The end event went out (or the missing one was reported).
    ended: bool,
}

impl Stream for Events {
    type Item = Result<DecodeEvent, Status>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let ev = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) if self.ended => return Poll::Ready(None),
            Poll::Ready(None) => {
                self.ended = true;
                return Poll::Ready(Some(Err(to_status(&DecodeError::EngineStopped, &self.node))));
            }
            Poll::Ready(Some(ev)) => ev,
        };
        Poll::Ready(Some(match ev {
            Event::Delta(p, mark) => Ok(DecodeEvent {
                event: Some(decode_event::Event::Delta(Delta {
                    text: p.text,
                    token_ids: p.tokens,
                    logprobs: Vec::new(),
                })),
                mark: mark.map(mark_to_wire),
            }),
            Event::Moving { mark, kv_tokens } => Ok(DecodeEvent {
                event: Some(decode_event::Event::Moving(DecodeMoving {
                    kv_tokens: kv_tokens as u32,
                })),
                mark: Some(mark_to_wire(mark)),
            }),
            Event::Moved => {
                self.ended = true;
                Ok(DecodeEvent {
                    event: Some(decode_event::Event::Moved(DecodeMoved {})),
                    mark: None,
                })
            }
            Event::Finished {
                reason,
                completion_tokens,
                queue_ms,
                prefill_ms,
                kv_evicted_tokens,
            } => {
                self.ended = true;
                Ok(DecodeEvent {
                    mark: None,
                    event: Some(decode_event::Event::Finished(DecodeFinished {
                        reason: finish_reason(reason) as i32,
                        completion_tokens,
                        queue_ms,
                        prefill_ms,
                        kv_evicted_tokens,
                    })),
                })
            }
            Event::Failed(e) => {
                self.ended = true;
                Err(to_status(&e, &self.node))
            }
        }))
    }
}

#[tonic::async_trait]
impl Decode for DecodeService {
    async fn reserve(
        &self,
        req: Request<ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        let r = req.into_inner();
        let lease = (r.lease_ms > 0).then(|| Duration::from_millis(u64::from(r.lease_ms)));
        let (prompt_len, max_tokens) = (r.prompt_tokens as usize, r.max_tokens as usize);
        // 0: all of them (callers that cannot continue a preempted request ask for that).
        let up_front = match r.reserve_tokens {
            0 => max_tokens,
            n => (n as usize).min(max_tokens),
        };
        let remote_kv = r.remote_kv;
        let grant = match (&self.inbox.pool, remote_kv) {
            (Some(pool), true) => {
                let pool = Arc::clone(pool);
                Some(RemoteGrant(Box::new(move |blocks: &[u32]| match pool.grant(blocks) {
                    Ok(g) => Ok(Some(g)),
                    Err(GrantError::StagingFull(e)) => {
                        tracing::debug!("this reservation's KV comes over a stream: {e}");
                        Ok(None)
                    }
                    Err(e) => Err(e.to_string()),
                })))
            }
            _ => None,
        };
        let (res, remote) = self
            .inbox
            .call(|reply| Command::Reserve {
                prompt_len,
                max_tokens,
                up_front,
                lease,
                remote_kv,
                grant,
                request: (r.owner.clone(), r.request_id.clone()),
                reply,
            })
            .await?;
        tracing::debug!(
            request = r.request_id,
            reservation = res.id(),
            blocks = res.prompt_blocks,
            "reserved"
        );
        Ok(Response::new(ReserveResponse {
            target: Some(KvTarget {
                reservation_id: res.cap.to_string(),
                decode_node: self.node_id().to_string(),
                address: self.address.clone(),
                layout: Some(self.inbox.layout.into()),
                blocks: res.prompt_blocks as u32,
                prompt_tokens: r.prompt_tokens,
                remote,
            }),
            lease_ms: res.lease.as_millis().min(u128::from(u32::MAX)) as u32,
        }))
    }

    async fn release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let cap = self.parse_id(&req.into_inner().reservation_id)?;
        let (reply, rx) = oneshot::channel();
        let stopped = || self.inbox.status(&DecodeError::EngineStopped);
        self.inbox.tx.send(Command::Release { cap, reply }).await.map_err(|_| stopped())?;
        let released = rx.await.map_err(|_| stopped())?;
        Ok(Response::new(ReleaseResponse { released }))
    }

    type DecodeStream = EventStream;

    async fn decode(
        &self,
        req: Request<DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let r = req.into_inner();
        let cap = self.parse_id(&r.reservation_id)?;
        let (sampling, rng_position) = sampling_from(r.sampler.as_ref())?;
        let start = match r.start {
            Some(decode_request::Start::FirstToken(t)) => Start::FirstToken(t),
            Some(decode_request::Start::PrefillLocally(true)) => Start::Local,
            Some(decode_request::Start::HandedOff(true)) if !r.resumed.is_empty() => {
                Start::HandedOff
            }
            _ => {
                return Err(Status::invalid_argument(
                    "start: set first_token, prefill_locally, or handed_off (with resumed tokens)",
                ));
            }
        };
        if r.max_tokens == 0 {
            return Err(Status::invalid_argument("max_tokens must be at least 1"));
        }
        if r.resumed.len() >= r.max_tokens as usize {
            return Err(Status::invalid_argument(format!(
                "resumed: {} tokens leave none of max_tokens {}",
                r.resumed.len(),
                r.max_tokens
            )));
        }
        pdmesh_wire::check_stops(&r.stop).map_err(Status::invalid_argument)?;
        let kv_policy = pdmesh_kv_types::KvPolicy::parse_field(&r.kv_policy)
            .map_err(|e| Status::invalid_argument(format!("kv_policy: {e}")))?;
        let max_tokens = (r.max_tokens as usize).min(self.context);
        let attach = Box::new(Attach {
            prompt: r.prompt,
            sampling,
            rng_position,
            max_tokens,
            stops: r.stop,
            ignore_eos: r.ignore_eos,
            kv_policy,
            start,
            resumed: r.resumed,
            span: Span::current(),
        });
        let (out, rx) = ChannelOutput::channel(max_tokens);
        self.inbox.call(|reply| Command::Attach { cap, attach, out, reply }).await?;
        let events = Events { rx, node: self.node_id().to_string(), ended: false };
        Ok(Response::new(Box::pin(events)))
    }

    async fn push_kv(
        &self,
        req: Request<Streaming<KvChunk>>,
    ) -> Result<Response<PushKvResponse>, Status> {
        pdmesh_kv_transfer::receive_push(self.inbox.clone(), req).await
    }

    type KvSessionStream = pdmesh_kv_transfer::SessionEvents;

    async fn kv_session(
        &self,
        req: Request<Streaming<KvSessionRequest>>,
    ) -> Result<Response<Self::KvSessionStream>, Status> {
        pdmesh_kv_transfer::accept_session(self.inbox.clone(), req).await
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<NodeStats>, Status> {
        let c = *self.counts.lock().expect("counts lock is never poisoned");
        let pool = self.inbox.pool.as_deref();
        let staging = pool.and_then(|p| p.staging());
        Ok(Response::new(NodeStats {
            node_id: self.node_id().to_string(),
            role: Role::Decode as i32,
            load: Some(Self::load(&c)),
            layout: Some(self.inbox.layout.into()),
            queued: c.queued,
            prefilling: c.prefilling,
            transferring: c.transferring,
            decoding: c.decoding,
            reserved: c.reserved,
            completed: c.completed,
            cancelled: c.cancelled,
            failed: c.failed,
            leases_expired: c.leases_expired,
            transports: self.inbox.stats.snapshot(),
            prefix_cache: None,
            moved: c.moved,
            preempted: c.preempted,
            backend: self.inbox.backend.clone(),
            kv_path: pool.map_or("", |p| p.path().name()).into(),
            kv_staging_free_blocks: staging.map_or(0, |s| s.free_blocks() as u32),
            kv_staging_blocks: staging.map_or(0, |s| s.blocks() as u32),
            kv_staging_full: staging.map_or(0, |s| s.full()),
        }))
    }

    async fn hand_off(
        &self,
        req: Request<HandOffRequest>,
    ) -> Result<Response<HandOffResponse>, Status> {
        let r = req.into_inner();
        let cap = self.parse_id(&r.reservation_id)?;
        let stay = |cap: Capability| async move {
            self.inbox.call(|reply| Command::Stay { cap, reply }).await
        };
        let Some(target) = r.target else {
            stay(cap).await?;
            return Ok(Response::new(HandOffResponse::default()));
        };
        let (id, blocks, kv_tokens) =
            self.inbox.call(|reply| Command::Export { cap, reply }).await?;
        let t0 = std::time::Instant::now();
        match self.push(&target, blocks, kv_tokens).await {
            Ok((bytes, transport)) => {
                let _ = self.inbox.tx.send(Command::Moved { id }).await;
                tracing::info!(
                    reservation = id,
                    to = target.decode_node,
                    bytes,
                    transport,
                    "handed a request off with its KV"
                );
                Ok(Response::new(HandOffResponse {
                    bytes,
                    transport: transport.into(),
                    transfer_ms: t0.elapsed().as_secs_f64() * 1e3,
                }))
            }
            Err(s) => {
                tracing::warn!(
                    reservation = id,
                    to = target.decode_node,
                    "hand-off failed, the request stays: {}",
                    s.message()
                );
                stay(cap).await?;
                Err(s)
            }
        }
    }

    async fn cancel_request(
        &self,
        req: Request<NodeCancelRequest>,
    ) -> Result<Response<NodeCancelResponse>, Status> {
        let NodeCancelRequest { request_id, owner } = req.into_inner();
        let (reply, rx) = oneshot::channel();
        let stopped = || self.inbox.status(&DecodeError::EngineStopped);
        let cmd = Command::Cancel { owner, request_id, reply };
        self.inbox.tx.send(cmd).await.map_err(|_| stopped())?;
        let found = rx.await.map_err(|_| stopped())?;
        Ok(Response::new(NodeCancelResponse { found }))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let (reply, rx) = oneshot::channel();
        let stopped = || self.inbox.status(&DecodeError::EngineStopped);
        self.inbox.tx.send(Command::Drain { reply }).await.map_err(|_| stopped())?;
        let requests = rx.await.map_err(|_| stopped())?;
        self.drain.cancel();
        Ok(Response::new(DrainResponse { requests: requests as u32 }))
    }
}

impl DecodeService {
    /// Pushes a moving request's KV (`kv_tokens` tokens in `blocks`) into `target`.
    async fn push(
        &self,
        target: &KvTarget,
        blocks: Vec<Vec<u8>>,
        kv_tokens: usize,
    ) -> Result<(u64, &'static str), Status> {
        let layout = target.layout.as_ref();
        pdmesh_kv_transfer::check_layout(&self.inbox.layout, layout, &target.decode_node)?;
        if target.prompt_tokens as usize != kv_tokens || target.blocks as usize != blocks.len() {
            return Err(Status::invalid_argument(format!(
                "target: {} tokens in {} blocks, the request holds {kv_tokens} in {}",
                target.prompt_tokens,
                target.blocks,
                blocks.len()
            )));
        }
        let mut sink = self.transport.open(target, self.node_id()).await?;
        let n = blocks.len() as u32;
        for (i, b) in blocks.into_iter().enumerate() {
            let piece = KvPiece { first_block: i as u32, layer: None, data: Bytes::from(b) };
            sink.send(piece).await?;
        }
        let done = sink.finish(n, Vec::new()).await?;
        Ok((done.bytes, done.transport))
    }
}

/// A mark as the wire carries it.
fn mark_to_wire(m: pdmesh_engine::Mark) -> DecodeMark {
    DecodeMark {
        tokens: m.tokens,
        rng_position: pdmesh_wire::rng_position_bytes(m.rng_position),
        logprobs: m.logprobs.iter().map(pdmesh_wire::logprobs_to_wire).collect(),
    }
}
