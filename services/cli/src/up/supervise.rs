//! `pdmesh up`'s supervision: each child started on its config file, restarted with back-off
//! when it dies, and with `--autoscale` nodes started or drained as the router's planner asks.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{ListNodesRequest, Role};

use pdmesh_cli::process::{Proc, spawn_announcing};

use super::SEAL_KEY_FILE;
use super::children::{NodeTemplate, Settings, node_settings};

/// How often --autoscale reads the planner's decision.
pub(super) const AUTOSCALE_EVERY: Duration = Duration::from_secs(2);

/// How `up` starts a child: its certificate (or `--insecure`) and where its config goes.
#[derive(Debug, Clone)]
pub(super) struct Launch {
    pub(super) tls_dir: Option<PathBuf>,
    pub(super) configs: PathBuf,
}

impl Launch {
    /// Writes `settings` to `<name>.toml` and starts the child on it, supervised.
    pub(super) async fn start(
        &self,
        name: &str,
        cpus: Option<String>,
        settings: Settings,
        announces: usize,
    ) -> anyhow::Result<Supervised> {
        let file = self.configs.join(format!("{name}.toml"));
        let mut args =
            vec![settings.service().to_string(), "--config".into(), file.display().to_string()];
        // Each process gets its own certificate, named as it is; or all run --insecure.
        match &self.tls_dir {
            Some(d) => args.extend([
                "--tls-dir".into(),
                d.display().to_string(),
                "--tls-name".into(),
                name.into(),
                "--seal-key".into(),
                d.join(SEAL_KEY_FILE).display().to_string(),
            ]),
            None => args.push("--insecure".into()),
        }
        let mut p = Supervised {
            name: name.to_string(),
            cpus,
            args,
            file,
            settings,
            announces,
            addrs: Vec::new(),
            proc: None,
            started: Instant::now(),
            deaths: 0,
            due: None,
            role: None,
            model: 0,
            retiring: false,
        };
        p.write()?;
        let (proc, addrs) =
            spawn_announcing(&p.name, p.cpus.as_deref(), &p.args, p.announces).await?;
        (p.proc, p.addrs) = (Some(proc), addrs);
        Ok(p)
    }
}

/// Starts node `i` of `role` of model `k` under supervision.
pub(super) async fn start_node(
    t: &NodeTemplate<'_>,
    k: usize,
    role: &str,
    i: usize,
) -> anyhow::Result<Supervised> {
    let name = super::UpArgs::node_name(k, role, i);
    let (settings, cpus) = node_settings(t, k, role == "prefill", &name);
    let mut node = t.launch.start(&name, cpus, settings, 1).await?;
    node.role = Some(if role == "prefill" { Role::Prefill } else { Role::Decode });
    node.model = k;
    Ok(node)
}

/// The planner's `pdmesh_planner_desired_nodes` (prefill, decode) of `model`'s pool, scraped
/// from the router's metrics endpoint (`http://ADDR/metrics`).
pub(super) async fn desired_nodes(endpoint: &str, model: &str) -> anyhow::Result<(usize, usize)> {
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
        let series = format!("pdmesh_planner_desired_nodes{{role=\"{role}\",model=\"{model}\"}} ");
        let line = body
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .with_context(|| format!("no {series}yet"))?;
        Ok(line.trim().parse::<f64>()? as usize)
    };
    Ok((gauge("prefill")?, gauge("decode")?))
}

/// One step towards model `k`'s planner's pools: a node of it started, or one drained, per
/// role.
pub(super) async fn autoscale(
    t: &NodeTemplate<'_>,
    procs: &mut Vec<Supervised>,
    k: usize,
    (prefill, decode): (usize, usize),
) {
    let a = t.a;
    for (role, name, want) in
        [(Role::Prefill, "prefill", prefill), (Role::Decode, "decode", decode)]
    {
        let want = want.clamp(a.nodes(name, k), a.most(name, k));
        let serving: Vec<usize> = (0..procs.len())
            .filter(|&i| procs[i].role == Some(role) && procs[i].model == k && !procs[i].retiring)
            .collect();
        if want > serving.len() {
            // The lowest free name, so names (and their certificates) are reused.
            let node = |i: usize| super::UpArgs::node_name(k, name, i);
            let taken = |i: usize| procs.iter().any(|p| p.name == node(i));
            let Some(i) = (0..a.most(name, k)).find(|&i| !taken(i)) else { continue };
            eprintln!("pdmesh: the planner wants {want} {name} nodes; starting {}", node(i));
            match start_node(t, k, name, i).await {
                Ok(started) => procs.push(started),
                Err(e) => eprintln!("pdmesh: starting {} failed: {e:#}", node(i)),
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
pub(super) struct Supervised {
    pub(super) name: String,
    pub(super) cpus: Option<String>,
    pub(super) args: Vec<String>,
    /// Its config file, `settings` as TOML.
    pub(super) file: PathBuf,
    pub(super) settings: Settings,
    /// Addresses it announces (the router: public and internal).
    pub(super) announces: usize,
    /// What it announced when it last started.
    pub(super) addrs: Vec<String>,
    pub(super) proc: Option<Proc>,
    pub(super) started: Instant,
    /// Quick deaths in a row.
    pub(super) deaths: u32,
    /// When it is to be started again, after a death.
    pub(super) due: Option<Instant>,
    /// A node's role (--autoscale counts them).
    pub(super) role: Option<Role>,
    /// A node's model (its index among `--model`s).
    pub(super) model: usize,
    /// Drained on purpose: not restarted when it exits.
    pub(super) retiring: bool,
}

impl Supervised {
    fn write(&self) -> anyhow::Result<()> {
        let text = self.settings.toml().with_context(|| format!("{}'s settings", self.name))?;
        std::fs::write(&self.file, text).with_context(|| format!("writing {}", self.file.display()))
    }

    /// Keeps the addresses it announced for its later starts.
    pub(super) fn pin(&mut self) {
        self.settings.pin(&self.addrs);
        if let Err(e) = self.write() {
            eprintln!("pdmesh: {e:#}; a restart may move it");
        }
    }

    /// Drains it (SIGTERM: a decode node hands its streams to the others with their KV) and
    /// lets it go.
    pub(super) fn retire(&mut self) {
        self.retiring = true;
        if let Some(p) = &self.proc {
            p.terminate();
        }
    }

    /// Notices a death and schedules the restart; restarts when it is due.
    pub(super) async fn tend(&mut self, now: Instant) {
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

pub(super) async fn wait_ready(
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
