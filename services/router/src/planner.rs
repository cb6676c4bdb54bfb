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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, pdmesh_settings::Settings)]
#[serde(deny_unknown_fields, default)]
#[settings(flags = PlannerFlags)]
pub struct PlannerConfig {
    /// Time-to-first-token objective: p90 above it with prompts queueing asks for a prefill
    /// node.
    pub ttft_slo_ms: f64,
    /// Inter-token objective: a decode node's capacity is what it delivers at this latency.
    pub itl_slo_ms: f64,
    /// Share of a node's measured capacity the planner plans for (headroom for bursts).
    pub target_utilization: f64,
    /// The measurements planned on: requests that ended in this last stretch.
    #[arg(long = "planner-window-s")]
    pub window_s: u64,
    /// Fewer nodes only after the need stayed lower this long since the last change.
    #[arg(long = "planner-cooldown-s")]
    pub cooldown_s: u64,
    /// Fewest prefill nodes the planner asks for.
    pub min_prefill: u32,
    /// Most prefill nodes the planner asks for.
    pub max_prefill: u32,
    /// Fewest decode nodes the planner asks for.
    pub min_decode: u32,
    /// Most decode nodes the planner asks for.
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
    /// When its prefill compute began, and on which node.
    pub prefill_from: Instant,
    pub prefill_node: String,
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
    /// The needs of the last cool-down (and the one before it began), oldest first.
    needs: VecDeque<(Instant, Pools)>,
}

impl Planner {
    pub fn new(cfg: PlannerConfig) -> Self {
        Self {
            cfg,
            window: VecDeque::new(),
            desired: None,
            changed_at: None,
            needs: VecDeque::new(),
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
        let computing_s = busy_seconds(w);
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

    /// Hysteresis: up at once; down, once a cool-down has passed since the last change, to
    /// the highest need of the last cool-down, so a pool never shrinks below what any moment
    /// of it asked for (a one-node step would take hundreds of cool-downs at a large mesh's
    /// scale).
    fn settle(&mut self, now: Instant, current: Pools, needed: Pools) -> Pools {
        let c = &self.cfg;
        let mut desired = self.desired.unwrap_or(Pools {
            prefill: current.prefill.clamp(c.min_prefill, c.max_prefill),
            decode: current.decode.clamp(c.min_decode, c.max_decode),
        });
        let cooldown = Duration::from_secs(c.cooldown_s);
        self.needs.push_back((now, needed));
        // Keep one need from before the cool-down began: it says the history spans it.
        while self.needs.get(1).is_some_and(|(t, _)| now.duration_since(*t) >= cooldown) {
            self.needs.pop_front();
        }
        let spans = self.needs.front().is_some_and(|(t, _)| now.duration_since(*t) >= cooldown);
        let cooled = self.changed_at.is_none_or(|t| now.duration_since(t) >= cooldown);
        let recent = |f: fn(&Pools) -> u32| {
            self.needs.iter().skip(1).map(|(_, p)| f(p)).max().unwrap_or_else(|| f(&needed))
        };
        let floors = [recent(|p| p.prefill), recent(|p| p.decode)];
        let mut changed = false;
        for ((want, floor), have) in [needed.prefill, needed.decode]
            .into_iter()
            .zip(floors)
            .zip([&mut desired.prefill, &mut desired.decode])
        {
            if want > *have {
                *have = want;
                changed = true;
            } else if floor < *have && cooled && spans {
                *have = floor;
                changed = true;
            }
        }
        if changed {
            self.changed_at = Some(now);
        }
        self.desired = Some(desired);
        desired
    }
}

/// Seconds prefill nodes spent computing the window's prompts: per node, the union of its
/// requests' compute intervals. Summing each request's own time instead would count a step
/// shared by several prompts once for each, and understate a node's speed by as much.
fn busy_seconds(w: &VecDeque<Sample>) -> f64 {
    let mut by_node: std::collections::HashMap<&str, Vec<(Instant, Instant)>> =
        std::collections::HashMap::new();
    for s in w {
        let end = s.prefill_from + Duration::from_secs_f64(s.prefill_ms.max(0.0) / 1e3);
        by_node.entry(&s.prefill_node).or_default().push((s.prefill_from, end));
    }
    let mut busy = Duration::ZERO;
    for spans in by_node.values_mut() {
        spans.sort();
        let mut cur: Option<(Instant, Instant)> = None;
        for &(a, b) in spans.iter() {
            cur = match cur {
                Some((ca, cb)) if a <= cb => Some((ca, cb.max(b))),
                Some((ca, cb)) => {
                    busy += cb - ca;
                    Some((a, b))
                }
                None => Some((a, b)),
            };
        }
        if let Some((ca, cb)) = cur {
            busy += cb - ca;
        }
    }
    busy.as_secs_f64()
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

    /// A request that ended at `at`: 500 prompt tokens computed on prefill-0 in the 100 ms
    /// before it, after 5 ms in the queue, 100 tokens out of decode-0 at 10 ms each.
    fn sample(at: Instant) -> Sample {
        Sample {
            at,
            prefill_from: at - Duration::from_millis(100),
            prefill_node: "prefill-0".into(),
            computed_tokens: 500,
            prefill_ms: 100.0,
            queue_ms: 5.0,
            ttft_ms: 120.0,
            completion_tokens: 100,
            itl_ms: 10.0,
            decode_node: "decode-0".into(),
        }
    }

    /// `rate` requests per second over the window: 500 prompt tokens computed at 5,000
    /// tokens/s (on as many prefill nodes as keep each one busy at most all the time), 100
    /// out at `itl_ms` each.
    fn load(p: &mut Planner, t0: Instant, secs: u64, rate: u64, itl_ms: f64) {
        let nodes = rate.div_ceil(10);
        for i in 0..secs * rate {
            let at = t0 + Duration::from_millis(i * 1000 / rate);
            p.observe(Sample {
                prefill_node: format!("prefill-{}", i % nodes),
                itl_ms,
                ..sample(at)
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
    fn up_at_once_down_to_the_cooldowns_highest_need_within_bounds() {
        let mut p = Planner::new(PlannerConfig { max_prefill: 40, ..cfg() });
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        load(&mut p, t0, 10, 40, 200.0);
        let high = p.plan(at(10), Pools { prefill: 1, decode: 1 });
        // 20,000 prompt tokens/s over 5,000/s per node at 70% → 6 prefill nodes. 4,000
        // tokens/s out from one node at twice the ITL SLO: 2,000/s per node at the SLO → 3.
        assert_eq!(high.desired, Pools { prefill: 6, decode: 3 }, "{high:?}");
        let mut b = Planner::new(cfg());
        load(&mut b, t0, 10, 40, 200.0);
        assert_eq!(b.plan(at(10), Pools { prefill: 1, decode: 1 }).desired.prefill, 4, "bounded");
        // Nothing for 10 s, then a quarter of the load at a quarter of the ITL: 2 prefill
        // nodes, 1 decode. Nothing comes down within a cool-down of the rise, nor below a need
        // the last cool-down saw.
        let (mut d, mut changes) = (high.desired, Vec::new());
        for t in 10..200 {
            if t >= 20 {
                load(&mut p, at(t), 1, 10, 50.0);
            }
            let next = p.plan(at(t + 1), d).desired;
            if next != d {
                changes.push((t + 1, next));
                d = next;
            }
        }
        // The window empties of the high load over 10 s, so the needs of the cool-down after
        // the rise fall from 6 to 0: the first step goes to the highest of them, the next to
        // the new load's, a cool-down apart (one node at a time: 4 steps, 80 s).
        assert_eq!(
            changes,
            [(31, Pools { prefill: 5, decode: 3 }), (51, Pools { prefill: 2, decode: 1 })]
        );
        // The load stops: down to the minimum once a cool-down holds no need above it.
        assert_eq!(p.plan(at(260), d).desired, Pools { prefill: 1, decode: 1 });
    }

    #[test]
    fn prompts_sharing_a_nodes_steps_count_its_time_once() {
        let mut p = Planner::new(cfg());
        let t0 = Instant::now();
        // Two prompts of 500 tokens computed together in the same 100 ms on one node: it
        // computes 10,000 tokens a second, not 5,000.
        for _ in 0..2 {
            p.observe(sample(t0));
        }
        let plan = p.plan(t0 + Duration::from_secs(1), Pools { prefill: 1, decode: 1 });
        assert!((plan.prefill_node_tps - 10_000.0).abs() < 1.0, "{plan:?}");
    }

    #[test]
    fn a_ttft_over_its_slo_with_prompts_queueing_asks_for_a_prefill_node() {
        let mut p = Planner::new(cfg());
        let t0 = Instant::now();
        for i in 0..10 {
            p.observe(Sample {
                computed_tokens: 10,
                prefill_ms: 10.0,
                queue_ms: 3_000.0,
                ttft_ms: 3_100.0,
                completion_tokens: 10,
                itl_ms: 20.0,
                ..sample(t0 + Duration::from_secs(i))
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
