//! The model's tokenizer, rebuilt from GGUF metadata so that token ids are llama.cpp's: GPT-2
//! style byte-level BPE (`tokenizer.ggml.model = "gpt2"`, on the `tokenizers` crate, with the
//! pre-tokenizer `tokenizer.ggml.pre` names) and SentencePiece (`"llama"`, hand-written after
//! llama.cpp's). Also the pieces a streaming server needs: the exact bytes of every token and a
//! decoder that never splits a UTF-8 character across two chunks.
//!
//! Around both models sits what llama.cpp does with a vocabulary: token attributes from
//! `tokenizer.ggml.token_type` amended by token text (end-of-turn and fill-in-the-middle
//! markers become control tokens), special tokens written in the text split out before the
//! model sees it, BOS/EOS added as the metadata says, and the set of tokens that end generation.

mod bpe;
mod spm;
#[cfg(test)]
mod tests;

use aho_corasick::AhoCorasick;

use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};

/// A token's attributes, llama.cpp's `llama_token_attr` bits that tokenizing and decoding read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Attr(u8);

impl Attr {
    const UNDEFINED: Attr = Attr(0);
    const NORMAL: Attr = Attr(1);
    const UNKNOWN: Attr = Attr(2);
    const CONTROL: Attr = Attr(4);
    const USER_DEFINED: Attr = Attr(8);
    const UNUSED: Attr = Attr(16);
    const BYTE: Attr = Attr(32);

    /// From a GGUF token type (`tokenizer.ggml.token_type`).
    fn from_type(t: i64) -> Attr {
        match t {
            1 => Attr::NORMAL,
            2 => Attr::UNKNOWN,
            3 => Attr::CONTROL,
            4 => Attr::USER_DEFINED,
            5 => Attr::UNUSED,
            6 => Attr::BYTE,
            _ => Attr::UNDEFINED,
        }
    }

    fn has(self, other: Attr) -> bool {
        self.0 & other.0 != 0
    }

    fn with(self, other: Attr) -> Attr {
        Attr(self.0 | other.0)
    }

    /// Tokens written in a prompt stand for themselves, and decode to their own text.
    fn is_special(self) -> bool {
        self.has(Attr::UNKNOWN) || self.has(Attr::CONTROL) || self.has(Attr::USER_DEFINED)
    }
}

/// Texts llama.cpp takes for end-of-generation tokens whatever their type (it makes them
/// control tokens).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle markers llama.cpp looks for by text when the GGUF names none of a kind
/// (metadata keys first): the one found becomes a control token, and pad, repo and file
/// separator markers end generation.
const FIM: &[(&[&str], &[&str], bool)] = &[
    (
        &["tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"],
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        &["tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"],
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        &["tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"],
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        &["tokenizer.ggml.fim_pad_token_id"],
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        &["tokenizer.ggml.fim_rep_token_id"],
        &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
        true,
    ),
    (&["tokenizer.ggml.fim_sep_token_id"], &["<|file_sep|>"], true),
];

/// gpt-oss's message-structure tokens, which llama.cpp always renders (user-defined).
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

enum Model {
    Bpe(bpe::Bpe),
    Spm {
        spm: spm::Spm,
        /// A space before text at the start and after each special token.
        add_space_prefix: bool,
    },
}

/// A tokenizer built from a GGUF file.
pub struct Tokenizer {
    model: Model,
    /// Special tokens (control, user-defined, unknown) matched in prompts, longest text first,
    /// and a searcher over their texts (same order) to find which a prompt contains.
    specials: Vec<(u32, String)>,
    special_finder: Option<AhoCorasick>,
    /// Raw bytes each token stands for (llama.cpp's piece; specials: their text).
    token_bytes: Vec<Vec<u8>>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eog: Vec<u32>,
    chat: std::result::Result<ChatTemplate, String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.model {
            Model::Bpe(_) => "bpe",
            Model::Spm { .. } => "spm",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab", &self.token_bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish()
    }
}

/// A stretch of prompt: text for the model, or a special token written in it.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
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

/// A per-token array that must cover every token, or `None` when the key is absent.
fn token_array<T>(
    gguf: &GgufFile,
    key: &str,
    n: usize,
    each: impl Fn(&Value) -> Option<T>,
) -> Result<Option<Vec<T>>> {
    let Some(a) = gguf.get_array(key)? else { return Ok(None) };
    if a.len() < n {
        return Err(meta_err(key, format!("{} entries for {n} tokens", a.len())));
    }
    a[..n]
        .iter()
        .map(|v| each(v).ok_or_else(|| meta_err(key, "an element of the wrong type")))
        .collect::<Result<Vec<T>>>()
        .map(Some)
}

/// The byte a byte token such as `<0x0A>` stands for, read as llama.cpp reads it (the hex
/// digits after `<0x`).
fn byte_of(text: &str) -> u8 {
    let hex: String = text.chars().skip(3).take(2).take_while(char::is_ascii_hexdigit).collect();
    u8::from_str_radix(&hex, 16).unwrap_or(0)
}

impl Tokenizer {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let kind = gguf.require("tokenizer.ggml.model", gguf.get_str("tokenizer.ggml.model"))?;
        let is_spm = match kind {
            "gpt2" => false,
            "llama" => true,
            other => {
                return Err(Error::UnsupportedModel(format!(
                    "tokenizer model {other:?} (tokenizer.ggml.model) is not supported; known: \
                     \"gpt2\" (byte-level BPE), \"llama\" (SentencePiece)"
                )));
            }
        };
        // Resolved before anything else so that an unknown one is what a load reports.
        let pre = if is_spm {
            None
        } else {
            Some(bpe::pre_tokenizer(gguf.get_str("tokenizer.ggml.pre")?)?)
        };

        // llama.cpp renames empty tokens, which would otherwise all be one map key.
        let tokens: Vec<String> = string_array(gguf, "tokenizer.ggml.tokens")?
            .iter()
            .enumerate()
            .map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { (*t).to_string() })
            .collect();
        let n = tokens.len();
        let mut attrs: Vec<Attr> =
            token_array(gguf, "tokenizer.ggml.token_type", n, |v| v.as_i64().map(Attr::from_type))?
                .unwrap_or_else(|| vec![Attr::NORMAL; n]);

        let id_key = |key: &str| -> Result<Option<u32>> {
            match gguf.get_u64(key)? {
                None => Ok(None),
                Some(v) if (v as usize) < n => Ok(Some(v as u32)),
                Some(v) => Err(meta_err(key, format!("token id {v} is outside the vocabulary"))),
            }
        };
        // SentencePiece vocabularies that name none have llama's <unk>, <s>, </s> at 0, 1, 2.
        let spm_default = |id: u32| (is_spm && (id as usize) < n).then_some(id);
        let bos = id_key("tokenizer.ggml.bos_token_id")?.or(spm_default(1));
        let eos = id_key("tokenizer.ggml.eos_token_id")?.or(spm_default(2));
        let unk = id_key("tokenizer.ggml.unknown_token_id")?.or(spm_default(0));
        let eot = id_key("tokenizer.ggml.eot_token_id")?;
        let eom = id_key("tokenizer.ggml.eom_token_id")?;

        let add_bos = gguf
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(is_spm || pre.is_some_and(|p| p.add_bos));
        let add_eos = gguf.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let add_space_prefix = gguf.get_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(is_spm);
        if add_bos && bos.is_none() {
            return Err(meta_err(
                "tokenizer.ggml.add_bos_token",
                "set but there is no bos_token_id",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(meta_err(
                "tokenizer.ggml.add_eos_token",
                "set but there is no eos_token_id",
            ));
        }

        let eog = amend_attrs(gguf, &tokens, &mut attrs, [eos, eot, eom])?;

        let model = match pre {
            Some(pre) => {
                let merges = string_array(gguf, "tokenizer.ggml.merges")?;
                Model::Bpe(bpe::Bpe::new(&tokens, &merges, pre)?)
            }
            None => {
                // Converters write f32; llama.cpp also reads i32 scores.
                let scores = token_array(gguf, "tokenizer.ggml.scores", n, |v| {
                    v.as_f64().or_else(|| v.as_i64().map(|i| i as f64)).map(|s| s as f32)
                })?
                .unwrap_or_else(|| vec![0.0; n]);
                Model::Spm { spm: spm::Spm::new(&tokens, scores, unk), add_space_prefix }
            }
        };

        let mut specials: Vec<(u32, String)> = (0..n)
            .filter(|&i| attrs[i].is_special())
            .map(|i| (i as u32, tokens[i].clone()))
            .collect();
        specials.sort_by_key(|(_, t)| std::cmp::Reverse(t.len()));
        let special_finder = if specials.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::new(specials.iter().map(|(_, t)| t))
                    .map_err(|e| Error::Tokenizer(format!("special tokens: {e}")))?,
            )
        };

        let gpt2_bytes = bpe::unicode_to_byte();
        let token_bytes: Vec<Vec<u8>> = tokens
            .iter()
            .zip(&attrs)
            .map(|(t, &a)| {
                if a.is_special() {
                    t.as_bytes().to_vec()
                } else if a.has(Attr::NORMAL) {
                    if is_spm {
                        t.replace(spm::SPACE, " ").into_bytes()
                    } else {
                        // Byte-level tokens spell bytes with GPT-2's printable alphabet. Some
                        // vocabularies mix in raw text: that is kept as its UTF-8, where
                        // llama.cpp would print an "[UNK_BYTE_…]" marker instead.
                        let mut out = Vec::with_capacity(t.len());
                        for c in t.chars() {
                            match gpt2_bytes.get(&c) {
                                Some(&b) => out.push(b),
                                None => {
                                    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes())
                                }
                            }
                        }
                        out
                    }
                } else if a.has(Attr::BYTE) {
                    vec![byte_of(t)]
                } else {
                    // Unused and undefined tokens yield nothing, as in llama.cpp.
                    Vec::new()
                }
            })
            .collect();

        let text = |id: Option<u32>| id.map(|i| tokens[i as usize].clone()).unwrap_or_default();
        let chat = match gguf.get_str("tokenizer.chat_template")? {
            Some(src) => ChatTemplate::new(src, &text(bos), &text(eos)).map_err(|e| e.to_string()),
            None => {
                Err("the model has no chat template (tokenizer.chat_template); send raw prompts"
                    .to_string())
            }
        };

        Ok(Self {
            model,
            specials,
            special_finder,
            token_bytes,
            bos,
            eos,
            add_bos,
            add_eos,
            eog,
            chat,
        })
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

    /// Tokens that end generation, as llama.cpp decides: EOS, EOT and EOM, the end-of-turn texts
    /// it knows, and fill-in-the-middle pad, repo and file-separator markers.
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Tokenizes `text` as llama.cpp does with special-token parsing on: special tokens written
    /// in it (`<|im_start|>` …) are recognised, and BOS/EOS are added when the model asks.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos
            && let Some(b) = self.bos
        {
            ids.push(b);
        }
        let mut after_special = true;
        for fragment in self.partition(text) {
            match fragment {
                Fragment::Token(id) => {
                    ids.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    match &self.model {
                        Model::Bpe(bpe) => bpe.tokenize(t, &mut ids)?,
                        Model::Spm { spm, add_space_prefix } => {
                            spm.tokenize(t, *add_space_prefix && after_special, &mut ids)?;
                        }
                    }
                    after_special = false;
                }
            }
        }
        if self.add_eos
            && let Some(e) = self.eos
        {
            ids.push(e);
        }
        Ok(ids)
    }

    /// Splits special tokens out of `text` the way llama.cpp does: each special in turn, longest
    /// first, is cut out of every stretch of text still left, left to right.
    fn partition<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(text)];
        let Some(finder) = &self.special_finder else { return fragments };
        // Only specials the text contains can be cut out of any part of it.
        let mut present = vec![false; self.specials.len()];
        for m in finder.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
        }
        for ((id, special), _) in self.specials.iter().zip(&present).filter(|(_, p)| **p) {
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(special.as_str()) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(*id));
                    rest = &rest[at + special.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// The bytes a token stands for when generated (llama.cpp's piece with specials rendered),
    /// or `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// The pieces of `ids` concatenated (invalid UTF-8 becomes U+FFFD; out-of-range ids are
    /// skipped). A SentencePiece prompt decodes with the space its first word was given.
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

/// Amends token attributes by token text as llama.cpp does after loading a vocabulary, and
/// returns the tokens that end generation: the end-of-turn texts, fill-in-the-middle pad/repo/
/// separator markers, and the EOS/EOT/EOM ids the metadata names.
fn amend_attrs(
    gguf: &GgufFile,
    tokens: &[String],
    attrs: &mut [Attr],
    eos_eot_eom: [Option<u32>; 3],
) -> Result<Vec<u32>> {
    let n = tokens.len();
    let find = |text: &str| tokens.iter().position(|t| t == text).map(|i| i as u32);
    let mut eog: Vec<u32> = Vec::new();
    let add = |eog: &mut Vec<u32>, id: u32| {
        if !eog.contains(&id) {
            eog.push(id);
        }
    };

    for (keys, texts, ends) in FIM {
        let mut named = None;
        for key in *keys {
            if let Some(v) = gguf.get_u64(key)?
                && (v as usize) < n
            {
                named = Some(v as u32);
            }
        }
        let id = match named {
            Some(id) => Some(id),
            None => {
                // llama.cpp takes the first it meets in a hash map; with one candidate (the
                // usual case) that is the same token.
                let found = (0..n).find(|&i| texts.contains(&tokens[i].as_str())).map(|i| i as u32);
                if let Some(i) = found {
                    attrs[i as usize] = attrs[i as usize].with(Attr::CONTROL);
                }
                found
            }
        };
        if *ends && let Some(id) = id {
            add(&mut eog, id);
        }
    }
    for (i, t) in tokens.iter().enumerate() {
        if EOG_TEXTS.contains(&t.as_str()) {
            add(&mut eog, i as u32);
            attrs[i] = attrs[i].with(Attr::CONTROL);
        }
    }
    for text in ALWAYS_RENDERED {
        if let Some(i) = find(text) {
            attrs[i as usize] = Attr::USER_DEFINED;
        }
    }
    for id in eos_eot_eom.into_iter().flatten() {
        add(&mut eog, id);
    }

    // gpt-oss and solar-open end a message with <|end|> but stop generating at <|return|> or
    // <|call|> (<|calls|>, <|flush|>): there <|end|> is an ordinary rendered token.
    let in_eog = |eog: &[u32], text: &str| eog.iter().any(|&i| tokens[i as usize] == text);
    let (ret, call, calls, flush) = (
        in_eog(&eog, "<|return|>"),
        in_eog(&eog, "<|call|>"),
        in_eog(&eog, "<|calls|>"),
        in_eog(&eog, "<|flush|>"),
    );
    if (call || calls)
        && (ret || flush)
        && let Some(pos) = eog.iter().position(|&i| tokens[i as usize] == "<|end|>")
    {
        let end = eog.remove(pos);
        attrs[end as usize] = Attr::USER_DEFINED;
    }
    // Where another token ends a turn (gemma4, plamo), </s> is plain text.
    if (in_eog(&eog, "<|tool_response>") || in_eog(&eog, "<|plamo:eos|>"))
        && let Some(pos) = eog.iter().position(|&i| tokens[i as usize] == "</s>")
    {
        let s = eog.remove(pos);
        attrs[s as usize] = Attr::NORMAL;
    }
    Ok(eog)
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
