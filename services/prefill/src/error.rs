//! The prefill node's one error type and its mapping to gRPC statuses.

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
    Engine(std::sync::Arc<pdmesh_engine::Error>),
    /// The node could not start or keep serving (bad config, engine load, listener).
    #[error("startup: {0}")]
    Startup(String),
    #[error("the prefill node is shutting down")]
    ShuttingDown,
}

impl From<pdmesh_engine::Error> for PrefillError {
    fn from(e: pdmesh_engine::Error) -> Self {
        PrefillError::Engine(std::sync::Arc::new(e))
    }
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
        PrefillError::Startup(_) => Status::internal(msg),
        PrefillError::ShuttingDown => Status::unavailable(msg),
    }
}
