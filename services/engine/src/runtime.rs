//! The forward pass on one backend, as blocks (`attention`, `mlp`, the norms before them)
//! that every architecture's layers are made of (`models`): the model's
//! weights prepared for it, its KV pool and its scratch buffers, all in the backend's own
//! memory types. `Runtime<B>` is generic (every kernel call is static), and the engine holds it
//! as a `Device` trait object chosen from its config, so nothing above this file names a
//! backend.

use std::sync::Arc;

use pdmesh_kernels::{
    ActNeeds, AttnQuery, Backend, Candidates, Cut, KvDtype, KvGeometry, KvSlot, KvStorage,
    MatmulJob, Phase, Rope, RopeMode, WeightType,
};

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvView, SeqId};
use crate::model::{Activation, Mlp, Model, ModelConfig, RopeFreq};

/// One step's tokens, in the order the step items listed them.
#[derive(Debug)]
pub(crate) struct Batch<'a> {
    pub tokens: &'a [u32],
    /// Each token's RoPE position.
    pub positions: &'a [usize],
    /// Each token's index in its sequence's cache: its position less what a lossy policy
    /// evicted.
    pub cache_pos: &'a [usize],
    /// Tokens (indexes into `tokens`) whose attention over their sequence's blocks is summed
    /// into the forward's `mass`, for a score-driven policy.
    pub probes: &'a [usize],
    /// Where each token's KV goes, per KV group (`KvGroups`): `slots[g][t]`.
    pub slots: &'a [Vec<KvSlot>],
    pub owner: &'a [SeqId],
    pub phases: &'a [Phase],
    /// Indexes (into `tokens`) of the tokens whose logits are wanted.
    pub logit_tokens: &'a [usize],
    /// Each wanted row's cut when the step's samplers need no more than its candidates
    /// (`Logits::Cut`): a device may reduce the rows where they are instead of reading them
    /// back. Empty: the rows come back whole.
    pub cuts: &'a [Cut],
}

/// What a step gives back for its wanted rows.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rows<'a> {
    /// Their logits, row after row.
    Logits(&'a [f32]),
    /// Each row's candidates (`pdmesh_kernels::Cut::apply`).
    Candidates(&'a Candidates),
}

/// A backend with its KV pool and the model's weights: what the engine runs steps on.
pub(crate) trait Device: Send + std::fmt::Debug {
    fn describe(&self) -> String;
    fn store(&self) -> &dyn KvStorage;
    fn store_mut(&mut self) -> &mut dyn KvStorage;
    /// Computes `batch` (its KV already has slots in `cache`), calling `on_layer(l, kv)` as soon
    /// as layer `l`'s KV is written; returns the wanted logits, row by row (or their
    /// candidates, when `batch.cuts` lets it).
    /// Each probe's attention mass per block of its sequence, summed over heads and the layers
    /// that attend to the whole sequence, goes into `mass`.
    fn forward(
        &mut self,
        cache: &KvCache,
        batch: &Batch<'_>,
        on_layer: &mut dyn FnMut(usize, &KvView<'_>),
        mass: &mut Vec<(SeqId, Vec<f32>)>,
    ) -> Rows<'_>;
}

/// An attention block's weights on the backend.
struct AttentionWeights<B: Backend> {
    /// Which activation forms the Q/K/V and the output projections consume.
    needs_qkv: ActNeeds,
    needs_o: ActNeeds,
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    wo: B::Weight,
    bq: Option<B::Buffer>,
    bk: Option<B::Buffer>,
    bv: Option<B::Buffer>,
    /// Q's and K's per-head norms.
    head_norm: Option<(B::Buffer, B::Buffer)>,
    /// The sliding window, if the layer attends through one.
    window: Option<usize>,
    /// Which of the runtime's RoPE tables it rotates by.
    rope: usize,
    /// Q's factor after RoPE, the scores then unscaled; else the scores' `1/√head_dim`.
    q_scale: Option<f32>,
}

impl<B: Backend> AttentionWeights<B> {
    /// The scores' factor: 1 where Q was scaled already.
    fn kq_scale(&self, c: &ModelConfig) -> f32 {
        if self.q_scale.is_some() { 1.0 } else { 1.0 / (c.head_dim as f32).sqrt() }
    }
}

/// An MLP block's weights on the backend.
enum MlpWeights<B: Backend> {
    Gated {
        act: Activation,
        needs_gate_up: ActNeeds,
        needs_down: ActNeeds,
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
    },
}

impl<B: Backend> MlpWeights<B> {
    /// The activation forms its input projections consume.
    fn needs_in(&self) -> ActNeeds {
        match self {
            MlpWeights::Gated { needs_gate_up, .. } => *needs_gate_up,
        }
    }
}

struct LayerWeights<B: Backend> {
    attn_norm: B::Buffer,
    attn: AttentionWeights<B>,
    post_attn_norm: Option<B::Buffer>,
    ffn_norm: B::Buffer,
    mlp: MlpWeights<B>,
    post_ffn_norm: Option<B::Buffer>,
}

/// One RoPE's angles for a step's tokens (a model whose window layers rotate by another base
/// has two).
struct RopeTable<B: Backend> {
    freq: RopeFreq,
    /// Ratio between the rotation angles of consecutive rotary pairs.
    theta_scale: f32,
    cos: B::Buffer,
    sin: B::Buffer,
}

/// Reusable buffers, sized to the largest step seen.
struct Scratch<B: Backend> {
    x: B::Buffer,
    xn: B::Buffer,
    acts: B::Activations,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    /// The Q or K heads' norms are written here, then swapped in.
    normed: B::Buffer,
    attn: B::Buffer,
    proj: B::Buffer,
    gate: B::Buffer,
    up: B::Buffer,
    ffn: B::Buffer,
    sel: B::Buffer,
    logits: B::Buffer,
    /// Host side: the RoPE tables before upload, the logits after download.
    host_cos: Vec<f32>,
    host_sin: Vec<f32>,
    host_logits: Vec<f32>,
    /// Q read back for the probes of a score-driven KV policy.
    host_q: Vec<f32>,
    /// The rows' candidates, when only those are wanted.
    host_cands: Candidates,
    /// The phases of the rows `sel` gathered.
    sel_phases: Vec<Phase>,
}

/// The forward pass of one model on backend `B`.
pub(crate) struct Runtime<B: Backend> {
    backend: B,
    model: Arc<Model>,
    kv: B::Kv,
    token_embd: B::Weight,
    output: B::Weight,
    needs_output: ActNeeds,
    output_norm: B::Buffer,
    layers: Vec<LayerWeights<B>>,
    scratch: Scratch<B>,
    /// The RoPEs the layers rotate by, each with its step's angles.
    ropes: Vec<RopeTable<B>>,
    /// Each pair's divisor of its angle (Llama 3's frequency factors; all 1 without them).
    freq_factors: Vec<f32>,
}

impl<B: Backend> std::fmt::Debug for Runtime<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("backend", &self.backend).finish_non_exhaustive()
    }
}

impl<B: Backend> Runtime<B> {
    /// Prepares `model`'s weights for `backend` and allocates a pool of `blocks` KV blocks.
    pub fn new(backend: B, model: Arc<Model>, geometry: KvGeometry, blocks: usize) -> Result<Self> {
        let kv = backend.kv(geometry, blocks).map_err(|e| Error::KvAlloc(e.to_string()))?;
        let vector = |v: &[f32]| {
            let mut b = backend.buffer();
            backend.upload(v, &mut b);
            b
        };
        let weight = |w| backend.weight(&model.host_weight(w));
        let opt_vector = |v: &Option<Vec<f32>>| v.as_deref().map(vector);
        let c = &model.config;
        let mut freqs: Vec<RopeFreq> = Vec::new();
        for l in &model.layers {
            if !freqs.contains(&l.attn.rope) {
                freqs.push(l.attn.rope);
            }
        }
        let layers = model
            .layers
            .iter()
            .map(|l| {
                let a = &l.attn;
                let attn = AttentionWeights {
                    needs_qkv: ActNeeds::of([a.wq.ty, a.wk.ty, a.wv.ty]),
                    needs_o: ActNeeds::of([a.wo.ty]),
                    wq: weight(&a.wq),
                    wk: weight(&a.wk),
                    wv: weight(&a.wv),
                    wo: weight(&a.wo),
                    bq: opt_vector(&a.bq),
                    bk: opt_vector(&a.bk),
                    bv: opt_vector(&a.bv),
                    head_norm: a.head_norm.as_ref().map(|h| (vector(&h.q), vector(&h.k))),
                    window: a.window,
                    rope: freqs.iter().position(|f| *f == a.rope).expect("collected above"),
                    q_scale: a.q_scale,
                };
                let mlp = match &l.mlp {
                    Mlp::Gated { act, gate, up, down } => MlpWeights::Gated {
                        act: *act,
                        needs_gate_up: ActNeeds::of([gate.ty, up.ty]),
                        needs_down: ActNeeds::of([down.ty]),
                        gate: weight(gate),
                        up: weight(up),
                        down: weight(down),
                    },
                };
                LayerWeights {
                    attn_norm: vector(&l.attn_norm),
                    attn,
                    post_attn_norm: opt_vector(&l.post_attn_norm),
                    ffn_norm: vector(&l.ffn_norm),
                    mlp,
                    post_ffn_norm: opt_vector(&l.post_ffn_norm),
                }
            })
            .collect();
        let ropes = freqs
            .into_iter()
            .map(|freq| RopeTable {
                freq,
                theta_scale: freq.base.powf(-2.0 / c.head_dim as f32),
                cos: backend.buffer(),
                sin: backend.buffer(),
            })
            .collect();
        let scratch = Scratch {
            x: backend.buffer(),
            xn: backend.buffer(),
            acts: backend.activations(),
            q: backend.buffer(),
            k: backend.buffer(),
            v: backend.buffer(),
            normed: backend.buffer(),
            attn: backend.buffer(),
            proj: backend.buffer(),
            gate: backend.buffer(),
            up: backend.buffer(),
            ffn: backend.buffer(),
            sel: backend.buffer(),
            logits: backend.buffer(),
            host_cos: Vec::new(),
            host_sin: Vec::new(),
            host_logits: Vec::new(),
            host_q: Vec::new(),
            host_cands: Candidates::default(),
            sel_phases: Vec::new(),
        };
        Ok(Self {
            token_embd: weight(&model.token_embd),
            output: weight(&model.output),
            needs_output: ActNeeds::of([model.output.ty]),
            output_norm: vector(&model.output_norm),
            layers,
            scratch,
            ropes,
            freq_factors: model.rope_freqs.clone().unwrap_or_else(|| vec![1.0; c.head_dim / 2]),
            kv,
            backend,
            model,
        })
    }
}

impl<B: Backend> Device for Runtime<B> {
    fn describe(&self) -> String {
        self.backend.describe()
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
        mass: &mut Vec<(SeqId, Vec<f32>)>,
    ) -> Rows<'_> {
        let c = &self.model.config;
        let mode = rope_mode(c.rope_mode);
        let be = &self.backend;
        let s = &mut self.scratch;
        let n = batch.tokens.len();
        let (d, hd, qd) = (c.hidden, c.head_dim, c.heads * c.head_dim);
        let kvd = c.kv_heads * hd;
        let half = hd / 2;
        be.resize(&mut s.x, n * d);
        be.resize(&mut s.xn, n * d);
        be.resize(&mut s.q, n * qd);
        be.resize(&mut s.k, n * kvd);
        be.resize(&mut s.v, n * kvd);
        be.resize(&mut s.attn, n * qd);
        be.resize(&mut s.proj, n * d);
        be.resize(&mut s.gate, n * c.ffn);
        be.resize(&mut s.up, n * c.ffn);
        be.resize(&mut s.ffn, n * c.ffn);
        s.host_cos.resize(n * half, 0.0);
        s.host_sin.resize(n * half, 0.0);
        for rope in &mut self.ropes {
            for (t, &p) in batch.positions.iter().enumerate() {
                // Angles by repeated multiplication, divided by the pair's frequency factor
                // and then scaled, in the order llama.cpp's `ggml_rope_cache_init` and
                // `rope_yarn` take them, so both round alike (a factor and a scale of 1 change
                // no bit).
                let mut theta = p as f32;
                for (i, &ff) in self.freq_factors.iter().enumerate() {
                    let angle = rope.freq.scale * (theta / ff);
                    s.host_cos[t * half + i] = angle.cos();
                    s.host_sin[t * half + i] = angle.sin();
                    theta *= rope.theta_scale;
                }
            }
            be.upload(&s.host_cos, &mut rope.cos);
            be.upload(&s.host_sin, &mut rope.sin);
        }

        be.embed(&self.token_embd, batch.tokens, &mut s.x);
        if let Some(f) = self.model.embed_scale {
            be.scale(&mut s.x, f);
        }

        // Each KV group's queries, over its own tables; through the window for the groups of
        // layers that have one (a model has at most one window length).
        let groups = cache.groups();
        let queries: Vec<Vec<AttnQuery<'_>>> = (0..groups.count())
            .map(|g| {
                let w = groups.window(g);
                batch
                    .cache_pos
                    .iter()
                    .zip(batch.owner)
                    .zip(batch.phases)
                    .map(|((&pos, id), &phase)| {
                        AttnQuery::full(pos, &cache.seqs[id].tables[g], phase).windowed(w)
                    })
                    .collect()
            })
            .collect();

        let rotation = self.kv.geometry().rotation();
        let step = Step { c, n, phases: batch.phases };
        for (li, l) in self.layers.iter().enumerate() {
            // x += attn(norm(x)); x += mlp(norm(x)): the pre-norm layer of every
            // architecture here, each block's output normed again first where the layer has
            // a post-norm (Gemma).
            norm_into(be, s, &l.attn_norm, &step, l.attn.needs_qkv);
            let kv = &mut self.kv;
            // The layer's group holds its KV, at its index within the group's blocks.
            let (g, at) = groups.place(li);
            let qs = &queries[g];
            debug_assert_eq!(groups.window(g).is_some(), l.attn.window.is_some());
            let rope = &self.ropes[l.attn.rope];
            let how = Attend { rope: Rope { cos: &rope.cos, sin: &rope.sin, mode }, queries: qs };
            let slots = &batch.slots[g];
            attention(be, kv, at, &l.attn, s, &step, rotation, slots, &how, &mut |kv| {
                on_layer(li, &KvView::new(cache, kv))
            });
            if !batch.probes.is_empty() && l.attn.window.is_none() {
                let q = be.read(&s.q, &mut s.host_q);
                probe_mass(&*kv, at, c, l.attn.kq_scale(c), q, qs, batch, mass);
            }
            add_block(be, s, l.post_attn_norm.as_ref(), c.rms_eps);
            norm_into(be, s, &l.ffn_norm, &step, l.mlp.needs_in());
            mlp(be, &l.mlp, s, &step);
            add_block(be, s, l.post_ffn_norm.as_ref(), c.rms_eps);
        }

        let m = batch.logit_tokens.len();
        be.resize(&mut s.logits, m * c.vocab);
        if m > 0 {
            // Only the rows whose logits were asked for go through the output head.
            be.gather_rows(&s.x, batch.logit_tokens, d, &mut s.sel);
            be.resize(&mut s.xn, m * d);
            s.sel_phases.clear();
            s.sel_phases.extend(batch.logit_tokens.iter().map(|&t| batch.phases[t]));
            let (sel, xn, acts) = (&s.sel, &mut s.xn, &mut s.acts);
            let (w, needs) = (&self.output_norm, self.needs_output);
            be.norm_quantize(sel, w, c.rms_eps, (m, d), needs, &s.sel_phases, xn, acts);
            be.matmul(&s.acts, &mut [MatmulJob { weight: &self.output, out: &mut s.logits }]);
        }
        // A row with more candidates than fit sends the step's rows back whole.
        if !batch.cuts.is_empty()
            && be.candidates(&s.logits, c.vocab, batch.cuts, &mut s.host_cands)
        {
            return Rows::Candidates(&s.host_cands);
        }
        Rows::Logits(be.read(&s.logits, &mut s.host_logits))
    }
}

/// What every block of one step shares.
struct Step<'a> {
    c: &'a ModelConfig,
    /// Tokens in the step.
    n: usize,
    phases: &'a [Phase],
}

/// `x += proj`, or `x += norm(proj)` with a post-norm (in `xn`, free once the block's input
/// projections have read it).
fn add_block<B: Backend>(be: &B, s: &mut Scratch<B>, post_norm: Option<&B::Buffer>, eps: f32) {
    match post_norm {
        Some(w) => {
            be.rms_norm(&s.proj, w, eps, &mut s.xn);
            be.add_assign(&mut s.x, &s.xn);
        }
        None => be.add_assign(&mut s.x, &s.proj),
    }
}

/// The RoPE and the queries of one attention block.
struct Attend<'a, 'q, B: Backend> {
    rope: Rope<'a, B::Buffer>,
    queries: &'a [AttnQuery<'q>],
}

/// `xn = norm(x)`, quantized into `acts` as the next projections consume it.
fn norm_into<B: Backend>(
    be: &B,
    s: &mut Scratch<B>,
    w: &B::Buffer,
    step: &Step<'_>,
    needs: ActNeeds,
) {
    let (x, xn, acts) = (&s.x, &mut s.xn, &mut s.acts);
    be.norm_quantize(x, w, step.c.rms_eps, (step.n, step.c.hidden), needs, step.phases, xn, acts);
}

/// The attention block on the normed activations: projections (with biases and per-head
/// norms as the block has them), RoPE, the layer's KV written (`on_kv` called right after),
/// attention over each query's prefix, and the output projection into `s.proj`.
#[allow(clippy::too_many_arguments)]
fn attention<B: Backend>(
    be: &B,
    kv: &mut B::Kv,
    li: usize,
    a: &AttentionWeights<B>,
    s: &mut Scratch<B>,
    step: &Step<'_>,
    rotation: Option<(usize, usize)>,
    slots: &[KvSlot],
    at: &Attend<'_, '_, B>,
    on_kv: &mut dyn FnMut(&B::Kv),
) {
    let (c, n) = (step.c, step.n);
    let Rope { cos, sin, mode } = at.rope;
    let (hd, qd, kvd) = (c.head_dim, c.q_dim(), c.kv_dim());
    be.matmul(
        &s.acts,
        &mut [
            MatmulJob { weight: &a.wq, out: &mut s.q },
            MatmulJob { weight: &a.wk, out: &mut s.k },
            MatmulJob { weight: &a.wv, out: &mut s.v },
        ],
    );
    // Biases as llama.cpp's `ggml_add` after each projection, then the per-head norms
    // (Qwen3) before RoPE, as its graphs order them.
    for (x, b) in [(&mut s.q, &a.bq), (&mut s.k, &a.bk), (&mut s.v, &a.bv)] {
        if let Some(b) = b {
            be.add_rows(x, b);
        }
    }
    if let Some((q_norm, k_norm)) = &a.head_norm {
        for (x, w, len) in [(&mut s.q, q_norm, n * qd), (&mut s.k, k_norm, n * kvd)] {
            be.resize(&mut s.normed, len);
            be.rms_norm(x, w, c.rms_eps, &mut s.normed);
            std::mem::swap(x, &mut s.normed);
        }
    }
    // A quantized cache holds K and V rotated, as llama.cpp's does: Q and K by the same
    // Hadamard matrix (scores are unchanged in exact arithmetic), V by another that the
    // output's rotation undoes.
    // Gemma scales Q after RoPE (a power of two for its head sizes, so exact either way, but
    // Q is rounded to the KV type inside attention: the scale must come first).
    let scale = |be: &B, q: &mut B::Buffer| {
        if let Some(f) = a.q_scale {
            be.scale(q, f);
        }
    };
    if let Some((n_k, n_v)) = rotation {
        be.rope(&mut s.q, c.heads, hd, cos, sin, mode);
        be.rope(&mut s.k, c.kv_heads, hd, cos, sin, mode);
        scale(be, &mut s.q);
        be.fwht(&mut s.q, n_k);
        be.fwht(&mut s.k, n_k);
        be.fwht(&mut s.v, n_v);
        be.kv_write(kv, li, &s.k, &s.v, slots);
    } else {
        let (q, k, v) = (&mut s.q, &mut s.k, &s.v);
        be.rope_kv_write(kv, li, q, k, v, c.heads, at.rope, slots);
        scale(be, &mut s.q);
    }
    on_kv(kv);
    be.attention(kv, li, c.heads, &s.q, a.kq_scale(c), at.queries, &mut s.attn);
    if let Some((_, n_v)) = rotation {
        be.fwht(&mut s.attn, n_v);
    }
    be.quantize(&s.attn, n, qd, a.needs_o, step.phases, &mut s.acts);
    be.matmul(&s.acts, &mut [MatmulJob { weight: &a.wo, out: &mut s.proj }]);
}

/// Adds, for each probe of `batch`, its attention over its sequence's blocks at layer `layer`
/// of the blocks `queries` name (softmax of `q·k · scale` per head, summed over heads and per
/// block) to `mass`. It reads K back as stored and scores in f32 on the host: a ranking for a
/// score-driven policy, which needs no bit-exactness, from any backend.
#[allow(clippy::too_many_arguments)]
fn probe_mass(
    kv: &dyn KvStorage,
    layer: usize,
    c: &ModelConfig,
    scale: f32,
    q: &[f32],
    queries: &[AttnQuery<'_>],
    batch: &Batch<'_>,
    mass: &mut Vec<(SeqId, Vec<f32>)>,
) {
    let g = *kv.geometry();
    let (hd, heads, bs) = (c.head_dim, c.heads, g.block_size);
    let group = heads / g.kv_heads;
    let ty = match g.dtype {
        KvDtype::F32 => WeightType::F32,
        KvDtype::F16 => WeightType::F16,
        KvDtype::Q8_0 | KvDtype::Q8_0NoRot => WeightType::Q8_0,
    };
    let rb = g.row_bytes();
    let (mut bytes, mut k, mut scores) = (Vec::new(), vec![0f32; hd], Vec::new());
    for &t in batch.probes {
        let query = &queries[t];
        let n = query.pos + 1;
        scores.clear();
        scores.resize(heads * n, 0f32);
        for b in 0..n.div_ceil(bs) {
            bytes.clear();
            kv.read_layer(query.blocks[b] as usize, layer, &mut bytes);
            for kh in 0..g.kv_heads {
                for slot in 0..bs.min(n - b * bs) {
                    // K rows come first in a layer's part, head by head.
                    let r = kh * bs + slot;
                    pdmesh_kernels::quant::dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut k);
                    for h in kh * group..(kh + 1) * group {
                        let qh = &q[(t * heads + h) * hd..][..hd];
                        let dot: f32 = qh.iter().zip(&k).map(|(a, b)| a * b).sum();
                        scores[h * n + b * bs + slot] = dot * scale;
                    }
                }
            }
        }
        let mut per_block = vec![0f32; query.blocks.len()];
        for row in scores.chunks_exact(n) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
            for (j, &x) in row.iter().enumerate() {
                per_block[j / bs] += (x - max).exp() / sum;
            }
        }
        let id = batch.owner[t];
        match mass.iter_mut().find(|(s, _)| *s == id) {
            Some((_, m)) => m.iter_mut().zip(&per_block).for_each(|(m, p)| *m += p),
            None => mass.push((id, per_block)),
        }
    }
}

/// The MLP block on the normed activations, into `s.proj`.
fn mlp<B: Backend>(be: &B, m: &MlpWeights<B>, s: &mut Scratch<B>, step: &Step<'_>) {
    match m {
        MlpWeights::Gated { act, needs_down, gate, up, down, .. } => {
            be.matmul(
                &s.acts,
                &mut [
                    MatmulJob { weight: gate, out: &mut s.gate },
                    MatmulJob { weight: up, out: &mut s.up },
                ],
            );
            match act {
                Activation::Silu => be.swiglu(&s.gate, &s.up, &mut s.ffn),
                Activation::Gelu => be.geglu(&s.gate, &s.up, &mut s.ffn),
            }
            be.quantize(&s.ffn, step.n, step.c.ffn, *needs_down, step.phases, &mut s.acts);
            be.matmul(&s.acts, &mut [MatmulJob { weight: down, out: &mut s.proj }]);
        }
    }
}

#[cfg(test)]
#[path = "runtime_tests.rs"]
mod tests;

/// The kernels' name for an architecture's RoPE pairing (the kernels know no model vocabulary).
fn rope_mode(m: pdmesh_model::RopeMode) -> RopeMode {
    match m {
        pdmesh_model::RopeMode::Normal => RopeMode::Normal,
        pdmesh_model::RopeMode::Neox => RopeMode::Neox,
    }
}
