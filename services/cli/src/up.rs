//! `pdmesh up`: a whole mesh on this machine, as separate processes — one router, `--prefill N`
//! prefill nodes and `--decode M` decode nodes — started from this same binary. It waits until
//! every node has registered with the router, prints the endpoint, and supervises the mesh as an
//! orchestrator would: a process that dies is restarted (with back-off, on the same addresses
//! where others dial it) while the rest keep serving. On Ctrl-C or SIGTERM it stops the
//! children by closing their stdin (each exits cleanly when it closes, so none can outlive this
//! process), killing any that do not stop in time.
//!
//! With `--autoscale` it follows the router's planner (`pdmesh_planner_desired_nodes`, one per
//! model's pools): it starts a node of a model when its planner wants more, and drains one
//! (SIGTERM: its streams move to the others with their KV) when it wants fewer, between the
//! starting counts and `--max-*`.
//!
//! The mesh runs as production does: mutual TLS between its processes under a throwaway CA,
//! and an API key for the public API, all made now in a private directory named after the
//! router's address (where `pdmesh generate` finds them) and removed when the mesh stops.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

use pdmesh_cli::client::{API_KEY_FILE, KEY_RING_FILE, OPERATOR};
use pdmesh_cli::process::stop;
use pdmesh_kv_transfer::{PushMode, TransportKind};
use pdmesh_router::placement::PrefillPolicy;

mod children;
mod supervise;

use children::{NodeTemplate, Settings, router_config};
use supervise::{
    AUTOSCALE_EVERY, Launch, Supervised, autoscale, desired_nodes, start_node, wait_ready,
};

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Prefill nodes of each model (0: decode nodes prefill prompts themselves): one count for
    /// every model, or one per `--model` in order, comma-separated (`--prefill 1,2`).
    #[arg(long, default_value = "1", value_delimiter = ',', value_name = "N[,N...]")]
    prefill: Vec<usize>,
    /// Decode nodes of each model (at least 1), as `--prefill` counts them.
    #[arg(long, default_value = "1", value_delimiter = ',', value_name = "N[,N...]")]
    decode: Vec<usize>,
    /// Where the router listens.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: String,
    /// Where the router serves the OpenAI-compatible HTTP API (HTTPS under the mesh's CA,
    /// with the same API key).
    #[arg(long, default_value = "127.0.0.1:8000")]
    http_listen: String,
    /// A GGUF model (llama, qwen2, qwen3 or gemma3 architecture). Repeat it to serve several:
    /// each has nodes of its own and is asked for by its file's name without `.gguf` (the
    /// first serves requests that name none; the KV-store, if any, caches its prefixes).
    #[arg(long = "model", env = "PDMESH_MODEL", value_name = "GGUF")]
    #[arg(default_value = pdmesh_engine::DEFAULT_MODEL_PATH)]
    models: Vec<PathBuf>,
    /// Compute threads per node (default: the machine's cores shared among the nodes).
    #[arg(long)]
    threads: Option<usize>,
    /// KV blocks per decode node.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Tokens per KV block on every node and the KV-store. Also the unit the
    /// prefix cache shares.
    #[arg(long)]
    block_size: Option<usize>,
    /// KV element type on every node and the KV-store: f16, f32, q8_0 (llama.cpp's
    /// 8-bit blocks with its Hadamard rotation: half of f16's KV memory and transfer bytes)
    /// or q8_0-norot.
    #[arg(long)]
    kv_dtype: Option<pdmesh_kernels::KvDtype>,
    /// Prompts shorter than this are prefilled on the decode node (0 = never).
    #[arg(long, default_value_t = 0)]
    colocate_below_tokens: usize,
    /// What prefill nodes compute on: cpu, cuda (the first GPU) or cuda-emu (see
    /// `pdmesh prefill --help`).
    #[arg(long)]
    prefill_backend: Option<pdmesh_engine::BackendName>,
    /// What decode nodes compute on: cpu, cuda or cuda-emu.
    #[arg(long)]
    decode_backend: Option<pdmesh_engine::BackendName>,
    /// Pin prefill nodes to these CPUs (taskset list, e.g. "0" or "0-1").
    #[arg(long)]
    prefill_cpus: Option<String>,
    /// Pin decode nodes to these CPUs (taskset list).
    #[arg(long)]
    decode_cpus: Option<String>,
    /// How KV moves from prefill to decode nodes: ucx, grpc or auto (see `pdmesh prefill --help`).
    #[arg(long)]
    kv_transport: Option<TransportKind>,
    /// When prefill nodes push KV: layer, chunk or prompt.
    #[arg(long)]
    kv_push: Option<PushMode>,
    /// Bytes the KV-store (the shared prefix cache) holds; 0 runs the mesh without one.
    #[arg(long, default_value_t = pdmesh_kvstore::KvStoreConfig::default().budget_bytes)]
    kvstore_budget_bytes: u64,
    /// A directory for the KV-store's disk tier (`pdmesh kvstore --disk-dir`): its blocks are
    /// also kept there and served again after it restarts. None: RAM only.
    #[arg(long, value_name = "DIR")]
    kvstore_disk_dir: Option<PathBuf>,
    /// A directory for the prefill nodes' own caches' disk tiers, each node in a subdirectory
    /// of its name (`pdmesh prefill --cache-disk-dir`). None: RAM only.
    #[arg(long, value_name = "DIR")]
    cache_disk_dir: Option<PathBuf>,
    /// How the router chooses prefill nodes: prefix-aware, least-load or round-robin.
    #[arg(long)]
    prefill_policy: Option<PrefillPolicy>,
    /// Bytes of recent KV blocks each prefill node keeps itself (0 = none).
    #[arg(long, value_name = "BYTES")]
    cache_bytes: Option<u64>,
    /// Give up if the mesh is not ready within this many seconds.
    #[arg(long, default_value_t = 120)]
    ready_timeout_s: u64,
    /// Follow the router's planner: start nodes when the load needs more, drain nodes when it
    /// needs fewer (never below --prefill/--decode, never above --max-prefill/--max-decode);
    /// each model's pools by that model's own planner.
    #[arg(long)]
    autoscale: bool,
    /// Most prefill nodes --autoscale runs, of each model.
    #[arg(long, default_value_t = 3)]
    max_prefill: usize,
    /// Most decode nodes --autoscale runs, of each model.
    #[arg(long, default_value_t = 3)]
    max_decode: usize,
    /// The planner's time-to-first-token objective, in ms.
    #[arg(long)]
    ttft_slo_ms: Option<f64>,
    /// The planner's inter-token objective, in ms.
    #[arg(long)]
    itl_slo_ms: Option<f64>,
    /// Seconds of finished requests the planner plans on.
    #[arg(long)]
    planner_window_s: Option<u64>,
    /// Seconds the planner's need must stay lower before a pool shrinks.
    #[arg(long)]
    planner_cooldown_s: Option<u64>,
    /// Serve the virtual model `auto` along these served models, cheapest first (a model's id
    /// is its file's name without `.gguf`), by --tier-policy. None: `auto` is not served.
    #[arg(long, value_delimiter = ',', value_name = "ID,ID[,...]")]
    tiers: Vec<String>,
    /// How `auto` picks the model that answers: cascade (each cheaper model answers out of
    /// sight, kept when confident enough) or classifier (chosen up front from the request's
    /// words by --tier-classifier).
    #[arg(long, default_value = "cascade", requires = "tiers")]
    tier_policy: pdmesh_router::config::TierPolicy,
    /// cascade: the least mean token log-probability (<= 0) a cheaper model's answer needs.
    #[arg(long, default_value_t = -0.3, requires = "tiers", allow_negative_numbers = true)]
    tier_min_logprob: f32,
    /// classifier: the file `scripts/train_tiers.py train` wrote (e.g.
    /// deploy/config/tier-classifier.json).
    #[arg(long, value_name = "FILE", requires = "tiers")]
    tier_classifier: Option<PathBuf>,
    /// classifier: the least predicted chance (0..1) of a good answer a cheaper model needs.
    #[arg(long, default_value_t = 0.5, requires = "tiers")]
    tier_min_p: f32,
}

impl UpArgs {
    /// The default model: requests that name none and the KV-store are its.
    fn model(&self) -> &Path {
        &self.models[0]
    }

    /// Nodes of `role` model `k` starts with.
    fn nodes(&self, role: &str, k: usize) -> usize {
        let counts = if role == "prefill" { &self.prefill } else { &self.decode };
        counts.get(k).or(counts.first()).copied().unwrap_or(0)
    }

    /// Nodes of `role` the mesh starts with, every model's.
    fn total(&self, role: &str) -> usize {
        (0..self.models.len()).map(|k| self.nodes(role, k)).sum()
    }

    /// Most nodes of `role` model `k` may run.
    fn most(&self, role: &str, k: usize) -> usize {
        let least = self.nodes(role, k);
        match (role, self.autoscale) {
            ("prefill", true) => self.max_prefill.max(least),
            (_, true) => self.max_decode.max(least),
            (_, false) => least,
        }
    }

    /// The name node `i` of `role` of model `k` runs (and is certified) as: the default
    /// model's are `prefill-0`, `decode-1`, ..., model k's `m{k}-prefill-0`, ...
    fn node_name(k: usize, role: &str, i: usize) -> String {
        if k == 0 { format!("{role}-{i}") } else { format!("m{k}-{role}-{i}") }
    }

    /// Refuses a mesh `up` cannot run, naming the flag.
    fn check(&self) -> anyhow::Result<()> {
        let models = self.models.len();
        for (flag, counts) in [("--prefill", &self.prefill), ("--decode", &self.decode)] {
            if counts.len() != 1 && counts.len() != models {
                bail!(
                    "{flag} has {} counts for {models} models: give one for every model or one \
                     per --model",
                    counts.len()
                );
            }
        }
        if let Some(k) = (0..models).find(|&k| self.nodes("decode", k) == 0) {
            bail!(
                "--decode must be at least 1 for every model ({} has none): decode nodes serve \
                 every request",
                self.models[k].display()
            );
        }
        if self.autoscale
            && let Some(k) = (0..models).find(|&k| self.nodes("prefill", k) == 0)
        {
            bail!(
                "--autoscale needs --prefill of at least 1 for every model ({} has none): it \
                 scales both pools",
                self.models[k].display()
            );
        }
        let mut ids = Vec::new();
        for m in &self.models {
            if !m.exists() {
                bail!(
                    "model file {} not found: run `just fetch-model` (or pass --model PATH)",
                    m.display()
                );
            }
            let id = pdmesh_router::config::default_model_id(m);
            if ids.contains(&id) {
                bail!("two --model files are both named {id:?}: each model is asked for by name");
            }
            ids.push(id);
        }
        if let Some(t) = children::tiers(self) {
            t.check(&ids).map_err(|e| anyhow::anyhow!("--tiers and --tier-*: {e}"))?;
            if let Some(file) = &t.classifier {
                pdmesh_router::classifier::Classifier::load(file, &t.ladder)
                    .map_err(|e| anyhow::anyhow!("--tier-classifier: {e}"))?;
            }
        }
        Ok(())
    }
}

pub fn run(a: UpArgs, insecure: bool) -> anyhow::Result<()> {
    a.check()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    if insecure {
        // Plaintext and without keys: refused before anything starts, rather than by the
        // router once the rest is up.
        let far: Vec<&str> = [a.listen.as_str(), a.http_listen.as_str()]
            .into_iter()
            .filter(|l| !crate::serve::is_loopback(l))
            .collect();
        if !far.is_empty() {
            bail!(
                "--insecure serves the mesh in plaintext and without API keys, so only on \
                 loopback addresses; {} not (leave out --insecure: the mesh makes its own \
                 certificates and key)",
                far.join(", ")
            );
        }
        pdmesh_common::tls::init(None);
        return rt.block_on(up_with(&a, None));
    }
    let dir = pdmesh_cli::client::local_mesh_dir(&a.listen).context(pdmesh_cli::client::NO_HOME)?;
    let issued = issue_credentials(&a, &dir)?;
    let renew = rt.spawn(renew_certificates(issued, dir.clone()));
    let r = rt.block_on(up_with(&a, Some(&dir)));
    renew.abort();
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// How long the certificates `pdmesh up` makes are good for: a key left on disk by a mesh
/// that was killed, or copied off a running one, stops working within the day.
const UP_CERT_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// How often `pdmesh up` renews them; every process reloads its files within seconds
/// (`tls::watch`), and connections dialled before drain at their maximum age.
const UP_RENEW_EVERY: Duration = Duration::from_secs(8 * 3600);
/// The throwaway CA's term: it outlives any mesh `up` runs, and its key never touches disk.
const UP_CA_VALIDITY: Duration = Duration::from_secs(365 * 86_400);

/// The mesh's CA (its key held only in this process's memory) and whom it certifies.
struct Issued {
    ca: pdmesh_common::tls::Ca,
    names: Vec<(String, pdmesh_common::tls::MeshRole)>,
}

impl Issued {
    /// Every process's certificate, issued (anew) into `dir`.
    fn issue(&self, dir: &Path) -> Result<(), pdmesh_common::tls::TlsError> {
        for (name, role) in &self.names {
            // The router's HTTPS clients dial it on this machine.
            let hosts = if *role == pdmesh_common::tls::MeshRole::Router {
                LOOPBACK_HOSTS.map(String::from).to_vec()
            } else {
                Vec::new()
            };
            self.ca.issue_for_hosts(dir, name, *role, &hosts)?;
        }
        Ok(())
    }
}

/// Issues every process's certificate anew every `UP_RENEW_EVERY`, until aborted.
async fn renew_certificates(issued: Issued, dir: PathBuf) {
    // This process dials the mesh as its operator: it takes its own renewed certificate too.
    pdmesh_common::tls::watch(pdmesh_common::serve::RELOAD_EVERY);
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + UP_RENEW_EVERY, UP_RENEW_EVERY);
    loop {
        tick.tick().await;
        if let Err(e) = issued.issue(&dir) {
            eprintln!("pdmesh: renewing the mesh's certificates (they expire in a day): {e}");
        }
    }
}

/// The names a client on this machine dials the router's HTTPS API by.
pub const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// The mesh's UCX seal key, in the credentials directory.
pub(super) const SEAL_KEY_FILE: &str = "mesh-seal.key";

/// Makes the mesh's credentials in `dir`: a CA, one certificate per process named as the
/// process is, the operator's, the operator's API key and the UCX seal key.
fn issue_credentials(a: &UpArgs, dir: &Path) -> anyhow::Result<Issued> {
    use pdmesh_common::tls::{Ca, MeshRole};
    // Whatever an earlier mesh at this address left (it was killed) is stale.
    let _ = std::fs::remove_dir_all(dir);
    let ca = Ca::generate_for(UP_CA_VALIDITY)?.with_leaf_validity(UP_CERT_VALIDITY);
    // The CA's key is not written: no one adds processes to a throwaway mesh, and only this
    // process renews their certificates.
    ca.write(dir, false)?;
    let mut names: Vec<(String, MeshRole)> = vec![
        ("router".into(), MeshRole::Router),
        ("kvstore".into(), MeshRole::KvStore),
        (OPERATOR.into(), MeshRole::Admin),
    ];
    for k in 0..a.models.len() {
        for (role, cert) in [("prefill", MeshRole::Prefill), ("decode", MeshRole::Decode)] {
            let n = a.most(role, k);
            names.extend((0..n).map(|i| (UpArgs::node_name(k, role, i), cert)));
        }
    }
    let issued = Issued { ca, names };
    issued.issue(dir)?;
    let operator = pdmesh_common::apikey::Tenant {
        tenant: OPERATOR.into(),
        max_in_flight: None,
        cache_group: None,
        kv_policy: None,
        default_model: None,
    };
    let key = pdmesh_common::apikey::add(&dir.join(KEY_RING_FILE), operator)?;
    write_private(&dir.join(API_KEY_FILE), &key)?;
    write_private(&dir.join(SEAL_KEY_FILE), &pdmesh_kv_ucx::new_seal_key())?;
    pdmesh_common::tls::init(Some(pdmesh_common::tls::MeshTls::load(dir, OPERATOR)?));
    Ok(issued)
}

fn write_private(path: &Path, data: &str) -> anyhow::Result<()> {
    pdmesh_common::config::write_private(path, data.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

async fn up_with(a: &UpArgs, dir: Option<&Path>) -> anyhow::Result<()> {
    // The children's config files live as long as the mesh.
    let configs = tempfile::Builder::new()
        .prefix("pdmesh-up-")
        .tempdir()
        .context("making a directory for the children's config files")?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (prefill, decode) = (a.total("prefill"), a.total("decode"));
    let threads = a.threads.unwrap_or_else(|| (cores / (prefill + decode)).max(1));
    let launch = Launch { tls_dir: dir.map(Path::to_path_buf), configs: configs.path().into() };
    let mut procs: Vec<Supervised> = Vec::new();
    let mut http_addr = String::new();
    let mut template: Option<NodeTemplate<'_>> = None;
    let result = async {
        let mut router = launch.start("router", None, Settings::Router(router_config(a, dir).into()), 4).await?;
        let (addr, internal) = (router.addrs[0].clone(), router.addrs[1].clone());
        http_addr = router.addrs[2].clone();
        router.pin();
        procs.push(router);
        let kvstore = if a.kvstore_budget_bytes > 0 && a.nodes("prefill", 0) > 0 {
            let c = children::kvstore_config(a, &internal);
            let mut p = launch.start("kvstore", None, Settings::KvStore(c.into()), 1).await?;
            p.pin();
            let kaddr = p.addrs[0].clone();
            procs.push(p);
            Some(kaddr)
        } else {
            None
        };
        template = Some(NodeTemplate { a, internal: internal.clone(), threads, kvstore: kvstore.clone(), launch: launch.clone() });
        let template = template.as_ref().expect("just set");
        for k in 0..a.models.len() {
            for role in ["prefill", "decode"] {
                for i in 0..a.nodes(role, k) {
                    procs.push(start_node(template, k, role, i).await?);
                }
            }
        }
        wait_ready(&internal, prefill, decode, Duration::from_secs(a.ready_timeout_s)).await?;
        println!(
            "pdmesh mesh ready: router on {addr} ({prefill} prefill, {decode} decode, {threads} threads each{}); Ctrl-C stops it",
            if kvstore.is_some() { ", a KV-store" } else { "" }
        );
        if a.models.len() > 1 {
            for (k, m) in a.models.iter().enumerate() {
                println!(
                    "  model {} ({} prefill, {} decode){}",
                    pdmesh_router::config::default_model_id(m),
                    a.nodes("prefill", k),
                    a.nodes("decode", k),
                    if k == 0 { ": the default" } else { "" }
                );
            }
        }
        println!("  each process's settings: {}/NAME.toml", configs.path().display());
        match dir {
            Some(d) => println!(
                "  mutual TLS between its processes and API keys on {addr}; `pdmesh generate` \
                 finds the credentials in {} (others: --tls-dir {} --tls-name {OPERATOR} \
                 --api-key $(cat {}))",
                d.display(),
                d.display(),
                d.join(API_KEY_FILE).display()
            ),
            None => println!("  --insecure: plaintext, no certificates, no API keys"),
        }
        match dir {
            Some(d) => println!(
                "  OpenAI API on https://{http_addr}/v1 (model {}); e.g. \
                 OPENAI_BASE_URL=https://{http_addr}/v1 OPENAI_API_KEY=$(cat {}) SSL_CERT_FILE={}",
                pdmesh_router::config::default_model_id(a.model()),
                d.join(API_KEY_FILE).display(),
                d.join("ca.pem").display()
            ),
            None => println!(
                "  OpenAI API on http://{http_addr}/v1 (model {})",
                pdmesh_router::config::default_model_id(a.model())
            ),
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        stop(procs.iter_mut().filter_map(|p| p.proc.take()).collect()).await;
        return Err(e);
    }
    // Run until a signal, restarting whatever dies on its own (but what was drained), and
    // with --autoscale following the planner.
    let template = template.expect("set before the mesh was ready");
    let supervise = async {
        let mut planned = Instant::now();
        loop {
            let now = Instant::now();
            for p in procs.iter_mut() {
                p.tend(now).await;
            }
            procs.retain(|p| !(p.retiring && p.proc.is_none()));
            if a.autoscale && now.duration_since(planned) >= AUTOSCALE_EVERY {
                planned = now;
                // The router's metrics port, as it announced it when it (re)started.
                let metrics = procs
                    .iter()
                    .find(|p| p.name == "router")
                    .and_then(|p| p.addrs.get(3))
                    .cloned()
                    .unwrap_or_default();
                // Each model's pools follow that model's planner.
                for (k, m) in a.models.iter().enumerate() {
                    let model = pdmesh_router::config::default_model_id(m);
                    match desired_nodes(&metrics, &model).await {
                        Ok(want) => autoscale(&template, &mut procs, k, want).await,
                        Err(e) => {
                            eprintln!("pdmesh: --autoscale: reading {model}'s planner: {e:#}")
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        () = pdmesh_cli::process::shutdown_signal(false) => {}
        () = supervise => {}
    }
    stop(procs.iter_mut().filter_map(|p| p.proc.take()).collect()).await;
    eprintln!("pdmesh: mesh stopped");
    Ok(())
}
