//! Token sampling: greedy, temperature, top-k, top-p, min-p, a repetition penalty and
//! OpenAI's frequency and presence penalties; on request, each token's log-probability and the
//! most likely alternatives. Each request owns its sampler and its seeded RNG, so a seed
//! reproduces the same tokens whatever other requests share the batch.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use pdmesh_kernels::Cut;

use crate::error::Result;
pub use pdmesh_model::sampling::{MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs};

/// Logits this far below the best (after temperature) carry under 1e-13 of its probability
/// each; dropping them before sorting changes no probability at f32 precision and saves
/// sorting the whole vocabulary every token.
const PRUNE_BELOW_MAX: f32 = 30.0;

/// The largest top-k a device cuts logits to (`Sampler::cut`); larger ones, and samplers
/// without a top-k, whose candidates within the prune margin can be most of the vocabulary,
/// read the logits whole.
pub const MAX_DEVICE_TOP_K: u32 = 1024;

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

    /// The cut of a row of logits whose candidates are all this sampler picks from, when
    /// there is one worth making: no penalty moves logits and no log-probabilities are
    /// reported, and the sampler is greedy (the maximum's ties) or keeps a top-k of at most
    /// `MAX_DEVICE_TOP_K` (the temperature's prune margin and the top-k). Then a device may
    /// cut the logits where they are (`Logits::Cut`) and `sample_candidates` picks the token
    /// `sample` would have.
    pub fn cut(&self) -> Option<Cut> {
        let p = &self.params;
        let plain = p.repetition_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && p.logprobs.is_none();
        if !plain {
            return None;
        }
        if p.is_greedy() {
            return Some(Cut::GREEDY);
        }
        let top_k = u32::try_from(p.top_k).ok().filter(|&k| k > 0 && k <= MAX_DEVICE_TOP_K)?;
        Some(Cut { scale: 1.0 / p.temperature, margin: PRUNE_BELOW_MAX, top_k })
    }

    /// Where this sampler's random stream stands.
    pub fn rng_position(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// Picks a token from `logits`; `history` is the sequence so far, the output being what
    /// follows its first `prompt_len` tokens (frequency and presence penalties count only it;
    /// the repetition penalty looks at the whole window). With `logprobs` set, also reports
    /// the token's log-probability and the most likely alternatives.
    pub fn sample(
        &mut self,
        logits: &[f32],
        history: &[u32],
        prompt_len: usize,
    ) -> (u32, Option<TokenLogprobs>) {
        let tok = self.pick(logits, history, prompt_len);
        let report = self.params.logprobs.map(|n| logprobs_of(logits, tok, n as usize));
        (tok, report)
    }

    fn pick(&mut self, logits: &[f32], history: &[u32], prompt_len: usize) -> u32 {
        let p = &self.params;
        let mut adjusted;
        let counted = p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        let logits: &[f32] = if p.repetition_penalty != 1.0 || counted {
            adjusted = logits.to_vec();
            if p.repetition_penalty != 1.0 {
                let start = history.len().saturating_sub(p.penalty_window);
                let mut seen = Vec::with_capacity(p.penalty_window.min(history.len()));
                for &t in &history[start..] {
                    if (t as usize) >= adjusted.len() || seen.contains(&t) {
                        continue;
                    }
                    seen.push(t);
                    // As in llama.cpp/CTRL: push positive logits down and negative ones further down.
                    let l = &mut adjusted[t as usize];
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
            if counted {
                let mut output = history[prompt_len.min(history.len())..].to_vec();
                output.sort_unstable();
                for run in output.chunk_by(|a, b| a == b) {
                    if let Some(l) = adjusted.get_mut(run[0] as usize) {
                        *l -= p.frequency_penalty * run.len() as f32 + p.presence_penalty;
                    }
                }
            }
            &adjusted
        } else {
            logits
        };

        if p.is_greedy() {
            // Ties go to the lowest id; NaN never wins (the device reduction's rule too).
            return pdmesh_kernels::argmax(logits);
        }
        self.draw(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)))
    }

    /// The token `sample` picks from logits whose candidates under `cut()` are `candidates`
    /// (in any order): the same token, and the same random numbers drawn. Only for a sampler
    /// that has a cut.
    pub fn sample_candidates(&mut self, candidates: &[(u32, f32)]) -> u32 {
        debug_assert!(self.cut().is_some(), "a sampler without a cut needs whole logits");
        if self.params.is_greedy() {
            return pdmesh_kernels::argmax_of(candidates);
        }
        self.draw(candidates.iter().copied())
    }

    /// Draws from `(id, logit)` pairs: every token of the row, or a superset of those within
    /// the prune margin of the maximum that holds the top-k (so the same draw either way).
    fn draw(&mut self, logits: impl Iterator<Item = (u32, f32)> + Clone) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max =
            logits.clone().map(|l| l.1).filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max)
                * inv_t;
        self.cand.clear();
        for (i, l) in logits {
            let z = l * inv_t;
            if z >= max - PRUNE_BELOW_MAX {
                self.cand.push((i, z));
            }
        }
        if self.cand.is_empty() {
            return 0;
        }
        // Descending by logit; ties by id so the order (and the draw) is deterministic. The
        // order is total, so selecting the top-k before sorting keeps the same k in the same
        // order, without sorting the thousands a high temperature leaves within the margin.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && self.cand.len() > p.top_k {
            self.cand.select_nth_unstable_by(p.top_k - 1, order);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_unstable_by(order);
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

/// `token`'s log-probability under `logits` and the `n` most likely tokens with theirs.
fn logprobs_of(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().filter(|v| !v.is_nan()).map(|&v| f64::from(v - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    let lp = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { (f64::from(v) - log_z) as f32 };
    // The n best by one pass over a short sorted list (n is at most 20).
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() || (top.len() == n && v <= top[n - 1].1) {
                continue;
            }
            let at = top.partition_point(|&(_, b)| b >= v);
            top.insert(at, (i as u32, v));
            top.truncate(n);
        }
    }
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&v| lp(v));
    TokenLogprobs { token, logprob, top: top.into_iter().map(|(i, v)| (i, lp(v))).collect() }
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
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], &[], 0).0, 1);
        assert_eq!(s.sample(&[f32::NAN, 0.5, 0.2], &[], 0).0, 1);
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
            (0..50).map(|_| s.sample(&l, &[], 0).0).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn resume_continues_the_random_stream() {
        let l = logits();
        let p = SamplingParams { seed: 11, ..params(1.2) };
        let mut one = Sampler::new(p.clone()).unwrap();
        let whole: Vec<u32> = (0..40).map(|_| one.sample(&l, &[], 0).0).collect();
        let mut first = Sampler::new(p.clone()).unwrap();
        let mut split: Vec<u32> = (0..7).map(|_| first.sample(&l, &[], 0).0).collect();
        let mut second = Sampler::resume(p, first.rng_position()).unwrap();
        split.extend((7..40).map(|_| second.sample(&l, &[], 0).0));
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
            assert!(top3.contains(&s.sample(&l, &[], 0).0));
        }
        // A tiny top_p keeps only the most likely token.
        let mut s = Sampler::new(SamplingParams { top_p: 1e-6, seed: 2, ..params(1.0) }).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&l, &[], 0).0, top3[0]);
        }
        // min_p = 1 keeps only tokens as likely as the best.
        let mut s = Sampler::new(SamplingParams { min_p: 1.0, seed: 3, ..params(1.0) }).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&l, &[], 0).0, top3[0]);
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with logits ln(3) and 0: expect ~75% / 25%.
        let l = [3f32.ln(), 0.0];
        let mut s = Sampler::new(SamplingParams { seed: 9, ..params(1.0) }).unwrap();
        let n = 20_000;
        let zeros = (0..n).filter(|_| s.sample(&l, &[], 0).0 == 0).count();
        let frac = zeros as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn repetition_penalty_demotes_recent_tokens() {
        let l = [2.0f32, 1.9, -1.0];
        let mut s =
            Sampler::new(SamplingParams { repetition_penalty: 1.5, ..params(0.0) }).unwrap();
        assert_eq!(s.sample(&l, &[], 0).0, 0);
        assert_eq!(s.sample(&l, &[0], 0).0, 1);
        // Outside the window the penalty no longer applies.
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 1.5,
            penalty_window: 1,
            ..params(0.0)
        })
        .unwrap();
        assert_eq!(s.sample(&l, &[0, 2], 0).0, 0);
    }

    #[test]
    fn frequency_and_presence_penalties_count_only_the_output() {
        let l = [2.0f32, 1.5, 0.0];
        let freq = SamplingParams { frequency_penalty: 0.3, ..params(0.0) };
        let mut s = Sampler::new(freq).unwrap();
        // Token 0 twice in the output: 2.0 - 0.6 < 1.5.
        assert_eq!(s.sample(&l, &[0, 0], 0).0, 1);
        // Once: 2.0 - 0.3 > 1.5.
        assert_eq!(s.sample(&l, &[0, 0], 1).0, 0);
        // In the prompt only: no penalty at all.
        assert_eq!(s.sample(&l, &[0, 0], 2).0, 0);
        let pres = SamplingParams { presence_penalty: 0.6, ..params(0.0) };
        let mut s = Sampler::new(pres).unwrap();
        assert_eq!(s.sample(&l, &[0], 0).0, 1);
        // A negative penalty encourages repeating.
        let enc = SamplingParams { presence_penalty: -1.0, ..params(0.0) };
        let mut s = Sampler::new(enc).unwrap();
        assert_eq!(s.sample(&l, &[2], 0).0, 0);
        assert_eq!(s.sample(&[2.0, 1.5, 1.2], &[2], 0).0, 2);
        for bad in [2.5f32, -2.1, f32::NAN] {
            let p = SamplingParams { frequency_penalty: bad, ..params(0.0) };
            assert!(Sampler::new(p).unwrap_err().to_string().contains("frequency_penalty"));
        }
    }

    #[test]
    fn logprobs_are_the_model_distribution_with_the_best_first() {
        let l = [1.0f32, 3.0, 2.0, 3.0];
        let p = SamplingParams { logprobs: Some(3), presence_penalty: 2.0, ..params(0.0) };
        let mut s = Sampler::new(p).unwrap();
        // The penalty moves the choice to token 3 but not the reported distribution.
        let (tok, lp) = s.sample(&l, &[1], 0);
        let lp = lp.unwrap();
        assert_eq!(tok, 3);
        let z: f64 = l.iter().map(|&v| f64::from(v).exp()).sum();
        let want = |v: f32| (f64::from(v) - z.ln()) as f32;
        assert!((lp.logprob - want(3.0)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        assert!((lp.top[2].1 - want(2.0)).abs() < 1e-6);
        let total: f32 = l.iter().map(|&v| want(v).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        // Without logprobs asked for, none; with zero alternatives, just the token's.
        assert!(Sampler::new(params(0.0)).unwrap().sample(&l, &[], 0).1.is_none());
        let p = SamplingParams { logprobs: Some(0), ..params(0.0) };
        let lp = Sampler::new(p).unwrap().sample(&l, &[], 0).1.unwrap();
        assert!(lp.top.is_empty() && lp.token == 1);
        let p = SamplingParams { logprobs: Some(21), ..params(0.0) };
        assert!(Sampler::new(p).unwrap_err().to_string().contains("logprobs"));
    }

    /// A sampler with a cut picks from the cut's candidates, in any order, what it picks
    /// from the whole row, drawing the same random numbers; one without a cut says so.
    #[test]
    fn candidates_give_the_whole_rows_pick() {
        use rand::seq::SliceRandom;
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let row = |rng: &mut ChaCha8Rng| -> Vec<f32> {
            let mut v: Vec<f32> = (0..500).map(|_| rng.random_range(-12.0..12.0f32)).collect();
            // Ties at the top and beyond the k-th, NaN and -inf among them.
            v[7] = v.iter().copied().fold(f32::MIN, f32::max);
            v[300] = v[7];
            v[11] = f32::NAN;
            v[12] = f32::NEG_INFINITY;
            v.iter_mut().skip(400).for_each(|x| *x = x.round());
            v
        };
        let kinds = [
            params(0.0),
            SamplingParams { top_k: 1, ..params(0.7) },
            SamplingParams { top_k: 40, seed: 5, ..params(1.0) },
            SamplingParams { top_k: 200, top_p: 0.8, seed: 6, ..params(1.6) },
            SamplingParams { top_k: 1024, min_p: 0.05, seed: 7, ..params(0.3) },
        ];
        for p in kinds {
            let (mut whole, mut cut) = (Sampler::new(p.clone()).unwrap(), Sampler::new(p).unwrap());
            let c = cut.cut().expect("a plain sampler with a small top-k has a cut");
            for _ in 0..40 {
                let r = row(&mut rng);
                let mut cands = Vec::new();
                c.apply(&r, &mut cands);
                cands.shuffle(&mut rng);
                assert_eq!(cut.sample_candidates(&cands), whole.sample(&r, &[], 0).0);
                assert_eq!(cut.rng_position(), whole.rng_position());
            }
        }
        for p in [
            params(1.0),
            SamplingParams { top_k: 1025, ..params(1.0) },
            SamplingParams { repetition_penalty: 1.1, ..params(0.0) },
            SamplingParams { presence_penalty: 0.5, top_k: 5, ..params(1.0) },
            SamplingParams { frequency_penalty: -0.5, ..params(0.0) },
            SamplingParams { logprobs: Some(0), ..params(0.0) },
        ] {
            assert_eq!(Sampler::new(p.clone()).unwrap().cut(), None, "{p:?}");
        }
    }
}
