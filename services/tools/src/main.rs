//! `pdmesh-tools`: what measures and observes a mesh, kept out of the product binary. The
//! `pdmesh` binary runs it for `pdmesh bench`, `pdmesh replay` and `pdmesh collect`, so the
//! commands are the same whichever binary is called.

mod bench;
mod collect;
mod hosts_bench;
mod http_load;
mod kv_bench;
mod mesh_bench;
mod replay;
mod synth_model;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "pdmesh",
    bin_name = "pdmesh",
    version,
    about = "pdmesh tools: benchmarks, trace replay, a trace collector and synthetic models (run as `pdmesh <tool>`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    access: pdmesh_cli::client::Access,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Drive a running mesh with concurrent or Poisson-arriving requests and report TTFT,
    /// TPOT, inter-token and end-to-end latency, throughput and goodput; `bench engine`
    /// measures the local engine instead, `bench kv` KV transfer bandwidth.
    Bench(Box<bench::BenchArgs>),
    /// Replay a Mooncake-format trace against a running mesh: ideal vs achieved prefix-cache
    /// hit rate, TTFT/TPOT percentiles and goodput.
    Replay(replay::ReplayArgs),
    /// Receive spans over OTLP/gRPC (what the services export to
    /// OTEL_EXPORTER_OTLP_ENDPOINT) and print one line per span: Jaeger's job, without Jaeger.
    Collect(collect::CollectArgs),
    /// Write a GGUF with a model's metadata, vocabulary and tensor shapes but seeded random
    /// weights, or only its shape (`--shape-only`, a few MB): how the GPU tier gets a model
    /// onto a machine its file cannot reach.
    SynthModel(synth_model::SynthArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(b) => bench::run(*b, &cli.access),
        Command::Replay(a) => replay::run(a, &cli.access),
        Command::Collect(a) => collect::run(a),
        Command::SynthModel(a) => synth_model::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", pdmesh_cli::describe(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
