//! `pdmesh bench`: drives a running mesh with N requests of a given prompt and output length,
//! closed-loop at a fixed concurrency or open-loop with Poisson arrivals, optionally alongside
//! K steady long-running streams (the mixed load under which disaggregation matters). Reports
//! time to first token, time per output token, inter-token latency and end-to-end latency
//! (p50/p90/p99), throughput, and goodput under the given SLOs, as a table or JSON.
//! `--engine-alone` runs the same requests on one in-process engine, one at a time: the
//! reference the mesh's overhead is measured against.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use pdmesh_proto::v1::{GenerateRequest, TokenIds, generate_request, generate_response};
use rand::{Rng, SeedableRng};

use pdmesh_cli::args::EngineArgs;

#[derive(Debug, Args)]
pub struct MeshBenchArgs {
    /// The routers to drive (comma-separated: requests take them in turn, as a load balancer
    /// in front of several routers would spread them).
    #[arg(long, default_value = "127.0.0.1:50051", value_delimiter = ',')]
    target: Vec<String>,
    /// Send the requests to the router's OpenAI HTTP API at this address (host:port;
    /// `POST /v1/completions`, streamed, over HTTP/2) instead of gRPC Generate; --target
    /// still names the mesh whose credentials are used.
    #[arg(long, value_name = "ADDR")]
    http: Option<String>,
    /// Requests to send.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Requests in flight at once (closed loop). Ignored with --rate.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Poisson arrivals at this many requests per second (open loop) instead of --concurrency.
    #[arg(long)]
    rate: Option<f64>,
    /// Prompt length of each request, in tokens (after the shared prefix, if any).
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens of a prefix every prompt starts with (a system prompt), before its own
    /// --prompt-tokens: what the prefix cache saves.
    #[arg(long, default_value_t = 0)]
    shared_prefix_tokens: usize,
    /// Seeds the shared prefix (default: --seed); a new value makes a prefix no cache holds.
    #[arg(long)]
    prefix_seed: Option<u64>,
    /// Tokens each request generates (end-of-turn is ignored so lengths are exact).
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Steady streams running alongside the requests (16-token prompt, --stream-tokens each,
    /// restarted until the requests are done), started first; their inter-token latency is
    /// reported separately.
    #[arg(long, default_value_t = 0)]
    streams: usize,
    /// Tokens each steady stream generates.
    #[arg(long, default_value_t = 256)]
    stream_tokens: u32,
    /// Time-to-first-token SLO for goodput, in ms.
    #[arg(long, default_value_t = 2000.0)]
    ttft_slo_ms: f64,
    /// Time-per-output-token SLO for goodput, in ms.
    #[arg(long, default_value_t = 100.0)]
    tpot_slo_ms: f64,
    /// Seeds the prompts and the arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run the requests one at a time on an engine in this process instead of a mesh.
    #[arg(long)]
    engine_alone: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// What one request saw.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    pub(crate) ok: bool,
    /// From the mesh's usage: prompt tokens whose KV came from the prefix cache.
    pub(crate) cached_tokens: u32,
    pub(crate) error: Option<String>,
    pub(crate) ttft_ms: f64,
    pub(crate) e2e_ms: f64,
    pub(crate) tokens: usize,
    /// Gaps between consecutive token arrivals after the first.
    pub(crate) itl_ms: Vec<f64>,
    /// Where the mesh says the time to first token went.
    queue_ms: f64,
    prefill_ms: f64,
    pub(crate) transfer_ms: f64,
    /// How the KV moved ("ucx", "grpc", "local").
    pub(crate) kv_transport: String,
    /// The nodes the mesh placed it on.
    prefill_node: String,
    decode_node: String,
    /// Times its decode node preempted it (growing reservations).
    preemptions: u32,
}

impl Sample {
    /// This sample, failed with `why`.
    pub(crate) fn failed(mut self, why: String) -> Sample {
        self.error = Some(why);
        self.ok = false;
        self
    }

    /// `n` tokens arrived at `now` (the request left at `t0`; `last` is the previous arrival):
    /// the first sets the time to first token, a later delta of several spreads its gap.
    pub(crate) fn token_arrived(
        &mut self,
        t0: Instant,
        last: &mut Option<Instant>,
        now: Instant,
        n: usize,
    ) {
        match *last {
            None => self.ttft_ms = ms(now - t0),
            Some(l) => {
                let per = ms(now - l) / n as f64;
                self.itl_ms.extend(std::iter::repeat_n(per, n));
            }
        }
        self.tokens += n;
        *last = Some(now);
    }

    fn tpot_ms(&self) -> Option<f64> {
        (self.tokens > 1).then(|| (self.e2e_ms - self.ttft_ms) / (self.tokens - 1) as f64)
    }
}

/// Keeps a shared prefix's stream apart from the suffixes' when both seeds are equal.
const PREFIX_SALT: u64 = 0x5eed_5eed_5eed_5eed;

fn shared_prefix(a: &MeshBenchArgs) -> Vec<u32> {
    let seed = a.prefix_seed.unwrap_or(a.seed) ^ PREFIX_SALT;
    prompt(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed), a.shared_prefix_tokens)
}

pub(crate) fn prompt(rng: &mut impl Rng, n: usize) -> Vec<u32> {
    // Ordinary vocabulary ids: no special tokens, nothing the tokenizer treats specially.
    (0..n).map(|_| rng.random_range(200..40_000)).collect()
}

/// A connection requests go out on: to the gRPC API or to the HTTP one.
#[derive(Debug, Clone)]
pub(crate) enum Client {
    Grpc(pdmesh_common::apikey::GenerationClient),
    Http(crate::http_load::HttpClient),
}

/// One request of `ids`, generating exactly `max_tokens` (with `eos`, at most: it ends at the
/// model's end of text), timed.
pub(crate) async fn one(client: Client, ids: Vec<u32>, max_tokens: u32, eos: bool) -> Sample {
    match client {
        Client::Grpc(c) => one_grpc(c, ids, max_tokens, eos).await,
        Client::Http(c) => crate::http_load::one(c, ids, max_tokens, eos).await,
    }
}

async fn one_grpc(
    mut client: pdmesh_common::apikey::GenerationClient,
    ids: Vec<u32>,
    max_tokens: u32,
    eos: bool,
) -> Sample {
    let req = GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids })),
        max_tokens,
        ignore_eos: !eos,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut s = Sample::default();
    let mut stream = match client.generate(req).await {
        Ok(r) => r.into_inner(),
        Err(e) => {
            s.error = Some(format!("{:?}: {}", e.code(), e.message()));
            return s;
        }
    };
    let mut last: Option<Instant> = None;
    loop {
        match stream.message().await {
            Ok(Some(m)) => match m.event {
                Some(generate_response::Event::Delta(d)) if !d.token_ids.is_empty() => {
                    s.token_arrived(t0, &mut last, Instant::now(), d.token_ids.len());
                }
                Some(generate_response::Event::Finished(f)) => {
                    s.cached_tokens = f.usage.unwrap_or_default().cached_tokens;
                    let t = f.timings.unwrap_or_default();
                    (s.queue_ms, s.prefill_ms, s.transfer_ms) =
                        (t.queue_ms, t.prefill_ms, t.transfer_ms);
                    (s.prefill_node, s.decode_node) = (t.prefill_node, t.decode_node);
                    s.kv_transport = t.kv_transport;
                    s.preemptions = t.preemptions;
                    s.e2e_ms = ms(t0.elapsed());
                    s.ok = true;
                    return s;
                }
                _ => {}
            },
            Ok(None) => {
                s.error = Some("stream ended without a finish".into());
                return s;
            }
            Err(e) => {
                s.error = Some(format!("{:?}: {}", e.code(), e.message()));
                return s;
            }
        }
    }
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (p / 100.0 * (s.len() - 1) as f64).round() as usize;
    s[rank.min(s.len() - 1)]
}

fn dist(v: &[f64]) -> serde_json::Value {
    serde_json::json!({
        "p50": percentile(v, 50.0), "p90": percentile(v, 90.0), "p99": percentile(v, 99.0),
        "mean": if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 },
    })
}

pub(crate) fn summary(
    samples: &[Sample],
    wall_s: f64,
    ttft_slo: f64,
    tpot_slo: f64,
) -> serde_json::Value {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let ttft: Vec<f64> = ok.iter().map(|s| s.ttft_ms).collect();
    let tpot: Vec<f64> = ok.iter().filter_map(|s| s.tpot_ms()).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|s| s.itl_ms.iter().copied()).collect();
    let e2e: Vec<f64> = ok.iter().map(|s| s.e2e_ms).collect();
    let tokens: usize = ok.iter().map(|s| s.tokens).sum();
    let good = ok
        .iter()
        .filter(|s| s.ttft_ms <= ttft_slo && s.tpot_ms().is_none_or(|t| t <= tpot_slo))
        .count();
    let mut errors: Vec<String> = samples.iter().filter_map(|s| s.error.clone()).collect();
    errors.dedup();
    errors.truncate(5);
    serde_json::json!({
        "requests": samples.len(),
        "ok": ok.len(),
        "failed": samples.len() - ok.len(),
        "errors": errors,
        "ttft_ms": dist(&ttft),
        "tpot_ms": dist(&tpot),
        "itl_ms": dist(&itl),
        "e2e_ms": dist(&e2e),
        "queue_ms": dist(&ok.iter().map(|s| s.queue_ms).collect::<Vec<_>>()),
        "cached_tokens": dist(&ok.iter().map(|s| f64::from(s.cached_tokens)).collect::<Vec<_>>()),
        "prefill_ms": dist(&ok.iter().map(|s| s.prefill_ms).collect::<Vec<_>>()),
        "transfer_ms": dist(&ok.iter().map(|s| s.transfer_ms).collect::<Vec<_>>()),
        "output_tok_s": tokens as f64 / wall_s,
        "output_tokens": tokens,
        "preemptions": ok.iter().map(|s| u64::from(s.preemptions)).sum::<u64>(),
        "req_s": ok.len() as f64 / wall_s,
        "goodput_req_s": good as f64 / wall_s,
        "slo_attainment": if samples.is_empty() { 0.0 } else { good as f64 / samples.len() as f64 },
        "placement": {
            "prefill": spread(ok.iter().map(|s| s.prefill_node.as_str())),
            "decode": spread(ok.iter().map(|s| s.decode_node.as_str())),
        },
    })
}

/// How evenly requests fell on nodes: nodes used, and the busiest node's count against the
/// mean (1.0 is perfectly even).
fn spread<'a>(nodes: impl Iterator<Item = &'a str>) -> serde_json::Value {
    let mut per: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for n in nodes {
        *per.entry(n).or_default() += 1;
    }
    let total: usize = per.values().sum();
    let max = per.values().copied().max().unwrap_or(0);
    let mean = if per.is_empty() { f64::NAN } else { total as f64 / per.len() as f64 };
    serde_json::json!({"nodes_used": per.len(), "max_over_mean": max as f64 / mean})
}

pub fn run(a: MeshBenchArgs, access: &pdmesh_cli::client::Access) -> anyhow::Result<()> {
    if a.requests == 0 || a.prompt_tokens == 0 || a.max_tokens == 0 {
        bail!("--requests, --prompt-tokens and --max-tokens must be at least 1");
    }
    if a.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    if let Some(r) = a.rate
        && !(r.is_finite() && r > 0.0)
    {
        bail!("--rate must be a positive number of requests per second");
    }
    if a.engine_alone {
        return engine_alone(&a);
    }
    let key = access.init(first_target(&a.target)?)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(drive(a, key))
}

/// Connections to the router that requests are spread over: one HTTP/2 connection caps the
/// streams it carries at once, which would queue requests in the client at high rates.
pub(crate) const CONNECTIONS: usize = 8;

/// The router whose credentials a run uses: the first of `targets` (one mesh's routers share
/// them). Fails when there are more routers than connections to spread over them.
pub(crate) fn first_target(targets: &[String]) -> anyhow::Result<&str> {
    match targets {
        [] => bail!("--target needs at least one router"),
        t if t.len() > CONNECTIONS => {
            bail!("--target names {} routers; at most {CONNECTIONS} are driven at once", t.len())
        }
        [first, ..] => Ok(first),
    }
}

/// `CONNECTIONS` clients, taking `targets` in turn: request i goes out on client
/// i % CONNECTIONS, so consecutive requests reach different routers.
pub(crate) async fn connect_many(
    targets: &[String],
    key: Option<&str>,
) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::with_capacity(CONNECTIONS);
    for target in targets.iter().cycle().take(CONNECTIONS) {
        clients.push(Client::Grpc(pdmesh_cli::client::connect(target, key).await?));
    }
    Ok(clients)
}

async fn drive(a: MeshBenchArgs, key: Option<String>) -> anyhow::Result<()> {
    let clients = match &a.http {
        Some(addr) => crate::http_load::connect_many(addr, key.as_deref(), CONNECTIONS)
            .await?
            .into_iter()
            .map(Client::Http)
            .collect(),
        None => connect_many(&a.target, key.as_deref()).await?,
    };
    let client = clients[0].clone();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed);
    // Steady streams first, so the requests arrive into a running decode batch. Each stream
    // starts a new request whenever its last one ends, until every measured request is done,
    // so the streams see every arrival.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut streams = Vec::new();
    for _ in 0..a.streams {
        let ids = prompt(&mut rng, 16);
        let (c, stop, n) = (client.clone(), Arc::clone(&stop), a.stream_tokens);
        streams.push(tokio::spawn(async move {
            let mut v = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let s = one(c.clone(), ids.clone(), n, false).await;
                let failed = !s.ok;
                v.push(s);
                if failed {
                    break;
                }
            }
            v
        }));
    }
    if a.streams > 0 {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let shared = shared_prefix(&a);
    let prompts: Vec<Vec<u32>> = (0..a.requests)
        .map(|_| shared.iter().copied().chain(prompt(&mut rng, a.prompt_tokens)).collect())
        .collect();
    let gaps: Vec<f64> = match a.rate {
        // Exponential inter-arrival times: a Poisson process.
        Some(r) => (0..a.requests).map(|_| -(1.0 - rng.random::<f64>()).ln() / r).collect(),
        None => Vec::new(),
    };
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let total = a.requests;
    let t0 = Instant::now();
    let sem =
        Arc::new(tokio::sync::Semaphore::new(if a.rate.is_some() { total } else { a.concurrency }));
    let mut tasks = Vec::new();
    // Arrivals are kept to their own schedule: a sleep per gap would round each gap up to the
    // timer's millisecond and cap the rate near 1,000 a second.
    let mut due = t0;
    for (i, ids) in prompts.into_iter().enumerate() {
        if let Some(g) = gaps.get(i) {
            due += Duration::from_secs_f64(*g);
            tokio::time::sleep_until(due.into()).await;
        }
        let permit = Arc::clone(&sem).acquire_owned().await?;
        let c = clients[i % CONNECTIONS].clone();
        let (done, max_tokens) = (Arc::clone(&done), a.max_tokens);
        tasks.push(tokio::spawn(async move {
            let s = one(c, ids, max_tokens, false).await;
            drop(permit);
            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if n % 100 == 0 || n == total {
                eprint!("\r[{n}/{total} requests]");
            }
            s
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.push(t.await?);
    }
    let wall = t0.elapsed().as_secs_f64();
    eprintln!();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut stream_samples = Vec::new();
    for s in streams {
        stream_samples.extend(s.await?);
    }
    let stream_wall = t0.elapsed().as_secs_f64() + 0.5;
    let mut report = serde_json::json!({
        "target": a.target.join(","),
        "frontend": if a.http.is_some() { "http" } else { "grpc" },
        "mode": if a.rate.is_some() { "poisson" } else { "closed-loop" },
        "rate": a.rate,
        "concurrency": a.concurrency,
        "prompt_tokens": a.prompt_tokens,
        "shared_prefix_tokens": a.shared_prefix_tokens,
        "max_tokens": a.max_tokens,
        "ttft_slo_ms": a.ttft_slo_ms,
        "tpot_slo_ms": a.tpot_slo_ms,
        "wall_s": wall,
        "results": summary(&samples, wall, a.ttft_slo_ms, a.tpot_slo_ms),
    });
    if a.streams > 0 {
        report["streams"] = summary(&stream_samples, stream_wall, f64::INFINITY, a.tpot_slo_ms);
        let all_tokens: f64 =
            samples.iter().chain(&stream_samples).filter(|s| s.ok).map(|s| s.tokens as f64).sum();
        report["total_output_tok_s"] = serde_json::json!(all_tokens / stream_wall);
    }
    print_report(&report, a.json);
    Ok(())
}

fn engine_alone(a: &MeshBenchArgs) -> anyhow::Result<()> {
    use pdmesh_engine::{GenerateParams, generate};
    let mut engine = a.engine.engine()?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed);
    let params = GenerateParams {
        max_tokens: a.max_tokens as usize,
        ignore_eos: true,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut samples = Vec::new();
    let shared = shared_prefix(a);
    for i in 0..a.requests {
        let ids: Vec<u32> =
            shared.iter().copied().chain(prompt(&mut rng, a.prompt_tokens)).collect();
        let start = Instant::now();
        let mut s = Sample::default();
        let mut last: Option<Instant> = None;
        generate(&mut engine, &ids, &params, |_| {
            let now = Instant::now();
            match last {
                None => s.ttft_ms = ms(now - start),
                Some(l) => s.itl_ms.push(ms(now - l)),
            }
            s.tokens += 1;
            last = Some(now);
            true
        })?;
        s.e2e_ms = ms(start.elapsed());
        s.prefill_ms = s.ttft_ms;
        s.ok = true;
        samples.push(s);
        eprint!("\r[{}/{} requests]", i + 1, a.requests);
    }
    eprintln!();
    let wall = t0.elapsed().as_secs_f64();
    let report = serde_json::json!({
        "target": "engine-alone",
        "mode": "sequential",
        "prompt_tokens": a.prompt_tokens,
        "shared_prefix_tokens": a.shared_prefix_tokens,
        "max_tokens": a.max_tokens,
        "ttft_slo_ms": a.ttft_slo_ms,
        "tpot_slo_ms": a.tpot_slo_ms,
        "wall_s": wall,
        "results": summary(&samples, wall, a.ttft_slo_ms, a.tpot_slo_ms),
    });
    print_report(&report, a.json);
    Ok(())
}

fn print_report(r: &serde_json::Value, json: bool) {
    if json {
        println!("{r}");
        return;
    }
    println!(
        "{} ({}), prompt {} tokens, output {} tokens, {:.1} s",
        r["target"].as_str().unwrap_or(""),
        r["mode"].as_str().unwrap_or(""),
        r["prompt_tokens"],
        r["max_tokens"],
        r["wall_s"].as_f64().unwrap_or(0.0)
    );
    let rows: Vec<(&str, &serde_json::Value)> =
        [("requests", &r["results"]), ("streams", &r["streams"])]
            .into_iter()
            .filter(|(_, v)| !v.is_null())
            .collect();
    println!(
        "{:<10} {:>8} {:>30} {:>30} {:>30} {:>30}",
        "",
        "ok/all",
        "TTFT ms p50/p90/p99",
        "TPOT ms p50/p90/p99",
        "ITL ms p50/p90/p99",
        "E2E ms p50/p90/p99"
    );
    let d = |v: &serde_json::Value| {
        format!(
            "{:.1}/{:.1}/{:.1}",
            v["p50"].as_f64().unwrap_or(f64::NAN),
            v["p90"].as_f64().unwrap_or(f64::NAN),
            v["p99"].as_f64().unwrap_or(f64::NAN)
        )
    };
    for (name, v) in &rows {
        println!(
            "{:<10} {:>8} {:>30} {:>30} {:>30} {:>30}",
            name,
            format!("{}/{}", v["ok"], v["requests"]),
            d(&v["ttft_ms"]),
            d(&v["tpot_ms"]),
            d(&v["itl_ms"]),
            d(&v["e2e_ms"])
        );
    }
    // The mesh's own account of TTFT travels in gRPC's Finished only.
    let timed = r["frontend"] != "http";
    for (name, v) in &rows {
        if timed {
            println!(
                "{name}: TTFT p50 = queue {:.1} + prefill {:.1} + transfer {:.1} ms + relay",
                v["queue_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
                v["prefill_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
                v["transfer_ms"]["p50"].as_f64().unwrap_or(f64::NAN)
            );
        }
        println!(
            "{name}: {:.1} output tok/s, {:.2} req/s, goodput {:.2} req/s ({:.0}% within SLOs)",
            v["output_tok_s"].as_f64().unwrap_or(0.0),
            v["req_s"].as_f64().unwrap_or(0.0),
            v["goodput_req_s"].as_f64().unwrap_or(0.0),
            100.0 * v["slo_attainment"].as_f64().unwrap_or(0.0)
        );
        if let Some(errs) = v["errors"].as_array().filter(|e| !e.is_empty()) {
            println!("{name} errors: {errs:?}");
        }
    }
    if let Some(t) = r["total_output_tok_s"].as_f64() {
        println!("total: {t:.1} output tok/s");
    }
}
