//! The simulated engine (`--engine sim`): a device that computes nothing. Each step sleeps as
//! long as the real engine would take for the same batch, by a profile calibrated from
//! `pdmesh bench engine --json`, and yields deterministic tokens. Everything above the device
//! (batch runner, KV blocks, transfer, node services, the router) is the real code; it exists
//! to drive the real router, planner and placement with more nodes than one machine can run
//! real engines for. Its KV cache has a one-layer, one-head shape of four values, so KV still
//! moves block by block between nodes at a few bytes a token; such nodes can only pair with
//! each other (their layout differs from the model's).

use std::collections::BTreeMap;
use std::time::Duration;

use pdmesh_kernels::{KvBuffer, KvDtype, KvGeometry, KvStorage, Phase};
use pdmesh_kv_types::KvShape;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvView, SeqId};
use crate::runtime::{Batch, Device, Rows};

/// The KV shape of a simulated node: the least that still moves block by block.
pub const SIM_KV_SHAPE: KvShape = KvShape { layers: 1, kv_heads: 1, head_dim: 4 };

/// The calibration the engine bundles: `pdmesh bench engine --json` of the default model on
/// the CPU of the machine pdmesh is developed on (2 cores, AVX2).
const BUILTIN_PROFILE: &str = include_str!("sim_profile.json");

/// How long the real engine takes for a step: prompt tokens at a measured rate, decode steps
/// by batch size between measured points.
#[derive(Debug, Clone, PartialEq)]
pub struct SimProfile {
    /// Prompt tokens a second.
    pub prefill_tok_s: f64,
    /// `(batch size, seconds a decode step of that many sequences takes)`, by batch size.
    pub decode_step_s: Vec<(usize, f64)>,
    /// Where the numbers come from (a file, or "built-in").
    pub source: String,
}

/// The fields of `pdmesh bench engine --json` the profile reads.
#[derive(Deserialize)]
struct BenchJson {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    #[serde(default)]
    batched_decode_tok_s: BTreeMap<String, f64>,
    #[serde(default)]
    backend: String,
}

impl SimProfile {
    /// The bundled calibration.
    pub fn builtin() -> Self {
        Self::from_bench_json(BUILTIN_PROFILE, "built-in")
            .expect("the bundled sim profile is valid")
    }

    /// Reads a profile from a file holding `pdmesh bench engine --json`'s output.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::invalid(format!("engine.sim_profile: cannot read {}: {e}", path.display()))
        })?;
        Self::from_bench_json(&text, &path.display().to_string())
    }

    /// Parses `pdmesh bench engine --json`'s output; every rate must be positive and finite.
    pub fn from_bench_json(text: &str, source: &str) -> Result<Self> {
        let bad = |m: String| Error::invalid(format!("engine.sim_profile {source}: {m}"));
        let b: BenchJson = serde_json::from_str(text.trim())
            .map_err(|e| bad(format!("not `pdmesh bench engine --json` output: {e}")))?;
        let rate_ok = |r: f64| r.is_finite() && r > 0.0;
        if !rate_ok(b.prefill_tok_s) || !rate_ok(b.decode_tok_s) {
            return Err(bad(format!(
                "prefill_tok_s {} and decode_tok_s {} must be positive",
                b.prefill_tok_s, b.decode_tok_s
            )));
        }
        let mut points = BTreeMap::from([(1usize, 1.0 / b.decode_tok_s)]);
        for (k, &rate) in &b.batched_decode_tok_s {
            let n: usize = k
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("batch size {k:?} is not a positive integer")))?;
            if !rate_ok(rate) {
                return Err(bad(format!("batched decode rate {rate} at {n} must be positive")));
            }
            // A batch's step takes its sequences over the aggregate rate.
            points.insert(n, n as f64 / rate);
        }
        let via = if b.backend.is_empty() { String::new() } else { format!(" ({})", b.backend) };
        Ok(Self {
            prefill_tok_s: b.prefill_tok_s,
            decode_step_s: points.into_iter().collect(),
            source: format!("{source}{via}"),
        })
    }

    /// Seconds a decode step of `batch` sequences takes: linear between measured batch sizes,
    /// and along the last measured slope beyond them.
    pub fn decode_step_seconds(&self, batch: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let p = &self.decode_step_s;
        let i = p.partition_point(|&(b, _)| b < batch);
        if i < p.len() && p[i].0 == batch {
            return p[i].1;
        }
        let (lo, hi) = match (i, p.len()) {
            (_, 1) => return p[0].1 * batch as f64 / p[0].0 as f64,
            (0, _) => (p[0], p[1]),
            (i, n) if i == n => (p[n - 2], p[n - 1]),
            (i, _) => (p[i - 1], p[i]),
        };
        let slope = (hi.1 - lo.1) / (hi.0 - lo.0) as f64;
        (lo.1 + slope * (batch as f64 - lo.0 as f64)).max(0.0)
    }

    /// Seconds a step of `prompt` prompt tokens and `decode` decode tokens takes.
    pub fn step_seconds(&self, prompt: usize, decode: usize) -> f64 {
        prompt as f64 / self.prefill_tok_s + self.decode_step_seconds(decode)
    }

    /// Decode tokens a second one node gives at `batch` sequences.
    pub fn decode_tok_s(&self, batch: usize) -> f64 {
        batch as f64 / self.decode_step_seconds(batch.max(1))
    }
}

/// The token a simulated model emits after `token` at `position`: mixed from both (so
/// sequences differ), never an end-of-generation token (so lengths are what was asked).
pub fn sim_token(token: u32, position: usize, vocab: usize, eog: &[u32]) -> u32 {
    let mut x = u64::from(token) ^ (position as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let vocab = vocab.max(1) as u64;
    let mut t = (x % vocab) as u32;
    // At most `eog.len()` steps: the vocabulary holds more than its end tokens.
    while eog.contains(&t) && vocab > eog.len() as u64 {
        t = ((u64::from(t) + 1) % vocab) as u32;
    }
    t
}

/// A device whose steps take calibrated time and compute a fixed function of the input.
#[derive(Debug)]
pub(crate) struct SimDevice {
    kv: KvBuffer,
    profile: SimProfile,
    vocab: usize,
    eog: Vec<u32>,
    logits: Vec<f32>,
}

impl SimDevice {
    pub fn new(
        geometry: KvGeometry,
        blocks: usize,
        profile: SimProfile,
        vocab: usize,
        eog: Vec<u32>,
    ) -> Result<Self> {
        let kv = KvBuffer::new(geometry, blocks).map_err(|e| Error::KvAlloc(e.to_string()))?;
        Ok(Self { kv, profile, vocab, eog, logits: Vec::new() })
    }

    /// The geometry of a simulated node's pool.
    pub fn geometry(block_size: usize, dtype: KvDtype) -> KvGeometry {
        KvGeometry::new(SIM_KV_SHAPE, block_size, dtype)
    }
}

impl Device for SimDevice {
    fn describe(&self) -> String {
        format!(
            "sim ({:.0} prefill tok/s, {:.1} ms decode step; calibrated by {})",
            self.profile.prefill_tok_s,
            1e3 * self.profile.decode_step_seconds(1),
            self.profile.source
        )
    }

    fn store(&self) -> &dyn KvStorage {
        &self.kv
    }

    fn store_mut(&mut self) -> &mut dyn KvStorage {
        &mut self.kv
    }

    fn forward(
        &mut self,
        cache: &KvCache,
        batch: &Batch<'_>,
        on_layer: &mut dyn FnMut(usize, &KvView<'_>),
        _mass: &mut Vec<(SeqId, Vec<f32>)>,
    ) -> Rows<'_> {
        let decode = batch.phases.iter().filter(|&&p| p == Phase::Decode).count();
        let prompt = batch.phases.len() - decode;
        let secs = self.profile.step_seconds(prompt, decode);
        std::thread::sleep(Duration::from_secs_f64(secs));
        on_layer(0, &KvView::new(cache, &self.kv));
        let v = self.vocab;
        self.logits.clear();
        self.logits.resize(batch.logit_tokens.len() * v, -1e9);
        for (row, &i) in self.logits.chunks_exact_mut(v.max(1)).zip(batch.logit_tokens) {
            let t = sim_token(batch.tokens[i], batch.positions[i], v, &self.eog);
            row[t as usize] = 0.0;
        }
        // The simulated device has its logits on the host already: it gives them whole.
        Rows::Logits(&self.logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BENCH: &str = r#"{"prefill_tok_s": 1000.0, "decode_tok_s": 50.0,
        "batched_decode_tok_s": {"1": 50.0, "4": 160.0, "16": 320.0}, "backend": "cpu/avx2 x2"}"#;

    #[test]
    fn steps_follow_the_measured_points() {
        let p = SimProfile::from_bench_json(BENCH, "t").unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(p.decode_step_seconds(1), 0.02));
        assert!(close(p.decode_step_seconds(4), 0.025));
        assert!(close(p.decode_step_seconds(16), 0.05));
        // Halfway between 4 and 16, and along the 4→16 slope past 16.
        assert!(close(p.decode_step_seconds(10), 0.0375));
        assert!(close(p.decode_step_seconds(28), 0.075));
        assert!(close(p.step_seconds(500, 0), 0.5));
        assert!(close(p.step_seconds(500, 4), 0.525));
        assert_eq!(p.decode_step_seconds(0), 0.0);
        assert!(close(p.decode_tok_s(16), 320.0));
        assert!(p.source.contains("cpu/avx2"));
    }

    #[test]
    fn bad_profiles_are_refused_with_the_field() {
        let e = SimProfile::from_bench_json("{}", "p.json").unwrap_err().to_string();
        assert!(e.contains("p.json") && e.contains("bench engine"), "{e}");
        let neg = BENCH.replace("1000.0", "-1");
        assert!(
            SimProfile::from_bench_json(&neg, "p").unwrap_err().to_string().contains("positive")
        );
        let zero_batch = BENCH.replace("\"16\"", "\"0\"");
        let e = SimProfile::from_bench_json(&zero_batch, "p").unwrap_err().to_string();
        assert!(e.contains("batch size"), "{e}");
        SimProfile::builtin();
    }

    #[test]
    fn a_sim_engine_generates_the_sim_tokens_in_a_small_pool() {
        use crate::engine::{BackendKind, Engine, EngineConfig};
        use crate::generate::generate;
        use crate::runner::GenerateParams;
        let fast = BENCH.replace("1000.0", "1e9").replace("50.0", "1e9");
        let profile = SimProfile::from_bench_json(&fast, "t").unwrap();
        let model = crate::testing::tiny_model();
        let cfg =
            EngineConfig { kv_blocks: 8, backend: BackendKind::Sim(profile), ..Default::default() };
        let mut e = Engine::new(std::sync::Arc::clone(&model), cfg).unwrap();
        assert_eq!(e.kv_layout().geometry.layers, 1, "the sim pool's shape, not the model's");
        assert!(e.describe_backend().starts_with("sim"));
        let prompt = [1, 2, 3, 4, 5];
        let params = GenerateParams { max_tokens: 20, ..Default::default() };
        let g = generate(&mut e, &prompt, &params, |_| true).unwrap();
        let (vocab, eog) = (model.config.vocab, model.tokenizer.eog_tokens());
        let mut want = Vec::new();
        let mut last = (prompt[4], 4);
        for _ in 0..20 {
            let t = sim_token(last.0, last.1, vocab, eog);
            want.push(t);
            last = (t, last.1 + 1);
        }
        assert_eq!(g.tokens, want, "greedy follows the sim's chain to max_tokens");
        assert_eq!(e.kv().free_blocks(), 8, "the sequence was freed");
    }

    #[test]
    fn tokens_are_fixed_and_never_end_generation() {
        let eog = [3, 7];
        for pos in 0..2000 {
            let t = sim_token(pos as u32 % 11, pos, 8, &eog);
            assert!(t < 8 && !eog.contains(&t));
            assert_eq!(t, sim_token(pos as u32 % 11, pos, 8, &eog));
        }
        assert_ne!(sim_token(5, 1, 50_000, &[]), sim_token(5, 2, 50_000, &[]));
    }
}
