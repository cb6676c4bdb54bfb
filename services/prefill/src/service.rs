//! The `pdmesh.v1.Prefill` service: check the request and the KV layout, open the transfer,
//! queue the prompt on the engine thread, and relay what it produces — blocks to the decode
//! node, then the first token and the transfer's outcome to the caller. If the caller goes
//! away, everything stops: the engine drops the prompt and the transfer is aborted.

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_common::convert::{ms, rng_position_bytes, sampling_from};
use pdmesh_kv_transfer::{KvSink, KvTransport, TransferStats};
use pdmesh_proto::v1::prefill_server::Prefill;
use pdmesh_proto::v1::{
    KvLayout, NodeLoad, NodeStats, PrefillComputed, PrefillEvent, PrefillRequest,
    PrefillTransferred, Role, StatsRequest, prefill_event,
};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use pdmesh_common::trace;

use crate::core::{Counts, Job, Out, PushMode};
use crate::error::{PrefillError, to_status};
use crate::worker::{ChannelOutput, Submit};

#[derive(Debug, Clone)]
pub struct PrefillService {
    pub node_id: String,
    pub layout: KvLayout,
    pub tx: mpsc::Sender<Submit>,
    pub transport: Arc<dyn KvTransport>,
    pub stats: Arc<TransferStats>,
    /// When KV goes to the transport (`layer` needs a layered transport, else `chunk`).
    pub push: PushMode,
    /// Send each block's checksum for the decode node to verify.
    pub verify: bool,
    /// The prefix cache: the node's own tier and/or the KV-store.
    pub cache: Option<Arc<crate::cache::PrefixCache>>,
    pub counts: Arc<Mutex<Counts>>,
    pub transferring: Arc<AtomicU32>,
    pub fault_delay: Duration,
}

impl PrefillService {
    fn cache_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.local_capacity())
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<PrefillEvent, Status>> + Send>>;

impl PrefillService {
    pub fn load(counts: &Counts, transferring: u32, cache_blocks: usize) -> NodeLoad {
        NodeLoad {
            cache_blocks: u32::try_from(cache_blocks).unwrap_or(u32::MAX),
            queued: counts.queued,
            running: counts.prefilling + transferring,
            free_blocks: counts.free_blocks,
            total_blocks: counts.total_blocks,
            committed_blocks: counts.total_blocks - counts.free_blocks,
        }
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

#[tonic::async_trait]
impl Prefill for PrefillService {
    type PrefillStream = EventStream;

    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let r = req.into_inner();
        let node = self.node_id.clone();
        let target = r.target.ok_or_else(|| Status::invalid_argument("target is missing"))?;
        pdmesh_kv_transfer::check_layout(&self.layout, target.layout.as_ref(), &target.decode_node)
            .map_err(|s| Status::new(s.code(), format!("node {node}: {}", s.message())))?;
        let (sampling, rng_position) = sampling_from(r.sampler.as_ref())?;
        let blocks = r.prompt.len().div_ceil(self.layout.block_size.max(1) as usize);
        if target.blocks as usize != blocks || target.prompt_tokens as usize != r.prompt.len() {
            return Err(Status::invalid_argument(format!(
                "target expects {} tokens in {} blocks, the prompt has {} tokens",
                target.prompt_tokens,
                target.blocks,
                r.prompt.len()
            )));
        }
        // The transfer's span runs from opening the sink to the decode node's acknowledgement;
        // the decode node's side of it is its child, through the control messages. `tail_ms`
        // and the bandwidth cover what is left after the first token: what decoding waits for.
        let transfer = pdmesh_common::span!(
            "prefill.kv_transfer",
            decode_node = %target.decode_node,
            reservation_id = %target.reservation_id,
            transport = Empty,
            push = Empty,
            blocks = i64::from(target.blocks),
            layers = i64::from(self.layout.layers),
            bytes = Empty,
            tail_ms = Empty,
            bandwidth_mb_s = Empty,
        );
        let opened = self.transport.open(&target, &node).instrument(transfer.clone()).await;
        let mut sink: Box<dyn KvSink> = opened.map_err(|e| {
            let s = Status::from(e);
            trace::fail(&transfer, &s);
            s
        })?;
        transfer.record("transport", sink.transport());

        let push = match self.push {
            PushMode::Layer if !sink.layered() => PushMode::Chunk,
            p => p,
        };
        // At most one piece per layer per block.
        transfer.record("push", tracing::field::display(push));
        let pieces = blocks * (self.layout.layers.max(1) as usize);
        let (out, mut block_rx, mut done_rx) = ChannelOutput::channel(pieces);
        let (reply, accepted) = oneshot::channel();
        let lookup = match &self.cache {
            Some(c) => c.lookup(&r.prompt).await,
            None => crate::cache::Lookup::default(),
        };
        let job = Job {
            prompt: r.prompt,
            sampling,
            rng_position,
            push,
            checksums: self.verify,
            cached: lookup.cached,
            publish: self.cache.is_some(),
            span: Span::current(),
        };
        let cache = self.cache.clone();
        let chain = lookup.chain;
        let closed = || to_status(&PrefillError::ShuttingDown, &node);
        self.tx.send(Submit { job, out, reply }).await.map_err(|_| closed())?;
        accepted.await.map_err(|_| closed())?.map_err(|e| to_status(&e, &node))?;

        let (events, rx) = mpsc::channel::<Result<PrefillEvent, Status>>(4);
        let transport = sink.transport();
        let stats = Arc::clone(&self.stats);
        let gauge = Arc::clone(&self.transferring);
        let delay = self.fault_delay;
        let request_id = r.request_id;
        let relay_task = async move {
            let relay = async {
                // Blocks go out as the engine produces them; the first token is reported as
                // soon as it exists, while the last blocks may still be in flight.
                let push = async {
                    while let Some(o) = block_rx.recv().await {
                        if let Out::Blocks(piece) = o {
                            if !delay.is_zero() {
                                tokio::time::sleep(delay).await;
                            }
                            sink.send(piece).await.map_err(Status::from)?;
                        }
                    }
                    Ok::<_, Status>(())
                }
                .instrument(transfer.clone());
                let computed = async {
                    match done_rx.recv().await {
                        Some(Out::Computed {
                            first_token,
                            rng_position,
                            queue_ms,
                            prefill_ms,
                            blocks,
                            checksums,
                            cached_tokens,
                            computed_blocks,
                        }) => {
                            if let Some(c) = &cache {
                                let first = chain.len() - computed_blocks.len();
                                c.publish(&chain, first, computed_blocks);
                            }
                            let g = Gauge::up(&gauge);
                            let ev = PrefillComputed {
                                first_token,
                                rng_position: rng_position_bytes(rng_position),
                                queue_ms,
                                prefill_ms,
                                cached_tokens,
                            };
                            let ev =
                                PrefillEvent { event: Some(prefill_event::Event::Computed(ev)) };
                            // A closed stream is noticed by the select below.
                            let _ = events.send(Ok(ev)).await;
                            Ok((Instant::now(), blocks, checksums, g))
                        }
                        Some(Out::Failed(e)) => Err(to_status(&e, &node)),
                        _ => Err(to_status(&PrefillError::ShuttingDown, &node)),
                    }
                };
                let ((), (t0, blocks, checksums, _gauge)) = tokio::try_join!(push, computed)?;
                let done = sink.finish(blocks, checksums).instrument(transfer.clone()).await;
                let secs = t0.elapsed().as_secs_f64();
                stats.record(transport, done.as_ref().ok().copied(), secs);
                let bytes = done.map_err(Status::from)?;
                transfer.record("bytes", bytes as i64);
                transfer.record("tail_ms", secs * 1e3);
                if secs > 0.0 {
                    transfer.record("bandwidth_mb_s", bytes as f64 / secs / 1e6);
                }
                let ev = PrefillTransferred {
                    transfer_ms: ms(t0.elapsed()),
                    bytes,
                    transport: transport.into(),
                };
                let _ = events
                    .send(Ok(PrefillEvent { event: Some(prefill_event::Event::Transferred(ev)) }))
                    .await;
                Ok(())
            };
            // The caller leaving ends the relay: dropping the receivers stops the engine work
            // and dropping the sink aborts the transfer.
            let result: Result<(), Status> = tokio::select! {
                r = relay => r,
                () = events.closed() => {
                    tracing::info!(request = request_id, "caller went away; prefill aborted");
                    Ok(())
                }
            };
            if let Err(s) = result {
                tracing::warn!(request = request_id, "prefill failed: {}", s.message());
                trace::fail(&transfer, &s);
                let _ = events.send(Err(s)).await;
            }
        };
        tokio::spawn(relay_task.in_current_span());
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<NodeStats>, Status> {
        let c = *self.counts.lock().expect("counts lock is never poisoned");
        let transferring = self.transferring.load(Ordering::Relaxed);
        Ok(Response::new(NodeStats {
            node_id: self.node_id.clone(),
            role: Role::Prefill as i32,
            load: Some(Self::load(&c, transferring, self.cache_blocks())),
            layout: Some(self.layout.clone()),
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
        }))
    }
}
