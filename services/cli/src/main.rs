//! `pdmesh`: the product's one binary. `up` starts a whole mesh on this machine; `router`,
//! `prefill`, `decode` and `kvstore` run one service each; `generate` is a client of a running
//! mesh; `run` and `perplexity` use the engine in this process. The benchmarks, the trace
//! replay and the trace collector live in the tools binary beside it (`pdmesh-tools`), and
//! `pdmesh bench|replay|collect` runs them there.

mod generate;
mod models;
mod perplexity;
mod run;
mod serve;
mod up;

use std::ffi::OsString;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "pdmesh",
    version,
    about = "pdmesh: disaggregated LLM serving (prefill and decode pools, shared prefix cache)",
    long_about = "pdmesh serves GGUF models of the llama, qwen2 and qwen3 architectures.\n\n\
        `pdmesh up` starts a mesh on this machine and `pdmesh generate` talks to it;\n\
        `pdmesh router|prefill|decode` run one service each (for clusters). Local\n\
        commands (`run`, `perplexity`) use the engine in this process. The default model\n\
        is SmolLM2-135M-Instruct (Q4_1), fetched by `just fetch-model` into models/.",
    after_help = "Tools (in the pdmesh-tools binary beside this one, run as `pdmesh <tool>`):\n  \
        bench        Drive a running mesh (TTFT, TPOT, goodput); `bench engine`, `bench kv`\n  \
        replay       Replay a Mooncake-format trace against a running mesh\n  \
        collect      Receive OTLP spans and print them (Jaeger's job, without Jaeger)\n  \
        synth-model  A model's shape with seeded random weights (the GPU tier's models)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    tls: pdmesh_cli::client::TlsFlags,
    /// The mesh's seal key (64 hex digits; `pdmesh certs seal-key`): every UCX worker address
    /// and remote key a node hands out is sealed with it (HMAC-SHA256), and none is accepted
    /// unless it is, so a forged target never reaches UCX. Same file on every node.
    #[arg(long, global = true, value_name = "FILE", env = "PDMESH_SEAL_KEY")]
    seal_key: Option<std::path::PathBuf>,
}

/// Sets a service's TLS from the flags: certificates, or plaintext when asked for.
fn init_service_tls(cli: &Cli) -> anyhow::Result<()> {
    let Some(tls) = cli.tls.explicit()? else {
        anyhow::bail!(
            "the mesh runs mutual TLS: give --tls-dir DIR --tls-name NAME (certificates from \
             the mesh's CA; `pdmesh up` makes throwaway ones, deploy/ shows cert-manager), or \
             --insecure for plaintext on loopback addresses"
        )
    };
    pdmesh_common::tls::init(tls);
    Ok(())
}

fn init_tls(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Router(_) | Command::Prefill(_) | Command::Decode(_) | Command::Kvstore(_) => {
            init_service_tls(cli)?;
            match &cli.seal_key {
                Some(f) => {
                    let key = pdmesh_kv_ucx::read_seal_key(f).map_err(anyhow::Error::msg)?;
                    pdmesh_kv_ucx::set_seal_key(&key);
                }
                // The router never hands out or opens a UCX target; with TLS every node
                // must seal them: a checksum stops accidents, not a member of the mesh who
                // forges a target.
                None if cli.tls.insecure || matches!(cli.command, Command::Router(_)) => {}
                None => anyhow::bail!(
                    "the mesh runs mutual TLS, so UCX targets are sealed: give --seal-key FILE \
                     (or PDMESH_SEAL_KEY), the same file on every node (`pdmesh certs \
                     seal-key --file FILE` makes one; `pdmesh up` makes its own)"
                ),
            }
            Ok(())
        }
        Command::Up(_) => {
            anyhow::ensure!(
                cli.tls.tls_dir.is_none() && cli.tls.tls_name.is_none(),
                "`pdmesh up` makes its own certificates (or none with --insecure)"
            );
            Ok(())
        }
        // The client finds its credentials itself (`pdmesh_cli::client`).
        _ => Ok(()),
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a whole mesh on this machine: a router plus prefill and decode nodes, each its
    /// own process. Prints the router's endpoint once every node has registered.
    Up(up::UpArgs),
    /// Stream a completion from a running mesh.
    Generate(generate::GenerateArgs),
    /// Make a mesh CA and certificates for its processes (without cert-manager: for
    /// Secrets, compose, or a handful of machines).
    Certs(CertsArgs),
    /// Make an API key for a tenant: appends its hash to the router's key file and prints
    /// the key (once: only the hash is kept).
    ApiKey(ApiKeyArgs),
    /// Run a router: the public Generation API, admission, placement, membership.
    Router(serve::RouterArgs),
    /// Run a prefill node: computes prompts' KV and pushes it to decode nodes.
    Prefill(serve::PrefillArgs),
    /// Run a decode node: holds KV reservations and generates tokens.
    Decode(serve::DecodeArgs),
    /// Run a KV-store: the mesh-wide prefix cache of KV blocks, addressed by content.
    Kvstore(serve::KvStoreArgs),
    /// Generate text from a prompt on this machine, streaming it to stdout.
    Run(run::RunArgs),
    /// Score a text file: perplexity over non-overlapping windows of --ctx tokens.
    Perplexity(perplexity::PerplexityArgs),
    /// Look inside model files: `models inspect FILE` prints architecture, formats per
    /// tensor, context, vocabulary and the KV ledger, and whether pdmesh serves the file.
    Models(models::ModelsArgs),
    /// Write the logits of every position of a token sequence as raw little-endian f32
    /// (fidelity tooling: compared against llama.cpp by scripts/compare_llamacpp.py).
    #[command(hide = true)]
    DumpLogits(perplexity::DumpLogitsArgs),
    /// A tool of the tools binary (`bench`, `replay`, `collect`, `synth-model`).
    #[command(external_subcommand)]
    Tool(Vec<OsString>),
}

#[derive(Debug, clap::Args)]
struct ApiKeyArgs {
    /// The tenant the key is for (its requests, limits and prefix cache are its own).
    #[arg(long)]
    tenant: String,
    /// The router's key file (`--api-keys`); made if missing.
    #[arg(long, value_name = "FILE")]
    file: std::path::PathBuf,
    /// The tenant's requests in flight at once (default: only the router's limit).
    #[arg(long)]
    max_in_flight: Option<usize>,
    /// Share cached prompt prefixes with the other tenants of this group (default: the
    /// tenant's own).
    #[arg(long)]
    cache_group: Option<String>,
    /// The lossy KV policy of this tenant's requests that name none: `sinks:BUDGET[:SINKS]`
    /// or `h2o:BUDGET[:RECENT]` (default: none, full attention).
    #[arg(long)]
    kv_policy: Option<pdmesh_kv_types::KvPolicy>,
    /// The model of the tenant's requests that name none: a served model's id, or `auto`
    /// (tiered routing); default: the router's default model.
    #[arg(long, value_name = "MODEL")]
    default_model: Option<String>,
}

fn api_key(a: ApiKeyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!a.tenant.is_empty(), "--tenant must not be empty");
    anyhow::ensure!(a.max_in_flight != Some(0), "--max-in-flight must be at least 1");
    let tenant = pdmesh_common::apikey::Tenant {
        tenant: a.tenant,
        max_in_flight: a.max_in_flight,
        cache_group: a.cache_group,
        kv_policy: a.kv_policy,
        default_model: a.default_model,
    };
    let key = pdmesh_common::apikey::add(&a.file, tenant)?;
    println!("{key}");
    Ok(())
}

#[derive(Debug, clap::Args)]
struct CertsArgs {
    #[command(subcommand)]
    what: CertsCommand,
}

#[derive(Debug, clap::Subcommand)]
enum CertsCommand {
    /// A new seal key for UCX targets (`--seal-key`), written to FILE (owner-only).
    SealKey {
        #[arg(long)]
        file: std::path::PathBuf,
    },
    /// A new CA: DIR/ca.pem (give it to every process) and DIR/ca.key (keep it private).
    Ca {
        #[arg(long)]
        dir: std::path::PathBuf,
        /// Days the CA is good for; replacing it is a rotation of the whole mesh.
        #[arg(long, default_value_t = 1825, value_parser = clap::value_parser!(u32).range(1..=3650))]
        days: u32,
    },
    /// A certificate for one process, signed by the CA in --ca-dir: DIR/NAME.pem and
    /// DIR/NAME.key, with DIR/ca.pem beside them. Its role decides what it may call.
    Issue {
        /// Where the CA is (ca.pem, ca.key).
        #[arg(long)]
        ca_dir: std::path::PathBuf,
        /// Where to write (default: --ca-dir).
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
        /// The process's name (a node's id).
        #[arg(long)]
        name: String,
        /// router, prefill, decode, kvstore or admin (operators' tools).
        #[arg(long, value_parser = parse_role)]
        role: pdmesh_common::tls::MeshRole,
        /// A DNS name or IP address HTTPS clients dial the process by (a router serving
        /// the OpenAI API); repeat for several.
        #[arg(long = "host", value_name = "HOST")]
        hosts: Vec<String>,
        /// Days the certificate is good for: renew it before then (cert-manager does at two
        /// thirds); a running process takes the renewed files within seconds.
        #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u32).range(1..=825))]
        days: u32,
    },
}

fn parse_role(s: &str) -> Result<pdmesh_common::tls::MeshRole, String> {
    pdmesh_common::tls::MeshRole::parse(s)
        .ok_or_else(|| "expected router, prefill, decode, kvstore or admin".into())
}

fn certs(a: CertsArgs) -> anyhow::Result<()> {
    use pdmesh_common::tls::Ca;
    match a.what {
        CertsCommand::SealKey { file } => {
            // Replacing a mesh's key would lock out every node still holding the old one.
            anyhow::ensure!(!file.exists(), "{} exists; remove it first", file.display());
            let key = format!("{}\n", pdmesh_kv_ucx::new_seal_key());
            pdmesh_common::config::write_private(&file, key.as_bytes())
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            println!("{}", file.display());
        }
        CertsCommand::Ca { dir, days } => {
            anyhow::ensure!(
                !dir.join("ca.key").exists(),
                "{} already holds a CA; remove it first to make another",
                dir.display()
            );
            Ca::generate_for(days_of(days))?.write(&dir, true)?;
            println!("{}", dir.join("ca.pem").display());
        }
        CertsCommand::Issue { ca_dir, dir, name, role, hosts, days } => {
            let dir = dir.unwrap_or_else(|| ca_dir.clone());
            let ca = Ca::load(&ca_dir)?.with_leaf_validity(days_of(days));
            ca.issue_for_hosts(&dir, &name, role, &hosts)?;
            println!("{}", dir.join(format!("{name}.pem")).display());
        }
    }
    Ok(())
}

fn days_of(days: u32) -> std::time::Duration {
    std::time::Duration::from_secs(u64::from(days) * 86_400)
}

/// The commands the tools binary provides.
const TOOLS: [&str; 4] = ["bench", "replay", "collect", "synth-model"];

/// Runs `pdmesh-tools <args>` in this process's place.
fn tool(args: Vec<OsString>) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let name = args.first().and_then(|a| a.to_str()).unwrap_or_default().to_string();
    anyhow::ensure!(
        TOOLS.contains(&name.as_str()),
        "unknown command {name:?} (see `pdmesh --help`)"
    );
    let me = std::env::current_exe()?;
    let tools = me.with_file_name("pdmesh-tools");
    anyhow::ensure!(
        tools.exists(),
        "`pdmesh {name}` is in the tools binary, {}, which is not built: \
         `cargo build --release -p pdmesh-tools`",
        tools.display()
    );
    // exec returns only if it failed.
    let e = std::process::Command::new(&tools).args(&args).exec();
    Err(anyhow::Error::new(e).context(format!("running {}", tools.display())))
}

/// The command line, parsed with each service flag's help showing its config's default.
fn cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let matches = serve::document_defaults(Cli::command()).get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> std::process::ExitCode {
    // The transports beyond gRPC this binary carries: one line each (`kv_transport` names).
    pdmesh_kv_ucx::register();
    let cli = cli();
    if let Err(e) = init_tls(&cli) {
        eprintln!("error: {}", pdmesh_cli::describe(&e));
        return std::process::ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Up(a) => up::run(a, cli.tls.insecure),
        Command::Generate(a) => generate::run(a, &cli.tls),
        Command::ApiKey(a) => api_key(a),
        Command::Certs(a) => certs(a),
        Command::Router(a) => serve::router(a),
        Command::Prefill(a) => serve::prefill(a),
        Command::Decode(a) => serve::decode(a),
        Command::Kvstore(a) => serve::kvstore(a),
        Command::Run(a) => run::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Models(a) => models::run(a),
        Command::DumpLogits(a) => perplexity::dump_logits(a),
        Command::Tool(args) => tool(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", pdmesh_cli::describe(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Command};

    /// A node's flags set only what was given (so the file's and the environment's values stay
    /// underneath), under the config's own keys, nested tables included.
    #[test]
    fn service_flags_write_back_only_what_was_given() {
        let cli = Cli::try_parse_from([
            "pdmesh",
            "decode",
            "--kv-blocks",
            "9",
            "--router",
            "a:1",
            "--router",
            "b:2",
            "--kv-shared-pool",
            "false",
        ])
        .expect("parses");
        let Command::Decode(a) = cli.command else { panic!("a decode command") };
        let written = serde_json::to_value(&a.settings).expect("serializes");
        let want = serde_json::json!({
            "routers": ["a:1", "b:2"],
            "kv_shared_pool": false,
            "engine": {"kv_blocks": 9},
        });
        assert_eq!(written, want);
        let e = Cli::try_parse_from(["pdmesh", "router", "--max-queued", "many"])
            .expect_err("not a number");
        assert!(e.to_string().contains("--max-queued"), "{e}");
    }

    /// `--help` shows each service's own defaults, from its config's `Default`: a decode node's
    /// lease is not a KV-store's.
    #[test]
    fn help_shows_each_services_defaults() {
        let cmd = super::serve::document_defaults(Cli::command());
        cmd.clone().debug_assert();
        let help = |sub: &str, arg: &str| {
            let c = cmd.find_subcommand(sub).expect("a service command");
            let a = c.get_arguments().find(|a| a.get_id() == arg).expect("a flag");
            a.get_help().expect("help").to_string()
        };
        let decode = pdmesh_decode::DecodeConfig::default().lease_ms;
        let kvstore = pdmesh_kvstore::KvStoreConfig::default().lease_ms;
        assert_ne!(decode, kvstore, "the check needs two different defaults");
        assert!(help("decode", "lease_ms").ends_with(&format!("[default: {decode}]")));
        assert!(help("kvstore", "lease_ms").ends_with(&format!("[default: {kvstore}]")));
        let blocks = pdmesh_decode::DecodeConfig::default().engine.kv_blocks;
        assert!(help("decode", "kv_blocks").ends_with(&format!("[default: {blocks}]")));
        // A nested table's (`[planner]`) too.
        let slo = serde_json::json!(pdmesh_router::planner::PlannerConfig::default().ttft_slo_ms);
        assert!(help("router", "ttft_slo_ms").ends_with(&format!("[default: {slo}]")));
        // Unset by default: no default to show.
        assert!(!help("kvstore", "advertise").contains("[default"));
    }
}
