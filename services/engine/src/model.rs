//! A llama-architecture model loaded from GGUF: hyperparameters from the metadata, weight views
//! into the mapped file (kept quantized), the tokenizer and chat template, and a fingerprint
//! that identifies the exact weights (KV from another model must never be mixed in).

use std::path::{Path, PathBuf};

use pdmesh_kernels::{HostWeight, KvDtype, KvGeometry, WeightMatrix, WeightType};
use pdmesh_kv_types::{KvLayout, KvShape};

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, TensorInfo};
use crate::tokenizer::Tokenizer;

/// Hyperparameters of a llama-architecture model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub name: String,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
}

impl ModelConfig {
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
        let arch =
            gguf.require("general.architecture", gguf.get_str("general.architecture"))?.to_string();
        if arch != "llama" {
            return Err(Error::UnsupportedModel(format!(
                "architecture {arch:?}: pdmesh runs llama-architecture models"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let req_usize = |k: &str| -> Result<usize> {
            let full = key(k);
            let v = gguf.require(&full, gguf.get_u64(&full))?;
            usize::try_from(v).ok().filter(|&v| v > 0 && v < 1 << 24).ok_or_else(|| {
                Error::gguf(format!("metadata {full:?}"), format!("implausible value {v}"))
            })
        };
        let layers = req_usize("block_count")?;
        let hidden = req_usize("embedding_length")?;
        let ffn = req_usize("feed_forward_length")?;
        let heads = req_usize("attention.head_count")?;
        let kv_heads = match gguf.get_u64(&key("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => heads,
        };
        let context = req_usize("context_length")?;
        let rope_base = gguf.get_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
        let rms_eps = gguf.require(
            &key("attention.layer_norm_rms_epsilon"),
            gguf.get_f64(&key("attention.layer_norm_rms_epsilon")),
        )? as f32;
        if let Some(kind) = gguf.get_str(&key("rope.scaling.type"))?
            && kind != "none"
        {
            return Err(Error::UnsupportedModel(format!("RoPE scaling {kind:?} is not supported")));
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::UnsupportedModel(format!(
                "{heads} heads is not a multiple of {kv_heads} KV heads"
            )));
        }
        if hidden % heads != 0 {
            return Err(Error::UnsupportedModel(format!(
                "hidden size {hidden} is not divisible by {heads} heads"
            )));
        }
        let head_dim = hidden / heads;
        if let Some(rd) = gguf.get_u64(&key("rope.dimension_count"))?
            && rd as usize != head_dim
        {
            return Err(Error::UnsupportedModel(format!(
                "partial RoPE ({rd} of {head_dim} dims) is not supported"
            )));
        }
        if !head_dim.is_multiple_of(16) {
            return Err(Error::UnsupportedModel(format!(
                "head dim {head_dim} is not a multiple of 16"
            )));
        }

        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let token_embd = weight(&gguf, "token_embd.weight", hidden, None)?;
        let vocab = token_embd.rows;
        if let Some(v) = gguf.get_u64(&key("vocab_size"))?
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
            Some(_) => weight(&gguf, "output.weight", hidden, Some(vocab))?,
            None => token_embd, // tied embeddings
        };
        let output_norm = norm(&gguf, "output_norm.weight", hidden)?;
        let kv_dim = kv_heads * head_dim;
        let mut lw = Vec::with_capacity(layers);
        for i in 0..layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            lw.push(LayerWeights {
                attn_norm: norm(&gguf, &n("attn_norm"), hidden)?,
                wq: weight(&gguf, &n("attn_q"), hidden, Some(hidden))?,
                wk: weight(&gguf, &n("attn_k"), hidden, Some(kv_dim))?,
                wv: weight(&gguf, &n("attn_v"), hidden, Some(kv_dim))?,
                wo: weight(&gguf, &n("attn_output"), hidden, Some(hidden))?,
                ffn_norm: norm(&gguf, &n("ffn_norm"), hidden)?,
                w_gate: weight(&gguf, &n("ffn_gate"), hidden, Some(ffn))?,
                w_up: weight(&gguf, &n("ffn_up"), hidden, Some(ffn))?,
                w_down: weight(&gguf, &n("ffn_down"), ffn, Some(hidden))?,
            });
        }
        let name = gguf.get_str("general.name")?.unwrap_or("unnamed").to_string();
        let config = ModelConfig {
            arch,
            name,
            layers,
            hidden,
            ffn,
            heads,
            kv_heads,
            head_dim,
            vocab,
            context,
            rope_base,
            rms_eps,
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

fn tensor<'a>(gguf: &'a GgufFile, name: &str) -> Result<&'a TensorInfo> {
    gguf.tensor(name).ok_or_else(|| Error::gguf(format!("tensor {name:?}"), "missing"))
}

/// Looks up a 2-D weight with `cols` columns (and `rows` rows when known).
fn weight(gguf: &GgufFile, name: &str, cols: usize, rows: Option<usize>) -> Result<WeightRef> {
    let t = tensor(gguf, name)?;
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

/// Reads a 1-D norm weight as f32.
fn norm(gguf: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    let t = tensor(gguf, name)?;
    if t.dims != [n as u64] {
        return Err(Error::gguf(
            format!("tensor {name:?}"),
            format!("shape {:?}, expected [{n}]", t.dims),
        ));
    }
    let mut out = vec![0f32; n];
    pdmesh_kernels::quant::dequantize_row(t.ty, gguf.tensor_data(t), &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;
    use crate::gguf::writer::GgufBuilder;

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
        assert!(e.contains("gemma") && e.contains("llama-architecture"), "{e}");
        for kind in ["bert", "t5", "rwkv"] {
            let e = load(base("llama", kind));
            assert!(e.contains("tokenizer.ggml.model") && e.contains(&format!("{kind:?}")), "{e}");
        }
    }
}
