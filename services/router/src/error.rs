//! The router's errors. `RequestError` is why a request failed, classified once where it
//! happened; the gRPC adapter maps each variant to its status (and an HTTP adapter to its
//! code). `RouterError` is why the router could not start.

use std::time::Duration;

use tonic::{Code, Status};

/// Why a request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestError {
    /// A field of the request is invalid; the message names it.
    #[error("{0}")]
    Invalid(String),
    /// The router or the mesh is full; retry after `retry_after`.
    #[error("{message}")]
    Overloaded { message: String, retry_after: Duration },
    /// A request with this id is already running.
    #[error("request_id {0} is already running")]
    Duplicate(String),
    /// No node can serve it now: none registered, or the one serving it was lost.
    #[error("{0}")]
    Unavailable(String),
    /// The deadline passed; the message says in which phase and on which node.
    #[error("{0}")]
    Deadline(String),
    /// A node refused it with a status of its own: its code is kept and the message names it.
    #[error("{}", .0.message())]
    Node(Status),
}

impl RequestError {
    /// The gRPC code this error is reported with.
    pub fn code(&self) -> Code {
        match self {
            RequestError::Invalid(_) => Code::InvalidArgument,
            RequestError::Overloaded { .. } => Code::ResourceExhausted,
            RequestError::Duplicate(_) => Code::AlreadyExists,
            RequestError::Unavailable(_) => Code::Unavailable,
            RequestError::Deadline(_) => Code::DeadlineExceeded,
            RequestError::Node(s) => s.code(),
        }
    }
}

impl From<RequestError> for Status {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Invalid(m) => Status::invalid_argument(m),
            RequestError::Overloaded { message, retry_after } => {
                pdmesh_common::status::exhausted(message, retry_after)
            }
            RequestError::Duplicate(id) => {
                Status::already_exists(format!("request_id {id} is already running"))
            }
            RequestError::Unavailable(m) => Status::unavailable(m),
            RequestError::Deadline(m) => Status::deadline_exceeded(m),
            RequestError::Node(s) => s,
        }
    }
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid config: {0}")]
    Config(#[from] pdmesh_common::InvalidConfig),
    #[error("loading the model: {0}")]
    Model(#[from] pdmesh_model::Error),
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("serving HTTP: {0}")]
    Frontend(String),
}
