//! GPT-2 style byte-level BPE (`tokenizer.ggml.model = "gpt2"`) on the `tokenizers` crate, with
//! the pre-tokenizer llama.cpp uses for the vocabulary's `tokenizer.ggml.pre`.
//!
//! llama.cpp splits text with a list of regexes, each applied to the pieces the previous one
//! left (matches and the text between them both become pieces), then byte-encodes each piece and
//! merges within it by rank. A `Sequence` of isolating `Split`s followed by `ByteLevel` is the
//! same pipeline. The regexes are llama.cpp's own: where it runs a hand-written splitter instead
//! (GPT-2, llama3, qwen2), the regex here is the one that splitter implements, in the form
//! llama.cpp spells it (`'[sS]` rather than `(?i:'s)`, whose Unicode case folding would also
//! take `'ſ`).

use std::collections::{HashMap, HashSet};

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's tekken split as llama.cpp rewrote it for its regex engine: "a letter that is not
/// a-z" and "a letter that is not A-Z" stand for the upper- and lower-case classes, and marks
/// (`\p{M}`) are not letters.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const CJK: &str = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+";

/// A pre-tokenizer as llama.cpp sets it up for some `tokenizer.ggml.pre` names: the regexes of
/// its `LLAMA_VOCAB_PRE_TYPE_*`, in order, and the tokenizer flags those names set.
pub(super) struct PreTokenizer {
    pub names: &'static [&'static str],
    regexes: &'static [&'static str],
    /// A piece that is a whole vocabulary token is taken as it is, without merging.
    ignore_merges: bool,
    /// Whether BOS is added when the GGUF does not say (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
}

const fn pre(names: &'static [&'static str], regexes: &'static [&'static str]) -> PreTokenizer {
    PreTokenizer { names, regexes, ignore_merges: false, add_bos: false }
}

/// The pre-tokenizers supported. Each entry (one set of regexes and flags) is checked against
/// llama.cpp by a vocabulary fixture (`scripts/make_vocab_fixtures.py`) under one of its names;
/// the names and what they select are llama.cpp's.
pub(super) const PRE_TOKENIZERS: &[PreTokenizer] = &[
    // Also what a vocabulary without `tokenizer.ggml.pre` gets.
    pre(&["default"], &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]),
    pre(
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ],
        &[GPT2],
    ),
    pre(
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        &[r"\p{N}", GPT2],
    ),
    // Llama 3 and the vocabularies converted like it take whole-token pieces unmerged and add BOS.
    PreTokenizer {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    pre(&["dbrx", "smaug-bpe", "chatglm-bpe"], &[LLAMA3]),
    PreTokenizer {
        names: &["glm4", "glm5"],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos: false,
    },
    pre(
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        &[QWEN2],
    ),
    // Mistral Nemo, Mistral Small 3 and later Mistral models.
    PreTokenizer { names: &["tekken"], regexes: &[TEKKEN], ignore_merges: true, add_bos: true },
    pre(
        &["deepseek-llm"],
        &[
            r"[\r\n]",
            r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
            r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
            r"\s+$",
            CJK,
            r"\p{N}+",
        ],
    ),
    pre(&["deepseek-coder"], &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}"]),
];

/// The pre-tokenizer llama.cpp picks for `tokenizer.ggml.pre` (absent: "default").
pub(super) fn pre_tokenizer(name: Option<&str>) -> Result<&'static PreTokenizer> {
    let name = name.unwrap_or("default");
    PRE_TOKENIZERS.iter().find(|p| p.names.contains(&name)).ok_or_else(|| {
        let known: Vec<&str> = PRE_TOKENIZERS.iter().flat_map(|p| p.names).copied().collect();
        Error::UnsupportedModel(format!(
            "pre-tokenizer {name:?} (tokenizer.ggml.pre) is not supported; known: {}",
            known.join(", ")
        ))
    })
}

/// A byte-level BPE vocabulary with its pre-tokenizer.
pub(super) struct Bpe {
    /// Boxed: the `tokenizers` pipeline is large, and lives beside the small SentencePiece model.
    inner: Box<tokenizers::Tokenizer>,
}

impl Bpe {
    /// `merges` are "a b" strings split at the first space after the first byte, as llama.cpp
    /// splits them; a pair listed twice keeps its first (best) rank.
    pub fn new(tokens: &[String], merges: &[&str], pre: &PreTokenizer) -> Result<Self> {
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.clone(), i as u32);
        }
        let mut seen = HashSet::new();
        let mut pairs = Vec::with_capacity(merges.len());
        for (i, m) in merges.iter().enumerate() {
            let split = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(at, _)| at);
            let Some(at) = split else {
                return Err(Error::gguf(
                    "metadata \"tokenizer.ggml.merges\"",
                    format!("entry {i} ({m:?}) is not \"a b\""),
                ));
            };
            let pair = (m[..at].to_string(), m[at + 1..].to_string());
            if seen.insert(pair.clone()) {
                pairs.push(pair);
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, pairs)
            .ignore_merges(pre.ignore_merges)
            .build()
            .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
        for re in pre.regexes {
            let split = Split::new(
                SplitPattern::Regex((*re).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex {re:?}: {e}")))?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, true, false).into());
        inner.with_pre_tokenizer(Some(Sequence::new(steps)));
        Ok(Self { inner: Box::new(inner) })
    }

    /// Appends the ids of `text` (no special tokens in it: they were split out before).
    pub fn tokenize(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }
}

/// GPT-2's reversible map from bytes to printable characters, inverted.
pub(super) fn unicode_to_byte() -> HashMap<char, u8> {
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
