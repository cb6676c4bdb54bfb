//! Stall-free steps for a runner that both decodes and prefills (a decode node prefilling a
//! prompt itself: colocated, or conditional disaggregation). Every running stream waits for
//! the whole step its next token is in, so a step that also computes a long prompt chunk
//! stalls them all. The pacer sizes the prompt tokens of each step that has streams in it so
//! that the step fits an inter-token target.
//!
//! It steers by what the streams see: the time from one step's start to the next one's (the
//! compute, sampling, delivery and whatever the node's loop does between steps), not a model
//! of the compute. After each such step it scales the chunk by aim / took, where the aim is
//! 80% of the target (headroom for steps that run long whatever the pacer does), which
//! settles where a step takes the aim whatever the step costs (a fixed part plus a part per
//! prompt token: the fixed part makes each correction smaller than the last). It shrinks at
//! once (by half at most) and grows by a quarter at most. A chunk the prompt did not fill
//! (its last) teaches nothing unless the step was still too long. The
//! chunk is never below `MIN_CHUNK` tokens (a prompt always advances) nor above the engine's
//! `max_batch_tokens`; with nothing decoding there is nobody to stall and a step takes the
//! whole budget.

use std::time::Duration;

/// Fewest prompt tokens a step gives a waiting prompt, however tight the target.
pub const MIN_CHUNK: usize = 16;

/// Prompt tokens a step with streams in it gets before the pacer has seen one.
pub const FIRST_CHUNK: usize = 64;

/// Largest correction of one step downwards: one odd step (a page fault, another process
/// taking the core) halves the chunk at most.
const MAX_SHRINK: f64 = 2.0;

/// Largest growth of one step: slower up than down, so that a step that ran long is not
/// soon repeated.
const MAX_GROW: f64 = 1.25;

/// The share of the target steps aim at: the rest is headroom for the steps that run long
/// anyway (the machine's other work), so that the target bounds the tail, not the mean.
const AIM: f64 = 0.8;

#[derive(Debug, Clone)]
pub struct StepPacer {
    target_ms: f64,
    max_tokens: usize,
    /// Prompt tokens for the next step with streams in it.
    chunk: f64,
}

impl StepPacer {
    /// Steps of at most `max_tokens` tokens, each with streams running aimed at `target`
    /// (`None`: no target, every step takes `max_tokens`).
    pub fn new(target: Option<Duration>, max_tokens: usize) -> Self {
        let max_tokens = max_tokens.max(1);
        Self {
            target_ms: target.map_or(0.0, |t| t.as_secs_f64() * 1e3),
            max_tokens,
            chunk: FIRST_CHUNK.min(max_tokens) as f64,
        }
    }

    fn paced(&self) -> bool {
        self.target_ms > 0.0
    }

    /// The next step's token budget (decodes included) with `decoding` streams running.
    pub fn budget(&self, decoding: usize) -> usize {
        if !self.paced() || decoding == 0 {
            return self.max_tokens;
        }
        let want = decoding + (self.chunk as usize).max(MIN_CHUNK);
        want.min(self.max_tokens.max(decoding + MIN_CHUNK))
    }

    /// A step of `decoding` decodes and `prompt` prompt tokens took `took`, from its start to
    /// the next step's.
    pub fn observe(&mut self, decoding: usize, prompt: usize, took: Duration) {
        let ms = took.as_secs_f64() * 1e3;
        if !self.paced() || decoding == 0 || prompt == 0 || ms <= 0.0 {
            return;
        }
        let over = ms > AIM * self.target_ms;
        if over || prompt >= self.chunk as usize {
            let scale = (AIM * self.target_ms / ms).clamp(1.0 / MAX_SHRINK, MAX_GROW);
            self.chunk = (self.chunk * scale).clamp(MIN_CHUNK as f64, self.max_tokens as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    /// Steps the pacer against a step that costs `fixed` ms plus `per_token` ms a prompt
    /// token; returns the prompt tokens of the last step.
    fn settle(p: &mut StepPacer, decoding: usize, fixed: f64, per_token: f64) -> usize {
        let mut prompt = 0;
        for _ in 0..100 {
            prompt = p.budget(decoding) - decoding;
            p.observe(decoding, prompt, ms(fixed + per_token * prompt as f64));
        }
        prompt
    }

    #[test]
    fn without_streams_or_a_target_a_step_takes_the_whole_budget() {
        let p = StepPacer::new(Some(ms(50.0)), 512);
        assert_eq!(p.budget(0), 512);
        assert_eq!(StepPacer::new(None, 512).budget(8), 512);
    }

    /// A step costs 10 ms plus 0.5 ms a prompt token: a 50 ms target, aimed at 40 ms, leaves
    /// 60 prompt tokens, and the pacer settles there from its first cautious chunk.
    #[test]
    fn the_prompt_gets_what_the_target_leaves_after_the_decodes() {
        let mut p = StepPacer::new(Some(ms(50.0)), 512);
        assert_eq!(p.budget(4), 4 + FIRST_CHUNK);
        let got = settle(&mut p, 4, 10.0, 0.5);
        assert!((59..=60).contains(&got), "{got}");
        // A slower machine (or a bigger model) gets smaller chunks from the same target.
        let got = settle(&mut p, 4, 20.0, 1.0);
        assert!((19..=20).contains(&got), "{got}");
        // The prompt's last, short chunk teaches nothing when the step was quick.
        p.observe(4, 3, ms(21.0));
        assert!((19..=20).contains(&(p.budget(4) - 4)));
    }

    #[test]
    fn a_target_below_a_decode_step_still_advances_the_prompt() {
        let mut p = StepPacer::new(Some(ms(5.0)), 512);
        assert_eq!(settle(&mut p, 2, 20.0, 0.5), MIN_CHUNK);
        // Never past the engine's step size, however loose the target.
        let mut loose = StepPacer::new(Some(ms(10_000.0)), 256);
        assert_eq!(settle(&mut loose, 1, 1.0, 0.01), 255);
    }
}
