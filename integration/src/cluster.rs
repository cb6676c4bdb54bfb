//! A mesh of real `pdmesh` processes for tests: `Cluster::builder().prefill(2).decode(2)
//! .start()`. Every service binds port 0 and announces its address on stdout; every child's
//! stdin is a pipe, so the services stop when the cluster (or the test process) goes away.
//!
//! Clusters run as production does: mutual TLS under one CA per test process ([`pki`]),
//! each process with its own certificate, and API keys on the public API. The test itself
//! calls in as the router would (`harness`, a router certificate) unless a test picks another
//! identity (`Pki::identity`); `insecure()` starts a plaintext cluster instead.

use std::process::Command;
use std::time::{Duration, Instant};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use pdmesh_common::apikey::{Bearer, GenerationClient, Tenant};
use pdmesh_common::tls::{Ca, MeshRole, MeshTls};
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{ListNodesRequest, NodeStats, NodeStatus, Role, StatsRequest};
use tonic::transport::Channel;

pub use crate::service::Service;
use crate::service::zombie;
use crate::{model_path, pdmesh_bin};

/// The test process's CA: every cluster's certificates, and the identities tests call with.
pub struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    clusters: AtomicUsize,
    harness: MeshTls,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").field("dir", &self.dir.path()).finish()
    }
}

/// The PKI of this test process (made on first use).
pub fn pki() -> &'static Pki {
    static PKI: OnceLock<Pki> = OnceLock::new();
    PKI.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temp dir for certificates");
        let ca = Ca::generate().expect("a CA");
        ca.write(dir.path(), true).expect("CA written");
        ca.issue(dir.path(), "harness", MeshRole::Router).expect("harness certificate");
        let harness = MeshTls::load(dir.path(), "harness").expect("harness certificate loads");
        Pki { dir, ca, clusters: AtomicUsize::new(0), harness }
    })
}

impl Pki {
    /// A certificate for `name` in `role` (say, an attacker holding a real prefill node's).
    pub fn identity(&self, name: &str, role: MeshRole) -> MeshTls {
        MeshTls::load(&self.identity_dir(name, role), name).expect("certificate loads")
    }

    /// `identity`'s files: a directory to give a process as `--tls-dir`.
    pub fn identity_dir(&self, name: &str, role: MeshRole) -> PathBuf {
        let d = self.dir.path().join("ids").join(format!("{name}-{role}"));
        self.ca.issue(&d, name, role).expect("certificate issued");
        d
    }

    /// A certificate for `name` in `role` whose term ended yesterday (one copied off a mesh
    /// and kept).
    pub fn expired_identity(&self, name: &str, role: MeshRole) -> MeshTls {
        let d = self.dir.path().join("expired").join(format!("{name}-{role}"));
        let day = Duration::from_secs(86_400);
        let now = std::time::SystemTime::now();
        let term = pdmesh_common::tls::Validity { from: now - 2 * day, until: now - day };
        self.ca.issue_within(&d, name, role, &[], term).expect("certificate issued");
        MeshTls::load(&d, name).expect("certificate loads")
    }

    /// The CA's certificate file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A fresh directory for one cluster's certificates.
    fn cluster_dir(&self) -> PathBuf {
        let n = self.clusters.fetch_add(1, Ordering::Relaxed);
        self.dir.path().join(format!("cluster-{n}"))
    }

    fn issue(&self, dir: &Path, name: &str, role: MeshRole) {
        // A router serves HTTPS too, dialed as 127.0.0.1.
        let hosts =
            if role == MeshRole::Router { vec!["127.0.0.1".to_string()] } else { Vec::new() };
        self.ca.issue_for_hosts(dir, name, role, &hosts).expect("certificate issued");
    }
}

/// An endpoint to a TLS cluster's process of role `serves` at `addr`, as `tls`.
pub fn endpoint_as(addr: &str, tls: &MeshTls, serves: MeshRole) -> tonic::transport::Endpoint {
    pdmesh_common::tls::endpoint_with(addr, tls, serves).expect("a valid address")
}

#[derive(Debug, Clone)]
pub struct ClusterBuilder {
    /// Routers besides the first (every node registers with all of them).
    more_routers: usize,
    /// Each process on a host of its own (`Netns`), named as the process is.
    netns: Option<std::sync::Arc<crate::netns::Netns>>,
    prefill: usize,
    decode: usize,
    kvstore: bool,
    kvstore_args: Vec<String>,
    kvstore_budget: u64,
    router_args: Vec<String>,
    prefill_args: Vec<String>,
    decode_args: Vec<String>,
    env: Vec<(String, String)>,
    /// The GGUF every service loads (default: `model_path()`).
    model: Option<PathBuf>,
    /// Plaintext, no certificates, no API keys.
    insecure: bool,
    /// Netns hosts share this machine's IPC namespace (as under a bare `ip netns exec`)
    /// instead of each having its own.
    shared_ipc: bool,
    /// Tenants with API keys (besides "test", which `client()` uses), with their limits.
    tenants: Vec<Tenant>,
    /// Models served beside the default one, each with nodes of its own.
    also: Vec<AlsoServed>,
    /// The router's tiered routing (`[tiers]`): the ladder and its threshold.
    tiers: Option<(Vec<String>, f32)>,
}

/// A model the router serves beside the default (`[[models]]` in its config), and its nodes.
#[derive(Debug, Clone)]
struct AlsoServed {
    path: PathBuf,
    name: String,
    prefill: usize,
    decode: usize,
}

impl ClusterBuilder {
    /// Serves this GGUF instead of the default model.
    pub fn model(mut self, path: &Path) -> Self {
        self.model = Some(path.to_path_buf());
        self
    }

    fn model_arg(&self) -> String {
        self.model.clone().unwrap_or_else(model_path).display().to_string()
    }

    /// Serves `auto` as a cascade along `ladder` (served models' ids), kept from
    /// `min_mean_logprob` up.
    pub fn tiers(mut self, ladder: &[&str], min_mean_logprob: f32) -> Self {
        self.tiers = Some((ladder.iter().map(|s| s.to_string()).collect(), min_mean_logprob));
        self
    }

    /// Serves `path` as `name` beside the default model, on `prefill` + `decode` nodes of its
    /// own (started after the default model's, so numbered after them).
    pub fn also_serve(mut self, path: &Path, name: &str, prefill: usize, decode: usize) -> Self {
        let (path, name) = (path.to_path_buf(), name.to_string());
        self.also.push(AlsoServed { path, name, prefill, decode });
        self
    }

    /// Sets an environment variable for every service process.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }
    /// Runs each process on its host in `hosts` (named as the process: router, prefill-0,
    /// decode-1, ...), listening on the host's address.
    pub fn netns(mut self, hosts: std::sync::Arc<crate::netns::Netns>) -> Self {
        self.netns = Some(hosts);
        self
    }
    /// Netns hosts keep this machine's IPC namespace: separate networks, shared memory.
    pub fn shared_ipc(mut self) -> Self {
        self.shared_ipc = true;
        self
    }

    /// The command that runs `pdmesh` as process `name`, and the host it listens on.
    fn command(&self, name: &str) -> (Command, String) {
        let on = self
            .netns
            .as_deref()
            .and_then(|n| Some((n.command_prefix(name, self.shared_ipc)?, n.host(name)?.1)));
        match on {
            // Its own IPC namespace too unless `shared_ipc`, as on a machine of its own: UCX
            // then shares no memory with the other hosts' processes and moves KV over the
            // network.
            Some((prefix, ip)) => {
                let mut c = Command::new(&prefix[0]);
                c.args(&prefix[1..]).arg(pdmesh_bin());
                (c, ip.to_string())
            }
            None => (Command::new(pdmesh_bin()), "127.0.0.1".into()),
        }
    }

    /// Starts process `name` (`pdmesh <role> <args>`) where it runs.
    fn launch(&self, role: &str, name: &str, args: &[String]) -> Service {
        Service::spawn(self.command(name).0, role, name, args, &self.env)
    }

    /// `n` routers in all (at least 1); every node registers with each.
    pub fn routers(mut self, n: usize) -> Self {
        self.more_routers = n.saturating_sub(1);
        self
    }

    pub fn prefill(mut self, n: usize) -> Self {
        self.prefill = n;
        self
    }
    pub fn decode(mut self, n: usize) -> Self {
        self.decode = n;
        self
    }
    pub fn router_args(mut self, a: &[&str]) -> Self {
        self.router_args.extend(a.iter().map(|s| s.to_string()));
        self
    }
    pub fn prefill_args(mut self, a: &[&str]) -> Self {
        self.prefill_args.extend(a.iter().map(|s| s.to_string()));
        self
    }
    pub fn decode_args(mut self, a: &[&str]) -> Self {
        self.decode_args.extend(a.iter().map(|s| s.to_string()));
        self
    }
    /// A plaintext cluster (`--insecure`, `--allow-anonymous`).
    pub fn insecure(mut self) -> Self {
        self.insecure = true;
        self
    }
    /// Another tenant with an API key (`Cluster::client_as`).
    pub fn tenant(mut self, t: Tenant) -> Self {
        self.tenants.push(t);
        self
    }
    /// Starts a KV-store too, and points every prefill node at it.
    pub fn kvstore(mut self) -> Self {
        self.kvstore = true;
        self
    }

    /// Extra flags for the KV-store.
    pub fn kvstore_args(mut self, args: &[&str]) -> Self {
        self.kvstore_args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// The KV-store's budget in bytes (it evicts past it).
    pub fn kvstore_budget(mut self, bytes: u64) -> Self {
        self.kvstore_budget = bytes;
        self
    }

    /// Every service serves `/metrics` on a port of its own (`Service::metrics`).
    pub fn metrics(mut self) -> Self {
        let m = ["--metrics-listen".to_string(), "127.0.0.1:0".to_string()];
        for args in [
            &mut self.router_args,
            &mut self.prefill_args,
            &mut self.decode_args,
            &mut self.kvstore_args,
        ] {
            args.extend(m.iter().cloned());
        }
        self
    }
    /// The KV transport both node kinds use ("ucx", "grpc" or "auto").
    pub fn transport(self, t: &str) -> Self {
        self.prefill_args(&["--kv-transport", t]).decode_args(&["--kv-transport", t])
    }

    /// `--tls-dir DIR --tls-name NAME --seal-key DIR/seal.key`, or `--insecure`.
    fn tls_args(&self, dir: &Path, name: &str) -> Vec<String> {
        if self.insecure {
            return vec!["--insecure".into()];
        }
        let d = dir.display().to_string();
        let seal = dir.join("seal.key").display().to_string();
        vec!["--tls-dir".into(), d, "--tls-name".into(), name.into(), "--seal-key".into(), seal]
    }

    /// Starts the router and the nodes, and waits until every node has registered.
    pub async fn start(self) -> Cluster {
        let model = self.model_arg();
        let pki = pki();
        let dir = pki.cluster_dir();
        let mut keys = std::collections::HashMap::new();
        let keyring = dir.join("api-keys.toml");
        if !self.insecure {
            pki.issue(&dir, "router", MeshRole::Router);
            std::fs::write(dir.join("seal.key"), pdmesh_kv_ucx::new_seal_key())
                .expect("seal key written");
            pki.issue(&dir, "kvstore", MeshRole::KvStore);
            let test = Tenant {
                tenant: "test".into(),
                max_in_flight: None,
                cache_group: None,
                kv_policy: None,
                default_model: None,
            };
            for t in std::iter::once(test).chain(self.tenants.iter().cloned()) {
                let name = t.tenant.clone();
                keys.insert(name, pdmesh_common::apikey::add(&keyring, t).expect("API key"));
            }
        }
        let any = format!("{}:0", self.command("router").1);
        let mut rargs: Vec<String> =
            ["--listen", &any, "--internal-listen", &any, "--model", &model]
                .iter()
                .map(|s| s.to_string())
                .collect();
        rargs.extend(self.tls_args(&dir, "router"));
        if self.insecure {
            rargs.push("--allow-anonymous".into());
        } else {
            rargs.extend(["--api-keys".into(), keyring.display().to_string()]);
        }
        rargs.extend([
            "--heartbeat-interval-ms".into(),
            "100".into(),
            "--node-ttl-ms".into(),
            "1000".into(),
        ]);
        if !self.also.is_empty() || self.tiers.is_some() {
            let models: Vec<toml::Value> = self
                .also
                .iter()
                .map(|m| {
                    let mut t = toml::Table::new();
                    t.insert("path".into(), m.path.display().to_string().into());
                    t.insert("name".into(), m.name.clone().into());
                    toml::Value::Table(t)
                })
                .collect();
            let mut table = toml::Table::new();
            table.insert("models".into(), toml::Value::Array(models));
            if let Some((ladder, threshold)) = &self.tiers {
                let mut t = toml::Table::new();
                let ladder = ladder.iter().map(|m| toml::Value::from(m.as_str())).collect();
                t.insert("ladder".into(), toml::Value::Array(ladder));
                t.insert("min_mean_logprob".into(), f64::from(*threshold).into());
                table.insert("tiers".into(), toml::Value::Table(t));
            }
            let file = dir.join("router-models.toml");
            std::fs::write(&file, table.to_string()).expect("router config written");
            rargs.extend(["--config".to_string(), file.display().to_string()]);
        }
        rargs.extend(self.router_args.iter().cloned());
        let router = self.launch("router", "router", &rargs);
        let more_routers = (1..=self.more_routers)
            .map(|i| {
                let name = format!("router-{i}");
                if !self.insecure {
                    pki.issue(&dir, &name, MeshRole::Router);
                }
                let mut a = rargs.clone();
                // The first router's certificate flags, swapped for this one's.
                if let Some(at) = a.iter().position(|x| x == "--tls-name") {
                    a[at + 1] = name.clone();
                }
                self.launch("router", &name, &a)
            })
            .collect();
        let mut builder = self.clone();
        let mut kvstore_args = Vec::new();
        let kvstore = self.kvstore.then(|| {
            // It reports its blocks to every router, as the name in its certificate.
            let routers: Vec<String> = std::iter::once(&router)
                .chain(&more_routers)
                .flat_map(|r: &Service| {
                    ["--router".to_string(), r.internal.clone().expect("internal address")]
                })
                .collect();
            kvstore_args = ["--model", &model, "--budget-bytes"]
                .map(String::from)
                .into_iter()
                .chain(std::iter::once(self.kvstore_budget.to_string()))
                .chain(["--node-id".to_string(), "kvstore".to_string()])
                .chain(routers)
                .chain(self.tls_args(&dir, "kvstore"))
                .chain(self.kvstore_args.iter().cloned())
                .collect::<Vec<_>>();
            let listen = ["--listen".to_string(), "127.0.0.1:0".to_string()];
            let args: Vec<String> = listen.into_iter().chain(kvstore_args.clone()).collect();
            let k = Service::start_with_env("kvstore", "kvstore", &args, &self.env);
            builder.prefill_args.extend(["--kvstore".to_string(), k.addr.clone()]);
            k
        });
        let mut c = Cluster {
            router,
            more_routers,
            prefills: Vec::new(),
            decodes: Vec::new(),
            kvstore,
            kvstore_args,
            builder,
            dir,
            keys,
            node_models: std::collections::HashMap::new(),
        };
        for _ in 0..self.prefill {
            c.add_prefill(&[]);
        }
        for _ in 0..self.decode {
            c.add_decode(&[]);
        }
        for m in &self.also {
            for _ in 0..m.prefill {
                c.add_prefill_of(&m.path, &[]);
            }
            for _ in 0..m.decode {
                c.add_decode_of(&m.path, &[]);
            }
        }
        // A node that dies at start (a backend it cannot load) fails the start at once, not
        // after the 30 s the wait gives nodes to register.
        let mut watch = tokio::spawn({
            let pids: Vec<(String, u32)> = c
                .prefills
                .iter()
                .chain(&c.decodes)
                .filter_map(|s| Some((s.name.clone(), s.child.as_ref()?.id())))
                .collect();
            async move {
                loop {
                    if let Some((name, _)) = pids.iter().find(|(_, pid)| zombie(*pid)) {
                        return name.clone();
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        tokio::select! {
            () = c.wait_nodes(
                self.prefill + self.also.iter().map(|m| m.prefill).sum::<usize>(),
                self.decode + self.also.iter().map(|m| m.decode).sum::<usize>(),
            ) => watch.abort(),
            dead = &mut watch => panic!(
                "{} exited while the mesh was starting (its log above says why)",
                dead.unwrap_or_default()
            ),
        }
        c
    }
}

/// Fields drop in order: nodes first, then the router they heartbeat to.
#[derive(Debug)]
pub struct Cluster {
    pub prefills: Vec<Service>,
    pub decodes: Vec<Service>,
    pub kvstore: Option<Service>,
    /// The KV-store's arguments but its listener, for `restart_kvstore`.
    kvstore_args: Vec<String>,
    pub router: Service,
    /// Routers besides the first (`ClusterBuilder::routers`).
    pub more_routers: Vec<Service>,
    builder: ClusterBuilder,
    /// This cluster's certificates.
    dir: PathBuf,
    /// API keys by tenant.
    keys: std::collections::HashMap<String, String>,
    /// The GGUF of each node that serves another than the default model, by name.
    node_models: std::collections::HashMap<String, PathBuf>,
}

impl Cluster {
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder {
            more_routers: 0,
            netns: None,
            prefill: 1,
            decode: 1,
            kvstore: false,
            kvstore_args: Vec::new(),
            kvstore_budget: 200_000_000,
            router_args: Vec::new(),
            prefill_args: Vec::new(),
            decode_args: Vec::new(),
            env: Vec::new(),
            model: None,
            insecure: false,
            shared_ipc: false,
            tenants: Vec::new(),
            also: Vec::new(),
            tiers: None,
        }
    }

    fn node_args(&self, role: &str, name: &str, extra: &[&str]) -> Vec<String> {
        let model = match self.node_models.get(name) {
            Some(m) => m.display().to_string(),
            None => self.builder.model_arg(),
        };
        let any = format!("{}:0", self.builder.command(name).1);
        let mut a: Vec<String> = vec!["--listen".to_string(), any];
        for r in std::iter::once(&self.router).chain(&self.more_routers) {
            let internal = r.internal.as_deref().expect("a router's internal address");
            a.extend(["--router".to_string(), internal.to_string()]);
        }
        a.extend(
            ["--node-id", name, "--model", &model, "--threads", "1"].iter().map(|s| s.to_string()),
        );
        if !self.builder.insecure {
            let r = if role == "prefill" { MeshRole::Prefill } else { MeshRole::Decode };
            pki().issue(&self.dir, name, r);
        }
        a.extend(self.builder.tls_args(&self.dir, name));
        a.extend(
            if role == "prefill" { &self.builder.prefill_args } else { &self.builder.decode_args }
                .iter()
                .cloned(),
        );
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    /// Starts another prefill node (it registers by itself); returns its index.
    pub fn add_prefill(&mut self, extra: &[&str]) -> usize {
        let name = format!("prefill-{}", self.prefills.len());
        let args = self.node_args("prefill", &name, extra);
        self.prefills.push(self.builder.launch("prefill", &name, &args));
        self.prefills.len() - 1
    }

    /// Starts another decode node; returns its index.
    pub fn add_decode(&mut self, extra: &[&str]) -> usize {
        let name = format!("decode-{}", self.decodes.len());
        let args = self.node_args("decode", &name, extra);
        self.decodes.push(self.builder.launch("decode", &name, &args));
        self.decodes.len() - 1
    }

    /// Starts another prefill node of `model` (one the router serves); returns its index.
    pub fn add_prefill_of(&mut self, model: &Path, extra: &[&str]) -> usize {
        self.node_models.insert(format!("prefill-{}", self.prefills.len()), model.into());
        self.add_prefill(extra)
    }

    /// Starts another decode node of `model` (one the router serves); returns its index.
    pub fn add_decode_of(&mut self, model: &Path, extra: &[&str]) -> usize {
        self.node_models.insert(format!("decode-{}", self.decodes.len()), model.into());
        self.add_decode(extra)
    }

    /// Starts decode node `i` again (killing it first if it runs): same name, new port.
    pub fn restart_decode(&mut self, i: usize) {
        self.decodes[i].kill();
        let name = format!("decode-{i}");
        let args = self.node_args("decode", &name, &[]);
        self.decodes[i] = self.builder.launch("decode", &name, &args);
    }

    /// Kills the KV-store (SIGKILL) and starts it again with the same arguments on the same
    /// address, where the prefill nodes look for it.
    pub fn restart_kvstore(&mut self) {
        let k = self.kvstore.as_mut().expect("a cluster with a KV-store");
        k.kill();
        let listen = ["--listen".to_string(), k.addr.clone()];
        let args: Vec<String> = listen.into_iter().chain(self.kvstore_args.clone()).collect();
        *k = Service::start_with_env("kvstore", "kvstore", &args, &self.builder.env);
    }

    /// Starts prefill node `i` again (killing it first if it runs): same name, new port.
    pub fn restart_prefill(&mut self, i: usize) {
        self.prefills[i].kill();
        let name = format!("prefill-{i}");
        let args = self.node_args("prefill", &name, &[]);
        self.prefills[i] = self.builder.launch("prefill", &name, &args);
    }

    /// A channel to one of this cluster's processes, as the harness (a router's certificate).
    pub async fn channel(&self, addr: &str) -> Channel {
        let ep = if self.builder.insecure {
            tonic::transport::Endpoint::from_shared(format!("http://{addr}")).expect("an address")
        } else {
            self.endpoint_as(addr, &pki().harness)
        };
        ep.connect().await.unwrap_or_else(|e| panic!("{addr} unreachable: {e}"))
    }

    /// `endpoint_as` to this cluster's process at `addr`, whose role it knows.
    pub fn endpoint_as(&self, addr: &str, tls: &MeshTls) -> tonic::transport::Endpoint {
        endpoint_as(addr, tls, self.role_at(addr))
    }

    /// The role of this cluster's process at `addr` (a router's ports, or a node's).
    pub fn role_at(&self, addr: &str) -> MeshRole {
        let routers = std::iter::once(&self.router).chain(&self.more_routers);
        if routers.clone().any(|r| r.addr == addr || r.internal.as_deref() == Some(addr)) {
            return MeshRole::Router;
        }
        if self.prefills.iter().any(|p| p.addr == addr) {
            return MeshRole::Prefill;
        }
        if self.decodes.iter().any(|d| d.addr == addr) {
            return MeshRole::Decode;
        }
        if self.kvstore.as_ref().is_some_and(|k| k.addr == addr) {
            return MeshRole::KvStore;
        }
        panic!("no process of this cluster is at {addr}")
    }

    /// A client of the public API, as tenant "test".
    pub async fn client(&self) -> GenerationClient {
        self.client_with_key(self.keys.get("test").map(String::as_str)).await
    }

    /// A client of the public API, as `tenant` (one given to the builder).
    pub async fn client_as(&self, tenant: &str) -> GenerationClient {
        let key = self.keys.get(tenant).unwrap_or_else(|| panic!("no key for tenant {tenant}"));
        self.client_with_key(Some(key)).await
    }

    /// A client of the public API that sends `key` (None: no key at all).
    pub async fn client_with_key(&self, key: Option<&str>) -> GenerationClient {
        self.client_of(&self.router, key).await
    }

    /// A client of router `i` (0 is `router`), as tenant "test".
    pub async fn client_at(&self, i: usize) -> GenerationClient {
        self.client_at_as(i, "test").await
    }

    /// A client of router `i` as `tenant` (one given to the builder).
    pub async fn client_at_as(&self, i: usize, tenant: &str) -> GenerationClient {
        let r = if i == 0 { &self.router } else { &self.more_routers[i - 1] };
        let key = self.keys.get(tenant).unwrap_or_else(|| panic!("no key for tenant {tenant}"));
        self.client_of(r, Some(key)).await
    }

    async fn client_of(&self, router: &Service, key: Option<&str>) -> GenerationClient {
        let ch = self.channel(&router.addr).await;
        pdmesh_proto::v1::generation_client::GenerationClient::with_interceptor(
            ch,
            Bearer::new(key).expect("a header-safe key"),
        )
    }

    /// The API key of `tenant`.
    pub fn api_key(&self, tenant: &str) -> &str {
        &self.keys[tenant]
    }

    /// The directory of this cluster's certificates and key file.
    pub fn credentials(&self) -> &Path {
        &self.dir
    }

    pub async fn nodes(&self) -> Vec<NodeStatus> {
        self.nodes_at(0).await
    }

    /// The nodes router `i` knows (0 is `router`).
    pub async fn nodes_at(&self, i: usize) -> Vec<NodeStatus> {
        let r = if i == 0 { &self.router } else { &self.more_routers[i - 1] };
        let internal = r.internal.as_deref().expect("the router's internal address");
        let mut c = MembershipClient::new(self.channel(internal).await);
        c.list_nodes(ListNodesRequest {}).await.expect("ListNodes").into_inner().nodes
    }

    /// Waits until exactly `prefill` prefill and `decode` decode nodes are registered with
    /// every router.
    pub async fn wait_nodes(&self, prefill: usize, decode: usize) {
        for i in 0..=self.more_routers.len() {
            if i == 0 || self.more_routers[i - 1].is_running_ref() {
                self.wait_nodes_at(i, prefill, decode).await;
            }
        }
    }

    /// Waits until router `i` has exactly `prefill` prefill and `decode` decode nodes.
    pub async fn wait_nodes_at(&self, i: usize, prefill: usize, decode: usize) {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let n = self.nodes_at(i).await;
            let count = |r: Role| n.iter().filter(|x| x.role == r as i32).count();
            if count(Role::Prefill) == prefill && count(Role::Decode) == decode {
                return;
            }
            assert!(
                Instant::now() < until,
                "wanted {prefill} prefill and {decode} decode nodes, router has {:?}",
                n.iter().map(|x| &x.node_id).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn prefill_stats(&self, i: usize) -> NodeStats {
        let mut c = PrefillClient::new(self.channel(&self.prefills[i].addr).await);
        c.stats(StatsRequest {}).await.expect("Stats").into_inner()
    }

    pub async fn decode_stats(&self, i: usize) -> NodeStats {
        let mut c = DecodeClient::new(self.channel(&self.decodes[i].addr).await);
        c.stats(StatsRequest {}).await.expect("Stats").into_inner()
    }

    /// Waits until every running node has all its KV blocks free (decode nodes: none
    /// committed either).
    pub async fn wait_blocks_free(&self) {
        let wait = Duration::from_secs(30);
        for (i, d) in self.decodes.iter().enumerate() {
            if d.is_running_ref() {
                eventually(wait, &format!("decode-{i} blocks all free"), || async move {
                    let l = self.decode_stats(i).await.load.unwrap_or_default();
                    l.free_blocks == l.total_blocks && l.committed_blocks == 0
                })
                .await;
            }
        }
        for (i, p) in self.prefills.iter().enumerate() {
            if p.is_running_ref() {
                eventually(wait, &format!("prefill-{i} blocks all free"), || async move {
                    let l = self.prefill_stats(i).await.load.unwrap_or_default();
                    l.free_blocks == l.total_blocks
                })
                .await;
            }
        }
    }

    /// KV transfers decode node `i` received over `transport`.
    pub async fn received(&self, i: usize, transport: &str) -> u64 {
        let s = self.decode_stats(i).await;
        s.transports.iter().filter(|t| t.transport == transport).map(|t| t.transfers).sum()
    }

    /// A Decode client acting as the router.
    pub async fn decode_client(&self, i: usize) -> DecodeClient<Channel> {
        DecodeClient::new(self.channel(&self.decodes[i].addr).await)
    }
}

/// Polls `probe` until it returns true, failing the test with `what` after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = Instant::now() + timeout;
    while !probe().await {
        assert!(Instant::now() < until, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
