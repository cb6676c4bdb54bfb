//! The one error type of the model vocabulary and of the engine, which re-exports it. Each
//! variant is classified once, here, into the class the services map to a gRPC status
//! (invalid request, capacity exhausted, failed precondition).

use std::path::PathBuf;
use std::sync::Arc;

/// Everything that can go wrong in the engine. Cloneable: one failed step fails every
/// sequence in it with the same error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("cannot open model file {path}: {source}")]
    Io { path: PathBuf, source: Arc<std::io::Error> },

    /// The file is not a GGUF file we can read, or is damaged. `context` names the header field,
    /// metadata key or tensor where reading failed.
    #[error("invalid GGUF file: {context}: {problem}")]
    Gguf { context: String, problem: String },

    /// The GGUF is intact but describes a model this engine cannot run.
    #[error("unsupported model: {0}")]
    UnsupportedModel(String),

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    Template(String),

    /// A caller asked for something invalid (bad token id, prompt too long, unknown sequence…).
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// Not enough free KV blocks for the step; nothing was changed.
    #[error("KV cache exhausted: need {needed} free blocks, {free} available")]
    KvExhausted { needed: usize, free: usize },

    #[error("cannot allocate the KV cache: {0}")]
    KvAlloc(String),
}

/// How a failure should be reported to a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    InvalidRequest,
    CapacityExhausted,
    FailedPrecondition,
}

impl Error {
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::InvalidRequest(_) => ErrorClass::InvalidRequest,
            Error::KvExhausted { .. } => ErrorClass::CapacityExhausted,
            Error::Io { .. }
            | Error::Gguf { .. }
            | Error::UnsupportedModel(_)
            | Error::Tokenizer(_)
            | Error::Template(_)
            | Error::KvAlloc(_) => ErrorClass::FailedPrecondition,
        }
    }

    pub fn gguf(context: impl Into<String>, problem: impl Into<String>) -> Self {
        Error::Gguf { context: context.into(), problem: problem.into() }
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidRequest(msg.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
