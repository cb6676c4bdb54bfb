//! The model's tokenizer, rebuilt from GGUF metadata on top of the `tokenizers` crate (GPT-2
//! style byte-level BPE with the pre-tokenizer the metadata names), plus the pieces a streaming
//! server needs: the exact bytes of every token and a decoder that never splits a UTF-8
//! character across two chunks.

use std::collections::HashMap;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};

/// GGUF token types (`tokenizer.ggml.token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Texts of control tokens that end a turn in the chat formats we know (llama.cpp treats the
/// same set as end-of-generation).
const EOG_TEXTS: &[&str] =
    &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>"];

/// The llama-3 pre-tokenizer split (used by `llama-bpe` vocabularies).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer built from a GGUF file.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Raw bytes each token stands for (specials: their text).
    token_bytes: Vec<Vec<u8>>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    chat: std::result::Result<ChatTemplate, String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.token_bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

fn meta_err(key: &str, problem: impl Into<String>) -> Error {
    Error::gguf(format!("metadata {key:?}"), problem)
}

fn string_array<'a>(gguf: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    gguf.require(key, gguf.get_array(key))?
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(meta_err(key, format!("element {i} is not a string"))),
        })
        .collect()
}

/// GPT-2's reversible map from bytes to printable characters, inverted.
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut map = HashMap::new();
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\u{FFFD}')
        };
        map.insert(c, b);
    }
    map
}

impl Tokenizer {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf.require("tokenizer.ggml.model", gguf.get_str("tokenizer.ggml.model"))?;
        if model != "gpt2" {
            return Err(Error::UnsupportedModel(format!(
                "tokenizer model {model:?} (tokenizer.ggml.model): only GPT-2 style byte-level BPE is supported"
            )));
        }
        let tokens = string_array(gguf, "tokenizer.ggml.tokens")?;
        let merges_raw = string_array(gguf, "tokenizer.ggml.merges")?;
        let types: Vec<i64> = match gguf.get_array("tokenizer.ggml.token_type")? {
            Some(a) => a
                .iter()
                .map(|v| {
                    v.as_i64()
                        .ok_or_else(|| meta_err("tokenizer.ggml.token_type", "non-integer element"))
                })
                .collect::<Result<_>>()?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(meta_err(
                "tokenizer.ggml.token_type",
                format!("{} entries for {} tokens", types.len(), tokens.len()),
            ));
        }
        let id = |key: &str| -> Result<Option<u32>> {
            match gguf.get_u64(key)? {
                None => Ok(None),
                Some(v) if (v as usize) < tokens.len() => Ok(Some(v as u32)),
                Some(v) => Err(meta_err(key, format!("token id {v} is outside the vocabulary"))),
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let eot = id("tokenizer.ggml.eot_token_id")?;
        let add_bos = gguf.get_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(meta_err(
                "tokenizer.ggml.add_bos_token",
                "set but there is no bos_token_id",
            ));
        }

        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert((*t).to_string(), i as u32);
        }
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (i, m) in merges_raw.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| {
                meta_err("tokenizer.ggml.merges", format!("entry {i} ({m:?}) is not \"a b\""))
            })?;
            merges.push((a.to_string(), b.to_string()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);

        let pre = gguf.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
        let byte_level = ByteLevel::new(false, true, true);
        let pre_tok: PreTokenizerWrapper = match pre {
            "default" | "gpt2" | "gpt-2" => byte_level.into(),
            "smollm" | "starcoder" => {
                Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
            }
            "llama-bpe" | "llama3" => {
                let split = Split::new(
                    SplitPattern::Regex(LLAMA3_SPLIT.to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| Error::Tokenizer(format!("llama3 split regex: {e}")))?;
                Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
            }
            other => {
                return Err(Error::UnsupportedModel(format!(
                    "pre-tokenizer {other:?} (tokenizer.ggml.pre) is not supported (known: default, gpt2, smollm, starcoder, llama-bpe)"
                )));
            }
        };
        inner.with_pre_tokenizer(Some(pre_tok));

        let special: Vec<bool> =
            types.iter().map(|&t| t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED).collect();
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&special)
            .filter(|(_, s)| **s)
            .map(|(t, _)| AddedToken::from((*t).to_string(), true).normalized(false))
            .collect();
        inner.add_special_tokens(&added);

        let table = unicode_to_byte();
        let token_bytes: Vec<Vec<u8>> = tokens
            .iter()
            .zip(&special)
            .map(|(t, &s)| {
                if s {
                    t.as_bytes().to_vec()
                } else {
                    // Byte-level tokens spell bytes with GPT-2's printable alphabet; anything
                    // outside it is kept as its UTF-8 (some vocabularies mix in raw text).
                    let mut out = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match table.get(&c) {
                            Some(&b) => out.push(b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                }
            })
            .collect();

        let mut eog: Vec<u32> = eos.into_iter().chain(eot).collect();
        for (i, (t, &s)) in tokens.iter().zip(&special).enumerate() {
            if s && EOG_TEXTS.contains(t) && !eog.contains(&(i as u32)) {
                eog.push(i as u32);
            }
        }

        let text = |id: Option<u32>| id.map(|i| tokens[i as usize].to_string()).unwrap_or_default();
        let chat = match gguf.get_str("tokenizer.chat_template")? {
            Some(src) => ChatTemplate::new(src, &text(bos), &text(eos)).map_err(|e| e.to_string()),
            None => {
                Err("the model has no chat template (tokenizer.chat_template); send raw prompts"
                    .to_string())
            }
        };

        Ok(Self { inner, token_bytes, bos, eos, add_bos, eog, chat })
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Tokens that end generation (EOS, EOT and the known end-of-turn tokens).
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Tokenizes `text`, recognising special tokens written in it (`<|im_start|>` …) and adding
    /// BOS when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos
            && let Some(b) = self.bos
        {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The bytes a token stands for, or `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD; out-of-range ids are skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> =
            ids.iter().filter_map(|&i| self.token_bytes(i)).flatten().copied().collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The model's chat template, or why there is none usable.
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        self.chat.as_ref().map_err(|e| Error::Template(e.clone()))
    }
}

/// Turns a stream of token ids into text chunks that are always whole UTF-8: bytes of a
/// character split across tokens are held back until the character is complete.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if let Some(b) = tok.token_bytes(id) {
            self.pending.extend_from_slice(b);
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // The first `good` bytes were just validated.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // An invalid sequence can never complete: replace it and go on.
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Whether bytes of an unfinished character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Flushes whatever is held back at the end of the stream (an unfinished character becomes
    /// U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
