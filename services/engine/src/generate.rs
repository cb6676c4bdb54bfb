//! Local generation: drives the engine with the continuous-batching scheduler for one or many
//! prompts, sampling each sequence with its own sampler. Used by `pdmesh run`, the engine
//! benchmark and the tests; the decode service drives the same pieces over the network.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::engine::{Engine, Logits, StepItem};
use crate::error::{Error, Result};
use crate::kv_cache::SeqId;
use crate::sampler::{Sampler, SamplingParams};
use crate::scheduler::{Scheduler, Work};

/// What to generate for one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    pub sampling: SamplingParams,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Extra token ids that end generation.
    pub stop_tokens: Vec<u32>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::default(),
            max_tokens: 128,
            stop_tokens: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-generation token.
    Eos,
    /// One of `stop_tokens` was produced.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The sequence filled the model's context.
    ContextFull,
    /// The caller's callback asked to stop.
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

/// The result for one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated ids (the token that stopped generation is not included).
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// The EOS/stop token that ended it, if any.
    pub stop_token: Option<u32>,
    pub prompt_tokens: usize,
    /// From start to the first generated token.
    pub time_to_first_token: Duration,
    pub total_time: Duration,
}

struct Running {
    seq: SeqId,
    sampler: Sampler,
    history: Vec<u32>,
    prompt_len: usize,
    next: Option<u32>,
    out: Vec<u32>,
    ttft: Option<Duration>,
}

/// Generates for every request; `on_token(i, id)` sees each new token of request `i` as it is
/// produced and returns `false` to stop that request. Sequences are freed however this ends.
pub fn generate_batch(
    engine: &mut Engine,
    requests: &[(Vec<u32>, GenerateParams)],
    max_running: usize,
    on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Generation>> {
    generate_batch_observed(engine, requests, max_running, |_, _| {}, on_token)
}

/// `generate_batch`, also showing `on_logits(i, logits)` the logits each token is sampled from.
pub fn generate_batch_observed(
    engine: &mut Engine,
    requests: &[(Vec<u32>, GenerateParams)],
    max_running: usize,
    mut on_logits: impl FnMut(usize, &[f32]),
    mut on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Generation>> {
    let start = Instant::now();
    let mut sched = Scheduler::new(engine.config().max_batch_tokens, max_running);
    let mut running: HashMap<u64, Running> = HashMap::new();
    let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
    for (i, (prompt, p)) in requests.iter().enumerate() {
        if p.max_tokens == 0 {
            return Err(Error::invalid(format!("request {i}: max_tokens must be at least 1")));
        }
        if prompt.len() >= engine.max_seq_len() {
            return Err(Error::invalid(format!(
                "request {i}: prompt of {} tokens leaves no room in the context of {}",
                prompt.len(),
                engine.max_seq_len()
            )));
        }
        sched.add(i as u64, prompt.len()).map_err(|e| Error::invalid(e.to_string()))?;
    }
    let result = (|| -> Result<()> {
        while !sched.is_empty() {
            let plan = sched.plan();
            for s in &plan {
                if let std::collections::hash_map::Entry::Vacant(e) = running.entry(s.id) {
                    let i = s.id as usize;
                    let (prompt, p) = &requests[i];
                    e.insert(Running {
                        seq: engine.create_sequence(),
                        sampler: Sampler::new(p.sampling.clone())?,
                        history: prompt.clone(),
                        prompt_len: prompt.len(),
                        next: None,
                        out: Vec::new(),
                        ttft: None,
                    });
                }
            }
            let decode_tokens: Vec<[u32; 1]> =
                plan.iter().map(|s| [running[&s.id].next.unwrap_or(0)]).collect();
            let items: Vec<StepItem<'_>> = plan
                .iter()
                .zip(&decode_tokens)
                .map(|(s, tok)| {
                    let r = &running[&s.id];
                    match s.work {
                        Work::Prefill { offset, len, last } => StepItem::prefill(
                            r.seq,
                            &requests[s.id as usize].0[offset..offset + len],
                            if last { Logits::Last } else { Logits::None },
                        ),
                        Work::Decode => StepItem::decode(r.seq, tok),
                    }
                })
                .collect();
            let ctx = engine.max_seq_len();
            let model = std::sync::Arc::clone(engine.model());
            let logits = engine.step(&items)?;
            let mut finished = Vec::new();
            for (k, s) in plan.iter().enumerate() {
                let Some(row) = logits.last_of(k) else { continue };
                let i = s.id as usize;
                let p = &requests[i].1;
                let r = running.get_mut(&s.id).expect("scheduled sequences are running");
                on_logits(i, row);
                let tok = r.sampler.sample(row, &r.history);
                r.ttft.get_or_insert_with(|| start.elapsed());
                let stop = if !p.ignore_eos && model.tokenizer.is_eog(tok) {
                    Some(FinishReason::Eos)
                } else if p.stop_tokens.contains(&tok) {
                    Some(FinishReason::Stop)
                } else {
                    None
                };
                let reason = match stop {
                    Some(reason) => Some((reason, Some(tok))),
                    None => {
                        r.out.push(tok);
                        r.history.push(tok);
                        if !on_token(i, tok) {
                            Some((FinishReason::Cancelled, None))
                        } else if r.out.len() >= p.max_tokens {
                            Some((FinishReason::Length, None))
                        } else if r.prompt_len + r.out.len() >= ctx {
                            Some((FinishReason::ContextFull, None))
                        } else {
                            r.next = Some(tok);
                            None
                        }
                    }
                };
                if let Some((finish, stop_token)) = reason {
                    finished.push((s.id, finish, stop_token));
                }
            }
            for (id, finish, stop_token) in finished {
                sched.remove(id);
                let r = running.remove(&id).expect("finished sequences are running");
                engine.free_sequence(r.seq)?;
                done[id as usize] = Some(Generation {
                    tokens: r.out,
                    finish,
                    stop_token,
                    prompt_tokens: r.prompt_len,
                    time_to_first_token: r.ttft.unwrap_or_default(),
                    total_time: start.elapsed(),
                });
            }
        }
        Ok(())
    })();
    for (_, r) in running.drain() {
        let _ = engine.free_sequence(r.seq);
    }
    result?;
    Ok(done
        .into_iter()
        .map(|g| g.expect("every request finishes before the scheduler empties"))
        .collect())
}

/// Generates for one prompt, streaming each token to `on_token` (return `false` to stop).
pub fn generate(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: impl FnMut(u32) -> bool,
) -> Result<Generation> {
    generate_observed(engine, prompt, params, |_| {}, on_token)
}

/// `generate`, also showing `on_logits` the logits each token is sampled from.
pub fn generate_observed(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_logits: impl FnMut(&[f32]),
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Generation> {
    let reqs = [(prompt.to_vec(), params.clone())];
    let mut out =
        generate_batch_observed(engine, &reqs, 1, |_, l| on_logits(l), |_, t| on_token(t))?;
    Ok(out.remove(0))
}
