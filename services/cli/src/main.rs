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
        bench    Drive a running mesh (TTFT, TPOT, goodput); `bench engine`, `bench kv`\n  \
        replay   Replay a Mooncake-format trace against a running mesh\n  \
        collect  Receive OTLP spans and print them (Jaeger's job, without Jaeger)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Mutual TLS on every connection between mesh processes: DIR holds the mesh CA
    /// (`ca.pem`) and this process's certificate and key (`NAME.pem`, `NAME.key`, NAME from
    /// --tls-name). Servers then accept only clients with a certificate from that CA, and
    /// clients only such servers. Without it connections are plaintext.
    #[arg(long, global = true, value_name = "DIR", env = "PDMESH_TLS_DIR")]
    tls_dir: Option<std::path::PathBuf>,
    /// This process's certificate in --tls-dir.
    #[arg(long, global = true, value_name = "NAME", env = "PDMESH_TLS_NAME")]
    tls_name: Option<String>,
}

/// Sets this process's TLS from the flags.
fn init_tls(cli: &Cli) -> anyhow::Result<()> {
    let tls = match (&cli.tls_dir, &cli.tls_name) {
        (Some(dir), Some(name)) => Some(pdmesh_common::tls::MeshTls::load(dir, name)?),
        (Some(_), None) => {
            anyhow::bail!("--tls-dir needs --tls-name: which certificate is this process's")
        }
        (None, Some(_)) => anyhow::bail!("--tls-name needs --tls-dir: where the certificates are"),
        (None, None) => return Ok(()),
    };
    pdmesh_common::tls::init(tls);
    Ok(())
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a whole mesh on this machine: a router plus prefill and decode nodes, each its
    /// own process. Prints the router's endpoint once every node has registered.
    Up(up::UpArgs),
    /// Stream a completion from a running mesh.
    Generate(generate::GenerateArgs),
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
    /// A tool of the tools binary (`bench`, `replay`, `collect`).
    #[command(external_subcommand)]
    Tool(Vec<OsString>),
}

/// The commands the tools binary provides.
const TOOLS: [&str; 3] = ["bench", "replay", "collect"];

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

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_tls(&cli) {
        eprintln!("error: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Up(a) => up::run(a),
        Command::Generate(a) => generate::run(a),
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
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
