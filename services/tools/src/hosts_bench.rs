//! `pdmesh bench hosts`: disaggregation across hosts, against disaggregation on one host and
//! colocation, in one run. Each layout is a real mesh of `pdmesh` processes with mutual TLS:
//! - cross-host: router, prefill node and decode node each on a host of its own (network and
//!   IPC namespaces, `pdmesh_cli::netns`), the prefill and decode hosts' links shaped to
//!   `--link-mbit`, KV over UCX (TCP between the hosts) pushed layer by layer as it computes;
//!   once more with the whole prompt's KV pushed after its prefill (`--kv-push prompt`), the
//!   reference for how much of the transfer the layer-wise push hides;
//! - same-host: the three on this host, KV through the decode node's pool mapped by the
//!   prefill node;
//! - colocated: router and one decode node that prefills prompts itself.
//!
//! Every layout's mesh runs at once; for each model and prompt length, requests go one at a
//! time in rounds where each layout serves the same prompt in turn (distinct random prompts
//! across rounds, so no prefix cache helps; the first round warms up), so a machine whose
//! speed drifts slows every layout alike. Medians of time to first token, inter-token
//! latency and the exposed transfer (`transfer_ms`: end of prefill to the KV complete on the
//! decode node) are reported, with cross-host TTFT over same-host TTFT and the share of the
//! transfer the layer-wise push hid (1 − exposed / exposed with `--kv-push prompt`). Needs
//! root.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use pdmesh_cli::netns::Netns;
use pdmesh_cli::process::{Proc, spawn_under};
use pdmesh_common::tls::{MeshRole, MeshTls};
use rand::SeedableRng;
use serde::Serialize;

use crate::mesh_bench::{Client, Sample};

#[derive(Debug, Args)]
pub struct HostsBenchArgs {
    /// A GGUF to serve (repeat for several; each is measured in every layout).
    #[arg(long = "model", default_value = pdmesh_engine::DEFAULT_MODEL_PATH)]
    models: Vec<PathBuf>,
    /// Prompt lengths, in tokens (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    prompt_tokens: Vec<usize>,
    /// Timed requests per model, layout and prompt length (after one warm-up).
    #[arg(long, default_value_t = 5)]
    requests: usize,
    /// Tokens each request generates (its inter-token latency is measured over them).
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// The cross-host links' rate, Mbit/s (0: unshaped).
    #[arg(long, default_value_t = 10_000)]
    link_mbit: u64,
    /// Compute threads per node.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Layout {
    CrossHost,
    /// Cross-host with the whole prompt's KV pushed after its prefill: nothing hidden.
    CrossHostPrompt,
    SameHost,
    Colocated,
}

impl Layout {
    const ALL: [Layout; 4] =
        [Layout::CrossHost, Layout::CrossHostPrompt, Layout::SameHost, Layout::Colocated];

    fn name(self) -> &'static str {
        match self {
            Layout::CrossHost => "cross-host",
            Layout::CrossHostPrompt => "cross-host, kv-push prompt",
            Layout::SameHost => "same-host",
            Layout::Colocated => "colocated",
        }
    }
}

#[derive(Debug, Serialize)]
struct Row {
    model: String,
    prompt_tokens: usize,
    layout: Layout,
    ttft_ms: f64,
    itl_ms: f64,
    transfer_ms: f64,
    kv_transport: String,
    failed: usize,
}

/// The certificates and keys every mesh of the run shares (this process's TLS is set once).
struct Pki {
    dir: tempfile::TempDir,
    key: String,
}

fn pki() -> anyhow::Result<Pki> {
    let dir = tempfile::tempdir().context("a directory for the bench's keys")?;
    pdmesh_common::tls::issue(
        dir.path(),
        &[
            ("router", MeshRole::Router),
            ("prefill-0", MeshRole::Prefill),
            ("decode-0", MeshRole::Decode),
            ("bench", MeshRole::Admin),
        ],
    )?;
    std::fs::write(dir.path().join("seal.key"), pdmesh_kv_ucx::new_seal_key())?;
    let tenant = pdmesh_common::apikey::Tenant {
        tenant: "bench".into(),
        max_in_flight: None,
        cache_group: None,
        kv_policy: None,
        default_model: None,
    };
    let key = pdmesh_common::apikey::add(&dir.path().join("api-keys.toml"), tenant)?;
    pdmesh_common::tls::init(Some(MeshTls::load(dir.path(), "bench")?));
    Ok(Pki { dir, key })
}

/// One layout's processes (killed on drop), and its hosts (removed after them).
struct Mesh {
    _procs: Vec<Proc>,
    router: String,
    _hosts: Option<Netns>,
}

async fn start(a: &HostsBenchArgs, pki: &Pki, model: &str, layout: Layout) -> anyhow::Result<Mesh> {
    let cross = matches!(layout, Layout::CrossHost | Layout::CrossHostPrompt);
    let hosts = if cross {
        let h = Netns::new(&["router", "prefill", "decode"])
            .map_err(|e| anyhow::anyhow!("making the hosts (needs root and iproute2): {e}"))?;
        if a.link_mbit > 0 {
            for n in ["prefill", "decode"] {
                h.shape(n, Some(a.link_mbit)).map_err(anyhow::Error::msg)?;
            }
        }
        Some(h)
    } else {
        None
    };
    let place = |name: &str| -> (Vec<String>, String) {
        match hosts.as_ref().and_then(|h| Some((h.command_prefix(name, false)?, h.host(name)?.1))) {
            Some((prefix, ip)) => (prefix, format!("{ip}:0")),
            None => (Vec::new(), "127.0.0.1:0".into()),
        }
    };
    let dir = pki.dir.path().display().to_string();
    let tls = |name: &str| {
        let seal = pki.dir.path().join("seal.key").display().to_string();
        ["--tls-dir", &dir, "--tls-name", name, "--seal-key", &seal].map(String::from).to_vec()
    };
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<String>>();
    let mut procs = Vec::new();
    let (prefix, listen) = place("router");
    let keys = pki.dir.path().join("api-keys.toml").display().to_string();
    let mut args = strings(&["router", "--listen", &listen, "--internal-listen", &listen]);
    args.extend(strings(&["--model", model, "--api-keys", &keys]));
    args.extend(tls("router"));
    let (p, addrs) = spawn_under("router", &prefix, &args, 2).await?;
    procs.push(p);
    let (router, internal) = (addrs[0].clone(), addrs[1].clone());
    let threads = a.threads.to_string();
    let node = |role: &str, name: &str| {
        let (prefix, listen) = place(if role == "prefill" { "prefill" } else { "decode" });
        let mut args = strings(&[role, "--listen", &listen, "--router", &internal]);
        args.extend(strings(&["--node-id", name, "--model", model, "--threads", &threads]));
        args.extend(tls(name));
        (prefix, args)
    };
    if layout != Layout::Colocated {
        let (prefix, mut args) = node("prefill", "prefill-0");
        let push = if layout == Layout::CrossHostPrompt { "prompt" } else { "layer" };
        args.extend(strings(&["--kv-push", push]));
        procs.push(spawn_under("prefill-0", &prefix, &args, 1).await?.0);
    }
    let (prefix, args) = node("decode", "decode-0");
    procs.push(spawn_under("decode-0", &prefix, &args, 1).await?.0);
    Ok(Mesh { _procs: procs, router, _hosts: hosts })
}

/// The medians of `samples`: TTFT, ITL, exposed transfer.
fn medians(samples: &[Sample]) -> (f64, f64, f64) {
    let med = |v: Vec<f64>| crate::mesh_bench::percentile(&v, 50.0);
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    (
        med(ok.iter().map(|s| s.ttft_ms).collect()),
        med(ok.iter().flat_map(|s| s.itl_ms.iter().copied()).collect()),
        med(ok.iter().map(|s| s.transfer_ms).collect()),
    )
}

/// Waits until `layout`'s mesh serves: its nodes register on their own, and the first
/// request that succeeds says they have.
async fn ready(
    client: &pdmesh_common::apikey::GenerationClient,
    layout: Layout,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let s = crate::mesh_bench::one(Client::Grpc(client.clone()), vec![300; 8], 1, false).await;
        if s.ok {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("{}: the mesh did not serve within 60 s: {:?}", layout.name(), s.error);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every layout's mesh up at once, then rounds in which each layout serves the same prompt
/// in turn (the first to go rotating): a machine whose speed drifts — a shared VM — then
/// slows every layout alike instead of whichever ran last. Idle meshes only heartbeat.
async fn measure(
    a: &HostsBenchArgs,
    pki: &Pki,
    model: &std::path::Path,
    started: Instant,
) -> anyhow::Result<Vec<Row>> {
    let name = model.display().to_string();
    let mut meshes = Vec::new();
    for layout in Layout::ALL {
        let mesh = start(a, pki, &name, layout).await?;
        let client = pdmesh_cli::client::connect(&mesh.router, Some(&pki.key)).await?;
        ready(&client, layout).await?;
        meshes.push((layout, mesh, client));
    }
    let mut rows = Vec::new();
    for &n in &a.prompt_tokens {
        eprintln!("{name}: {n}-token prompts ({:.0} s in)", started.elapsed().as_secs_f64());
        // The same prompts in every layout; none twice in one.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(n as u64);
        let mut samples: Vec<Vec<Sample>> = meshes.iter().map(|_| Vec::new()).collect();
        for i in 0..=a.requests {
            let ids = crate::mesh_bench::prompt(&mut rng, n);
            for j in 0..meshes.len() {
                let k = (i + j) % meshes.len();
                let client = Client::Grpc(meshes[k].2.clone());
                let s = crate::mesh_bench::one(client, ids.clone(), a.max_tokens, false).await;
                // The first round warms every mesh up.
                if i > 0 {
                    samples[k].push(s);
                }
            }
        }
        for ((layout, _, _), samples) in meshes.iter().zip(&samples) {
            let (ttft_ms, itl_ms, transfer_ms) = medians(samples);
            let failed = samples.iter().filter(|s| !s.ok).count();
            if let Some(e) = samples.iter().find_map(|s| s.error.clone()) {
                eprintln!("{} {n}: {failed} failed, e.g. {e}", layout.name());
            }
            let kv_transport = samples.iter().find(|s| s.ok).map(|s| s.kv_transport.clone());
            rows.push(Row {
                model: name.clone(),
                prompt_tokens: n,
                layout: *layout,
                ttft_ms,
                itl_ms,
                transfer_ms,
                kv_transport: kv_transport.unwrap_or_default(),
                failed,
            });
        }
    }
    Ok(rows)
}

pub fn run(a: HostsBenchArgs) -> anyhow::Result<()> {
    if a.requests == 0 || a.max_tokens < 2 || a.prompt_tokens.contains(&0) {
        bail!("--requests must be at least 1, --max-tokens at least 2, prompts not empty");
    }
    for m in &a.models {
        if !m.exists() {
            bail!("model file {} not found", m.display());
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let pki = pki()?;
    let mut rows = Vec::new();
    let started = Instant::now();
    for m in &a.models {
        rows.extend(rt.block_on(measure(&a, &pki, m, started))?);
    }
    if a.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    let link = if a.link_mbit > 0 {
        format!("{} Gbit/s", a.link_mbit as f64 / 1e3)
    } else {
        "unshaped".into()
    };
    println!(
        "Disaggregation across hosts (links {link}) vs on one host vs colocated: medians of {} \
         requests, {} output tokens, {} thread(s) per node",
        a.requests, a.max_tokens, a.threads
    );
    println!(
        "{:<40} {:>7} {:<28} {:>10} {:>9} {:>12} {:<6}",
        "model", "prompt", "layout", "TTFT ms", "ITL ms", "exposed KV", "via"
    );
    for r in &rows {
        let model = r.model.rsplit('/').next().unwrap_or(&r.model);
        println!(
            "{model:<40} {:>7} {:<28} {:>10.1} {:>9.2} {:>12.1} {:<6}{}",
            r.prompt_tokens,
            r.layout.name(),
            r.ttft_ms,
            r.itl_ms,
            r.transfer_ms,
            r.kv_transport,
            if r.failed > 0 { format!(" ({} failed)", r.failed) } else { String::new() }
        );
    }
    let find = |m: &str, n: usize, l: Layout| {
        rows.iter().find(|r| r.model == m && r.prompt_tokens == n && r.layout == l)
    };
    for m in &a.models {
        let m = m.display().to_string();
        for &n in &a.prompt_tokens {
            let (Some(x), Some(xp), Some(s)) = (
                find(&m, n, Layout::CrossHost),
                find(&m, n, Layout::CrossHostPrompt),
                find(&m, n, Layout::SameHost),
            ) else {
                continue;
            };
            let hidden =
                if xp.transfer_ms > 0.0 { 1.0 - x.transfer_ms / xp.transfer_ms } else { f64::NAN };
            println!(
                "{} {n}: cross-host TTFT / same-host {:.3}; layer-wise push hid {:.0}% of the transfer \
                 ({:.1} of {:.1} ms exposed)",
                m.rsplit('/').next().unwrap_or(&m),
                x.ttft_ms / s.ttft_ms,
                hidden * 100.0,
                x.transfer_ms,
                xp.transfer_ms
            );
        }
    }
    Ok(())
}
