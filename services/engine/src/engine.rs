//! The engine: one model, one backend, one paged KV cache, and the batched step that prefill
//! and decode workers drive. A step takes any mix of prompt chunks and single decode tokens from
//! many sequences (up to a token budget) and returns the logits asked for.

use std::sync::Arc;

use pdmesh_kernels::{CpuBackend, Cut, KvDtype, KvSlot, MemoryRegion, Phase, Simd};
use pdmesh_kv_types::HostMemory;
use pdmesh_kv_types::KvLayout;

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvGroups, KvView, SeqId};
use crate::kv_policy::KvPolicy;
use crate::model::Model;
use crate::runtime::{Batch, Device, Rows, Runtime};
use crate::sim::{SimDevice, SimProfile};

/// The CUDA backend's opt-in kernels, each faster where the GPU allows it and each within a
/// stated bound of the CPU's logits instead of bit for bit. Off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// Prompt matmuls of the quantized formats on the int8 tensor cores
    /// (`CudaBackend::with_mma`).
    pub mma: bool,
    /// Prompt attention with flash attention's running softmax (`CudaBackend::with_flash`).
    pub flash: bool,
}

impl CudaOptions {
    fn apply<D: pdmesh_kernels::cuda::Device>(
        self,
        be: pdmesh_kernels::cuda::CudaBackend<D>,
    ) -> pdmesh_kernels::cuda::CudaBackend<D> {
        be.with_mma(self.mma).with_flash(self.flash)
    }
}

/// Which backend computes, with its own options.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendKind {
    /// The host CPU; `simd` forces a kernel set (default: the best the CPU supports).
    Cpu { simd: Option<Simd> },
    /// The CUDA backend on GPU `device` (by ordinal), through the driver loaded at run time.
    Cuda { device: usize, opts: CudaOptions },
    /// The CUDA backend's kernels and host side on the emulated device (CUDA's execution
    /// model on the host's threads): slow, for checking the CUDA backend without a GPU.
    CudaEmu { opts: CudaOptions },
    /// No computation: steps take the time `SimProfile` says the real engine would, and give
    /// deterministic tokens (for studying a mesh larger than the machine; see `sim`).
    Sim(SimProfile),
}

impl Default for BackendKind {
    fn default() -> Self {
        BackendKind::Cpu { simd: None }
    }
}

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
    /// The backend that computes.
    pub backend: BackendKind,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            block_size: 16,
            kv_dtype: KvDtype::F16,
            kv_blocks: 1024,
            max_batch_tokens: 512,
            backend: BackendKind::default(),
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
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Logits {
    None,
    /// Only for the item's last token (end of a prompt, or a decode token).
    Last,
    /// Only the last token's candidates under this cut (`pdmesh_kernels::Cut`, see
    /// `StepLogits::candidates_of`): what a sampler without penalties picks from. When every
    /// item of a step asks for no more, a device reduces the logits where they are and reads
    /// back only the candidates. Otherwise as `Last`.
    Cut(Cut),
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

/// The logits a step produced, row by row in item order: whole, or only each row's greedy
/// candidates when every item asked for no more (`Logits::Cut`).
#[derive(Debug)]
pub struct StepLogits<'a> {
    data: Rows<'a>,
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

    /// Row `i`: which item and token it belongs to, and its logits. A step whose items all
    /// asked for `Logits::Cut` may have none to give (see `candidates_of`): asking is a bug.
    pub fn row(&self, i: usize) -> ((usize, usize), &'a [f32]) {
        (self.rows[i], self.logits(i).expect("the step gave candidates, not logits"))
    }

    fn logits(&self, i: usize) -> Option<&'a [f32]> {
        match self.data {
            Rows::Logits(d) => Some(&d[i * self.vocab..(i + 1) * self.vocab]),
            Rows::Candidates(_) => None,
        }
    }

    /// The logits of item `item`'s last wanted token (none when only greedy picks came back).
    pub fn last_of(&self, item: usize) -> Option<&'a [f32]> {
        let i = self.rows.iter().rposition(|&(it, _)| it == item)?;
        self.logits(i)
    }

    /// The candidates of item `item`'s last wanted token, in no particular order, when the
    /// step cut its logits on the device; `None` when they came back whole (see `last_of`).
    pub fn candidates_of(&self, item: usize) -> Option<&'a [(u32, f32)]> {
        let i = self.rows.iter().rposition(|&(it, _)| it == item)?;
        match self.data {
            Rows::Candidates(c) => Some(c.row(i)),
            Rows::Logits(_) => None,
        }
    }
}

/// Runs a model over a paged KV cache, on the backend its config names.
#[derive(Debug)]
pub struct Engine {
    model: Arc<Model>,
    /// The pool's bookkeeping; its memory is the device's.
    kv: KvCache,
    device: Box<dyn Device>,
    config: EngineConfig,
    /// `(item index, token index within the item)` of each logits row of the last step.
    logit_rows: Vec<(usize, usize)>,
}

impl Engine {
    pub fn new(model: Arc<Model>, config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let geom = match config.backend {
            BackendKind::Sim(_) => SimDevice::geometry(config.block_size, config.kv_dtype),
            BackendKind::Cpu { .. } | BackendKind::Cuda { .. } | BackendKind::CudaEmu { .. } => {
                model.config.kv_geometry(config.block_size, config.kv_dtype)
            }
        };

        if matches!(config.backend, BackendKind::Sim(_)) && geom.dtype.is_q8_0() {
            return Err(Error::invalid(format!(
                "the simulated engine keeps f16 or f32 KV, not {}",
                geom.dtype
            )));
        }
        if geom.dtype.row_bytes(geom.head_dim).is_none() {
            return Err(Error::invalid(format!(
                "KV dtype {} needs a head dimension that is a multiple of {}; this model's is {}",
                geom.dtype,
                pdmesh_kernels::Q8_0_BLOCK,
                geom.head_dim
            )));
        }
        let group = model.config.heads / model.config.kv_heads.max(1);
        if geom.dtype.is_q8_0() && group > pdmesh_kernels::cpu::q8kv::MAX_GROUP {
            return Err(Error::invalid(format!(
                "KV dtype {} supports at most {} query heads per KV head; this model has {group}",
                geom.dtype,
                pdmesh_kernels::cpu::q8kv::MAX_GROUP
            )));
        }
        // Local layers' KV goes in groups of its own, so that it can follow the window (the
        // simulated device keeps no per-layer KV).
        let groups = match (&config.backend, &model.config.sliding_window) {
            (BackendKind::Sim(_), _) | (_, None) => KvGroups::whole(geom.layers),
            (_, Some(w)) => KvGroups::windowed(&w.local, w.tokens),
        };
        let kv = KvCache::grouped(geom, groups, config.kv_blocks)?;
        let (pool, pool_blocks) = (*kv.pool_geometry(), kv.pool_blocks());
        let device: Box<dyn Device> = match &config.backend {
            BackendKind::Cpu { simd: None } => {
                let be = CpuBackend::new(config.threads);
                Box::new(Runtime::new(be, Arc::clone(&model), pool, pool_blocks)?)
            }
            &BackendKind::Cpu { simd: Some(simd) } => {
                let be = CpuBackend::with_simd(config.threads, simd)
                    .map_err(|e| Error::invalid(e.to_string()))?;
                Box::new(Runtime::new(be, Arc::clone(&model), pool, pool_blocks)?)
            }
            &BackendKind::Cuda { device, opts } => {
                let dev = pdmesh_kernels::cuda::GpuDevice::open(device)
                    .map_err(|e| Error::invalid(format!("--backend cuda: {e}")))?;
                let be = opts.apply(pdmesh_kernels::cuda::CudaBackend::new(dev));
                Box::new(Runtime::new(be, Arc::clone(&model), pool, pool_blocks)?)
            }
            &BackendKind::CudaEmu { opts } => {
                let dev = pdmesh_kernels::cuda::EmuDevice;
                let be = opts.apply(pdmesh_kernels::cuda::CudaBackend::new(dev));
                Box::new(Runtime::new(be, Arc::clone(&model), pool, pool_blocks)?)
            }
            BackendKind::Sim(profile) => Box::new(SimDevice::new(
                geom,
                config.kv_blocks,
                profile.clone(),
                model.config.vocab,
                model.tokenizer.eog_tokens().to_vec(),
            )?),
        };
        Ok(Self { model, kv, device, config, logit_rows: Vec::new() })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// What computes, e.g. `cpu/avx2 x2`.
    pub fn describe_backend(&self) -> String {
        self.device.describe()
    }

    /// The KV pool's bookkeeping (blocks, sequences, geometry).
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// The KV of every sequence, for reading.
    pub fn kv_view(&self) -> KvView<'_> {
        KvView::new(&self.kv, self.device.store())
    }

    /// Bytes of KV memory the pool holds.
    pub fn kv_bytes(&self) -> usize {
        self.kv.pool_blocks() * self.kv.pool_geometry().bytes_per_block()
    }

    /// The layout of this engine's KV blocks: what a peer must match to exchange them.
    pub fn kv_layout(&self) -> KvLayout {
        let (g, fingerprint) = (*self.kv.geometry(), self.model.fingerprint);
        match self.config.backend {
            // The simulated device's pool has a shape of its own and keeps no layer's KV.
            BackendKind::Sim(_) => {
                KvLayout { model_fingerprint: fingerprint, geometry: g, window: None }
            }
            _ => self.model.config.kv_layout(fingerprint, g.block_size, g.dtype),
        }
    }

    /// Physical pool block of the sequence's `index`-th block, in a pool of whole blocks
    /// (`KvPool::kv_blocks_whole`).
    pub fn pool_block(&self, seq: SeqId, index: usize) -> Result<u32> {
        self.kv.block(seq, index).map(|b| b as u32)
    }

    /// What a remote writer is granted for the sequence's first `n` blocks: their pool blocks
    /// where the pool keeps blocks whole; else their indices, since such a pool is reached
    /// only through staging, which reads only how many there are.
    pub fn writer_blocks(&self, seq: SeqId, n: usize) -> Result<Vec<u32>> {
        let whole = self.kv.groups().is_whole();
        (0..n).map(|i| if whole { self.pool_block(seq, i) } else { Ok(i as u32) }).collect()
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

    /// Gives `a` the blocks of `b` and `b` those of `a`: a decode node moves a reservation
    /// onto fresh blocks while a writer may still reach its old ones.
    pub fn swap_sequences(&mut self, a: SeqId, b: SeqId) -> Result<()> {
        self.kv.swap(a, b)
    }

    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.kv.free(seq)
    }

    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        self.kv.len(seq)
    }

    /// Puts the sequence's KV under a lossy policy (`None`: keep everything, the default), and
    /// evicts down to its budget at once and after each step the sequence is in.
    pub fn set_kv_policy(&mut self, seq: SeqId, policy: Option<KvPolicy>) -> Result<()> {
        self.kv.set_policy(seq, policy)?;
        // A sequence already past the budget (a whole prompt) is cut down at once.
        self.kv.enforce(seq).map(|_| ())
    }

    /// Tokens the sequence's policy has evicted so far.
    pub fn evicted_tokens(&self, seq: SeqId) -> Result<usize> {
        self.kv.evicted(seq)
    }

    /// The position of the sequence's next token (its length plus what was evicted).
    pub fn seq_position(&self, seq: SeqId) -> Result<usize> {
        self.kv.position(seq)
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
        self.kv.append(seq, n, self.device.store_mut()).map(|_| ())
    }

    /// Blocks the sequence holds.
    pub fn sequence_blocks(&self, seq: SeqId) -> Result<usize> {
        self.kv.block_count(seq)
    }

    /// Lets go of the blocks of `seq`'s windowed layers that no later query reads; returns the
    /// pool blocks freed. Only once nothing reads the sequence's blocks whole again.
    pub fn release_window(&mut self, seq: SeqId) -> Result<usize> {
        self.kv.release_window(seq)
    }

    /// Appends the bytes of the sequence's `index`-th block to `out`.
    pub fn read_block(&self, seq: SeqId, index: usize, out: &mut Vec<u8>) -> Result<()> {
        self.kv_view().read_block(seq, index, out)
    }

    /// Overwrites the sequence's `index`-th block with bytes from `read_block` on an engine of
    /// the same KV layout.
    pub fn write_block(&mut self, seq: SeqId, index: usize, data: &[u8]) -> Result<()> {
        self.write_blocks(seq, index, [data])
    }

    /// `write_block` of consecutive blocks from the sequence's `first`-th, all checked before
    /// any is written, and one wait for a device's copies (not one per block).
    pub fn write_blocks<'d>(
        &mut self,
        seq: SeqId,
        first: usize,
        blocks: impl IntoIterator<Item = &'d [u8]>,
    ) -> Result<()> {
        self.write_wire_blocks(seq, first, 0, blocks)
    }

    /// `write_blocks` of blocks in their wire form: those before `thin` thin (their global
    /// layers, `KvLayout::thin_blocks`), whose local layers no later query reads.
    pub fn write_wire_blocks<'d>(
        &mut self,
        seq: SeqId,
        first: usize,
        thin: usize,
        blocks: impl IntoIterator<Item = &'d [u8]>,
    ) -> Result<()> {
        let layout = self.kv_layout();
        let owned = self.kv.scatter(seq, first, (&layout, thin), blocks)?;
        let writes: Vec<(usize, &[u8])> = owned.iter().map(|(b, d)| (*b, &d[..])).collect();
        self.device.store_mut().write_blocks(&writes).map_err(|e| Error::invalid(e.to_string()))
    }

    /// Appends block `index`'s wire form (thin before `thin`) to `out`.
    pub fn read_wire_block(
        &self,
        seq: SeqId,
        index: usize,
        thin: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.kv_view().read_wire_block(seq, index, (&self.kv_layout(), thin), out)
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
            if let Logits::Cut(c) = it.logits
                && !(c.scale.is_finite()
                    && c.scale > 0.0
                    && c.margin.is_finite()
                    && c.margin >= 0.0)
            {
                return Err(Error::invalid(format!(
                    "step item {i} ({}) asks for a cut with scale {} and margin {}: the scale \
                     must be finite and > 0, the margin finite and >= 0",
                    it.seq, c.scale, c.margin
                )));
            }
            if let Some(&bad) = it.tokens.iter().find(|&&t| t as usize >= self.model.config.vocab) {
                return Err(Error::invalid(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.model.config.vocab
                )));
            }
            let len = self.kv.position(it.seq)?;
            if len + it.tokens.len() > self.max_seq_len() {
                return Err(Error::invalid(format!(
                    "{} would hold {} tokens, past the model's context of {}",
                    it.seq,
                    len + it.tokens.len(),
                    self.max_seq_len()
                )));
            }
            total += it.tokens.len();
            blocks += self.kv.pool_blocks_needed(it.seq, it.tokens.len())?;
        }
        if total > self.config.max_batch_tokens {
            return Err(Error::invalid(format!(
                "step has {total} tokens, over the budget of {}",
                self.config.max_batch_tokens
            )));
        }
        if blocks > self.kv.free_pool_blocks() {
            return Err(Error::KvExhausted { needed: blocks, free: self.kv.free_pool_blocks() });
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
        on_layer: &mut dyn FnMut(usize, &KvView<'_>),
    ) -> Result<StepLogits<'_>> {
        self.validate(items)?;
        let n: usize = items.iter().map(|it| it.tokens.len()).sum();
        let mut tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut cache_pos = Vec::with_capacity(n);
        let mut slots: Vec<Vec<KvSlot>> = vec![Vec::with_capacity(n); self.kv.groups().count()];
        let mut owner = Vec::with_capacity(n);
        let mut phases = Vec::with_capacity(n);
        let mut logit_rows = std::mem::take(&mut self.logit_rows);
        logit_rows.clear();
        let mut logit_tokens = Vec::new();
        // Each wanted row's cut, while every wanted row has one.
        let (mut cuts, mut all_cut) = (Vec::new(), true);
        // Rows whose attention a score-driven policy sums: each item's last.
        let mut probes = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let (start, at) = (self.kv.position(it.seq)?, self.kv.len(it.seq)?);
            let s = self.kv.append(it.seq, it.tokens.len(), self.device.store_mut())?;
            if self.kv.mass(it.seq)?.is_some() {
                probes.push(tokens.len() + it.tokens.len() - 1);
            }
            for (j, &t) in it.tokens.iter().enumerate() {
                let want = match it.logits {
                    Logits::None => false,
                    Logits::Last | Logits::Cut(_) => j + 1 == it.tokens.len(),
                    Logits::All => true,
                };
                if want {
                    logit_rows.push((i, j));
                    logit_tokens.push(tokens.len());
                    match it.logits {
                        Logits::Cut(c) => cuts.push(c),
                        _ => all_cut = false,
                    }
                }
                tokens.push(t);
                positions.push(start + j);
                cache_pos.push(at + j);
                owner.push(it.seq);
                phases.push(it.phase);
            }
            for (g, part) in slots.iter_mut().zip(s.chunks_exact(it.tokens.len())) {
                g.extend_from_slice(part);
            }
        }
        if !all_cut {
            cuts.clear();
        }
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            cache_pos: &cache_pos,
            probes: &probes,
            slots: &slots,
            owner: &owner,
            phases: &phases,
            cuts: &cuts,
            logit_tokens: &logit_tokens,
        };
        // The attention mass the probes gave each block, per probed sequence.
        let mut mass = Vec::new();
        let data = self.device.forward(&self.kv, &batch, on_layer, &mut mass);
        for (id, m) in &mass {
            self.kv.add_mass(*id, m);
        }
        // A policy's budget holds after every step (its evictions were checked when set).
        for it in items {
            self.kv.enforce(it.seq).expect("a policy evicts only full blocks it holds");
        }
        self.logit_rows = logit_rows;
        Ok(StepLogits { data, vocab: self.model.config.vocab, rows: &self.logit_rows })
    }
}

/// A transport offers the engine's pool through this, without linking the engine (the
/// trait's documentation is the contract).
impl pdmesh_kv_types::KvPool for Engine {
    fn kv_geometry(&self) -> pdmesh_kv_types::KvGeometry {
        *self.kv.geometry()
    }

    fn kv_blocks_whole(&self) -> bool {
        self.kv.groups().is_whole()
    }

    fn kv_bytes(&self) -> usize {
        Engine::kv_bytes(self)
    }

    fn kv_memory(&self) -> MemoryRegion {
        self.device.store().region()
    }

    fn rehome_kv(&mut self, memory: HostMemory) -> std::result::Result<(), String> {
        // Blocks are not carried over, and regions handed out earlier keep naming the old
        // memory: only an empty pool moves.
        if self.kv.free_blocks() != self.kv.total_blocks() {
            return Err(Error::invalid("the KV pool moves only while it holds no KV").to_string());
        }
        self.device.store_mut().rehome(memory).map_err(|e| kv_alloc(&e))
    }

    fn kv_staging_memory(&self, len: usize) -> std::result::Result<HostMemory, String> {
        self.device.store().staging(len).map_err(|e| kv_alloc(&e))
    }

    fn kv_pin(&self, memory: HostMemory) -> std::result::Result<HostMemory, (HostMemory, String)> {
        self.device.store().pin(memory).map_err(|(m, e)| (m, kv_alloc(&e)))
    }
}

/// A KV memory failure as the engine words it.
fn kv_alloc(e: &impl std::fmt::Display) -> String {
    Error::KvAlloc(e.to_string()).to_string()
}
