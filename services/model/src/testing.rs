//! A tiny llama model with seeded random weights, built in memory with the GGUF writer: the
//! fast tier of tests (cores, batch runner, relay, prefill) runs on it in milliseconds, with
//! the same loader, tokenizer, chat template and forward pass as the real model. Its outputs
//! mean nothing; they are deterministic for a seed, which is all a test of the machinery
//! needs. Variants in the other architectures' forms (`TinyArch`) exercise their options.
//! Enabled for tests and by the `testing` feature; the engine's `testing` builds the weights
//! on top of the card this makes.

use std::sync::Arc;

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::card::ModelCard;
use crate::gguf::writer::GgufBuilder;
use crate::gguf::{GgmlType, GgufFile, Value};

/// Hidden size of the tiny model (4 heads of 16, 2 KV heads).
pub const HIDDEN: usize = 64;
const HEADS: u32 = 4;
const KV_HEADS: u32 = 2;
const FFN: usize = 128;
const LAYERS: u32 = 2;

/// Words the vocabulary merges into single tokens, so prompts tokenize to fewer ids than bytes.
const WORDS: [&str; 8] = ["the", "ing", "and", "one", "two", "Ġthe", "Ġand", "Ġone"];
/// Special tokens, after the byte tokens and the merged words.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Which architecture's form a tiny model takes. The weights every form shares are the same
/// for one seed; each form's extras come from a stream of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TinyArch {
    /// Plain llama.
    #[default]
    Llama,
    /// Llama 3: llama with RoPE frequency factors (`rope_freqs.weight`).
    Llama3,
    /// Qwen2: NEOX RoPE and Q/K/V biases.
    Qwen2,
    /// Qwen3: NEOX RoPE, per-head Q/K norms, and heads of 32 (`key_length`) where hidden /
    /// heads is 16.
    Qwen3,
    /// Gemma 3: per-head Q/K norms, norms after attention and MLP, GeGLU, and layer 0
    /// attending through a window of `TINY_WINDOW` tokens (layer 1 globally: a pattern of
    /// period 2) with a RoPE base of its own.
    Gemma3,
}

/// The tiny Gemma 3's sliding window, in tokens.
pub const TINY_WINDOW: usize = 8;

impl TinyArch {
    pub fn name(self) -> &'static str {
        match self {
            TinyArch::Llama | TinyArch::Llama3 => "llama",
            TinyArch::Qwen2 => "qwen2",
            TinyArch::Qwen3 => "qwen3",
            TinyArch::Gemma3 => "gemma3",
        }
    }

    /// Size of one head.
    pub fn head_dim(self) -> usize {
        match self {
            TinyArch::Qwen3 => 32,
            _ => HIDDEN / HEADS as usize,
        }
    }
}

/// How to build a tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TinyModel {
    /// Seeds every weight.
    pub seed: u64,
    /// The end-of-generation token (default `<|im_end|>`); any id, so that a test can make a
    /// token the model is known to produce end generation.
    pub eos: Option<u32>,
    /// The context length.
    pub context: usize,
    pub arch: TinyArch,
}

impl Default for TinyModel {
    fn default() -> Self {
        Self { seed: 7, eos: None, context: 256, arch: TinyArch::Llama }
    }
}

/// GPT-2's byte-level alphabet: each byte as the printable character that spells it.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| {
        (u32::from('!')..=u32::from('~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).expect("a valid code point")
        })
        .collect()
}

fn q8_0(rng: &mut ChaCha8Rng, rows: usize, cols: usize, scale: f32) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols / 32 * 34);
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(rng.random_range(0.5..1.0) * scale);
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        out.extend((0..32).map(|_| rng.random_range(-127i32..=127) as i8 as u8));
    }
    out
}

fn q4_1(rng: &mut ChaCha8Rng, rows: usize, cols: usize, scale: f32) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols / 32 * 20);
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(rng.random_range(0.5..1.0) * scale);
        let m = f16::from_f32(-7.5 * d.to_f32());
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        out.extend_from_slice(&m.to_bits().to_le_bytes());
        out.extend((0..16).map(|_| rng.random::<u8>()));
    }
    out
}

fn f32s(rng: &mut ChaCha8Rng, n: usize, range: std::ops::Range<f32>) -> Vec<u8> {
    (0..n).flat_map(|_| rng.random_range(range.clone()).to_le_bytes()).collect()
}

fn norm(rng: &mut ChaCha8Rng) -> Vec<u8> {
    f32s(rng, HIDDEN, 0.8..1.2)
}

impl TinyModel {
    /// Every prefix (of two characters or more) of every merged word, each built by one merge
    /// from the prefix before it: `("th", "t h")`, `("the", "th e")` …
    fn pieces() -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for w in WORDS {
            let chars: Vec<char> = w.chars().collect();
            for n in 2..=chars.len() {
                let piece: String = chars[..n].iter().collect();
                let left: String = chars[..n - 1].iter().collect();
                if !out.iter().any(|(p, _)| *p == piece) {
                    out.push((piece, format!("{left} {}", chars[n - 1])));
                }
            }
        }
        out
    }

    /// The model's vocabulary: 256 byte tokens, the merged pieces, then the special tokens.
    pub fn vocab() -> Vec<String> {
        let mut v: Vec<String> = byte_chars().into_iter().map(String::from).collect();
        v.extend(Self::pieces().into_iter().map(|(p, _)| p));
        v.extend(SPECIALS.iter().map(|s| s.to_string()));
        v
    }

    /// The GGUF image.
    pub fn gguf(&self) -> Vec<u8> {
        self.builder().build()
    }

    /// The GGUF image under construction, for a test to vary before building.
    pub fn builder(&self) -> GgufBuilder {
        let s = |x: &str| Value::String(x.into());
        let vocab = Self::vocab();
        let n = vocab.len();
        let id = |t: &str| vocab.iter().position(|v| v == t).expect("in the vocabulary") as u32;
        let merges: Vec<Value> = Self::pieces().iter().map(|(_, m)| s(m)).collect();
        let types: Vec<Value> =
            (0..n).map(|i| Value::I32(if i >= n - 3 { 3 } else { 1 })).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut extra = ChaCha8Rng::seed_from_u64(self.seed ^ 0x5eed_e57a);
        let arch = self.arch.name();
        let hd = self.arch.head_dim();
        let (q_dim, kv_dim) = (HEADS as usize * hd, KV_HEADS as usize * hd);
        let hidden = HIDDEN as u64;
        let key = |k: &str| format!("{arch}.{k}");
        let mut b = GgufBuilder::default()
            .kv("general.architecture", s(arch))
            .kv("general.name", s("pdmesh-tiny"))
            .kv(&key("block_count"), Value::U32(LAYERS))
            .kv(&key("context_length"), Value::U32(self.context as u32))
            .kv(&key("embedding_length"), Value::U32(HIDDEN as u32))
            .kv(&key("feed_forward_length"), Value::U32(FFN as u32))
            .kv(&key("attention.head_count"), Value::U32(HEADS))
            .kv(&key("attention.head_count_kv"), Value::U32(KV_HEADS))
            .kv(&key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5))
            .kv(&key("rope.freq_base"), Value::F32(10_000.0))
            .kv("tokenizer.ggml.model", s("gpt2"))
            .kv("tokenizer.ggml.pre", s("gpt-2"))
            .kv("tokenizer.ggml.tokens", Value::Array(vocab.iter().map(|t| s(t)).collect()))
            .kv("tokenizer.ggml.token_type", Value::Array(types))
            .kv("tokenizer.ggml.merges", Value::Array(merges))
            .kv("tokenizer.ggml.bos_token_id", Value::U32(id("<|im_start|>")))
            .kv("tokenizer.ggml.eos_token_id", Value::U32(self.eos.unwrap_or(id("<|im_end|>"))))
            .kv("tokenizer.chat_template", s(CHATML))
            .tensor(
                "token_embd.weight",
                &[hidden, n as u64],
                GgmlType::Q8_0,
                q8_0(&mut rng, n, HIDDEN, 0.02),
            )
            .tensor("output_norm.weight", &[hidden], GgmlType::F32, norm(&mut rng))
            // Untied: with tied embeddings a random model just repeats the prompt's last token.
            .tensor(
                "output.weight",
                &[hidden, n as u64],
                GgmlType::Q8_0,
                q8_0(&mut rng, n, HIDDEN, 0.0025),
            );
        if self.arch == TinyArch::Qwen3 {
            b = b
                .kv(&key("attention.key_length"), Value::U32(hd as u32))
                .kv(&key("attention.value_length"), Value::U32(hd as u32));
        }
        if self.arch == TinyArch::Gemma3 {
            b = b
                .kv(&key("attention.sliding_window"), Value::U32(TINY_WINDOW as u32))
                .kv(&key("attention.sliding_window_pattern"), Value::U32(2))
                .kv(&key("rope.freq_base_swa"), Value::F32(100.0));
        }
        if self.arch == TinyArch::Llama3 {
            let factors = f32s(&mut extra, hd / 2, 1.0..8.0);
            b = b.tensor("rope_freqs.weight", &[hd as u64 / 2], GgmlType::F32, factors);
        }
        for l in 0..LAYERS {
            let t = |x: &str| format!("blk.{l}.{x}.weight");
            let (h, q, k, f) = (hidden, q_dim as u64, kv_dim as u64, FFN as u64);
            b = b
                .tensor(&t("attn_norm"), &[h], GgmlType::F32, norm(&mut rng))
                .tensor(&t("attn_q"), &[h, q], GgmlType::Q4_1, q4_1(&mut rng, q_dim, HIDDEN, 0.035))
                .tensor(
                    &t("attn_k"),
                    &[h, k],
                    GgmlType::Q4_1,
                    q4_1(&mut rng, kv_dim, HIDDEN, 0.035),
                )
                .tensor(
                    &t("attn_v"),
                    &[h, k],
                    GgmlType::Q8_0,
                    q8_0(&mut rng, kv_dim, HIDDEN, 0.0025),
                )
                .tensor(
                    &t("attn_output"),
                    &[q, h],
                    GgmlType::Q8_0,
                    q8_0(&mut rng, HIDDEN, q_dim, 0.0025),
                )
                .tensor(&t("ffn_norm"), &[h], GgmlType::F32, norm(&mut rng))
                .tensor(&t("ffn_gate"), &[h, f], GgmlType::Q4_1, q4_1(&mut rng, FFN, HIDDEN, 0.035))
                .tensor(&t("ffn_up"), &[h, f], GgmlType::Q8_0, q8_0(&mut rng, FFN, HIDDEN, 0.0025))
                .tensor(
                    &t("ffn_down"),
                    &[f, h],
                    GgmlType::Q8_0,
                    q8_0(&mut rng, HIDDEN, FFN, 0.0025),
                );
            match self.arch {
                TinyArch::Llama | TinyArch::Llama3 => {}
                TinyArch::Qwen2 => {
                    for (name, n) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
                        let bias = f32s(&mut extra, n, -0.5..0.5);
                        b = b.tensor(
                            &format!("blk.{l}.{name}.bias"),
                            &[n as u64],
                            GgmlType::F32,
                            bias,
                        );
                    }
                }
                TinyArch::Qwen3 | TinyArch::Gemma3 => {
                    for name in ["attn_q_norm", "attn_k_norm"] {
                        let w = f32s(&mut extra, hd, 0.5..1.5);
                        b = b.tensor(&t(name), &[hd as u64], GgmlType::F32, w);
                    }
                }
            }
            if self.arch == TinyArch::Gemma3 {
                for name in ["post_attention_norm", "post_ffw_norm"] {
                    let w = f32s(&mut extra, HIDDEN, 0.5..1.5);
                    b = b.tensor(&t(name), &[hidden], GgmlType::F32, w);
                }
            }
        }
        b
    }

    /// The model's file, parsed.
    pub fn file(&self) -> GgufFile {
        GgufFile::from_bytes(self.gguf()).expect("the tiny GGUF parses")
    }

    /// The model's card.
    pub fn card(&self) -> Arc<ModelCard> {
        Arc::new(
            ModelCard::from_gguf(self.file(), "tiny.gguf".into()).expect("the tiny model loads"),
        )
    }
}

/// The default tiny model's card, built once per process.
pub fn tiny_card() -> Arc<ModelCard> {
    static M: std::sync::OnceLock<Arc<ModelCard>> = std::sync::OnceLock::new();
    Arc::clone(M.get_or_init(|| TinyModel::default().card()))
}
