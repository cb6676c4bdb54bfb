//! The `pdmesh.v1.Decode` service: validate, hand to the engine thread, map the result.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_common::convert::{finish_reason, sampling_from};
use pdmesh_kv_transfer::{KvPool, TransferStats};
use pdmesh_proto::v1::decode_server::Decode;
use pdmesh_proto::v1::kv_chunk::Chunk;
use pdmesh_proto::v1::{
    DecodeEvent, DecodeFinished, DecodeRequest, Delta, KvAccepted, KvChunk, KvCommitted, KvHeader,
    KvLayout, KvSessionEvent, KvSessionRequest, KvTarget, NodeLoad, NodeStats, PushKvResponse,
    ReleaseRequest, ReleaseResponse, ReserveRequest, ReserveResponse, Role, StatsRequest,
    decode_event, decode_request, kv_session_event, kv_session_request,
};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use pdmesh_common::trace;

use crate::core::{Attach, Counts, Event, Start};
use crate::error::{DecodeError, to_status};
use crate::worker::{ChannelOutput, Command};

#[derive(Debug, Clone)]
pub struct DecodeService {
    pub node_id: String,
    pub address: String,
    pub layout: KvLayout,
    pub context: usize,
    pub tx: mpsc::Sender<Command>,
    pub counts: Arc<Mutex<Counts>>,
    /// The registered KV pool when this node offers UCX.
    pub pool: Option<KvPool>,
    pub stats: Arc<TransferStats>,
}

/// Tells the engine thread a transfer's stream ended, however the handler exits.
struct TransferEnd {
    tx: mpsc::Sender<Command>,
    id: u64,
}

impl Drop for TransferEnd {
    fn drop(&mut self) {
        let (tx, id) = (self.tx.clone(), self.id);
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

type EventStream = Pin<Box<dyn Stream<Item = Result<DecodeEvent, Status>> + Send>>;

impl DecodeService {
    fn status(&self, e: &DecodeError) -> Status {
        to_status(e, &self.node_id)
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, DecodeError>>) -> Command,
    ) -> Result<T, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| self.status(&DecodeError::ShuttingDown))?;
        let r = rx.await.map_err(|_| self.status(&DecodeError::ShuttingDown))?;
        r.map_err(|e| self.status(&e))
    }

    fn parse_id(&self, s: &str) -> Result<u64, Status> {
        s.parse().map_err(|_| {
            Status::invalid_argument(format!(
                "node {}: reservation_id {s:?} is not a reservation id",
                self.node_id
            ))
        })
    }

    /// Checks a transfer's header and tells the engine thread it starts.
    async fn begin(&self, header: Option<KvHeader>, writer: bool) -> Result<(u64, String), Status> {
        let header =
            header.ok_or_else(|| Status::invalid_argument("a KV stream starts with a header"))?;
        let from = if header.prefill_node.is_empty() {
            "a prefill node".into()
        } else {
            header.prefill_node.clone()
        };
        pdmesh_kv_transfer::check_layout(&self.layout, header.layout.as_ref(), &from).map_err(
            |s| Status::new(s.code(), format!("node {}: {}", self.node_id, s.message())),
        )?;
        let id = self.parse_id(&header.reservation_id)?;
        let f = from.clone();
        self.call(|reply| Command::KvBegin { id, from: f, writer, reply }).await?;
        Ok((id, from))
    }

    /// The span of one incoming transfer, a child of the sender's transfer span (named in the
    /// header: the control messages carry the trace, whatever carries them).
    fn receive_span(&self, header: Option<&KvHeader>, transport: &'static str) -> Span {
        let span = pdmesh_common::span!(
            "decode.kv_receive",
            transport,
            reservation_id = Empty,
            prefill_node = Empty,
            blocks = Empty,
            layers = self.layout.layers as i64,
            bytes = Empty,
            bandwidth_mb_s = Empty,
        );
        if let Some(h) = header {
            trace::continue_from(&span, &h.traceparent);
            span.record("reservation_id", h.reservation_id.as_str());
            span.record("prefill_node", h.prefill_node.as_str());
        }
        span
    }

    pub fn load(counts: &Counts) -> NodeLoad {
        NodeLoad {
            queued: counts.queued + counts.reserved + counts.transferring,
            running: counts.decoding + counts.prefilling,
            free_blocks: counts.total_blocks.saturating_sub(counts.committed_blocks),
            total_blocks: counts.total_blocks,
            committed_blocks: counts.committed_blocks,
            cache_blocks: 0,
        }
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
        let remote_kv = r.remote_kv;
        let res = self
            .call(|reply| Command::Reserve { prompt_len, max_tokens, lease, remote_kv, reply })
            .await?;
        tracing::debug!(
            request = r.request_id,
            reservation = res.id,
            blocks = res.prompt_blocks,
            "reserved"
        );
        let ucx = match (&self.pool, remote_kv) {
            (Some(pool), true) => Some(pool.target(&res.pool_blocks)),
            _ => None,
        };
        Ok(Response::new(ReserveResponse {
            target: Some(KvTarget {
                reservation_id: res.id.to_string(),
                decode_node: self.node_id.clone(),
                address: self.address.clone(),
                layout: Some(self.layout.clone()),
                blocks: res.prompt_blocks as u32,
                prompt_tokens: r.prompt_tokens,
                ucx,
            }),
            lease_ms: res.lease.as_millis().min(u128::from(u32::MAX)) as u32,
        }))
    }

    async fn release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let id = self.parse_id(&req.into_inner().reservation_id)?;
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Release { id, reply })
            .await
            .map_err(|_| self.status(&DecodeError::ShuttingDown))?;
        let released = rx.await.map_err(|_| self.status(&DecodeError::ShuttingDown))?;
        Ok(Response::new(ReleaseResponse { released }))
    }

    type DecodeStream = EventStream;

    async fn decode(
        &self,
        req: Request<DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let r = req.into_inner();
        let id = self.parse_id(&r.reservation_id)?;
        let (sampling, rng_position) = sampling_from(r.sampler.as_ref())?;
        let start = match r.start {
            Some(decode_request::Start::FirstToken(t)) => Start::FirstToken(t),
            Some(decode_request::Start::PrefillLocally(true)) => Start::Local,
            _ => return Err(Status::invalid_argument("start: set first_token or prefill_locally")),
        };
        if r.max_tokens == 0 {
            return Err(Status::invalid_argument("max_tokens must be at least 1"));
        }
        let max_tokens = (r.max_tokens as usize).min(self.context);
        let attach = Box::new(Attach {
            prompt: r.prompt,
            sampling,
            rng_position,
            max_tokens,
            stops: r.stop,
            ignore_eos: r.ignore_eos,
            start,
            span: Span::current(),
        });
        let (out, rx) = ChannelOutput::channel(max_tokens);
        self.call(|reply| Command::Attach { id, attach, out, reply }).await?;
        let node = self.node_id.clone();
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |ev| match ev {
            Event::Delta(p) => Ok(DecodeEvent {
                event: Some(decode_event::Event::Delta(Delta {
                    text: p.text,
                    token_ids: p.tokens,
                })),
            }),
            Event::Finished { reason, completion_tokens, queue_ms, prefill_ms } => {
                Ok(DecodeEvent {
                    event: Some(decode_event::Event::Finished(DecodeFinished {
                        reason: finish_reason(reason) as i32,
                        completion_tokens,
                        queue_ms,
                        prefill_ms,
                    })),
                })
            }
            Event::Failed(e) => Err(to_status(&e, &node)),
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn push_kv(
        &self,
        req: Request<Streaming<KvChunk>>,
    ) -> Result<Response<PushKvResponse>, Status> {
        let mut s = req.into_inner();
        let header = match s.message().await? {
            Some(KvChunk { chunk: Some(Chunk::Header(h)) }) => Some(h),
            _ => None,
        };
        let span = self.receive_span(header.as_ref(), "grpc");
        trace::in_span(&span, self.receive(s, header)).await
    }

    type KvSessionStream = Pin<Box<dyn Stream<Item = Result<KvSessionEvent, Status>> + Send>>;

    async fn kv_session(
        &self,
        req: Request<Streaming<KvSessionRequest>>,
    ) -> Result<Response<Self::KvSessionStream>, Status> {
        if self.pool.is_none() {
            return Err(Status::failed_precondition(format!(
                "node {}: this decode node offers no UCX (kv_transport = grpc)",
                self.node_id
            )));
        }
        let mut inbound = req.into_inner();
        let header = match inbound.message().await? {
            Some(KvSessionRequest { msg: Some(kv_session_request::Msg::Open(h)) }) => Some(h),
            _ => None,
        };
        let span = self.receive_span(header.as_ref(), "ucx");
        let started = std::time::Instant::now();
        let (id, from) = trace::in_span(&span, self.begin(header, true)).await?;
        let end = TransferEnd { tx: self.tx.clone(), id };
        let (events, rx) = mpsc::channel(2);
        let accepted =
            KvSessionEvent { event: Some(kv_session_event::Event::Accepted(KvAccepted {})) };
        let _ = events.try_send(Ok(accepted));
        let this = self.clone();
        let session = async move {
            // Until the commit (or the end of the stream) the prefill node may be putting.
            let outcome = match inbound.message().await {
                Ok(Some(KvSessionRequest { msg: Some(kv_session_request::Msg::Commit(e)) })) => {
                    let (blocks, checksums) = (e.blocks as usize, e.checksums);
                    let bytes = blocks as u64
                        * pdmesh_kv_transfer::bytes_per_block(&this.layout).unwrap_or(0) as u64;
                    let r =
                        this.call(|reply| Command::KvEnd { id, blocks, checksums, reply }).await;
                    let secs = started.elapsed().as_secs_f64();
                    this.stats.record("ucx", r.as_ref().ok().map(|()| bytes), secs);
                    received(&Span::current(), blocks, bytes, secs);
                    r.map(|()| bytes)
                }
                Ok(Some(_)) => {
                    Err(Status::invalid_argument("a UCX session takes one commit after its open"))
                }
                Ok(None) => Err(Status::cancelled("the session ended before its commit")),
                Err(s) => Err(s),
            };
            match outcome {
                Ok(bytes) => {
                    let ev = KvSessionEvent {
                        event: Some(kv_session_event::Event::Committed(KvCommitted { bytes })),
                    };
                    let _ = events.send(Ok(ev)).await;
                }
                Err(st) => {
                    tracing::info!(reservation = id, from, "UCX session failed: {}", st.message());
                    trace::fail(&Span::current(), &st);
                    let why = DecodeError::TransferBroken { from, why: st.message().to_string() };
                    let _ = this.tx.send(Command::KvAbort { id, why }).await;
                    let _ = events.send(Err(st)).await;
                }
            }
            // Dropping `end` reports the writer closed: the prefill node flushed before its
            // commit, and ended or lost the stream otherwise.
            drop(end);
        };
        tokio::spawn(session.instrument(span));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<NodeStats>, Status> {
        let c = *self.counts.lock().expect("counts lock is never poisoned");
        Ok(Response::new(NodeStats {
            node_id: self.node_id.clone(),
            role: Role::Decode as i32,
            load: Some(Self::load(&c)),
            layout: Some(self.layout.clone()),
            queued: c.queued,
            prefilling: c.prefilling,
            transferring: c.transferring,
            decoding: c.decoding,
            reserved: c.reserved,
            completed: c.completed,
            cancelled: c.cancelled,
            failed: c.failed,
            leases_expired: c.leases_expired,
            transports: self.stats.snapshot(),
            prefix_cache: None,
        }))
    }
}

/// Records a completed transfer's size and speed on its span.
fn received(span: &Span, blocks: usize, bytes: u64, secs: f64) {
    span.record("blocks", blocks as i64);
    span.record("bytes", bytes as i64);
    if secs > 0.0 {
        span.record("bandwidth_mb_s", bytes as f64 / secs / 1e6);
    }
}

impl DecodeService {
    /// A `PushKv` stream after its header: blocks into the reservation until the end marker.
    async fn receive(
        &self,
        mut s: Streaming<KvChunk>,
        header: Option<KvHeader>,
    ) -> Result<Response<PushKvResponse>, Status> {
        let started = std::time::Instant::now();
        let (id, from) = self.begin(header, false).await?;
        let _end = TransferEnd { tx: self.tx.clone(), id };
        let mut bytes = 0u64;
        let abort = |why: String| Command::KvAbort {
            id,
            why: DecodeError::TransferBroken { from: from.clone(), why },
        };
        loop {
            let msg = match s.message().await {
                Ok(Some(m)) => m,
                Ok(None) => {
                    let _ =
                        self.tx.send(abort("the stream ended before the end marker".into())).await;
                    return Err(Status::invalid_argument("KV stream ended without an end marker"));
                }
                Err(st) => {
                    let _ = self.tx.send(abort(st.message().to_string())).await;
                    return Err(st);
                }
            };
            match msg.chunk {
                Some(Chunk::Blocks(b)) => {
                    bytes += b.data.len() as u64;
                    let cmd =
                        Command::KvWrite { id, first_block: b.first_block as usize, data: b.data };
                    self.tx.send(cmd).await.map_err(|_| self.status(&DecodeError::ShuttingDown))?;
                }
                Some(Chunk::End(e)) => {
                    let (blocks, checksums) = (e.blocks as usize, e.checksums);
                    let r =
                        self.call(|reply| Command::KvEnd { id, blocks, checksums, reply }).await;
                    let secs = started.elapsed().as_secs_f64();
                    self.stats.record("grpc", r.as_ref().ok().map(|()| bytes), secs);
                    r?;
                    received(&Span::current(), blocks, bytes, secs);
                    return Ok(Response::new(PushKvResponse { bytes }));
                }
                _ => {
                    let _ = self.tx.send(abort("unexpected message in the KV stream".into())).await;
                    return Err(Status::invalid_argument("unexpected message in the KV stream"));
                }
            }
        }
    }
}
