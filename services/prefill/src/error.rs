//! The prefill node's errors: `PrefillError` for requests, each variant mapped to the gRPC
//! status a caller gets (naming this node), and `StartError` for a node that cannot start.

use tonic::Status;

#[derive(Debug, Clone, thiserror::Error)]
pub enum PrefillError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("queue full ({0} prompts waiting)")]
    QueueFull(usize),
    #[error("prompt needs {need} KV blocks, the pool has {total}")]
    TooLong { need: usize, total: usize },
    #[error("engine: {0}")]
    Engine(#[from] pdmesh_engine::Error),
    /// The engine thread is gone (it died, or the node is stopping).
    #[error("the engine thread has stopped")]
    ShuttingDown,
}

/// The status a caller gets, naming this node.
pub fn to_status(e: &PrefillError, node: &str) -> Status {
    use pdmesh_engine::ErrorClass;
    let msg = format!("node {node}: {e}");
    match e {
        PrefillError::Invalid(_) => Status::invalid_argument(msg),
        PrefillError::QueueFull(_) => {
            pdmesh_common::status::exhausted(msg, std::time::Duration::from_millis(200))
        }
        PrefillError::TooLong { .. } => Status::failed_precondition(msg),
        PrefillError::Engine(inner) => match inner.class() {
            ErrorClass::InvalidRequest => Status::invalid_argument(msg),
            ErrorClass::CapacityExhausted => Status::resource_exhausted(msg),
            ErrorClass::FailedPrecondition => Status::failed_precondition(msg),
        },
        PrefillError::ShuttingDown => Status::unavailable(msg),
    }
}

/// Why a prefill node could not start or keep serving.
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
    #[error("the prefix cache: {0}")]
    Cache(#[from] pdmesh_kv_transfer::CacheError),
    #[error("the prefix cache's disk tier: {0}")]
    Disk(String),
    #[error("starting the engine thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
}
