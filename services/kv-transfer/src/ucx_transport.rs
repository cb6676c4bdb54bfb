//! The UCX KV transport, both halves. The data path is one-sided: the prefill node puts each block (or each
//! layer of each block, while later layers still compute) straight into the decode node's
//! registered KV pool at the addresses its reservation named. The control path is the decode
//! node's `KvSession` gRPC stream: open (the decode node accepts before any byte moves), then
//! after every put has completed and the endpoint is flushed, commit. The decode node never
//! reads a block before the commit.
//!
//! Endpoints and unpacked remote keys are cached per decode worker; a UCX failure evicts them.
//! A transfer dropped before its commit waits (in a background task) for its puts to finish
//! before ending the session, so the decode node reuses the blocks only once nothing more can
//! land in them.

use std::sync::Arc;

use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::{
    KvAccepted, KvCommitted, KvEnd, KvHeader, KvSessionEvent, KvSessionRequest, KvTarget,
    kv_session_event, kv_session_request,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::grpc::GrpcTransport;
use crate::inbox::{self, ClosedOnDrop, KvInbox};
use crate::scope::Keys;
use crate::ucx::{Peer, Peers, Pending, UcxError, UcxNode};
use crate::{KvPiece, KvSink, KvTransport, TransferError};

/// Puts a transfer keeps in flight before it waits for the oldest ones.
const MAX_PENDING: usize = 1024;

#[derive(Debug)]
pub struct UcxTransport {
    grpc: Arc<GrpcTransport>,
    peers: Peers,
}

impl UcxTransport {
    /// `grpc` supplies the channels of the control path.
    pub fn new(node: UcxNode, grpc: Arc<GrpcTransport>) -> Self {
        Self { grpc, peers: Peers::new(node) }
    }
}

fn no_endpoint(node: &str, reason: impl ToString) -> TransferError {
    TransferError::NoEndpoint { node: node.into(), reason: reason.to_string() }
}

fn unreachable(node: &str, reason: impl ToString) -> TransferError {
    TransferError::Unreachable { node: node.into(), reason: reason.to_string() }
}

#[async_trait::async_trait]
impl KvTransport for UcxTransport {
    fn name(&self) -> &'static str {
        "ucx"
    }

    async fn open(
        &self,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        let node = target.decode_node.clone();
        let ucx = target
            .ucx
            .as_ref()
            .ok_or_else(|| no_endpoint(&node, "the decode node offers no UCX target"))?;
        let wire_layout = target.layout.clone().unwrap_or_default();
        let layout = pdmesh_proto::layout_from_wire(&wire_layout).map_err(|e| {
            TransferError::BadTarget { node: node.clone(), reason: format!("the target's {e}") }
        })?;
        let bpb = layout.bytes_per_block() as u64;
        // Every address is checked against the ranges the decode node registered for this
        // reservation before UCX sees it: a target naming other memory is refused here.
        crate::scope::check(&ucx.ranges, &ucx.block_addrs, bpb)
            .map_err(|e| TransferError::BadTarget { node: node.clone(), reason: e.to_string() })?;
        if ucx.block_addrs.len() != target.blocks as usize {
            return Err(TransferError::BadTarget {
                node,
                reason: format!(
                    "the target names {} block addresses for {} blocks",
                    ucx.block_addrs.len(),
                    target.blocks
                ),
            });
        }
        let peer = self.peers.get(&ucx.worker_address).await.map_err(|e| no_endpoint(&node, e))?;
        // The session is accepted before anything is put: the reservation is then known to
        // be alive, and its blocks will not be reused until the session ends. Its round trip
        // and the keys' unpacking overlap.
        let channel = self.grpc.channel(&target.address, &node)?;
        let (tx, rx) = mpsc::channel(2);
        let open = KvSessionRequest {
            msg: Some(kv_session_request::Msg::Open(KvHeader {
                reservation_id: target.reservation_id.clone(),
                layout: Some(wire_layout),
                prefill_node: prefill_node.to_string(),
                traceparent: pdmesh_common::trace::traceparent().unwrap_or_default(),
                grant: crate::scope::digest(&ucx.ranges),
            })),
        };
        tx.send(open).await.map_err(|_| unreachable(&node, "the session closed"))?;
        let accept = async {
            let mut client = DecodeClient::new(channel);
            let mut events = client
                .kv_session(ReceiverStream::new(rx))
                .await
                .map_err(|s| TransferError::from_peer(&node, s))?
                .into_inner();
            match events.message().await {
                Ok(Some(KvSessionEvent { event: Some(kv_session_event::Event::Accepted(_)) })) => {
                    Ok(events)
                }
                Ok(_) => Err(unreachable(&node, "the session ended before it was accepted")),
                Err(s) => Err(TransferError::from_peer(&node, s)),
            }
        };
        let (keys, events) = tokio::join!(Keys::unpack(&peer.ep, &ucx.ranges), accept);
        let keys = keys.map_err(|e| {
            self.peers.evict(&peer);
            no_endpoint(&node, e)
        })?;
        let events = events?;
        Ok(Box::new(UcxSink {
            node,
            peers: self.peers.clone(),
            peer,
            keys,
            addrs: ucx.block_addrs.clone(),
            bpb,
            layers: layout.geometry.layers as u64,
            session: Some((tx, events)),
            pending: Vec::new(),
            bytes: 0,
        }))
    }
}

type Session = (mpsc::Sender<KvSessionRequest>, Streaming<KvSessionEvent>);

struct UcxSink {
    node: String,
    peers: Peers,
    peer: Arc<Peer>,
    /// The keys of the reservation's ranges; each put uses the one whose range holds it.
    keys: Keys,
    addrs: Vec<u64>,
    bpb: u64,
    layers: u64,
    session: Option<Session>,
    pending: Vec<Pending<()>>,
    bytes: u64,
}

impl UcxSink {
    fn fail(&self, e: UcxError) -> TransferError {
        self.peers.evict(&self.peer);
        unreachable(&self.node, e)
    }

    async fn settle(&mut self, keep: usize) -> Result<(), TransferError> {
        let n = self.pending.len().saturating_sub(keep);
        for p in self.pending.drain(..n).collect::<Vec<_>>() {
            p.await.map_err(|e| self.fail(e))?;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl KvSink for UcxSink {
    fn transport(&self) -> &'static str {
        "ucx"
    }

    fn layered(&self) -> bool {
        true
    }

    async fn send(&mut self, piece: KvPiece) -> Result<(), TransferError> {
        let (bpb, layers) = (self.bpb, self.layers);
        let (unit, offset) = match piece.layer {
            None => (bpb, 0),
            Some(l) if u64::from(l) < layers => (bpb / layers, u64::from(l) * (bpb / layers)),
            Some(l) => {
                return Err(TransferError::Invalid {
                    node: self.node.clone(),
                    reason: format!("layer {l} is past the model's {layers} layers"),
                });
            }
        };
        let len = piece.data.len() as u64;
        let first = piece.first_block as usize;
        let n = (len / unit.max(1)) as usize;
        if unit == 0 || len == 0 || !len.is_multiple_of(unit) || first + n > self.addrs.len() {
            return Err(TransferError::Invalid {
                node: self.node.clone(),
                reason: format!(
                    "{len} bytes at block {first} are not whole units of {unit} within {} blocks",
                    self.addrs.len()
                ),
            });
        }
        // Whole blocks that sit next to each other in the decode pool, within one granted
        // range, go as one put. (Each block lies in a range: `open` checked them all.)
        let mut i = 0;
        while i < n {
            let start = self.addrs[first + i] + offset;
            let Some(key) = self.keys.key(start, unit) else {
                return Err(TransferError::Invalid {
                    node: self.node.clone(),
                    reason: format!("{unit} bytes at {start:#x} lie outside the granted ranges"),
                });
            };
            let mut run = 1;
            while piece.layer.is_none()
                && i + run < n
                && self.addrs[first + i + run] == start + run as u64 * bpb
                && self.keys.key(start, (run as u64 + 1) * bpb).is_some()
            {
                run += 1;
            }
            let data = piece.data.slice(i * unit as usize..(i + run) * unit as usize);
            self.pending.push(self.peer.ep.put(data, start, key));
            i += run;
        }
        self.bytes += len;
        if self.pending.len() > MAX_PENDING {
            self.settle(MAX_PENDING / 2).await?;
        }
        Ok(())
    }

    async fn finish(
        mut self: Box<Self>,
        blocks: u32,
        checksums: Vec<u64>,
    ) -> Result<u64, TransferError> {
        self.settle(0).await?;
        self.peer.ep.flush().await.map_err(|e| self.fail(e))?;
        let (tx, mut events) =
            self.session.take().ok_or_else(|| unreachable(&self.node, "the session is gone"))?;
        let commit = KvSessionRequest {
            msg: Some(kv_session_request::Msg::Commit(KvEnd { blocks, checksums })),
        };
        if tx.send(commit).await.is_err() {
            return Err(unreachable(&self.node, "the session closed before the commit"));
        }
        match events.message().await {
            Ok(Some(KvSessionEvent { event: Some(kv_session_event::Event::Committed(c)) })) => {
                Ok(c.bytes.max(self.bytes))
            }
            Ok(_) => Err(unreachable(&self.node, "the session ended before the commit")),
            Err(s) => Err(TransferError::from_peer(&self.node, s)),
        }
    }
}

impl Drop for UcxSink {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else { return };
        let pending = std::mem::take(&mut self.pending);
        let node = self.node.clone();
        let (peers, peer) = (self.peers.clone(), Arc::clone(&self.peer));
        // The session must outlive every put: ending it lets the decode node reuse the blocks.
        let quiesce = async move {
            let mut failed = None;
            for p in pending {
                if let Err(e) = p.await {
                    failed.get_or_insert(e);
                }
            }
            if let Some(e) = failed {
                tracing::debug!(node, "aborted UCX transfer: {e}");
                peers.evict(&peer);
            }
            drop(session);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(quiesce);
            }
            Err(_) => tracing::warn!(
                node = self.node,
                "UCX transfer dropped outside a runtime; ending its session now"
            ),
        }
    }
}

/// The events a decode node's side of a UCX session sends.
pub type SessionEvents = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<KvSessionEvent, tonic::Status>> + Send>,
>;

/// The receiving half: a `KvSession` into `inbox`'s reservation. The session is accepted
/// before any byte moves; the prefill node then puts into the reservation's blocks and
/// commits; the end of the stream (however it ends) tells the node the writer can put no
/// more, and an end before the commit fails the reservation.
pub async fn accept_session(
    inbox: Arc<dyn KvInbox>,
    req: tonic::Request<Streaming<KvSessionRequest>>,
) -> Result<tonic::Response<SessionEvents>, tonic::Status> {
    use tonic::Status;
    use tracing::Instrument;
    let mut inbound = req.into_inner();
    let header = match inbound.message().await? {
        Some(KvSessionRequest { msg: Some(kv_session_request::Msg::Open(h)) }) => Some(h),
        _ => None,
    };
    let span = inbox::receive_span(&*inbox, header.as_ref(), "ucx");
    let started = std::time::Instant::now();
    let (id, from) =
        pdmesh_common::trace::in_span(&span, inbox::open(&*inbox, header, true)).await?;
    let closed = ClosedOnDrop { inbox: Arc::clone(&inbox), id };
    let (events, rx) = mpsc::channel(2);
    let accepted = KvSessionEvent { event: Some(kv_session_event::Event::Accepted(KvAccepted {})) };
    let _ = events.try_send(Ok(accepted));
    let session = async move {
        // Until the commit (or the end of the stream) the prefill node may be putting.
        let outcome = match inbound.message().await {
            Ok(Some(KvSessionRequest { msg: Some(kv_session_request::Msg::Commit(e)) })) => {
                let blocks = e.blocks as usize;
                let bytes = blocks as u64 * inbox.layout().bytes_per_block() as u64;
                let r = inbox.end(id, blocks, e.checksums).await;
                let secs = started.elapsed().as_secs_f64();
                inbox.stats().record("ucx", r.as_ref().ok().map(|()| bytes), secs);
                inbox::received(&tracing::Span::current(), blocks, bytes, secs);
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
                pdmesh_common::trace::fail(&tracing::Span::current(), &st);
                inbox.abort(id, &from, st.message().to_string()).await;
                let _ = events.send(Err(st)).await;
            }
        }
        // Dropping `closed` reports the writer closed: the prefill node flushed before its
        // commit, and ended or lost the stream otherwise.
        drop(closed);
    };
    tokio::spawn(session.instrument(span));
    Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
}
