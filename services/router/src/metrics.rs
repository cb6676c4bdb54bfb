//! The router's Prometheus metrics: latency histograms and requests by outcome, recorded as
//! each request ends, and in-flight requests and registered nodes read at scrape time.

use std::sync::Arc;

use pdmesh_common::metrics::{Family, Kind, Metrics};
use pdmesh_proto::v1::Role;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as LabelledFamily;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::api::Finished;
use crate::mesh::Mesh;

type Labels = Vec<(&'static str, String)>;

#[derive(Debug, Clone)]
pub struct RouterMetrics {
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    dispatch: Histogram,
    requests: LabelledFamily<Labels, Counter>,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    migrations: Counter,
    preemptions: Counter,
    queued: Counter,
    coalesced: Counter,
    index_staleness: Histogram,
    index_changes: Counter,
    index_resyncs: Counter,
    refused: LabelledFamily<Labels, Counter>,
    escalations: LabelledFamily<Labels, Counter>,
    tier_choices: LabelledFamily<Labels, Counter>,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        // 5 ms .. ~160 s for whole requests and first tokens; 1 ms .. ~8 s per output token.
        let long = || Histogram::new(exponential_buckets(0.005, 2.0, 16));
        Self {
            ttft: long(),
            tpot: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            e2e: long(),
            // 50 µs .. ~11 s in steps of 30%: the router's own share is small, and its tail is
            // what a larger mesh or an overloaded one stretches.
            dispatch: Histogram::new(exponential_buckets(0.000_05, 1.3, 48)),
            requests: LabelledFamily::default(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            migrations: Counter::default(),
            preemptions: Counter::default(),
            queued: Counter::default(),
            coalesced: Counter::default(),
            // 100 µs .. ~30 s in steps of 30%.
            index_staleness: Histogram::new(exponential_buckets(0.000_1, 1.3, 48)),
            index_changes: Counter::default(),
            index_resyncs: Counter::default(),
            refused: LabelledFamily::default(),
            escalations: LabelledFamily::default(),
            tier_choices: LabelledFamily::default(),
        }
    }
}

/// Each pool's planner decision and what it rests on, labelled by its model, for KEDA / an
/// HPA on external metrics and `pdmesh up --autoscale` (a pool has none before its first plan).
fn planner_families(plans: &[(String, crate::planner::Plan)]) -> Vec<Family> {
    type Pick = fn(&crate::planner::Plan) -> (f64, f64);
    let family = |name: &str, help: &'static str, label: &'static str, pick: Pick| Family {
        name: name.into(),
        help,
        kind: Kind::Gauge,
        samples: plans
            .iter()
            .flat_map(|(model, p)| {
                let (prefill, decode) = pick(p);
                [("prefill", prefill), ("decode", decode)]
                    .map(|(l, v)| (vec![(label, l.to_string()), ("model", model.clone())], v))
            })
            .collect(),
    };
    if plans.is_empty() {
        return Vec::new();
    }
    vec![
        family(
            "pdmesh_planner_desired_nodes",
            "Nodes the load needs, per model and role, after hysteresis and bounds: scale each \
             pool on it.",
            "role",
            |p| (f64::from(p.desired.prefill), f64::from(p.desired.decode)),
        ),
        family(
            "pdmesh_planner_needed_nodes",
            "Nodes the last window's demand over measured capacity asks for, before hysteresis.",
            "role",
            |p| (f64::from(p.needed.prefill), f64::from(p.needed.decode)),
        ),
        family(
            "pdmesh_planner_demand_tokens_per_second",
            "Prompt tokens computed and tokens generated per second over the planner's window.",
            "phase",
            |p| (p.prefill_demand_tps, p.decode_demand_tps),
        ),
        family(
            "pdmesh_planner_node_tokens_per_second",
            "What one node delivers, measured (decode: stretched to the inter-token SLO).",
            "phase",
            |p| (p.prefill_node_tps, p.decode_node_tps),
        ),
    ]
}

impl RouterMetrics {
    /// Registers everything with `m`; in-flight requests and nodes are read from `mesh`.
    pub fn register(&self, m: &Metrics, mesh: Arc<Mesh>, admission: Arc<tokio::sync::Semaphore>) {
        m.register("pdmesh_router_ttft_seconds", "Time to first token.", self.ttft.clone());
        m.register(
            "pdmesh_router_tpot_seconds",
            "Time per output token after the first.",
            self.tpot.clone(),
        );
        m.register(
            "pdmesh_router_e2e_seconds",
            "Whole request, admission to finish.",
            self.e2e.clone(),
        );
        m.register(
            "pdmesh_router_dispatch_seconds",
            "Admission to the prefill request leaving the router: the router's own time (node \
             choice, the decode reservation) before a node works on the request.",
            self.dispatch.clone(),
        );
        m.register(
            "pdmesh_router_requests",
            "Requests ended, by finish reason (finished) or gRPC code (failed).",
            self.requests.clone(),
        );
        m.register(
            "pdmesh_router_prompt_tokens",
            "Prompt tokens of finished requests.",
            self.prompt_tokens.clone(),
        );
        m.register(
            "pdmesh_router_cached_tokens",
            "Prompt tokens of finished requests whose KV came from a cache.",
            self.cached_tokens.clone(),
        );
        m.register(
            "pdmesh_router_migrations",
            "Streams moved to another decode node mid-way (theirs died, hung or drained).",
            self.migrations.clone(),
        );
        m.register(
            "pdmesh_router_preemptions",
            "Streams a decode node preempted (out of blocks for growing reservations) that \
             waited for room and continued.",
            self.preemptions.clone(),
        );
        m.register(
            "pdmesh_router_queued",
            "Requests that found no decode node with room and waited for it.",
            self.queued.clone(),
        );
        m.register(
            "pdmesh_router_coalesced",
            "Requests that waited for a shared prefix another request was computing.",
            self.coalesced.clone(),
        );
        m.register(
            "pdmesh_router_index_staleness_seconds",
            "Age of block events when the index applied them (the oldest of each batch, by the \
             node's clock): how late the index is behind the nodes' caches.",
            self.index_staleness.clone(),
        );
        m.register(
            "pdmesh_router_index_changes",
            "Block stores and removals applied to the index from nodes' events.",
            self.index_changes.clone(),
        );
        m.register(
            "pdmesh_router_index_resyncs",
            "Snapshots asked of nodes whose events had a gap.",
            self.index_resyncs.clone(),
        );
        m.register(
            "pdmesh_router_nodes_refused",
            "Nodes refused at joining, by reason: `model` (another model's weights) or `layout` \
             (KV in another dtype or block size than the mesh's nodes). A refused node retries.",
            self.refused.clone(),
        );
        m.register(
            "pdmesh_router_escalations",
            "Requests for `auto` re-run on the next model of the ladder, by the model whose \
             answer was not kept (its run counts in `requests_total` of that model too).",
            self.escalations.clone(),
        );
        m.register(
            "pdmesh_router_tier_choices",
            "Choices the tier classifier made for requests for `auto`, by the model chosen (before \
             any model ran).",
            self.tier_choices.clone(),
        );
        let max = mesh.config.max_in_flight;
        m.register_snapshot(move || {
            let in_flight = max.saturating_sub(admission.available_permits());
            let roles =
                [("prefill", Role::Prefill), ("decode", Role::Decode), ("kvstore", Role::Kvstore)];
            let nodes = Family {
                name: "pdmesh_router_nodes".into(),
                help: "Usable registered nodes, by model and role.",
                kind: Kind::Gauge,
                samples: mesh
                    .pools()
                    .iter()
                    .flat_map(|p| {
                        roles.map(|(name, r)| {
                            let labels = vec![("model", p.id.clone()), ("role", name.to_string())];
                            (labels, mesh.live_count(p.fingerprint(), r) as f64)
                        })
                    })
                    .collect(),
            };
            let plans: Vec<(String, crate::planner::Plan)> =
                mesh.pools().iter().filter_map(|p| Some((p.id.clone(), p.plan()?))).collect();
            let mut v = planner_families(&plans);
            v.extend([
                Family::one(
                    "pdmesh_router_in_flight_requests",
                    "Requests admitted and running.",
                    Kind::Gauge,
                    in_flight as f64,
                ),
                Family::one(
                    "pdmesh_router_waiting_requests",
                    "Requests waiting for room on a decode node.",
                    Kind::Gauge,
                    mesh.pools().iter().map(|p| p.queue.len()).sum::<usize>() as f64,
                ),
                nodes,
            ]);
            let (blocks, entries) = mesh.index.size();
            v.push(Family::one(
                "pdmesh_router_index_blocks",
                "Distinct KV blocks the index knows a holder of.",
                Kind::Gauge,
                blocks as f64,
            ));
            v.push(Family::one(
                "pdmesh_router_index_entries",
                "Block-holder pairs in the index (a block two nodes hold counts twice).",
                Kind::Gauge,
                entries as f64,
            ));
            let states = mesh.index.states();
            let by_state: Vec<(&str, f64)> = crate::index::State::ALL
                .iter()
                .map(|s| (s.name(), states.get(s).copied().unwrap_or(0) as f64))
                .collect();
            v.push(Family::labelled(
                "pdmesh_router_index_nodes",
                "Nodes by what the index knows of their blocks: exact (from their events), \
                 resyncing, estimate (they send none), detached (session ended) or none.",
                Kind::Gauge,
                "state",
                &by_state,
            ));
            v
        });
    }

    /// A request of `model` finished (any reason): its latencies and tokens.
    pub fn finished(&self, model: &str, f: &Finished) {
        let (t, completion) = (&f.timings, f.usage.completion_tokens);
        let reason = pdmesh_wire::finish_reason(f.reason);
        let name = reason.as_str_name().trim_start_matches("FINISH_REASON_").to_ascii_lowercase();
        let labels =
            vec![("model", model.into()), ("outcome", "finished".into()), ("reason", name)];
        self.requests.get_or_create(&labels).inc();
        // A request cancelled before its first token has no TTFT.
        if t.ttft_ms > 0.0 {
            self.ttft.observe(t.ttft_ms / 1e3);
        }
        self.e2e.observe(t.total_ms / 1e3);
        if completion > 1 {
            self.tpot.observe((t.total_ms - t.ttft_ms) / 1e3 / f64::from(completion - 1));
        }
        self.prompt_tokens.inc_by(u64::from(f.usage.prompt_tokens));
        self.cached_tokens.inc_by(u64::from(f.usage.cached_tokens));
    }

    /// A request's prefill left the router `secs` after its admission.
    pub fn dispatched(&self, secs: f64) {
        self.dispatch.observe(secs);
    }

    /// A started stream moved to another decode node.
    pub fn migrated(&self) {
        self.migrations.inc();
    }

    /// A started stream was preempted by its decode node.
    pub fn preempted(&self) {
        self.preemptions.inc();
    }

    /// A request found no room and joined the queue for it.
    pub fn queued(&self) {
        self.queued.inc();
    }

    /// `changes` block events applied, the oldest `age` seconds after it happened.
    pub fn index_applied(&self, changes: usize, age: f64) {
        self.index_changes.inc_by(changes as u64);
        self.index_staleness.observe(age);
    }

    /// A node was asked for a snapshot.
    pub fn index_resync(&self) {
        self.index_resyncs.inc();
    }

    /// A node asked to join and was refused for `reason`.
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&vec![("reason", reason.into())]).inc();
    }

    /// An `auto` request's answer from `model` was not confident enough (or `model` could not
    /// answer): it runs on the next model of the ladder.
    pub fn escalated(&self, model: &str) {
        self.escalations.get_or_create(&vec![("from", model.into())]).inc();
    }

    /// The tier classifier chose `model` to answer an `auto` request.
    pub fn tier_chosen(&self, model: &str) {
        self.tier_choices.get_or_create(&vec![("model", model.into())]).inc();
    }

    /// A request waited for its prefix to be computed by another.
    pub fn coalesced(&self) {
        self.coalesced.inc();
    }

    /// The client of a request of `model` went away before the request ended.
    pub fn abandoned(&self, model: &str) {
        let labels = vec![("model", model.into()), ("outcome", "abandoned".into())];
        self.requests.get_or_create(&labels).inc();
    }

    /// A request failed with `code`: of `model`, or refused before it chose one (None).
    pub fn failed(&self, model: Option<&str>, code: tonic::Code) {
        let mut labels: Labels = model.map(|m| ("model", m.to_string())).into_iter().collect();
        labels.extend([("outcome", "failed".into()), ("code", format!("{code:?}"))]);
        self.requests.get_or_create(&labels).inc();
    }
}
