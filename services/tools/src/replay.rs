//! `pdmesh replay`: a Mooncake-format trace against a running mesh. Each `hash_id` becomes a
//! deterministic block of real token ids, so requests that share prefix blocks in the trace
//! share token prefixes here; lengths are scaled by `--token-scale` (so prompts fit a small
//! model's context) and arrival times by `--time-scale`. Reports the trace's ideal hit rate
//! (from the file), the hit rate the mesh achieved (cached over prompt tokens, from each
//! request's usage), and TTFT/TPOT percentiles and goodput. `--day` stretches the trace's
//! hour into a day whose load rises and falls, for watching the planner follow it.

use std::io::BufReader;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use pdmesh_kvstore::trace::{
    TRACE_BLOCK_TOKENS, TraceRequest, ideal_hit_rate, previous_turns, reachable_hits, read_trace,
    share_of_prompts,
};
use tokio::sync::watch;

use crate::mesh_bench::{CONNECTIONS, Sample, connect_many, first_target, one, summary};

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The trace: one JSON object a line (`timestamp`, `input_length`, `output_length`,
    /// `hash_ids`), as in ../shared/traces/.
    #[arg(long)]
    trace: PathBuf,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Multiplies every length (a trace block of 512 tokens becomes 512 × F tokens).
    #[arg(long, default_value_t = 1.0 / 32.0)]
    token_scale: f64,
    /// Multiplies every arrival time (0.1 replays ten times faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Most output tokens per request, after scaling.
    #[arg(long, default_value_t = 64)]
    max_output_tokens: u32,
    /// Let requests end at the model's end of text: each asks for its trace output length as
    /// max_tokens, the most it may take, as a client that cannot know an answer's length does
    /// (without it each generates exactly that many).
    #[arg(long)]
    eos: bool,
    /// Longest prompt sent, after scaling (longer ones are cut: the model's context is finite).
    #[arg(long, default_value_t = 4096)]
    max_prompt_tokens: usize,
    /// The routers (comma-separated: requests take them in turn, so a conversation's turns
    /// reach different routers).
    #[arg(long, default_value = "127.0.0.1:50051", value_delimiter = ',')]
    target: Vec<String>,
    /// Time-to-first-token SLO for goodput, in ms.
    #[arg(long, default_value_t = 2000.0)]
    ttft_slo_ms: f64,
    /// Time-per-output-token SLO for goodput, in ms.
    #[arg(long, default_value_t = 100.0)]
    tpot_slo_ms: f64,
    /// Make a day of the trace before --time-scale: its hour played 24 times, each hour
    /// keeping a share of its requests that follows a daily curve (20% of them at 03:00, all
    /// at 15:00), each hour's conversations its own.
    #[arg(long)]
    day: bool,
    /// Send only this share of the requests (a fixed choice; with --day, of the day's).
    #[arg(long, default_value_t = 1.0)]
    keep: f64,
    /// Write each request's arrival (seconds after the start, after scaling), prompt and output
    /// tokens to FILE, one JSON object a line: the load to compare a planner's pools with.
    #[arg(long, value_name = "FILE")]
    schedule: Option<PathBuf>,
    /// Send each request at its time even when it is a later turn of a conversation whose
    /// previous turn is not answered yet. Without it such a turn waits for that answer (its
    /// prompt contains it), so a compressed --time-scale cannot send a turn before it exists.
    #[arg(long)]
    no_turn_order: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The share of the peak load at `hour` (0..24) of the day `--day` makes: lowest at 03:00,
/// highest at 15:00.
fn daily_share(hour: f64) -> f64 {
    0.6 - 0.4 * (2.0 * std::f64::consts::PI * (hour - 3.0) / 24.0).cos()
}

/// A fixed pseudo-random number in [0, 1) for request `i` of hour `h`.
fn unit(h: u64, i: u64) -> f64 {
    let mut x = h.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// The trace's hour as a day (see `--day`): every hour a copy, thinned by `daily_share` at
/// each request's time of day, with its prefix block ids moved past the previous hour's.
fn as_day(trace: &[TraceRequest], keep: f64) -> Vec<TraceRequest> {
    const HOUR_MS: u64 = 3_600_000;
    let span = trace.iter().flat_map(|r| r.hash_ids.iter().copied()).max().map_or(1, |m| m + 1);
    let mut day = Vec::new();
    for h in 0..24u64 {
        for (i, r) in trace.iter().enumerate() {
            let at = h * HOUR_MS + r.timestamp.min(HOUR_MS - 1);
            if unit(h, i as u64) < keep * daily_share(at as f64 / HOUR_MS as f64) {
                let ids = r.hash_ids.iter().map(|&id| id + h * span).collect();
                day.push(TraceRequest { timestamp: at, hash_ids: ids, ..r.clone() });
            }
        }
    }
    day.sort_by_key(|r| r.timestamp);
    day
}

/// The token ids of trace block `id`: fixed by the id alone, ordinary vocabulary ids.
fn block_tokens(id: u64, n: usize) -> impl Iterator<Item = u32> {
    (0..n as u64).map(move |k| {
        let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ k.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 31;
        x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 29;
        200 + (x % 30_000) as u32
    })
}

/// A trace request's prompt and output length after scaling.
fn scaled(r: &TraceRequest, a: &ReplayArgs) -> (Vec<u32>, u32) {
    let per_block = ((TRACE_BLOCK_TOKENS as f64 * a.token_scale).round() as usize).max(1);
    let len = ((r.input_length as f64 * a.token_scale).round() as usize)
        .clamp(1, a.max_prompt_tokens)
        .min(per_block * r.hash_ids.len().max(1));
    let prompt: Vec<u32> =
        r.hash_ids.iter().flat_map(|&id| block_tokens(id, per_block)).take(len).collect();
    let out =
        ((r.output_length as f64 * a.token_scale).round() as u32).clamp(1, a.max_output_tokens);
    (prompt, out)
}

pub fn run(a: ReplayArgs, access: &pdmesh_cli::client::Access) -> anyhow::Result<()> {
    if !(a.token_scale > 0.0 && a.token_scale <= 1.0) {
        bail!("--token-scale must be in (0, 1], got {}", a.token_scale);
    }
    if !(a.time_scale >= 0.0 && a.time_scale.is_finite()) {
        bail!("--time-scale must be a non-negative number, got {}", a.time_scale);
    }
    if a.max_prompt_tokens == 0 || a.max_output_tokens == 0 {
        bail!("--max-prompt-tokens and --max-output-tokens must be at least 1");
    }
    let f = std::fs::File::open(&a.trace)
        .with_context(|| format!("opening the trace {}", a.trace.display()))?;
    let mut trace = read_trace(BufReader::new(f), a.limit)?;
    if trace.is_empty() {
        bail!("the trace {} has no requests", a.trace.display());
    }
    if !(a.keep > 0.0 && a.keep <= 1.0) {
        bail!("--keep must be in (0, 1], got {}", a.keep);
    }
    if a.day {
        trace = as_day(&trace, a.keep);
    } else if a.keep < 1.0 {
        let mut i = 0u64;
        trace.retain(|_| {
            i += 1;
            unit(u64::MAX, i) < a.keep
        });
    }
    if trace.is_empty() {
        bail!("--keep {} left no request", a.keep);
    }
    let key = access.init(first_target(&a.target)?)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(replay(&a, &trace, key.as_deref()))
}

async fn replay(a: &ReplayArgs, trace: &[TraceRequest], key: Option<&str>) -> anyhow::Result<()> {
    let clients = connect_many(&a.target, key).await?;
    let ideal = ideal_hit_rate(trace);
    // A later turn of a conversation carries the previous turn's answer: it is sent only once
    // that answer is back, as a client would, however much --time-scale compresses the gap.
    let turns = if a.no_turn_order { vec![None; trace.len()] } else { previous_turns(trace) };
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(trace.len());
    let mut answered: Vec<watch::Receiver<bool>> = Vec::with_capacity(trace.len());
    let mut sizes = Vec::with_capacity(trace.len());
    // Every prompt sent counts: a failed request cached nothing.
    let mut prompt = 0u64;
    // Each request is made when it is due, so a day of them is never all in memory at once.
    for (r, turn) in trace.iter().zip(&turns) {
        let at_s = r.timestamp as f64 * a.time_scale / 1e3;
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(at_s)).into()).await;
        let (ids, out) = scaled(r, a);
        prompt += ids.len() as u64;
        sizes.push((ids.len(), out));
        let (done, rx) = watch::channel(false);
        let after = turn.map(|p| answered[p].clone());
        answered.push(rx);
        let c = clients[tasks.len() % CONNECTIONS].clone();
        let eos = a.eos;
        tasks.push(tokio::spawn(async move {
            if let Some(mut previous) = after {
                // Its sender is dropped only after it sent: an error is an answer too.
                let _ = previous.wait_for(|&d| d).await;
            }
            let sent = t0.elapsed().as_secs_f64();
            let s = one(c, ids, out, eos).await;
            let _ = done.send(true);
            (sent, s)
        }));
    }
    let mut samples: Vec<Sample> = Vec::with_capacity(tasks.len());
    let mut sent_s = Vec::with_capacity(tasks.len());
    let every = (trace.len() / 10).max(50);
    for (i, t) in tasks.into_iter().enumerate() {
        let (sent, s) = t.await.context("a request task panicked")?;
        samples.push(s);
        sent_s.push(sent);
        if !a.json && (i + 1) % every == 0 {
            eprintln!("  {} of {} requests done", i + 1, trace.len());
        }
    }
    if let Some(p) = &a.schedule {
        use std::io::Write;
        let file = std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?;
        let mut w = std::io::BufWriter::new(file);
        for (at_s, (prompt, output)) in sent_s.iter().zip(&sizes) {
            let line = serde_json::json!({"at_s": at_s, "prompt": prompt, "output": output});
            writeln!(w, "{line}")?;
        }
        w.flush()?;
    }
    let wall = t0.elapsed().as_secs_f64();
    let cached: u64 = samples.iter().filter(|s| s.ok).map(|s| u64::from(s.cached_tokens)).sum();
    let hit_rate = if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 };
    // A prompt's KV exists about when its first token does.
    let computed_s: Vec<Option<f64>> =
        samples.iter().zip(&sent_s).map(|(s, at)| s.ok.then(|| at + s.ttft_ms / 1e3)).collect();
    let reachable = share_of_prompts(trace, &reachable_hits(trace, &sent_s, &computed_s));
    let report = serde_json::json!({
        "trace": a.trace.display().to_string(),
        "requests": trace.len(),
        "token_scale": a.token_scale,
        "time_scale": a.time_scale,
        "ideal_hit_rate": ideal,
        "hit_rate": hit_rate,
        "hit_vs_ideal": if ideal > 0.0 { hit_rate / ideal } else { f64::NAN },
        "reachable_hit_rate": reachable,
        "hit_vs_reachable": if reachable > 0.0 { hit_rate / reachable } else { f64::NAN },
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "results": summary(&samples, wall, a.ttft_slo_ms, a.tpot_slo_ms),
    });
    if a.json {
        println!("{report}");
        return Ok(());
    }
    let r = &report["results"];
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    println!("{} requests ({} ok, {} failed) in {wall:.1} s", trace.len(), r["ok"], r["failed"]);
    println!(
        "hit rate {:.3} of an ideal {:.3} ({:.1}% of ideal; {cached} of {prompt} prompt tokens cached)",
        hit_rate,
        ideal,
        100.0 * f(&report["hit_vs_ideal"])
    );
    println!(
        "reachable {reachable:.3}: prefixes computed before the request came ({:.1}% of it hit)",
        100.0 * f(&report["hit_vs_reachable"])
    );
    for (name, key) in [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")] {
        let d = &r[key];
        println!(
            "{name} ms: p50 {:.1}  p90 {:.1}  p99 {:.1}",
            f(&d["p50"]),
            f(&d["p90"]),
            f(&d["p99"])
        );
    }
    println!(
        "goodput {:.2} req/s (SLO TTFT {} ms, TPOT {} ms: {:.0}% attained)",
        f(&r["goodput_req_s"]),
        a.ttft_slo_ms,
        a.tpot_slo_ms,
        100.0 * f(&r["slo_attainment"])
    );
    if let Some(errors) = r["errors"].as_array().filter(|e| !e.is_empty()) {
        println!("errors: {errors:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(scale: f64) -> ReplayArgs {
        ReplayArgs {
            trace: PathBuf::new(),
            limit: None,
            token_scale: scale,
            time_scale: 1.0,
            max_output_tokens: 64,
            eos: false,
            max_prompt_tokens: 4096,
            target: Vec::new(),
            ttft_slo_ms: 0.0,
            tpot_slo_ms: 0.0,
            day: false,
            keep: 1.0,
            schedule: None,
            no_turn_order: false,
            json: false,
        }
    }

    fn req(input: u64, output: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length: input,
            output_length: output,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn shared_trace_blocks_become_shared_token_prefixes() {
        let a = args(1.0 / 32.0);
        let (p1, o1) = scaled(&req(1100, 300, &[0, 1, 3]), &a);
        let (p2, _) = scaled(&req(1536, 10, &[0, 1, 2]), &a);
        let (p3, _) = scaled(&req(1024, 10, &[5, 1]), &a);
        assert_eq!((p1.len(), o1), (34, 9), "lengths scale by 1/32");
        assert_eq!(p1[..32], p2[..32], "blocks 0 and 1 are shared");
        assert_ne!(p1[32..34], p2[32..34], "block 3 is not block 2");
        // Block 1 after another first block has the same tokens; its KV differs, which the
        // hash chain (seeded by everything before it) accounts for.
        assert_eq!(p3[16..32], p1[16..32]);
    }

    #[test]
    fn a_day_rises_and_falls_with_each_hour_its_own() {
        let hour: Vec<TraceRequest> = (0..1000)
            .map(|i| TraceRequest { timestamp: i * 3600, ..req(100, 10, &[0, 1]) })
            .collect();
        let day = as_day(&hour, 1.0);
        let tenth = as_day(&hour, 0.1).len() as f64 / day.len() as f64;
        assert!((0.08..0.12).contains(&tenth), "--keep 0.1 keeps about a tenth: {tenth}");
        let per_hour = |h: u64| day.iter().filter(|r| r.timestamp / 3_600_000 == h).count();
        let (night, noon) = (per_hour(3), per_hour(15));
        assert!((150..=250).contains(&night), "about 20% at 03:00: {night}");
        assert!(noon >= 990, "nearly all at 15:00: {noon}");
        assert!(day.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let ids = |h: u64| day.iter().find(|r| r.timestamp / 3_600_000 == h).unwrap().hash_ids[0];
        assert_ne!(ids(3), ids(4), "hours share no prefix");
        assert!((daily_share(3.0) - 0.2).abs() < 1e-9 && (daily_share(15.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn lengths_are_clamped() {
        let mut a = args(1.0);
        a.max_prompt_tokens = 100;
        a.max_output_tokens = 5;
        let (p, o) = scaled(&req(600, 900, &[1, 2]), &a);
        assert_eq!((p.len(), o), (100, 5));
        let (p, o) = scaled(&req(1, 0, &[9]), &args(1.0 / 32.0));
        assert_eq!((p.len(), o), (1, 1), "never empty");
    }
}
