//! The router's startup errors. Request failures are gRPC statuses built where they happen
//! (validation, admission, placement, relay), each naming the field or node concerned.

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid config: {0}")]
    Config(String),
    #[error("loading the model: {0}")]
    Model(#[from] pdmesh_engine::Error),
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
}
