//! The SLO planner: how many prefill and decode nodes the load needs, from what this router
//! measures as requests end, never from an offline profile. Over a sliding window it takes the
//! demand (prompt tokens to compute and tokens to generate, per second) and what the nodes
//! deliver (prefill tokens per second while computing; decode tokens per second per node,
//! scaled to the inter-token SLO: a node decoding faster than the SLO can batch more), and
//! divides, at a target utilisation. A time to first token over its SLO with prompts queueing
//! asks for another prefill node. Decisions go up at once and come down one node at a time,
//! only after the need stayed lower for a whole cool-down. The decision is a Prometheus gauge
//! (`pdmesh_planner_desired_nodes{role}`) that KEDA or an HPA scales each pool on, and that
//! `pdmesh up --autoscale` follows.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The planner's settings (the router config's `[planner]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlannerConfig {
    /// Time-to-first-token objective: p90 above it with prompts queueing asks for a prefill
    /// node.
    pub ttft_slo_ms: f64,
    /// Inter-token objective: a decode node's capacity is what it delivers at this latency.
    pub itl_slo_ms: f64,
    /// Share of a node's measured capacity to plan for (headroom for bursts).
    pub target_utilization: f64,
    /// The measurements planned on: requests that ended in this last stretch.
    pub window_s: u64,
    /// Fewer nodes only after the need stayed lower this long since the last change.
    pub cooldown_s: u64,
    pub min_prefill: u32,
    pub max_prefill: u32,
    pub min_decode: u32,
    pub max_decode: u32,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            ttft_slo_ms: 2_000.0,
            itl_slo_ms: 100.0,
            target_utilization: 0.7,
            window_s: 30,
            cooldown_s: 60,
            min_prefill: 1,
            max_prefill: 16,
            min_decode: 1,
            max_decode: 16,
        }
    }
}

impl PlannerConfig {
    pub fn validate(&self) -> Result<(), pdmesh_common::InvalidConfig> {
        use pdmesh_common::InvalidConfig;
        let positive = |name, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(InvalidConfig::new(name, format!("must be a number > 0, got {v}")))
            }
        };
        positive("planner.ttft_slo_ms", self.ttft_slo_ms)?;
        positive("planner.itl_slo_ms", self.itl_slo_ms)?;
        if !(self.target_utilization > 0.0 && self.target_utilization <= 1.0) {
            let why = format!("must be in (0, 1], got {}", self.target_utilization);
            return Err(InvalidConfig::new("planner.target_utilization", why));
        }
        if self.window_s == 0 {
            return Err(InvalidConfig::new("planner.window_s", "must be at least 1"));
        }
        for (name, min, max) in [
            ("planner.max_prefill", self.min_prefill, self.max_prefill),
            ("planner.max_decode", self.min_decode, self.max_decode),
        ] {
            if max == 0 || min > max {
                let why = format!("must be at least 1 and at least the minimum ({min}), got {max}");
                return Err(InvalidConfig::new(name, why));
            }
        }
        Ok(())
    }
}

/// What one ended request tells the planner.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at: Instant,
    /// Prompt tokens computed (not taken from a cache) and the time computing them took.
    pub computed_tokens: u32,
    pub prefill_ms: f64,
    /// Admission to the start of prefill compute.
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub completion_tokens: u32,
    /// Mean time per output token after the first (0 with fewer than two).
    pub itl_ms: f64,
    /// The decode node that finished it.
    pub decode_node: String,
}

/// Nodes per role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pools {
    pub prefill: u32,
    pub decode: u32,
}

/// A decision and what it rests on.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub desired: Pools,
    /// What the window asks for before hysteresis (and bounds).
    pub needed: Pools,
    pub prefill_demand_tps: f64,
    pub prefill_node_tps: f64,
    pub decode_demand_tps: f64,
    pub decode_node_tps: f64,
    pub ttft_p90_ms: f64,
    pub samples: usize,
}

#[derive(Debug)]
pub struct Planner {
    cfg: PlannerConfig,
    window: VecDeque<Sample>,
    desired: Option<Pools>,
    changed_at: Option<Instant>,
    /// Since when each role's need has been below what is desired.
    lower_since: [Option<Instant>; 2],
}

impl Planner {
    pub fn new(cfg: PlannerConfig) -> Self {
        Self {
            cfg,
            window: VecDeque::new(),
            desired: None,
            changed_at: None,
            lower_since: [None; 2],
        }
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    pub fn observe(&mut self, s: Sample) {
        self.window.push_back(s);
    }

    /// The plan for now, given the nodes registered (`current`), which seed the decision.
    pub fn plan(&mut self, now: Instant, current: Pools) -> Plan {
        let span = Duration::from_secs(self.cfg.window_s);
        while self.window.front().is_some_and(|s| now.duration_since(s.at) > span) {
            self.window.pop_front();
        }
        let c = &self.cfg;
        let secs = span.as_secs_f64();
        let w = &self.window;
        let computed: f64 = w.iter().map(|s| f64::from(s.computed_tokens)).sum();
        let computing_s: f64 = w.iter().map(|s| s.prefill_ms).sum::<f64>() / 1e3;
        let prefill_demand = computed / secs;
        let prefill_node = if computing_s > 0.0 { computed / computing_s } else { 0.0 };
        // What each decode node produced over the window, at the ITL it was measured at; a
        // node may batch more streams until its ITL reaches the SLO, and (decoding being
        // bound by reading the weights once per step) its throughput grows about in step:
        // its capacity is what it produced stretched by SLO / ITL. Conservative while the ITL
        // stays flat as the batch grows; measured again every window.
        let generated: f64 = w.iter().map(|s| f64::from(s.completion_tokens)).sum();
        let decode_demand = generated / secs;
        let itls: Vec<f64> = w.iter().filter(|s| s.itl_ms > 0.0).map(|s| s.itl_ms).collect();
        let itl = median(&itls);
        let served: std::collections::HashSet<&str> =
            w.iter().map(|s| s.decode_node.as_str()).collect();
        let decode_node = if itl > 0.0 {
            (decode_demand / served.len().max(1) as f64) * (c.itl_slo_ms / itl)
        } else {
            0.0
        };
        let ttfts: Vec<f64> = w.iter().map(|s| s.ttft_ms).filter(|&t| t > 0.0).collect();
        let ttft_p90 = percentile(&ttfts, 0.9);
        let queued = w.iter().filter(|s| s.queue_ms > s.prefill_ms).count() * 2 > w.len();
        let need = |demand: f64, per_node: f64| -> u32 {
            if per_node > 0.0 {
                (demand / (per_node * c.target_utilization)).ceil() as u32
            } else {
                0
            }
        };
        let mut needed = Pools {
            prefill: need(prefill_demand, prefill_node),
            decode: need(decode_demand, decode_node),
        };
        if ttft_p90 > c.ttft_slo_ms && queued {
            needed.prefill = needed.prefill.max(current.prefill + 1);
        }
        if w.is_empty() {
            needed = Pools::default();
        }
        let bounded = Pools {
            prefill: needed.prefill.clamp(c.min_prefill, c.max_prefill),
            decode: needed.decode.clamp(c.min_decode, c.max_decode),
        };
        let samples = w.len();
        let desired = self.settle(now, current, bounded);
        Plan {
            desired,
            needed,
            prefill_demand_tps: prefill_demand,
            prefill_node_tps: prefill_node,
            decode_demand_tps: decode_demand,
            decode_node_tps: decode_node,
            ttft_p90_ms: ttft_p90,
            samples,
        }
    }

    /// Hysteresis: up at once; down by one, once the need stayed lower for a cool-down since
    /// the last change.
    fn settle(&mut self, now: Instant, current: Pools, needed: Pools) -> Pools {
        let c = &self.cfg;
        let mut desired = self.desired.unwrap_or(Pools {
            prefill: current.prefill.clamp(c.min_prefill, c.max_prefill),
            decode: current.decode.clamp(c.min_decode, c.max_decode),
        });
        let cooldown = Duration::from_secs(c.cooldown_s);
        let cooled = self.changed_at.is_none_or(|t| now.duration_since(t) >= cooldown);
        let mut changed = false;
        for (i, (want, have)) in
            [(needed.prefill, &mut desired.prefill), (needed.decode, &mut desired.decode)]
                .into_iter()
                .enumerate()
        {
            if want > *have {
                *have = want;
                self.lower_since[i] = None;
                changed = true;
            } else if want < *have {
                let since = *self.lower_since[i].get_or_insert(now);
                if cooled && now.duration_since(since) >= cooldown {
                    *have -= 1;
                    self.lower_since[i] = None;
                    changed = true;
                }
            } else {
                self.lower_since[i] = None;
            }
        }
        if changed {
            self.changed_at = Some(now);
        }
        self.desired = Some(desired);
        desired
    }
}

fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PlannerConfig {
        PlannerConfig {
            window_s: 10,
            cooldown_s: 20,
            max_prefill: 4,
            max_decode: 4,
            ..Default::default()
        }
    }

    /// `rate` requests per second over the window: 500 prompt tokens computed at 5,000
    /// tokens/s, 100 out at `itl_ms` each.
    fn load(p: &mut Planner, t0: Instant, secs: u64, rate: u64, itl_ms: f64) {
        for i in 0..secs * rate {
            let at = t0 + Duration::from_millis(i * 1000 / rate);
            p.observe(Sample {
                at,
                computed_tokens: 500,
                prefill_ms: 100.0,
                queue_ms: 5.0,
                ttft_ms: 120.0,
                completion_tokens: 100,
                itl_ms,
                decode_node: "decode-0".into(),
            });
        }
    }

    #[test]
    fn pools_follow_measured_demand_over_measured_capacity() {
        let mut p = Planner::new(cfg());
        let t0 = Instant::now();
        let one = Pools { prefill: 1, decode: 1 };
        // 4 req/s: 2,000 prompt tokens/s against 5,000/s per node at 70% → 1 prefill node;
        // 400 tokens/s out, each node doing 400/s at 50 ms ITL, 800/s at the 100 ms SLO → 1.
        load(&mut p, t0, 10, 4, 50.0);
        let plan = p.plan(t0 + Duration::from_secs(10), one);
        assert_eq!(plan.desired, one, "{plan:?}");
        assert!((plan.prefill_node_tps - 5_000.0).abs() < 1.0, "{plan:?}");
        // Five times the load: 10,000 tokens/s → 3 prefill nodes; decode at the SLO already
        // (100 ms) → 2,000 tokens/s over 2,000/s per node at 70% → 2.
        let t1 = t0 + Duration::from_secs(30);
        load(&mut p, t1, 10, 20, 100.0);
        let plan = p.plan(t1 + Duration::from_secs(10), one);
        assert_eq!(plan.desired, Pools { prefill: 3, decode: 2 }, "{plan:?}");
    }

    #[test]
    fn up_at_once_down_one_at_a_time_after_a_cooldown_within_bounds() {
        let mut p = Planner::new(cfg());
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        load(&mut p, t0, 10, 40, 200.0);
        let high = p.plan(at(10), Pools { prefill: 1, decode: 1 });
        // 20,000 prompt tokens/s need 6 prefill nodes: bounded by 4. 4,000 tokens/s out from
        // one node at twice the ITL SLO: 2,000/s per node at the SLO, 70% → 3.
        assert_eq!(high.desired, Pools { prefill: 4, decode: 3 }, "{high:?}");
        assert!(high.needed.prefill > 4);
        // The load stops: nothing comes down within a cool-down of the rise, then each pool
        // by one node per cool-down, to the minimum.
        let (mut d, mut last, mut changes) = (high.desired, 10, 0);
        for t in 11..400 {
            let next = p.plan(at(t), d).desired;
            if next != d {
                assert!(t - last >= 20, "changed at {t}, {} s after the last", t - last);
                assert!(d.prefill - next.prefill <= 1 && d.decode - next.decode <= 1);
                (d, last, changes) = (next, t, changes + 1);
            }
        }
        assert_eq!(d, Pools { prefill: 1, decode: 1 });
        assert!((3..=5).contains(&changes), "{changes} changes for 3 + 2 steps down");
    }

    #[test]
    fn a_ttft_over_its_slo_with_prompts_queueing_asks_for_a_prefill_node() {
        let mut p = Planner::new(cfg());
        let t0 = Instant::now();
        for i in 0..10 {
            p.observe(Sample {
                at: t0 + Duration::from_secs(i),
                computed_tokens: 10,
                prefill_ms: 10.0,
                queue_ms: 3_000.0,
                ttft_ms: 3_100.0,
                completion_tokens: 10,
                itl_ms: 20.0,
                decode_node: "decode-0".into(),
            });
        }
        let plan = p.plan(t0 + Duration::from_secs(10), Pools { prefill: 1, decode: 1 });
        assert_eq!(plan.desired.prefill, 2, "{plan:?}");
    }

    #[test]
    fn settings_are_checked() {
        for bad in [
            PlannerConfig { itl_slo_ms: 0.0, ..cfg() },
            PlannerConfig { target_utilization: 1.5, ..cfg() },
            PlannerConfig { window_s: 0, ..cfg() },
            PlannerConfig { min_decode: 5, max_decode: 4, ..cfg() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(cfg().validate().is_ok());
    }
}
