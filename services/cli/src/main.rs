//! `pdmesh`: the one binary of the project. `up` starts a whole mesh on this machine;
//! `router`, `prefill` and `decode` run one service each; `generate` and `bench` are clients of
//! a running mesh; `run`, `perplexity` and `bench engine` use the engine in this process.

mod args;
mod bench;
mod collect;
mod generate;
mod kv_bench;
mod mesh_bench;
mod perplexity;
mod replay;
mod run;
mod serve;
mod up;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "pdmesh",
    version,
    about = "pdmesh: disaggregated LLM serving (prefill and decode pools, shared prefix cache)",
    long_about = "pdmesh serves llama-architecture GGUF models.\n\n\
        `pdmesh up` starts a mesh on this machine and `pdmesh generate` talks to it;\n\
        `pdmesh router|prefill|decode` run one service each (for clusters). Local\n\
        commands (`run`, `perplexity`, `bench engine`) use the engine in this process.\n\
        The default model is SmolLM2-135M-Instruct (Q4_1), fetched by `just fetch-model`\n\
        into models/."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    /// Replay a Mooncake-format trace against a running mesh: ideal vs achieved prefix-cache
    /// hit rate, TTFT/TPOT percentiles and goodput.
    Replay(replay::ReplayArgs),
    /// Generate text from a prompt on this machine, streaming it to stdout.
    Run(run::RunArgs),
    /// Score a text file: perplexity over non-overlapping windows of --ctx tokens.
    Perplexity(perplexity::PerplexityArgs),
    /// Drive a running mesh with concurrent or Poisson-arriving requests and report TTFT,
    /// TPOT, inter-token and end-to-end latency, throughput and goodput; `bench engine`
    /// measures the local engine instead.
    Bench(bench::BenchArgs),
    /// Receive spans over OTLP/gRPC (what the services export to
    /// OTEL_EXPORTER_OTLP_ENDPOINT) and print one line per span: Jaeger's job, without Jaeger.
    Collect(collect::CollectArgs),
    /// Write the logits of every position of a token sequence as raw little-endian f32
    /// (fidelity tooling: compared against llama.cpp by scripts/compare_llamacpp.py).
    #[command(hide = true)]
    DumpLogits(perplexity::DumpLogitsArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(a) => up::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Router(a) => serve::router(a),
        Command::Prefill(a) => serve::prefill(a),
        Command::Decode(a) => serve::decode(a),
        Command::Kvstore(a) => serve::kvstore(a),
        Command::Replay(a) => replay::run(a),
        Command::Run(a) => run::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Collect(a) => collect::run(a),
        Command::DumpLogits(a) => perplexity::dump_logits(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
