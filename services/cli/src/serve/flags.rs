//! The flags of `pdmesh router|prefill|decode|kvstore`: each service's settings as its config
//! struct derives them (`pdmesh_settings::Settings`: names, help and defaults written once, on
//! the struct), plus what only a process has: its config file, and how `pdmesh up` and
//! `--sim-nodes` run it.

use std::path::PathBuf;

use clap::Args;

/// What every service command takes beside its settings.
#[derive(Debug, Clone, Args)]
pub struct ProcessFlags {
    /// TOML config file (see deploy/config/ for one per service, every key spelled out).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Stop when stdin closes (used by `pdmesh up` so children never outlive it).
    #[arg(long, hide = true)]
    pub(crate) exit_with_stdin: bool,
}

/// What a node command takes to host several simulated nodes.
#[derive(Debug, Clone, Args)]
pub struct FleetFlags {
    /// With --engine sim: host this many simulated nodes in this process, each with its own
    /// listener (port 0: any free one; port P: P, P+1, …; on 127.0.0.1 each its own loopback
    /// address, 127.1.x.y) and its own router sessions, named NODE_ID-0, NODE_ID-1, …
    /// (plaintext on loopback only: one process has one certificate).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub(crate) sim_nodes: usize,
}

/// `pdmesh prefill|decode`: a node's settings (`S`, derived from its config struct).
#[derive(Debug, Args)]
pub struct NodeArgs<S: Args> {
    #[command(flatten)]
    pub(crate) process: ProcessFlags,
    #[command(flatten)]
    pub(crate) fleet: FleetFlags,
    #[command(flatten)]
    pub(crate) settings: S,
}

/// `pdmesh router|kvstore`: a service's settings (`S`), in one process.
#[derive(Debug, Args)]
pub struct ServiceArgs<S: Args> {
    #[command(flatten)]
    pub(crate) process: ProcessFlags,
    #[command(flatten)]
    pub(crate) settings: S,
}

pub type DecodeArgs = NodeArgs<pdmesh_decode::DecodeFlags>;
pub type PrefillArgs = NodeArgs<pdmesh_prefill::PrefillFlags>;
pub type RouterArgs = ServiceArgs<pdmesh_router::RouterFlags>;
pub type KvStoreArgs = ServiceArgs<pdmesh_kvstore::KvStoreFlags>;

/// Appends each setting's default, as the config struct's `Default` has it, to its flag's
/// help: `[default: …]` comes from the one place the value is written.
pub fn with_defaults(
    mut cmd: clap::Command,
    defaults: &serde_json::Value,
    keys: &[(&'static str, String)],
) -> clap::Command {
    for (id, pointer) in keys {
        let shown = match defaults.pointer(pointer) {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::Array(a)) if a.is_empty() => continue,
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
        };
        cmd = cmd.mut_arg(*id, |a| {
            let help = a.get_help().map(ToString::to_string).unwrap_or_default();
            let a = a.help(format!("{help} [default: {shown}]"));
            match a.get_long_help().map(ToString::to_string) {
                Some(long) => a.long_help(format!("{long} [default: {shown}]")),
                None => a,
            }
        });
    }
    cmd
}
