//! Moving KV blocks from a prefill node into a decode node's reservation. The KV layout
//! handshake lives here (both ends check it; a mismatch is FAILED_PRECONDITION, never silently
//! wrong output), along with the `KvTransport` trait the prefill node pushes through, and its
//! gRPC-stream implementation. The UCX transport implements the same trait.

pub mod grpc;
pub mod layout;
pub mod ucx;

use std::fmt::Debug;

use bytes::Bytes;
use pdmesh_proto::v1::KvTarget;
use tonic::Status;

pub use grpc::GrpcTransport;
pub use layout::{bytes_per_block, check_layout, layout_mismatch, layout_of};

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The decode node answered with a status (layout mismatch, unknown reservation …).
    #[error("decode node {node} refused the KV: {status}")]
    Refused { node: String, status: Status },
    /// The decode node could not be reached or the connection broke.
    #[error("decode node {node} unreachable: {reason}")]
    Unreachable { node: String, reason: String },
}

impl From<TransferError> for Status {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Refused { node, status } => peer_status(&node, &status),
            TransferError::Unreachable { node, reason } => {
                Status::unavailable(format!("node {node}: KV transfer failed: {reason}"))
            }
        }
    }
}

// Keeps the peer's code and names it.
fn peer_status(node: &str, status: &Status) -> Status {
    Status::new(status.code(), format!("node {node}: {}", status.message()))
}

/// Pushes a request's KV into a decode node's reservation.
#[async_trait::async_trait]
pub trait KvTransport: Send + Sync + Debug {
    /// "grpc", "ucx": reported in timings and metrics.
    fn name(&self) -> &'static str;
    /// Starts a transfer into `target` on behalf of `prefill_node`.
    async fn open(
        &self,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Result<Box<dyn KvSink>, TransferError>;
}

/// One transfer in progress. Dropping it without `finish` aborts the transfer; the decode node
/// then fails the reservation and frees its blocks.
#[async_trait::async_trait]
pub trait KvSink: Send {
    /// Sends whole blocks, in order, starting at the prompt's block `first_block`.
    async fn send(&mut self, first_block: u32, data: Bytes) -> Result<(), TransferError>;
    /// Marks the KV complete (`blocks` in all) and waits until the decode node has it.
    /// Returns the bytes moved.
    async fn finish(self: Box<Self>, blocks: u32) -> Result<u64, TransferError>;
}
