//! The KV connector: how KV gets into and out of the batch runner's sequences without the
//! runner (or the engine) knowing any transport. Modelled on vLLM v1's `KVConnectorBase_V1`:
//! a scheduler side that says how much of a prompt's KV is already available (a cached
//! prefix, KV pushed by a prefill node) and a worker side that loads it into a sequence, saves
//! each layer as soon as a step has written it, saves the step, and exports a sequence as it
//! leaves. The prefix cache, the UCX and gRPC push and the decode node's receive side are
//! connectors (in `pdmesh-kv-transfer`); local generation uses `NoConnector`.

use crate::engine::Engine;
use crate::error::Result;
use crate::kv_cache::{KvView, SeqId};

/// A sequence's share of a step, as the connector sees it: its prompt's KV is computed up to
/// `computed` tokens once the step is done (`last` when that is the whole prompt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    pub id: u64,
    pub seq: SeqId,
    pub computed: usize,
    pub prompt_len: usize,
    pub last: bool,
}

/// What the runner does with a departing sequence's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Free them now.
    Free,
    /// Someone outside may still write into them (a remote writer whose session is open): the
    /// connector's owner frees the sequence once it cannot.
    Keep,
}

/// Moves KV in and out of the runner's sequences. Every method has a default that does
/// nothing, so a connector implements only its side.
pub trait KvConnector {
    /// Scheduler side: how many leading tokens of `id`'s prompt have KV available without
    /// computing it, or `None` while it is still arriving (the sequence then waits, without
    /// holding back the others).
    fn available(&mut self, _id: u64, _prompt: &[u32]) -> Option<usize> {
        Some(0)
    }

    /// Worker side: makes those tokens' KV present in `seq` before it is first scheduled (the
    /// sequence's length must then equal what `available` said).
    fn load(&mut self, _id: u64, _seq: SeqId, _engine: &mut Engine) -> Result<()> {
        Ok(())
    }

    /// Worker side: layer `layer` of the step is written for every sequence of `batch` (and
    /// the next layer not yet computed): ship it while the rest computes.
    fn save_layer(&mut self, _layer: usize, _kv: &KvView<'_>, _batch: &[Saved]) {}

    /// Worker side: the step is done for `batch`.
    fn save(&mut self, _kv: &KvView<'_>, _batch: &[Saved]) {}

    /// Whether a sliding window's layers may let go of the blocks it has moved past once a
    /// step's `save` is done: only for a connector that never reads a sequence's blocks whole
    /// after its steps (one that publishes or pushes a prompt at its end does).
    fn lets_window_go(&self) -> bool {
        false
    }

    /// The sequence leaves the runner (finished, failed or cancelled) with its KV still in
    /// `seq`: export what should outlive it, and say whether its blocks can be freed.
    fn finished(&mut self, _id: u64, _seq: SeqId, _kv: &KvView<'_>) -> Release {
        Release::Free
    }
}

/// No KV comes from or goes anywhere: every prompt is computed here.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoConnector;

impl KvConnector for NoConnector {
    fn lets_window_go(&self) -> bool {
        true
    }
}
