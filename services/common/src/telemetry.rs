//! Logging setup shared by every service: human-readable lines on stderr, filtered by
//! `PDMESH_LOG` (or `RUST_LOG`), `info` by default.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber once; later calls do nothing (tests start several services).
pub fn init_logging() {
    let filter = std::env::var("PDMESH_LOG")
        .ok()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| "info".into());
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(filter))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
