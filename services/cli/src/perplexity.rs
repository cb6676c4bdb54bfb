//! `pdmesh perplexity`: fidelity check on a text file.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use pdmesh_cli::args::EngineArgs;

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// UTF-8 text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens; every token of a window except the first is scored.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many windows (0 = all).
    #[arg(long, default_value_t = 0)]
    max_windows: usize,
    /// A lossy KV policy to score instead of full attention: `sinks:BUDGET[:SINKS]`
    /// (StreamingLLM: the first SINKS tokens, 4 by default, and the most recent) or
    /// `h2o:BUDGET[:RECENT]` (the RECENT newest tokens, half the budget by default, and the
    /// most attended older blocks). Each window then streams one block per step.
    #[arg(long)]
    kv_policy: Option<pdmesh_engine::kv_policy::KvPolicy>,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(a: PerplexityArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let mut engine = a.engine.engine()?;
    let mut tokens = engine.model().tokenizer.encode(&text)?;
    if a.max_windows > 0 {
        tokens.truncate(a.max_windows * a.ctx);
    }
    match a.kv_policy {
        Some(p) => eprintln!("{} tokens, windows of {}, KV policy {p}", tokens.len(), a.ctx),
        None => eprintln!("{} tokens, windows of {}", tokens.len(), a.ctx),
    }
    let start = std::time::Instant::now();
    let r = pdmesh_engine::eval::perplexity(&mut engine, &tokens, a.ctx, a.kv_policy, |i, n| {
        eprint!("\rwindow {i}/{n}");
    })?;
    eprintln!();
    println!(
        "scored {} tokens in {} windows ({:.1} s); mean NLL {:.6}",
        r.scored_tokens,
        r.windows,
        start.elapsed().as_secs_f64(),
        r.mean_nll
    );
    println!("perplexity: {:.4}", r.perplexity);
    Ok(())
}

#[derive(Debug, Args)]
pub struct DumpLogitsArgs {
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Output file: tokens × vocab f32 values.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn dump_logits(a: DumpLogitsArgs) -> anyhow::Result<()> {
    use pdmesh_engine::{Logits, StepItem};
    let mut engine = a.engine.engine()?;
    let seq = engine.create_sequence();
    let budget = engine.config().max_batch_tokens;
    let mut bytes = Vec::new();
    for chunk in a.tokens.chunks(budget) {
        let l = engine.step(&[StepItem::prefill(seq, chunk, Logits::All)])?;
        for i in 0..l.len() {
            for v in l.row(i).1 {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    std::fs::write(&a.out, bytes).with_context(|| format!("writing {}", a.out.display()))?;
    Ok(())
}
