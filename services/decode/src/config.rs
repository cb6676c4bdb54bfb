//! The decode node's config: defaults → TOML file → `PDMESH_DECODE_*` → flags.

use pdmesh_common::InvalidConfig;
use pdmesh_engine::EngineSettings;
use pdmesh_kv_transfer::{KvStaging, TransportKind};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, pdmesh_settings::Settings)]
#[serde(deny_unknown_fields, default)]
#[settings(flags = DecodeFlags)]
pub struct DecodeConfig {
    /// Address to listen on ("host:port"; port 0 picks a free one).
    #[arg(value_name = "ADDR")]
    pub listen: String,
    /// Where Prometheus scrapes `GET /metrics` ("host:port"; port 0 picks a free one); none =
    /// no metrics endpoint.
    #[arg(value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Address routers and prefill nodes dial (default: the bound address).
    #[arg(value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Name in statuses, logs and stats (default: "decode@<advertise>").
    pub node_id: Option<String>,
    /// Routers to register with.
    #[arg(long = "router", value_name = "ADDR")]
    pub routers: Vec<String>,
    /// Requests decoding at once (the continuous batch).
    pub max_running: usize,
    /// Longest a step may take while streams are running in it, when this node also prefills
    /// prompts (colocated, or conditional disaggregation): a prompt's chunks get only the
    /// tokens that fit, so streams never stall for a whole prompt chunk. 0 = no target (each
    /// step takes up to `engine.max_batch_tokens`).
    pub itl_target_ms: u64,
    /// Lease on a reservation until its request is attached and its KV complete.
    pub lease_ms: u64,
    /// Longest lease a caller may ask for.
    pub max_lease_ms: u64,
    /// Time in-flight calls get to finish at shutdown, after the drain.
    pub drain_ms: u64,
    /// Longest a stopping node (SIGTERM, `Drain`) waits for its requests to move to other
    /// decode nodes with their KV, or to finish here when none has room, before it exits.
    pub drain_grace_ms: u64,
    /// How prefill nodes may deliver KV here: "ucx" (register the KV pool with UCX; fail to
    /// start without it), "grpc" (the gRPC stream only), "auto" (UCX when it starts).
    pub kv_transport: TransportKind,
    /// With UCX: keep the KV pool in shared memory that UCX allocates and offer it to writers
    /// on this host, which then copy KV in with one memcpy (see kv-transfer's `pool`). They
    /// could reach every block, not only their reservation's; false keeps writers to puts.
    #[arg(value_name = "BOOL")]
    pub kv_shared_pool: bool,
    /// With UCX: whether writers put into the KV pool itself ("direct"), into host staging
    /// blocks that this node copies into the pool at each commit ("staged"), or "auto":
    /// direct where UCX reaches the pool's memory (host memory; a GPU's with a CUDA-enabled
    /// UCX), staged otherwise. Stats and traces show the path taken (`kv_path`).
    #[arg(value_name = "auto|direct|staged")]
    pub kv_staging: KvStaging,
    /// Size of the staging area in MiB (page-locked host memory for a GPU pool; shared memory
    /// with `kv_shared_pool`), at most the pool's size. It holds the KV of transfers in
    /// flight; a reservation that finds it full takes its KV over a stream instead.
    #[arg(value_name = "MIB")]
    pub kv_staging_mb: u64,
    /// Fault injection for tests: the engine thread panics at this step. None in production.
    #[settings(hide)]
    pub fault_engine_panic_at_step: Option<u64>,
    /// Fault injection for tests: each engine step waits this long first. 0 in production.
    #[settings(hide)]
    pub fault_step_delay_ms: u64,
    #[settings(flatten = pdmesh_engine::EngineFlags)]
    pub engine: EngineSettings,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50061".into(),
            metrics_listen: None,
            advertise: None,
            node_id: None,
            routers: Vec::new(),
            max_running: 64,
            itl_target_ms: 50,
            lease_ms: 30_000,
            max_lease_ms: 300_000,
            drain_ms: 5_000,
            drain_grace_ms: 30_000,
            kv_transport: TransportKind::Auto,
            kv_shared_pool: true,
            kv_staging: KvStaging::Auto,
            kv_staging_mb: 1024,
            fault_engine_panic_at_step: None,
            fault_step_delay_ms: 0,
            engine: EngineSettings { kv_blocks: 1024, ..EngineSettings::default() },
        }
    }
}

impl DecodeConfig {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.max_running == 0 {
            return Err(InvalidConfig::new("max_running", "must be at least 1"));
        }
        if self.lease_ms == 0 || self.lease_ms > self.max_lease_ms {
            let why = format!(
                "must be in 1..=max_lease_ms ({}), got {}",
                self.max_lease_ms, self.lease_ms
            );
            return Err(InvalidConfig::new("lease_ms", why));
        }
        if self.kv_staging_mb == 0 {
            return Err(InvalidConfig::new("kv_staging_mb", "must be at least 1"));
        }
        if self.kv_staging != KvStaging::Auto && self.kv_transport == TransportKind::Grpc {
            let why = format!(
                "{} needs a one-sided transport (ucx), but kv_transport is grpc",
                self.kv_staging
            );
            return Err(InvalidConfig::new("kv_staging", why));
        }
        self.engine.engine_config().map_err(|e| InvalidConfig::new("engine", e.to_string()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_settings_are_checked() {
        let ok = DecodeConfig::default();
        ok.validate().expect("the defaults are valid");
        let zero = DecodeConfig { kv_staging_mb: 0, ..ok.clone() };
        let e = zero.validate().expect_err("an empty staging area");
        assert!(e.to_string().contains("kv_staging_mb"), "{e}");
        let no_ucx = DecodeConfig {
            kv_staging: KvStaging::Staged,
            kv_transport: TransportKind::Grpc,
            ..ok.clone()
        };
        let e = no_ucx.validate().expect_err("staging without UCX");
        assert!(e.to_string().contains("needs a one-sided transport"), "{e}");
        let auto = DecodeConfig { kv_transport: TransportKind::Grpc, ..ok };
        auto.validate().expect("auto staging is fine without UCX");
        assert_eq!("Staged".parse::<KvStaging>(), Ok(KvStaging::Staged));
        assert!("sometimes".parse::<KvStaging>().is_err());
    }

    #[test]
    fn auto_stages_only_what_ucx_cannot_reach() {
        assert!(!KvStaging::Auto.stages(true));
        assert!(KvStaging::Auto.stages(false));
        assert!(!KvStaging::Direct.stages(false), "direct never stages: it fails instead");
        assert!(KvStaging::Staged.stages(true));
    }
}
