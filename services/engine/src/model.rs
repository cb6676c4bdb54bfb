//! A model loaded for computing: its card (hyperparameters, tokenizer, fingerprint: the
//! `pdmesh-model` crate) and weight views into the mapped file, kept quantized.
//!
//! What each architecture reads and uses is what llama.cpp's loader and graph for it read and
//! use; a tensor the graph would not use is refused at load, naming it, rather than silently
//! computed differently.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pdmesh_kernels::{HostWeight, SharedBytes, WeightMatrix, WeightType};
pub use pdmesh_model::card::{Arch, ModelCard, ModelConfig, RopeMode};

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};

/// Where a weight lives in the file.
#[derive(Debug, Clone, Copy)]
pub struct WeightRef {
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    pub offset: usize,
    pub size: usize,
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: WeightRef,
    pub wk: WeightRef,
    pub wv: WeightRef,
    /// Biases added to the Q, K and V projections (Qwen2), when the file has them.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// RMS-norm weights (`head_dim` each) applied to every head of Q and of K before RoPE
    /// (Qwen3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: WeightRef,
    pub ffn_norm: Vec<f32>,
    pub w_gate: WeightRef,
    pub w_up: WeightRef,
    pub w_down: WeightRef,
}

/// A loaded model: its card, and weights that are views into the memory-mapped GGUF. It reads
/// as its card (`model.config`, `model.tokenizer`) through `Deref`: a model is a card that can
/// also compute.
pub struct Model {
    pub card: ModelCard,
    pub layers: Vec<LayerWeights>,
    pub token_embd: WeightRef,
    pub output: WeightRef,
    pub output_norm: Vec<f32>,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`, one per rotated pair): pair
    /// `i`'s angle is divided by factor `i`.
    pub rope_freqs: Option<Vec<f32>>,
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
        let gguf = card.gguf();
        let (arch, c) = (card.arch, &card.config);
        let mut t = Tensors { gguf, used: BTreeSet::new() };
        let (hidden, vocab) = (c.hidden, c.vocab);
        let token_embd = t.weight("token_embd.weight", hidden, Some(vocab))?;
        let output = match gguf.tensor("output.weight") {
            Some(_) => t.weight("output.weight", hidden, Some(vocab))?,
            None => token_embd, // tied embeddings
        };
        let output_norm = t.vector("output_norm.weight", hidden)?;
        // llama.cpp gives only llama's graph the frequency factors (qwen2/qwen3 pass none, so
        // a file of theirs with the tensor is refused below as an unused tensor).
        let rope_freqs = match arch {
            Arch::Llama if gguf.tensor("rope_freqs.weight").is_some() => {
                Some(t.vector("rope_freqs.weight", c.head_dim / 2)?)
            }
            _ => None,
        };
        let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let mut lw = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let bias = |t: &mut Tensors<'_>, s: &str, len: usize| {
                let name = format!("blk.{i}.{s}.bias");
                t.optional(&name).then(|| t.vector(&name, len)).transpose()
            };
            let qk_norm = |t: &mut Tensors<'_>, s: &str| match arch {
                Arch::Qwen3 => t.vector(&n(s), hd).map(Some),
                Arch::Llama | Arch::Qwen2 => Ok(None),
            };
            lw.push(LayerWeights {
                attn_norm: t.vector(&n("attn_norm"), hidden)?,
                wq: t.weight(&n("attn_q"), hidden, Some(qd))?,
                wk: t.weight(&n("attn_k"), hidden, Some(kvd))?,
                wv: t.weight(&n("attn_v"), hidden, Some(kvd))?,
                bq: bias(&mut t, "attn_q", qd)?,
                bk: bias(&mut t, "attn_k", kvd)?,
                bv: bias(&mut t, "attn_v", kvd)?,
                q_norm: qk_norm(&mut t, "attn_q_norm")?,
                k_norm: qk_norm(&mut t, "attn_k_norm")?,
                wo: t.weight(&n("attn_output"), qd, Some(hidden))?,
                ffn_norm: t.vector(&n("ffn_norm"), hidden)?,
                w_gate: t.weight(&n("ffn_gate"), hidden, Some(c.ffn))?,
                w_up: t.weight(&n("ffn_up"), hidden, Some(c.ffn))?,
                w_down: t.weight(&n("ffn_down"), c.ffn, Some(hidden))?,
            });
        }
        t.all_used(arch)?;
        Ok(Self { layers: lw, token_embd, output, output_norm, rope_freqs, card })
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
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .map(|w| w.size)
            .sum();
        layers + self.output.size
    }
}

/// The kernels' format for a GGUF tensor type: every type the reader accepts is one the kernels
/// compute with (`ggml_types_match_the_kernels` holds the two lists together).
pub fn weight_type(t: GgmlType) -> WeightType {
    WeightType::from_gguf_id(t.gguf_id()).expect("every GGUF type pdmesh reads has a kernel")
}

/// Looks tensors up by name, keeping the set of those used: a file with a tensor the graph
/// does not use is one whose arithmetic pdmesh does not know (llama.cpp, for its part, fails
/// to load it: its tensor count comes out short).
struct Tensors<'a> {
    gguf: &'a GgufFile,
    used: BTreeSet<String>,
}

impl<'a> Tensors<'a> {
    fn get(&mut self, name: &str) -> Result<&'a TensorInfo> {
        let t = self
            .gguf
            .tensor(name)
            .ok_or_else(|| Error::gguf(format!("tensor {name:?}"), "missing"))?;
        self.used.insert(name.to_string());
        Ok(t)
    }

    /// Whether the file has the tensor.
    fn optional(&self, name: &str) -> bool {
        self.gguf.tensor(name).is_some()
    }

    /// A 2-D weight with `cols` columns (and `rows` rows when known).
    fn weight(&mut self, name: &str, cols: usize, rows: Option<usize>) -> Result<WeightRef> {
        let t = self.get(name)?;
        let (c, r) = t.matrix_shape();
        if t.dims.len() != 2 || c != cols || rows.is_some_and(|rows| rows != r) {
            return Err(Error::gguf(
                format!("tensor {name:?}"),
                format!(
                    "shape {:?}, expected [{cols}, {}]",
                    t.dims,
                    rows.map_or("?".into(), |r| r.to_string())
                ),
            ));
        }
        Ok(WeightRef { ty: weight_type(t.ty), rows: r, cols: c, offset: t.offset, size: t.size })
    }

    /// A 1-D tensor of `n` values (a norm weight, a bias), as f32.
    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.get(name)?;
        if t.dims != [n as u64] {
            return Err(Error::gguf(
                format!("tensor {name:?}"),
                format!("shape {:?}, expected [{n}]", t.dims),
            ));
        }
        let mut out = vec![0f32; n];
        pdmesh_kernels::quant::dequantize_row(
            weight_type(t.ty),
            self.gguf.tensor_data(t),
            &mut out,
        );
        Ok(out)
    }

    fn all_used(&self, arch: Arch) -> Result<()> {
        match self.gguf.tensors.iter().find(|t| !self.used.contains(&t.name)) {
            None => Ok(()),
            Some(t) => Err(Error::UnsupportedModel(format!(
                "tensor {:?} is not part of pdmesh's {} graph",
                t.name,
                arch.name()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;
    use crate::gguf::writer::GgufBuilder;
    use crate::testing::{BuildModel, TinyArch, TinyModel};

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
        assert!(q2.layers.iter().all(|l| l.bq.is_some() && l.bk.is_some() && l.bv.is_some()));
        let q3 = TinyModel { arch: TinyArch::Qwen3, ..Default::default() }.build();
        assert!(q3.layers.iter().all(|l| l.q_norm.is_some() && l.k_norm.is_some()));
    }
}
