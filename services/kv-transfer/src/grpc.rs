//! The gRPC KV transport, both halves. Sending: one client stream per transfer into the decode
//! node's `PushKv` (a header with the reservation and layout, block data, an end marker), on
//! channels cached per decode address; the call runs in its own task that is aborted when the
//! sink is dropped, so an abandoned transfer resets the stream. Receiving: `receive_push`
//! writes the blocks into the reservation and fails it when the stream ends early.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pdmesh_common::channels::ChannelCache;
use pdmesh_common::trace::Channel;
use pdmesh_kv_types::KvLayout;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::kv_chunk::Chunk;
use pdmesh_proto::v1::{KvBlocks, KvChunk, KvEnd, KvHeader, KvTarget, PushKvResponse};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tracing::Instrument;

use crate::inbox::{self, KvInbox};
use crate::{Finished, KvPiece, KvSink, KvTransport, TransferError};

/// Messages buffered per transfer before `send` waits for the network.
const IN_FLIGHT_MESSAGES: usize = 8;

/// The most bytes one `PushKv` message carries (whole blocks, at least one): both ends refuse
/// messages over 64 MiB, and a prefill node's piece can be larger (64 blocks of a big model's
/// KV); a receiver also buffers a whole message before it can write any of it.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Decode nodes a prefill node keeps a channel to; the least recently used goes past this
/// (addresses come with each request's target, so the set must not grow without end).
pub const MAX_CHANNELS: usize = 256;

#[derive(Debug)]
pub struct GrpcTransport {
    channels: ChannelCache<Channel>,
}

impl Default for GrpcTransport {
    fn default() -> Self {
        Self { channels: ChannelCache::new(MAX_CHANNELS) }
    }
}

impl GrpcTransport {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn channel(&self, address: &str, node: &str) -> Result<Channel, TransferError> {
        self.channels.get(address, || {
            // KV is pushed into decode nodes only (a draining one hands off to another).
            let ep = pdmesh_common::tls::endpoint(address, pdmesh_common::tls::MeshRole::Decode)
                .map_err(|e| TransferError::Unreachable {
                    node: node.into(),
                    reason: format!("bad address {address}: {e}"),
                })?
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .initial_stream_window_size(Some(8 << 20))
                .initial_connection_window_size(Some(32 << 20));
            Ok(pdmesh_common::trace::channel(ep.connect_lazy()))
        })
    }
}

#[async_trait::async_trait]
impl KvTransport for GrpcTransport {
    fn name(&self) -> &'static str {
        "grpc"
    }

    async fn open(
        &self,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        let node = target.decode_node.clone();
        let layout = target
            .layout
            .as_ref()
            .and_then(|l| pdmesh_proto::layout_from_wire(l).ok())
            .ok_or_else(|| TransferError::Invalid {
                node: node.clone(),
                reason: "the KV target carries no valid layout".into(),
            })?;
        let thin = layout.thin_blocks(target.prompt_tokens as usize);
        let channel = self.channel(&target.address, &node)?;
        let (tx, rx) = mpsc::channel(IN_FLIGHT_MESSAGES);
        let header = KvChunk {
            chunk: Some(Chunk::Header(KvHeader {
                reservation_id: target.reservation_id.clone(),
                layout: target.layout.clone(),
                prefill_node: prefill_node.to_string(),
                traceparent: pdmesh_common::trace::traceparent().unwrap_or_default(),
                // The stream is not a remote writer: it holds no grant.
                grant: 0,
            })),
        };
        tx.send(header).await.map_err(|_| closed(&node))?;
        let call = tokio::spawn(
            async move {
                let mut client = DecodeClient::new(channel)
                    .max_decoding_message_size(64 << 20)
                    .max_encoding_message_size(64 << 20);
                client.push_kv(ReceiverStream::new(rx)).await.map(|r| r.into_inner().bytes)
            }
            .in_current_span(),
        );
        Ok(Box::new(GrpcSink { node, tx: Some(tx), call: Some(call), sent: 0, layout, thin }))
    }
}

struct GrpcSink {
    node: String,
    tx: Option<mpsc::Sender<KvChunk>>,
    call: Option<JoinHandle<Result<u64, tonic::Status>>>,
    sent: u64,
    layout: KvLayout,
    /// The prompt's first blocks that travel thin (`KvLayout::thin_blocks`).
    thin: usize,
}

/// `data` (blocks from `first_block` on, `bytes(i)` each for block `i`) as messages of at
/// most `MAX_MESSAGE_BYTES` (or one block, when a block is larger), cut at block boundaries;
/// slices of the one buffer, not copies. An empty piece is still one (empty) message.
fn messages(
    first_block: u32,
    data: Bytes,
    bytes: impl Fn(usize) -> usize,
) -> impl Iterator<Item = KvBlocks> {
    let mut out = Vec::new();
    let (mut at, mut block) = (0, first_block as usize);
    loop {
        let (start, first) = (at, block);
        while at < data.len() {
            let n = bytes(block).max(1);
            if at > start && at - start + n > MAX_MESSAGE_BYTES {
                break;
            }
            at = (at + n).min(data.len());
            block += 1;
        }
        out.push(KvBlocks { first_block: first as u32, data: data.slice(start..at) });
        if at >= data.len() {
            return out.into_iter();
        }
    }
}

fn closed(node: &str) -> TransferError {
    TransferError::Unreachable { node: node.into(), reason: "the KV stream closed".into() }
}

impl GrpcSink {
    /// The call's outcome once the stream can no longer be written to.
    async fn outcome(&mut self) -> Result<u64, TransferError> {
        let call = self.call.take().ok_or_else(|| closed(&self.node))?;
        match call.await {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(status)) => Err(TransferError::from_peer(&self.node, status)),
            Err(e) => {
                Err(TransferError::Unreachable { node: self.node.clone(), reason: e.to_string() })
            }
        }
    }
}

#[async_trait::async_trait]
impl KvSink for GrpcSink {
    fn transport(&self) -> &'static str {
        "grpc"
    }

    fn layered(&self) -> bool {
        false
    }

    async fn send(&mut self, piece: KvPiece) -> Result<(), TransferError> {
        let KvPiece { first_block, layer, data } = piece;
        if layer.is_some() {
            return Err(TransferError::Invalid {
                node: self.node.clone(),
                reason: "the gRPC stream carries whole blocks, not layers".into(),
            });
        }
        let (layout, thin) = (self.layout, self.thin);
        for blocks in messages(first_block, data, |i| layout.wire_block_bytes(i, thin)) {
            let n = blocks.data.len() as u64;
            let msg = KvChunk { chunk: Some(Chunk::Blocks(blocks)) };
            let tx = self.tx.as_ref().ok_or_else(|| closed(&self.node))?;
            if tx.send(msg).await.is_err() {
                // The call ended early: its status says why.
                self.tx = None;
                return Err(self.outcome().await.err().unwrap_or_else(|| closed(&self.node)));
            }
            self.sent += n;
        }
        Ok(())
    }

    async fn finish(
        mut self: Box<Self>,
        blocks: u32,
        checksums: Vec<u64>,
    ) -> Result<Finished, TransferError> {
        if let Some(tx) = self.tx.take() {
            let end = KvChunk { chunk: Some(Chunk::End(KvEnd { blocks, checksums, bytes: 0 })) };
            // A failed send means the call already ended; its outcome says how.
            let _ = tx.send(end).await;
        }
        let bytes = self.outcome().await.map(|_| self.sent)?;
        Ok(Finished { bytes, transport: "grpc" })
    }
}

impl Drop for GrpcSink {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            call.abort();
        }
    }
}

/// The receiving half: a `PushKv` stream into `inbox`'s reservation — a header, blocks until
/// the end marker. A stream that ends or breaks before it fails the reservation.
pub async fn receive_push(
    inbox: Arc<dyn KvInbox>,
    req: tonic::Request<Streaming<KvChunk>>,
) -> Result<tonic::Response<PushKvResponse>, tonic::Status> {
    let mut s = req.into_inner();
    let header = match s.message().await? {
        Some(KvChunk { chunk: Some(Chunk::Header(h)) }) => Some(h),
        _ => None,
    };
    let span = inbox::receive_span(&*inbox, header.as_ref(), "grpc");
    pdmesh_common::trace::in_span(&span, receive(inbox, s, header)).await
}

async fn receive(
    inbox: Arc<dyn KvInbox>,
    mut s: Streaming<KvChunk>,
    header: Option<KvHeader>,
) -> Result<tonic::Response<PushKvResponse>, tonic::Status> {
    use tonic::Status;
    let started = std::time::Instant::now();
    let (id, from) = inbox::open(&*inbox, header, false).await?;
    // No `ClosedOnDrop`: a stream writes nothing once it ends, and its end must not read as
    // the end of the reservation's UCX session (after a fallback, that session may still be
    // putting into the blocks it was granted, parked until it closes).
    let mut bytes = 0u64;
    loop {
        let msg = match s.message().await {
            Ok(Some(m)) => m,
            Ok(None) => {
                inbox.abort(id, &from, "the stream ended before the end marker".into()).await;
                return Err(Status::invalid_argument("KV stream ended without an end marker"));
            }
            Err(st) => {
                inbox.abort(id, &from, st.message().to_string()).await;
                return Err(st);
            }
        };
        match msg.chunk {
            Some(Chunk::Blocks(b)) => {
                bytes += b.data.len() as u64;
                inbox.write(id, b.first_block as usize, b.data).await?;
            }
            Some(Chunk::End(e)) => {
                let blocks = e.blocks as usize;
                let r = inbox.end(id, blocks, e.checksums).await;
                let secs = started.elapsed().as_secs_f64();
                inbox.stats().record("grpc", r.as_ref().ok().map(|_| bytes), secs);
                let unstaged = r?;
                inbox::received(&tracing::Span::current(), blocks, bytes, secs, unstaged);
                return Ok(tonic::Response::new(PushKvResponse { bytes }));
            }
            _ => {
                inbox.abort(id, &from, "unexpected message in the KV stream".into()).await;
                return Err(Status::invalid_argument("unexpected message in the KV stream"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A piece over the message limit goes as several messages of whole blocks that cover
    /// it in order (a 64-block piece of a large model's KV was one message both ends refuse).
    #[test]
    fn large_pieces_go_as_messages_of_whole_blocks() {
        let block = 3 << 20;
        let data = Bytes::from((0..20 * block).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        let m: Vec<_> = messages(7, data.clone(), |_| block).collect();
        assert_eq!(m.len(), 4, "5 blocks (15 MiB) fit one message, 20 take four");
        let mut next = 7;
        let mut joined = Vec::new();
        for b in &m {
            assert!(b.data.len() <= MAX_MESSAGE_BYTES && b.data.len().is_multiple_of(block));
            assert_eq!(b.first_block, next);
            next += (b.data.len() / block) as u32;
            joined.extend_from_slice(&b.data);
        }
        assert_eq!(joined, data);
        // A block over the limit still goes, alone; a small piece stays one message.
        let big = messages(0, Bytes::from(vec![1u8; 2 * (20 << 20)]), |_| 20 << 20);
        assert_eq!(big.map(|b| b.first_block).collect::<Vec<_>>(), [0, 1]);
        let small: Vec<_> = messages(3, data.slice(..block), |_| block).collect();
        assert_eq!((small.len(), small[0].first_block, small[0].data.len()), (1, 3, block));
        assert_eq!(
            messages(5, Bytes::new(), |_| block).map(|b| b.first_block).collect::<Vec<_>>(),
            [5]
        );
    }

    /// Thin blocks (smaller) before whole ones: each message starts at a block boundary and
    /// names its first block, so the receiver can cut it again.
    #[test]
    fn thin_blocks_are_cut_at_their_own_sizes() {
        let (thin, whole) = (1 << 20, 6 << 20);
        let size = |i: usize| if i < 40 { thin } else { whole };
        let len: usize = (0..44).map(size).sum();
        let data = Bytes::from((0..len).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        let m: Vec<_> = messages(0, data.clone(), size).collect();
        let mut next = 0usize;
        let mut joined = Vec::new();
        for b in &m {
            assert!(b.data.len() <= MAX_MESSAGE_BYTES, "{}", b.data.len());
            assert_eq!(b.first_block as usize, next);
            let mut left = b.data.len();
            while left > 0 {
                left = left.checked_sub(size(next)).expect("whole blocks");
                next += 1;
            }
            joined.extend_from_slice(&b.data);
        }
        assert_eq!((next, joined), (44, data.to_vec()));
    }

    /// Targets name the decode node's address, so a caller could make a prefill node keep a
    /// channel to every address it names; the cache keeps the most recently used only.
    #[tokio::test]
    async fn the_channel_cache_is_bounded() {
        let t = GrpcTransport::new();
        let first = "127.0.0.1:1".to_string();
        t.channel(&first, "d").unwrap();
        for port in 2..(MAX_CHANNELS as u16 + 100) {
            t.channel(&format!("127.0.0.1:{port}"), "d").unwrap();
            // The first stays in use, so it stays.
            t.channel(&first, "d").unwrap();
        }
        assert_eq!(t.channels.len(), MAX_CHANNELS);
        assert!(t.channels.holds(&first));
        assert!(!t.channels.holds("127.0.0.1:2"), "the least recently used went first");
    }
}
