//! The sending side on a prefill node, as a `KvConnector`: a prompt's cached prefix (from the
//! prefix cache) is loaded into its sequence instead of computed, and the KV computed for it
//! is handed to its transfer as soon as it exists — each layer of the blocks a chunk
//! completes while later layers compute (`layer`), the blocks after each step (`chunk`), or
//! everything after the last chunk (`prompt`). A sliding-window model's blocks wholly before
//! the window of the token after the prompt go thin (their global layers: a windowed layer's
//! piece of them is never sent). As the sequence leaves, its export (checksums, the full
//! blocks it computed, whole, for the prefix cache) is kept for the caller.
//!
//! Pieces go into a bounded channel per prompt, sized for every piece it can produce, so the
//! engine thread never waits on a slow network; the transfer's task sends them on.

use std::collections::HashMap;

use bytes::Bytes;
use pdmesh_engine::{Engine, KvConnector, KvView, Release, Saved, SeqId};
use pdmesh_kv_types::KvLayout;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::KvPiece;

/// When a prompt's KV is handed to the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PushMode {
    /// Each layer's part of the blocks a chunk completes, as soon as that layer is computed
    /// (while the next layers compute). Needs a layered transport (UCX); else `chunk`.
    #[default]
    Layer,
    /// The blocks each chunk completes, after its step.
    Chunk,
    /// Everything after the last chunk (no overlap; the reference for the other two).
    Prompt,
}

impl std::fmt::Display for PushMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PushMode::Layer => "layer",
            PushMode::Chunk => "chunk",
            PushMode::Prompt => "prompt",
        })
    }
}

impl std::str::FromStr for PushMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "layer" => Ok(PushMode::Layer),
            "chunk" => Ok(PushMode::Chunk),
            "prompt" => Ok(PushMode::Prompt),
            other => Err(format!("unknown kv_push {other:?} (expected layer, chunk or prompt)")),
        }
    }
}

/// Why a push job is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("{cached} cached blocks leave nothing of a {prompt_len}-token prompt to compute")]
    NothingToCompute { cached: usize, prompt_len: usize },
    #[error("cached block {index} has {got} bytes, a block is {want}")]
    BlockSize { index: usize, got: usize, want: usize },
}

/// One prompt's push.
#[derive(Debug)]
pub struct PushJob {
    pub mode: PushMode,
    /// Compute each block's checksum for the receiver to verify.
    pub checksums: bool,
    /// The prompt's first blocks, already computed (from the prefix cache). Whole blocks,
    /// fewer than the prompt fills.
    pub cached: Vec<Bytes>,
    /// Export the full blocks computed here (for publishing to the prefix cache).
    pub publish: bool,
    /// Where pieces go; sized by `piece_capacity`.
    pub pieces: mpsc::Sender<KvPiece>,
}

/// What a prompt's push leaves behind when its sequence is done.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Export {
    /// Verify mode: each block's checksum (of its wire form); else empty.
    pub checksums: Vec<u64>,
    /// With `publish`: the full blocks computed here (after the cached ones), in order.
    pub computed_blocks: Vec<Bytes>,
    /// Prompt tokens whose KV came from the cache.
    pub cached_tokens: usize,
}

#[derive(Debug)]
struct Active {
    job: PushJob,
    /// Blocks in the prompt.
    blocks: usize,
    cached_blocks: usize,
    /// Blocks handed to the transport so far (layer mode: every layer of them).
    sent: usize,
    /// The first blocks, before the window of the token after the prompt, that travel thin
    /// (`KvLayout::thin_blocks`).
    thin: usize,
    checksums: Vec<u64>,
}

/// The prefill node's connector.
#[derive(Debug)]
pub struct PushConnector {
    jobs: HashMap<u64, Active>,
    exports: HashMap<u64, Export>,
    layout: KvLayout,
    block_size: usize,
    layers: usize,
    blocks_per_message: usize,
}

impl PushConnector {
    pub fn new(engine: &Engine, blocks_per_message: usize) -> Self {
        let g = engine.kv().geometry();
        Self {
            jobs: HashMap::new(),
            exports: HashMap::new(),
            layout: engine.kv_layout(),
            block_size: g.block_size,
            layers: g.layers,
            blocks_per_message: blocks_per_message.max(1),
        }
    }

    /// Room a prompt of `prompt_len` tokens needs in its piece channel: at most one piece per
    /// layer per block.
    pub fn piece_capacity(&self, prompt_len: usize) -> usize {
        prompt_len.div_ceil(self.block_size) * self.layers + 1
    }

    /// Checks a job for a prompt of `prompt_len` tokens and starts tracking it.
    pub fn add(
        &mut self,
        id: u64,
        prompt_len: usize,
        job: PushJob,
        block_bytes: usize,
    ) -> Result<(), PushError> {
        let cached = job.cached.len();
        if cached * self.block_size >= prompt_len {
            return Err(PushError::NothingToCompute { cached, prompt_len });
        }
        if let Some((index, b)) =
            job.cached.iter().enumerate().find(|(_, b)| b.len() != block_bytes)
        {
            return Err(PushError::BlockSize { index, got: b.len(), want: block_bytes });
        }
        let blocks = prompt_len.div_ceil(self.block_size);
        let cached_blocks = job.cached.len();
        let thin = self.layout.thin_blocks(prompt_len);
        let a = Active { job, blocks, cached_blocks, sent: 0, thin, checksums: Vec::new() };
        self.jobs.insert(id, a);
        Ok(())
    }

    /// The export of a finished prompt (once).
    pub fn take_export(&mut self, id: u64) -> Option<Export> {
        self.exports.remove(&id)
    }

    /// Forgets a prompt that will not finish (refused, or failed before the runner had it).
    pub fn remove(&mut self, id: u64) {
        self.jobs.remove(&id);
        self.exports.remove(&id);
    }

    /// Blocks of a job that can be shipped once its prompt is computed up to `computed`
    /// tokens: the full blocks (none before the end in `prompt` mode), and at the end the
    /// tail block.
    fn ready(&self, a: &Active, s: &Saved) -> usize {
        if s.last {
            a.blocks
        } else if a.job.mode == PushMode::Prompt {
            a.sent
        } else {
            s.computed / self.block_size
        }
    }
}

/// Appends blocks `blocks` in their wire form (thin before `thin`).
fn read_blocks(
    kv: &KvView<'_>,
    seq: SeqId,
    blocks: std::ops::Range<usize>,
    wire: (&KvLayout, usize),
    out: &mut Vec<u8>,
) {
    for i in blocks {
        kv.read_wire_block(seq, i, wire, out).expect("blocks of a live sequence");
    }
}

impl KvConnector for PushConnector {
    fn available(&mut self, id: u64, _prompt: &[u32]) -> Option<usize> {
        Some(self.jobs.get(&id).map_or(0, |a| a.job.cached.len() * self.block_size))
    }

    fn load(&mut self, id: u64, seq: SeqId, engine: &mut Engine) -> pdmesh_engine::Result<()> {
        let Some(a) = self.jobs.get_mut(&id) else { return Ok(()) };
        let cached = std::mem::take(&mut a.job.cached);
        engine.extend_sequence(seq, cached.len() * self.block_size)?;
        engine.write_blocks(seq, 0, cached.iter().map(|b| &b[..]))?;
        Ok(())
    }

    fn save_layer(&mut self, layer: usize, kv: &KvView<'_>, batch: &[Saved]) {
        for s in batch {
            let Some(a) = self.jobs.get(&s.id) else { continue };
            let ready = self.ready(a, s);
            // A thin block travels without this layer when it is a windowed one.
            let first = match self.layout.wire_layer_offset(layer, a.sent, a.thin) {
                Some(_) => a.sent,
                None => a.sent.max(a.thin),
            };
            if a.job.mode != PushMode::Layer || ready <= first {
                continue;
            }
            let mut buf = Vec::new();
            for i in first..ready {
                kv.read_block_layer(s.seq, i, layer, &mut buf).expect("blocks of a live sequence");
            }
            let piece =
                KvPiece { first_block: first as u32, layer: Some(layer as u32), data: buf.into() };
            // A closed transfer is noticed by its caller; the prompt is then cancelled.
            let _ = a.job.pieces.try_send(piece);
        }
    }

    fn save(&mut self, kv: &KvView<'_>, batch: &[Saved]) {
        for s in batch {
            let Some(a) = self.jobs.get(&s.id) else { continue };
            let ready = self.ready(a, s);
            let a = self.jobs.get_mut(&s.id).expect("looked up above");
            if a.job.checksums {
                let mut buf = Vec::new();
                for i in a.sent..ready {
                    buf.clear();
                    kv.read_wire_block(s.seq, i, (&self.layout, a.thin), &mut buf)
                        .expect("blocks of a live sequence");
                    a.checksums.push(pdmesh_kv_types::block_checksum(&buf));
                }
            }
            if a.job.mode == PushMode::Layer {
                a.sent = ready;
                continue;
            }
            while a.sent < ready {
                let n = (ready - a.sent).min(self.blocks_per_message);
                let mut buf = Vec::new();
                read_blocks(kv, s.seq, a.sent..a.sent + n, (&self.layout, a.thin), &mut buf);
                let piece = KvPiece { first_block: a.sent as u32, layer: None, data: buf.into() };
                if a.job.pieces.try_send(piece).is_err() {
                    break;
                }
                a.sent += n;
            }
        }
    }

    fn finished(&mut self, id: u64, seq: SeqId, kv: &KvView<'_>) -> Release {
        let Some(a) = self.jobs.remove(&id) else { return Release::Free };
        // Nobody is left to take the export of a prompt whose transfer is gone.
        if a.job.pieces.is_closed() {
            return Release::Free;
        }
        let mut computed_blocks = Vec::new();
        if a.job.publish {
            let full = kv.len(seq).unwrap_or(0) / self.block_size;
            for i in a.cached_blocks..full {
                // Whole: a later prompt may continue from any of them.
                let mut buf = Vec::new();
                kv.read_block(seq, i, &mut buf).expect("blocks of a live sequence");
                computed_blocks.push(Bytes::from(buf));
            }
        }
        let export = Export {
            checksums: a.checksums,
            computed_blocks,
            cached_tokens: a.cached_blocks * self.block_size,
        };
        self.exports.insert(id, export);
        Release::Free
    }
}
