//! `pdmesh up`: a whole mesh on this machine, as separate processes — one router, `--prefill N`
//! prefill nodes and `--decode M` decode nodes — started from this same binary. It waits until
//! every node has registered with the router, prints the endpoint, and on Ctrl-C or SIGTERM
//! stops the children by closing their stdin (each exits cleanly when it closes, so none can
//! outlive this process), killing any that do not stop in time.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{ListNodesRequest, Role};

use pdmesh_cli::process::{Proc, spawn, stop};
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
    /// Mutual TLS between the mesh's processes, with a throwaway CA and certificates made
    /// now in a private temporary directory (removed when the mesh stops). A client then
    /// connects with `--tls-dir DIR --tls-name client`, printed once the mesh is ready.
    #[arg(long)]
    tls: bool,
    /// Give up if the mesh is not ready within this many seconds.
    #[arg(long, default_value_t = 120)]
    ready_timeout_s: u64,
}

pub fn run(a: UpArgs) -> anyhow::Result<()> {
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
    rt.block_on(up(a))
}

/// Makes the mesh's certificates: one per process, named as the process is, and `client`.
fn issue_certs(a: &UpArgs) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("pdmesh-tls-{}", std::process::id()));
    let mut names: Vec<(String, &str)> = vec![
        ("router".into(), "router"),
        ("kvstore".into(), "kvstore"),
        ("client".into(), "client"),
    ];
    names.extend((0..a.prefill).map(|i| (format!("prefill-{i}"), "prefill")));
    names.extend((0..a.decode).map(|i| (format!("decode-{i}"), "decode")));
    let refs: Vec<(&str, &str)> = names.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    pdmesh_common::tls::issue(&dir, &refs)?;
    pdmesh_common::tls::init(Some(pdmesh_common::tls::MeshTls::load(&dir, "client")?));
    Ok(dir)
}

async fn up(a: UpArgs) -> anyhow::Result<()> {
    let tls_dir = if a.tls { Some(issue_certs(&a)?) } else { None };
    let r = up_with(&a, tls_dir.as_deref()).await;
    if let Some(d) = &tls_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    r
}

async fn up_with(a: &UpArgs, tls_dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    // Each process gets its own certificate, named as it is.
    let tls = |name: &str| -> Vec<String> {
        tls_dir.map_or_else(Vec::new, |d| {
            vec!["--tls-dir".into(), d.display().to_string(), "--tls-name".into(), name.into()]
        })
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = a.threads.unwrap_or_else(|| (cores / (a.prefill + a.decode)).max(1));
    let model = a.model.display().to_string();
    let mut procs: Vec<Proc> = Vec::new();
    let result = async {
        let (router, addr) = spawn(
            "router",
            None,
            &[
                "router".into(),
                "--listen".into(),
                a.listen.clone(),
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
            .collect::<Vec<String>>(),
        )
        .await?;
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
            let (p, kaddr) = spawn("kvstore", None, &args).await?;
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
                    addr.clone(),
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
                let (p, _) = spawn(&name, cpus.as_deref(), &args).await?;
                procs.push(p);
            }
        }
        wait_ready(&addr, a.prefill, a.decode, Duration::from_secs(a.ready_timeout_s)).await?;
        println!(
            "pdmesh mesh ready: router on {addr} ({} prefill, {} decode, {threads} threads each{}); Ctrl-C stops it",
            a.prefill,
            a.decode,
            if kvstore.is_some() { ", a KV-store" } else { "" }
        );
        if let Some(d) = tls_dir {
            println!(
                "  mutual TLS on every connection; clients: --tls-dir {} --tls-name client",
                d.display()
            );
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        stop(procs).await;
        return Err(e);
    }
    // Run until a signal, or until a child dies on its own (then the mesh is broken: stop).
    let died = async {
        loop {
            for p in procs.iter_mut() {
                if let Some(why) = p.exited() {
                    return why;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let outcome = tokio::select! {
        () = pdmesh_cli::process::shutdown_signal(false) => None,
        d = died => Some(d),
    };
    stop(procs).await;
    match outcome {
        None => {
            eprintln!("pdmesh: mesh stopped");
            Ok(())
        }
        Some(d) => bail!("{d}; stopped the mesh"),
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
