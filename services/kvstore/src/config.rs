//! The KV-store's config: defaults → TOML file → `PDMESH_KVSTORE_*` → flags.

use std::path::PathBuf;

use pdmesh_common::InvalidConfig;
use pdmesh_kv_transfer::TransportKind;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, pdmesh_settings::Settings)]
#[serde(deny_unknown_fields, default)]
#[settings(flags = KvStoreFlags)]
pub struct KvStoreConfig {
    /// Address to listen on ("host:port"; port 0 picks a free one).
    #[arg(value_name = "ADDR")]
    pub listen: String,
    /// Where Prometheus scrapes `GET /metrics` ("host:port"; port 0 picks a free one); none =
    /// no metrics endpoint.
    #[arg(value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Name in statuses and logs (default: "kvstore@<advertised address>").
    pub node_id: Option<String>,
    /// Routers to report the blocks it holds to ("host:port", each a name that may stand for
    /// several), so their placement knows what any prefill node can read from it. None: it
    /// reports to no one, and routers count only the nodes' own caches.
    #[arg(long = "router", value_name = "ADDR")]
    pub routers: Vec<String>,
    /// The address prefill nodes reach it at (their `--kvstore`); routers pair the two by it
    /// (default: the bound address).
    #[arg(value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Bytes of KV blocks held in RAM; least recently used unpinned blocks go when it is full
    /// (to the disk tier only, when there is one).
    pub budget_bytes: u64,
    /// A directory for the disk tier: every block stored is also written there (checksummed,
    /// crash-safe), read back when RAM no longer holds it, and served again after a restart.
    /// None: RAM only.
    #[arg(value_name = "DIR")]
    pub disk_dir: Option<PathBuf>,
    /// Bytes of blocks the disk tier holds; least recently used files are deleted past it.
    pub disk_budget_bytes: u64,
    /// Sync each block file to the disk before it counts as written (off: a power loss may tear
    /// recent files, which are then detected and dropped, never served).
    pub disk_sync: bool,
    /// Lease on a match's pins when the caller asks for none.
    pub lease_ms: u64,
    /// Longest lease a caller may ask for.
    pub max_lease_ms: u64,
    /// Time in-flight calls get to finish at shutdown.
    pub drain_ms: u64,
    /// The model whose KV is stored (its fingerprint and shape make the KV layout).
    #[arg(env = "PDMESH_MODEL")]
    pub model: PathBuf,
    /// KV element type of the mesh: f16, f32, q8_0 or q8_0-norot.
    pub kv_dtype: String,
    /// Tokens per KV block of the mesh.
    pub block_size: usize,
    /// How prefill nodes may read blocks: "auto" (UCX gets from the registered pool when UCX
    /// starts, else the gRPC stream), "ucx" (UCX must start) or "grpc" (the stream only).
    pub kv_transport: TransportKind,
}

impl Default for KvStoreConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50081".into(),
            metrics_listen: None,
            node_id: None,
            routers: Vec::new(),
            advertise: None,
            budget_bytes: 1 << 30,
            disk_dir: None,
            disk_budget_bytes: 16 << 30,
            disk_sync: true,
            lease_ms: 10_000,
            max_lease_ms: 60_000,
            drain_ms: 5_000,
            model: PathBuf::from(pdmesh_model::DEFAULT_MODEL_PATH),
            kv_dtype: "f16".into(),
            block_size: 16,
            kv_transport: TransportKind::Auto,
        }
    }
}

impl KvStoreConfig {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        if self.lease_ms == 0 || self.lease_ms > self.max_lease_ms {
            let why = format!(
                "must be in 1..=max_lease_ms ({}), got {}",
                self.max_lease_ms, self.lease_ms
            );
            return Err(InvalidConfig::new("lease_ms", why));
        }
        if self.disk_dir.is_some() && self.disk_budget_bytes == 0 {
            return Err(InvalidConfig::new("disk_budget_bytes", "must be above 0 with a disk_dir"));
        }
        if self.block_size == 0 {
            return Err(InvalidConfig::new("block_size", "must be at least 1"));
        }
        self.kv_dtype
            .parse::<pdmesh_kv_types::KvDtype>()
            .map_err(|e| InvalidConfig::new("kv_dtype", e))?;
        Ok(())
    }
}
