//! One served model's share of the mesh: its card (what requests are validated and tokenized
//! against), the KV layout its nodes keep (prompts are hashed in it), its planner and its
//! queue of requests waiting for room. The registry, channels, block index and running
//! requests stay the mesh's; a node belongs to the pool whose model fingerprint its layout
//! names, and a request is placed, queued, planned for and moved only among its pool's nodes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_kv_types::KvLayout;
use pdmesh_model::ModelCard;

use crate::planner::{Plan, Planner, PlannerConfig, Pools, Sample};
use crate::queue::RoomQueue;

#[derive(Debug)]
pub struct Pool {
    /// The name requests ask for it by.
    pub id: String,
    pub model: Arc<ModelCard>,
    /// The KV layout of the pool's nodes (registration keeps it one).
    layout: Mutex<Option<KvLayout>>,
    /// The planner, and its latest plan (`replan`).
    planner: Mutex<(Planner, Option<Plan>)>,
    /// Requests waiting for room on one of the pool's decode nodes.
    pub queue: RoomQueue,
}

impl Pool {
    pub fn new(
        id: String,
        model: Arc<ModelCard>,
        planner: PlannerConfig,
        max_queued: usize,
    ) -> Self {
        Self {
            id,
            model,
            layout: Mutex::new(None),
            planner: Mutex::new((Planner::new(planner), None)),
            queue: RoomQueue::new(max_queued),
        }
    }

    /// The model fingerprint its nodes' layouts name.
    pub fn fingerprint(&self) -> u64 {
        self.model.fingerprint
    }

    /// The nodes' KV layout, once one has joined.
    pub fn layout(&self) -> Option<KvLayout> {
        *self.layout.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_layout(&self, layout: KvLayout) {
        *self.layout.lock().unwrap_or_else(|p| p.into_inner()) = Some(layout);
    }

    /// Tells the planner how a finished request went.
    pub fn observe(&self, f: &crate::api::Finished) {
        let (t, u) = (&f.timings, &f.usage);
        let itl = if u.completion_tokens > 1 {
            (t.total_ms - t.ttft_ms) / f64::from(u.completion_tokens - 1)
        } else {
            0.0
        };
        let now = Instant::now();
        let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1e3);
        // Admission was `total_ms` ago; prefill compute began `queue_ms` after it.
        let admitted = now.checked_sub(ms(t.total_ms)).unwrap_or(now);
        let sample = Sample {
            at: now,
            prefill_from: admitted + ms(t.queue_ms),
            prefill_node: t.prefill_node.clone(),
            computed_tokens: u.prompt_tokens.saturating_sub(u.cached_tokens),
            prefill_ms: t.prefill_ms,
            queue_ms: t.queue_ms,
            ttft_ms: t.ttft_ms,
            completion_tokens: u.completion_tokens,
            itl_ms: itl,
            decode_node: t.decode_node.clone(),
        };
        self.planner.lock().expect("planner lock is never poisoned").0.observe(sample);
    }

    /// Plans again from the window and the pool's `current` nodes; logs a changed decision.
    pub fn replan(&self, current: Pools) -> Plan {
        let mut p = self.planner.lock().expect("planner lock is never poisoned");
        let plan = p.0.plan(Instant::now(), current);
        if p.1.as_ref().is_none_or(|last| last.desired != plan.desired) {
            tracing::info!(
                model = self.id,
                prefill = plan.desired.prefill,
                decode = plan.desired.decode,
                prefill_demand_tps = plan.prefill_demand_tps,
                decode_demand_tps = plan.decode_demand_tps,
                "planner: the load needs this many nodes"
            );
        }
        p.1 = Some(plan.clone());
        plan
    }

    /// The latest plan (`replan`).
    pub fn plan(&self) -> Option<Plan> {
        self.planner.lock().expect("planner lock is never poisoned").1.clone()
    }
}
