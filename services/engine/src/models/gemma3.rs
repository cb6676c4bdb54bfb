//! `gemma3`: Gemma 3 (text). Per-head RMS norms on Q and K before RoPE, Q scaled after RoPE
//! (`f_attention_scale`) with unscaled scores, a norm after attention and after the MLP
//! before each is added back, a GELU-gated MLP, embeddings scaled by `√hidden`, and five of
//! every six layers attending through a sliding window with a RoPE base of their own (the
//! card's `SlidingWindow`): llama.cpp's `llm_build_gemma3`.

use super::blocks::{Activation, Attention, HeadNorms, Layer, Mlp, Weights};
use super::{Architecture, Tensors};
use crate::error::Result;
use crate::model::ModelConfig;

pub(crate) struct Gemma3;

/// Gemma 3 27B's layer count: llama.cpp scales its queries by `1/√(hidden / heads)` (its
/// query pre-attention scalar) instead of `1/√head_dim`.
const LAYERS_27B: usize = 62;

impl Architecture for Gemma3 {
    fn name(&self) -> &'static str {
        "gemma3"
    }

    fn load(&self, t: &mut Tensors<'_>, c: &ModelConfig) -> Result<Weights> {
        let per_head = if c.layers == LAYERS_27B { c.hidden / c.heads } else { c.head_dim };
        let q_scale = 1.0 / (per_head as f32).sqrt();
        let w = Weights::load(t, c, None, |t, i| {
            let attn = |t: &mut Tensors<'_>| {
                let a = Attention::load(t, i, c, HeadNorms::Required)?;
                Ok(Attention { q_scale: Some(q_scale), ..a })
            };
            Layer::sandwich(t, i, c, attn, |t| Mlp::gated(t, i, c, Activation::Gelu))
        })?;
        // `sqrtf(n_embd)`, in f32 as llama.cpp takes it.
        Ok(Weights { embed_scale: Some((c.hidden as f32).sqrt()), ..w })
    }
}
