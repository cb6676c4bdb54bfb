//! Harness for tests of the whole mesh: `Cluster`, a mesh of real `pdmesh` processes on the
//! real model (where the binary and the model are, a runner that captures output), and
//! `inprocess::Mesh`, the real services started in this process on the tiny model.

pub mod cluster;
pub mod inprocess;
pub use pdmesh_cli::netns;
pub mod reference;
pub mod service;

pub use cluster::{Cluster, ClusterBuilder, eventually};
/// A client of the public API that sends an API key (`Cluster::client`).
pub use pdmesh_common::apikey::GenerationClient as Client;

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs an `async fn name(transport: &str)` test once per KV transport, as `name::grpc` and
/// `name::ucx`: every mesh behaviour must hold whichever transport moves the KV.
#[macro_export]
macro_rules! per_transport {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn grpc() {
                super::$name("grpc").await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ucx() {
                super::$name("ucx").await
            }
        }
    )*};
}

/// A greedy request for these token ids that ignores end-of-turn tokens.
pub fn greedy(ids: &[u32], max_tokens: u32) -> pdmesh_proto::v1::GenerateRequest {
    use pdmesh_proto::v1::{GenerateRequest, TokenIds, generate_request};
    GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids: ids.to_vec() })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// A response stream's tokens and its `Finished`, or its first error.
pub async fn collect(
    mut s: tonic::Streaming<pdmesh_proto::v1::GenerateResponse>,
) -> Result<(Vec<u32>, Option<pdmesh_proto::v1::Finished>), tonic::Status> {
    use pdmesh_proto::v1::generate_response::Event;
    let (mut toks, mut finished) = (Vec::new(), None);
    while let Some(m) = s.message().await? {
        match m.event {
            Some(Event::Delta(d)) => toks.extend(d.token_ids),
            Some(Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    Ok((toks, finished))
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `pdmesh` binary of this build. `cargo test --workspace` (`just test`) builds it; running
/// only this crate's tests (`-p pdmesh-integration`) does not, so build `pdmesh-cli` first.
pub fn pdmesh_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> → target/<profile>/pdmesh
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|p| p.join(format!("pdmesh{}", std::env::consts::EXE_SUFFIX)))
        .expect("test binary lives in target/<profile>/deps");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p pdmesh-cli`",
        bin.display()
    );
    bin
}

/// The default model, which `just fetch-model` provides, or the file `PDMESH_TEST_MODEL` names
/// (the GPU tier's synthetic SmolLM2, where the real file cannot travel).
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("PDMESH_TEST_MODEL")
        .map_or_else(|| repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"), PathBuf::from);
    assert!(p.exists(), "{} is missing: run `just fetch-model`", p.display());
    p
}

/// A `pdmesh` command preset with the default model and two threads.
pub fn pdmesh(args: &[&str]) -> Command {
    let mut c = Command::new(pdmesh_bin());
    c.args(args).arg("--model").arg(model_path()).args(["--threads", "2"]);
    c
}

/// Spawns `c` (a `pdmesh up` command) and returns it once it printed that its mesh is ready;
/// the rest of its stdout is drained so it never blocks on a full pipe.
pub fn spawn_up(mut c: Command) -> std::process::Child {
    use std::io::BufRead;
    use std::process::Stdio;
    let mut up = c
        .env("PDMESH_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("pdmesh up starts");
    let mut lines = std::io::BufReader::new(up.stdout.take().expect("piped")).lines();
    loop {
        let l = lines.next().expect("up printed its readiness").expect("up's stdout");
        if l.contains("mesh ready") {
            break;
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    up
}

/// Runs a command and returns (exit code, stdout, stderr).
pub fn run(mut c: Command) -> (i32, String, String) {
    let Output { status, stdout, stderr } = c.output().expect("pdmesh starts");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

/// The fields of `/proc/<pid>/stat` after the command name (state first, then the parent's
/// pid, …), or None when the process is gone.
pub fn proc_stat(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.split_whitespace().map(str::to_string).collect())
}

/// The pid of a direct child of `parent` whose command line contains `needle`.
pub fn child_pid(parent: u32, needle: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let ppid: u32 = proc_stat(pid)?.get(1)?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        (ppid == parent && cmd.contains(needle)).then_some(pid)
    })
}

/// The samples of one scrape, by series (`name{labels}`), and the raw response.
pub async fn scrape(addr: &str) -> (std::collections::HashMap<String, f64>, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("metrics port reachable");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .expect("scrape sent");
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.expect("scrape read");
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    let body = raw.split_once("\r\n\r\n").expect("a body").1.to_string();
    let samples = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect();
    (samples, raw)
}
