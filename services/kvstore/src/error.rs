//! Why a KV-store could not start (request failures are gRPC statuses built where they happen,
//! each naming the field or block concerned).

/// Why a KV-store could not start or keep serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid config: {0}")]
    Config(#[from] pdmesh_common::InvalidConfig),
    #[error("the listener: {0}")]
    Listener(#[source] std::io::Error),
    #[error("loading the model: {0}")]
    Model(#[from] pdmesh_model::Error),
    #[error("the model load task: {0}")]
    Load(#[from] tokio::task::JoinError),
    #[error("the KV layout: {0}")]
    Layout(String),
    #[error("the pool: {0}")]
    Pool(String),
    #[error("the disk tier: {0}")]
    Disk(String),
    /// The configured transport could not start (the message names it).
    #[error("{0}")]
    Transport(String),
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
}
