//! `pdmesh`: the one binary of the project. This commands run the engine locally:
//! `run` (generate from a prompt), `perplexity` (score a text) and `bench engine`.

mod args;
mod bench;
mod perplexity;
mod run;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "pdmesh",
    version,
    about = "pdmesh: disaggregated LLM serving (prefill and decode pools, shared prefix cache)",
    long_about = "pdmesh serves llama-architecture GGUF models.\n\n\
        Local commands run the engine in this process; the default model is\n\
        SmolLM2-135M-Instruct (Q4_1), fetched by `just fetch-model` into models/."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text from a prompt on this machine, streaming it to stdout.
    Run(run::RunArgs),
    /// Score a text file: perplexity over non-overlapping windows of --ctx tokens.
    Perplexity(perplexity::PerplexityArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Write the logits of every position of a token sequence as raw little-endian f32
    /// (fidelity tooling: compared against llama.cpp by scripts/compare_llamacpp.py).
    #[command(hide = true)]
    DumpLogits(perplexity::DumpLogitsArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Bench(b) => bench::run(b),
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
