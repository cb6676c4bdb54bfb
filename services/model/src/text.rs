//! Turns generated tokens into the text deltas a client sees: whole UTF-8 characters only, and
//! stop strings found across token boundaries without ever sending any part of one. Text that
//! could still turn out to begin a stop string is held back until it cannot. The batch runner
//! keeps one per sequence that wants text, so stop strings are a finish rule like any other.

use crate::tokenizer::{StreamDecoder, Tokenizer};

/// One piece of output: text and the tokens that produced it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Piece {
    pub text: String,
    pub tokens: Vec<u32>,
}

impl Piece {
    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.tokens.is_empty()
    }
}

/// What pushing a token produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pushed {
    /// Text (possibly empty) that is safe to send.
    Text(Piece),
    /// A stop string completed: send this last piece (the text before the stop) and finish.
    Stopped(Piece),
}

#[derive(Debug, Clone)]
pub struct TextStream {
    decoder: StreamDecoder,
    stops: Vec<String>,
    /// Decoded text not yet sent because it may be the start of a stop string.
    held: String,
    /// Tokens not yet reported in a piece.
    tokens: Vec<u32>,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> Self {
        Self { decoder: StreamDecoder::new(), stops, held: String::new(), tokens: Vec::new() }
    }

    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Pushed {
        self.tokens.push(id);
        let new = self.decoder.push(tok, id);
        self.held.push_str(&new);
        // The earliest stop string wins; only text that was held can contain it.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Pushed::Stopped(Piece { text, tokens: std::mem::take(&mut self.tokens) });
        }
        let keep = self.partial_stop_suffix();
        let send = self.held.len() - keep;
        let text: String = self.held.drain(..send).collect();
        // Tokens are reported with the text they produced; while text is held back (or a
        // character is incomplete) they wait for it.
        let tokens = if keep == 0 && !self.decoder.has_pending() {
            std::mem::take(&mut self.tokens)
        } else {
            Vec::new()
        };
        Pushed::Text(Piece { text, tokens })
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_stop_suffix(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            let max = s.len().saturating_sub(1).min(self.held.len());
            for n in (best + 1..=max).rev() {
                let start = self.held.len() - n;
                if self.held.is_char_boundary(start) && s.starts_with(&self.held[start..]) {
                    best = n;
                    break;
                }
            }
        }
        best
    }

    /// Everything still held, at the end of generation (not a stop).
    pub fn finish(&mut self) -> Piece {
        let mut text = std::mem::take(&mut self.held);
        text.push_str(&self.decoder.finish());
        Piece { text, tokens: std::mem::take(&mut self.tokens) }
    }
}
