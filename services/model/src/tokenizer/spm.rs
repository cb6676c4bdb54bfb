//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral 7B, …),
//! tokenized the way llama.cpp's `llm_tokenizer_spm` does, so that ids agree with it exactly.
//!
//! Spaces become U+2581, the text is cut into characters, and neighbouring symbols are merged
//! greedily: always the pair whose concatenation is the vocabulary piece with the highest score
//! (the leftmost among equal scores), until no pair forms a piece. A symbol left that is not a
//! piece is spelled with byte tokens (`<0xE4>` …).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{Error, Result};

/// SentencePiece's visible space.
pub(super) const SPACE: &str = "\u{2581}";

/// A SentencePiece vocabulary: pieces, their scores and the byte-fallback tokens.
pub(super) struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// The `<0xXX>` token of each byte. (llama.cpp falls back to the byte's one-character piece,
    /// but only characters that are no piece are ever spelled, so that never finds one.)
    bytes: Vec<Option<u32>>,
    unk: Option<u32>,
}

/// A symbol of the text being merged: a byte range, linked to its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of two adjacent symbols; stale once either of them changed.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Bigram {
    /// The best pair first: highest score, then leftmost. Scores compare as C++ floats do
    /// (-0.0 equals 0.0), as llama.cpp's queue compares them.
    fn cmp(&self, other: &Self) -> Ordering {
        let score = self.score.partial_cmp(&other.score).unwrap_or(Ordering::Equal);
        score.then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl Spm {
    /// `tokens[i]` has score `scores[i]`; `unk` is used for a character that neither a piece nor
    /// byte tokens can spell (llama.cpp aborts there; SentencePiece itself emits `<unk>`).
    pub fn new(tokens: &[String], scores: Vec<f32>, unk: Option<u32>) -> Self {
        let mut ids = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            ids.insert(t.clone(), i as u32);
        }
        let bytes = (0..256).map(|b| ids.get(&format!("<0x{b:02X}>")).copied()).collect();
        Self { ids, scores, bytes, unk }
    }

    /// Appends the ids of `text`, a stretch of text between special tokens; `prefix_space` puts a
    /// space before it (`tokenizer.ggml.add_space_prefix`, at the start and after a special).
    pub fn tokenize(&self, text: &str, prefix_space: bool, out: &mut Vec<u32>) -> Result<()> {
        let mut escaped = String::with_capacity(text.len() * 3 / 2 + 3);
        if prefix_space {
            escaped.push_str(SPACE);
        }
        for c in text.chars() {
            match c {
                ' ' => escaped.push_str(SPACE),
                c => escaped.push(c),
            }
        }
        let text = escaped.as_str();

        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (start + c.len_utf8() < text.len()).then_some(i + 1),
            });
        }
        if symbols.is_empty() {
            return Ok(());
        }

        let mut queue = BinaryHeap::new();
        let try_add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left, right| {
            let (Some(left), Some(right)) = (left, right) else { return };
            let (l, r): (&Symbol, &Symbol) = (&symbols[left], &symbols[right]);
            let piece = &text[l.start..l.start + l.len + r.len];
            if let Some(&id) = self.ids.get(piece) {
                let score = self.scores.get(id as usize).copied().unwrap_or(0.0);
                queue.push(Bigram { score, left, right, len: piece.len() });
            }
        };
        for i in 1..symbols.len() {
            try_add(&symbols, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            try_add(&symbols, &mut queue, l.prev, Some(b.left));
            try_add(&symbols, &mut queue, Some(b.left), r.next);
        }

        // Every merge made a vocabulary piece, so only single characters can miss: those are
        // spelled in bytes (llama.cpp's `resegment` never needs its merge history here).
        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => self.spell(piece, out)?,
            }
            at = s.next;
        }
        Ok(())
    }

    fn spell(&self, piece: &str, out: &mut Vec<u32>) -> Result<()> {
        let bytes: Option<Vec<u32>> = piece.bytes().map(|b| self.bytes[b as usize]).collect();
        match (bytes, self.unk) {
            (Some(ids), _) => out.extend(ids),
            (None, Some(unk)) => out.push(unk),
            (None, None) => {
                return Err(Error::Tokenizer(format!(
                    "{piece:?} is no piece, has no byte tokens and the vocabulary has no unknown token"
                )));
            }
        }
        Ok(())
    }
}
