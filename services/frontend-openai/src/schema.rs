//! The OpenAI API's request and response bodies, as its reference defines them (Chat
//! Completions, Completions, Models, the error object), plus the extensions other servers
//! accept (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `return_token_ids`). Requests
//! ignore fields they do not know, as the API's clients expect; what is known is typed here
//! and checked in `prepare`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    /// The newer name of `max_tokens`; wins when both are set.
    pub max_completion_tokens: Option<u32>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    /// Function calling and structured output are not served; set, they are refused.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub response_format: Option<Value>,
    pub modalities: Option<Vec<String>>,
    pub audio: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    /// Report this many alternatives per token (0 to 5 in the API; up to 20 here).
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
}

/// The parameters both endpoints share, read from the same body as the endpoint's own
/// (a flattened struct would lose the name of a bad field).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<Stop>,
    pub seed: Option<i64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// A caller's end user: recorded on the request's trace.
    pub user: Option<String>,
    // Extensions vLLM, SGLang and TGI accept.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    /// Also return the generated token ids (`token_ids` on each choice or chunk) and, without
    /// streaming, the prompt's (`prompt_token_ids`), as vLLM does.
    pub return_token_ids: Option<bool>,
    /// pdmesh's: an opt-in lossy KV policy (`GenerateRequest.kv_policy`'s form); the usage
    /// then names it and counts what it evicted.
    pub kv_policy: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A completion's prompt: text, token ids, or a batch of one of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatch(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// None for an assistant message that only called tools.
    pub content: Option<Content>,
    pub name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// What every completion, whole or a chunk, opens with.
#[derive(Debug, Clone, Serialize)]
pub struct Head {
    pub id: String,
    /// "chat.completion", "chat.completion.chunk" or "text_completion".
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
}

/// A chat completion (`object: "chat.completion"`).
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    #[serde(flatten)]
    pub head: Head,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
    pub refusal: Option<String>,
}

/// A streamed chat chunk (`object: "chat.completion.chunk"`).
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    #[serde(flatten)]
    pub head: Head,
    pub choices: Vec<ChatChunkChoice>,
    /// With `stream_options.include_usage`: null on every chunk but the last, which has no
    /// choices and the request's usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<TopLogprob>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A completion, whole or one streamed chunk (`object: "text_completion"` for both).
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    #[serde(flatten)]
    pub head: Head,
    pub choices: Vec<CompletionChoice>,
    /// Whole: the usage. Streamed: as `ChatChunk::usage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The legacy completions' logprobs: parallel lists, and each place's alternatives as a map.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
    /// pdmesh's: the lossy KV policy the request ran under and the KV tokens it evicted
    /// (absent under full attention).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_evicted_tokens: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: u32,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The model's context length (an extension vLLM also reports).
    pub max_model_len: u32,
}

/// The API's error body: `{"error": {...}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}
