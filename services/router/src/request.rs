//! Checking a Generate request and turning it into token ids and sampler settings. Every
//! problem is an INVALID_ARGUMENT that names the field.

use pdmesh_kv_types::KvPolicy;
use pdmesh_model::{Message, ModelCard, SamplingParams};
use pdmesh_proto::v1::{Chat, GenerateRequest, generate_request};

/// Roles the chat template understands.
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// A checked request, ready to place.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// The lossy KV policy the request asked for (`GenerateRequest.kv_policy`); the router
    /// puts its tenant's in when it names none.
    pub kv_policy: Option<KvPolicy>,
    /// The served model's id; empty: the default model.
    pub model: String,
}

/// The message of a chat `auto`'s classifier reads: the last user message, the question
/// asked now (`role` says each message's role).
pub fn classified_message<M>(msgs: &[M], role: impl Fn(&M) -> &str) -> Option<&M> {
    msgs.iter().rev().find(|m| role(m) == "user")
}

/// The message of an INVALID_ARGUMENT.
pub type Invalid = String;

fn chat_text(model: &ModelCard, chat: &Chat) -> Result<String, Invalid> {
    if chat.messages.is_empty() {
        return Err("chat.messages: at least one message is required".into());
    }
    let mut msgs = Vec::with_capacity(chat.messages.len());
    for (i, m) in chat.messages.iter().enumerate() {
        check_role(&m.role).map_err(|e| format!("chat.messages[{i}].role: {e}"))?;
        msgs.push(Message::new(m.role.clone(), m.content.clone()));
    }
    render_chat(model, &msgs).map_err(|e| format!("chat: {e}"))
}

/// Whether the chat template understands `role`; the message says which roles it does.
pub fn check_role(role: &str) -> Result<(), Invalid> {
    if ROLES.contains(&role) {
        return Ok(());
    }
    Err(format!("unknown role {role:?} (expected one of {})", ROLES.join(", ")))
}

/// `msgs` through the model's chat template, with the generation prompt.
pub fn render_chat(model: &ModelCard, msgs: &[Message]) -> Result<String, Invalid> {
    let template = model.tokenizer.chat_template().map_err(|e| e.to_string())?;
    template.render(msgs, true).map_err(|e| e.to_string())
}

/// Token ids given as a prompt: not empty, each in the vocabulary (the message names the
/// index at fault, as `[i]: ...`).
pub fn check_ids(model: &ModelCard, ids: &[u32]) -> Result<(), Invalid> {
    if ids.is_empty() {
        return Err(": must not be empty".into());
    }
    let vocab = model.tokenizer.vocab_size();
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
        return Err(format!("[{i}]: {id} is outside the vocabulary of {vocab}"));
    }
    Ok(())
}

/// Why a prompt and its output do not fit the model's context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unfit {
    /// The prompt alone leaves no room.
    Prompt(Invalid),
    /// The output asked for does not fit after the prompt.
    MaxTokens(Invalid),
}

/// The most tokens to generate after a prompt of `prompt_len`: `max_tokens` when it fits the
/// context, else why not; None asks for all the room left.
pub fn fit(
    model: &ModelCard,
    prompt_len: usize,
    max_tokens: Option<usize>,
) -> Result<usize, Unfit> {
    let ctx = model.config.context;
    if prompt_len >= ctx {
        return Err(Unfit::Prompt(format!(
            "{prompt_len} tokens leave no room in the model's context of {ctx}"
        )));
    }
    let max_tokens = max_tokens.unwrap_or(ctx - prompt_len);
    if max_tokens == 0 {
        return Err(Unfit::MaxTokens("must be at least 1".into()));
    }
    if prompt_len + max_tokens > ctx {
        return Err(Unfit::MaxTokens(format!(
            "{max_tokens} past a prompt of {prompt_len} tokens exceeds the context of {ctx} (at most {})",
            ctx - prompt_len
        )));
    }
    Ok(max_tokens)
}

/// Token ids for an input (prompt, chat or ids), checked against the vocabulary.
pub fn tokenize(
    model: &ModelCard,
    input: Option<&generate_request::Input>,
) -> Result<Vec<u32>, Invalid> {
    use generate_request::Input;
    let ids = match input {
        None => return Err("input: set one of prompt, chat or token_ids".into()),
        Some(Input::Prompt(p)) => {
            if p.is_empty() {
                return Err("prompt: must not be empty".into());
            }
            model.tokenizer.encode(p).map_err(|e| format!("prompt: {e}"))?
        }
        Some(Input::Chat(c)) => {
            let text = chat_text(model, c)?;
            model.tokenizer.encode(&text).map_err(|e| format!("chat: {e}"))?
        }
        Some(Input::TokenIds(t)) => {
            check_ids(model, &t.ids).map_err(|e| format!("token_ids{e}"))?;
            t.ids.clone()
        }
    };
    if ids.is_empty() {
        return Err("input: empty after tokenization".into());
    }
    Ok(ids)
}

/// Checks every field of `req` and tokenizes its input.
pub fn prepare(model: &ModelCard, req: &GenerateRequest) -> Result<Prepared, Invalid> {
    let prompt = tokenize(model, req.input.as_ref())?;
    let max_tokens =
        fit(model, prompt.len(), Some(req.max_tokens as usize)).map_err(|u| match u {
            Unfit::Prompt(m) => format!("prompt: {m}"),
            Unfit::MaxTokens(m) => format!("max_tokens: {m}"),
        })?;
    let s = req.sampling.unwrap_or_default();
    if !s.temperature.is_finite() || s.temperature < 0.0 {
        return Err(format!(
            "sampling.temperature: must be a finite number >= 0, got {}",
            s.temperature
        ));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(format!("sampling.top_p: must be in (0, 1], got {top_p}"));
    }
    if !(0.0..=1.0).contains(&s.min_p) {
        return Err(format!("sampling.min_p: must be in [0, 1], got {}", s.min_p));
    }
    let rp = s.repetition_penalty.unwrap_or(1.0);
    if !rp.is_finite() || rp <= 0.0 {
        return Err(format!("sampling.repetition_penalty: must be a finite number > 0, got {rp}"));
    }
    pdmesh_wire::check_stops(&req.stop)?;
    let sampling = SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p,
        min_p: s.min_p,
        repetition_penalty: rp,
        seed: s.seed.unwrap_or(0),
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        logprobs: s.logprobs,
        ..SamplingParams::default()
    };
    // The sampler's own checks for the rest (penalties, logprobs); its message names the field.
    sampling.validate().map_err(|e| match e {
        pdmesh_model::Error::InvalidRequest(m) => format!("sampling.{m}"),
        other => format!("sampling: {other}"),
    })?;
    // The decode node checks the budget against its own block size too.
    let kv_policy = KvPolicy::parse_field(&req.kv_policy).map_err(|e| format!("kv_policy: {e}"))?;
    Ok(Prepared {
        prompt,
        max_tokens,
        sampling,
        stop: req.stop.clone(),
        ignore_eos: req.ignore_eos,
        kv_policy,
        model: req.model.clone(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use pdmesh_model::testing::tiny_card;
    use pdmesh_proto::v1::{GenerateRequest, SamplingParams, TokenIds, generate_request};

    /// The sampler's own checks reach a Generate caller with the field named.
    #[test]
    fn penalties_and_logprobs_out_of_range_name_the_field() {
        let req = |s: SamplingParams| GenerateRequest {
            input: Some(generate_request::Input::TokenIds(TokenIds { ids: vec![5, 6] })),
            max_tokens: 4,
            sampling: Some(s),
            ..Default::default()
        };
        for (s, field) in [
            (SamplingParams { frequency_penalty: 2.5, ..Default::default() }, "frequency_penalty"),
            (SamplingParams { presence_penalty: -3.0, ..Default::default() }, "presence_penalty"),
            (SamplingParams { logprobs: Some(21), ..Default::default() }, "logprobs"),
        ] {
            let e = super::prepare(&tiny_card(), &req(s)).unwrap_err();
            assert!(e.starts_with(&format!("sampling.{field}")), "{e}");
        }
        let ok = SamplingParams { frequency_penalty: 1.0, logprobs: Some(3), ..Default::default() };
        let p = super::prepare(&tiny_card(), &req(ok)).unwrap();
        assert_eq!((p.sampling.frequency_penalty, p.sampling.logprobs), (1.0, Some(3)));
    }
}
