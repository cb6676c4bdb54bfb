//! `pdmesh up`: a whole mesh on this machine, as separate processes — one router, `--prefill N`
//! prefill nodes and `--decode M` decode nodes — started from this same binary. It waits until
//! every node has registered with the router, prints the endpoint, and supervises the mesh as an
//! orchestrator would: a process that dies is restarted (with back-off, on the same addresses
//! where others dial it) while the rest keep serving. On Ctrl-C or SIGTERM it stops the
//! children by closing their stdin (each exits cleanly when it closes, so none can outlive this
//! process), killing any that do not stop in time.
//!
//! With `--autoscale` it follows the router's planner (`pdmesh_planner_desired_nodes`): it
//! starts a node when the planner wants more, and drains one (SIGTERM: its streams move to the
//! others with their KV) when it wants fewer, between the starting counts and `--max-*`.
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
    /// Where the router serves the OpenAI-compatible HTTP API (HTTPS under the mesh's CA,
    /// with the same API key).
    #[arg(long, default_value = "127.0.0.1:8000")]
    http_listen: String,
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
    /// KV element type on every node and the KV-store: f16 (default), f32, q8_0 (llama.cpp's
    /// 8-bit blocks with its Hadamard rotation: half of f16's KV memory and transfer bytes)
    /// or q8_0-norot.
    #[arg(long)]
    kv_dtype: Option<pdmesh_kernels::KvDtype>,
    /// Prompts shorter than this are prefilled on the decode node (0 = never).
    #[arg(long, default_value_t = 0)]
    colocate_below_tokens: usize,
    /// What prefill nodes compute on: cpu (default), cuda (the first GPU) or cuda-emu (see
    /// `pdmesh prefill --help`).
    #[arg(long)]
    prefill_backend: Option<pdmesh_engine::BackendName>,
    /// What decode nodes compute on: cpu (default), cuda or cuda-emu.
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
    /// Follow the router's planner: start nodes when the load needs more, drain nodes when it
    /// needs fewer (never below --prefill/--decode, never above --max-prefill/--max-decode).
    #[arg(long)]
    autoscale: bool,
    /// Most prefill nodes --autoscale runs.
    #[arg(long, default_value_t = 3)]
    max_prefill: usize,
    /// Most decode nodes --autoscale runs.
    #[arg(long, default_value_t = 3)]
    max_decode: usize,
    /// The planner's time-to-first-token objective, in ms (router default: 2000).
    #[arg(long)]
    ttft_slo_ms: Option<f64>,
    /// The planner's inter-token objective, in ms (router default: 100).
    #[arg(long)]
    itl_slo_ms: Option<f64>,
    /// Seconds of finished requests the planner plans on (router default: 30).
    #[arg(long)]
    planner_window_s: Option<u64>,
    /// Seconds the planner's need must stay lower before a pool shrinks (router default: 60).
    #[arg(long)]
    planner_cooldown_s: Option<u64>,
}

impl UpArgs {
    /// Most nodes of `role` this mesh may run.
    fn most(&self, role: &str) -> usize {
        match (role, self.autoscale) {
            ("prefill", true) => self.max_prefill.max(self.prefill),
            ("prefill", false) => self.prefill,
            (_, true) => self.max_decode.max(self.decode),
            (_, false) => self.decode,
        }
    }
}

pub fn run(a: UpArgs, insecure: bool) -> anyhow::Result<()> {
    if a.decode == 0 {
        bail!("--decode must be at least 1: decode nodes serve every request");
    }
    if a.autoscale && a.prefill == 0 {
        bail!("--autoscale needs --prefill of at least 1: it scales both pools");
    }
    if !a.model.exists() {
        bail!(
            "model file {} not found: run `just fetch-model` (or pass --model PATH)",
            a.model.display()
        );
    }
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
const SEAL_KEY_FILE: &str = "mesh-seal.key";

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
    names.extend((0..a.most("prefill")).map(|i| (format!("prefill-{i}"), MeshRole::Prefill)));
    names.extend((0..a.most("decode")).map(|i| (format!("decode-{i}"), MeshRole::Decode)));
    let issued = Issued { ca, names };
    issued.issue(dir)?;
    let operator = pdmesh_common::apikey::Tenant {
        tenant: OPERATOR.into(),
        max_in_flight: None,
        cache_group: None,
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
    let mut http_addr = String::new();
    let mut template: Option<NodeTemplate<'_>> = None;
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
                "--http-listen".into(),
                a.http_listen.clone(),
                "--model".into(),
                model.clone(),
                "--colocate-below-tokens".into(),
                a.colocate_below_tokens.to_string(),
                "--metrics-listen".into(),
                "127.0.0.1:0".into(),
                "--min-prefill".into(),
                a.prefill.max(1).to_string(),
                "--max-prefill".into(),
                a.most("prefill").max(1).to_string(),
                "--min-decode".into(),
                a.decode.to_string(),
                "--max-decode".into(),
                a.most("decode").to_string(),
            ]
            .into_iter()
            .chain(a.ttft_slo_ms.iter().flat_map(|v| ["--ttft-slo-ms".into(), v.to_string()]))
            .chain(a.itl_slo_ms.iter().flat_map(|v| ["--itl-slo-ms".into(), v.to_string()]))
            .chain(a.planner_window_s.iter().flat_map(|v| ["--planner-window-s".into(), v.to_string()]))
            .chain(a.planner_cooldown_s.iter().flat_map(|v| ["--planner-cooldown-s".into(), v.to_string()]))
            .chain(a.prefill_policy.iter().flat_map(|p| ["--prefill-policy".into(), p.to_string()]))
            .chain(tls("router"))
            .chain(keys)
            .collect::<Vec<String>>(),
            4,
        )
        .await?;
        let (addr, internal) = (router.addrs[0].clone(), router.addrs[1].clone());
        let http = router.addrs[2].clone();
        // Restarted, it must be where clients and nodes already dial it.
        router.pin("--listen", &addr);
        router.pin("--internal-listen", &internal);
        router.pin("--http-listen", &http);
        http_addr = http;
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
                "--router".into(),
                internal.clone(),
                // Its certificate's name: the router hears it only as that.
                "--node-id".into(),
                "kvstore".into(),
            ]
            .into_iter()
            .chain(a.block_size.iter().flat_map(|b| ["--block-size".into(), b.to_string()]))
            .chain(a.kv_dtype.iter().flat_map(|d| ["--kv-dtype".into(), d.name().to_string()]))
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
        template = Some(NodeTemplate {
            a,
            internal: internal.clone(),
            threads,
            kvstore: kvstore.clone(),
            tls_dir: dir.map(Path::to_path_buf),
        });
        let template = template.as_ref().expect("just set");
        for (role, n) in [("prefill", a.prefill), ("decode", a.decode)] {
            for i in 0..n {
                procs.push(start_node(template, role, i).await?);
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
        match dir {
            Some(d) => println!(
                "  OpenAI API on https://{http_addr}/v1 (model {}); e.g. \
                 OPENAI_BASE_URL=https://{http_addr}/v1 OPENAI_API_KEY=$(cat {}) SSL_CERT_FILE={}",
                pdmesh_router::config::default_model_id(&a.model),
                d.join(API_KEY_FILE).display(),
                d.join("ca.pem").display()
            ),
            None => println!(
                "  OpenAI API on http://{http_addr}/v1 (model {})",
                pdmesh_router::config::default_model_id(&a.model)
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
                let metrics =
                    procs.iter().find(|p| p.name == "router").and_then(|p| p.addrs.get(3));
                match desired_nodes(metrics.map_or("", String::as_str)).await {
                    Ok(want) => autoscale(&template, &mut procs, want).await,
                    Err(e) => eprintln!("pdmesh: --autoscale: reading the planner: {e:#}"),
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

/// How often --autoscale reads the planner's decision.
const AUTOSCALE_EVERY: Duration = Duration::from_secs(2);

/// What every node of the mesh is started with; `start_node` adds its name.
struct NodeTemplate<'a> {
    a: &'a UpArgs,
    internal: String,
    threads: usize,
    kvstore: Option<String>,
    tls_dir: Option<PathBuf>,
}

/// Starts node `i` of `role` under supervision.
async fn start_node(t: &NodeTemplate<'_>, role: &str, i: usize) -> anyhow::Result<Supervised> {
    let a = t.a;
    let name = format!("{role}-{i}");
    let mut args = vec![
        role.to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--router".into(),
        t.internal.clone(),
        "--node-id".into(),
        name.clone(),
        "--model".into(),
        a.model.display().to_string(),
        "--threads".into(),
        t.threads.to_string(),
        "--metrics-listen".into(),
        "127.0.0.1:0".into(),
    ];
    if let Some(b) = a.block_size {
        args.extend(["--block-size".into(), b.to_string()]);
    }
    if let Some(d) = a.kv_dtype {
        args.extend(["--kv-dtype".into(), d.name().to_string()]);
    }
    if let Some(tk) = &a.kv_transport {
        args.extend(["--kv-transport".into(), tk.to_string()]);
    }
    let backend = if role == "prefill" { a.prefill_backend } else { a.decode_backend };
    if let Some(b) = backend {
        args.extend(["--backend".into(), b.to_string()]);
    }
    let cpus = if role == "prefill" {
        if let Some(p) = &a.kv_push {
            args.extend(["--kv-push".into(), p.to_string()]);
        }
        if let Some(b) = a.cache_bytes {
            args.extend(["--cache-bytes".into(), b.to_string()]);
        }
        if let Some(k) = &t.kvstore {
            args.extend(["--kvstore".into(), k.clone()]);
        }
        a.prefill_cpus.clone()
    } else {
        if let Some(b) = a.kv_blocks {
            args.extend(["--kv-blocks".into(), b.to_string()]);
        }
        a.decode_cpus.clone()
    };
    match &t.tls_dir {
        Some(d) => args.extend([
            "--tls-dir".into(),
            d.display().to_string(),
            "--tls-name".into(),
            name.clone(),
            "--seal-key".into(),
            d.join(SEAL_KEY_FILE).display().to_string(),
        ]),
        None => args.push("--insecure".into()),
    }
    let mut node = Supervised::start(&name, cpus, args, 1).await?;
    node.role = Some(if role == "prefill" { Role::Prefill } else { Role::Decode });
    Ok(node)
}

/// The planner's `pdmesh_planner_desired_nodes` (prefill, decode), scraped from the router's
/// metrics endpoint (`http://ADDR/metrics`).
async fn desired_nodes(endpoint: &str) -> anyhow::Result<(usize, usize)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = endpoint.trim_start_matches("http://").trim_end_matches("/metrics");
    let body = tokio::time::timeout(Duration::from_secs(2), async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: router\r\n\r\n").await?;
        let mut body = String::new();
        tcp.read_to_string(&mut body).await?;
        anyhow::Ok(body)
    })
    .await
    .context("the router's metrics did not answer in 2 s")??;
    let gauge = |role: &str| -> anyhow::Result<usize> {
        let series = format!("pdmesh_planner_desired_nodes{{role=\"{role}\"}} ");
        let line = body
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .with_context(|| format!("no {series}yet"))?;
        Ok(line.trim().parse::<f64>()? as usize)
    };
    Ok((gauge("prefill")?, gauge("decode")?))
}

/// One step towards the planner's pools: a node started, or one drained, per role.
async fn autoscale(
    t: &NodeTemplate<'_>,
    procs: &mut Vec<Supervised>,
    (prefill, decode): (usize, usize),
) {
    let a = t.a;
    for (role, name, want, least) in
        [(Role::Prefill, "prefill", prefill, a.prefill), (Role::Decode, "decode", decode, a.decode)]
    {
        let want = want.clamp(least, a.most(name));
        let serving: Vec<usize> = (0..procs.len())
            .filter(|&i| procs[i].role == Some(role) && !procs[i].retiring)
            .collect();
        if want > serving.len() {
            // The lowest free name, so names (and their certificates) are reused.
            let taken = |i: usize| procs.iter().any(|p| p.name == format!("{name}-{i}"));
            let Some(i) = (0..a.most(name)).find(|&i| !taken(i)) else { continue };
            eprintln!("pdmesh: the planner wants {want} {name} nodes; starting {name}-{i}");
            match start_node(t, name, i).await {
                Ok(node) => procs.push(node),
                Err(e) => eprintln!("pdmesh: starting {name}-{i} failed: {e:#}"),
            }
        } else if want < serving.len() {
            let newest = *serving.last().expect("more serving than wanted");
            let p = &mut procs[newest];
            eprintln!("pdmesh: the planner wants {want} {name} nodes; draining {}", p.name);
            p.retire();
        }
    }
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
    /// A node's role (--autoscale counts them).
    role: Option<Role>,
    /// Drained on purpose: not restarted when it exits.
    retiring: bool,
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
            role: None,
            retiring: false,
        })
    }

    /// Drains it (SIGTERM: a decode node hands its streams to the others with their KV) and
    /// lets it go.
    fn retire(&mut self) {
        self.retiring = true;
        if let Some(p) = &self.proc {
            p.terminate();
        }
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
            if self.retiring {
                eprintln!("pdmesh: {why}, drained");
                return;
            }
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
        let channel = async {
            pdmesh_common::tls::endpoint(addr, pdmesh_common::tls::MeshRole::Router)?
                .connect()
                .await
        };
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
