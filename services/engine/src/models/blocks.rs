//! The blocks a layer is made of, as weights read from the file: the attention over the paged
//! cache, the MLP, and the RMS norms before each. What varies between architectures within a
//! block is a property of it (Q/K/V biases, per-head Q/K norms, a sliding window), which the
//! runtime's block functions compute; a new kind of block is a new variant here and there.

use crate::error::{Error, Result};
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
}

/// Whether an architecture's attention has per-head Q/K norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadNorms {
    None,
    Required,
}

impl Attention {
    /// Layer `i`'s attention: biases where the file has them (llama.cpp adds each one the
    /// file has), head norms as the architecture requires, full attention.
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
        Ok(Self { wq, wk, wv, wo, bq, bk, bv, head_norm, window: None })
    }

    pub fn weights(&self) -> [&WeightRef; 4] {
        [&self.wq, &self.wk, &self.wv, &self.wo]
    }
}

/// The feed-forward block.
#[derive(Debug, Clone)]
pub enum Mlp {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu { gate: WeightRef, up: WeightRef, down: WeightRef },
}

impl Mlp {
    /// Layer `i`'s SwiGLU MLP.
    pub(crate) fn swiglu(t: &mut Tensors<'_>, i: usize, c: &ModelConfig) -> Result<Self> {
        let w = |s: &str| format!("blk.{i}.{s}.weight");
        Ok(Mlp::SwiGlu {
            gate: t.weight(&w("ffn_gate"), c.hidden, Some(c.ffn))?,
            up: t.weight(&w("ffn_up"), c.hidden, Some(c.ffn))?,
            down: t.weight(&w("ffn_down"), c.ffn, Some(c.hidden))?,
        })
    }

    pub fn weights(&self) -> Vec<&WeightRef> {
        match self {
            Mlp::SwiGlu { gate, up, down } => vec![gate, up, down],
        }
    }
}

/// A pre-norm decoder layer: `x += attn(norm(x)); x += mlp(norm(x))`.
#[derive(Debug, Clone)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    pub ffn_norm: Vec<f32>,
    pub mlp: Mlp,
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
        let attn_norm = t.vector(&format!("blk.{i}.attn_norm.weight"), c.hidden)?;
        let attn = attn(t)?;
        let ffn_norm = t.vector(&format!("blk.{i}.ffn_norm.weight"), c.hidden)?;
        Ok(Self { attn_norm, attn, ffn_norm, mlp: mlp(t)? })
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
        if let Some(w) = layers.iter().find_map(|l| l.attn.window)
            && w < c.context
        {
            // The attention kernels attend to the whole prefix; computing a window as full
            // attention would be silently wrong past it.
            return Err(Error::UnsupportedModel(format!(
                "sliding-window attention ({w} of {} tokens) is not in the attention kernels",
                c.context
            )));
        }
        Ok(Self { layers, token_embd, output, output_norm, rope_freqs })
    }
}
