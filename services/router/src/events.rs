//! What a request produces, as plain Rust: the events every adapter (gRPC, HTTP) turns into
//! its own wire form, and the account of how the request ended.

use pdmesh_model::{FinishReason, TokenLogprobs};

/// What a request produces, in order: `Started`, `Delta`s, then `Finished` (or an error).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Started {
        request_id: String,
        prompt_tokens: u32,
        trace_id: Option<String>,
        /// The served model that answers.
        model: String,
    },
    /// New text (never part of a stop string, never a broken character) and its tokens, with
    /// one logprob report per token when the request asked for them.
    Delta {
        text: String,
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
    },
    Finished(Finished),
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
    /// The served model that answered.
    pub model: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    /// Prompt tokens whose KV came from a cache instead of being computed.
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    /// `cached_tokens` by tier, when the prefill node said.
    pub cached_by_tier: Option<CachedTiers>,
    /// The lossy KV policy the request ran under, if any.
    pub kv_policy: Option<pdmesh_kv_types::KvPolicy>,
    /// KV tokens it evicted (0: the output is what full attention gives).
    pub kv_evicted_tokens: u32,
}

/// Cached prompt tokens by where their KV came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CachedTiers {
    /// The prefill node's own cache: RAM, disk.
    pub node_ram: u32,
    pub node_disk: u32,
    /// The KV-store: RAM, disk.
    pub kvstore_ram: u32,
    pub kvstore_disk: u32,
}

/// Where a request's time went, and which nodes served it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Admission to the start of prefill compute.
    pub queue_ms: f64,
    pub prefill_ms: f64,
    /// End of prefill compute to the KV being complete on the decode node.
    pub transfer_ms: f64,
    /// Admission to the first token leaving the router.
    pub ttft_ms: f64,
    pub total_ms: f64,
    /// "colocated" when the decode node prefilled the prompt itself.
    pub prefill_node: String,
    pub decode_node: String,
    /// How the KV moved: "ucx", "grpc", or "local" when colocated.
    pub kv_transport: String,
    pub kv_bytes: u64,
    /// Attempts it took (2 when a failure before the first token was retried).
    pub attempts: u32,
    /// Times the stream moved to another decode node mid-way and continued there.
    pub migrations: u32,
    /// Times its decode node preempted it and it continued once a node had room.
    pub preemptions: u32,
    /// Times an `auto` request was re-run on the next model of the ladder.
    pub escalations: u32,
}
