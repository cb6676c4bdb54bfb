//! The prefill node's config: defaults → TOML file → `PDMESH_PREFILL_*` → flags.

use pdmesh_common::InvalidConfig;
use pdmesh_engine::EngineSettings;
use pdmesh_kv_transfer::{PushMode, TransportKind};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, pdmesh_settings::Settings)]
#[serde(deny_unknown_fields, default)]
#[settings(flags = PrefillFlags)]
pub struct PrefillConfig {
    /// Address to listen on ("host:port"; port 0 picks a free one).
    #[arg(value_name = "ADDR")]
    pub listen: String,
    /// Where Prometheus scrapes `GET /metrics` ("host:port"; port 0 picks a free one); none =
    /// no metrics endpoint.
    #[arg(value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Address routers dial (default: the bound address).
    #[arg(value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Name in statuses, logs and stats (default: "prefill@<advertise>").
    pub node_id: Option<String>,
    /// Routers to register with.
    #[arg(long = "router", value_name = "ADDR")]
    pub routers: Vec<String>,
    /// Prompts computed at once (their chunks share each step's token budget).
    pub max_running: usize,
    /// Prompts waiting for the engine beyond `max_running`; more are refused.
    pub max_queued: usize,
    /// Most KV blocks per transport message.
    pub blocks_per_message: usize,
    /// Time in-flight calls get to finish at shutdown.
    pub drain_ms: u64,
    /// Longest a stopping node (SIGTERM) keeps computing the prompts it has, taking no new
    /// ones (its heartbeats say it is draining), before it exits.
    pub drain_grace_ms: u64,
    /// How KV reaches decode nodes: "ucx" (one-sided puts into the decode node's pool; a
    /// decode node without UCX fails the request), "grpc" (the gRPC stream), "auto" (UCX
    /// when the decode node offers it, else gRPC).
    pub kv_transport: TransportKind,
    /// When KV is pushed: "layer" (each layer as soon as it is computed; UCX only, else
    /// "chunk"), "chunk" (after each chunk's step), "prompt" (after the whole prompt).
    pub kv_push: PushMode,
    /// Send a checksum of every block; the decode node verifies it (DATA_LOSS on mismatch).
    #[settings(switch)]
    pub kv_verify: bool,
    /// A UCX session that completes nothing for this long (plus the time its oldest put's
    /// bytes take at `kv_stall_floor_mbit`) is given up, and its KV sent again over gRPC.
    #[arg(value_name = "MS")]
    pub kv_stall_ms: u64,
    /// The slowest link rate a session is expected to move at, in Mbit/s.
    #[arg(value_name = "MBIT")]
    pub kv_stall_floor_mbit: u64,
    /// The KV-store (prefix cache) to match prompts against and publish computed blocks to,
    /// "host:port"; none = no prefix cache.
    #[arg(value_name = "ADDR")]
    pub kvstore: Option<String>,
    /// The node's own prefix cache: bytes of recently computed or fetched blocks it keeps and
    /// looks up before the KV-store (0 = none).
    #[arg(value_name = "BYTES")]
    pub cache_bytes: u64,
    /// A directory for the node's own cache's disk tier: its blocks are written through there
    /// (checksummed, crash-safe), read back when RAM no longer holds them, and served again
    /// after a restart, or by a replacement node given the same directory. None: RAM only.
    #[arg(value_name = "DIR")]
    pub cache_disk_dir: Option<std::path::PathBuf>,
    /// Bytes of blocks the disk tier holds; least recently used files are deleted past it.
    #[arg(value_name = "BYTES")]
    pub cache_disk_bytes: u64,
    /// Longest a prefix-cache lookup may take; past it the prompt is computed in full.
    pub kvstore_timeout_ms: u64,
    /// Fault injection for tests: wait this long before sending each KV message, so a
    /// transfer stays in flight long enough to be interrupted. 0 in production.
    #[settings(hide)]
    pub fault_transfer_delay_ms: u64,
    /// Fault injection for tests: the block event with this number is never sent to any
    /// router, so each sees a gap. 0 in production.
    #[settings(hide)]
    pub fault_skip_block_event: u64,
    /// Fault injection for tests: the engine thread panics at this step. None in production.
    #[settings(hide)]
    pub fault_engine_panic_at_step: Option<u64>,
    #[settings(flatten = pdmesh_engine::EngineFlags)]
    pub engine: EngineSettings,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50071".into(),
            metrics_listen: None,
            advertise: None,
            node_id: None,
            routers: Vec::new(),
            max_running: 4,
            max_queued: 256,
            blocks_per_message: 4,
            drain_ms: 5_000,
            drain_grace_ms: 30_000,
            kv_transport: TransportKind::Auto,
            kv_push: PushMode::Layer,
            kv_verify: false,
            kv_stall_ms: 1_000,
            kv_stall_floor_mbit: 1_000,
            kvstore: None,
            cache_bytes: 128 << 20,
            cache_disk_dir: None,
            cache_disk_bytes: 4 << 30,
            kvstore_timeout_ms: 500,
            fault_transfer_delay_ms: 0,
            fault_skip_block_event: 0,
            fault_engine_panic_at_step: None,
            engine: EngineSettings::default(),
        }
    }
}

impl PrefillConfig {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.max_running == 0 {
            return Err(InvalidConfig::new("max_running", "must be at least 1"));
        }
        if self.cache_disk_dir.is_some() && (self.cache_bytes == 0 || self.cache_disk_bytes == 0) {
            return Err(InvalidConfig::new(
                "cache_disk_dir",
                "needs a cache in RAM (cache_bytes) and a disk budget (cache_disk_bytes) above 0",
            ));
        }
        if self.blocks_per_message == 0 || self.blocks_per_message > 64 {
            let got = self.blocks_per_message;
            return Err(InvalidConfig::new(
                "blocks_per_message",
                format!("must be in 1..=64, got {got}"),
            ));
        }
        self.stall().map_err(|e| InvalidConfig::new("kv_stall_ms", e))?;
        self.engine.engine_config().map_err(|e| InvalidConfig::new("engine", e.to_string()))?;
        Ok(())
    }

    /// The bound on a UCX session making no progress.
    pub fn stall(&self) -> Result<pdmesh_kv_transfer::StallBound, String> {
        pdmesh_kv_transfer::StallBound::new(self.kv_stall_ms, self.kv_stall_floor_mbit)
    }
}
