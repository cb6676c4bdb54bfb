//! The blocks a layer is made of, as weights read from the file: the attention over the paged
//! cache, the MLP, and the RMS norms before (and, in Gemma, after) each. What varies between
//! architectures within a block is a property of it (Q/K/V biases, per-head Q/K norms, a
//! sliding window, its RoPE, a query scale), which the runtime's block functions compute; a
//! new kind of block is a new variant here and there.

use crate::error::Result;
use crate::model::ModelConfig;
use crate::models::Tensors;
use pdmesh_kernels::WeightType;

/// Where a weight lives in the file.
#[derive(Debug, Clone, Copy)]
pub struct WeightRef {
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    pub offset: usize,
    pub size: usize,
}

/// Per-head RMS norms (`head_dim` weights each) applied to every head of Q and of K before
/// RoPE (Qwen3).
#[derive(Debug, Clone)]
pub struct HeadNorm {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
}

/// Self-attention over the paged KV cache: Q/K/V projections, RoPE, attention, output
/// projection.
#[derive(Debug, Clone)]
pub struct Attention {
    pub wq: WeightRef,
    pub wk: WeightRef,
    pub wv: WeightRef,
    pub wo: WeightRef,
    /// Biases added to the Q, K and V projections, each when the file has it.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub head_norm: Option<HeadNorm>,
    /// Tokens a query attends back to, itself included, when the layer's attention is a
    /// sliding window; `None` attends to the whole prefix.
    pub window: Option<usize>,
    /// The RoPE it rotates Q and K by.
    pub rope: RopeFreq,
    /// A factor Q is multiplied by after RoPE, the scores then taken unscaled (Gemma's
    /// `f_attention_scale`); `None` scales the scores by `1/√head_dim` instead.
    pub q_scale: Option<f32>,
}

/// A RoPE's base and the factor every angle is multiplied by (`1 / linear scaling factor`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeFreq {
    pub base: f32,
    pub scale: f32,
}

/// Whether an architecture's attention has per-head Q/K norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadNorms {
    None,
    Required,
}

impl Attention {
    /// Layer `i`'s attention: biases where the file has them (llama.cpp adds each one the
    /// file has), head norms as the architecture requires, the model's window for the layer
    /// and the RoPE that goes with it.
    pub(crate) fn load(
        t: &mut Tensors<'_>,
        i: usize,
        c: &ModelConfig,
        norms: HeadNorms,
    ) -> Result<Self> {
        let w = |s: &str| format!("blk.{i}.{s}.weight");
        let b = |s: &str| format!("blk.{i}.{s}.bias");
        let (hidden, qd, kvd) = (c.hidden, c.q_dim(), c.kv_dim());
        let wq = t.weight(&w("attn_q"), hidden, Some(qd))?;
        let wk = t.weight(&w("attn_k"), hidden, Some(kvd))?;
        let wv = t.weight(&w("attn_v"), hidden, Some(kvd))?;
        let bq = t.optional_vector(&b("attn_q"), qd)?;
        let bk = t.optional_vector(&b("attn_k"), kvd)?;
        let bv = t.optional_vector(&b("attn_v"), kvd)?;
        let head_norm = match norms {
            HeadNorms::None => None,
            HeadNorms::Required => Some(HeadNorm {
                q: t.vector(&w("attn_q_norm"), c.head_dim)?,
                k: t.vector(&w("attn_k_norm"), c.head_dim)?,
            }),
        };
        let wo = t.weight(&w("attn_output"), qd, Some(hidden))?;
        let window = c.window(i);
        let rope = match (&c.sliding_window, window) {
            (Some(sw), Some(_)) => RopeFreq { base: sw.rope_base, scale: sw.rope_freq_scale },
            _ => RopeFreq { base: c.rope_base, scale: c.rope_freq_scale },
        };
        Ok(Self { wq, wk, wv, wo, bq, bk, bv, head_norm, window, rope, q_scale: None })
    }

    pub fn weights(&self) -> [&WeightRef; 4] {
        [&self.wq, &self.wk, &self.wv, &self.wo]
    }
}

/// The feed-forward block.
#[derive(Debug, Clone)]
pub enum Mlp {
    /// `down(act(gate(x)) * up(x))`, `act` SiLU or GELU.
    Gated { act: Activation, gate: WeightRef, up: WeightRef, down: WeightRef },
}

/// A gated MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU: SwiGLU (Llama, Qwen).
    Silu,
    /// GELU's tanh approximation: GeGLU (Gemma).
    Gelu,
}

impl Mlp {
    /// Layer `i`'s gated MLP with activation `act`.
    pub(crate) fn gated(
        t: &mut Tensors<'_>,
        i: usize,
        c: &ModelConfig,
        act: Activation,
    ) -> Result<Self> {
        let w = |s: &str| format!("blk.{i}.{s}.weight");
        Ok(Mlp::Gated {
            act,
            gate: t.weight(&w("ffn_gate"), c.hidden, Some(c.ffn))?,
            up: t.weight(&w("ffn_up"), c.hidden, Some(c.ffn))?,
            down: t.weight(&w("ffn_down"), c.ffn, Some(c.hidden))?,
        })
    }

    /// Layer `i`'s SwiGLU MLP.
    pub(crate) fn swiglu(t: &mut Tensors<'_>, i: usize, c: &ModelConfig) -> Result<Self> {
        Self::gated(t, i, c, Activation::Silu)
    }

    pub fn weights(&self) -> Vec<&WeightRef> {
        match self {
            Mlp::Gated { gate, up, down, .. } => vec![gate, up, down],
        }
    }
}

/// A pre-norm decoder layer: `x += attn(norm(x)); x += mlp(norm(x))`, each block's output
/// normed once more before it is added when the layer has post-norms (Gemma's "sandwich").
#[derive(Debug, Clone)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub mlp: Mlp,
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl Layer {
    /// Layer `i`: the RMS norm before its attention, the attention `attn` reads, the norm
    /// before its MLP and the MLP `mlp` reads, in that order (a missing tensor is named in the
    /// order of the graph).
    pub(crate) fn pre_norm(
        t: &mut Tensors<'_>,
        i: usize,
        c: &ModelConfig,
        attn: impl FnOnce(&mut Tensors<'_>) -> Result<Attention>,
        mlp: impl FnOnce(&mut Tensors<'_>) -> Result<Mlp>,
    ) -> Result<Self> {
        Self::read(t, i, c, attn, mlp, false)
    }

    /// `pre_norm` with a norm after each block as well (`post_attention_norm`,
    /// `post_ffw_norm`): Gemma's layer.
    pub(crate) fn sandwich(
        t: &mut Tensors<'_>,
        i: usize,
        c: &ModelConfig,
        attn: impl FnOnce(&mut Tensors<'_>) -> Result<Attention>,
        mlp: impl FnOnce(&mut Tensors<'_>) -> Result<Mlp>,
    ) -> Result<Self> {
        Self::read(t, i, c, attn, mlp, true)
    }

    /// The layer's tensors in graph order, with the post-norms when `post`.
    fn read(
        t: &mut Tensors<'_>,
        i: usize,
        c: &ModelConfig,
        attn: impl FnOnce(&mut Tensors<'_>) -> Result<Attention>,
        mlp: impl FnOnce(&mut Tensors<'_>) -> Result<Mlp>,
        post: bool,
    ) -> Result<Self> {
        let norm =
            |t: &mut Tensors<'_>, name: &str| t.vector(&format!("blk.{i}.{name}.weight"), c.hidden);
        let attn_norm = norm(t, "attn_norm")?;
        let attn = attn(t)?;
        let post_attn_norm = if post { Some(norm(t, "post_attention_norm")?) } else { None };
        let ffn_norm = norm(t, "ffn_norm")?;
        let mlp = mlp(t)?;
        let post_ffn_norm = if post { Some(norm(t, "post_ffw_norm")?) } else { None };
        Ok(Self { attn_norm, attn, post_attn_norm, ffn_norm, mlp, post_ffn_norm })
    }
}

/// A model's weights: its layers, and the embedding, final norm and output head around them.
#[derive(Debug, Clone)]
pub struct Weights {
    pub layers: Vec<Layer>,
    pub token_embd: WeightRef,
    pub output: WeightRef,
    pub output_norm: Vec<f32>,
    /// RoPE frequency factors (`rope_freqs.weight`, one per rotated pair): pair `i`'s angle is
    /// divided by factor `i` (Llama 3).
    pub rope_freqs: Option<Vec<f32>>,
    /// A factor the embeddings are multiplied by before the first layer (Gemma's `√hidden`).
    pub embed_scale: Option<f32>,
}

impl Weights {
    /// The embedding (tied to the output head when the file has no `output.weight`), the final
    /// norm, and `c.layers` layers read by `layer`.
    pub(crate) fn load(
        t: &mut Tensors<'_>,
        c: &ModelConfig,
        rope_freqs: Option<Vec<f32>>,
        mut layer: impl FnMut(&mut Tensors<'_>, usize) -> Result<Layer>,
    ) -> Result<Self> {
        let (hidden, vocab) = (c.hidden, c.vocab);
        let token_embd = t.weight("token_embd.weight", hidden, Some(vocab))?;
        let output = match t.has("output.weight") {
            true => t.weight("output.weight", hidden, Some(vocab))?,
            false => token_embd,
        };
        let output_norm = t.vector("output_norm.weight", hidden)?;
        let layers: Vec<Layer> = (0..c.layers).map(|i| layer(t, i)).collect::<Result<_>>()?;
        Ok(Self { layers, token_embd, output, output_norm, rope_freqs, embed_scale: None })
    }
}
