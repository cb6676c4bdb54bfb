//! Moving KV between nodes, as the engine's `KvConnector`s see it. On a prefill node, `push`
//! loads a prompt's cached prefix (from `prefix_cache`: the node's own tier, then the KV-store)
//! and hands what the engine computes to the prompt's transfer; on a decode node, `receive`
//! takes the arriving KV into a reservation and tells the batch runner when it is complete.
//! The transfers themselves go through the `KvTransport` trait: the gRPC stream (`grpc`) is
//! built in; one-sided transports (UCX, in its own crate) plug in through the seam in
//! `transport` and `pool`, their sessions accepted by `session`, with `auto` choosing one and
//! falling back to gRPC. Both ends check the KV layout handshake; a mismatch is
//! FAILED_PRECONDITION, never silently wrong output. `push` and `receive` are the only parts
//! that know the engine (feature `connectors`); the KV-store and transports link without it.

pub mod auto;
pub mod disk;
pub mod grpc;
pub mod inbox;
pub mod layout;
pub mod pool;
pub mod prefix_cache;
#[cfg(feature = "connectors")]
pub mod push;
#[cfg(feature = "connectors")]
pub mod receive;
pub mod session;
pub mod staging;
pub mod stall;
pub mod stats;
pub mod transport;

use std::fmt::Debug;

use bytes::Bytes;
use pdmesh_proto::v1::KvTarget;
use tonic::Status;

pub use auto::{AutoTransport, Fallen};
pub use disk::{DiskStats, DiskTier};
pub use grpc::{GrpcTransport, receive_push};
pub use inbox::{KvInbox, parse_reservation};
pub use layout::check_layout;
pub use pool::{Grant, GrantError, Granted, KvPath, KvStaging, PoolOffer, PoolOptions};
pub use prefix_cache::{CacheError, Lookup, PrefixCache};
#[cfg(feature = "connectors")]
pub use push::{Export, PushConnector, PushError, PushJob, PushMode};
#[cfg(feature = "connectors")]
pub use receive::{ReceiveError, Receiver, Target};
pub use session::{SessionEvents, accept_session};
pub use staging::{StagedBlocks, StagingArea, StagingFull};
pub use stall::StallBound;
pub use stats::TransferStats;
pub use transport::{Fabric, ReadOffer, RemoteReader, TransportKind};

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The decode node answered with a status (layout mismatch, unknown reservation …).
    #[error("decode node {node} refused the KV: {status}")]
    Refused { node: String, status: Status },
    /// The decode node could not be reached or the connection broke.
    #[error("decode node {node} unreachable: {reason}")]
    Unreachable { node: String, reason: String },
    /// No endpoint of the wanted transport to the decode node could be made (it offers none,
    /// or the transport failed): `auto` falls back to gRPC on this one.
    #[error("no endpoint to decode node {node}: {reason}")]
    NoEndpoint { node: String, reason: String },
    /// The transfer was used wrongly (a bug on the sending side).
    #[error("bad KV transfer to decode node {node}: {reason}")]
    Invalid { node: String, reason: String },
    /// The transfer made no progress within its bound (`StallBound`) and was given up.
    /// `resendable`: the decode node moved the reservation onto blocks the abandoned session
    /// cannot reach, so the KV may be sent again over another transport.
    #[error("KV transfer to decode node {node} stalled: {reason}")]
    Stalled { node: String, reason: String, resendable: bool },
    /// The target the caller gave is not one to write to (malformed, or naming memory
    /// outside what it grants).
    #[error("bad KV target for decode node {node}: {reason}")]
    BadTarget { node: String, reason: String },
}

impl From<TransferError> for Status {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Refused { node, status } => peer_status(&node, &status),
            TransferError::Unreachable { node, reason } => pdmesh_common::status::unreachable(
                &node,
                format_args!("KV transfer failed: {reason}"),
            ),
            TransferError::NoEndpoint { node, reason } => Status::failed_precondition(format!(
                "node {node}: no endpoint of the configured kv_transport: {reason}"
            )),
            TransferError::Invalid { node, reason } => {
                Status::internal(format!("KV transfer to node {node}: {reason}"))
            }
            TransferError::Stalled { node, reason, .. } => pdmesh_common::status::unreachable(
                &node,
                format_args!("KV transfer stalled: {reason}"),
            ),
            TransferError::BadTarget { node, reason } => {
                Status::invalid_argument(format!("KV target for node {node}: {reason}"))
            }
        }
    }
}

impl TransferError {
    /// What a status from the decode node's KV call means: it went away (the transport broke,
    /// the call was cut) or it refused (a status of its own, kept).
    pub fn from_peer(node: &str, status: Status) -> Self {
        use tonic::Code;
        match status.code() {
            Code::Unavailable | Code::Unknown | Code::Cancelled => TransferError::Unreachable {
                node: node.into(),
                reason: status.message().to_string(),
            },
            _ => TransferError::Refused { node: node.into(), status },
        }
    }
}

// Keeps the peer's code and names it.
fn peer_status(node: &str, status: &Status) -> Status {
    Status::new(status.code(), pdmesh_common::status::naming(node, status.message()))
}

/// Pushes a request's KV into a decode node's reservation.
#[async_trait::async_trait]
pub trait KvTransport: Send + Sync + Debug {
    /// "grpc", a transport's name or "auto": what was configured (each sink says what it
    /// uses).
    fn name(&self) -> &str;
    /// Starts a transfer into `target` on behalf of `prefill_node`.
    async fn open(
        &self,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Result<Box<dyn KvSink>, TransferError>;
}

/// Part of a prompt's KV: whole blocks (`layer: None`), or one layer's part of each block
/// (`layer: Some(l)`), for blocks `first_block..`, concatenated in block order.
#[derive(Debug, Clone)]
pub struct KvPiece {
    pub first_block: u32,
    pub layer: Option<u32>,
    pub data: Bytes,
}

/// A transfer that reached the decode node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub bytes: u64,
    /// The transport that carried it in the end ("grpc", "ucx"): not the one it was opened
    /// on when it fell back.
    pub transport: &'static str,
}

/// One transfer in progress. Dropping it without `finish` aborts the transfer; the decode node
/// then fails the reservation and frees its blocks (after anything in flight has landed).
#[async_trait::async_trait]
pub trait KvSink: Send {
    /// The transport carrying this transfer: "grpc" or "ucx".
    fn transport(&self) -> &'static str;
    /// Whether pieces may be single layers (sent while later layers compute).
    fn layered(&self) -> bool;
    /// Whether pieces are copied straight into the receiver's memory, mapped here (a decode
    /// node's shared KV pool on this host).
    fn mapped(&self) -> bool {
        false
    }
    /// Sends a piece. Whole blocks arrive in order; layers of a block in any order.
    async fn send(&mut self, piece: KvPiece) -> Result<(), TransferError>;
    /// Marks the KV complete (`blocks` in all; `checksums` of each block in verify mode, else
    /// empty) and waits until the decode node has it.
    async fn finish(
        self: Box<Self>,
        blocks: u32,
        checksums: Vec<u64>,
    ) -> Result<Finished, TransferError>;
}

/// `sink`, waiting `delay` before each piece: test-only fault injection that keeps a transfer
/// in flight long enough to be interrupted.
pub fn delayed(sink: Box<dyn KvSink>, delay: std::time::Duration) -> Box<dyn KvSink> {
    Box::new(Delayed { inner: sink, delay })
}

struct Delayed {
    inner: Box<dyn KvSink>,
    delay: std::time::Duration,
}

#[async_trait::async_trait]
impl KvSink for Delayed {
    fn transport(&self) -> &'static str {
        self.inner.transport()
    }

    fn layered(&self) -> bool {
        self.inner.layered()
    }

    fn mapped(&self) -> bool {
        self.inner.mapped()
    }

    async fn send(&mut self, piece: KvPiece) -> Result<(), TransferError> {
        tokio::time::sleep(self.delay).await;
        self.inner.send(piece).await
    }

    async fn finish(
        self: Box<Self>,
        blocks: u32,
        checksums: Vec<u64>,
    ) -> Result<Finished, TransferError> {
        self.inner.finish(blocks, checksums).await
    }
}
