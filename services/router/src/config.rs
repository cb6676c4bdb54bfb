//! The router's config: defaults → TOML file → `PDMESH_ROUTER_*` → flags.

use std::path::PathBuf;

use pdmesh_common::InvalidConfig;
use serde::{Deserialize, Serialize};

use crate::placement::PrefillPolicy;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, pdmesh_settings::Settings)]
#[serde(deny_unknown_fields, default)]
#[settings(flags = RouterFlags)]
pub struct RouterConfig {
    /// Where Prometheus scrapes `GET /metrics` ("host:port"; port 0 picks a free one); none =
    /// no metrics endpoint.
    #[arg(value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// The public `Generation` API: where clients dial ("host:port"; port 0 picks a free one).
    #[arg(value_name = "ADDR")]
    pub listen: String,
    /// `Membership`: where nodes register and heartbeat (mutual TLS, nodes' certificates
    /// only). Port 0 picks a free one.
    #[arg(value_name = "ADDR")]
    pub internal_listen: String,
    /// The OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`,
    /// `/v1/models`, `/health`): where its clients dial ("host:port"; port 0 picks one). HTTPS
    /// with the router's certificate when the mesh runs TLS. None = not served.
    #[arg(value_name = "ADDR")]
    pub http_listen: Option<String>,
    /// The model's id in the HTTP API (`model` in requests, `/v1/models`); default: the
    /// model file's name without `.gguf`.
    #[arg(value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// A TOML file of hashed API keys, each mapped to a tenant (`pdmesh api-key` makes
    /// them); re-read when it changes. Required unless `allow_anonymous`.
    #[arg(value_name = "FILE")]
    pub api_keys: Option<PathBuf>,
    /// Serve the public API without API keys (every caller is tenant "anonymous"): for a
    /// router behind a gateway that authenticates, or experiments.
    #[settings(switch)]
    pub allow_anonymous: bool,
    /// The GGUF whose tokenizer, chat template and context the router validates against:
    /// the default model, which requests that name none are served by.
    #[arg(env = "PDMESH_MODEL")]
    pub model: PathBuf,
    /// More models served beside `model` (`[[models]]` in the file: `path`, and `name`, the
    /// file's name without `.gguf` by default). Each has a pool of its own nodes (those
    /// whose weights are its), placed, queued and planned apart; a request names one by
    /// `model`.
    #[settings(skip)]
    pub models: Vec<ServedModel>,
    /// Tiered routing (`[tiers]` in the file): what a request for the virtual model `auto`
    /// runs on. None: `auto` is not served.
    #[settings(skip)]
    pub tiers: Option<Tiers>,
    /// Requests admitted at once; more get RESOURCE_EXHAUSTED with a retry hint.
    pub max_in_flight: usize,
    /// Admitted requests that may wait for room on a decode node (a burst past the mesh's
    /// KV), placed as room appears (first come first served within a tenant, tenants taking
    /// turns), each until its deadline. Past it, RESOURCE_EXHAUSTED with a retry hint; 0
    /// refuses every request that finds no room.
    pub max_queued: usize,
    /// The retry hint given with RESOURCE_EXHAUSTED.
    pub retry_after_ms: u64,
    /// How often nodes heartbeat.
    pub heartbeat_interval_ms: u32,
    /// A node silent this long is dropped.
    pub node_ttl_ms: u32,
    /// Most heartbeats a second all nodes together send: past `heartbeat_interval_ms` ×
    /// this many nodes, each is told to heartbeat less often (and its TTL grows with it).
    pub max_heartbeats_per_s: u32,
    /// Longest a request may run; a client's shorter grpc-timeout wins.
    pub request_timeout_ms: u64,
    /// Longest a reservation or a node's first answer may take.
    pub node_call_timeout_ms: u64,
    /// Longest between the first token being computed and the KV being complete.
    pub transfer_timeout_ms: u64,
    /// Longest a decode stream may go silent.
    pub stall_timeout_ms: u64,
    /// Longest a client may read nothing while its request has output waiting: past it the
    /// client has stopped reading, and the request ends (freeing its place and its KV)
    /// rather than holding them until its deadline.
    pub client_stall_ms: u64,
    /// Lease on decode reservations.
    pub lease_ms: u32,
    /// Times a request may move to another decode node after its stream started (its node
    /// died, hung or drained); it continues there bit-identically. Past it, the client gets
    /// the failure's status. 0 = never move a started stream.
    pub max_migrations: u32,
    /// Output tokens a decode reservation promises blocks for up front (capped at
    /// max_tokens): the rest are promised as they are generated, so short answers do not hold
    /// KV for max_tokens. A node that runs out preempts its youngest growing request, which
    /// waits here for room and continues bit-identically, its prompt and output recomputed.
    /// 0 = promise all of max_tokens (never preempted).
    pub reserve_tokens: usize,
    /// Prompts shorter than this are prefilled on the decode node itself (conditional
    /// disaggregation); 0 = always disaggregate when a prefill node exists.
    pub colocate_below_tokens: usize,
    /// Prompts of any length are prefilled on the decode node when every prefill node has at
    /// least this many prompts queued or running (conditional disaggregation on live load:
    /// the decode node computes them in chunks its streams do not stall on); 0 = never.
    pub colocate_when_prefill_busy: u32,
    /// How prefill nodes are chosen: "prefix-aware" (where the prompt would be done first, by
    /// the node's backlog and its cache hits, within `prefix_max_imbalance`), "least-load" or
    /// "round-robin".
    pub prefill_policy: PrefillPolicy,
    /// Most prompts a prefix-aware choice may have queued or running above the least-loaded
    /// prefill node; past it the cache is given up for the idle node.
    pub prefix_max_imbalance: u32,
    /// What reading a prompt token's KV from the KV-store costs a prefill node, as a share of
    /// computing it (0..=1): prefix-aware placement weighs the store's blocks by it against
    /// the node's own.
    pub kvstore_read_cost: f64,
    /// Longest a request waits for a prefix another request is computing (in-flight prefix
    /// coalescing), capped at half its remaining deadline; 0 = never wait, compute it again.
    pub coalesce_wait_ms: u64,
    /// Fewest shared tokens (not cached anywhere yet) a request waits for: a shorter shared
    /// prefix (a chat template's) saves little and would send a whole burst after one node.
    pub coalesce_min_tokens: usize,
    /// Time in-flight requests get to finish at shutdown.
    pub drain_ms: u64,
    /// How many nodes the load needs (`[planner]`): SLOs, headroom, bounds.
    #[settings(flatten = crate::planner::PlannerFlags)]
    pub planner: crate::planner::PlannerConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50051".into(),
            internal_listen: "127.0.0.1:50052".into(),
            http_listen: None,
            served_model_name: None,
            api_keys: None,
            allow_anonymous: false,
            metrics_listen: None,
            model: PathBuf::from(pdmesh_model::DEFAULT_MODEL_PATH),
            models: Vec::new(),
            tiers: None,
            max_in_flight: 256,
            max_queued: 1024,
            retry_after_ms: 500,
            heartbeat_interval_ms: 500,
            node_ttl_ms: 2_000,
            max_heartbeats_per_s: 1_000,
            request_timeout_ms: 600_000,
            node_call_timeout_ms: 10_000,
            transfer_timeout_ms: 30_000,
            stall_timeout_ms: 60_000,
            client_stall_ms: 30_000,
            lease_ms: 30_000,
            max_migrations: 3,
            reserve_tokens: 256,
            colocate_below_tokens: 0,
            colocate_when_prefill_busy: 0,
            prefill_policy: PrefillPolicy::PrefixAware,
            prefix_max_imbalance: 2,
            kvstore_read_cost: 0.1,
            coalesce_wait_ms: 30_000,
            coalesce_min_tokens: 128,
            drain_ms: 5_000,
            planner: crate::planner::PlannerConfig::default(),
        }
    }
}

impl RouterConfig {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if !(0.0..=1.0).contains(&self.kvstore_read_cost) {
            let why = format!("must be in 0..=1, got {}", self.kvstore_read_cost);
            return Err(InvalidConfig::new("kvstore_read_cost", why));
        }
        if self.api_keys.is_none() && !self.allow_anonymous {
            return Err(InvalidConfig::new(
                "api_keys",
                "the public API needs API keys (a key file: `pdmesh api-key --help`), or \
                 allow_anonymous = true (--allow-anonymous) to serve anyone who reaches it",
            ));
        }
        if self.listen == self.internal_listen && !self.listen.ends_with(":0") {
            return Err(InvalidConfig::new(
                "internal_listen",
                "must differ from listen: nodes and clients are served on separate ports",
            ));
        }
        if let Some(h) = &self.http_listen
            && (h == &self.listen || h == &self.internal_listen)
            && !h.ends_with(":0")
        {
            return Err(InvalidConfig::new(
                "http_listen",
                "must differ from listen and internal_listen: each API has its own port",
            ));
        }
        if self.served_model_name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            return Err(InvalidConfig::new("served_model_name", "must not be empty"));
        }
        let mut names = vec![self.model_id()];
        for m in &self.models {
            let name = m.id();
            if name.trim().is_empty() || name == AUTO_MODEL {
                let why = format!("a model's name must be neither empty nor {AUTO_MODEL:?}");
                return Err(InvalidConfig::new("models", why));
            }
            if names.contains(&name) {
                return Err(InvalidConfig::new("models", format!("{name:?} is served twice")));
            }
            names.push(name);
        }
        if let Some(t) = &self.tiers {
            t.check(&names).map_err(|why| InvalidConfig::new("tiers", why))?;
        }
        if self.max_in_flight == 0 {
            return Err(InvalidConfig::new("max_in_flight", "must be at least 1"));
        }
        if self.heartbeat_interval_ms == 0 || self.node_ttl_ms <= self.heartbeat_interval_ms {
            let why = format!(
                "{} must exceed heartbeat_interval_ms ({}), which must be > 0",
                self.node_ttl_ms, self.heartbeat_interval_ms
            );
            return Err(InvalidConfig::new("node_ttl_ms", why));
        }
        if self.max_heartbeats_per_s == 0 {
            return Err(InvalidConfig::new("max_heartbeats_per_s", "must be at least 1"));
        }
        self.planner.validate()?;
        for (name, v) in [
            ("request_timeout_ms", self.request_timeout_ms),
            ("node_call_timeout_ms", self.node_call_timeout_ms),
            ("transfer_timeout_ms", self.transfer_timeout_ms),
            ("stall_timeout_ms", self.stall_timeout_ms),
            ("client_stall_ms", self.client_stall_ms),
            ("lease_ms", u64::from(self.lease_ms)),
        ] {
            if v == 0 {
                return Err(InvalidConfig::new(name, "must be at least 1"));
            }
        }
        Ok(())
    }
}

impl RouterConfig {
    /// The default model's id (requests' `model`, the HTTP API's).
    pub fn model_id(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| default_model_id(&self.model))
    }

    /// Every served model, the default first: its id and its file.
    pub fn served(&self) -> Vec<(String, PathBuf)> {
        let extra = self.models.iter().map(|m| (m.id(), m.path.clone()));
        std::iter::once((self.model_id(), self.model.clone())).chain(extra).collect()
    }
}

/// A name no model may take: kept for routing along a ladder of models.
pub const AUTO_MODEL: &str = "auto";

/// Tiered routing along a ladder of served models, cheapest first: how a request for `auto`
/// picks the model that answers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tiers {
    /// Served models' ids, cheapest first (at least two).
    pub ladder: Vec<String>,
    /// `cascade` (the default) or `classifier`.
    #[serde(default)]
    pub policy: TierPolicy,
    /// cascade: the least mean token log-probability (≤ 0) an answer needs to be kept.
    #[serde(default = "default_min_mean_logprob")]
    pub min_mean_logprob: f32,
    /// classifier: the file `scripts/train_tiers.py` wrote (weights for every model of the
    /// ladder but the last).
    #[serde(default)]
    pub classifier: Option<PathBuf>,
    /// classifier: the least predicted chance of a good answer (0..1) a cheaper model needs
    /// to be chosen.
    #[serde(default = "default_min_p_correct")]
    pub min_p_correct: f32,
}

/// How `auto` climbs its ladder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TierPolicy {
    /// Each model but the last answers in full, out of the client's sight; its answer is
    /// kept when the mean log-probability of its tokens reaches `min_mean_logprob`, and the
    /// request is otherwise re-run on the next model. No training; costs the cheaper models'
    /// runs on every escalated request.
    #[default]
    Cascade,
    /// Before any model runs, a classifier trained offline on graded answers predicts from
    /// the request's words how likely each cheaper model is to answer well; the cheapest
    /// whose chance reaches `min_p_correct` answers, else the last. One run per request.
    Classifier,
}

fn default_min_mean_logprob() -> f32 {
    -0.3
}

fn default_min_p_correct() -> f32 {
    0.5
}

impl Tiers {
    /// A cascade along `ladder` that keeps answers whose mean token log-probability reaches
    /// `min_mean_logprob`.
    pub fn cascade(ladder: Vec<String>, min_mean_logprob: f32) -> Self {
        Self {
            ladder,
            policy: TierPolicy::Cascade,
            min_mean_logprob,
            classifier: None,
            min_p_correct: default_min_p_correct(),
        }
    }

    /// Routing up front along `ladder` by the classifier in `file`.
    pub fn classifier(ladder: Vec<String>, file: PathBuf, min_p_correct: f32) -> Self {
        Self {
            policy: TierPolicy::Classifier,
            classifier: Some(file),
            min_p_correct,
            ..Self::cascade(ladder, default_min_mean_logprob())
        }
    }

    /// Refuses a ladder of models not all in `served`, or settings out of range, saying why.
    pub fn check(&self, served: &[String]) -> Result<(), String> {
        if self.ladder.len() < 2 {
            return Err("ladder: at least two models, cheapest first".into());
        }
        for (i, m) in self.ladder.iter().enumerate() {
            if !served.contains(m) {
                return Err(format!("ladder[{i}]: {m:?} is not served (served: {served:?})"));
            }
            if self.ladder[..i].contains(m) {
                return Err(format!("ladder[{i}]: {m:?} is on the ladder twice"));
            }
        }
        if !(self.min_mean_logprob.is_finite() && self.min_mean_logprob <= 0.0) {
            return Err(format!(
                "min_mean_logprob: a log-probability, finite and <= 0; got {}",
                self.min_mean_logprob
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p_correct) {
            return Err(format!("min_p_correct: a chance in 0..=1; got {}", self.min_p_correct));
        }
        match (self.policy, &self.classifier) {
            (TierPolicy::Classifier, None) => {
                Err("policy \"classifier\" needs `classifier`, the trained file".into())
            }
            (TierPolicy::Cascade, Some(_)) => {
                Err("classifier: only read with policy = \"classifier\" (the policy is cascade)"
                    .into())
            }
            _ => Ok(()),
        }
    }
}

/// A model served beside the default one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServedModel {
    /// Its GGUF.
    pub path: PathBuf,
    /// Its id in requests; default: the file's name without `.gguf`.
    pub name: Option<String>,
}

impl ServedModel {
    pub fn id(&self) -> String {
        self.name.clone().unwrap_or_else(|| default_model_id(&self.path))
    }
}

/// A model's id in the HTTP API unless one is given: its file's name without `.gguf`.
pub fn default_model_id(model: &std::path::Path) -> String {
    let file = model.file_name().map(|f| f.to_string_lossy().into_owned());
    let file = file.unwrap_or_else(|| "model".into());
    file.strip_suffix(".gguf").map(str::to_string).unwrap_or(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(models: &[(&str, Option<&str>)]) -> RouterConfig {
        let models = models
            .iter()
            .map(|(p, n)| ServedModel { path: p.into(), name: n.map(str::to_string) })
            .collect();
        RouterConfig { allow_anonymous: true, models, ..Default::default() }
    }

    /// Every served model has one id, the default first; a name served twice (by the
    /// default's file name too), an empty one or the reserved `auto` is refused.
    #[test]
    fn served_models_have_distinct_ids() {
        let c = with(&[("m/gemma.gguf", None), ("m/b.gguf", Some("big"))]);
        c.validate().unwrap();
        let ids: Vec<String> = c.served().into_iter().map(|(id, _)| id).collect();
        assert_eq!(ids, [c.model_id().as_str(), "gemma", "big"]);
        for (bad, why) in [
            (with(&[("x/gemma.gguf", None), ("y/gemma.gguf", None)]), "served twice"),
            (with(&[("x/a.gguf", Some(&c.model_id()))]), "served twice"),
            (with(&[("x/a.gguf", Some(" "))]), "empty"),
            (with(&[("x/a.gguf", Some("auto"))]), "auto"),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("models"), "{e}");
        }
    }

    /// A ladder names served models, each once, at least two, with a log-probability
    /// threshold; anything else is refused naming what is wrong.
    #[test]
    fn a_ladder_climbs_served_models() {
        let tiers = |ladder: &[&str], t: f32| {
            let mut c = with(&[("m/big.gguf", None)]);
            let ladder = ladder.iter().map(|s| s.to_string()).collect();
            c.tiers = Some(Tiers::cascade(ladder, t));
            c
        };
        let small = RouterConfig::default().model_id();
        tiers(&[&small, "big"], -0.5).validate().unwrap();
        for (bad, why) in [
            (tiers(&["big"], -0.5), "at least two"),
            (tiers(&[&small, "huge"], -0.5), "\"huge\" is not served"),
            (tiers(&[&small, &small], -0.5), "twice"),
            (tiers(&[&small, "big"], 0.5), "<= 0"),
            (tiers(&[&small, "big"], f32::NAN), "<= 0"),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("tiers"), "{e}");
        }
        // The classifier policy needs its file, and the file no other policy.
        let with_tiers = |t: Tiers| RouterConfig { tiers: Some(t), ..tiers(&[], 0.0) };
        let ladder = || vec![small.clone(), "big".to_string()];
        with_tiers(Tiers::classifier(ladder(), "c.json".into(), 0.6)).validate().unwrap();
        let no_file = Tiers { classifier: None, ..Tiers::classifier(ladder(), "c".into(), 0.6) };
        let stray = Tiers { classifier: Some("c.json".into()), ..Tiers::cascade(ladder(), -0.3) };
        for (bad, why) in [
            (with_tiers(no_file), "needs `classifier`"),
            (with_tiers(stray), "only read with policy"),
            (with_tiers(Tiers::classifier(ladder(), "c".into(), 1.5)), "0..=1"),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("tiers"), "{e}");
        }
        let file: RouterConfig =
            toml::from_str("[tiers]\nladder = [\"a\", \"b\"]\nmin_mean_logprob = -0.7\n").unwrap();
        assert_eq!(file.tiers.unwrap().ladder, ["a", "b"]);
        let file: RouterConfig = toml::from_str(
            "[tiers]\nladder = [\"a\", \"b\"]\npolicy = \"classifier\"\nclassifier = \"c.json\"\n",
        )
        .unwrap();
        let t = file.tiers.unwrap();
        assert_eq!((t.policy, t.min_p_correct), (TierPolicy::Classifier, 0.5));
        let e = toml::from_str::<RouterConfig>("[tiers]\nladder = []\npolicy = \"guess\"\n");
        assert!(e.unwrap_err().to_string().contains("unknown variant"));
    }
}
