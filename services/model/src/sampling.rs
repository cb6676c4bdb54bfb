//! What a request asks of the sampler: temperature, top-k/p, min-p, penalties, seed and log
//! probabilities, each checked with a message naming the field; and what a token's report of
//! its log-probability holds. The sampler itself is the engine's; the router and frontends
//! validate and carry these without it.

use crate::error::{Error, Result};

/// How to pick the next token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = keep all).
    pub min_p: f32,
    /// Penalise tokens seen in the last `penalty_window` tokens (1 = off; > 1 discourages).
    pub repetition_penalty: f32,
    pub penalty_window: usize,
    pub seed: u64,
    /// Subtracted from a token's logit once per time it appears in the output so far
    /// (OpenAI's `frequency_penalty`, in [-2, 2]; 0 = off).
    pub frequency_penalty: f32,
    /// Subtracted from a token's logit once it appears in the output at all (OpenAI's
    /// `presence_penalty`, in [-2, 2]; 0 = off).
    pub presence_penalty: f32,
    /// Report each sampled token's log-probability and this many most likely alternatives
    /// (at most `MAX_TOP_LOGPROBS`); None reports nothing.
    pub logprobs: Option<u32>,
}

/// The most alternatives a token's report lists (OpenAI's limit for `top_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A sampled token's log-probability and the most likely tokens at its place, from the
/// model's own distribution (log-softmax of the raw logits: before penalties and temperature,
/// so the numbers say what the model thought whatever the sampler's settings).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// Most likely first; ties by lower id.
    pub top: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            penalty_window: 64,
            seed: 0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Checks every field; the message names the field and the accepted range.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::invalid(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::invalid(format!("min_p must be in [0, 1], got {}", self.min_p)));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(Error::invalid(format!(
                "repetition_penalty must be a finite number > 0, got {}",
                self.repetition_penalty
            )));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::invalid(format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(Error::invalid(format!(
                "logprobs must ask for at most {MAX_TOP_LOGPROBS} alternatives, got {n}"
            )));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}
