//! The decode node's one error type and its mapping to gRPC statuses.

use tonic::Status;

#[derive(Debug, Clone, thiserror::Error)]
pub enum DecodeError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("not enough KV blocks: need {need}, {free} uncommitted")]
    NoBlocks { need: usize, free: usize },
    #[error("reservation {0} is unknown (expired, released or finished)")]
    UnknownReservation(u64),
    #[error("reservation {0}: lease expired before its KV arrived")]
    LeaseExpired(u64),
    #[error("KV transfer from {from} broke: {why}")]
    TransferBroken { from: String, why: String },
    #[error("KV block {block} failed its checksum: the transfer corrupted it")]
    Corrupt { block: usize },
    #[error("engine: {0}")]
    Engine(std::sync::Arc<pdmesh_engine::Error>),
    /// The node could not start or keep serving (bad config, engine load, listener).
    #[error("startup: {0}")]
    Startup(String),
    #[error("the decode node is shutting down")]
    ShuttingDown,
}

impl From<pdmesh_engine::Error> for DecodeError {
    fn from(e: pdmesh_engine::Error) -> Self {
        DecodeError::Engine(std::sync::Arc::new(e))
    }
}

/// The status a caller gets; `node` is this node's id, so the caller knows who failed.
pub fn to_status(e: &DecodeError, node: &str) -> Status {
    use pdmesh_engine::ErrorClass;
    let msg = format!("node {node}: {e}");
    match e {
        DecodeError::Invalid(_) => Status::invalid_argument(msg),
        DecodeError::NoBlocks { .. } => {
            pdmesh_common::status::exhausted(msg, std::time::Duration::from_millis(200))
        }
        DecodeError::UnknownReservation(_) => Status::not_found(msg),
        DecodeError::LeaseExpired(_) => Status::deadline_exceeded(msg),
        DecodeError::TransferBroken { .. } => Status::unavailable(msg),
        DecodeError::Corrupt { .. } => Status::data_loss(msg),
        DecodeError::Engine(inner) => match inner.class() {
            ErrorClass::InvalidRequest => Status::invalid_argument(msg),
            ErrorClass::CapacityExhausted => Status::resource_exhausted(msg),
            ErrorClass::FailedPrecondition => Status::failed_precondition(msg),
        },
        DecodeError::Startup(_) => Status::internal(msg),
        DecodeError::ShuttingDown => Status::unavailable(msg),
    }
}
