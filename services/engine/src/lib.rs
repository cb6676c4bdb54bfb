//! The pdmesh engine: loads a llama, qwen2, qwen3 or gemma3 model's weights on top of its card
//! (`pdmesh-model`; weights stay quantized in a memory map; one file per architecture in
//! `models`) and runs the forward pass over a paged KV cache through one batched `step` that
//! mixes prompt chunks and decode tokens from many sequences, with the sampler and the batch
//! runner above it. Prefill and decode workers both drive this crate.
//!
//! Logits are bit-identical for a sequence whatever else shares its batch and however its prompt
//! was chunked; the disaggregated mesh relies on that to prove it matches a single engine.

pub mod connector;
pub mod engine;
pub mod eval;
#[cfg(test)]
mod fuzz;
pub mod generate;
pub mod kv_cache;
pub mod kv_policy;
pub mod model;
mod models;
pub mod pacing;
pub mod runner;
mod runtime;
pub mod sampler;
pub mod scheduler;
pub mod settings;
pub mod sim;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

// The model vocabulary, under the paths engine code has always used.
pub use pdmesh_model::{chat, error, finish, gguf, text, tokenizer};

pub use chat::{ChatTemplate, Message};
pub use connector::{KvConnector, NoConnector, Release, Saved};
pub use engine::{BackendKind, CudaOptions, Engine, EngineConfig, Logits, StepItem, StepLogits};
pub use error::{Error, ErrorClass, Result};
pub use finish::FinishReason;
pub use generate::{Generation, generate, generate_batch, generate_batch_observed};
pub use kv_cache::{BlockAllocator, KvCache, KvGroups, KvView, SeqId};
pub use model::{Model, ModelCard, ModelConfig};
pub use pacing::StepPacer;
pub use pdmesh_kernels::Phase;
pub use pdmesh_model::DEFAULT_MODEL_PATH;
pub use runner::{
    BatchRunner, End, Event, GenerateParams, Mark, Origin, Output, Paused, Role, SeqKind, SeqSpec,
    SeqStatus, StepFailed,
};
pub use sampler::{MAX_DEVICE_TOP_K, MAX_TOP_LOGPROBS, Sampler, SamplingParams, TokenLogprobs};
pub use scheduler::{Scheduled, Scheduler, Work};
pub use settings::{BackendName, EngineFlags, EngineName, EngineSettings};
pub use sim::SimProfile;
pub use text::{Piece, Pushed, TextStream};
pub use tokenizer::{StreamDecoder, Tokenizer};
