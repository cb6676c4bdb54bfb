//! An API request checked and turned into the router's `Prepared` (token ids, sampler, limits)
//! plus how to answer it (streamed or not, usage, logprobs). Every problem is a 400 naming the
//! parameter, in the API's terms; what the router checks for gRPC (roles, the vocabulary, the
//! context) is the same code here.

use pdmesh_model::{MAX_TOP_LOGPROBS, Message, ModelCard, SamplingParams};
use pdmesh_router::request::{self, Prepared, Unfit};

use crate::error::ApiError;
use crate::schema::{
    ChatCompletionRequest, ChatMessage, CommonParams, CompletionRequest, Content, Prompt, Stop,
};

/// The most alternatives the legacy completions API reports per token.
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// How a checked request is answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub prep: Prepared,
    pub stream: bool,
    pub include_usage: bool,
    /// Report logprobs, with this many alternatives per token.
    pub logprobs: Option<u32>,
    pub return_token_ids: bool,
    pub user: Option<String>,
}

/// Checks a chat request against `model`, served as `model_id` (the caller resolved the name
/// the request gave: one model, or each of `auto`'s ladder).
pub fn chat(
    model: &ModelCard,
    model_id: &str,
    r: &ChatCompletionRequest,
    common: &CommonParams,
) -> Result<Plan, ApiError> {
    let refuse = |param: &str, why: &str| Err(ApiError::invalid(param, why));
    if present(&r.tools) || present(&r.functions) {
        return refuse("tools", "function calling is not supported by this server");
    }
    if let Some(choice) = &r.tool_choice
        && !choice.is_null()
        && choice.as_str() != Some("none")
    {
        return refuse("tool_choice", "function calling is not supported by this server");
    }
    if let Some(f) = &r.response_format
        && !f.is_null()
        && f.get("type").and_then(|t| t.as_str()) != Some("text")
    {
        return refuse("response_format", "only {\"type\": \"text\"} is supported");
    }
    if r.modalities.as_ref().is_some_and(|m| m.iter().any(|m| m != "text")) || present(&r.audio) {
        return refuse("modalities", "only text output is supported");
    }
    if r.messages.is_empty() {
        return refuse("messages", "at least one message is required");
    }
    let mut msgs = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.iter().enumerate() {
        // OpenAI's newer name for the system role.
        let role = if m.role == "developer" { "system" } else { m.role.as_str() };
        request::check_role(role)
            .map_err(|e| ApiError::invalid(format!("messages[{i}].role"), e))?;
        let text = content_text(i, m)?;
        msgs.push(Message::new(role, text));
    }
    let rendered =
        request::render_chat(model, &msgs).map_err(|e| ApiError::invalid("messages", e))?;
    let prompt = model
        .tokenizer
        .encode(&rendered)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let logprobs = match (r.logprobs.unwrap_or(false), r.top_logprobs) {
        (false, Some(n)) if n > 0 => {
            return refuse("top_logprobs", "needs `logprobs` set to true");
        }
        (false, _) => None,
        (true, n) => {
            let n = n.unwrap_or(0);
            if n > MAX_TOP_LOGPROBS {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("must be in [0, {MAX_TOP_LOGPROBS}], got {n}"),
                ));
            }
            Some(n)
        }
    };
    // The newer name wins; without either, the rest of the context.
    let max_tokens = r.max_completion_tokens.map(|m| ("max_completion_tokens", m));
    let max_tokens = max_tokens.or(common.max_tokens.map(|m| ("max_tokens", m)));
    plan((model, model_id), prompt, "messages", max_tokens, common, logprobs)
}

/// Message `i`'s text: its string, or its text parts joined (other parts are refused).
fn content_text(i: usize, m: &ChatMessage) -> Result<String, ApiError> {
    Ok(match &m.content {
        None => String::new(),
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let at = format!("messages[{i}].content[{j}]");
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::invalid(at, "a text part needs `text`"));
                    }
                    (other, _) => {
                        return Err(ApiError::invalid(
                            format!("{at}.type"),
                            format!("only text parts are supported, not {other:?}"),
                        ));
                    }
                }
            }
            text
        }
    })
}

/// The words of a chat `auto`'s classifier reads: its last user message (nothing where that
/// is invalid: `chat` refuses it anyway).
pub fn chat_words(r: &ChatCompletionRequest) -> String {
    let last = request::classified_message(&r.messages, |m| &m.role);
    last.and_then(|m| content_text(0, m).ok()).unwrap_or_default()
}

/// The words of a completions request `auto`'s classifier reads: its text prompt (token ids
/// have none).
pub fn completion_words(r: &CompletionRequest) -> String {
    match &r.prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::Texts(t) => t.first().cloned().unwrap_or_default(),
        Prompt::Tokens(_) | Prompt::TokenBatch(_) => String::new(),
    }
}

/// Checks a completions request against `model`, served as `model_id` (as `chat`).
pub fn completion(
    model: &ModelCard,
    model_id: &str,
    r: &CompletionRequest,
    common: &CommonParams,
) -> Result<Plan, ApiError> {
    if r.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echoing the prompt is not supported"));
    }
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "insertion (a suffix) is not supported"));
    }
    if let Some(b) = r.best_of
        && b != 1
    {
        return Err(ApiError::invalid("best_of", format!("only 1 is supported, got {b}")));
    }
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid(
                "prompt",
                format!(
                    "one prompt per request, got a batch of {n} (send them as separate requests)"
                ),
            ))
        }
    };
    let prompt = match &r.prompt {
        Prompt::Text(t) => text_prompt(model, t)?,
        Prompt::Texts(t) => {
            one(t.len())?;
            text_prompt(model, &t[0])?
        }
        Prompt::Tokens(ids) => ids_prompt(model, ids)?,
        Prompt::TokenBatch(b) => {
            one(b.len())?;
            ids_prompt(model, &b[0])?
        }
    };
    if let Some(n) = r.logprobs
        && n > MAX_TOP_LOGPROBS
    {
        return Err(ApiError::invalid(
            "logprobs",
            format!("must be in [0, {MAX_TOP_LOGPROBS}], got {n}"),
        ));
    }
    // The API's default for completions is 16 tokens.
    let max_tokens = Some(("max_tokens", common.max_tokens.unwrap_or(16)));
    plan((model, model_id), prompt, "prompt", max_tokens, common, r.logprobs)
}

fn text_prompt(model: &ModelCard, text: &str) -> Result<Vec<u32>, ApiError> {
    if text.is_empty() {
        return Err(ApiError::invalid("prompt", "must not be empty"));
    }
    model.tokenizer.encode(text).map_err(|e| ApiError::invalid("prompt", e.to_string()))
}

fn ids_prompt(model: &ModelCard, ids: &[u32]) -> Result<Vec<u32>, ApiError> {
    request::check_ids(model, ids).map_err(|e| ApiError::invalid("prompt", e))?;
    Ok(ids.to_vec())
}

fn present(v: &Option<serde_json::Value>) -> bool {
    match v {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

/// The parameters both endpoints share, checked, around a tokenized prompt.
fn plan(
    (model, model_id): (&ModelCard, &str),
    prompt: Vec<u32>,
    prompt_param: &str,
    max_tokens: Option<(&str, u32)>,
    c: &CommonParams,
    logprobs: Option<u32>,
) -> Result<Plan, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid(prompt_param, "empty after tokenization"));
    }
    if let Some(n) = c.n
        && n != 1
    {
        return Err(ApiError::invalid(
            "n",
            format!("only 1 choice per request is supported, got {n}"),
        ));
    }
    if c.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::invalid("logit_bias", "not supported by this server"));
    }
    let stream = c.stream.unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ApiError::invalid("stream_options", "only allowed when `stream` is true"));
    }
    let temperature = range(c.temperature, "temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", format!("must be in (0, 1], got {top_p}")));
    }
    let frequency_penalty = range(c.frequency_penalty, "frequency_penalty", -2.0, 2.0)?;
    let presence_penalty = range(c.presence_penalty, "presence_penalty", -2.0, 2.0)?;
    let min_p = range(c.min_p, "min_p", 0.0, 1.0)?;
    let top_k = match c.top_k {
        // -1 is how vLLM says "no limit".
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid("top_k", format!("must be -1, 0 or positive, got {k}")));
        }
    };
    let repetition_penalty = c.repetition_penalty.unwrap_or(1.0);
    if !repetition_penalty.is_finite() || repetition_penalty <= 0.0 {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("must be a finite number > 0, got {repetition_penalty}"),
        ));
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    pdmesh_wire::check_stops(&stop).map_err(|e| ApiError::param("stop", e))?;
    let (max_param, max) = match max_tokens {
        Some((p, m)) => (p, Some(m as usize)),
        None => ("max_tokens", None),
    };
    let max_tokens = request::fit(model, prompt.len(), max).map_err(|u| match u {
        Unfit::Prompt(m) => ApiError::invalid(prompt_param, m),
        Unfit::MaxTokens(m) => ApiError::invalid(max_param, m),
    })?;
    let sampling = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p: min_p.unwrap_or(0.0),
        repetition_penalty,
        // Any integer the API allows: a negative seed is as good a seed as its bits.
        seed: c.seed.map_or(0, |s| s as u64),
        frequency_penalty: frequency_penalty.unwrap_or(0.0),
        presence_penalty: presence_penalty.unwrap_or(0.0),
        logprobs,
        ..SamplingParams::default()
    };
    sampling.validate().map_err(|e| ApiError::invalid("sampling", e.to_string()))?;
    let kv_policy = c
        .kv_policy
        .as_deref()
        .map(|p| {
            p.parse::<pdmesh_kv_types::KvPolicy>().map_err(|e| ApiError::invalid("kv_policy", e))
        })
        .transpose()?;
    Ok(Plan {
        prep: Prepared {
            prompt,
            max_tokens,
            sampling,
            stop,
            ignore_eos: c.ignore_eos.unwrap_or(false),
            kv_policy,
            model: model_id.to_string(),
        },
        stream,
        include_usage: c.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        logprobs,
        return_token_ids: c.return_token_ids.unwrap_or(false),
        user: c.user.clone(),
    })
}

/// `v` when it is a number in [lo, hi].
fn range(v: Option<f32>, param: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => {
            Err(ApiError::invalid(param, format!("must be in [{lo}, {hi}], got {x}")))
        }
        v => Ok(v),
    }
}
