//! `pdmesh up`: a whole mesh on this machine, as separate processes — one router, `--prefill N`
//! prefill nodes and `--decode M` decode nodes — started from this same binary. It waits until
//! every node has registered with the router, prints the endpoint, and supervises the mesh as an
//! orchestrator would: a process that dies is restarted (with back-off, on the same addresses
//! where others dial it) while the rest keep serving. On Ctrl-C or SIGTERM it stops the
//! children by closing their stdin (each exits cleanly when it closes, so none can outlive this
//! process), killing any that do not stop in time.
//!
//! The mesh runs as production does: mutual TLS between its processes under a throwaway CA,
//! and an API key for the public API, all made now in a private directory named after the
//! router's address (where `pdmesh generate` finds them) and removed when the mesh stops.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{ListNodesRequest, Role};

use pdmesh_cli::client::{API_KEY_FILE, KEY_RING_FILE, OPERATOR};
use pdmesh_cli::process::{Proc, spawn_announcing, stop};
use pdmesh_kv_transfer::{PushMode, TransportKind};
use pdmesh_router::placement::PrefillPolicy;

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Prefill nodes (0: decode nodes prefill prompts themselves).
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode nodes (at least 1).
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Where the router listens.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: String,
    /// A GGUF model (llama, qwen2 or qwen3 architecture).
    #[arg(long, env = "PDMESH_MODEL", default_value = pdmesh_engine::DEFAULT_MODEL_PATH)]
    model: PathBuf,
    /// Compute threads per node (default: the machine's cores shared among the nodes).
    #[arg(long)]
    threads: Option<usize>,
    /// KV blocks per decode node.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Tokens per KV block on every node and the KV-store (default 16). Also the unit the
    /// prefix cache shares.
    #[arg(long)]
    block_size: Option<usize>,
    /// Prompts shorter than this are prefilled on the decode node (0 = never).
    #[arg(long, default_value_t = 0)]
    colocate_below_tokens: usize,
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
    #[arg(long, default_value_t = 1 << 30)]
    kvstore_budget_bytes: u64,
    /// How the router chooses prefill nodes: prefix-aware, least-load or round-robin.
    #[arg(long)]
    prefill_policy: Option<PrefillPolicy>,
    /// Bytes of recent KV blocks each prefill node keeps itself (0 = none; default 128 MiB).
    #[arg(long, value_name = "BYTES")]
    cache_bytes: Option<u64>,
    /// Give up if the mesh is not ready within this many seconds.
    #[arg(long, default_value_t = 120)]
    ready_timeout_s: u64,
}

pub fn run(a: UpArgs, insecure: bool) -> anyhow::Result<()> {
    if a.decode == 0 {
        bail!("--decode must be at least 1: decode nodes serve every request");
    }
    if !a.model.exists() {
        bail!(
            "model file {} not found: run `just fetch-model` (or pass --model PATH)",
            a.model.display()
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    if insecure {
        pdmesh_common::tls::init(None);
        return rt.block_on(up_with(&a, None));
    }
    let dir = pdmesh_cli::client::local_mesh_dir(&a.listen);
    issue_credentials(&a, &dir)?;
    let r = rt.block_on(up_with(&a, Some(&dir)));
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// The mesh's UCX seal key, in the credentials directory.
const SEAL_KEY_FILE: &str = "mesh-seal.key";

/// Makes the mesh's credentials in `dir`: a CA, one certificate per process named as the
/// process is, the operator's, the operator's API key and the UCX seal key.
fn issue_credentials(a: &UpArgs, dir: &Path) -> anyhow::Result<()> {
    use pdmesh_common::tls::{Ca, MeshRole};
    // Whatever an earlier mesh at this address left (it was killed) is stale.
    let _ = std::fs::remove_dir_all(dir);
    let ca = Ca::generate()?;
    // The CA's key is not kept: no one adds processes to a throwaway mesh.
    ca.write(dir, false)?;
    let mut names: Vec<(String, MeshRole)> = vec![
        ("router".into(), MeshRole::Router),
        ("kvstore".into(), MeshRole::KvStore),
        (OPERATOR.into(), MeshRole::Admin),
    ];
    names.extend((0..a.prefill).map(|i| (format!("prefill-{i}"), MeshRole::Prefill)));
    names.extend((0..a.decode).map(|i| (format!("decode-{i}"), MeshRole::Decode)));
    for (n, r) in &names {
        ca.issue(dir, n, *r)?;
    }
    let operator = pdmesh_common::apikey::Tenant {
        tenant: OPERATOR.into(),
        max_in_flight: None,
        cache_group: None,
    };
    let key = pdmesh_common::apikey::add(&dir.join(KEY_RING_FILE), operator)?;
    write_private(&dir.join(API_KEY_FILE), &key)?;
    write_private(&dir.join(SEAL_KEY_FILE), &pdmesh_kv_transfer::ucx::new_seal_key())?;
    pdmesh_common::tls::init(Some(pdmesh_common::tls::MeshTls::load(dir, OPERATOR)?));
    Ok(())
}

fn write_private(path: &Path, data: &str) -> anyhow::Result<()> {
    pdmesh_common::config::write_private(path, data.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

async fn up_with(a: &UpArgs, dir: Option<&Path>) -> anyhow::Result<()> {
    // Each process gets its own certificate, named as it is; or all run --insecure.
    let tls = |name: &str| -> Vec<String> {
        match dir {
            Some(d) => vec![
                "--tls-dir".into(),
                d.display().to_string(),
                "--tls-name".into(),
                name.into(),
                "--seal-key".into(),
                d.join(SEAL_KEY_FILE).display().to_string(),
            ],
            None => vec!["--insecure".into()],
        }
    };
    let keys = match dir {
        Some(d) => vec!["--api-keys".into(), d.join(KEY_RING_FILE).display().to_string()],
        None => vec!["--allow-anonymous".into()],
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = a.threads.unwrap_or_else(|| (cores / (a.prefill + a.decode)).max(1));
    let model = a.model.display().to_string();
    let mut procs: Vec<Supervised> = Vec::new();
    let result = async {
        let mut router = Supervised::start(
            "router",
            None,
            [
                "router".into(),
                "--listen".into(),
                a.listen.clone(),
                "--internal-listen".into(),
                "127.0.0.1:0".into(),
                "--model".into(),
                model.clone(),
                "--colocate-below-tokens".into(),
                a.colocate_below_tokens.to_string(),
                "--metrics-listen".into(),
                "127.0.0.1:0".into(),
            ]
            .into_iter()
            .chain(a.prefill_policy.iter().flat_map(|p| ["--prefill-policy".into(), p.to_string()]))
            .chain(tls("router"))
            .chain(keys)
            .collect::<Vec<String>>(),
            2,
        )
        .await?;
        let (addr, internal) = (router.addrs[0].clone(), router.addrs[1].clone());
        // Restarted, it must be where clients and nodes already dial it.
        router.pin("--listen", &addr);
        router.pin("--internal-listen", &internal);
        procs.push(router);
        let kvstore = if a.kvstore_budget_bytes > 0 && a.prefill > 0 {
            let args: Vec<String> = [
                "kvstore".to_string(),
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--model".into(),
                model.clone(),
                "--budget-bytes".into(),
                a.kvstore_budget_bytes.to_string(),
                "--metrics-listen".into(),
                "127.0.0.1:0".into(),
            ]
            .into_iter()
            .chain(a.block_size.iter().flat_map(|b| ["--block-size".into(), b.to_string()]))
            .chain(a.kv_transport.iter().flat_map(|t| ["--kv-transport".into(), t.to_string()]))
            .chain(tls("kvstore"))
            .collect::<Vec<String>>();
            let mut p = Supervised::start("kvstore", None, args, 1).await?;
            let kaddr = p.addrs[0].clone();
            p.pin("--listen", &kaddr);
            procs.push(p);
            Some(kaddr)
        } else {
            None
        };
        for (role, n, cpus) in [("prefill", a.prefill, &a.prefill_cpus), ("decode", a.decode, &a.decode_cpus)] {
            for i in 0..n {
                let name = format!("{role}-{i}");
                let mut args = vec![
                    role.to_string(),
                    "--listen".into(),
                    "127.0.0.1:0".into(),
                    "--router".into(),
                    internal.clone(),
                    "--node-id".into(),
                    name.clone(),
                    "--model".into(),
                    model.clone(),
                    "--threads".into(),
                    threads.to_string(),
                    "--metrics-listen".into(),
                    "127.0.0.1:0".into(),
                ];
                if let Some(b) = a.block_size {
                    args.extend(["--block-size".into(), b.to_string()]);
                }
                if role == "decode"
                    && let Some(b) = a.kv_blocks
                {
                    args.extend(["--kv-blocks".into(), b.to_string()]);
                }
                if let Some(t) = &a.kv_transport {
                    args.extend(["--kv-transport".into(), t.to_string()]);
                }
                if role == "prefill"
                    && let Some(p) = &a.kv_push
                {
                    args.extend(["--kv-push".into(), p.to_string()]);
                }
                if role == "prefill"
                    && let Some(b) = a.cache_bytes
                {
                    args.extend(["--cache-bytes".into(), b.to_string()]);
                }
                if role == "prefill"
                    && let Some(k) = &kvstore
                {
                    args.extend(["--kvstore".into(), k.clone()]);
                }
                args.extend(tls(&name));
                procs.push(Supervised::start(&name, cpus.clone(), args, 1).await?);
            }
        }
        wait_ready(&internal, a.prefill, a.decode, Duration::from_secs(a.ready_timeout_s)).await?;
        println!(
            "pdmesh mesh ready: router on {addr} ({} prefill, {} decode, {threads} threads each{}); Ctrl-C stops it",
            a.prefill,
            a.decode,
            if kvstore.is_some() { ", a KV-store" } else { "" }
        );
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
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        stop(procs.iter_mut().filter_map(|p| p.proc.take()).collect()).await;
        return Err(e);
    }
    // Run until a signal, restarting whatever dies on its own.
    let supervise = async {
        loop {
            let now = Instant::now();
            for p in procs.iter_mut() {
                p.tend(now).await;
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

/// First pause before restarting a process that died; it doubles with each quick death.
const RESTART_BACKOFF: Duration = Duration::from_millis(500);
/// The longest pause between restarts.
const MAX_RESTART_BACKOFF: Duration = Duration::from_secs(30);
/// A process that ran this long before dying is restarted without delay.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// One child of the mesh, restarted when it dies.
struct Supervised {
    name: String,
    cpus: Option<String>,
    args: Vec<String>,
    /// Addresses it announces (the router: public and internal).
    announces: usize,
    /// What it announced when it last started.
    addrs: Vec<String>,
    proc: Option<Proc>,
    started: Instant,
    /// Quick deaths in a row.
    deaths: u32,
    /// When it is to be started again, after a death.
    due: Option<Instant>,
}

impl Supervised {
    async fn start(
        name: &str,
        cpus: Option<String>,
        args: Vec<String>,
        announces: usize,
    ) -> anyhow::Result<Self> {
        let (proc, addrs) = spawn_announcing(name, cpus.as_deref(), &args, announces).await?;
        Ok(Self {
            name: name.to_string(),
            cpus,
            args,
            announces,
            addrs,
            proc: Some(proc),
            started: Instant::now(),
            deaths: 0,
            due: None,
        })
    }

    /// Sets `flag`'s value for later starts.
    fn pin(&mut self, flag: &str, value: &str) {
        if let Some(i) = self.args.iter().position(|a| a == flag) {
            self.args[i + 1] = value.to_string();
        }
    }

    /// Notices a death and schedules the restart; restarts when it is due.
    async fn tend(&mut self, now: Instant) {
        if let Some(why) = self.proc.as_mut().and_then(Proc::exited) {
            self.proc = None;
            self.deaths =
                if now.duration_since(self.started) >= HEALTHY_RUN { 0 } else { self.deaths + 1 };
            let wait = (RESTART_BACKOFF * 2u32.saturating_pow(self.deaths.saturating_sub(1)))
                .min(MAX_RESTART_BACKOFF);
            let wait = if self.deaths == 0 { Duration::ZERO } else { wait };
            eprintln!("pdmesh: {why}; restarting it in {wait:?}");
            self.due = Some(now + wait);
        }
        if self.due.is_some_and(|d| now >= d) {
            match spawn_announcing(&self.name, self.cpus.as_deref(), &self.args, self.announces)
                .await
            {
                Ok((proc, addrs)) => {
                    eprintln!("pdmesh: {} restarted on {}", self.name, addrs.join(", "));
                    self.proc = Some(proc);
                    self.addrs = addrs;
                    self.started = Instant::now();
                    self.due = None;
                }
                Err(e) => {
                    self.deaths += 1;
                    let wait = (RESTART_BACKOFF * 2u32.saturating_pow(self.deaths))
                        .min(MAX_RESTART_BACKOFF);
                    eprintln!("pdmesh: restarting {} failed: {e:#}; again in {wait:?}", self.name);
                    self.due = Some(Instant::now() + wait);
                }
            }
        }
    }
}

async fn wait_ready(
    addr: &str,
    prefill: usize,
    decode: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let until = Instant::now() + timeout;
    let mut last = String::from("router not reachable");
    while Instant::now() < until {
        let channel = async { pdmesh_common::tls::endpoint(addr)?.connect().await };
        if let Ok(ch) = channel.await
            && let Ok(r) = MembershipClient::new(ch).list_nodes(ListNodesRequest {}).await
        {
            let nodes = r.into_inner().nodes;
            let count = |role: Role| nodes.iter().filter(|n| n.role == role as i32).count();
            let (p, d) = (count(Role::Prefill), count(Role::Decode));
            if p >= prefill && d >= decode {
                return Ok(());
            }
            last = format!("{p}/{prefill} prefill and {d}/{decode} decode nodes registered");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("mesh not ready after {timeout:?}: {last}")
}
