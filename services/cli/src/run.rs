//! `pdmesh run`: local generation from a prompt.

use std::io::Write;

use anyhow::{Context, bail};
use clap::Args;
use pdmesh_engine::generate::{generate, generate_observed};
use pdmesh_engine::{GenerateParams, Message, SamplingParams, StreamDecoder};

use pdmesh_cli::args::EngineArgs;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The prompt. Wrapped in the model's chat template as a user message unless --raw.
    #[arg(long, short, required_unless_present = "prompt_file", conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this UTF-8 file instead (a prompt too long for a command line).
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<std::path::PathBuf>,
    /// Keep only the first N tokens of the prompt (0 = all of it): a prompt of an exact
    /// length, for measuring.
    #[arg(long, value_name = "N", default_value_t = 0)]
    prompt_tokens: usize,
    /// Tokenize the prompt exactly as given (special tokens such as <|im_start|> included),
    /// without the chat template.
    #[arg(long)]
    raw: bool,
    /// A system message (chat mode only; default: the template's own).
    #[arg(long, conflicts_with = "raw")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Drop tokens below min_p × the best token's probability (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Penalty for tokens among the last 64 (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    /// RNG seed; the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-turn tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// With --json: also report the N highest logits before each generated token.
    #[arg(long, default_value_t = 0, requires = "json")]
    top_logits: usize,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed,
        ..Default::default()
    };
    sampling.validate()?;
    let given = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        (None, None) => bail!("give --prompt or --prompt-file"),
    };
    let mut engine = a.engine.engine()?;
    let model = std::sync::Arc::clone(engine.model());
    let text = if a.raw {
        given
    } else {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(Message::new("system", s.clone()));
        }
        msgs.push(Message::new("user", given));
        model.tokenizer.chat_template()?.render(&msgs, true)?
    };
    let mut prompt = model.tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if a.prompt_tokens > 0 {
        if prompt.len() < a.prompt_tokens {
            bail!(
                "--prompt-tokens {}: the prompt has only {} tokens",
                a.prompt_tokens,
                prompt.len()
            );
        }
        prompt.truncate(a.prompt_tokens);
    }
    let params = GenerateParams {
        sampling,
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        ..Default::default()
    };
    let mut dec = StreamDecoder::new();
    let mut out = std::io::stdout().lock();
    let mut text_out = String::new();
    let mut io_err = None;
    let mut tops: Vec<Vec<(u32, f32)>> = Vec::new();
    let top_n = a.top_logits;
    let on_token = |tok| {
        let piece = dec.push(&model.tokenizer, tok);
        text_out.push_str(&piece);
        if !a.json
            && let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush())
        {
            io_err = Some(e);
            return false; // stdout closed (e.g. piped into `head`): stop generating
        }
        true
    };
    // Logits are observed only when asked for: otherwise a device cuts them to the sampler's
    // candidates where they are (`Logits::Cut`).
    let g = if top_n > 0 {
        let top = |logits: &[f32]| {
            let mut v: Vec<(u32, f32)> =
                logits.iter().copied().enumerate().map(|(i, l)| (i as u32, l)).collect();
            v.sort_by(|x, y| y.1.total_cmp(&x.1));
            v.truncate(top_n);
            tops.push(v);
        };
        generate_observed(&mut engine, &prompt, &params, top, on_token)?
    } else {
        generate(&mut engine, &prompt, &params, on_token)?
    };
    let tail = dec.finish();
    text_out.push_str(&tail);
    if let Some(e) = io_err {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(e).context("writing to stdout");
    }
    let decode_s = (g.total_time - g.time_to_first_token).as_secs_f64();
    let decode_tps = if g.tokens.len() > 1 && decode_s > 0.0 {
        (g.tokens.len() - 1) as f64 / decode_s
    } else {
        0.0
    };
    if a.json {
        let obj = serde_json::json!({
            "token_ids": g.tokens,
            "text": text_out,
            "finish_reason": g.finish.as_str(),
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.tokens.len(),
            "ttft_ms": g.time_to_first_token.as_secs_f64() * 1e3,
            "decode_tok_s": decode_tps,
            // The least --kv-blocks this run fits in.
            "kv_peak_blocks": engine.kv().peak_blocks(),
        });
        let mut obj = obj;
        if top_n > 0 {
            obj["top_logits"] = serde_json::json!(
                tops.iter()
                    .map(|v| v.iter().map(|&(i, l)| serde_json::json!([i, l])).collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            );
        }
        writeln!(out, "{obj}")?;
    } else {
        write!(out, "{tail}")?;
        writeln!(out)?;
    }
    eprintln!(
        "[{} prompt tokens, {} generated, finish: {}; first token {:.0} ms, {:.1} tok/s]",
        g.prompt_tokens,
        g.tokens.len(),
        g.finish.as_str(),
        g.time_to_first_token.as_secs_f64() * 1e3,
        decode_tps
    );
    Ok(())
}
