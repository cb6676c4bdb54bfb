//! The UCX KV transport's sending half. The data path is one-sided: the prefill node puts each block (or each
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

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use pdmesh_kv_transfer::{
    Finished, GrpcTransport, KvPiece, KvSink, KvTransport, StallBound, TransferError,
};
use pdmesh_kv_types::KvLayout;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::{
    KvAbandon, KvEnd, KvHeader, KvSessionEvent, KvSessionRequest, KvTarget, kv_session_event,
    kv_session_request,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::descriptor::{self, UcxShared, UcxTarget};
use crate::scope::Keys;
use crate::ucx::{Mapped, Peer, Peers, Pending, UcxError, UcxNode};

/// Puts a transfer keeps in flight before it waits for the oldest ones.
const MAX_PENDING: usize = 1024;
/// Copies into a mapped pool (one per piece) a transfer keeps in flight.
const MAX_COPIES: usize = 8;

/// How long an abandoned session waits for its puts before its endpoint is let go.
const QUIESCE: Duration = Duration::from_secs(30);
#[derive(Debug)]
pub struct UcxTransport {
    grpc: Arc<GrpcTransport>,
    peers: Peers,
    stall: StallBound,
}

impl UcxTransport {
    /// `grpc` supplies the channels of the control path.
    pub fn new(node: UcxNode, grpc: Arc<GrpcTransport>) -> Self {
        Self { grpc, peers: Peers::new(node), stall: StallBound::default() }
    }

    /// Sessions making no progress within `stall` are given up.
    pub fn with_stall(mut self, stall: StallBound) -> Self {
        self.stall = stall;
        self
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
    fn name(&self) -> &str {
        descriptor::NAME
    }

    async fn open(
        &self,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        let node = target.decode_node.clone();
        let ucx: UcxTarget = match &target.remote {
            Some(d) if d.transport == descriptor::NAME => descriptor::open(d)
                .map_err(|reason| TransferError::BadTarget { node: node.clone(), reason })?,
            _ => return Err(no_endpoint(&node, "the decode node offers no UCX target")),
        };
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
                Ok(Some(KvSessionEvent { event: Some(kv_session_event::Event::Accepted(a)) })) => {
                    Ok((events, a.direct))
                }
                Ok(_) => Err(unreachable(&node, "the session ended before it was accepted")),
                Err(s) => Err(TransferError::from_peer(&node, s)),
            }
        };
        let opened = tokio::time::timeout(self.stall.limit(0), async {
            tokio::join!(Keys::unpack(&peer.ep, &ucx.ranges), accept)
        });
        let Ok((keys, events)) = opened.await else {
            self.peers.evict(&peer);
            return Err(TransferError::Stalled {
                node,
                reason: format!("the session was not open after {:?}", self.stall.limit(0)),
                resendable: false,
            });
        };
        let keys = keys.map_err(|e| {
            self.peers.evict(&peer);
            no_endpoint(&node, e)
        })?;
        let (events, shared) = events?;
        // The decode node offers its pool's shared memory to a writer on its host: mapped
        // here, blocks go in by one memcpy each. Should this process not be able to open its
        // key (not the node's user on its host) or UCX not map it, puts carry them.
        let shared = shared.map(|d| descriptor::open::<UcxShared>(&d)).transpose();
        let shared =
            shared.map_err(|reason| TransferError::BadTarget { node: node.clone(), reason })?;
        let mapped = match shared.and_then(|s| s.range.map(|r| (r, s.key_file))) {
            Some((sh, key_file)) => {
                let open = |k: &bytes::Bytes| {
                    crate::same_host::open(&key_file, k).map_err(UcxError::Usage)
                };
                match peer.shared(&sh.rkey, sh.base, sh.len, open).await {
                    Ok(m) => Some(m),
                    Err(e) => {
                        tracing::debug!(
                            node,
                            "the decode node's shared KV pool is not mappable: {e}"
                        );
                        None
                    }
                }
            }
            None => None,
        };
        Ok(Box::new(UcxSink {
            node,
            peers: self.peers.clone(),
            peer,
            keys,
            mapped,
            addrs: ucx.block_addrs.clone(),
            thin: layout.thin_blocks(target.prompt_tokens as usize),
            layout,
            session: Some((tx, events)),
            stall: self.stall,
            pending: VecDeque::new(),
            progressed: std::time::Instant::now(),
            copies: Vec::new(),
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
    /// The decode node's pool mapped here (same host): blocks are copied in, not put.
    mapped: Option<Arc<Mapped>>,
    addrs: Vec<u64>,
    layout: KvLayout,
    /// The prompt's first blocks that travel thin (`KvLayout::thin_blocks`).
    thin: usize,
    session: Option<Session>,
    stall: StallBound,
    /// Puts in flight, oldest first, with their bytes.
    pending: VecDeque<(Pending<()>, u64)>,
    /// When a put last completed, or the session last had none in flight.
    progressed: std::time::Instant,
    /// Copies into the mapped pool still running.
    copies: Vec<JoinHandle<()>>,
    bytes: u64,
}

/// One run of bytes to copy into the mapped pool: the source and where it goes here.
type CopyRun = (bytes::Bytes, usize);

impl UcxSink {
    fn fail(&self, e: UcxError) -> TransferError {
        self.peers.evict(&self.peer);
        unreachable(&self.node, e)
    }

    /// Takes the puts that completed, oldest first, and waits while more than `keep` are in
    /// flight. Puts complete in order, so an oldest put with no completion for its bound
    /// (counted from the last one) is the session stalling: it is given up, whether waited
    /// on here or found while pieces are still coming.
    async fn settle(&mut self, keep: usize) -> Result<(), TransferError> {
        loop {
            let waiting = self.pending.len() > keep;
            let Some((p, bytes)) = self.pending.front_mut() else { break };
            let limit = self.stall.limit(*bytes);
            let done = if waiting {
                let left = limit.saturating_sub(self.progressed.elapsed());
                tokio::time::timeout(left, p).await.ok()
            } else {
                p.try_take()
            };
            match done {
                Some(r) => {
                    self.pending.pop_front();
                    self.progressed = std::time::Instant::now();
                    r.map_err(|e| self.fail(e))?;
                }
                None if self.progressed.elapsed() >= limit => {
                    let outstanding: u64 = self.pending.iter().map(|(_, b)| b).sum();
                    let why = format!(
                        "no UCX put completed in {limit:?} ({} puts, {outstanding} bytes \
                         outstanding)",
                        self.pending.len()
                    );
                    return Err(self.give_up(why).await);
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Gives the session up: the decode node is asked to move the reservation onto blocks
    /// this session's late puts cannot reach, so the KV can be sent again another way. The
    /// session itself stays open until the puts are over (`Drop`).
    async fn give_up(&mut self, reason: String) -> TransferError {
        tracing::warn!(node = self.node, "giving up a UCX session: {reason}");
        let limit = self.stall.limit(0);
        let resendable = match &mut self.session {
            Some((tx, events)) => {
                let abandon = KvSessionRequest {
                    msg: Some(kv_session_request::Msg::Abandon(KvAbandon {
                        reason: reason.clone(),
                    })),
                };
                let answered = async {
                    tx.send(abandon).await.ok()?;
                    events.message().await.ok().flatten()
                };
                matches!(
                    tokio::time::timeout(limit, answered).await,
                    Ok(Some(KvSessionEvent { event: Some(kv_session_event::Event::Abandoned(_)) }))
                )
            }
            None => false,
        };
        TransferError::Stalled { node: self.node.clone(), reason, resendable }
    }

    /// Waits for all but the last `keep` copies.
    async fn settle_copies(&mut self, keep: usize) -> Result<(), TransferError> {
        let n = self.copies.len().saturating_sub(keep);
        // Awaited in place: a sink dropped meanwhile leaves the rest to `Drop`, which keeps
        // the session open until they are done.
        for _ in 0..n {
            let r = (&mut self.copies[0]).await;
            self.copies.remove(0);
            r.map_err(|e| unreachable(&self.node, format!("a copy into the KV pool failed: {e}")))?;
        }
        Ok(())
    }

    /// Where `len` bytes at the decode node's `start` are mapped here, when they lie in the
    /// mapped pool.
    fn local(&self, start: u64, len: u64) -> Option<usize> {
        let m = self.mapped.as_ref()?;
        let off = start.checked_sub(m.base)?;
        (off.checked_add(len)? <= m.len).then(|| m.local + off as usize)
    }

    /// Starts copying `plan` into the mapped pool on a blocking thread, which holds the peer
    /// (and with it the mapping) until it is done.
    fn copy(&mut self, plan: Vec<CopyRun>) {
        let peer = Arc::clone(&self.peer);
        let mapped = self.mapped.clone();
        self.copies.push(tokio::task::spawn_blocking(move || {
            let _alive = (peer, mapped);
            for (src, dst) in plan {
                // SAFETY: `dst..dst + len` lies inside the peer's pool as mapped here (`local`
                // checked it) and inside one of this reservation's granted ranges (`send`
                // checked it), which the decode node neither reads nor writes until the
                // commit; `_alive` keeps the mapping. Source and destination are distinct
                // memory.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len())
                };
            }
        }));
    }
}

#[async_trait::async_trait]
impl KvSink for UcxSink {
    fn transport(&self) -> &'static str {
        descriptor::NAME
    }

    fn layered(&self) -> bool {
        true
    }

    fn mapped(&self) -> bool {
        self.mapped.is_some()
    }

    async fn send(&mut self, piece: KvPiece) -> Result<(), TransferError> {
        let invalid = |reason: String| TransferError::Invalid { node: self.node.clone(), reason };
        let (l, thin) = (&self.layout, self.thin);
        let len = piece.data.len() as u64;
        let first = piece.first_block as usize;
        // Each block's part of the piece: (block, at in the piece, bytes, at in the block). A
        // block's wire form (a thin one, its global layers) starts its slot; a layer's part
        // goes where the wire form holds it.
        let mut parts = Vec::new();
        match piece.layer {
            None => {
                let blocks = l.split_wire(first, thin, &piece.data).filter(|b| !b.is_empty());
                let blocks = blocks.ok_or_else(|| {
                    invalid(format!("{len} bytes at block {first} are not whole blocks"))
                })?;
                let mut at = 0;
                for (i, b) in blocks.iter().enumerate() {
                    parts.push((first + i, at, b.len(), 0));
                    at += b.len();
                }
            }
            Some(layer) => {
                let layers = l.geometry.layers;
                if layer as usize >= layers {
                    return Err(invalid(format!(
                        "layer {layer} is past the model's {layers} layers"
                    )));
                }
                let unit = l.geometry.bytes_per_layer();
                if len == 0 || !piece.data.len().is_multiple_of(unit) {
                    return Err(invalid(format!("{len} bytes are not whole layers of {unit}")));
                }
                for i in 0..piece.data.len() / unit {
                    let b = first + i;
                    let off = l.wire_layer_offset(layer as usize, b, thin).ok_or_else(|| {
                        invalid(format!("thin block {b} travels without layer {layer}"))
                    })?;
                    parts.push((b, i * unit, unit, off));
                }
            }
        }
        if let Some(&(b, ..)) = parts.last().filter(|p| p.0 >= self.addrs.len()) {
            return Err(invalid(format!("block {b} is past the target's {}", self.addrs.len())));
        }
        // Parts that sit next to each other both in the piece and in the decode pool, within
        // one granted range, go as one put or copy. (Each block lies in a range: `open`
        // checked them all.)
        let mut plan = Vec::new();
        let mut i = 0;
        while i < parts.len() {
            let (b, at, n, off) = parts[i];
            let start = self.addrs[b] + off as u64;
            let Some(key) = self.keys.key(start, n as u64) else {
                return Err(invalid(format!(
                    "{n} bytes at {start:#x} lie outside the granted ranges"
                )));
            };
            let (mut run, mut bytes) = (1, n);
            while let Some(&(b2, at2, n2, off2)) = parts.get(i + run) {
                let next = self.addrs[b2] + off2 as u64;
                if at2 != at + bytes
                    || next != start + bytes as u64
                    || self.keys.key(start, (bytes + n2) as u64).is_none()
                {
                    break;
                }
                run += 1;
                bytes += n2;
            }
            let data = piece.data.slice(at..at + bytes);
            match self.local(start, data.len() as u64) {
                Some(dst) => plan.push((data, dst)),
                None => {
                    let len = data.len() as u64;
                    // The wait for progress starts with the first put in flight.
                    if self.pending.is_empty() {
                        self.progressed = std::time::Instant::now();
                    }
                    self.pending.push_back((self.peer.ep.put(data, start, key), len));
                }
            }
            i += run;
        }
        if !plan.is_empty() {
            self.copy(plan);
        }
        self.bytes += len;
        let keep = if self.pending.len() > MAX_PENDING { MAX_PENDING / 2 } else { usize::MAX };
        self.settle(keep).await?;
        if self.copies.len() > MAX_COPIES {
            self.settle_copies(MAX_COPIES / 2).await?;
        }
        Ok(())
    }

    async fn finish(
        mut self: Box<Self>,
        blocks: u32,
        checksums: Vec<u64>,
    ) -> Result<Finished, TransferError> {
        self.settle(0).await?;
        self.settle_copies(0).await?;
        let limit = self.stall.limit(0);
        match tokio::time::timeout(limit, self.peer.ep.flush()).await {
            Ok(r) => r.map_err(|e| self.fail(e))?,
            Err(_) => {
                return Err(self.give_up(format!("the flush did not complete in {limit:?}")).await);
            }
        }
        let (tx, mut events) =
            self.session.take().ok_or_else(|| unreachable(&self.node, "the session is gone"))?;
        let commit = KvSessionRequest {
            msg: Some(kv_session_request::Msg::Commit(KvEnd {
                blocks,
                checksums,
                bytes: self.bytes,
            })),
        };
        if tx.send(commit).await.is_err() {
            return Err(unreachable(&self.node, "the session closed before the commit"));
        }
        // The decode node checks the blocks before it answers (checksums, unstaging).
        let limit = self.stall.limit(self.bytes);
        let Ok(answer) = tokio::time::timeout(limit, events.message()).await else {
            return Err(TransferError::Stalled {
                node: self.node.clone(),
                reason: format!("the commit was not answered in {limit:?}"),
                resendable: false,
            });
        };
        match answer {
            Ok(Some(KvSessionEvent { event: Some(kv_session_event::Event::Committed(c)) })) => {
                Ok(Finished { bytes: c.bytes.max(self.bytes), transport: descriptor::NAME })
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
        let copies = std::mem::take(&mut self.copies);
        let node = self.node.clone();
        let (peers, peer) = (self.peers.clone(), Arc::clone(&self.peer));
        // The session must outlive every put: ending it lets the decode node reuse the blocks.
        let quiesce = async move {
            let mut failed = None;
            for c in copies {
                let _ = c.await;
            }
            // A put completes here once its bytes left (TCP: are in the socket); only a
            // flush says they are in the decode node's memory. Until then the session must
            // not end cleanly, or the node could reuse blocks that bytes still on the way
            // then land in.
            let landed = async {
                for (p, _) in pending {
                    if let Err(e) = p.await {
                        failed.get_or_insert(e);
                    }
                }
                if failed.is_none()
                    && let Err(e) = peer.ep.flush().await
                {
                    failed = Some(e);
                }
            };
            // Puts that never complete (a stalled session) are not waited for forever: the
            // endpoint is let go, which fails them.
            let in_time = tokio::time::timeout(QUIESCE, landed).await.is_ok();
            let (tx, mut events) = session;
            if in_time && failed.is_none() {
                // Ended cleanly: the decode node frees the blocks at once.
                drop(tx);
                let _ = tokio::time::timeout(QUIESCE, events.message()).await;
                return;
            }
            match failed {
                Some(e) => tracing::debug!(node, "aborted UCX transfer: {e}"),
                None => tracing::warn!(
                    node,
                    "an aborted UCX transfer's puts did not land in {QUIESCE:?}"
                ),
            }
            peers.evict(&peer);
            // Cancelled rather than ended: the decode node keeps the blocks a while longer
            // (kv-transfer's `session`), since nothing says what is still on the way.
            drop(events);
            drop(tx);
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
