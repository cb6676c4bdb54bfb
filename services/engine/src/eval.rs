//! Perplexity: the standard fidelity check against llama.cpp on the same GGUF.

use crate::engine::{Engine, Logits, StepItem};
use crate::error::{Error, Result};
use crate::kv_policy::KvPolicy;

/// Result of scoring a token stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Perplexity {
    pub perplexity: f64,
    /// Mean negative log-likelihood per scored token (nats).
    pub mean_nll: f64,
    pub scored_tokens: usize,
    pub windows: usize,
}

/// Splits `tokens` into non-overlapping windows of `ctx` tokens (a shorter tail is dropped)
/// and scores every token of each window except its first, from a fresh sequence.
/// `on_window(i, n)` reports progress.
///
/// Under a lossy KV `policy` each window is fed one block of tokens per step, the policy
/// evicting after each, so that no token sees more than the budget and one block: what a
/// sequence that streams past its budget would see.
pub fn perplexity(
    engine: &mut Engine,
    tokens: &[u32],
    ctx: usize,
    policy: Option<KvPolicy>,
    mut on_window: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    if ctx < 2 {
        return Err(Error::invalid("ctx must be at least 2"));
    }
    if ctx > engine.max_seq_len() {
        return Err(Error::invalid(format!(
            "ctx {ctx} is past the model's context of {}",
            engine.max_seq_len()
        )));
    }
    let windows = tokens.len() / ctx;
    if windows == 0 {
        return Err(Error::invalid(format!(
            "the text has {} tokens, fewer than one window of {ctx}",
            tokens.len()
        )));
    }
    let budget = match policy {
        Some(_) => engine.config().block_size.min(engine.config().max_batch_tokens),
        None => engine.config().max_batch_tokens,
    };
    let mut nll = 0f64;
    let mut count = 0usize;
    for w in 0..windows {
        let win = &tokens[w * ctx..(w + 1) * ctx];
        let seq = engine.create_sequence();
        let r = (|| -> Result<()> {
            engine.set_kv_policy(seq, policy)?;
            for (c, chunk) in win.chunks(budget).enumerate() {
                let base = c * budget;
                let logits = engine.step(&[StepItem::prefill(seq, chunk, Logits::All)])?;
                for i in 0..logits.len() {
                    let ((_, j), row) = logits.row(i);
                    let pos = base + j;
                    if pos + 1 >= win.len() {
                        continue;
                    }
                    nll += nll_of(row, win[pos + 1] as usize);
                    count += 1;
                }
            }
            Ok(())
        })();
        engine.free_sequence(seq)?;
        r?;
        on_window(w + 1, windows);
    }
    let mean_nll = nll / count as f64;
    Ok(Perplexity { perplexity: mean_nll.exp(), mean_nll, scored_tokens: count, windows })
}

/// `-log softmax(row)[target]`, in f64.
fn nll_of(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    (sum.ln() + max) - row[target] as f64
}
