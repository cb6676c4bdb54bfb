//! A model loaded from GGUF: hyperparameters from the metadata, weight views into the mapped
//! file (kept quantized), the tokenizer and chat template, and a fingerprint that identifies
//! the exact weights (KV from another model must never be mixed in).
//!
//! The architectures are those whose llama.cpp graphs are the llama block with options:
//! `llama` (Llama 1–3, Mistral: normal RoPE, optional Llama 3 frequency factors), `qwen2` (NEOX
//! RoPE, Q/K/V biases) and `qwen3` (NEOX RoPE, per-head Q/K RMS norms, a head size of its own).
//! What each reads and uses is what llama.cpp's loader and graph for that architecture read and
//! use; anything else in the file (a key that changes the arithmetic, a tensor the graph would
//! not use) is refused at load, naming it, rather than silently computed differently.
//!
//! `{arch}.attention.sliding_window` is ignored, as llama.cpp ignores it for these three
//! architectures: none of their loaders reads it, their KV cache is not the sliding-window
//! kind, and every query attends to its whole prefix. (Mistral 7B v0.1 was trained with a
//! 4,096-token window; llama.cpp's converter does not even write the key for arch llama, and a
//! file that has it computes full attention in llama.cpp, so it does here too.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pdmesh_kernels::{HostWeight, KvDtype, KvGeometry, RopeMode, WeightMatrix, WeightType};
use pdmesh_kv_types::{KvLayout, KvShape};

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, TensorInfo};
use crate::tokenizer::Tokenizer;

/// The architectures pdmesh runs (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }

    /// The prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// llama.cpp's `llama_model_rope_type` for it.
    pub fn rope_mode(self) -> RopeMode {
        match self {
            Arch::Llama => RopeMode::Normal,
            Arch::Qwen2 | Arch::Qwen3 => RopeMode::Neox,
        }
    }
}

/// Hyperparameters of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub name: String,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Size of one head of Q, K and V; `heads × head_dim` need not be `hidden` (Qwen3).
    pub head_dim: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_base: f32,
    /// Multiplies every rotation angle: `1 / {arch}.rope.scaling.factor` for linear scaling.
    pub rope_freq_scale: f32,
    pub rope_mode: RopeMode,
    pub rms_eps: f32,
}

impl ModelConfig {
    /// Width of a token's Q (and of the attention output).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of a token's K and V.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// What one token's KV is made of.
    pub fn kv_shape(&self) -> KvShape {
        KvShape { layers: self.layers, kv_heads: self.kv_heads, head_dim: self.head_dim }
    }

    pub fn kv_geometry(&self, block_size: usize, dtype: KvDtype) -> KvGeometry {
        KvGeometry::new(self.kv_shape(), block_size, dtype)
    }
}

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

/// A loaded model. Weights are views into the memory-mapped GGUF.
pub struct Model {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub layers: Vec<LayerWeights>,
    pub token_embd: WeightRef,
    pub output: WeightRef,
    pub output_norm: Vec<f32>,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`, one per rotated pair): pair
    /// `i`'s angle is divided by factor `i`.
    pub rope_freqs: Option<Vec<f32>>,
    /// Hash of the model's hyperparameters and weight bytes' identity (see `fingerprint`).
    pub fingerprint: u64,
    gguf: GgufFile,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("config", &self.config)
            .field("fingerprint", &format_args!("{:016x}", self.fingerprint))
            .finish()
    }
}

impl Model {
    /// Loads a llama-architecture GGUF.
    pub fn load(path: &Path) -> Result<Self> {
        let gguf = GgufFile::open(path)?;
        Self::from_gguf(gguf, path.to_path_buf())
    }

    pub fn from_gguf(gguf: GgufFile, path: PathBuf) -> Result<Self> {
        let arch_name =
            gguf.require("general.architecture", gguf.get_str("general.architecture"))?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            Error::UnsupportedModel(format!(
                "architecture {arch_name:?} (general.architecture): pdmesh runs llama, qwen2 \
                 and qwen3"
            ))
        })?;
        let h = Hparams::read(&gguf, arch)?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let mut t = Tensors { gguf: &gguf, used: BTreeSet::new() };
        let hidden = h.hidden;
        let token_embd = t.weight("token_embd.weight", hidden, None)?;
        let vocab = token_embd.rows;
        if let Some(v) = gguf.get_u64(&h.key("vocab_size"))?
            && v as usize != vocab
        {
            return Err(Error::gguf(
                "token_embd.weight",
                format!("has {vocab} rows but vocab_size is {v}"),
            ));
        }
        if tokenizer.vocab_size() != vocab {
            return Err(Error::gguf(
                "tokenizer.ggml.tokens",
                format!("{} tokens but the embedding has {vocab} rows", tokenizer.vocab_size()),
            ));
        }
        let output = match gguf.tensor("output.weight") {
            Some(_) => t.weight("output.weight", hidden, Some(vocab))?,
            None => token_embd, // tied embeddings
        };
        let output_norm = t.vector("output_norm.weight", hidden)?;
        // llama.cpp gives only llama's graph the frequency factors (qwen2/qwen3 pass none, so
        // a file of theirs with the tensor is refused below as an unused tensor).
        let rope_freqs = match arch {
            Arch::Llama if gguf.tensor("rope_freqs.weight").is_some() => {
                Some(t.vector("rope_freqs.weight", h.head_dim / 2)?)
            }
            _ => None,
        };
        let (qd, kvd, hd) = (h.heads * h.head_dim, h.kv_heads * h.head_dim, h.head_dim);
        let mut lw = Vec::with_capacity(h.layers);
        for i in 0..h.layers {
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
                w_gate: t.weight(&n("ffn_gate"), hidden, Some(h.ffn))?,
                w_up: t.weight(&n("ffn_up"), hidden, Some(h.ffn))?,
                w_down: t.weight(&n("ffn_down"), h.ffn, Some(hidden))?,
            });
        }
        t.all_used(arch)?;
        let name = gguf.get_str("general.name")?.unwrap_or("unnamed").to_string();
        let config = ModelConfig {
            arch: arch.name().to_string(),
            name,
            layers: h.layers,
            hidden,
            ffn: h.ffn,
            heads: h.heads,
            kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            vocab,
            context: h.context,
            rope_base: h.rope_base,
            rope_freq_scale: h.rope_freq_scale,
            rope_mode: arch.rope_mode(),
            rms_eps: h.rms_eps,
        };
        let fingerprint = fingerprint(&config, &gguf);
        Ok(Self {
            path,
            config,
            tokenizer,
            layers: lw,
            token_embd,
            output,
            output_norm,
            rope_freqs,
            fingerprint,
            gguf,
        })
    }

    /// The layout of this model's KV in blocks of `block_size` tokens of `dtype`: what an engine
    /// of these settings holds, and what a KV-store of the mesh stores.
    pub fn kv_layout(&self, block_size: usize, dtype: KvDtype) -> KvLayout {
        KvLayout {
            model_fingerprint: self.fingerprint,
            geometry: self.config.kv_geometry(block_size, dtype),
        }
    }

    /// A weight as a backend takes it: a view that shares (and keeps alive) the file's bytes.
    pub fn host_weight(&self, w: &WeightRef) -> HostWeight {
        let bytes = self.gguf.shared(w.offset..w.offset + w.size).expect("checked at load");
        HostWeight::new(w.ty, w.rows, w.cols, bytes).expect("shapes checked at load")
    }

    /// A view of a weight's bytes.
    pub fn weight(&self, w: &WeightRef) -> WeightMatrix<'_> {
        let data = &self.gguf.bytes()[w.offset..w.offset + w.size];
        WeightMatrix { ty: w.ty, rows: w.rows, cols: w.cols, data }
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    /// Size of the model file in bytes.
    pub fn file_size(&self) -> usize {
        self.gguf.bytes().len()
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

/// A stable identity for the model: FNV-1a over the hyperparameters, the tensor table and a
/// sample of each tensor's bytes (reading all ~100 MB at start-up would cost more than it buys;
/// the table plus samples distinguishes any two real conversions).
fn fingerprint(config: &ModelConfig, gguf: &GgufFile) -> u64 {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    h.write(format!("{config:?}").as_bytes());
    for t in &gguf.tensors {
        h.write(t.name.as_bytes());
        h.write(format!("{:?}{:?}{}", t.dims, t.ty, t.size).as_bytes());
        let data = gguf.tensor_data(t);
        for i in 0..16 {
            let at = data.len() * i / 16;
            h.write(&data[at..(at + 64).min(data.len())]);
        }
    }
    h.0
}

struct Fnv(u64);

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The hyperparameters, read from `{arch}.*` as llama.cpp's loader reads them.
struct Hparams {
    arch: Arch,
    layers: usize,
    hidden: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    context: usize,
    rope_base: f32,
    rope_freq_scale: f32,
    rms_eps: f32,
}

impl Hparams {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch.name())
    }

    fn read(gguf: &GgufFile, arch: Arch) -> Result<Self> {
        let key = |k: &str| format!("{}.{k}", arch.name());
        let unsupported =
            |k: &str, why: String| Error::UnsupportedModel(format!("metadata {:?}: {why}", key(k)));
        let opt_usize = |k: &str| -> Result<Option<usize>> {
            let full = key(k);
            gguf.get_u64(&full)?
                .map(|v| {
                    usize::try_from(v).ok().filter(|&v| v > 0 && v < 1 << 24).ok_or_else(|| {
                        Error::gguf(format!("metadata {full:?}"), format!("implausible value {v}"))
                    })
                })
                .transpose()
        };
        let req_usize = |k: &str| gguf.require(&key(k), opt_usize(k));
        let layers = req_usize("block_count")?;
        let hidden = req_usize("embedding_length")?;
        let ffn = req_usize("feed_forward_length")?;
        let heads = req_usize("attention.head_count")?;
        let kv_heads = opt_usize("attention.head_count_kv")?.unwrap_or(heads);
        let context = req_usize("context_length")?;
        let rms_eps = gguf.require(
            &key("attention.layer_norm_rms_epsilon"),
            gguf.get_f64(&key("attention.layer_norm_rms_epsilon")),
        )? as f32;
        if let Some(n) = gguf.get_u64(&key("expert_count"))?
            && n > 0
        {
            return Err(unsupported("expert_count", format!("{n} experts: MoE is not supported")));
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(unsupported(
                "attention.head_count_kv",
                format!("{heads} heads is not a multiple of {kv_heads} KV heads"),
            ));
        }

        // Head size: `attention.key_length` when given (Qwen3's 128 with a hidden size of
        // 1024 and 16 heads), else hidden / heads. K and V share the KV cache's geometry.
        let head_dim = match opt_usize("attention.key_length")? {
            Some(k) => k,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => {
                return Err(unsupported(
                    "attention.head_count",
                    format!("hidden size {hidden} is not divisible by {heads} heads"),
                ));
            }
        };
        let v_dim = opt_usize("attention.value_length")?.unwrap_or(hidden / heads);
        if v_dim != head_dim {
            return Err(unsupported(
                "attention.value_length",
                format!("V heads of {v_dim} differ from K heads of {head_dim}"),
            ));
        }
        if let Some(rd) = opt_usize("rope.dimension_count")?
            && rd != head_dim
        {
            return Err(unsupported(
                "rope.dimension_count",
                format!("partial RoPE ({rd} of {head_dim} dims) is not supported"),
            ));
        }
        if !head_dim.is_multiple_of(16) {
            return Err(Error::UnsupportedModel(format!(
                "head dim {head_dim} is not a multiple of 16"
            )));
        }

        let rope_base = gguf.get_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
        // llama.cpp: the scaling type defaults to linear, whose factor defaults to 1; `none`
        // ignores the factor. Llama 3's scaling has no type of its own in GGUF: it is the
        // `rope_freqs.weight` tensor.
        let kind = gguf.get_str(&key("rope.scaling.type"))?.unwrap_or("linear");
        let factor = match gguf.get_f64(&key("rope.scaling.factor"))? {
            Some(f) => Some(f),
            None => gguf.get_f64(&key("rope.scale_linear"))?,
        }
        .map_or(0.0, |f| f as f32);
        let rope_freq_scale = match kind {
            "none" => 1.0,
            "linear" if factor == 0.0 => 1.0,
            "linear" if factor > 0.0 && factor.is_finite() => 1.0 / factor,
            "linear" => {
                return Err(unsupported("rope.scaling.factor", format!("factor {factor}")));
            }
            other => {
                return Err(unsupported(
                    "rope.scaling.type",
                    format!("RoPE scaling {other:?} is not supported (none and linear are)"),
                ));
            }
        };
        if let Some(f) = gguf.get_f64(&key("rope.scaling.attn_factor"))?
            && f as f32 != 1.0
        {
            return Err(unsupported(
                "rope.scaling.attn_factor",
                format!("a RoPE magnitude factor of {f} is not supported"),
            ));
        }
        Ok(Self {
            arch,
            layers,
            hidden,
            ffn,
            heads,
            kv_heads,
            head_dim,
            context,
            rope_base,
            rope_freq_scale,
            rms_eps,
        })
    }
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
        Ok(WeightRef { ty: t.ty, rows: r, cols: c, offset: t.offset, size: t.size })
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
        pdmesh_kernels::quant::dequantize_row(t.ty, self.gguf.tensor_data(t), &mut out);
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
    use crate::testing::{TinyArch, TinyModel};

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
            .tensor("token_embd.weight", &[32, 3], WeightType::Q8_0, vec![0; 3 * 34])
            .tensor("output_norm.weight", &[32], WeightType::F32, vec![0; 128])
    }

    fn load(b: GgufBuilder) -> String {
        let g = GgufFile::from_bytes(b.build()).unwrap();
        Model::from_gguf(g, "test.gguf".into()).unwrap_err().to_string()
    }

    #[test]
    fn missing_tensor_is_named() {
        let e = load(base("llama", "gpt2"));
        assert!(e.contains("blk.0.attn_norm.weight") && e.contains("missing"), "{e}");
    }

    #[test]
    fn wrong_shape_is_named() {
        let b = base("llama", "gpt2")
            .tensor("blk.0.attn_norm.weight", &[32], WeightType::F32, vec![0; 128])
            .tensor("blk.0.attn_q.weight", &[32, 31], WeightType::Q8_0, vec![0; 31 * 34]);
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
                    b.tensor("blk.1.attn_output.bias", &[64], WeightType::F32, vec![0; 256])
                }),
                "blk.1.attn_output.bias",
            ),
            (
                TinyArch::Qwen2,
                Box::new(|b| b.tensor("rope_freqs.weight", &[8], WeightType::F32, vec![0; 32])),
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
