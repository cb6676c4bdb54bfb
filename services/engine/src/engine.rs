//! The engine: one model, one backend, one paged KV cache, and the batched step that prefill
//! and decode workers drive. A step takes any mix of prompt chunks and single decode tokens from
//! many sequences (up to a token budget) and returns the logits asked for.

use std::sync::Arc;

use pdmesh_kernels::{
    Activations, AttnQuery, Backend, CpuBackend, KvDtype, KvSlot, MatmulJob, MemoryRegion, Phase,
    Simd,
};
use pdmesh_kv_types::KvLayout;

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::Model;

/// Engine settings.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Compute threads (0 = one per available core).
    pub threads: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    pub kv_dtype: KvDtype,
    /// Blocks in the KV pool.
    pub kv_blocks: usize,
    /// Most tokens one step may process (the continuous-batching token budget).
    pub max_batch_tokens: usize,
    /// Force a kernel set (default: the best the CPU supports).
    pub simd: Option<Simd>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            block_size: 16,
            kv_dtype: KvDtype::F16,
            kv_blocks: 1024,
            max_batch_tokens: 512,
            simd: None,
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<()> {
        if self.threads > 1024 {
            return Err(Error::invalid(format!("threads {} is more than 1024", self.threads)));
        }
        if self.block_size == 0 || self.block_size > 1024 {
            return Err(Error::invalid(format!(
                "block_size {} must be in 1..=1024",
                self.block_size
            )));
        }
        if self.kv_blocks == 0 {
            return Err(Error::invalid("kv_blocks must be at least 1"));
        }
        if self.max_batch_tokens == 0 {
            return Err(Error::invalid("max_batch_tokens must be at least 1"));
        }
        Ok(())
    }
}

/// Which logits a step item wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    /// Only for the item's last token (end of a prompt, or a decode token).
    Last,
    /// For every token of the item (scoring, perplexity).
    All,
}

/// One sequence's share of a step: its next tokens.
#[derive(Debug, Clone, Copy)]
pub struct StepItem<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub logits: Logits,
    /// Prompt tokens (any number per step) or a generated token (one).
    pub phase: Phase,
}

impl<'a> StepItem<'a> {
    /// A chunk of prompt tokens.
    pub fn prefill(seq: SeqId, tokens: &'a [u32], logits: Logits) -> Self {
        Self { seq, tokens, logits, phase: Phase::Prefill }
    }

    /// One generated token, whose logits are wanted.
    pub fn decode(seq: SeqId, token: &'a [u32; 1]) -> Self {
        Self { seq, tokens: token, logits: Logits::Last, phase: Phase::Decode }
    }
}

/// The logits a step produced, row by row in item order.
#[derive(Debug)]
pub struct StepLogits<'a> {
    data: &'a [f32],
    vocab: usize,
    /// `(item index, token index within the item)` per row.
    rows: &'a [(usize, usize)],
}

impl<'a> StepLogits<'a> {
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Row `i`: which item and token it belongs to, and its logits.
    pub fn row(&self, i: usize) -> ((usize, usize), &'a [f32]) {
        (self.rows[i], &self.data[i * self.vocab..(i + 1) * self.vocab])
    }

    /// The logits of item `item`'s last requested token.
    pub fn last_of(&self, item: usize) -> Option<&'a [f32]> {
        let i = self.rows.iter().rposition(|&(it, _)| it == item)?;
        Some(self.row(i).1)
    }
}

/// Reusable activation buffers, sized to the largest step seen.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    acts: Activations,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    ffn: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    logits: Vec<f32>,
    logit_rows: Vec<(usize, usize)>,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch").finish_non_exhaustive()
    }
}

fn fit(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
}

/// Runs a model over a paged KV cache.
#[derive(Debug)]
pub struct Engine {
    model: Arc<Model>,
    backend: Box<dyn Backend>,
    kv: KvCache,
    config: EngineConfig,
    scratch: Scratch,
    /// Ratio between the rotation angles of consecutive rotary pairs.
    theta_scale: f32,
}

impl Engine {
    pub fn new(model: Arc<Model>, config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let backend: Box<dyn Backend> = match config.simd {
            None => Box::new(CpuBackend::new(config.threads)),
            Some(simd) => Box::new(
                CpuBackend::with_simd(config.threads, simd)
                    .map_err(|e| Error::invalid(e.to_string()))?,
            ),
        };
        let geom = model.config.kv_geometry(config.block_size, config.kv_dtype);
        let kv = KvCache::new(geom, config.kv_blocks)?;
        let c = &model.config;
        let theta_scale = c.rope_base.powf(-2.0 / c.head_dim as f32);
        Ok(Self { model, backend, kv, config, scratch: Scratch::default(), theta_scale })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// The KV pool's memory, for a transport to register: one allocation that never moves or
    /// grows, kept alive by the region itself; block `b` starts at
    /// `addr + b * bytes_per_block`.
    pub fn kv_memory(&self) -> MemoryRegion {
        self.kv.buffer.region()
    }

    /// The layout of this engine's KV blocks: what a peer must match to exchange them.
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout { model_fingerprint: self.model.fingerprint, geometry: *self.kv.geometry() }
    }

    /// Physical pool block of the sequence's `index`-th block.
    pub fn pool_block(&self, seq: SeqId, index: usize) -> Result<u32> {
        self.kv.block(seq, index).map(|b| b as u32)
    }

    /// The model's context length, the most tokens one sequence may hold.
    pub fn max_seq_len(&self) -> usize {
        self.model.config.context
    }

    pub fn create_sequence(&mut self) -> SeqId {
        self.kv.create()
    }

    pub fn fork_sequence(&mut self, src: SeqId) -> Result<SeqId> {
        self.kv.fork(src)
    }

    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.kv.free(seq)
    }

    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        self.kv.len(seq)
    }

    /// Appends `n` slots to `seq` without computing them: for KV that arrives from another node
    /// and is written with `write_block`.
    pub fn extend_sequence(&mut self, seq: SeqId, n: usize) -> Result<()> {
        if self.kv.len(seq)? + n > self.max_seq_len() {
            return Err(Error::invalid(format!(
                "{n} more tokens do not fit the context of {}",
                self.max_seq_len()
            )));
        }
        self.kv.append(seq, n).map(|_| ())
    }

    /// Blocks the sequence holds.
    pub fn sequence_blocks(&self, seq: SeqId) -> Result<usize> {
        Ok(self.kv.blocks(seq)?.len())
    }

    /// Appends the bytes of the sequence's `index`-th block to `out`.
    pub fn read_block(&self, seq: SeqId, index: usize, out: &mut Vec<u8>) -> Result<()> {
        self.kv.read_block(seq, index, out)
    }

    /// Overwrites the sequence's `index`-th block with bytes from `read_block` on an engine of
    /// the same KV layout.
    pub fn write_block(&mut self, seq: SeqId, index: usize, data: &[u8]) -> Result<()> {
        let block = self.kv.block(seq, index)?;
        self.kv.buffer.write_block_bytes(block, data).map_err(Error::invalid)
    }

    /// Checks a step without changing anything.
    fn validate(&self, items: &[StepItem<'_>]) -> Result<()> {
        if items.is_empty() {
            return Err(Error::invalid("a step needs at least one item"));
        }
        let mut total = 0usize;
        let mut blocks = 0usize;
        let mut seen = std::collections::HashSet::new();
        for (i, it) in items.iter().enumerate() {
            if it.tokens.is_empty() {
                return Err(Error::invalid(format!("step item {i} ({}) has no tokens", it.seq)));
            }
            if it.phase == Phase::Decode && it.tokens.len() != 1 {
                return Err(Error::invalid(format!(
                    "step item {i} ({}) is a decode item with {} tokens; decode takes one",
                    it.seq,
                    it.tokens.len()
                )));
            }
            if !seen.insert(it.seq) {
                return Err(Error::invalid(format!("{} appears twice in one step", it.seq)));
            }
            if let Some(&bad) = it.tokens.iter().find(|&&t| t as usize >= self.model.config.vocab) {
                return Err(Error::invalid(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.model.config.vocab
                )));
            }
            let len = self.kv.len(it.seq)?;
            if len + it.tokens.len() > self.max_seq_len() {
                return Err(Error::invalid(format!(
                    "{} would hold {} tokens, past the model's context of {}",
                    it.seq,
                    len + it.tokens.len(),
                    self.max_seq_len()
                )));
            }
            total += it.tokens.len();
            blocks += self.kv.blocks_needed(it.seq, it.tokens.len())?;
        }
        if total > self.config.max_batch_tokens {
            return Err(Error::invalid(format!(
                "step has {total} tokens, over the budget of {}",
                self.config.max_batch_tokens
            )));
        }
        if blocks > self.kv.free_blocks() {
            return Err(Error::KvExhausted { needed: blocks, free: self.kv.free_blocks() });
        }
        Ok(())
    }

    /// Runs one batched forward step: appends each item's tokens to its sequence and returns
    /// the requested logits. On error nothing has changed.
    pub fn step(&mut self, items: &[StepItem<'_>]) -> Result<StepLogits<'_>> {
        self.step_observed(items, &mut |_, _| {})
    }

    /// `step`, calling `on_layer(l, kv)` as soon as layer `l`'s KV for every item is written,
    /// before layer `l + 1` is computed: a transport ships layer `l` while the rest computes.
    pub fn step_observed(
        &mut self,
        items: &[StepItem<'_>],
        on_layer: &mut dyn FnMut(usize, &KvCache),
    ) -> Result<StepLogits<'_>> {
        self.validate(items)?;
        let n: usize = items.iter().map(|it| it.tokens.len()).sum();
        let mut tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut slots: Vec<KvSlot> = Vec::with_capacity(n);
        let mut owner = Vec::with_capacity(n);
        let mut phases = Vec::with_capacity(n);
        let mut logit_rows = std::mem::take(&mut self.scratch.logit_rows);
        logit_rows.clear();
        let mut logit_tokens = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let start = self.kv.len(it.seq)?;
            let s = self.kv.append(it.seq, it.tokens.len())?;
            for (j, &t) in it.tokens.iter().enumerate() {
                let want = match it.logits {
                    Logits::None => false,
                    Logits::Last => j + 1 == it.tokens.len(),
                    Logits::All => true,
                };
                if want {
                    logit_rows.push((i, j));
                    logit_tokens.push(tokens.len());
                }
                tokens.push(t);
                positions.push(start + j);
                owner.push(it.seq);
                phases.push(it.phase);
            }
            slots.extend(s);
        }
        self.forward(&tokens, &positions, &slots, &owner, &phases, &logit_tokens, on_layer);
        self.scratch.logit_rows = logit_rows;
        Ok(StepLogits {
            data: &self.scratch.logits,
            vocab: self.model.config.vocab,
            rows: &self.scratch.logit_rows,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        tokens: &[u32],
        positions: &[usize],
        slots: &[KvSlot],
        owner: &[SeqId],
        phases: &[Phase],
        logit_tokens: &[usize],
        on_layer: &mut dyn FnMut(usize, &KvCache),
    ) {
        let model = &*self.model;
        let c = &model.config;
        let be = self.backend.as_ref();
        let s = &mut self.scratch;
        let n = tokens.len();
        let (d, hd, qd) = (c.hidden, c.head_dim, c.heads * c.head_dim);
        let kvd = c.kv_heads * hd;
        let half = hd / 2;
        fit(&mut s.x, n * d);
        fit(&mut s.xn, n * d);
        fit(&mut s.q, n * qd);
        fit(&mut s.k, n * kvd);
        fit(&mut s.v, n * kvd);
        fit(&mut s.attn, n * qd);
        fit(&mut s.proj, n * d);
        fit(&mut s.gate, n * c.ffn);
        fit(&mut s.up, n * c.ffn);
        fit(&mut s.ffn, n * c.ffn);
        fit(&mut s.cos, n * half);
        fit(&mut s.sin, n * half);
        for (t, &p) in positions.iter().enumerate() {
            // Angles by repeated multiplication, as llama.cpp computes them, so both round alike.
            let mut theta = p as f32;
            for i in 0..half {
                s.cos[t * half + i] = theta.cos();
                s.sin[t * half + i] = theta.sin();
                theta *= self.theta_scale;
            }
        }

        be.embed(&model.weight(&model.token_embd), tokens, &mut s.x);

        // The queries borrow the block tables, the kernels the pool: separate fields, so the
        // whole cache can still be lent (shared) to `on_layer` between layers.
        let seqs = &self.kv.seqs;
        let queries: Vec<AttnQuery<'_>> = positions
            .iter()
            .zip(owner)
            .zip(phases)
            .map(|((&pos, id), &phase)| AttnQuery { pos, blocks: &seqs[id].blocks, phase })
            .collect();

        for (li, l) in model.layers.iter().enumerate() {
            be.rms_norm(&s.x, &l.attn_norm, c.rms_eps, &mut s.xn);
            be.quantize(&s.xn, n, d, &mut s.acts);
            be.matmul(
                &s.acts,
                &mut [
                    MatmulJob { weight: model.weight(&l.wq), out: &mut s.q },
                    MatmulJob { weight: model.weight(&l.wk), out: &mut s.k },
                    MatmulJob { weight: model.weight(&l.wv), out: &mut s.v },
                ],
            );
            be.rope(&mut s.q, c.heads, hd, &s.cos, &s.sin);
            be.rope(&mut s.k, c.kv_heads, hd, &s.cos, &s.sin);
            be.kv_write(&mut self.kv.buffer, li, &s.k, &s.v, slots);
            on_layer(li, &self.kv);
            be.attention(&self.kv.buffer, li, c.heads, &s.q, &queries, &mut s.attn);
            be.quantize(&s.attn, n, qd, &mut s.acts);
            be.matmul(&s.acts, &mut [MatmulJob { weight: model.weight(&l.wo), out: &mut s.proj }]);
            be.add_assign(&mut s.x, &s.proj);

            be.rms_norm(&s.x, &l.ffn_norm, c.rms_eps, &mut s.xn);
            be.quantize(&s.xn, n, d, &mut s.acts);
            be.matmul(
                &s.acts,
                &mut [
                    MatmulJob { weight: model.weight(&l.w_gate), out: &mut s.gate },
                    MatmulJob { weight: model.weight(&l.w_up), out: &mut s.up },
                ],
            );
            be.swiglu(&s.gate, &s.up, &mut s.ffn);
            be.quantize(&s.ffn, n, c.ffn, &mut s.acts);
            be.matmul(
                &s.acts,
                &mut [MatmulJob { weight: model.weight(&l.w_down), out: &mut s.proj }],
            );
            be.add_assign(&mut s.x, &s.proj);
        }

        let m = logit_tokens.len();
        fit(&mut s.logits, m * c.vocab);
        if m == 0 {
            return;
        }
        // Only the rows whose logits were asked for go through the output head.
        let mut sel = std::mem::take(&mut s.proj);
        fit(&mut sel, m * d);
        for (r, &t) in logit_tokens.iter().enumerate() {
            sel[r * d..(r + 1) * d].copy_from_slice(&s.x[t * d..(t + 1) * d]);
        }
        fit(&mut s.xn, m * d);
        be.rms_norm(&sel, &model.output_norm, c.rms_eps, &mut s.xn);
        be.quantize(&s.xn, m, d, &mut s.acts);
        be.matmul(
            &s.acts,
            &mut [MatmulJob { weight: model.weight(&model.output), out: &mut s.logits }],
        );
        s.proj = sel;
    }
}
