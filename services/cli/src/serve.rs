//! `pdmesh router|prefill|decode`: run one service of a mesh in this process. Settings come
//! from defaults, then `--config FILE` (TOML), then `PDMESH_<SERVICE>_*` variables, then
//! flags. Once bound, the process prints `pdmesh <service> listening on ADDR` on stdout (what
//! `pdmesh up` and the test harness wait for), and it stops cleanly on Ctrl-C or SIGTERM.

use std::io::Write;

use anyhow::Context;
use pdmesh_cli::process::shutdown_signal;
use pdmesh_common::metrics::Metrics;
use pdmesh_common::tls::MeshRole;
use serde::Serialize;

mod flags;
mod fleet;

pub use flags::{DecodeArgs, KvStoreArgs, PrefillArgs, ProcessFlags, RouterArgs};

fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

async fn bind_and_announce(
    service: &str,
    listen: &str,
    what: &str,
) -> anyhow::Result<tokio::net::TcpListener> {
    let (l, addr) =
        pdmesh_common::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "pdmesh {service} {what} {addr}")?;
    out.flush()?;
    Ok(l)
}

/// What differs between the service commands; everything else goes through `start`.
trait Service: Serialize + serde::de::DeserializeOwned + Default + Clone + Send + 'static {
    const NAME: &'static str;
    const ENV_PREFIX: &'static str;
    /// `service.name` in traces, unless OTEL_SERVICE_NAME says otherwise.
    const TRACE_NAME: &'static str;
    /// Async worker threads: workers only move messages (their compute has its own thread),
    /// and one thread does that without waking a second per token, which on a small machine
    /// steals time from the engine's compute threads. The router too: a request is a dozen
    /// small frames on five connections, and with two workers each frame's wake-up often
    /// crossed threads (`just bench-sim`: 0.99 ms of router CPU a request at 200 req/s with
    /// two workers, 0.70 with one).
    const ASYNC_THREADS: usize;
    /// The role its certificate must carry.
    const ROLE: MeshRole;
    fn check(&self) -> Result<(), pdmesh_common::InvalidConfig>;
    fn listen(&self) -> &str;
    fn set_listen(&mut self, addr: String);
    /// The engine it runs, if it runs one.
    fn engine(&self) -> Option<&pdmesh_engine::EngineSettings> {
        None
    }
    /// A second listener (the router's internal one), if the service has one.
    fn internal_listen(&self) -> Option<&str> {
        None
    }
    /// The OpenAI HTTP API's listener (the router's), if the service serves it.
    fn http_listen(&self) -> Option<&str> {
        None
    }
    /// Where `GET /metrics` is served, if anywhere.
    fn metrics_listen(&self) -> Option<&str>;
    /// Every gRPC address it listens on or dials: with `--insecure`, each must be loopback
    /// (and so must its HTTP and metrics listeners).
    fn addresses(&self) -> Vec<&str>;
    /// The node's name, which with TLS is its certificate's (None: the service has none).
    fn node_id(&mut self) -> Option<&mut Option<String>> {
        None
    }
    fn run(
        self,
        l: Listeners,
        metrics: Metrics,
        shutdown: Shutdown,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// What a service was bound to.
struct Listeners {
    main: tokio::net::TcpListener,
    internal: Option<tokio::net::TcpListener>,
    http: Option<tokio::net::TcpListener>,
}

type Shutdown = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// The four services differ only in these; everything else goes through `start`.
macro_rules! service {
    ($config:ty, $name:literal, $env:literal, $threads:literal, $role:ident,
     |$c:ident| addresses: $addrs:expr, node_id: $node:expr, internal: $internal:expr,
     $(http: $http:expr,)?
     engine: $engine:expr,
     run: |$l:ident, $m:ident, $s:ident| $run:expr) => {
        impl Service for $config {
            const NAME: &'static str = $name;
            const ENV_PREFIX: &'static str = $env;
            const TRACE_NAME: &'static str = concat!("pdmesh-", $name);
            const ASYNC_THREADS: usize = $threads;
            const ROLE: MeshRole = MeshRole::$role;
            fn check(&self) -> Result<(), pdmesh_common::InvalidConfig> {
                self.validate()
            }
            fn listen(&self) -> &str {
                &self.listen
            }
            fn set_listen(&mut self, addr: String) {
                self.listen = addr;
            }
            fn engine(&self) -> Option<&pdmesh_engine::EngineSettings> {
                let $c = self;
                let _ = &$c;
                $engine
            }
            fn internal_listen(&self) -> Option<&str> {
                let $c = self;
                let _ = &$c;
                $internal
            }
            fn metrics_listen(&self) -> Option<&str> {
                self.metrics_listen.as_deref()
            }
            $(fn http_listen(&self) -> Option<&str> {
                let $c = self;
                $http
            })?
            fn addresses(&self) -> Vec<&str> {
                let $c = self;
                $addrs
            }
            fn node_id(&mut self) -> Option<&mut Option<String>> {
                let $c = self;
                let _ = &$c;
                $node
            }
            async fn run(self, $l: Listeners, $m: Metrics, $s: Shutdown) -> anyhow::Result<()> {
                let $c = self;
                $run.await.map_err(|e| anyhow::anyhow!(e))
            }
        }
    };
}

/// A node's own addresses and the ones it dials.
fn node_addresses<'a>(
    listen: &'a str,
    advertise: Option<&'a str>,
    routers: &'a [String],
) -> Vec<&'a str> {
    [listen].into_iter().chain(advertise).chain(routers.iter().map(String::as_str)).collect()
}

service!(pdmesh_decode::DecodeConfig, "decode", "PDMESH_DECODE_", 1, Decode,
    |c| addresses: node_addresses(&c.listen, c.advertise.as_deref(), &c.routers),
    node_id: Some(&mut c.node_id), internal: None, engine: Some(&c.engine),
    run: |l, m, s| pdmesh_decode::run(c, l.main, m, s));
service!(pdmesh_prefill::PrefillConfig, "prefill", "PDMESH_PREFILL_", 1, Prefill,
    |c| addresses: {
        let mut a = node_addresses(&c.listen, c.advertise.as_deref(), &c.routers);
        a.extend(c.kvstore.as_deref());
        a
    },
    node_id: Some(&mut c.node_id), internal: None, engine: Some(&c.engine),
    run: |l, m, s| pdmesh_prefill::run(c, l.main, m, s));
service!(pdmesh_router::RouterConfig, "router", "PDMESH_ROUTER_", 1, Router,
|c| addresses: vec![c.listen.as_str(), c.internal_listen.as_str()],
node_id: None, internal: Some(&c.internal_listen), http: c.http_listen.as_deref(), engine: None,
run: |l, m, s| async move {
    let internal = l.internal.expect("the router is bound to its internal address too");
    let drain = std::time::Duration::from_millis(c.drain_ms);
    let http = l.http.map(|h| pdmesh_frontend_openai::frontend(h, drain));
    pdmesh_router::run_with(c, l.main, internal, m, s, http).await
});
service!(pdmesh_kvstore::KvStoreConfig, "kvstore", "PDMESH_KVSTORE_", 2, KvStore,
    |c| addresses: vec![c.listen.as_str()],
    node_id: Some(&mut c.node_id), internal: None, engine: None,
    run: |l, m, s| pdmesh_kvstore::run(c, l.main, m, s));

/// Whether `addr` (host:port) names only this machine.
pub(crate) fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    match addr.to_socket_addrs() {
        Ok(mut all) => {
            let all: Vec<_> = all.by_ref().collect();
            !all.is_empty() && all.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

/// With TLS, the process's certificate must be for this service, and names the node; without
/// (`--insecure`), every address must stay on this machine.
fn settle_identity<C: Service>(cfg: &mut C) -> anyhow::Result<()> {
    let Some(tls) = pdmesh_common::tls::current() else {
        // Every listener counts: the OpenAI API and the metrics page are plaintext too, and
        // the HTTP port serves the whole mesh to whoever reaches it.
        let all = cfg.addresses().into_iter().chain(cfg.http_listen()).chain(cfg.metrics_listen());
        let far: Vec<&str> = all.filter(|a| !is_loopback(a)).collect();
        anyhow::ensure!(
            far.is_empty(),
            "--insecure runs plaintext, so it is for loopback addresses only; {} {} not \
             (use mutual TLS: --tls-dir DIR --tls-name NAME)",
            far.join(", "),
            if far.len() == 1 { "is" } else { "are" }
        );
        return Ok(());
    };
    let me = tls.identity();
    anyhow::ensure!(
        me.role == C::ROLE,
        "the certificate {} is for a {}, not a {}",
        me.name,
        me.role,
        C::ROLE
    );
    if let Some(id) = cfg.node_id() {
        match id {
            None => *id = Some(me.name),
            Some(n) if *n == me.name => {}
            Some(n) => anyhow::bail!(
                "node id {n:?} differs from the name in its certificate, {:?}: routers \
                 accept a node only under its certificate's name",
                me.name
            ),
        }
    }
    Ok(())
}

/// Loads a service's config (defaults → file → env → `overlay`), binds, announces the address
/// and runs until a signal.
fn start<C: Service>(
    process: &ProcessFlags,
    overlay: &impl Serialize,
    sim_nodes: usize,
) -> anyhow::Result<()> {
    let rt = runtime(C::ASYNC_THREADS)?;
    // The span exporter's channel lives on the runtime.
    let telemetry = {
        let _in_runtime = rt.enter();
        pdmesh_common::telemetry::init(C::TRACE_NAME)?
    };
    let file = process.config.as_deref();
    let mut cfg: C = pdmesh_common::load_config(&C::default(), file, C::ENV_PREFIX, overlay)?;
    cfg.check().map_err(|e| anyhow::anyhow!("invalid config: {e}"))?;
    settle_identity(&mut cfg)?;
    if sim_nodes != 1 {
        fleet::check(&cfg, sim_nodes)?;
    }
    if telemetry.exporting() {
        tracing::info!(service = C::TRACE_NAME, "exporting spans over OTLP");
    }
    let shutdown = Box::pin(shutdown_signal(process.exit_with_stdin));
    let served = if sim_nodes != 1 {
        rt.block_on(fleet::run(cfg, sim_nodes, shutdown))
    } else {
        rt.block_on(serve(cfg, shutdown))
    };
    // Flushes the last spans while the runtime still drives the exporter's connection.
    let _ = rt.block_on(async { tokio::task::spawn_blocking(move || telemetry.shutdown()).await });
    // Dropping a runtime waits for its blocking threads, and the one reading stdin
    // (`--exit-with-stdin`) never returns when a signal, not stdin, stopped the service.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    served
}

/// Binds one service's listeners (and its metrics page) and runs it until `shutdown`.
async fn serve<C: Service>(cfg: C, shutdown: Shutdown) -> anyhow::Result<()> {
    let main = bind_and_announce(C::NAME, cfg.listen(), "listening on").await?;
    let internal = match cfg.internal_listen() {
        Some(a) => Some(bind_and_announce(C::NAME, a, "internal on").await?),
        None => None,
    };
    let http = match cfg.http_listen() {
        Some(a) => Some(bind_and_announce(C::NAME, a, "http on").await?),
        None => None,
    };
    let l = Listeners { main, internal, http };
    let metrics = Metrics::default();
    if let Some(m) = cfg.metrics_listen() {
        let (ml, addr) =
            pdmesh_common::bind(m).await.with_context(|| format!("cannot listen on {m}"))?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "pdmesh {} metrics on http://{addr}/metrics", C::NAME)?;
        out.flush()?;
        tokio::spawn(pdmesh_common::metrics::serve(ml, metrics.clone()));
    }
    cfg.run(l, metrics, shutdown).await
}

pub fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    start::<pdmesh_decode::DecodeConfig>(&a.process, &a.settings, a.fleet.sim_nodes)
}

pub fn prefill(a: PrefillArgs) -> anyhow::Result<()> {
    start::<pdmesh_prefill::PrefillConfig>(&a.process, &a.settings, a.fleet.sim_nodes)
}

pub fn kvstore(a: KvStoreArgs) -> anyhow::Result<()> {
    start::<pdmesh_kvstore::KvStoreConfig>(&a.process, &a.settings, 1)
}

pub fn router(a: RouterArgs) -> anyhow::Result<()> {
    start::<pdmesh_router::RouterConfig>(&a.process, &a.settings, 1)
}

/// Which child setting each of `up`'s mesh-wide flags sets (`service/json/pointer`): its
/// `--help` shows that setting's default, and a test holds `up` to it.
pub(crate) const UP_SETS: [(&str, &str); 13] = [
    ("kv_blocks", "/decode/engine/kv_blocks"),
    ("block_size", "/decode/engine/block_size"),
    ("kv_dtype", "/decode/engine/kv_dtype"),
    ("kv_transport", "/decode/kv_transport"),
    ("prefill_backend", "/prefill/engine/backend"),
    ("decode_backend", "/decode/engine/backend"),
    ("kv_push", "/prefill/kv_push"),
    ("cache_bytes", "/prefill/cache_bytes"),
    ("prefill_policy", "/router/prefill_policy"),
    ("ttft_slo_ms", "/router/planner/ttft_slo_ms"),
    ("itl_slo_ms", "/router/planner/itl_slo_ms"),
    ("planner_window_s", "/router/planner/window_s"),
    ("planner_cooldown_s", "/router/planner/cooldown_s"),
];

/// `--help` for the service commands, each flag with its setting's default.
pub fn document_defaults(cli: clap::Command) -> clap::Command {
    fn one<C: Service>(
        cli: clap::Command,
        keys: fn(&str, &mut Vec<(&'static str, String)>),
    ) -> clap::Command {
        let defaults = serde_json::to_value(C::default()).expect("configs serialize");
        let mut all = Vec::new();
        keys("", &mut all);
        cli.mut_subcommand(C::NAME, |c| flags::with_defaults(c, &defaults, &all))
    }
    // `up`'s mesh-wide flags set one service's setting each: theirs is that setting's default.
    let cli = cli.mut_subcommand("up", |up| {
        let defaults = serde_json::json!({
            "decode": pdmesh_decode::DecodeConfig::default(),
            "prefill": pdmesh_prefill::PrefillConfig::default(),
            "router": pdmesh_router::RouterConfig::default(),
        });
        let keys = UP_SETS.map(|(id, pointer)| (id, pointer.to_string()));
        flags::with_defaults(up, &defaults, &keys)
    });
    let cli = one::<pdmesh_router::RouterConfig>(cli, pdmesh_router::RouterFlags::setting_keys);
    let cli = one::<pdmesh_prefill::PrefillConfig>(cli, pdmesh_prefill::PrefillFlags::setting_keys);
    let cli = one::<pdmesh_decode::DecodeConfig>(cli, pdmesh_decode::DecodeFlags::setting_keys);
    one::<pdmesh_kvstore::KvStoreConfig>(cli, pdmesh_kvstore::KvStoreFlags::setting_keys)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every config file shipped under deploy/ loads through its service's own loader and
    /// passes validation (engine paths aside: they name the container's model).
    #[test]
    fn shipped_config_files_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/config");
        let none = serde_json::json!({});
        let r: pdmesh_router::RouterConfig = pdmesh_common::load_config(
            &pdmesh_router::RouterConfig::default(),
            Some(&dir.join("router.toml")),
            "PDMESH_TEST_ROUTER_",
            &none,
        )
        .expect("router.toml loads");
        r.validate().expect("router.toml is valid");
        let p: pdmesh_prefill::PrefillConfig = pdmesh_common::load_config(
            &pdmesh_prefill::PrefillConfig::default(),
            Some(&dir.join("prefill.toml")),
            "PDMESH_TEST_PREFILL_",
            &none,
        )
        .expect("prefill.toml loads");
        p.validate().expect("prefill.toml is valid");
        let k: pdmesh_kvstore::KvStoreConfig = pdmesh_common::load_config(
            &pdmesh_kvstore::KvStoreConfig::default(),
            Some(&dir.join("kvstore.toml")),
            "PDMESH_TEST_KVSTORE_",
            &none,
        )
        .expect("kvstore.toml loads");
        k.validate().expect("kvstore.toml is valid");
        let d: pdmesh_decode::DecodeConfig = pdmesh_common::load_config(
            &pdmesh_decode::DecodeConfig::default(),
            Some(&dir.join("decode.toml")),
            "PDMESH_TEST_DECODE_",
            &none,
        )
        .expect("decode.toml loads");
        d.validate().expect("decode.toml is valid");
        assert_eq!(d.engine.kv_blocks, 2048);
        assert_eq!(p.routers, vec!["pdmesh-router-internal:50052".to_string()]);
        // Every file spells out every key: nothing is left to a default a reader cannot see.
        for (name, defaults) in [
            ("router.toml", serde_json::to_value(pdmesh_router::RouterConfig::default())),
            ("prefill.toml", serde_json::to_value(pdmesh_prefill::PrefillConfig::default())),
            ("decode.toml", serde_json::to_value(pdmesh_decode::DecodeConfig::default())),
            ("kvstore.toml", serde_json::to_value(pdmesh_kvstore::KvStoreConfig::default())),
        ] {
            let text = std::fs::read_to_string(dir.join(name)).expect("readable");
            for key in defaults.expect("serializable").as_object().expect("a table").keys() {
                let spelled = text.lines().any(|l| {
                    l.trim_start().starts_with(&format!("{key} ="))
                        || l.trim() == format!("[{key}]")
                });
                // Unset, these have no TOML spelling (the disk tiers' directories and the
                // router's ladder are shown commented out), and the fault hooks are for tests.
                let unset = ["advertise", "node_id", "disk_dir", "cache_disk_dir", "tiers"];
                let optional = unset.contains(&key.as_str()) || key.starts_with("fault_");
                assert!(spelled || optional, "{name} does not set {key}");
            }
        }
    }

    #[test]
    fn flags_override_files_and_unknown_keys_fail() {
        let dir = tempfile::tempdir().expect("temp dir");
        let f = dir.path().join("d.toml");
        std::fs::write(&f, "max_running = 3\n[engine]\nkv_blocks = 9\n").expect("written");
        let flags = serde_json::json!({"max_running": 5});
        let d: pdmesh_decode::DecodeConfig = pdmesh_common::load_config(
            &pdmesh_decode::DecodeConfig::default(),
            Some(&f),
            "PDMESH_TEST_DECODE2_",
            &flags,
        )
        .expect("loads");
        assert_eq!((d.max_running, d.engine.kv_blocks), (5, 9));
        std::fs::write(&f, "[engine]\nkv_blokcs = 9\n").expect("written");
        let e = pdmesh_common::load_config::<pdmesh_decode::DecodeConfig>(
            &pdmesh_decode::DecodeConfig::default(),
            Some(&f),
            "PDMESH_TEST_DECODE2_",
            &serde_json::json!({}),
        )
        .expect_err("unknown key");
        assert!(e.to_string().contains("kv_blokcs"), "{e}");
    }
}
