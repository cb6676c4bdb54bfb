//! Local generation: the batch runner with no connector, for one or many prompts. Used by
//! `pdmesh run`, the tests and the benchmarks; prefill and decode nodes drive the same runner.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::connector::NoConnector;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::finish::FinishReason;
use crate::runner::{BatchRunner, End, Event, GenerateParams, LogitsObserver, SeqSpec};

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

/// Generates for every request; `on_token(i, id)` sees each new token of request `i` as it is
/// produced and returns `false` to stop that request. Sequences are freed however this ends.
pub fn generate_batch(
    engine: &mut Engine,
    requests: &[(Vec<u32>, GenerateParams)],
    max_running: usize,
    on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Generation>> {
    generate_batch_with(engine, requests, max_running, None, on_token)
}

struct Progress {
    tokens: Vec<u32>,
    ttft: Option<Duration>,
}

/// `generate_batch`, also showing `on_logits(i, logits)` the logits each token is sampled from
/// (so they are read back whole even where only greedy picks are needed).
pub fn generate_batch_observed(
    engine: &mut Engine,
    requests: &[(Vec<u32>, GenerateParams)],
    max_running: usize,
    mut on_logits: impl FnMut(usize, &[f32]),
    on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Generation>> {
    let mut observe = |id: usize, row: &[f32]| on_logits(id, row);
    generate_batch_with(engine, requests, max_running, Some(&mut observe), on_token)
}

/// Shown the logits each token of request `i` is sampled from.
type RequestObserver<'a> = dyn FnMut(usize, &[f32]) + 'a;

fn generate_batch_with(
    engine: &mut Engine,
    requests: &[(Vec<u32>, GenerateParams)],
    max_running: usize,
    mut on_logits: Option<&mut RequestObserver<'_>>,
    mut on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Generation>> {
    let start = Instant::now();
    let mut runner = BatchRunner::new(engine, max_running, false);
    let mut none = NoConnector;
    let mut progress: HashMap<u64, Progress> = HashMap::new();
    let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
    let result = (|| -> Result<()> {
        for (i, (prompt, p)) in requests.iter().enumerate() {
            let spec = SeqSpec::generate(prompt.clone(), p.clone());
            runner.add(engine, &mut none, i as u64, spec).map_err(|e| match e {
                Error::InvalidRequest(m) => Error::invalid(format!("request {i}: {m}")),
                other => other,
            })?;
            progress.insert(i as u64, Progress { tokens: Vec::new(), ttft: None });
        }
        let mut stopped = std::collections::HashSet::new();
        while !runner.is_empty() {
            let plan = runner.plan(engine, &mut none);
            let observed = on_logits.is_some();
            let mut observe = |id: u64, row: &[f32]| {
                if let Some(f) = on_logits.as_mut() {
                    f(id as usize, row);
                }
            };
            let observer: Option<&mut LogitsObserver<'_>> =
                if observed { Some(&mut observe) } else { None };
            let outputs = runner.run(&plan, engine, &mut none, observer).map_err(|f| f.error)?;
            for o in outputs {
                let i = o.id as usize;
                let p = progress.get_mut(&o.id).expect("every request has progress");
                match o.event {
                    Event::Delta(piece, _) => {
                        p.ttft.get_or_insert_with(|| start.elapsed());
                        for t in piece.tokens {
                            p.tokens.push(t);
                            if !stopped.contains(&o.id) && !on_token(i, t) {
                                stopped.insert(o.id);
                            }
                        }
                    }
                    Event::Done { end, .. } => {
                        let (finish, stop_token) = match end {
                            // The caller's stop wins over a rule that ended it in the same step.
                            _ if stopped.contains(&o.id) => (FinishReason::Cancelled, None),
                            End::Finished { reason, stop_token } => (reason, stop_token),
                            End::Failed(e) => return Err(e),
                            End::Prefilled { .. } => unreachable!("generation has no prefill role"),
                        };
                        done[i] = Some(Generation {
                            tokens: std::mem::take(&mut p.tokens),
                            finish,
                            stop_token,
                            prompt_tokens: requests[i].0.len(),
                            time_to_first_token: p.ttft.unwrap_or_else(|| start.elapsed()),
                            total_time: start.elapsed(),
                        });
                    }
                }
            }
            for &id in &stopped {
                if runner.contains(id) {
                    // Without text there is no tail to deliver; its end is recorded here.
                    runner.cancel(engine, &mut none, id);
                    let p = progress.get_mut(&id).expect("every request has progress");
                    done[id as usize] = Some(Generation {
                        tokens: std::mem::take(&mut p.tokens),
                        finish: FinishReason::Cancelled,
                        stop_token: None,
                        prompt_tokens: requests[id as usize].0.len(),
                        time_to_first_token: p.ttft.unwrap_or_default(),
                        total_time: start.elapsed(),
                    });
                }
            }
        }
        Ok(())
    })();
    // Whatever is left (an error ended the loop) is cancelled, which frees its sequence.
    for id in 0..requests.len() as u64 {
        if runner.contains(id) {
            runner.cancel(engine, &mut none, id);
        }
    }
    result?;
    Ok(done
        .into_iter()
        .map(|g| g.expect("every request finishes before the runner empties"))
        .collect())
}

/// Generates for one prompt, streaming each token to `on_token` (return `false` to stop).
pub fn generate(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Generation> {
    let reqs = [(prompt.to_vec(), params.clone())];
    let mut out = generate_batch(engine, &reqs, 1, |_, t| on_token(t))?;
    Ok(out.remove(0))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::testing::tiny_model;

    #[test]
    fn a_bad_request_is_named_once_and_frees_everything() {
        let cfg = EngineConfig { threads: 1, kv_blocks: 64, ..Default::default() };
        let mut e = Engine::new(tiny_model(), cfg).expect("engine");
        let ok = (vec![1, 2, 3], GenerateParams { max_tokens: 4, ..Default::default() });
        let long = (vec![1; 300], GenerateParams::default());
        let err = generate_batch(&mut e, &[ok, long], 4, |_, _| true).expect_err("too long");
        let msg = err.to_string();
        assert!(msg.starts_with("invalid request: request 1: a prompt of 300 tokens"), "{msg}");
        assert_eq!(e.kv().free_blocks(), 64, "the request admitted before it was freed");
    }

    /// Unobserved requests whose samplers have a cut (greedy, or top-k without penalties)
    /// pick from the candidates the step gives (`Logits::Cut`, cut by the backend); observed
    /// ones, and a batch with a sampler that has none, from whole logits: the same tokens.
    #[test]
    fn candidates_from_the_step_give_the_samplers_tokens() {
        use crate::SamplingParams;
        let cfg = EngineConfig { threads: 1, kv_blocks: 64, ..Default::default() };
        let mut e = Engine::new(tiny_model(), cfg).expect("engine");
        let greedy = GenerateParams { max_tokens: 12, ignore_eos: true, ..Default::default() };
        let with = |sampling| GenerateParams { sampling, ..greedy.clone() };
        let top_k = SamplingParams { temperature: 1.3, top_k: 6, seed: 3, ..Default::default() };
        let nucleus = SamplingParams { top_k: 40, top_p: 0.9, min_p: 0.02, seed: 4, ..top_k };
        let sampled = with(SamplingParams { temperature: 0.8, seed: 3, ..Default::default() });
        let prompts: Vec<Vec<u32>> =
            (0..3u32).map(|i| (0..9).map(|j| 7 + 31 * i + j).collect()).collect();
        let params = [greedy.clone(), with(top_k), with(nucleus)];
        let reqs: Vec<_> = prompts.iter().cloned().zip(params).collect();
        let picked = generate_batch(&mut e, &reqs, 3, |_, _| true).expect("cut");
        let mut seen = 0;
        let observed =
            generate_batch_observed(&mut e, &reqs, 3, |_, _| seen += 1, |_, _| true).expect("seen");
        assert!(seen > 0);
        for (p, o) in picked.iter().zip(&observed) {
            assert_eq!(p.tokens, o.tokens);
            assert_eq!(p.tokens.len(), 12);
        }
        let mut mixed = reqs.clone();
        mixed[1].1 = sampled;
        let m = generate_batch(&mut e, &mixed, 3, |_, _| true).expect("mixed");
        assert_eq!((&m[0].tokens, &m[2].tokens), (&picked[0].tokens, &picked[2].tokens));
    }
}
