//! `pdmesh bench kv`: how fast a prompt's KV moves into a decode node. It starts real decode
//! node processes, reserves room for a prompt of `--tokens` tokens, and pushes that many blocks
//! of KV into the reservation through the real transports, timing each transfer from opening it
//! to the decode node's commit: UCX as the nodes run it (on one host this process maps the
//! decode node's shared pool and copies in), UCX puts into a private pool (`--kv-shared-pool
//! false`, as between hosts), and the gRPC stream.
//! The reference is a plain memcpy of the same bytes in this process; a second reference moves
//! them through a bare loopback TCP socket between two threads, the ceiling of any stream over
//! TCP on this host (the gRPC stream runs on one). Medians of `--reps`
//! after one verified warm-up transfer per transport (every block checksummed by the decode
//! node, so a transport that moves the wrong bytes fails the bench).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use pdmesh_kv_transfer::{
    AutoTransport, Fabric, KvPiece, KvTransport, TransferStats, TransportKind,
};
use pdmesh_kv_types::block_checksum;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::{ReleaseRequest, ReserveRequest, StatsRequest};
use serde::Serialize;

use pdmesh_common::tls::{MeshRole, MeshTls};

use crate::bench::median;

#[derive(Debug, Args)]
pub struct KvBenchArgs {
    /// Prompt length whose KV is moved, in tokens.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// Timed transfers per transport; the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Blocks per piece handed to the transport: what a prefill node sends per message
    /// (its `blocks_per_message`, 4 unless configured).
    #[arg(long, default_value_t = 4)]
    blocks_per_piece: usize,
    /// A llama-architecture GGUF: the decode node loads it, which fixes the KV layout.
    #[arg(long, env = "PDMESH_MODEL", default_value = pdmesh_engine::DEFAULT_MODEL_PATH)]
    model: std::path::PathBuf,
    /// The decode node's KV element type (f16, f32, q8_0, q8_0-norot): q8_0 blocks are 53% of
    /// f16's bytes, so the same prompt moves that much less.
    #[arg(long, default_value = "f16")]
    kv_dtype: pdmesh_kv_types::KvDtype,
    /// The decode nodes' backend (cpu, cuda, cuda-emu): with cuda their pool is GPU memory,
    /// which UCX reaches through host staging blocks when it has no CUDA transport.
    #[arg(long, default_value = "cpu")]
    decode_backend: String,
    /// The decode nodes' `--kv-staging` (auto, direct, staged): `staged` on a CPU pool shows
    /// what the staging copy costs.
    #[arg(long, default_value = "auto")]
    kv_staging: pdmesh_kv_transfer::KvStaging,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Time only these paths (ucx, ucx-put, grpc; comma-separated); the rest print NaN (null
    /// in --json).
    #[arg(long, value_delimiter = ',', default_value = "ucx,ucx-put,grpc")]
    paths: Vec<String>,
    /// Between two hosts: the decode node runs in a network namespace of its own (and IPC
    /// namespace: nothing shared but the link), this process is the other host, and the
    /// veth between them is shaped with `tc tbf` to each of --link-mbit in turn. Times the
    /// paths that cross a network (ucx-put, grpc) against the link rate. Needs root.
    #[arg(long)]
    hosts: bool,
    /// With --hosts: the link rates, Mbit/s (0 = unshaped).
    #[arg(long, value_delimiter = ',', default_value = "0,25000,10000,1000")]
    link_mbit: Vec<u64>,
}

/// One path at one link rate (`--hosts`).
#[derive(Debug, Serialize)]
struct LinkRow {
    /// None: unshaped.
    link_mbit: Option<u64>,
    path: String,
    ms: f64,
    gbps: f64,
    /// Of the link rate (None unshaped).
    vs_link: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    kv_dtype: String,
    tokens: usize,
    blocks: usize,
    bytes: u64,
    reps: usize,
    /// UCX as the nodes run it: on one host, a memcpy into the decode node's shared pool.
    ucx_ms: f64,
    /// UCX puts into a decode node whose pool is private (`--kv-shared-pool false`): how KV
    /// moves between hosts, and moved on one host before the shared pool.
    ucx_put_ms: f64,
    grpc_ms: f64,
    memcpy_ms: f64,
    /// The bytes through a bare loopback TCP socket, no framing and no copies of our own.
    tcp_ms: f64,
    ucx_gbps: f64,
    ucx_put_gbps: f64,
    grpc_gbps: f64,
    memcpy_gbps: f64,
    tcp_gbps: f64,
    ucx_vs_memcpy: f64,
    ucx_put_vs_memcpy: f64,
    grpc_vs_memcpy: f64,
    tcp_vs_memcpy: f64,
    /// How close the gRPC stream comes to the socket it runs on (1 = no cost of its own).
    grpc_vs_tcp: f64,
    /// What computes on the decode nodes, and how UCX writers reach each one's pool
    /// (`kv_path`: shared pool, then private).
    decode_backend: String,
    ucx_kv_path: String,
    ucx_put_kv_path: String,
    /// Of the UCX times, the mean copy out of staging blocks into the pool per transfer
    /// (0 when the pool takes puts directly).
    ucx_unstage_ms: f64,
    ucx_put_unstage_ms: f64,
    /// UCX_TLS as set for this run ("" = UCX's default choice).
    ucx_tls: String,
    /// Whether the gRPC stream ran over mutual TLS (not with --insecure).
    tls: bool,
}

pub fn run(a: KvBenchArgs, insecure: bool) -> anyhow::Result<()> {
    if a.reps == 0 || a.blocks_per_piece == 0 {
        bail!("--reps and --blocks-per-piece must be at least 1");
    }
    for p in &a.paths {
        if !["ucx", "ucx-put", "grpc"].contains(&p.as_str()) {
            bail!("--paths: unknown path {p:?} (ucx, ucx-put, grpc)");
        }
    }
    if !a.model.exists() {
        bail!("model file {} not found: run `just fetch-model`", a.model.display());
    }
    if a.hosts && std::env::var_os("UCX_TCP_BRIDGE_ENABLE").is_none() {
        // This process is the sending host, and its NIC to the decode host is the bridge
        // the hosts hang off, which UCX leaves out unless told.
        // SAFETY: no other thread exists yet (the runtime and UCX start below).
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var("UCX_TCP_BRIDGE_ENABLE", "y")
        };
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    if a.hosts {
        return rt.block_on(across_hosts(&a, insecure));
    }
    let report = rt.block_on(bench(&a, insecure))?;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} KV of {} tokens: {} blocks, {:.1} MB, median of {} transfers into a decode node process{}",
            report.kv_dtype,
            report.tokens,
            report.blocks,
            report.bytes as f64 / 1e6,
            report.reps,
            if report.tls { "" } else { " (plaintext: --insecure)" }
        );
        println!("{:<8} {:>10} {:>10} {:>12}", "path", "ms", "GB/s", "vs memcpy");
        for (name, ms, gbps, r) in [
            ("memcpy", report.memcpy_ms, report.memcpy_gbps, 1.0),
            ("tcp", report.tcp_ms, report.tcp_gbps, report.tcp_vs_memcpy),
            ("ucx", report.ucx_ms, report.ucx_gbps, report.ucx_vs_memcpy),
            ("ucx-put", report.ucx_put_ms, report.ucx_put_gbps, report.ucx_put_vs_memcpy),
            ("grpc", report.grpc_ms, report.grpc_gbps, report.grpc_vs_memcpy),
        ] {
            println!("{name:<8} {ms:>10.2} {gbps:>10.2} {r:>12.3}");
        }
        println!(
            "(tcp: a bare loopback socket between two threads, the ceiling of any TCP stream; \
             grpc reaches {:.2} of it)",
            report.grpc_vs_tcp
        );
        println!(
            "decode nodes on {}: ucx into {} (unstaging {:.2} ms a transfer), ucx-put into {} \
             ({:.2} ms)",
            report.decode_backend,
            report.ucx_kv_path,
            report.ucx_unstage_ms,
            report.ucx_put_kv_path,
            report.ucx_put_unstage_ms
        );
    }
    Ok(())
}

/// The decode nodes under test and the KV to move into them.
struct Setup {
    nodes: Vec<(pdmesh_cli::process::Proc, DecodeClient<tonic::transport::Channel>)>,
    /// Holds the certificates and the seal key for the run.
    _certs: tempfile::TempDir,
    blocks: usize,
    bpb: usize,
    bytes: u64,
    src: Bytes,
    checksums: Vec<u64>,
}

/// Starts a decode node for each of `shared` (whether its pool is shared with writers on its
/// host), listening on `listen`, each run under `prefix` (a host's, or none), with this
/// process as the prefill node and router that use them: mutual TLS, or plaintext with
/// `insecure` (UCX moves KV outside TLS either way).
async fn setup(
    a: &KvBenchArgs,
    insecure: bool,
    prefix: &[String],
    listen: &str,
    shared: &[bool],
) -> anyhow::Result<Setup> {
    let model = a.model.display().to_string();
    let block_size = 16usize;
    let blocks = a.tokens.div_ceil(block_size);
    // Room for the prompt plus the one token a reservation must promise.
    let kv_blocks = (blocks + 2).to_string();
    let mut args: Vec<String> = [
        "decode",
        "--listen",
        listen,
        "--node-id",
        "bench-decode",
        "--model",
        &model,
        "--threads",
        "1",
        "--kv-transport",
        "ucx",
        "--kv-blocks",
        &kv_blocks,
        "--block-size",
        &block_size.to_string(),
        "--kv-dtype",
        a.kv_dtype.name(),
        "--backend",
        &a.decode_backend,
        "--kv-staging",
        a.kv_staging.name(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let certs = tempfile::tempdir().context("a directory for the bench's keys")?;
    // The router's certificate, which reserves and releases; none in plaintext.
    let router = if insecure {
        pdmesh_common::tls::init(None);
        args.push("--insecure".into());
        None
    } else {
        pdmesh_common::tls::issue(
            certs.path(),
            &[
                ("bench-decode", MeshRole::Decode),
                ("bench-prefill", MeshRole::Prefill),
                ("bench-router", MeshRole::Router),
            ],
        )?;
        pdmesh_common::tls::init(Some(MeshTls::load(certs.path(), "bench-prefill")?));
        let dir = certs.path().display().to_string();
        args.extend(["--tls-dir".into(), dir, "--tls-name".into(), "bench-decode".into()]);
        Some(MeshTls::load(certs.path(), "bench-router")?)
    };
    let seal = certs.path().join("seal.key");
    std::fs::write(&seal, pdmesh_kv_ucx::new_seal_key())?;
    let key = pdmesh_kv_ucx::read_seal_key(&seal).map_err(anyhow::Error::msg)?;
    pdmesh_kv_ucx::set_seal_key(&key);
    args.extend(["--seal-key".into(), seal.display().to_string()]);
    let mut nodes = Vec::new();
    for shared in shared {
        let mut args = args.clone();
        args.extend(["--kv-shared-pool".into(), shared.to_string()]);
        let (mut child, mut addrs) =
            pdmesh_cli::process::spawn_under("decode", prefix, &args, 1).await?;
        let addr = addrs.remove(0);
        let endpoint = match &router {
            Some(tls) => pdmesh_common::tls::endpoint_with(&addr, tls, MeshRole::Decode)?,
            None => pdmesh_common::tls::endpoint(&addr, MeshRole::Decode)?,
        };
        let channel = match endpoint.connect().await {
            Ok(c) => c,
            Err(e) => {
                // It listens before it loads its model: a node that cannot (no GPU for
                // `--decode-backend cuda`) exits right after, its reason on stderr above.
                for _ in 0..50 {
                    if let Some(how) = child.exited() {
                        bail!("{how} before serving (its log above says why)");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                return Err(e).with_context(|| format!("connecting to the decode node at {addr}"));
            }
        };
        nodes.push((child, DecodeClient::new(channel).max_decoding_message_size(64 << 20)));
    }
    let layout = nodes[0]
        .1
        .stats(StatsRequest {})
        .await?
        .into_inner()
        .layout
        .context("the decode node reports no KV layout")?;
    let bpb = pdmesh_proto::layout_from_wire(&layout)
        .map_err(anyhow::Error::msg)
        .context("the decode node's KV layout")?
        .bytes_per_block();
    let bytes = (blocks * bpb) as u64;

    // Deterministic, incompressible-looking KV.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let src: Vec<u8> = (0..blocks * bpb)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let src = Bytes::from(src);
    let checksums: Vec<u64> = src.chunks(bpb).map(block_checksum).collect();
    Ok(Setup { nodes, _certs: certs, blocks, bpb, bytes, src, checksums })
}

/// The median milliseconds of `--reps` transfers of the KV into decode node `node` by `path`
/// (`kind`), after one the decode node verifies.
async fn time_path(
    a: &KvBenchArgs,
    s: &mut Setup,
    path: &str,
    kind: TransportKind,
    node: usize,
) -> anyhow::Result<f64> {
    let (blocks, bpb, bytes) = (s.blocks, s.bpb, s.bytes);
    let client = &mut s.nodes[node].1;
    let fabric: Option<Arc<dyn Fabric>> = match kind {
        TransportKind::Grpc => None,
        _ => {
            let node = pdmesh_kv_ucx::UcxNode::start("bench-prefill").context("starting UCX")?;
            Some(Arc::new(pdmesh_kv_ucx::Ucx::new(node)))
        }
    };
    let transport =
        AutoTransport::new(kind.clone(), fabric.as_ref(), Arc::new(TransferStats::new()));
    let mut times = Vec::new();
    for rep in 0..a.reps + 1 {
        // The first transfer is verified by the decode node and not timed.
        let verify = rep == 0;
        let reserve = ReserveRequest {
            request_id: format!("bench-{kind}-{rep}"),
            prompt_tokens: a.tokens as u32,
            max_tokens: 1,
            lease_ms: 60_000,
            remote_kv: true,
            owner: String::new(),
            reserve_tokens: 0,
        };
        let target = client.reserve(reserve).await?.into_inner().target.context("no KV target")?;
        let t = Instant::now();
        let mut sink = transport.open(&target, "bench-prefill").await?;
        if sink.transport() != kind.name() {
            bail!("asked for {kind}, the transfer used {}", sink.transport());
        }
        if sink.mapped() != (path == "ucx") {
            bail!("path {path}: the decode node's shared pool mapped here is {}", sink.mapped());
        }
        for first in (0..blocks).step_by(a.blocks_per_piece) {
            let n = a.blocks_per_piece.min(blocks - first);
            let data = s.src.slice(first * bpb..(first + n) * bpb);
            sink.send(KvPiece { first_block: first as u32, layer: None, data }).await?;
        }
        let sums = if verify { s.checksums.clone() } else { Vec::new() };
        let done = sink.finish(blocks as u32, sums).await?;
        let elapsed = t.elapsed();
        if done.bytes < bytes || done.transport != kind.name() {
            bail!("{kind} moved {} of {bytes} bytes by {}", done.bytes, done.transport);
        }
        client.release(ReleaseRequest { reservation_id: target.reservation_id }).await?;
        if !verify {
            times.push(elapsed.as_secs_f64() * 1e3);
        }
    }
    // Let the endpoint close before the next transport starts.
    drop(transport);
    tokio::time::sleep(Duration::from_millis(50)).await;
    Ok(median(times))
}

/// `--hosts`: the crossing paths between this process and a decode node on a host of its
/// own, at each link rate.
async fn across_hosts(a: &KvBenchArgs, insecure: bool) -> anyhow::Result<()> {
    let hosts = pdmesh_cli::netns::Netns::new(&["kv-decode"])
        .map_err(|e| anyhow::anyhow!("making the decode host (needs root and iproute2): {e}"))?;
    let prefix = hosts.command_prefix("kv-decode", false).context("the decode host")?;
    let listen = format!("{}:0", hosts.host("kv-decode").context("the decode host")?.1);
    let mut s = setup(a, insecure, &prefix, &listen, &[false]).await?;
    let mut rows = Vec::new();
    for &mbit in &a.link_mbit {
        let link = (mbit > 0).then_some(mbit);
        hosts.shape("kv-decode", link).map_err(anyhow::Error::msg)?;
        for (path, kind) in
            [("ucx-put", TransportKind::named("ucx")), ("grpc", TransportKind::Grpc)]
        {
            if !a.paths.iter().any(|p| p == path) {
                continue;
            }
            let ms = time_path(a, &mut s, path, kind, 0).await?;
            let gbps = s.bytes as f64 * 8.0 / (ms / 1e3) / 1e9;
            let vs_link = link.map(|m| gbps * 1e3 / m as f64);
            rows.push(LinkRow { link_mbit: link, path: path.into(), ms, gbps, vs_link });
        }
    }
    hosts.shape("kv-decode", None).map_err(anyhow::Error::msg)?;
    if a.json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    println!(
        "{} KV of {} tokens ({:.1} MB) from this host into a decode node on another (veth, \
         tc tbf), median of {}{}",
        a.kv_dtype.name(),
        a.tokens,
        s.bytes as f64 / 1e6,
        a.reps,
        if insecure { " (plaintext: --insecure)" } else { "; gRPC under mutual TLS" }
    );
    println!("{:<10} {:<8} {:>10} {:>10} {:>9}", "link", "path", "ms", "Gbit/s", "of link");
    for r in &rows {
        let link = r.link_mbit.map_or("unshaped".into(), |m| format!("{} Gbit/s", m as f64 / 1e3));
        let of = r.vs_link.map_or("-".into(), |v| format!("{v:.3}"));
        println!("{link:<10} {:<8} {:>10.2} {:>10.2} {of:>9}", r.path, r.ms, r.gbps);
    }
    Ok(())
}

async fn bench(a: &KvBenchArgs, insecure: bool) -> anyhow::Result<Report> {
    // Two decode nodes: one as nodes run (its pool shared with writers on this host), one
    // whose pool is private, so UCX puts into it as it would from another host.
    let mut s = setup(a, insecure, &[], "127.0.0.1:0", &[true, false]).await?;
    let (bytes, src) = (s.bytes, s.src.clone());

    // The references are cheap and noisy on a shared machine: more samples than the
    // transports get.
    let samples = (3 * a.reps).max(21);
    let memcpy_ms = {
        let mut dst = vec![0u8; src.len()];
        timed_median(samples, || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            Ok(())
        })?
    };
    let tcp_ms = tokio::task::block_in_place(|| loopback_tcp_ms(&src, samples))
        .context("the loopback TCP reference")?;

    let mut ms = Vec::new();
    // (path, transport, decode node: 0 shares its pool, 1 does not)
    for (path, kind, node) in [
        ("ucx", TransportKind::named("ucx"), 0),
        ("ucx-put", TransportKind::named("ucx"), 1),
        ("grpc", TransportKind::Grpc, 0),
    ] {
        if a.paths.iter().any(|p| p == path) {
            ms.push(time_path(a, &mut s, path, kind, node).await?);
        } else {
            ms.push(f64::NAN);
        }
    }
    let gbps = |ms: f64| bytes as f64 / (ms / 1e3) / 1e9;
    let (ucx_ms, ucx_put_ms, grpc_ms) = (ms[0], ms[1], ms[2]);
    let mut nodes_stats = Vec::new();
    for (_, client) in &mut s.nodes {
        let st = client.stats(StatsRequest {}).await?.into_inner();
        let ucx = st.transports.iter().find(|t| t.transport == "ucx").cloned().unwrap_or_default();
        let unstage_ms =
            if ucx.staged > 0 { ucx.staged_seconds * 1e3 / ucx.staged as f64 } else { 0.0 };
        nodes_stats.push((st.backend, st.kv_path, unstage_ms));
    }
    let decode_backend = nodes_stats[0].0.clone();
    Ok(Report {
        decode_backend,
        ucx_kv_path: nodes_stats[0].1.clone(),
        ucx_put_kv_path: nodes_stats[1].1.clone(),
        ucx_unstage_ms: nodes_stats[0].2,
        ucx_put_unstage_ms: nodes_stats[1].2,
        kv_dtype: a.kv_dtype.name().to_string(),
        tokens: a.tokens,
        blocks: s.blocks,
        bytes,
        reps: a.reps,
        ucx_ms,
        ucx_put_ms,
        grpc_ms,
        memcpy_ms,
        ucx_gbps: gbps(ucx_ms),
        ucx_put_gbps: gbps(ucx_put_ms),
        grpc_gbps: gbps(grpc_ms),
        memcpy_gbps: gbps(memcpy_ms),
        tcp_ms,
        tcp_gbps: gbps(tcp_ms),
        tcp_vs_memcpy: memcpy_ms / tcp_ms,
        grpc_vs_tcp: tcp_ms / grpc_ms,
        ucx_vs_memcpy: memcpy_ms / ucx_ms,
        ucx_put_vs_memcpy: memcpy_ms / ucx_put_ms,
        grpc_vs_memcpy: memcpy_ms / grpc_ms,
        ucx_tls: std::env::var("UCX_TLS").unwrap_or_default(),
        tls: !insecure,
    })
}

/// The median milliseconds of `samples` runs of `f`, after one more that warms up.
fn timed_median(samples: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut times = Vec::with_capacity(samples + 1);
    for _ in 0..=samples {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.remove(0);
    Ok(median(times))
}

/// Median milliseconds (`timed_median`) to write `src` into a loopback TCP socket and read all
/// of it into a buffer on another thread, acknowledged by one byte back (as a transfer ends in
/// the receiver's answer).
fn loopback_tcp_ms(src: &[u8], samples: usize) -> anyhow::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut tx = std::net::TcpStream::connect(listener.local_addr()?)?;
    let (mut rx, _) = listener.accept()?;
    tx.set_nodelay(true)?;
    rx.set_nodelay(true)?;
    let len = src.len();
    std::thread::scope(|s| {
        // A reader that fails drops its socket, so the writer fails too instead of blocking.
        let reader = s.spawn(move || -> std::io::Result<()> {
            let mut dst = vec![0u8; len];
            for _ in 0..=samples {
                rx.read_exact(&mut dst)?;
                std::hint::black_box(&mut dst);
                rx.write_all(&[1])?;
            }
            Ok(())
        });
        let ms = timed_median(samples, || {
            tx.write_all(src)?;
            tx.read_exact(&mut [0u8])?;
            Ok(())
        });
        if ms.is_err() {
            // A writer that fails must not leave the reader waiting for bytes: the scope
            // joins it before returning.
            let _ = tx.shutdown(std::net::Shutdown::Both);
        }
        let read = reader.join().map_err(|_| anyhow::anyhow!("the reader thread panicked"))?;
        // The writer's error first: the reader's then only says the writer went away.
        let ms = ms?;
        read?;
        Ok(ms)
    })
}
