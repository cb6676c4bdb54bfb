//! Child processes of the `pdmesh` binary: starting a service of this same build and reading
//! the address it announces, stopping a set of them cleanly, and the signals a service stops
//! on. Shared by `pdmesh up` and the tools (`pdmesh-tools`) that start nodes of their own.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The `pdmesh` binary of this build: this process, or the one beside it (the tools binary
/// lives next to it).
pub fn pdmesh_exe() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("finding the pdmesh binary")?;
    if me.file_stem().is_some_and(|s| s == "pdmesh") {
        return Ok(me);
    }
    let beside = me.with_file_name("pdmesh");
    anyhow::ensure!(
        beside.exists(),
        "{} not found: build it with `cargo build --release -p pdmesh-cli`",
        beside.display()
    );
    Ok(beside)
}

/// A child node process; it ends with us (its stdin closes, and it is killed on drop).
pub struct Proc {
    name: String,
    child: Child,
}

impl std::fmt::Debug for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proc").field("name", &self.name).field("pid", &self.child.id()).finish()
    }
}

impl Proc {
    /// Sends SIGTERM: a service stops as an orchestrator stops it (a decode node drains).
    pub fn terminate(&self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
    }

    /// How it ended, if it has.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(format!("{} exited ({status})", self.name)),
            _ => None,
        }
    }
}

/// Starts `pdmesh <args>` and returns it with the address it announced.
pub async fn spawn(
    name: &str,
    cpus: Option<&str>,
    args: &[String],
) -> anyhow::Result<(Proc, String)> {
    let (p, mut addrs) = spawn_announcing(name, cpus, args, 1).await?;
    Ok((p, addrs.remove(0)))
}

/// Starts `pdmesh <args>` and returns it with the first `n` addresses it announces (`pdmesh
/// <service> listening on ADDR`, then the router's `internal on ADDR`).
pub async fn spawn_announcing(
    name: &str,
    cpus: Option<&str>,
    args: &[String],
    n: usize,
) -> anyhow::Result<(Proc, Vec<String>)> {
    let prefix = cpus.map(|c| ["taskset", "-c", c].map(String::from).to_vec());
    spawn_under(name, &prefix.unwrap_or_default(), args, n).await
}

/// `spawn_announcing`, run under `prefix` (a command that runs the rest of its arguments,
/// e.g. `netns::Netns::command_prefix`'s).
pub async fn spawn_under(
    name: &str,
    prefix: &[String],
    args: &[String],
    n: usize,
) -> anyhow::Result<(Proc, Vec<String>)> {
    let exe = pdmesh_exe()?;
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut t = Command::new(first);
            t.args(rest).arg(&exe);
            t
        }
        None => Command::new(&exe),
    };
    // Tells the processes apart in traces (prefill-0, prefill-1, ...) unless the user did.
    let attrs = std::env::var("OTEL_RESOURCE_ATTRIBUTES").unwrap_or_default();
    if !attrs.contains("service.instance.id=") {
        let sep = if attrs.trim().is_empty() { "" } else { "," };
        cmd.env("OTEL_RESOURCE_ATTRIBUTES", format!("{attrs}{sep}service.instance.id={name}"));
    }
    cmd.args(args)
        .arg("--exit-with-stdin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut addrs = Vec::with_capacity(n);
    while addrs.len() < n {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .with_context(|| format!("{name} did not start listening in 60 s"))??
            .with_context(|| format!("{name} exited before listening (see its log above)"))?;
        let addr = [" listening on ", " internal on ", " http on ", " metrics on "]
            .iter()
            .find_map(|m| line.rsplit_once(m))
            .map(|(_, a)| a.trim().to_string())
            .with_context(|| format!("{name} printed {line:?}, not its address"))?;
        addrs.push(addr);
    }
    // Anything else the child prints goes to our stderr rather than filling a pipe.
    tokio::spawn(async move {
        while let Ok(Some(l)) = lines.next_line().await {
            eprintln!("{l}");
        }
    });
    Ok((Proc { name: name.to_string(), child }, addrs))
}

/// Closes every child's stdin (a clean stop), then kills those still running after 10 s.
pub async fn stop(mut procs: Vec<Proc>) {
    for p in procs.iter_mut() {
        drop(p.child.stdin.take());
    }
    let until = Instant::now() + Duration::from_secs(10);
    for p in procs.iter_mut() {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, p.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                eprintln!("{} did not stop in time; killing it", p.name);
                let _ = p.child.kill().await;
            }
        }
    }
}

/// Completes on Ctrl-C, SIGTERM, or (with `--exit-with-stdin`) when stdin closes.
pub async fn shutdown_signal(watch_stdin: bool) {
    let stdin_closed = async {
        if watch_stdin {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 64];
            let mut stdin = tokio::io::stdin();
            while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
        } else {
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
        () = stdin_closed => {}
    }
    tracing::info!("shutting down");
}
