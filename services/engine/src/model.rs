//! A model loaded for computing: its card (hyperparameters, tokenizer, fingerprint: the
//! `pdmesh-model` crate) and weight views into the mapped file, kept quantized.
//!
//! Each architecture's weights are read by its file in `models`: what it reads and uses is
//! what llama.cpp's loader and graph for it read and use; a tensor the graph would not use is
//! refused at load, naming it, rather than silently computed differently.

use std::path::{Path, PathBuf};

use pdmesh_kernels::{HostWeight, SharedBytes, WeightMatrix};
pub use pdmesh_model::card::{Arch, ModelCard, ModelConfig, RopeMode};

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::models;
pub use crate::models::{
    Activation, Attention, HeadNorm, Layer, Mlp, RopeFreq, WeightRef, weight_type,
};

/// A loaded model: its card, and weights that are views into the memory-mapped GGUF. It reads
/// as its card (`model.config`, `model.tokenizer`) through `Deref`: a model is a card that can
/// also compute.
pub struct Model {
    pub card: ModelCard,
    pub layers: Vec<Layer>,
    pub token_embd: WeightRef,
    pub output: WeightRef,
    pub output_norm: Vec<f32>,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`, one per rotated pair): pair
    /// `i`'s angle is divided by factor `i`.
    pub rope_freqs: Option<Vec<f32>>,
    /// A factor the embeddings are multiplied by (Gemma's `√hidden`).
    pub embed_scale: Option<f32>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("card", &self.card).finish()
    }
}

impl std::ops::Deref for Model {
    type Target = ModelCard;
    fn deref(&self) -> &ModelCard {
        &self.card
    }
}

impl Model {
    /// Loads a GGUF of one of the architectures pdmesh runs.
    pub fn load(path: &Path) -> Result<Self> {
        let gguf = GgufFile::open(path)?;
        Self::from_gguf(gguf, path.to_path_buf())
    }

    pub fn from_gguf(gguf: GgufFile, path: PathBuf) -> Result<Self> {
        let card = ModelCard::from_gguf(gguf, path)?;
        let w = models::load(card.gguf(), &card.config)?;
        Ok(Self {
            layers: w.layers,
            token_embd: w.token_embd,
            output: w.output,
            output_norm: w.output_norm,
            rope_freqs: w.rope_freqs,
            embed_scale: w.embed_scale,
            card,
        })
    }

    /// A weight as a backend takes it: a view that shares (and keeps alive) the file's bytes.
    pub fn host_weight(&self, w: &WeightRef) -> HostWeight {
        let bytes = SharedBytes::new(self.gguf().shared(), w.offset..w.offset + w.size)
            .expect("checked at load");
        HostWeight::new(w.ty, w.rows, w.cols, bytes).expect("shapes checked at load")
    }

    /// A view of a weight's bytes.
    pub fn weight(&self, w: &WeightRef) -> WeightMatrix<'_> {
        let data = &self.gguf().bytes()[w.offset..w.offset + w.size];
        WeightMatrix { ty: w.ty, rows: w.rows, cols: w.cols, data }
    }

    /// Bytes of weights one forward pass reads through matmuls (every layer's projections and
    /// the output head; the embedding table is only indexed, unless it is the head too): what a
    /// decode step streams from memory besides the KV.
    pub fn matmul_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| l.attn.weights().into_iter().chain(l.mlp.weights()))
            .map(|w| w.size)
            .sum();
        layers + self.output.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::GgufBuilder;
    use crate::gguf::{GgmlType, Value};
    use crate::testing::{BuildModel, TinyArch, TinyModel};
    use pdmesh_kernels::WeightType;

    /// A llama header with a 3-token vocabulary and an embedding, but no layers yet.
    fn base(arch: &str, tok_model: &str) -> GgufBuilder {
        let s = |x: &str| Value::String(x.into());
        GgufBuilder::default()
            .kv("general.architecture", s(arch))
            .kv("llama.block_count", Value::U32(1))
            .kv("llama.context_length", Value::U32(64))
            .kv("llama.embedding_length", Value::U32(32))
            .kv("llama.feed_forward_length", Value::U32(64))
            .kv("llama.attention.head_count", Value::U32(2))
            .kv("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
            .kv("tokenizer.ggml.model", s(tok_model))
            .kv("tokenizer.ggml.tokens", Value::Array(vec![s("a"), s("b"), s("<|im_end|>")]))
            .kv("tokenizer.ggml.merges", Value::Array(vec![]))
            .tensor("token_embd.weight", &[32, 3], GgmlType::Q8_0, vec![0; 3 * 34])
            .tensor("output_norm.weight", &[32], GgmlType::F32, vec![0; 128])
    }

    fn load(b: GgufBuilder) -> String {
        let g = GgufFile::from_bytes(b.build()).unwrap();
        Model::from_gguf(g, "test.gguf".into()).unwrap_err().to_string()
    }

    #[test]
    fn ggml_types_match_the_kernels() {
        let ours: Vec<_> = GgmlType::ALL
            .iter()
            .map(|t| (t.gguf_id(), t.name(), t.block_elems(), t.block_bytes()))
            .collect();
        let kernels: Vec<_> = WeightType::ALL
            .iter()
            .map(|t| (t.gguf_id(), t.name(), t.block_elems(), t.block_bytes()))
            .collect();
        assert_eq!(ours, kernels);
    }

    #[test]
    fn missing_tensor_is_named() {
        let e = load(base("llama", "gpt2"));
        assert!(e.contains("blk.0.attn_norm.weight") && e.contains("missing"), "{e}");
    }

    #[test]
    fn wrong_shape_is_named() {
        let b = base("llama", "gpt2")
            .tensor("blk.0.attn_norm.weight", &[32], GgmlType::F32, vec![0; 128])
            .tensor("blk.0.attn_q.weight", &[32, 31], GgmlType::Q8_0, vec![0; 31 * 34]);
        let e = load(b);
        assert!(e.contains("blk.0.attn_q.weight") && e.contains("shape"), "{e}");
    }

    #[test]
    fn unsupported_architecture_and_tokenizer() {
        let e = load(base("gemma", "gpt2"));
        assert!(e.contains("gemma") && e.contains("general.architecture"), "{e}");
        for kind in ["bert", "t5", "rwkv"] {
            let e = load(base("llama", kind));
            assert!(e.contains("tokenizer.ggml.model") && e.contains(&format!("{kind:?}")), "{e}");
        }
    }

    type Edit = Box<dyn FnOnce(GgufBuilder) -> GgufBuilder>;

    fn refusal(arch: TinyArch, edit: impl FnOnce(GgufBuilder) -> GgufBuilder) -> String {
        load(edit(TinyModel { arch, ..Default::default() }.builder()))
    }

    #[test]
    fn what_would_compute_otherwise_is_refused_by_name() {
        let s = |x: &str| Value::String(x.into());
        let (yarn, longrope) = (s("yarn"), s("longrope"));
        let cases: Vec<(TinyArch, Edit, &str)> = vec![
            (
                TinyArch::Llama,
                Box::new(|b| b.set_kv("llama.rope.scaling.type", yarn)),
                "llama.rope.scaling.type",
            ),
            (
                TinyArch::Qwen2,
                Box::new(|b| b.set_kv("qwen2.rope.scaling.type", longrope)),
                "qwen2.rope.scaling.type",
            ),
            (
                TinyArch::Llama,
                Box::new(|b| b.set_kv("llama.rope.scaling.attn_factor", Value::F32(1.5))),
                "llama.rope.scaling.attn_factor",
            ),
            // A NaN base once panicked the engine's grouping of layers by rotation.
            (
                TinyArch::Llama,
                Box::new(|b| b.set_kv("llama.rope.freq_base", Value::F32(f32::NAN))),
                "llama.rope.freq_base",
            ),
            (
                TinyArch::Gemma3,
                Box::new(|b| b.set_kv("gemma3.rope.freq_base_swa", Value::F32(-1.0))),
                "gemma3.rope.freq_base_swa",
            ),
            (
                TinyArch::Llama,
                Box::new(|b| b.set_kv("llama.expert_count", Value::U32(8))),
                "llama.expert_count",
            ),
            (
                TinyArch::Qwen3,
                Box::new(|b| b.set_kv("qwen3.attention.value_length", Value::U32(16))),
                "qwen3.attention.value_length",
            ),
            (
                TinyArch::Llama,
                Box::new(|b| b.set_kv("llama.rope.dimension_count", Value::U32(8))),
                "llama.rope.dimension_count",
            ),
            // Tensors the graph would not use: an output bias, Llama 3's factors on qwen2.
            (
                TinyArch::Llama,
                Box::new(|b| {
                    b.tensor("blk.1.attn_output.bias", &[64], GgmlType::F32, vec![0; 256])
                }),
                "blk.1.attn_output.bias",
            ),
            (
                TinyArch::Qwen2,
                Box::new(|b| b.tensor("rope_freqs.weight", &[8], GgmlType::F32, vec![0; 32])),
                "rope_freqs.weight",
            ),
            // Qwen3's norms are not optional.
            (
                TinyArch::Qwen3,
                Box::new(|b| b.remove_tensors(|n| n == "blk.0.attn_k_norm.weight")),
                "blk.0.attn_k_norm.weight",
            ),
        ];
        for (arch, edit, name) in cases {
            let e = refusal(arch, edit);
            assert!(e.contains(name), "{arch:?} {name}: {e}");
        }
    }

    #[test]
    fn sliding_window_is_ignored_as_llama_cpp_ignores_it() {
        let plain = TinyModel::default().build();
        let mistral = Model::from_gguf(
            GgufFile::from_bytes(
                TinyModel::default()
                    .builder()
                    .kv("llama.attention.sliding_window", Value::U32(4))
                    .build(),
            )
            .unwrap(),
            "tiny.gguf".into(),
        )
        .unwrap();
        assert_eq!(mistral.config, plain.config);
    }

    #[test]
    fn architectures_read_their_own_keys() {
        for (arch, mode) in [
            (TinyArch::Llama, RopeMode::Normal),
            (TinyArch::Qwen2, RopeMode::Neox),
            (TinyArch::Qwen3, RopeMode::Neox),
        ] {
            let m = TinyModel { arch, ..Default::default() }.build();
            assert_eq!(m.config.rope_mode, mode, "{arch:?}");
            assert_eq!(m.config.head_dim, arch.head_dim(), "{arch:?}");
            assert_eq!(m.config.kv_dim(), 2 * arch.head_dim(), "{arch:?}");
        }
        let q2 = TinyModel { arch: TinyArch::Qwen2, ..Default::default() }.build();
        let a = |l: &Layer| l.attn.clone();
        assert!(
            q2.layers.iter().map(a).all(|a| a.bq.is_some() && a.bk.is_some() && a.bv.is_some())
        );
        assert!(q2.layers.iter().all(|l| l.attn.head_norm.is_none()));
        let q3 = TinyModel { arch: TinyArch::Qwen3, ..Default::default() }.build();
        assert!(q3.layers.iter().all(|l| l.attn.head_norm.is_some()));
        let llama = TinyModel::default().build();
        assert!(llama.layers.iter().all(|l| l.attn.bq.is_none() && l.attn.head_norm.is_none()));
        assert!(llama.layers.iter().all(|l| l.attn.window.is_none()));
    }
}
