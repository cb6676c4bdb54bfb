//! Checking a Generate request and turning it into token ids and sampler settings. Every
//! problem is an INVALID_ARGUMENT that names the field.

use pdmesh_engine::{Message, Model, SamplingParams};
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
}

/// The message of an INVALID_ARGUMENT.
pub type Invalid = String;

fn chat_text(model: &Model, chat: &Chat) -> Result<String, Invalid> {
    if chat.messages.is_empty() {
        return Err("chat.messages: at least one message is required".into());
    }
    let mut msgs = Vec::with_capacity(chat.messages.len());
    for (i, m) in chat.messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(format!(
                "chat.messages[{i}].role: unknown role {:?} (expected one of {})",
                m.role,
                ROLES.join(", ")
            ));
        }
        msgs.push(Message::new(m.role.clone(), m.content.clone()));
    }
    let template = model.tokenizer.chat_template().map_err(|e| format!("chat: {e}"))?;
    template.render(&msgs, true).map_err(|e| format!("chat: {e}"))
}

/// Token ids for an input (prompt, chat or ids), checked against the vocabulary.
pub fn tokenize(
    model: &Model,
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
            if t.ids.is_empty() {
                return Err("token_ids: must not be empty".into());
            }
            let vocab = model.tokenizer.vocab_size();
            if let Some((i, id)) = t.ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
                return Err(format!("token_ids[{i}]: {id} is outside the vocabulary of {vocab}"));
            }
            t.ids.clone()
        }
    };
    if ids.is_empty() {
        return Err("input: empty after tokenization".into());
    }
    Ok(ids)
}

/// Checks every field of `req` and tokenizes its input.
pub fn prepare(model: &Model, req: &GenerateRequest) -> Result<Prepared, Invalid> {
    let ctx = model.config.context;
    let prompt = tokenize(model, req.input.as_ref())?;
    if prompt.len() >= ctx {
        return Err(format!(
            "prompt: {} tokens leave no room in the model's context of {ctx}",
            prompt.len()
        ));
    }
    let max_tokens = req.max_tokens as usize;
    if max_tokens == 0 {
        return Err("max_tokens: must be at least 1".into());
    }
    if prompt.len() + max_tokens > ctx {
        return Err(format!(
            "max_tokens: {max_tokens} past a prompt of {} tokens exceeds the context of {ctx} (at most {})",
            prompt.len(),
            ctx - prompt.len()
        ));
    }
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
        ..SamplingParams::default()
    };
    Ok(Prepared {
        prompt,
        max_tokens,
        sampling,
        stop: req.stop.clone(),
        ignore_eos: req.ignore_eos,
    })
}
