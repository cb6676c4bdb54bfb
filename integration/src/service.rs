//! One `pdmesh` service process of a test cluster: started with its stdin a pipe (so it
//! stops when the test goes away), its announced addresses read from stdout, and the faults a
//! test plays on it (kill, pause, terminate).

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::pdmesh_bin;

/// One service process.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    pub addr: String,
    /// The router's internal (membership) address.
    pub internal: Option<String>,
    /// The router's OpenAI HTTP API address, when started with `--http-listen`.
    pub http: Option<String>,
    /// `host:port` of its `/metrics`, when started with `--metrics-listen`.
    pub metrics: Option<String>,
    pub(crate) child: Option<Child>,
    stdin: Option<ChildStdin>,
}

impl Service {
    /// Starts `pdmesh <role> <args>` and waits for its "listening on" line.
    pub fn start(role: &str, name: &str, args: &[String]) -> Service {
        Self::start_with_env(role, name, args, &[])
    }

    /// `start`, with these environment variables set for the process.
    pub fn start_with_env(
        role: &str,
        name: &str,
        args: &[String],
        env: &[(String, String)],
    ) -> Service {
        Self::spawn(Command::new(pdmesh_bin()), role, name, args, env)
    }

    /// `start` with at most `files` open file descriptors (`ulimit -n`).
    pub fn start_with_fd_limit(role: &str, name: &str, args: &[String], files: u32) -> Service {
        let mut c = Command::new("sh");
        c.args(["-c", &format!("ulimit -n {files} && exec \"$0\" \"$@\"")]).arg(pdmesh_bin());
        Self::spawn(c, role, name, args, &[])
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("process running").id()
    }

    pub(crate) fn spawn(
        mut c: Command,
        role: &str,
        name: &str,
        args: &[String],
        env: &[(String, String)],
    ) -> Service {
        c.envs(env.iter().map(|(k, v)| (k, v)));
        c.arg(role)
            .args(args)
            .arg("--exit-with-stdin")
            .env("PDMESH_LOG", std::env::var("PDMESH_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = c.spawn().expect("pdmesh starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        // The address the next line announces after `marker` (`pdmesh <service> listening on
        // ADDR`, then the router's internal and HTTP listeners, then the metrics page).
        let mut announced = |marker: &str| {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("{name} exited before announcing{marker}ADDR"))
                .expect("reading the child's stdout");
            let addr = line.rsplit_once(marker).map(|(_, a)| a.trim().to_string());
            addr.unwrap_or_else(|| panic!("{name} printed {line:?}"))
        };
        let addr = announced(" listening on ");
        let internal = (role == "router").then(|| announced(" internal on "));
        let flag = |f: &str| args.iter().any(|a| a == f);
        let http = flag("--http-listen").then(|| announced(" http on "));
        let metrics = flag("--metrics-listen").then(|| {
            let page = announced(" metrics on http://");
            let addr = page.strip_suffix("/metrics").map(str::to_string);
            addr.unwrap_or_else(|| panic!("{name} serves metrics at {page:?}"))
        });
        // Drain anything else so the child never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        let stdin = child.stdin.take();
        Service { name: name.to_string(), addr, internal, http, metrics, child: Some(child), stdin }
    }

    /// SIGKILL: the process dies at once, mid-whatever.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP (`resume` sends SIGCONT): the process hangs without dying, sockets open.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("process running").id().to_string();
        let ok = Command::new("kill").args([sig, &pid]).status().expect("kill runs").success();
        assert!(ok, "kill {sig} {pid} failed");
    }

    /// SIGTERM, as an orchestrator stops a process; `exited` waits for it.
    pub fn terminate(&self) {
        self.signal("-TERM");
    }

    /// Waits up to `within` for the process to exit; its status (None: still running).
    pub fn exited(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + within;
        let c = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                self.child = None;
                return Some(status);
            }
            if Instant::now() > until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A clean stop (stdin closes), waiting for the process to exit.
    pub fn stop(&mut self) {
        drop(self.stdin.take());
        if let Some(mut c) = self.child.take() {
            let until = Instant::now() + Duration::from_secs(15);
            loop {
                match c.try_wait() {
                    Ok(Some(status)) => {
                        assert!(
                            status.success(),
                            "{} exited with {status} on a clean stop",
                            self.name
                        );
                        return;
                    }
                    _ if Instant::now() > until => {
                        let _ = c.kill();
                        let _ = c.wait();
                        panic!("{} did not stop within 15 s of its stdin closing", self.name);
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }

    /// Whether the process was neither killed nor stopped by the test.
    pub fn is_running_ref(&self) -> bool {
        self.child.is_some()
    }
}

/// Whether process `pid` has exited but was not reaped (a zombie), or is gone.
pub(crate) fn zombie(pid: u32) -> bool {
    crate::proc_stat(pid).is_none_or(|f| f.first().is_some_and(|s| s == "Z"))
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}
