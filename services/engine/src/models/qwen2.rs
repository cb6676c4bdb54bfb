//! `qwen2`: Qwen2 and Qwen2.5. Llama's layers with NEOX RoPE (the card's) and Q/K/V biases;
//! no RoPE frequency factors (llama.cpp gives them to llama's graph alone, so a qwen2 file
//! with `rope_freqs.weight` is refused as an unused tensor).

use super::blocks::{Attention, HeadNorms, Layer, Mlp, Weights};
use super::{Architecture, Tensors};
use crate::error::Result;
use crate::model::ModelConfig;

pub(crate) struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }

    fn load(&self, t: &mut Tensors<'_>, c: &ModelConfig) -> Result<Weights> {
        Weights::load(t, c, None, |t, i| {
            let attn = |t: &mut Tensors<'_>| Attention::load(t, i, c, HeadNorms::None);
            Layer::pre_norm(t, i, c, attn, |t| Mlp::swiglu(t, i, c))
        })
    }
}
