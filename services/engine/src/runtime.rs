//! The forward pass on one backend, as blocks (`attention`, `mlp`, the norms before them)
//! that every architecture's layers are made of (`models`): the model's
//! weights prepared for it, its KV pool and its scratch buffers, all in the backend's own
//! memory types. `Runtime<B>` is generic (every kernel call is static), and the engine holds it
//! as a `Device` trait object chosen from its config, so nothing above this file names a
//! backend.

use std::sync::Arc;

use pdmesh_kernels::{
    ActNeeds, AttnQuery, Backend, Candidates, Cut, KvGeometry, KvSlot, KvStorage, MatmulJob, Phase,
    Rope, RopeMode,
};

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvView, SeqId};
use crate::model::{Mlp, Model, ModelConfig};

/// One step's tokens, in the order the step items listed them.
#[derive(Debug)]
pub(crate) struct Batch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    pub slots: &'a [KvSlot],
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
    fn forward(
        &mut self,
        cache: &KvCache,
        batch: &Batch<'_>,
        on_layer: &mut dyn FnMut(usize, &KvView<'_>),
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
}

/// An MLP block's weights on the backend.
enum MlpWeights<B: Backend> {
    SwiGlu {
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
            MlpWeights::SwiGlu { needs_gate_up, .. } => *needs_gate_up,
        }
    }
}

struct LayerWeights<B: Backend> {
    attn_norm: B::Buffer,
    attn: AttentionWeights<B>,
    ffn_norm: B::Buffer,
    mlp: MlpWeights<B>,
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
    cos: B::Buffer,
    sin: B::Buffer,
    sel: B::Buffer,
    logits: B::Buffer,
    /// Host side: the RoPE tables before upload, the logits after download.
    host_cos: Vec<f32>,
    host_sin: Vec<f32>,
    host_logits: Vec<f32>,
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
    /// Ratio between the rotation angles of consecutive rotary pairs.
    theta_scale: f32,
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
                };
                let mlp = match &l.mlp {
                    Mlp::SwiGlu { gate, up, down } => MlpWeights::SwiGlu {
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
                    ffn_norm: vector(&l.ffn_norm),
                    mlp,
                }
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
            cos: backend.buffer(),
            sin: backend.buffer(),
            sel: backend.buffer(),
            logits: backend.buffer(),
            host_cos: Vec::new(),
            host_sin: Vec::new(),
            host_logits: Vec::new(),
            host_cands: Candidates::default(),
            sel_phases: Vec::new(),
        };
        let c = &model.config;
        Ok(Self {
            token_embd: weight(&model.token_embd),
            output: weight(&model.output),
            needs_output: ActNeeds::of([model.output.ty]),
            output_norm: vector(&model.output_norm),
            layers,
            scratch,
            theta_scale: c.rope_base.powf(-2.0 / c.head_dim as f32),
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
        for (t, &p) in batch.positions.iter().enumerate() {
            // Angles by repeated multiplication, divided by the pair's frequency factor and
            // then scaled, in the order llama.cpp's `ggml_rope_cache_init` and `rope_yarn`
            // take them, so both round alike (a factor and a scale of 1 change no bit).
            let mut theta = p as f32;
            for (i, &ff) in self.freq_factors.iter().enumerate() {
                let angle = c.rope_freq_scale * (theta / ff);
                s.host_cos[t * half + i] = angle.cos();
                s.host_sin[t * half + i] = angle.sin();
                theta *= self.theta_scale;
            }
        }
        be.upload(&s.host_cos, &mut s.cos);
        be.upload(&s.host_sin, &mut s.sin);

        be.embed(&self.token_embd, batch.tokens, &mut s.x);

        let queries: Vec<AttnQuery<'_>> = batch
            .positions
            .iter()
            .zip(batch.owner)
            .zip(batch.phases)
            .map(|((&pos, id), &phase)| AttnQuery { pos, blocks: &cache.seqs[id].blocks, phase })
            .collect();

        let rotation = self.kv.geometry().rotation();
        let step = Step { c, n, phases: batch.phases, mode };
        for (li, l) in self.layers.iter().enumerate() {
            // x += attn(norm(x)); x += mlp(norm(x)): the pre-norm layer of every
            // architecture here.
            norm_into(be, s, &l.attn_norm, &step, l.attn.needs_qkv);
            let kv = &mut self.kv;
            attention(be, kv, li, &l.attn, s, &step, rotation, batch.slots, &queries, &mut |kv| {
                on_layer(li, &KvView::new(cache, kv))
            });
            be.add_assign(&mut s.x, &s.proj);
            norm_into(be, s, &l.ffn_norm, &step, l.mlp.needs_in());
            mlp(be, &l.mlp, s, &step);
            be.add_assign(&mut s.x, &s.proj);
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
    mode: RopeMode,
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
    queries: &[AttnQuery<'_>],
    on_kv: &mut dyn FnMut(&B::Kv),
) {
    let (c, n, mode) = (step.c, step.n, step.mode);
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
    if let Some((n_k, n_v)) = rotation {
        be.rope(&mut s.q, c.heads, hd, &s.cos, &s.sin, mode);
        be.rope(&mut s.k, c.kv_heads, hd, &s.cos, &s.sin, mode);
        be.fwht(&mut s.q, n_k);
        be.fwht(&mut s.k, n_k);
        be.fwht(&mut s.v, n_v);
        be.kv_write(kv, li, &s.k, &s.v, slots);
    } else {
        let rope = Rope { cos: &s.cos, sin: &s.sin, mode };
        let (q, k, v) = (&mut s.q, &mut s.k, &s.v);
        be.rope_kv_write(kv, li, q, k, v, c.heads, rope, slots);
    }
    on_kv(kv);
    be.attention(kv, li, c.heads, &s.q, queries, &mut s.attn);
    if let Some((_, n_v)) = rotation {
        be.fwht(&mut s.attn, n_v);
    }
    be.quantize(&s.attn, n, qd, a.needs_o, step.phases, &mut s.acts);
    be.matmul(&s.acts, &mut [MatmulJob { weight: &a.wo, out: &mut s.proj }]);
}

/// The MLP block on the normed activations, into `s.proj`.
fn mlp<B: Backend>(be: &B, m: &MlpWeights<B>, s: &mut Scratch<B>, step: &Step<'_>) {
    match m {
        MlpWeights::SwiGlu { needs_down, gate, up, down, .. } => {
            be.matmul(
                &s.acts,
                &mut [
                    MatmulJob { weight: gate, out: &mut s.gate },
                    MatmulJob { weight: up, out: &mut s.up },
                ],
            );
            be.swiglu(&s.gate, &s.up, &mut s.ffn);
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
