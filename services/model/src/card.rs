//! What a model is, short of computing with it: its architecture and hyperparameters from the
//! GGUF metadata, its tokenizer and chat template, and a fingerprint that identifies the exact
//! weights (KV from another model must never be mixed in). Routers, KV-stores and frontends
//! load a `ModelCard`; the engine loads the weights on top of one.
//!
//! The architectures are those whose llama.cpp graphs are the llama block with options:
//! `llama` (Llama 1–3, Mistral: normal RoPE, optional Llama 3 frequency factors), `qwen2` (NEOX
//! RoPE, Q/K/V biases) and `qwen3` (NEOX RoPE, per-head Q/K RMS norms, a head size of its own).
//! The hyperparameters are read as llama.cpp's loader reads them; a key that would change the
//! arithmetic is refused at load, naming it, rather than silently computed differently.
//!
//! `gemma3` (Gemma 3: NEOX RoPE, per-head Q/K norms, norms after attention and MLP, GELU) is
//! the one with sliding-window attention: five of every six layers attend to the last
//! `gemma3.attention.sliding_window` tokens, with a RoPE base of their own (`SlidingWindow`).
//!
//! `{arch}.attention.sliding_window` is ignored for the other three, as llama.cpp ignores it:
//! none of their loaders reads it, their KV cache is not the sliding-window kind, and every
//! query attends to its whole prefix. (Mistral 7B v0.1 was trained with a 4,096-token window;
//! llama.cpp's converter does not even write the key for arch llama, and a file that has it
//! computes full attention in llama.cpp, so it does here too.)

use std::path::{Path, PathBuf};

use pdmesh_kv_types::{
    KvDtype, KvGeometry, KvLayout, KvShape, KvWindow, LayerMask, MAX_WINDOW_LAYERS,
};

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};
use crate::tokenizer::Tokenizer;

/// Which dimensions of a head RoPE rotates together (llama.cpp's rope types). It belongs to
/// the architecture, not the file: conversion lays out Q and K for the one its family uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeMode {
    /// Adjacent pairs `(2i, 2i + 1)`: `LLAMA_ROPE_TYPE_NORM`.
    Normal,
    /// Pairs `(i, i + head_dim / 2)`: `LLAMA_ROPE_TYPE_NEOX`.
    Neox,
}

/// The architectures pdmesh runs (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Arch {
    /// Every architecture, each with its model file in the engine's `models`.
    pub const ALL: [Arch; 4] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3];

    pub fn from_name(name: &str) -> Option<Arch> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// llama.cpp's `llama_model_rope_type` for it.
    pub fn rope_mode(self) -> RopeMode {
        match self {
            Arch::Llama => RopeMode::Normal,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => RopeMode::Neox,
        }
    }
}

/// Sliding-window attention: the layers that attend to only the last `tokens` positions (the
/// query's own included), and the RoPE those layers rotate by.
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    pub tokens: usize,
    /// `local[i]`: whether layer `i` attends through the window.
    pub local: Vec<bool>,
    /// The window layers' RoPE base and angle scale (the other layers take the model's).
    pub rope_base: f32,
    pub rope_freq_scale: f32,
}

impl SlidingWindow {
    /// Layer `layer`'s window, `None` for a layer that attends to its whole prefix.
    pub fn of_layer(&self, layer: usize) -> Option<usize> {
        self.local.get(layer).copied().unwrap_or(false).then_some(self.tokens)
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
    /// The layers that attend through a sliding window, when some do.
    pub sliding_window: Option<SlidingWindow>,
}

impl ModelConfig {
    /// Layer `layer`'s attention window in tokens, `None` for full attention.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.as_ref().and_then(|w| w.of_layer(layer))
    }

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

    /// The KV layout of this model in blocks of `block_size` tokens of `dtype`, under
    /// `fingerprint`: what an engine of it holds and a KV-store of its mesh stores.
    pub fn kv_layout(&self, fingerprint: u64, block_size: usize, dtype: KvDtype) -> KvLayout {
        // The card's loader refuses masks past the layout's (`MAX_WINDOW_LAYERS`).
        let window = self.sliding_window.as_ref().map(|w| KvWindow {
            tokens: w.tokens,
            local: LayerMask::from_flags(&w.local).expect("a window's layers fit the mask"),
        });
        KvLayout {
            model_fingerprint: fingerprint,
            geometry: self.kv_geometry(block_size, dtype),
            window,
        }
    }
}

/// A model as everything but the engine sees it. Holds the mapped file, whose weights the
/// engine views without copying.
pub struct ModelCard {
    pub path: PathBuf,
    pub arch: Arch,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// Hash of the model's hyperparameters and weight bytes' identity (see `fingerprint`).
    pub fingerprint: u64,
    gguf: GgufFile,
}

impl std::fmt::Debug for ModelCard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelCard")
            .field("path", &self.path)
            .field("config", &self.config)
            .field("fingerprint", &format_args!("{:016x}", self.fingerprint))
            .finish()
    }
}

impl ModelCard {
    /// Reads the card of the GGUF at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let gguf = GgufFile::open(path)?;
        Self::from_gguf(gguf, path.to_path_buf())
    }

    pub fn from_gguf(gguf: GgufFile, path: PathBuf) -> Result<Self> {
        let arch_name =
            gguf.require("general.architecture", gguf.get_str("general.architecture"))?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            Error::UnsupportedModel(format!(
                "architecture {arch_name:?} (general.architecture): pdmesh runs llama, qwen2, \
                 qwen3 and gemma3"
            ))
        })?;
        let h = Hparams::read(&gguf, arch)?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let vocab = embedding_rows(&gguf, h.hidden)?;
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
        let name = gguf.get_str("general.name")?.unwrap_or("unnamed").to_string();
        let config = ModelConfig {
            arch: arch.name().to_string(),
            name,
            layers: h.layers,
            hidden: h.hidden,
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
            sliding_window: h.sliding_window,
        };
        let fingerprint = fingerprint(&config, &gguf);
        Ok(Self { path, arch, config, tokenizer, fingerprint, gguf })
    }

    /// The layout of this model's KV in blocks of `block_size` tokens of `dtype`: what an engine
    /// of these settings holds, and what a KV-store of the mesh stores.
    pub fn kv_layout(&self, block_size: usize, dtype: KvDtype) -> KvLayout {
        self.config.kv_layout(self.fingerprint, block_size, dtype)
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    /// Size of the model file in bytes.
    pub fn file_size(&self) -> usize {
        self.gguf.bytes().len()
    }
}

/// The vocabulary size: the rows of the token embedding, whose columns must be the hidden size.
fn embedding_rows(gguf: &GgufFile, hidden: usize) -> Result<usize> {
    let name = "token_embd.weight";
    let t = gguf.tensor(name).ok_or_else(|| Error::gguf(format!("tensor {name:?}"), "missing"))?;
    let (cols, rows) = t.matrix_shape();
    if t.dims.len() != 2 || cols != hidden {
        return Err(Error::gguf(
            format!("tensor {name:?}"),
            format!("shape {:?}, expected [{hidden}, ?]", t.dims),
        ));
    }
    Ok(rows)
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
    sliding_window: Option<SlidingWindow>,
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

        let rope_base = rope_base(gguf, &key, "rope.freq_base")?;
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
        let sliding_window = match arch {
            Arch::Gemma3 => sliding_window(gguf, &key, layers, context)?,
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => None,
        };
        if let Some(cap) = gguf.get_f64(&key("final_logit_softcapping"))?
            && cap != 0.0
        {
            return Err(unsupported(
                "final_logit_softcapping",
                format!("logit soft-capping ({cap}) is not supported"),
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
            sliding_window,
        })
    }
}

/// A RoPE base (10,000 when absent). A NaN, infinite, zero or negative base would give NaN
/// angles, and NaN also breaks the engine's grouping of layers by rotation (NaN != NaN).
fn rope_base(gguf: &GgufFile, key: &dyn Fn(&str) -> String, k: &str) -> Result<f32> {
    let base = gguf.get_f64(&key(k))?.unwrap_or(10_000.0) as f32;
    if !(base.is_finite() && base > 0.0) {
        return Err(Error::gguf(
            format!("metadata {:?}", key(k)),
            format!("RoPE base {base} is not a positive finite number"),
        ));
    }
    Ok(base)
}

/// Gemma 3's windows, as llama.cpp's loader reads them: `attention.sliding_window` tokens (none
/// when absent or 0), on the layers `attention.sliding_window_pattern` names (a period `p`:
/// layer `i` is local unless `i % p == p - 1`, 6 when absent; or one bool per layer), rotated
/// with base `rope.freq_base_swa` (10,000 when absent) and no scaling. A window as long as the
/// context is full attention, and so none.
fn sliding_window(
    gguf: &GgufFile,
    key: &dyn Fn(&str) -> String,
    layers: usize,
    context: usize,
) -> Result<Option<SlidingWindow>> {
    let bad = |k: &str, why: String| Error::gguf(format!("metadata {:?}", key(k)), why);
    let tokens = match gguf.get_u64(&key("attention.sliding_window"))? {
        None | Some(0) => return Ok(None),
        Some(t) => t as usize,
    };
    if tokens >= context {
        return Ok(None);
    }
    let k = key("attention.sliding_window_pattern");
    let local: Vec<bool> = match gguf.get_array(&k) {
        Ok(Some(a)) => {
            let flags: Option<Vec<bool>> =
                a.iter().map(|v| if let Value::Bool(b) = v { Some(*b) } else { None }).collect();
            match flags {
                Some(f) if f.len() == layers => f,
                _ => {
                    let why = format!("expected {layers} bools, one per layer");
                    return Err(bad("attention.sliding_window_pattern", why));
                }
            }
        }
        _ => {
            let period = gguf.get_u64(&k)?.unwrap_or(6) as usize;
            (0..layers).map(|i| period == 0 || i % period < period - 1).collect()
        }
    };
    // The KV layout states the window's layers in a bounded mask, and a block before the window
    // travels as its global layers, of which it must have some.
    if layers > MAX_WINDOW_LAYERS || local.iter().all(|&l| l) {
        let why = format!(
            "a window on every layer, or on a model of more than {MAX_WINDOW_LAYERS} layers, \
             is not served"
        );
        return Err(bad("attention.sliding_window_pattern", why));
    }
    let rope_base = rope_base(gguf, key, "rope.freq_base_swa")?;
    Ok(Some(SlidingWindow { tokens, local, rope_base, rope_freq_scale: 1.0 }))
}
