//! Token sampling: greedy, temperature, top-k, top-p, min-p and a repetition penalty. Each
//! request owns its sampler and its seeded RNG, so a seed reproduces the same tokens whatever
//! other requests share the batch.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

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
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Logits this far below the best (after temperature) carry under 1e-13 of its probability
/// each; dropping them before sorting changes no probability at f32 precision and saves
/// sorting the whole vocabulary every token.
const PRUNE_BELOW_MAX: f32 = 30.0;

/// A per-request sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    cand: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Self { params, rng, cand: Vec::new() })
    }

    /// A sampler that continues another's random stream from `rng_position` (as reported by
    /// `rng_position`), so a request sampled on one node and continued on another draws exactly
    /// the numbers it would have drawn on one.
    pub fn resume(params: SamplingParams, rng_position: u128) -> Result<Self> {
        let mut s = Self::new(params)?;
        s.rng.set_word_pos(rng_position);
        Ok(s)
    }

    /// Where this sampler's random stream stands.
    pub fn rng_position(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// Picks a token from `logits`; `history` is the sequence so far (for the penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut adjusted;
        let logits: &[f32] = if p.repetition_penalty != 1.0 {
            adjusted = logits.to_vec();
            let start = history.len().saturating_sub(p.penalty_window);
            let mut seen = Vec::with_capacity(p.penalty_window.min(history.len()));
            for &t in &history[start..] {
                if (t as usize) >= adjusted.len() || seen.contains(&t) {
                    continue;
                }
                seen.push(t);
                // As in llama.cpp/CTRL: push positive logits down and negative ones further down.
                let l = &mut adjusted[t as usize];
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
            &adjusted
        } else {
            logits
        };

        if p.is_greedy() {
            let mut best = 0usize;
            let mut best_v = f32::NEG_INFINITY;
            for (i, &v) in logits.iter().enumerate() {
                // Strictly greater: ties go to the lowest id; NaN never wins.
                if v > best_v {
                    best = i;
                    best_v = v;
                }
            }
            return best as u32;
        }

        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max)
            * inv_t;
        self.cand.clear();
        for (i, &l) in logits.iter().enumerate() {
            let z = l * inv_t;
            if z >= max - PRUNE_BELOW_MAX {
                self.cand.push((i as u32, z));
            }
        }
        if self.cand.is_empty() {
            return 0;
        }
        // Descending by logit; ties by id so the order (and the draw) is deterministic.
        self.cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            self.cand.truncate(p.top_k);
        }
        let top = self.cand[0].1;
        let mut probs: Vec<f64> =
            self.cand.iter().map(|&(_, z)| f64::from(z - top).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &x) in probs.iter().enumerate() {
                cum += x;
                if cum >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = f64::from(p.min_p) * probs[0];
            keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
        }
        let kept: f64 = probs[..keep].iter().sum();
        let u: f64 = self.rng.random::<f64>() * kept;
        let mut cum = 0.0;
        for (i, &x) in probs[..keep].iter().enumerate() {
            cum += x;
            if u < cum {
                return self.cand[i].0;
            }
        }
        self.cand[keep - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams { temperature: t, ..Default::default() }
    }

    #[test]
    fn greedy_takes_argmax_lowest_id_on_ties() {
        let mut s = Sampler::new(params(0.0)).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, 0.5, 0.2], &[]), 1);
    }

    #[test]
    fn validation_names_the_field() {
        for (p, field) in [
            (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature"),
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { top_p: 1.5, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: -0.1, ..Default::default() }, "min_p"),
            (
                SamplingParams { repetition_penalty: 0.0, ..Default::default() },
                "repetition_penalty",
            ),
        ] {
            let e = Sampler::new(p).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37 % 100) as f32) / 10.0).collect()
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let l = logits();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params(1.5) }).unwrap();
            (0..50).map(|_| s.sample(&l, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn resume_continues_the_random_stream() {
        let l = logits();
        let p = SamplingParams { seed: 11, ..params(1.2) };
        let mut one = Sampler::new(p.clone()).unwrap();
        let whole: Vec<u32> = (0..40).map(|_| one.sample(&l, &[])).collect();
        let mut first = Sampler::new(p.clone()).unwrap();
        let mut split: Vec<u32> = (0..7).map(|_| first.sample(&l, &[])).collect();
        let mut second = Sampler::resume(p, first.rng_position()).unwrap();
        split.extend((7..40).map(|_| second.sample(&l, &[])));
        assert_eq!(whole, split);
    }

    #[test]
    fn top_k_and_top_p_and_min_p_restrict_support() {
        let l = logits();
        let mut best: Vec<(usize, f32)> = l.iter().copied().enumerate().collect();
        best.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top3: Vec<u32> = best[..3].iter().map(|&(i, _)| i as u32).collect();
        let mut s = Sampler::new(SamplingParams { top_k: 3, seed: 1, ..params(5.0) }).unwrap();
        for _ in 0..200 {
            assert!(top3.contains(&s.sample(&l, &[])));
        }
        // A tiny top_p keeps only the most likely token.
        let mut s = Sampler::new(SamplingParams { top_p: 1e-6, seed: 2, ..params(1.0) }).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&l, &[]), top3[0]);
        }
        // min_p = 1 keeps only tokens as likely as the best.
        let mut s = Sampler::new(SamplingParams { min_p: 1.0, seed: 3, ..params(1.0) }).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&l, &[]), top3[0]);
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with logits ln(3) and 0: expect ~75% / 25%.
        let l = [3f32.ln(), 0.0];
        let mut s = Sampler::new(SamplingParams { seed: 9, ..params(1.0) }).unwrap();
        let n = 20_000;
        let zeros = (0..n).filter(|_| s.sample(&l, &[]) == 0).count();
        let frac = zeros as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn repetition_penalty_demotes_recent_tokens() {
        let l = [2.0f32, 1.9, -1.0];
        let mut s =
            Sampler::new(SamplingParams { repetition_penalty: 1.5, ..params(0.0) }).unwrap();
        assert_eq!(s.sample(&l, &[]), 0);
        assert_eq!(s.sample(&l, &[0]), 1);
        // Outside the window the penalty no longer applies.
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 1.5,
            penalty_window: 1,
            ..params(0.0)
        })
        .unwrap();
        assert_eq!(s.sample(&l, &[0, 2]), 0);
    }
}
