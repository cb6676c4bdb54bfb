//! `pdmesh bench engine`: prefill and decode throughput of the local engine, and its memory.
//! (`pdmesh bench` without a subcommand drives a mesh: see `mesh_bench`.)

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::bail;
use clap::{Args, Subcommand};
use pdmesh_engine::{Engine, Logits, Sampler, SamplingParams, SeqId, StepItem, StepLogits};

use pdmesh_cli::args::EngineArgs;

/// `pdmesh bench` drives a running mesh; `pdmesh bench engine` measures the local engine.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    #[command(flatten)]
    mesh: crate::mesh_bench::MeshBenchArgs,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Engine throughput: prefill of one prompt, single-stream decode, batched decode.
    Engine(EngineBenchArgs),
    /// KV transfer bandwidth into a decode node process: UCX vs the gRPC stream vs memcpy.
    Kv(crate::kv_bench::KvBenchArgs),
    /// Disaggregation across hosts (network namespaces, shaped links) vs on one host vs
    /// colocated: TTFT, ITL and the transfer the layer-wise push hides. Needs root.
    Hosts(crate::hosts_bench::HostsBenchArgs),
}

#[derive(Debug, Args)]
pub struct EngineBenchArgs {
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens generated for the single-stream decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Concurrent sequences for the aggregate decode measurement (comma-separated).
    #[arg(long, default_value = "1,4,16,32", value_delimiter = ',')]
    batch_sizes: Vec<usize>,
    /// Prompt length of each sequence in the batched measurement.
    #[arg(long, default_value_t = 32)]
    batch_prompt_tokens: usize,
    /// Decode steps timed in the batched measurement.
    #[arg(long, default_value_t = 64)]
    batch_steps: usize,
    /// Concurrent sequences for the sampled decode measurement: top-k samplers picking from
    /// whole logits against picking from the candidates each row is cut to (0 skips it).
    #[arg(long, default_value_t = 16)]
    sampled_batch: usize,
    /// The sampled decode's top-k (1 to 1024: larger ones read whole logits anyway).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// The sampled decode's temperature (> 0).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Repetitions of each measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(a: BenchArgs, access: &pdmesh_cli::client::Access) -> anyhow::Result<()> {
    match a.command {
        Some(BenchCommand::Engine(e)) => engine_bench(e),
        Some(BenchCommand::Kv(k)) => crate::kv_bench::run(k, access.tls.insecure),
        Some(BenchCommand::Hosts(h)) => crate::hosts_bench::run(h),
        None => crate::mesh_bench::run(a.mesh, access),
    }
}

/// Real text so the benchmark sees realistic token ids.
const TEXT: &str = "The history of computing is a story of layers. Each generation of engineers \
builds on the abstractions of the last: transistors become logic gates, gates become processors, \
processors run operating systems, and operating systems host the programs people use every day. \
Serving a language model adds one more layer. A prompt arrives, is split into tokens, and flows \
through dozens of transformer blocks; every block reads the keys and values of all earlier tokens \
from a cache that grows with the conversation. 1234567890 — naïve café, 東京, emoji 🚀. ";

fn tokens(engine: &Engine, n: usize) -> anyhow::Result<Vec<u32>> {
    let one = engine.model().tokenizer.encode(TEXT)?;
    if one.is_empty() {
        bail!("benchmark text tokenized to nothing");
    }
    Ok(one.iter().copied().cycle().take(n).collect())
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Feeds `prompt` to `seq` in budget-sized chunks; returns the argmax after the last token.
fn prefill(engine: &mut Engine, seq: SeqId, prompt: &[u32]) -> anyhow::Result<u32> {
    let budget = engine.config().max_batch_tokens;
    let mut next = 0;
    for chunk in prompt.chunks(budget) {
        let l = engine.step(&[StepItem::prefill(seq, chunk, Logits::Last)])?;
        next = argmax(l.last_of(0).unwrap_or(&[0.0]));
    }
    Ok(next)
}

fn rss_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn engine_bench(a: EngineBenchArgs) -> anyhow::Result<()> {
    if a.repeats == 0 || a.prompt_tokens == 0 || a.decode_tokens == 0 || a.batch_steps == 0 {
        bail!("--repeats, --prompt-tokens, --decode-tokens and --batch-steps must be at least 1");
    }
    let sampling =
        SamplingParams { temperature: a.temperature, top_k: a.top_k, ..Default::default() };
    if a.sampled_batch > 0 {
        let sampler = Sampler::new(sampling.clone())?;
        if a.temperature <= 0.0 || sampler.cut().is_none() {
            bail!(
                "--temperature must be > 0 and --top-k in 1..={} for the sampled decode, got {} \
                 and {}",
                pdmesh_engine::MAX_DEVICE_TOP_K,
                a.temperature,
                a.top_k
            );
        }
    }
    let mut ea = a.engine.clone();
    ea.max_batch_tokens = ea.max_batch_tokens.max(a.prompt_tokens);
    let max_b = a.batch_sizes.iter().copied().max().unwrap_or(1).max(a.sampled_batch);
    let need_tokens = (max_b * (a.batch_prompt_tokens + a.batch_steps))
        .max(a.prompt_tokens + a.decode_tokens + 32);
    let need_blocks = need_tokens.div_ceil(ea.block_size) + max_b;
    if ea.kv_blocks < need_blocks {
        ea.kv_blocks = need_blocks;
    }
    let mut engine = ea.engine()?;
    let rss_loaded = rss_bytes("VmRSS:").unwrap_or(0);
    let model_bytes = engine.model().file_size();
    let kv_bytes = engine.kv_bytes();

    // Prefill: one step with the whole prompt, logits for its last token only.
    let prompt = tokens(&engine, a.prompt_tokens)?;
    let mut times = Vec::new();
    for _ in 0..a.repeats {
        let seq = engine.create_sequence();
        let t = Instant::now();
        engine.step(&[StepItem::prefill(seq, &prompt, Logits::Last)])?;
        times.push(t.elapsed().as_secs_f64());
        engine.free_sequence(seq)?;
    }
    let prefill_tok_s = a.prompt_tokens as f64 / median(times);

    // Single-stream decode after a short prompt.
    let short = tokens(&engine, 32)?;
    let mut rates = Vec::new();
    for _ in 0..a.repeats {
        let seq = engine.create_sequence();
        let mut next = prefill(&mut engine, seq, &short)?;
        let t = Instant::now();
        for _ in 0..a.decode_tokens {
            let l = engine.step(&[StepItem::decode(seq, &[next])])?;
            next = argmax(l.last_of(0).unwrap_or(&[0.0]));
        }
        rates.push(a.decode_tokens as f64 / t.elapsed().as_secs_f64());
        engine.free_sequence(seq)?;
    }
    let decode_tok_s = median(rates);

    // Aggregate decode with B sequences stepping together.
    let mut batched = BTreeMap::new();
    let bp = tokens(&engine, a.batch_prompt_tokens)?;
    for &b in &a.batch_sizes {
        if b == 0 {
            bail!("--batch-sizes entries must be at least 1");
        }
        let mut rates = Vec::new();
        for _ in 0..a.repeats {
            let last = vec![Logits::Last; b];
            let greedy = |i, l: &StepLogits<'_>| Ok(argmax(l.last_of(i).unwrap_or(&[0.0])));
            rates.push(batch_decode(&mut engine, &bp, &last, a.batch_steps, greedy)?);
        }
        batched.insert(b, median(rates));
    }
    let sampled = if a.sampled_batch > 0 {
        Some(sampled_decode(&mut engine, &a, &bp, &sampling)?)
    } else {
        None
    };
    let peak = rss_bytes("VmHWM:").unwrap_or(0);

    // Decode streams every weight once per step: its bytes per token against what this
    // machine can read with the same threads.
    let weight_bytes = engine.model().matmul_bytes();
    let decode_gb_s = weight_bytes as f64 * decode_tok_s / 1e9;
    let read_gb_s = read_bandwidth_gb_s(engine.config().threads, a.repeats.max(5));

    if a.json {
        let obj = serde_json::json!({
            "prefill_tok_s": prefill_tok_s,
            "decode_tok_s": decode_tok_s,
            "batched_decode_tok_s": batched.iter().map(|(b, v)| (b.to_string(), *v)).collect::<BTreeMap<_, _>>(),
            "peak_rss_bytes": peak,
            "rss_after_load_bytes": rss_loaded,
            "model_file_bytes": model_bytes,
            "kv_pool_bytes": kv_bytes,
            "backend": engine.describe_backend(),
            "prompt_tokens": a.prompt_tokens,
            "decode_tokens": a.decode_tokens,
            "decode_weight_bytes_per_token": weight_bytes,
            "decode_gb_s": decode_gb_s,
            "read_bandwidth_gb_s": read_gb_s,
            "sampled_decode": sampled.map(|(whole, cut)| serde_json::json!({
                "batch": a.sampled_batch,
                "top_k": a.top_k,
                "temperature": a.temperature,
                "whole_logits_tok_s": whole,
                "candidates_tok_s": cut,
                "ratio": cut / whole,
            })),
        });
        println!("{obj}");
    } else {
        println!("backend            {}", engine.describe_backend());
        println!(
            "prefill            {prefill_tok_s:>9.1} tok/s  ({}-token prompt)",
            a.prompt_tokens
        );
        println!(
            "decode             {decode_tok_s:>9.1} tok/s  (1 stream, {} tokens)",
            a.decode_tokens
        );
        for (b, v) in &batched {
            println!("batched decode x{b:<3}{v:>9.1} tok/s  (aggregate)");
        }
        if let Some((whole, cut)) = sampled {
            println!(
                "sampled decode x{:<3}{cut:>9.1} tok/s  from candidates, {whole:.1} from whole \
                 logits: {:.3}x (top-k {}, temperature {})",
                a.sampled_batch,
                cut / whole,
                a.top_k,
                a.temperature
            );
        }
        println!(
            "decode bandwidth   {decode_gb_s:>9.2} GB/s of weights ({:.1} MB per token) = {:.0}% \
             of the {read_gb_s:.2} GB/s this machine reads with {} threads",
            weight_bytes as f64 / 1e6,
            100.0 * decode_gb_s / read_gb_s,
            engine.config().threads
        );
        println!(
            "memory             model file {:.1} MB, KV pool {:.1} MB, RSS after load {:.1} MB, peak RSS {:.1} MB",
            model_bytes as f64 / 1e6,
            kv_bytes as f64 / 1e6,
            rss_loaded as f64 / 1e6,
            peak as f64 / 1e6
        );
    }
    Ok(())
}

/// Aggregate tok/s of `logits.len()` sequences after `prompt`, decoding `steps` steps
/// together; sequence `i` asks for `logits[i]` and `pick(i, step)` gives its next token.
fn batch_decode(
    engine: &mut Engine,
    prompt: &[u32],
    logits: &[Logits],
    steps: usize,
    mut pick: impl FnMut(usize, &StepLogits<'_>) -> anyhow::Result<u32>,
) -> anyhow::Result<f64> {
    let seqs: Vec<SeqId> = logits.iter().map(|_| engine.create_sequence()).collect();
    let mut next = Vec::with_capacity(seqs.len());
    for &s in &seqs {
        next.push([prefill(engine, s, prompt)?]);
    }
    let t = Instant::now();
    for _ in 0..steps {
        let items: Vec<StepItem<'_>> = (0..seqs.len())
            .map(|i| StepItem { logits: logits[i], ..StepItem::decode(seqs[i], &next[i]) })
            .collect();
        let l = engine.step(&items)?;
        let new = (0..seqs.len()).map(|i| pick(i, &l).map(|t| [t])).collect::<Result<_, _>>()?;
        next = new;
    }
    let rate = (seqs.len() * steps) as f64 / t.elapsed().as_secs_f64();
    for s in seqs {
        engine.free_sequence(s)?;
    }
    Ok(rate)
}

/// Aggregate decode of `a.sampled_batch` sequences with `sampling`'s top-k samplers, each
/// repeat once sampling from whole logits and once from the candidates the backend cuts each
/// row to (`Logits::Cut`): tok/s of each, medians. The same seeds draw the same tokens.
fn sampled_decode(
    engine: &mut Engine,
    a: &EngineBenchArgs,
    prompt: &[u32],
    sampling: &SamplingParams,
) -> anyhow::Result<(f64, f64)> {
    let b = a.sampled_batch;
    let mut rates = [Vec::new(), Vec::new()];
    let mut drawn: [Vec<u32>; 2] = Default::default();
    for _ in 0..a.repeats {
        for cut in [false, true] {
            let mut samplers = (0..b)
                .map(|i| Sampler::new(SamplingParams { seed: i as u64, ..sampling.clone() }))
                .collect::<Result<Vec<_>, _>>()?;
            let logits: Vec<Logits> = samplers
                .iter()
                .map(|s| match s.cut() {
                    Some(c) if cut => Logits::Cut(c),
                    _ => Logits::Last,
                })
                .collect();
            let seen = &mut drawn[usize::from(cut)];
            let pick = |i: usize, l: &StepLogits<'_>| {
                let s = &mut samplers[i];
                let t = match (l.candidates_of(i), l.last_of(i)) {
                    (Some(c), _) => s.sample_candidates(c),
                    (None, Some(row)) => s.sample(row, &[], 0).0,
                    (None, None) => bail!("step gave nothing to sample row {i} from"),
                };
                seen.push(t);
                Ok(t)
            };
            rates[usize::from(cut)].push(batch_decode(
                engine,
                prompt,
                &logits,
                a.batch_steps,
                pick,
            )?);
        }
    }
    if drawn[0] != drawn[1] {
        bail!("sampling from candidates drew other tokens than from whole logits");
    }
    let [whole, cut] = rates;
    Ok((median(whole), median(cut)))
}

/// Memory read bandwidth with `threads` threads: each sums its share of a 1 GiB buffer (far
/// beyond any cache); the fastest of `repeats` passes, as the ceiling a decode step could reach
/// (on a shared machine the slower passes measure the neighbours).
fn read_bandwidth_gb_s(threads: usize, repeats: usize) -> f64 {
    const BYTES: usize = 1 << 30;
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let threads = threads.max(1);
    let chunk = buf.len().div_ceil(threads);
    let times: Vec<f64> = (0..repeats)
        .map(|_| {
            let t = Instant::now();
            let total: u64 = std::thread::scope(|s| {
                let handles: Vec<_> = buf
                    .chunks(chunk)
                    .map(|part| {
                        s.spawn(move || {
                            // Eight independent sums so the loads, not one add chain, set the pace.
                            let mut acc = [0u64; 8];
                            for c in part.chunks_exact(8) {
                                for (a, &v) in acc.iter_mut().zip(c) {
                                    *a = a.wrapping_add(v);
                                }
                            }
                            acc.iter().fold(0u64, |x, &y| x.wrapping_add(y))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
            });
            std::hint::black_box(total);
            t.elapsed().as_secs_f64()
        })
        .collect();
    BYTES as f64 / times.iter().copied().fold(f64::INFINITY, f64::min) / 1e9
}
