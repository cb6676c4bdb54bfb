//! `pdmesh collect`: an OTLP/gRPC trace receiver that prints each span it gets, one line each
//! (service, name, trace, span, parent, duration, status, attributes). A stand-in for Jaeger
//! where there is none: `OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 pdmesh up`.

use std::io::Write;

use anyhow::Context;
use clap::Args;
use pdmesh_common::collector::Collector;

#[derive(Debug, Args)]
pub struct CollectArgs {
    /// Where to receive OTLP/gRPC trace exports (host:port; port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:4317")]
    listen: String,
    /// Print nothing per span; only the count when stopped.
    #[arg(long)]
    quiet: bool,
    /// Exit when stdin closes (for scripts and tests), besides Ctrl-C and SIGTERM.
    #[arg(long)]
    exit_with_stdin: bool,
}

pub fn run(a: CollectArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async {
        let (listener, addr) = pdmesh_common::bind(&a.listen)
            .await
            .with_context(|| format!("cannot listen on {}", a.listen))?;
        let quiet = a.quiet;
        let collector = Collector::on_batch(move |spans| {
            if quiet {
                return;
            }
            let mut out = std::io::stdout().lock();
            for s in spans {
                // A closed stdout only stops the printing.
                let _ = writeln!(out, "{s}");
            }
            let _ = out.flush();
        });
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "pdmesh collect listening on {addr}")?;
            out.flush()?;
        }
        let served = collector.clone().serve(listener);
        tokio::select! {
            r = served => r.context("serving OTLP")?,
            () = pdmesh_cli::process::shutdown_signal(a.exit_with_stdin) => {}
        }
        eprintln!("pdmesh collect: {} spans received", collector.received());
        Ok(())
    })
}
