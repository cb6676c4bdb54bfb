//! The flags of `pdmesh router|prefill|decode|kvstore`: each service's settings as clap
//! parses them and as a `--config` file spells them (serialized back to TOML keys, so one set
//! of names serves flags, files and `PDMESH_<SERVICE>_*` variables).

use std::path::PathBuf;

use clap::Args;
use pdmesh_kernels::KvDtype;
use pdmesh_kv_transfer::{KvStaging, PushMode, TransportKind};
use pdmesh_router::placement::PrefillPolicy;
use serde::Serialize;

/// A flag's value as its config file spells it (the KV dtype by name).
fn by_name<S: serde::Serializer>(v: &Option<KvDtype>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(d) => s.serialize_str(d.name()),
        None => s.serialize_none(),
    }
}

#[derive(Debug, Clone, Args, Serialize)]
pub struct EngineFlags {
    /// A GGUF model (llama, qwen2 or qwen3 architecture).
    #[arg(long, env = "PDMESH_MODEL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) model: Option<PathBuf>,
    /// What computes: cpu; cuda (the first NVIDIA GPU, through the driver found at run time);
    /// or cuda-emu (the CUDA backend on an emulation of the GPU on this CPU: slow, for checking
    /// it without a GPU) [default: cpu].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) backend: Option<pdmesh_engine::BackendName>,
    /// real, or sim: no computation, each step takes the time the real engine would (see
    /// --sim-profile) and tokens are a fixed function of the sequence; for driving the router
    /// and planner with more nodes than this machine could compute for [default: real].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) engine: Option<pdmesh_engine::EngineName>,
    /// With --engine sim: `pdmesh bench engine --json` output to take step times from
    /// [default: the calibration pdmesh bundles].
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) sim_profile: Option<PathBuf>,
    /// Compute threads (0 = one per core).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) threads: Option<usize>,
    /// KV cache element type: f16, f32, q8_0 (llama.cpp's 8-bit blocks with its Hadamard
    /// rotation: half of f16's memory and transfer bytes) or q8_0-norot (without it).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "by_name")]
    pub(super) kv_dtype: Option<KvDtype>,
    /// Tokens per KV block.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) block_size: Option<usize>,
    /// Blocks in the KV pool.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kv_blocks: Option<usize>,
    /// Most tokens one engine step processes.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_batch_tokens: Option<usize>,
    /// With --backend cuda or cuda-emu: prompt matmuls of quantized weights (Q8_0, Q4_0, Q4_1,
    /// Q5_0, Q5_1 and the K-quants) on the int8 tensor cores, within a stated bound of the
    /// CPU's logits instead of bit for bit [default: false].
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) cuda_mma: Option<bool>,
    /// With --backend cuda or cuda-emu: attention of batches with prompt tokens (f16/f32 KV)
    /// with flash attention's running softmax, within a stated bound of the CPU's logits
    /// instead of bit for bit [default: false].
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) cuda_flash: Option<bool>,
}

#[derive(Debug, Clone, Args, Serialize)]
pub struct NodeFlags {
    /// TOML config file (see deploy/ for examples).
    #[arg(long)]
    #[serde(skip)]
    pub(super) config: Option<PathBuf>,
    /// Address to listen on, host:port (port 0 picks a free one).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) listen: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (host:port; port 0 picks a free one).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) metrics_listen: Option<String>,
    /// Address others dial to reach this node (default: the bound address).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) advertise: Option<String>,
    /// This node's name in statuses and stats.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) node_id: Option<String>,
    /// A router to register with (repeat for several).
    #[arg(long = "router", value_name = "ADDR")]
    #[serde(rename = "routers", skip_serializing_if = "Vec::is_empty")]
    pub(super) routers: Vec<String>,
    /// Requests the engine works on at once.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_running: Option<usize>,
    /// How KV moves between prefill and decode nodes: ucx (one-sided RDMA puts; UCX_TLS,
    /// UCX_NET_DEVICES … choose the fabric), grpc (the gRPC stream), auto (UCX when both ends
    /// have it, else gRPC) [default: auto].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kv_transport: Option<TransportKind>,
    #[command(flatten)]
    pub(super) engine: EngineFlags,
    /// With --engine sim: host this many simulated nodes in this process, each with its own
    /// listener (port 0: any free one; port P: P, P+1, …; on 127.0.0.1 each its own loopback
    /// address, 127.1.x.y) and its own router sessions, named NODE_ID-0, NODE_ID-1, …
    /// (plaintext on loopback only: one process has one certificate).
    #[arg(long, value_name = "N", default_value_t = 1)]
    #[serde(skip)]
    pub(super) sim_nodes: usize,
    /// Stop when stdin closes (used by `pdmesh up` so children never outlive it).
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub(super) exit_with_stdin: bool,
}

#[derive(Debug, Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub(super) node: NodeFlags,
    /// Lease on a reservation until its KV and its request arrive, in ms.
    #[arg(long)]
    pub(super) lease_ms: Option<u64>,
    /// On SIGTERM (or `Decode/Drain`): longest to wait for running requests to move to other
    /// decode nodes with their KV, or finish here when none has room, in ms [default: 30000].
    #[arg(long)]
    pub(super) drain_grace_ms: Option<u64>,
    /// Longest a step may take while streams run in it, when this node prefills a prompt
    /// itself (colocated): prompt chunks get only the tokens that fit, so streams never stall
    /// for a whole chunk; 0 = no target [default: 50].
    #[arg(long)]
    pub(super) itl_target_ms: Option<u64>,
    /// With UCX, keep the KV pool in shared memory and let prefill nodes on this host map it
    /// and copy KV in with one memcpy, instead of putting it through a transport; such a
    /// writer could reach every block of the pool, not only its reservation's [default: true].
    #[arg(long, value_name = "BOOL")]
    pub(super) kv_shared_pool: Option<bool>,
    /// With UCX, where prefill nodes put KV: direct (into the KV pool itself), staged (into
    /// host staging blocks this node copies into the pool at each commit; a GPU's pool when
    /// UCX has no CUDA transport), auto (direct where UCX reaches the pool's memory, else
    /// staged). Stats show the path as kv_path [default: auto].
    #[arg(long, value_name = "auto|direct|staged")]
    pub(super) kv_staging: Option<KvStaging>,
    /// Size of the staging area in MiB, at most the KV pool's: the KV of transfers in flight;
    /// a reservation that finds it full takes its KV over gRPC [default: 1024].
    #[arg(long, value_name = "MIB")]
    pub(super) kv_staging_mb: Option<u64>,
}

#[derive(Debug, Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub(super) node: NodeFlags,
    /// When KV is pushed: layer (each layer as soon as it is computed, UCX only), chunk (after
    /// each chunk), prompt (after the whole prompt) [default: layer].
    #[arg(long)]
    pub(super) kv_push: Option<PushMode>,
    /// Send a checksum of every KV block for the decode node to verify.
    #[arg(long)]
    pub(super) kv_verify: bool,
    /// Give up a UCX session that completes nothing for this long (plus the time its oldest
    /// put takes at --kv-stall-floor-mbit), and send its KV again over gRPC into the same
    /// reservation [default: 1000].
    #[arg(long, value_name = "MS")]
    pub(super) kv_stall_ms: Option<u64>,
    /// The slowest link a UCX session is expected to move KV at, Mbit/s: a large put is
    /// given this long on top of --kv-stall-ms [default: 1000].
    #[arg(long, value_name = "MBIT")]
    pub(super) kv_stall_floor_mbit: Option<u64>,
    /// A KV-store (`pdmesh kvstore`) to take cached prompt prefixes from and publish computed
    /// blocks to, host:port.
    #[arg(long, value_name = "ADDR")]
    pub(super) kvstore: Option<String>,
    /// Bytes of recent KV blocks the node keeps itself and looks up before the KV-store
    /// (0 = none) [default: 134217728].
    #[arg(long, value_name = "BYTES")]
    pub(super) cache_bytes: Option<u64>,
    /// Fault injection for tests: delay before each KV message, in ms.
    #[arg(long, hide = true)]
    pub(super) fault_transfer_delay_ms: Option<u64>,
    /// Fault injection for tests: never send block event number N to the routers.
    #[arg(long, hide = true)]
    pub(super) fault_skip_block_event: Option<u64>,
}

#[derive(Debug, Args, Serialize)]
pub struct RouterArgs {
    /// TOML config file (see deploy/ for examples).
    #[arg(long)]
    #[serde(skip)]
    pub(super) config: Option<PathBuf>,
    /// Address clients dial for the public Generation API, host:port.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) listen: Option<String>,
    /// Address nodes dial to register and heartbeat (Membership; mutual TLS with node
    /// certificates only), host:port [default: 127.0.0.1:50052].
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) internal_listen: Option<String>,
    /// Also serve the OpenAI-compatible HTTP API here, host:port (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/models`, `/health`; HTTPS with the router's certificate when
    /// TLS is on; the same API keys, as `Authorization: Bearer KEY`). Unset: not served.
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) http_listen: Option<String>,
    /// The model's id in the HTTP API [default: the model file's name without .gguf].
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) served_model_name: Option<String>,
    /// A TOML file of hashed API keys mapped to tenants (make keys with `pdmesh api-key`);
    /// re-read when it changes. Clients send `authorization: Bearer KEY`.
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) api_keys: Option<PathBuf>,
    /// Serve the public API without API keys: every caller is tenant "anonymous".
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(super) allow_anonymous: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (host:port; port 0 picks a free one).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) metrics_listen: Option<String>,
    /// The GGUF the router validates and tokenizes with.
    #[arg(long, env = "PDMESH_MODEL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) model: Option<PathBuf>,
    /// Requests admitted at once; beyond it clients get RESOURCE_EXHAUSTED.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_in_flight: Option<usize>,
    /// Admitted requests that may wait for room on a decode node, first come first served
    /// per tenant (tenants take turns), each until its deadline; beyond it
    /// RESOURCE_EXHAUSTED (0: no waiting) [default: 1024].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_queued: Option<usize>,
    /// Prompts shorter than this are prefilled on the decode node (0 = never).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) colocate_below_tokens: Option<usize>,
    /// Prompts of any length are prefilled on the decode node while every prefill node has at
    /// least this many prompts queued or running (0 = never) [default: 0].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) colocate_when_prefill_busy: Option<u32>,
    /// How prefill nodes are chosen: prefix-aware (where the prompt would be done first, by the
    /// node's backlog of prompt tokens and its cache hits, within --prefix-max-imbalance),
    /// least-load or round-robin [default: prefix-aware].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prefill_policy: Option<PrefillPolicy>,
    /// Most prompts a prefix-aware choice may have above the least-loaded prefill node
    /// [default: 2].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prefix_max_imbalance: Option<u32>,
    /// What reading a token's KV from the KV-store costs a prefill node, as a share of
    /// computing it (0..=1): placement weighs the store's blocks by it [default: 0.1].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kvstore_read_cost: Option<f64>,
    /// Longest a request waits for a shared prefix another request is computing, in ms,
    /// capped at half its deadline (0: compute it again) [default: 30000].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) coalesce_wait_ms: Option<u64>,
    /// Fewest shared tokens, not cached anywhere yet, a request waits for [default: 128].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) coalesce_min_tokens: Option<usize>,
    /// How often nodes heartbeat, in ms.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) heartbeat_interval_ms: Option<u32>,
    /// Nodes silent this long are dropped, in ms.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) node_ttl_ms: Option<u32>,
    /// Lease on decode reservations, in ms.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) lease_ms: Option<u32>,
    /// Longest a decode stream may go silent before its node counts as hung, in ms.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) stall_timeout_ms: Option<u64>,
    /// Times a started stream may move to another decode node when its node dies, hangs or
    /// drains (it continues there bit-identically); 0 = never [default: 3].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_migrations: Option<u32>,
    /// Output tokens a decode reservation holds KV for up front; the rest is promised as
    /// tokens come, and a node that runs out preempts its youngest growing stream, which
    /// waits for room and continues bit-identically (0: all of max_tokens up front, never
    /// preempted) [default: 256].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reserve_tokens: Option<usize>,
    #[command(flatten)]
    pub(super) planner: PlannerFlags,
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub(super) exit_with_stdin: bool,
}

/// The router's `[planner]` settings, as flags (what is not given keeps the file's or the
/// default).
#[derive(Debug, Args, Serialize)]
pub struct PlannerFlags {
    /// The planner's time-to-first-token objective, in ms [default: 2000].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) ttft_slo_ms: Option<f64>,
    /// The planner's inter-token objective, in ms [default: 100].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) itl_slo_ms: Option<f64>,
    /// Seconds of finished requests the planner plans on [default: 30].
    #[arg(long = "planner-window-s")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) window_s: Option<u64>,
    /// Seconds the need must stay lower before the planner shrinks a pool [default: 60].
    #[arg(long = "planner-cooldown-s")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) cooldown_s: Option<u64>,
    /// Fewest prefill nodes the planner asks for [default: 1].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) min_prefill: Option<u32>,
    /// Most prefill nodes the planner asks for [default: 16].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_prefill: Option<u32>,
    /// Fewest decode nodes the planner asks for [default: 1].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) min_decode: Option<u32>,
    /// Most decode nodes the planner asks for [default: 16].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_decode: Option<u32>,
}

#[derive(Debug, Args, Serialize)]
pub struct KvStoreArgs {
    /// TOML config file (see deploy/config/kvstore.toml).
    #[arg(long)]
    #[serde(skip)]
    pub(super) config: Option<PathBuf>,
    /// Address prefill nodes dial, host:port (port 0 picks a free one).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) listen: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (host:port; port 0 picks a free one).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) metrics_listen: Option<String>,
    /// This node's name in statuses and logs.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) node_id: Option<String>,
    /// A router to report the blocks it holds to, so placement counts them (repeat for
    /// several).
    #[arg(long = "router", value_name = "ADDR")]
    #[serde(rename = "routers", skip_serializing_if = "Vec::is_empty")]
    pub(super) routers: Vec<String>,
    /// The address prefill nodes reach it at, as their --kvstore names it: routers pair
    /// nodes with the store by it [default: the bound address].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) advertise: Option<String>,
    /// Bytes of KV blocks held (least recently used unpinned blocks are evicted beyond it).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) budget_bytes: Option<u64>,
    /// The mesh's model (its fingerprint and shape make the KV layout).
    #[arg(long, env = "PDMESH_MODEL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) model: Option<PathBuf>,
    /// KV element type of the mesh: f16, f32, q8_0 or q8_0-norot.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "by_name")]
    pub(super) kv_dtype: Option<KvDtype>,
    /// Tokens per KV block of the mesh.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) block_size: Option<usize>,
    /// How prefill nodes may read blocks: auto (UCX gets from the registered pool when UCX
    /// starts, else the gRPC stream), ucx (UCX must start) or grpc [default: auto].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kv_transport: Option<TransportKind>,
    /// Lease on a match's pins when the caller asks for none, in ms.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) lease_ms: Option<u64>,
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub(super) exit_with_stdin: bool,
}
