//! A whole mesh in this process, on the tiny seeded model: the real router, prefill and decode
//! services (their `run` functions, real gRPC on loopback, real KV transfer), started in
//! milliseconds. The fast tier of the relay's and the nodes' tests runs on it; the real-model,
//! real-process tests run on `Cluster`.

use std::path::PathBuf;
use std::time::Duration;

use pdmesh_common::metrics::Metrics;
use pdmesh_decode::DecodeConfig;
use pdmesh_engine::EngineSettings;
use pdmesh_engine::testing::TinyModel;
use pdmesh_prefill::PrefillConfig;
use pdmesh_proto::v1::generation_client::GenerationClient;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{ListNodesRequest, NodeStatus};
use pdmesh_router::RouterConfig;
use pdmesh_router::config::ServedModel;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Settings for a mesh; change what a test needs before `start`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub router: RouterConfig,
    pub prefill: Vec<PrefillConfig>,
    pub decode: Vec<DecodeConfig>,
    /// The tiny model every service loads (its plain form unless a test picks another).
    pub model: TinyModel,
    /// More models served beside `model` (`serve`), each on nodes of its own.
    pub extra: Vec<Extra>,
}

/// A model served beside the default one, and its nodes.
#[derive(Debug, Clone)]
pub struct Extra {
    pub name: String,
    pub model: TinyModel,
    pub prefill: Vec<PrefillConfig>,
    pub decode: Vec<DecodeConfig>,
}

fn prefill_config(id: String) -> PrefillConfig {
    PrefillConfig { node_id: Some(id), listen: "127.0.0.1:0".into(), ..Default::default() }
}

fn decode_config(id: String) -> DecodeConfig {
    let listen = "127.0.0.1:0".into();
    DecodeConfig { node_id: Some(id), listen, lease_ms: 5_000, ..Default::default() }
}

/// A running in-process mesh. Dropping it stops every service.
#[derive(Debug)]
pub struct Mesh {
    /// The router's public address.
    pub router: String,
    /// The router's membership address.
    pub members: String,
    pub decode: Vec<String>,
    pub prefill: Vec<String>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.stop.cancel();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A tiny model's GGUF, written where every service can load it.
fn tiny_gguf(dir: &std::path::Path, name: &str, model: &TinyModel) -> PathBuf {
    let path = dir.join(format!("{name}.gguf"));
    std::fs::write(&path, model.gguf()).expect("the tiny model is written");
    path
}

fn engine(model: &std::path::Path) -> EngineSettings {
    EngineSettings {
        model: model.to_path_buf(),
        threads: 1,
        block_size: 4,
        kv_blocks: 256,
        max_batch_tokens: 32,
        ..Default::default()
    }
}

impl Settings {
    /// A router with `prefill` prefill and `decode` decode nodes (ids `prefill-i`, `decode-i`),
    /// with timeouts short enough for tests.
    pub fn new(prefill: usize, decode: usize) -> Self {
        let router = RouterConfig {
            listen: "127.0.0.1:0".into(),
            internal_listen: "127.0.0.1:0".into(),
            // In one process there is no TLS, hence no identities: these are the plumbing's
            // tests, not the trust model's (that is `Cluster`'s).
            allow_anonymous: true,
            heartbeat_interval_ms: 50,
            node_ttl_ms: 400,
            ..Default::default()
        };
        let prefill = (0..prefill).map(|i| prefill_config(format!("prefill-{i}"))).collect();
        let decode = (0..decode).map(|i| decode_config(format!("decode-{i}"))).collect();
        Self { router, prefill, decode, model: TinyModel::default(), extra: Vec::new() }
    }

    /// Serves `model` too, as `name`, on `prefill` and `decode` nodes of its own (ids
    /// `NAME-prefill-i`, `NAME-decode-i`). The default model's id is `tiny`.
    pub fn serve(mut self, name: &str, model: TinyModel, prefill: usize, decode: usize) -> Self {
        let prefill = (0..prefill).map(|i| prefill_config(format!("{name}-prefill-{i}"))).collect();
        let decode = (0..decode).map(|i| decode_config(format!("{name}-decode-{i}"))).collect();
        self.extra.push(Extra { name: name.into(), model, prefill, decode });
        self
    }

    /// Starts every service and waits until each node has registered.
    pub async fn start(mut self) -> Mesh {
        // As the binary does: its nodes may run UCX (`kv_transport = auto`).
        pdmesh_kv_ucx::register();
        let dir = tempfile::tempdir().expect("a temp dir");
        let model = tiny_gguf(dir.path(), "tiny", &self.model);
        let extra: Vec<(Extra, PathBuf)> = std::mem::take(&mut self.extra)
            .into_iter()
            .map(|e| {
                let path = tiny_gguf(dir.path(), &e.name, &e.model);
                (e, path)
            })
            .collect();
        self.router.models = extra
            .iter()
            .map(|(e, path)| ServedModel { path: path.clone(), name: Some(e.name.clone()) })
            .collect();
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        let (listener, addr) = pdmesh_common::bind(&self.router.listen).await.expect("binds");
        let (internal, internal_addr) =
            pdmesh_common::bind(&self.router.internal_listen).await.expect("binds");
        let (router, members) = (addr.to_string(), internal_addr.to_string());
        self.router.model = model.clone();
        let done = stop.clone();
        let cfg = self.router.clone();
        tasks.push(tokio::spawn(async move {
            let shutdown = done.cancelled_owned();
            let r = pdmesh_router::run(cfg, listener, internal, Metrics::default(), shutdown);
            r.await.expect("the router runs");
        }));
        // Each node: bound, pointed at the router and the tiny model, and run until `stop`.
        macro_rules! start_nodes {
            ($configs:expr, $model:expr, $run:path) => {{
                let mut addrs = Vec::new();
                for mut c in $configs {
                    let (listener, addr) = pdmesh_common::bind(&c.listen).await.expect("binds");
                    c.routers = vec![members.clone()];
                    c.engine = engine($model);
                    addrs.push(addr.to_string());
                    let done = stop.clone();
                    tasks.push(tokio::spawn(async move {
                        let r = $run(c, listener, Metrics::default(), done.cancelled_owned());
                        r.await.expect("the node runs");
                    }));
                }
                addrs
            }};
        }
        let mut decode = start_nodes!(self.decode, &model, pdmesh_decode::run);
        let mut prefill = start_nodes!(self.prefill, &model, pdmesh_prefill::run);
        for (e, path) in extra {
            decode.extend(start_nodes!(e.decode, &path, pdmesh_decode::run));
            prefill.extend(start_nodes!(e.prefill, &path, pdmesh_prefill::run));
        }
        let mesh = Mesh { router, members, decode, prefill, stop, tasks, _dir: dir };
        let want = mesh.decode.len() + mesh.prefill.len();
        crate::eventually(Duration::from_secs(20), "every node registers", || async {
            mesh.nodes().await.len() == want
        })
        .await;
        mesh
    }
}

impl Mesh {
    pub async fn client(&self) -> GenerationClient<Channel> {
        GenerationClient::connect(format!("http://{}", self.router)).await.expect("router")
    }

    /// The nodes the router knows.
    pub async fn nodes(&self) -> Vec<NodeStatus> {
        let Ok(mut m) = MembershipClient::connect(format!("http://{}", self.members)).await else {
            return Vec::new();
        };
        m.list_nodes(ListNodesRequest {}).await.map(|r| r.into_inner().nodes).unwrap_or_default()
    }
}
