//! The `pdmesh.v1.Decode` service: validate, hand to the engine thread, map the result.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_common::convert::{finish_reason, sampling_from};
use pdmesh_proto::v1::decode_server::Decode;
use pdmesh_proto::v1::kv_chunk::Chunk;
use pdmesh_proto::v1::{
    DecodeEvent, DecodeFinished, DecodeRequest, Delta, KvChunk, KvLayout, KvTarget, NodeLoad,
    NodeStats, PushKvResponse, ReleaseRequest, ReleaseResponse, ReserveRequest, ReserveResponse,
    Role, StatsRequest, decode_event, decode_request,
};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

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

    pub fn load(counts: &Counts) -> NodeLoad {
        NodeLoad {
            queued: counts.queued + counts.reserved + counts.transferring,
            running: counts.decoding + counts.prefilling,
            free_blocks: counts.total_blocks.saturating_sub(counts.committed_blocks),
            total_blocks: counts.total_blocks,
            committed_blocks: counts.committed_blocks,
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
        let (id, blocks, lease) =
            self.call(|reply| Command::Reserve { prompt_len, max_tokens, lease, reply }).await?;
        tracing::debug!(request = r.request_id, reservation = id, blocks, "reserved");
        Ok(Response::new(ReserveResponse {
            target: Some(KvTarget {
                reservation_id: id.to_string(),
                decode_node: self.node_id.clone(),
                address: self.address.clone(),
                layout: Some(self.layout.clone()),
                blocks: blocks as u32,
                prompt_tokens: r.prompt_tokens,
            }),
            lease_ms: lease.as_millis().min(u128::from(u32::MAX)) as u32,
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
            Some(KvChunk { chunk: Some(Chunk::Header(h)) }) => h,
            _ => return Err(Status::invalid_argument("a KV stream starts with a header")),
        };
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
        self.call(|reply| Command::KvBegin { id, from: f, reply }).await?;
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
                    let blocks = e.blocks as usize;
                    self.call(|reply| Command::KvEnd { id, blocks, reply }).await?;
                    return Ok(Response::new(PushKvResponse { bytes }));
                }
                _ => {
                    let _ = self.tx.send(abort("unexpected message in the KV stream".into())).await;
                    return Err(Status::invalid_argument("unexpected message in the KV stream"));
                }
            }
        }
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
        }))
    }
}
