//! Stall-free steps for a runner that both decodes and prefills (a decode node prefilling a
//! prompt itself: colocated, or conditional disaggregation). Every running stream waits for
//! the whole step its next token is in, so a step that also computes a long prompt chunk
//! stalls them all. The pacer sizes each step's prompt tokens so that the step fits an
//! inter-token target: from the steps it has seen it learns what a step of decodes alone
//! costs and what each prompt token adds, and leaves the prompt what the target has room
//! for, never less than `MIN_CHUNK` tokens (a prompt always advances) and never more than the
//! engine's `max_batch_tokens`. With nothing decoding there is nobody to stall: a step takes
//! the whole budget.

use std::time::Duration;

/// Fewest prompt tokens a step gives a waiting prompt, however tight the target.
pub const MIN_CHUNK: usize = 16;

/// Weight of the newest step in the running estimates.
const ALPHA: f64 = 0.2;

/// Prompt tokens a step with streams running gets before the pacer has seen a prompt step.
const FIRST_CHUNK: usize = 64;

/// Prompt tokens a step must carry to teach the per-token cost (fewer are mostly noise).
const LEARN_FROM: usize = 8;

#[derive(Debug, Clone)]
pub struct StepPacer {
    target_ms: f64,
    max_tokens: usize,
    /// A step of decodes alone, per decoding sequence and fixed.
    decode_ms: Option<f64>,
    /// What each prompt token adds to a step: the running estimate, and the latest step's.
    /// The budget goes by the larger, so a cost that climbs (a prompt's later chunks attend
    /// over more context) is followed at once rather than over several late steps.
    token_ms: Option<f64>,
    last_token_ms: f64,
}

impl StepPacer {
    /// Steps of at most `max_tokens` tokens, each with streams running aimed at `target`
    /// (`None`: no target, every step takes `max_tokens`).
    pub fn new(target: Option<Duration>, max_tokens: usize) -> Self {
        Self {
            target_ms: target.map_or(0.0, |t| t.as_secs_f64() * 1e3),
            max_tokens: max_tokens.max(1),
            decode_ms: None,
            token_ms: None,
            last_token_ms: 0.0,
        }
    }

    /// The next step's token budget (decodes included) with `decoding` streams running.
    pub fn budget(&self, decoding: usize) -> usize {
        if self.target_ms <= 0.0 || decoding == 0 {
            return self.max_tokens;
        }
        let prompt = match (self.decode_ms, self.token_ms) {
            // (A hair over, so that a budget that fits exactly is not lost to rounding.)
            (Some(d), Some(t)) if t > 0.0 => {
                let t = t.max(self.last_token_ms);
                ((self.target_ms - d) / t + 1e-6).max(0.0) as usize
            }
            _ => FIRST_CHUNK,
        };
        (decoding + prompt.max(MIN_CHUNK)).min(self.max_tokens.max(decoding + MIN_CHUNK))
    }

    /// A step of `decoding` decodes and `prompt` prompt tokens took `took`.
    pub fn observe(&mut self, decoding: usize, prompt: usize, took: Duration) {
        let ms = took.as_secs_f64() * 1e3;
        let ewma = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + ALPHA * (new - o)));
        if prompt == 0 {
            if decoding > 0 {
                self.decode_ms = ewma(self.decode_ms, ms);
            }
        } else if prompt >= LEARN_FROM {
            let base = if decoding > 0 { self.decode_ms.unwrap_or(0.0) } else { 0.0 };
            self.last_token_ms = ((ms - base) / prompt as f64).max(0.0);
            self.token_ms = ewma(self.token_ms, self.last_token_ms);
        }
    }

    /// The target in ms (0: none).
    pub fn target_ms(&self) -> f64 {
        self.target_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    #[test]
    fn without_streams_or_a_target_a_step_takes_the_whole_budget() {
        let p = StepPacer::new(Some(ms(50.0)), 512);
        assert_eq!(p.budget(0), 512);
        assert_eq!(StepPacer::new(None, 512).budget(8), 512);
    }

    /// A step costs 10 ms of decoding plus 0.5 ms a prompt token: a 50 ms target leaves 80
    /// prompt tokens, and the estimate converges there from the first cautious chunk.
    #[test]
    fn the_prompt_gets_what_the_target_leaves_after_the_decodes() {
        let mut p = StepPacer::new(Some(ms(50.0)), 512);
        assert_eq!(p.budget(4), 4 + FIRST_CHUNK);
        for _ in 0..200 {
            let b = p.budget(4);
            let prompt = b - 4;
            p.observe(4, prompt, ms(10.0 + 0.5 * prompt as f64));
            p.observe(4, 0, ms(10.0));
        }
        assert_eq!(p.budget(4), 4 + 80);
        // A slower machine (or a bigger model) gets smaller chunks from the same target.
        for _ in 0..200 {
            p.observe(4, 0, ms(30.0));
            p.observe(4, 40, ms(30.0 + 40.0 * 1.0));
        }
        assert_eq!(p.budget(4), 4 + 20);
    }

    #[test]
    fn a_target_below_a_decode_step_still_advances_the_prompt() {
        let mut p = StepPacer::new(Some(ms(5.0)), 512);
        for _ in 0..20 {
            p.observe(2, 0, ms(20.0));
            p.observe(2, 32, ms(36.0));
        }
        assert_eq!(p.budget(2), 2 + MIN_CHUNK);
        // Never past the engine's step size, however loose the target.
        let mut loose = StepPacer::new(Some(ms(10_000.0)), 256);
        loose.observe(1, 0, ms(1.0));
        loose.observe(1, 100, ms(2.0));
        assert_eq!(loose.budget(1), 256);
    }
}
