//! `llama`: Llama 1–3 and Mistral. Pre-norm layers of attention (normal RoPE; Q/K/V biases
//! when the file has them) and a SwiGLU MLP; Llama 3's RoPE frequency factors when the file
//! has them.
//!
//! `llama.attention.sliding_window` is not read, as llama.cpp's llama loader does not read
//! it: Mistral 7B v0.1 was trained with a 4,096-token window, but llama.cpp's converter does
//! not write the key for arch llama, and a file that has it computes full attention there, so
//! it does here.

use super::blocks::{Attention, HeadNorms, Layer, Mlp, Weights};
use super::{Architecture, Tensors};
use crate::error::Result;
use crate::model::ModelConfig;

pub(crate) struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn load(&self, t: &mut Tensors<'_>, c: &ModelConfig) -> Result<Weights> {
        let rope_freqs = t.optional_vector("rope_freqs.weight", c.head_dim / 2)?;
        Weights::load(t, c, rope_freqs, |t, i| {
            let attn = |t: &mut Tensors<'_>| Attention::load(t, i, c, HeadNorms::None);
            Layer::pre_norm(t, i, c, attn, |t| Mlp::swiglu(t, i, c))
        })
    }
}
