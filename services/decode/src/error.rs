//! The decode node's errors: `DecodeError` for requests, each variant mapped to the gRPC status
//! a caller gets (naming this node), and `StartError` for a node that cannot start.

use pdmesh_kv_transfer::ReceiveError;
use tonic::Status;

/// Why a request (or a reservation) failed.
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
    Engine(#[from] pdmesh_engine::Error),
    /// The caller may not do this with the reservation (a session naming memory it was not
    /// granted).
    #[error("{0}")]
    Forbidden(String),
    /// The reservation's blocks could not be made reachable for a remote writer.
    #[error("granting remote access to the reservation's blocks: {0}")]
    Remote(String),
    /// The engine thread is gone (it died, or the node is stopping).
    #[error("the engine thread has stopped")]
    EngineStopped,
    /// A growing reservation needed a block and none of the node's `blocks` was left to
    /// promise: the request ends here, to be recomputed where there is room.
    #[error(
        "preempted: none of the node's {blocks} KV blocks was left to promise this growing \
         request; continue it from its last mark where there is room"
    )]
    Preempted { blocks: usize },
    /// The node is stopping: it takes no new work.
    #[error("the node is draining (stopping); it takes no new requests")]
    Draining,
}

impl From<ReceiveError> for DecodeError {
    fn from(e: ReceiveError) -> Self {
        match e {
            ReceiveError::Corrupt { block } => DecodeError::Corrupt { block },
            ReceiveError::Engine(e) => DecodeError::Engine(e),
            ReceiveError::Staging { .. } => DecodeError::Remote(e.to_string()),
            ReceiveError::AlreadyReceiving(_)
            | ReceiveError::NotReceiving(_)
            | ReceiveError::NotPreallocated(_)
            | ReceiveError::PartialBlock { .. }
            | ReceiveError::PastPrompt { .. }
            | ReceiveError::OutOfOrder { .. }
            | ReceiveError::Incomplete { .. }
            | ReceiveError::Checksums { .. } => DecodeError::Invalid(e.to_string()),
        }
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
        DecodeError::EngineStopped | DecodeError::Draining => Status::unavailable(msg),
        // The registration failed on this node: another node (or the gRPC path) may serve.
        DecodeError::Remote(_) => Status::unavailable(msg),
        DecodeError::Forbidden(_) => Status::permission_denied(msg),
        // The caller recomputes it (ReserveRequest.reserve_tokens says so).
        DecodeError::Preempted { .. } => Status::aborted(msg),
    }
}

/// Why a decode node could not start or keep serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid config: {0}")]
    Config(#[from] pdmesh_common::InvalidConfig),
    #[error("the listener: {0}")]
    Listener(#[source] std::io::Error),
    #[error("loading the engine: {0}")]
    Engine(#[from] pdmesh_engine::Error),
    #[error("the engine load task: {0}")]
    Load(#[from] tokio::task::JoinError),
    /// The configured transport could not start (the message names it).
    #[error("{0}")]
    Transport(String),
    #[error("kv_transport = {transport}: cannot offer the KV pool to its writers: {why}")]
    Pool { transport: String, why: String },
    #[error("starting the engine thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
}
