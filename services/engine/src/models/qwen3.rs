//! `qwen3`: Qwen3 (dense). Qwen2's layers with per-head RMS norms on Q and K before RoPE
//! (required) and a head size of its own (`qwen3.attention.key_length`, the card's).

use super::blocks::{Attention, HeadNorms, Layer, Mlp, Weights};
use super::{Architecture, Tensors};
use crate::error::Result;
use crate::model::ModelConfig;

pub(crate) struct Qwen3;

impl Architecture for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }

    fn load(&self, t: &mut Tensors<'_>, c: &ModelConfig) -> Result<Weights> {
        Weights::load(t, c, None, |t, i| {
            let attn = |t: &mut Tensors<'_>| Attention::load(t, i, c, HeadNorms::Required);
            Layer::pre_norm(t, i, c, attn, |t| Mlp::swiglu(t, i, c))
        })
    }
}
