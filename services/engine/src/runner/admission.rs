//! Admission: a sequence is checked as it is added (so a bad one never reaches a step), waits
//! until its KV is available and the pool can hold it, then gets its engine sequence, its KV
//! from the connector, and its place in the scheduler.

use std::collections::VecDeque;

use super::{
    BatchRunner, End, GenerateParams, Origin, Output, Role, SeqKind, SeqSpec, Slot, accept,
};
use crate::connector::KvConnector;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::sampler::Sampler;
use crate::text::{Pushed, TextStream};

impl BatchRunner {
    /// Adds a sequence. Checked here, so a bad one never reaches a step. A first token sampled
    /// elsewhere is accepted at once: its output (and, if it already ends generation, the
    /// sequence's end) comes back now.
    pub fn add(
        &mut self,
        engine: &mut Engine,
        connector: &mut dyn KvConnector,
        id: u64,
        spec: SeqSpec,
    ) -> Result<Vec<Output>> {
        let ctx = engine.max_seq_len();
        let vocab = self.model.config.vocab as u32;
        if self.slots.contains_key(&id) {
            return Err(Error::invalid(format!("sequence {id} is already running")));
        }
        if spec.prompt.is_empty() {
            return Err(Error::invalid("the prompt is empty"));
        }
        if spec.prompt.len() >= ctx {
            return Err(Error::invalid(format!(
                "a prompt of {} tokens leaves no room in the context of {ctx}",
                spec.prompt.len()
            )));
        }
        if spec.params.max_tokens == 0 {
            return Err(Error::invalid("max_tokens must be at least 1"));
        }
        if let Some(p) = &spec.params.kv_policy {
            p.validate(engine.config().block_size)
                .map_err(|e| Error::invalid(format!("kv_policy: {e}")))?;
        }
        let SeqSpec { prompt, params, rng_position, seq, kind } = spec;
        let role = kind.role();
        let (text, from) = match kind {
            SeqKind::Prefill => (false, Origin::Here),
            SeqKind::Generate { text, from } => (text, from),
        };
        let resumed = from.resumed().to_vec();
        if let Some(t) = prompt.iter().chain(&from.first_token()).find(|&&t| t >= vocab) {
            return Err(Error::invalid(format!("token id {t} is outside the vocabulary")));
        }
        // A prefill sequence ends at its first token whatever the rules say; they apply where
        // it is decoded.
        if role == Role::Generate && !text && !params.stop_strings.is_empty() {
            return Err(Error::invalid("stop strings need text output"));
        }
        match &from {
            Origin::Resumed { tokens, first_token } => {
                check_resumed(&prompt, &params, tokens, *first_token, ctx, vocab)?;
            }
            Origin::HandedOff { tokens } => {
                check_resumed(&prompt, &params, tokens, None, ctx, vocab)?
            }
            Origin::Here | Origin::FirstToken(_) => {}
        }
        let sampler = Sampler::resume(params.sampling.clone(), rng_position)?;
        let tokens = match role {
            Role::Prefill => prompt.len(),
            Role::Generate => (prompt.len() + params.max_tokens).min(ctx),
        };
        // Windowed layers that let go of what they left hold only a window's blocks.
        let step = engine.config().max_batch_tokens;
        let blocks = engine.kv().blocks_to_hold(tokens, step, connector.lets_window_go());
        if self.promise_blocks && blocks > engine.kv().total_blocks() {
            return Err(Error::KvExhausted { needed: blocks, free: engine.kv().total_blocks() });
        }
        let mut text = text.then(|| TextStream::new(params.stop_strings.clone()));
        if let Some(text) = &mut text {
            // The client has this output already: only the stream's state is wanted.
            for &t in &resumed {
                if let Pushed::Stopped(_) = text.push(&self.model.tokenizer, t) {
                    return Err(Error::invalid("the resumed tokens already end in a stop string"));
                }
            }
        }
        let mut replay: VecDeque<u32> = resumed.iter().copied().collect();
        let mut prompt_len = prompt.len();
        let (next, first_token) = match from {
            // Its KV came with it: only the last token is left to feed.
            Origin::HandedOff { .. } => {
                prompt_len += replay.len() - 1;
                let last = replay.pop_back();
                replay.clear();
                (last, None)
            }
            // The prompt's first token again: decoding starts from it, as it did.
            Origin::Resumed { first_token: Some(_), .. } => (replay.pop_front(), None),
            Origin::FirstToken(t) => (None, Some(t)),
            Origin::Here | Origin::Resumed { first_token: None, .. } => (None, None),
        };
        let mut slot = Slot {
            seq,
            admitted: false,
            prompt_len,
            generated: resumed.len(),
            history: [prompt, resumed].concat(),
            sampler,
            text,
            params,
            role,
            next,
            unmarked: Vec::new(),
            unmarked_logprobs: Vec::new(),
            replay,
            paused: false,
            promised: blocks,
            steps: 0,
            largest_batch: 0,
        };
        let mut out = Vec::new();
        if let Some(t) = first_token
            && let Some(end) = accept(&self.model, ctx, &mut slot, (t, None), id, &mut out)
        {
            self.slots.insert(id, slot);
            out.extend(self.leave(engine, connector, id, end));
            return Ok(out);
        }
        self.slots.insert(id, slot);
        self.waiting.push_back(id);
        Ok(out)
    }

    /// Moves waiting sequences into the scheduler, in arrival order: a sequence whose KV is
    /// still arriving is passed over, one the pool cannot hold yet holds back those behind it.
    pub(super) fn admit(&mut self, engine: &mut Engine, connector: &mut dyn KvConnector) {
        let total = engine.kv().total_blocks();
        let mut i = 0;
        while i < self.waiting.len() {
            let id = self.waiting[i];
            let slot = &self.slots[&id];
            let Some(available) = connector.available(id, &slot.history[..slot.prompt_len]) else {
                i += 1;
                continue;
            };
            if self.promise_blocks && self.promised + slot.promised > total {
                break;
            }
            self.waiting.remove(i);
            if let Err(e) = self.start(engine, connector, id, available) {
                let failed = self.leave(engine, connector, id, End::Failed(e));
                self.pending.extend(failed);
            }
        }
    }

    /// Gives an admitted sequence its engine sequence and KV, and schedules the rest.
    fn start(
        &mut self,
        engine: &mut Engine,
        connector: &mut dyn KvConnector,
        id: u64,
        available: usize,
    ) -> Result<()> {
        let slot = self.slots.get_mut(&id).expect("waiting sequences exist");
        let seq = *slot.seq.get_or_insert_with(|| engine.create_sequence());
        slot.admitted = true;
        if self.promise_blocks {
            self.promised += slot.promised;
        }
        connector.load(id, seq, engine)?;
        let have = engine.seq_len(seq)?;
        let slot = &self.slots[&id];
        if have != available {
            return Err(Error::invalid(format!(
                "the connector loaded {have} tokens of KV for sequence {id}, not {available}"
            )));
        }
        // KV that came whole (from a prefill node, or moved here) goes under its policy now.
        if have >= slot.prompt_len && slot.role == Role::Generate {
            engine.set_kv_policy(seq, slot.params.kv_policy)?;
        }
        let scheduled = match (have == slot.prompt_len, slot.next) {
            (true, Some(_)) => self.sched.add_prefilled(id, slot.prompt_len),
            (false, None) if have < slot.prompt_len => {
                self.sched.add_from(id, slot.prompt_len, have)
            }
            (true, None) => {
                return Err(Error::invalid(format!(
                    "sequence {id} has its whole prompt's KV but no first token to decode from"
                )));
            }
            _ => {
                return Err(Error::invalid(format!(
                    "sequence {id} has {have} of {} prompt tokens' KV and a first token; it needs all of them",
                    slot.prompt_len
                )));
            }
        };
        scheduled.map_err(|e| Error::invalid(e.to_string()))
    }
}

/// Checks a resumed sequence's tokens against its prompt, rules and first token.
fn check_resumed(
    prompt: &[u32],
    params: &GenerateParams,
    resumed: &[u32],
    first_token: Option<u32>,
    ctx: usize,
    vocab: u32,
) -> Result<()> {
    let n = resumed.len();
    if n == 0 {
        return Err(Error::invalid("a resumed sequence has no resumed tokens"));
    }
    if n >= params.max_tokens {
        let max = params.max_tokens;
        return Err(Error::invalid(format!("{n} resumed tokens leave none of max_tokens {max}")));
    }
    if prompt.len() + n >= ctx {
        return Err(Error::invalid(format!(
            "{n} resumed tokens past a prompt of {} fill the context of {ctx}",
            prompt.len()
        )));
    }
    if let Some(t) = resumed.iter().find(|&&t| t >= vocab) {
        return Err(Error::invalid(format!("resumed token id {t} is outside the vocabulary")));
    }
    if let Some(t) = first_token
        && t != resumed[0]
    {
        return Err(Error::invalid(format!(
            "the first token {t} is not the resumed stream's first, {}",
            resumed[0]
        )));
    }
    Ok(())
}
