//! The model vocabulary every pdmesh service shares, without the kernels: reading GGUF, what
//! a model is (`ModelCard`: architecture, hyperparameters, tokenizer, chat template,
//! fingerprint), what a request asks of sampling, why a generation ended, and turning tokens
//! back into text with stop strings. The router, wire, KV-store and frontends build on this
//! alone; the engine adds the weights and the forward pass.

pub mod card;
pub mod chat;
pub mod error;
pub mod finish;
pub mod gguf;
pub mod sampling;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod text;
pub mod tokenizer;

pub use card::{Arch, ModelCard, ModelConfig, RopeMode, SlidingWindow};
pub use chat::{ChatTemplate, Message};
pub use error::{Error, ErrorClass, Result};
pub use finish::FinishReason;
pub use sampling::{MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs};
pub use text::{Piece, Pushed, TextStream};
pub use tokenizer::{StreamDecoder, Tokenizer};

/// Where `just fetch-model` puts the default model, relative to the repository root.
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
