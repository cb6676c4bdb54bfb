//! Opt-in lossy KV policies: what a sequence past its KV budget keeps. Never on by default, as
//! they change what the model sees; whoever asks for one is told it was applied. Here is the
//! vocabulary the router validates a request's policy with; the engine enforces it.
//!
//! Both work on whole blocks, the pool's unit: an evicted block goes back to the pool and the
//! blocks after it close the gap (`KvCache::evict`), so attention reads only what is kept.
//! Kept keys keep the positions they were rotated with (no re-rotation), so a sequence stays
//! within its model's trained context as before.

use std::fmt;
use std::str::FromStr;

/// A lossy KV policy. Budgets and windows are in tokens and are rounded to whole blocks: a
/// sequence holds at most `budget` tokens after every step (a step may briefly hold its own
/// tokens on top).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvPolicy {
    /// StreamingLLM: the first `sinks` tokens (the attention sinks every query leans on) and
    /// the most recent ones.
    Sinks { budget: usize, sinks: usize },
    /// H2O: the `recent` newest tokens, and of the older blocks those that have received the
    /// most attention so far (heavy hitters).
    HeavyHitters { budget: usize, recent: usize },
}

impl KvPolicy {
    /// StreamingLLM's four sink tokens (one block).
    pub const DEFAULT_SINKS: usize = 4;

    pub fn budget(&self) -> usize {
        match *self {
            KvPolicy::Sinks { budget, .. } | KvPolicy::HeavyHitters { budget, .. } => budget,
        }
    }

    /// Whether the policy needs the attention each block receives.
    pub fn tracks_attention(&self) -> bool {
        matches!(self, KvPolicy::HeavyHitters { .. })
    }

    /// Checks the policy against a pool of `block_size`-token blocks: the budget must leave
    /// room, past what is always kept, for at least one block of what the policy chooses.
    pub fn validate(&self, block_size: usize) -> Result<(), String> {
        let bs = block_size;
        let (kept, what) = match *self {
            KvPolicy::Sinks { sinks, .. } => {
                (sinks.div_ceil(bs) + 2, "the sink blocks and two recent ones")
            }
            KvPolicy::HeavyHitters { recent, .. } => {
                if recent == 0 {
                    return Err("h2o: the recent window must be at least 1 token".to_string());
                }
                (recent.div_ceil(bs) + 1, "the recent window's blocks and one heavy hitter")
            }
        };
        if self.budget() < kept * bs {
            return Err(format!(
                "{self}: a budget of {} tokens cannot hold {what} ({} tokens in blocks of {bs})",
                self.budget(),
                kept * bs
            ));
        }
        Ok(())
    }

    /// The full blocks (table indices) to evict from a sequence holding `len` tokens in blocks
    /// of `block_size`, so that it holds at most the budget; `mass` is each block's attention
    /// (for heavy hitters). Oldest first among equals.
    pub fn victims(&self, len: usize, block_size: usize, mass: Option<&[f32]>) -> Vec<usize> {
        let bs = block_size;
        if len <= self.budget() {
            return Vec::new();
        }
        let drop = (len - self.budget()).div_ceil(bs);
        let (blocks, full) = (len.div_ceil(bs), len / bs);
        match *self {
            KvPolicy::Sinks { sinks, .. } => {
                (sinks.div_ceil(bs).min(full)..full).take(drop).collect()
            }
            KvPolicy::HeavyHitters { recent, .. } => {
                let older = blocks.saturating_sub(recent.div_ceil(bs)).min(full);
                let mut cand: Vec<usize> = (0..older).collect();
                let m = |i: usize| mass.and_then(|m| m.get(i)).copied().unwrap_or(0.0);
                // Stable: the older of two equally attended blocks goes first.
                cand.sort_by(|&a, &b| m(a).total_cmp(&m(b)));
                cand.truncate(drop);
                cand.sort_unstable();
                cand
            }
        }
    }
}

impl fmt::Display for KvPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            KvPolicy::Sinks { budget, sinks } => write!(f, "sinks:{budget}:{sinks}"),
            KvPolicy::HeavyHitters { budget, recent } => write!(f, "h2o:{budget}:{recent}"),
        }
    }
}

/// `sinks:BUDGET[:SINKS]` (4 sinks when left out) or `h2o:BUDGET[:RECENT]` (half the budget
/// when left out).
impl FromStr for KvPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("KV policy {s:?}: {why} (expected sinks:BUDGET[:SINKS] or h2o:BUDGET[:RECENT])")
        };
        let parts: Vec<&str> = s.split(':').collect();
        if !(2..=3).contains(&parts.len()) {
            return Err(bad("wrong number of fields"));
        }
        let num = |p: &str, what: &str| -> Result<usize, String> {
            p.trim().parse().map_err(|_| bad(&format!("{what} {p:?} is not a whole number")))
        };
        let budget = num(parts[1], "budget")?;
        if budget == 0 {
            return Err(bad("the budget must be above 0"));
        }
        let extra = parts.get(2).map(|p| num(p, "third field")).transpose()?;
        let policy = match parts[0].trim() {
            "sinks" => KvPolicy::Sinks { budget, sinks: extra.unwrap_or(Self::DEFAULT_SINKS) },
            "h2o" => KvPolicy::HeavyHitters { budget, recent: extra.unwrap_or(budget / 2) },
            other => return Err(bad(&format!("unknown policy {other:?}"))),
        };
        // What no block size could hold (a node checks its own with `validate`).
        policy.validate(1)?;
        Ok(policy)
    }
}

impl KvPolicy {
    /// A wire field's policy: empty is none.
    pub fn parse_field(s: &str) -> Result<Option<Self>, String> {
        if s.is_empty() { Ok(None) } else { s.parse().map(Some) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_print_and_refuse_nonsense() {
        let p: KvPolicy = "sinks:1024".parse().unwrap();
        assert_eq!(p, KvPolicy::Sinks { budget: 1024, sinks: 4 });
        assert_eq!(p.to_string().parse::<KvPolicy>().unwrap(), p);
        let h: KvPolicy = "h2o:2048".parse().unwrap();
        assert_eq!(h, KvPolicy::HeavyHitters { budget: 2048, recent: 1024 });
        assert_eq!("h2o:64:16".parse::<KvPolicy>().unwrap().to_string(), "h2o:64:16");
        for bad in ["", "sinks", "sinks:", "sinks:0", "sinks:x", "lru:64", "h2o:64:1:2", "h2o:-1"] {
            let e = bad.parse::<KvPolicy>().unwrap_err().to_string();
            assert!(e.contains("KV policy"), "{bad}: {e}");
        }
        // No block size holds 5 sinks and two recent blocks in 6 tokens.
        let e = "sinks:6:5".parse::<KvPolicy>().unwrap_err();
        assert!(e.contains("7 tokens"), "{e}");
        assert_eq!(KvPolicy::parse_field("").unwrap(), None);
        let h = KvPolicy::parse_field("h2o:8").unwrap();
        assert_eq!(h, Some(KvPolicy::HeavyHitters { budget: 8, recent: 4 }));
        assert!(KvPolicy::parse_field("h2o").is_err());
    }

    #[test]
    fn a_budget_too_small_for_what_is_always_kept_is_refused() {
        assert!(KvPolicy::Sinks { budget: 48, sinks: 4 }.validate(16).is_ok());
        let e = KvPolicy::Sinks { budget: 47, sinks: 4 }.validate(16).unwrap_err();
        assert!(e.to_string().contains("48 tokens"), "{e}");
        assert!(KvPolicy::HeavyHitters { budget: 32, recent: 0 }.validate(16).is_err());
        assert!(KvPolicy::HeavyHitters { budget: 32, recent: 16 }.validate(16).is_ok());
        assert!(KvPolicy::HeavyHitters { budget: 31, recent: 16 }.validate(16).is_err());
    }

    #[test]
    fn sinks_drop_the_oldest_blocks_after_the_sinks() {
        let p = KvPolicy::Sinks { budget: 64, sinks: 4 };
        assert!(p.victims(64, 16, None).is_empty());
        // 70 tokens: 4 full blocks and 6 in a fifth; one block must go, the first after the sink.
        assert_eq!(p.victims(70, 16, None), vec![1]);
        // 100 tokens (6 full, 4 more): 36 over, three blocks.
        assert_eq!(p.victims(100, 16, None), vec![1, 2, 3]);
    }

    #[test]
    fn heavy_hitters_keep_the_recent_window_and_the_most_attended() {
        let p = KvPolicy::HeavyHitters { budget: 64, recent: 16 };
        // 6 full blocks and 4 tokens in a 7th: the recent window is that 7th block only, so
        // the full six are candidates and the three least attended go.
        let mass = [5.0, 0.1, 3.0, 0.2, 4.0, 0.3, 9.0];
        assert_eq!(p.victims(100, 16, Some(&mass)), vec![1, 3, 5]);
        // Untracked mass is all zero: the oldest go first.
        assert_eq!(p.victims(100, 16, None), vec![0, 1, 2]);
        // A recent window of 40 tokens protects the three newest blocks.
        let p = KvPolicy::HeavyHitters { budget: 64, recent: 40 };
        assert_eq!(p.victims(100, 16, Some(&mass)), vec![1, 2, 3]);
    }
}
