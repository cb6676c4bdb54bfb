//! Why a generation ended, as every layer names it: the engine decides it, the wire carries
//! it, the router and frontends report it.

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-generation token.
    Eos,
    /// One of the stop tokens or stop strings was produced.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The sequence filled the model's context.
    ContextFull,
    /// The caller stopped it.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ContextFull => "context_full",
            FinishReason::Cancelled => "cancelled",
        }
    }
}
