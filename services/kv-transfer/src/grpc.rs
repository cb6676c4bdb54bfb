//! The gRPC KV transport: one client stream per transfer into the decode node's `PushKv`
//! (a header with the reservation and layout, block data, an end marker). Channels are cached
//! per decode address. The call runs in its own task that is aborted when the sink is dropped,
//! so an abandoned transfer resets the stream and the decode node frees the reservation.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use pdmesh_common::trace::Channel;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::kv_chunk::Chunk;
use pdmesh_proto::v1::{KvBlocks, KvChunk, KvEnd, KvHeader, KvTarget};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;
use tracing::Instrument;

use crate::{KvPiece, KvSink, KvTransport, TransferError};

/// Messages buffered per transfer before `send` waits for the network.
const IN_FLIGHT_MESSAGES: usize = 8;

#[derive(Debug, Default)]
pub struct GrpcTransport {
    channels: Mutex<HashMap<String, Channel>>,
}

impl GrpcTransport {
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn channel(&self, address: &str, node: &str) -> Result<Channel, TransferError> {
        let mut map = self.channels.lock().expect("channel map lock is never poisoned");
        if let Some(c) = map.get(address) {
            return Ok(c.clone());
        }
        let ep = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| TransferError::Unreachable {
                node: node.into(),
                reason: format!("bad address {address}: {e}"),
            })?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(32 << 20));
        let c = pdmesh_common::trace::channel(ep.connect_lazy());
        map.insert(address.to_string(), c.clone());
        Ok(c)
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
        let channel = self.channel(&target.address, &node)?;
        let (tx, rx) = mpsc::channel(IN_FLIGHT_MESSAGES);
        let header = KvChunk {
            chunk: Some(Chunk::Header(KvHeader {
                reservation_id: target.reservation_id.clone(),
                layout: target.layout.clone(),
                prefill_node: prefill_node.to_string(),
                traceparent: pdmesh_common::trace::traceparent().unwrap_or_default(),
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
        Ok(Box::new(GrpcSink { node, tx: Some(tx), call: Some(call), sent: 0 }))
    }
}

struct GrpcSink {
    node: String,
    tx: Option<mpsc::Sender<KvChunk>>,
    call: Option<JoinHandle<Result<u64, tonic::Status>>>,
    sent: u64,
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
        let n = data.len() as u64;
        let msg = KvChunk { chunk: Some(Chunk::Blocks(KvBlocks { first_block, data })) };
        let tx = self.tx.as_ref().ok_or_else(|| closed(&self.node))?;
        if tx.send(msg).await.is_err() {
            // The call ended early: its status says why.
            self.tx = None;
            return Err(self.outcome().await.err().unwrap_or_else(|| closed(&self.node)));
        }
        self.sent += n;
        Ok(())
    }

    async fn finish(
        mut self: Box<Self>,
        blocks: u32,
        checksums: Vec<u64>,
    ) -> Result<u64, TransferError> {
        if let Some(tx) = self.tx.take() {
            let end = KvChunk { chunk: Some(Chunk::End(KvEnd { blocks, checksums })) };
            // A failed send means the call already ended; its outcome says how.
            let _ = tx.send(end).await;
        }
        self.outcome().await.map(|_| self.sent)
    }
}

impl Drop for GrpcSink {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            call.abort();
        }
    }
}
