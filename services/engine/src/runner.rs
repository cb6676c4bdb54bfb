//! The one batch loop. A `BatchRunner` holds every sequence's state (history, sampler, next
//! token, text and stop-string state), admits sequences as their KV becomes available and the
//! pool can hold them, plans each step with the continuous-batching scheduler, runs it on the
//! engine with a `KvConnector` moving KV in and out, samples, and applies one set of finish
//! rules. Prefill, decode and local generation are this runner plus a policy: prefill stops at
//! the first token (`Role::Prefill`), decode loads its KV through a connector and may start
//! from a token sampled elsewhere, generate uses no connector.
//!
//! The runner does no I/O and reads no clock: what it produces comes back as `Output`s for
//! the caller to deliver, so every rule is testable in microseconds on a tiny model.

use std::collections::{HashMap, VecDeque};

use crate::connector::{KvConnector, Release, Saved};
use crate::engine::{Engine, Logits, StepItem};
use crate::error::{Error, Result};
use crate::finish::FinishReason;
use crate::kv_cache::SeqId;
use crate::kv_policy::KvPolicy;
use crate::model::Model;
use crate::pacing::StepPacer;
use crate::sampler::{Sampler, SamplingParams, TokenLogprobs};
use crate::scheduler::{Scheduled, Scheduler, Work};
use crate::text::{Piece, Pushed, TextStream};

/// What to generate for one prompt, and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    pub sampling: SamplingParams,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Token ids that end generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// Strings that end generation; no part of one is ever emitted. Needs text output.
    pub stop_strings: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// An opt-in lossy KV policy, put on the sequence once its prompt's KV is complete (the
    /// prompt is computed whole, however it is chunked or wherever); none: full attention.
    pub kv_policy: Option<KvPolicy>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::default(),
            max_tokens: 128,
            stop_tokens: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            kv_policy: None,
        }
    }
}

/// What a sequence is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Compute the prompt's KV and sample the first token, then leave (a prefill node).
    Prefill,
    /// Generate until a finish rule ends it (a decode node, local generation).
    Generate,
}

/// One sequence for the runner.
#[derive(Debug, Clone)]
pub struct SeqSpec {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
    /// Where the sampler's random stream starts (a request continued from another node).
    pub rng_position: u128,
    /// An engine sequence the caller made for it (a decode reservation, whose blocks may
    /// already hold KV); the runner makes one otherwise. Either way the runner owns it now.
    pub seq: Option<SeqId>,
    pub kind: SeqKind,
}

/// What a sequence is for, with what only that kind carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqKind {
    /// Compute the prompt's KV and sample the first token, then leave (a prefill node): its
    /// output is that token, and the finish rules apply where it is decoded.
    Prefill,
    /// Generate until a finish rule ends it (a decode node, local generation). `text`:
    /// outputs carry text (and stop strings apply); without it, pieces carry tokens.
    Generate { text: bool, from: Origin },
}

/// Where a generating sequence's output starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Its first token is sampled here, once its prompt is computed.
    Here,
    /// A first token sampled elsewhere (by a prefill node): emitted at once, decoding starts
    /// from it once the prompt's KV is complete.
    FirstToken(u32),
    /// Its own output from before it moved here (its node died or drained), the sampler at
    /// `rng_position` after it. The KV of these tokens is recomputed as it was first
    /// computed: the prompt as a prompt, then each token in a decode step (which is not the
    /// prompt's arithmetic), fed instead of sampled; the text stream is replayed over them
    /// (held text, stop-string matches), and they count towards `max_tokens`. Output then
    /// continues exactly as if the request had never moved. `first_token`: the prompt's first
    /// token sampled again by a prefill node, which must be the first of `tokens`.
    Resumed { tokens: Vec<u32>, first_token: Option<u32> },
    /// Its output from before it moved, whose KV (the prompt's and every token's but the
    /// last) is already in its sequence, handed off by the node it ran on: nothing is
    /// recomputed, decoding goes on from the last of `tokens`.
    HandedOff { tokens: Vec<u32> },
}

impl Origin {
    /// The tokens it already generated elsewhere.
    pub fn resumed(&self) -> &[u32] {
        match self {
            Origin::Resumed { tokens, .. } | Origin::HandedOff { tokens } => tokens,
            Origin::Here | Origin::FirstToken(_) => &[],
        }
    }

    /// A first token sampled elsewhere, to accept before any step.
    pub fn first_token(&self) -> Option<u32> {
        match self {
            Origin::FirstToken(t) => Some(*t),
            Origin::Resumed { first_token, .. } => *first_token,
            Origin::Here | Origin::HandedOff { .. } => None,
        }
    }
}

impl SeqKind {
    pub fn role(&self) -> Role {
        match self {
            SeqKind::Prefill => Role::Prefill,
            SeqKind::Generate { .. } => Role::Generate,
        }
    }
}

impl SeqSpec {
    /// A prompt to generate from, computed here, its output as tokens.
    pub fn generate(prompt: Vec<u32>, params: GenerateParams) -> Self {
        let kind = SeqKind::Generate { text: false, from: Origin::Here };
        Self { prompt, params, rng_position: 0, seq: None, kind }
    }
}

/// How a sequence left the runner.
#[derive(Debug, Clone)]
pub enum End {
    /// A finish rule (or the caller) ended generation. `stop_token` is the EOS or stop token
    /// that did, which is not part of the output.
    Finished { reason: FinishReason, stop_token: Option<u32> },
    /// A prefill sequence is done: its first token and where its sampler's stream stands.
    /// `logprobs`: the first token's report, when the request asked for one.
    Prefilled { first_token: u32, rng_position: u128, logprobs: Option<TokenLogprobs> },
    /// It failed (the step it was in failed, or its KV could not be loaded).
    Failed(Error),
}

/// Where a generating sequence stands after a piece of output: enough to continue it
/// elsewhere. Text can lag its tokens (held back by a possible stop string), so the tokens
/// are reported here as they are generated, whatever text they made.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    /// Tokens generated since the previous mark, in order.
    pub tokens: Vec<u32>,
    /// The sampler's random stream after the last of them.
    pub rng_position: u128,
    /// The reports of those of `tokens` sampled here, in order, when the request asked for
    /// them (a first token sampled elsewhere, or a resumed one, has none here).
    pub logprobs: Vec<TokenLogprobs>,
}

/// A decoding sequence taken out of the batch to move elsewhere (`BatchRunner::pause`).
#[derive(Debug, Clone, PartialEq)]
pub struct Paused {
    /// The tokens since the last mark (text may have held them back) and the sampler's
    /// position: the output to resume from is every mark's tokens up to this one.
    pub mark: Mark,
    /// Tokens whose KV the sequence holds: the prompt and every generated token but the last.
    pub kv_tokens: usize,
}

/// What the runner produced for a sequence.
#[derive(Debug, Clone)]
pub enum Event {
    /// Output to deliver (text, when asked for, with the tokens that made it), and the mark
    /// it leaves the sequence at; no mark on the text flushed as the sequence ends (nothing
    /// is left to continue).
    Delta(Piece, Option<Mark>),
    /// The sequence left; `kept` is its engine sequence when the connector said its blocks
    /// must not be freed yet (the caller frees it later).
    /// `evicted`: KV tokens the sequence's lossy policy evicted (0 without one).
    Done {
        end: End,
        generated: usize,
        steps: u32,
        largest_batch: usize,
        kept: Option<SeqId>,
        evicted: usize,
    },
}

#[derive(Debug, Clone)]
pub struct Output {
    pub id: u64,
    pub event: Event,
}

/// Where a sequence stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    /// Waiting for its KV (from the connector) or for room in the pool.
    Waiting,
    /// Admitted; its prompt is being computed.
    Prefilling,
    /// Generating.
    Decoding,
}

/// A step that failed: it changed no KV, and every planned sequence failed with its error.
#[derive(Debug)]
pub struct StepFailed {
    pub error: Error,
    pub outputs: Vec<Output>,
}

/// Shown each row of logits a sequence's token is sampled from, with the sequence's id.
pub type LogitsObserver<'a> = dyn FnMut(u64, &[f32]) + 'a;

/// How a row's next token is picked: from the candidates it came back as, or from its logits.
enum Pick<'a> {
    Candidates(&'a [(u32, f32)]),
    Sample(&'a [f32]),
}

struct Slot {
    seq: Option<SeqId>,
    admitted: bool,
    history: Vec<u32>,
    prompt_len: usize,
    sampler: Sampler,
    params: GenerateParams,
    role: Role,
    text: Option<TextStream>,
    next: Option<u32>,
    generated: usize,
    /// Generated tokens not yet reported in a mark.
    unmarked: Vec<u32>,
    /// Their logprob reports (when asked for).
    unmarked_logprobs: Vec<TokenLogprobs>,
    /// Resumed tokens still to feed, one decode step each, before sampling again.
    replay: VecDeque<u32>,
    /// Out of the batch while it moves (`pause`).
    paused: bool,
    /// Blocks counted against the pool while admitted (with `promise_blocks`).
    promised: usize,
    steps: u32,
    largest_batch: usize,
}

/// The batch loop's state: every sequence it runs, and the scheduler that plans their steps.
pub struct BatchRunner {
    sched: Scheduler,
    slots: HashMap<u64, Slot>,
    /// Sequences not yet admitted, in arrival order.
    waiting: VecDeque<u64>,
    /// Admit a sequence only when the pool can hold all of its blocks (prompt, plus
    /// `max_tokens` for generation) besides those of every admitted one. Off when blocks are
    /// promised elsewhere (a decode node's reservations).
    promise_blocks: bool,
    promised: usize,
    /// Outputs of sequences that failed at admission, delivered with the next step's.
    pending: Vec<Output>,
    model: std::sync::Arc<Model>,
    /// Sizes steps that carry both streams and prompt chunks to an inter-token target.
    pacer: StepPacer,
    /// The last step run: when it started, its decodes and its prompt tokens (what the pacer
    /// learns from once the next step is planned).
    last_step: Option<(std::time::Instant, usize, usize)>,
}

impl std::fmt::Debug for BatchRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchRunner")
            .field("sequences", &self.slots.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl BatchRunner {
    /// A runner for `engine`'s model with at most `max_running` sequences admitted at once.
    pub fn new(engine: &Engine, max_running: usize, promise_blocks: bool) -> Self {
        Self {
            sched: Scheduler::new(engine.config().max_batch_tokens, max_running),
            slots: HashMap::new(),
            waiting: VecDeque::new(),
            promise_blocks,
            promised: 0,
            pending: Vec::new(),
            model: std::sync::Arc::clone(engine.model()),
            pacer: StepPacer::new(None, engine.config().max_batch_tokens),
            last_step: None,
        }
    }

    /// Steps with sequences decoding in them give prompt chunks only what fits `target`
    /// (`pacing.rs`), so a prompt computed here never stalls running streams for longer;
    /// None: every step takes `max_batch_tokens`.
    pub fn set_itl_target(&mut self, engine: &Engine, target: Option<std::time::Duration>) {
        self.pacer = StepPacer::new(target, engine.config().max_batch_tokens);
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Sequences not admitted yet.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.slots.contains_key(&id)
    }

    pub fn status(&self, id: u64) -> Option<SeqStatus> {
        let s = self.slots.get(&id)?;
        Some(if !s.admitted {
            SeqStatus::Waiting
        } else if s.role == Role::Generate && s.next.is_some() {
            SeqStatus::Decoding
        } else {
            SeqStatus::Prefilling
        })
    }

    /// Blocks promised to admitted sequences (with `promise_blocks`).
    pub fn promised_blocks(&self) -> usize {
        self.promised
    }

    /// Takes a decoding sequence out of the batch so that it can move to another node: it
    /// keeps its KV and blocks and is not stepped until `unpause` (or it ends). None when it
    /// is not decoding (waiting, prefilling, replaying, already paused).
    pub fn pause(&mut self, id: u64) -> Option<Paused> {
        let slot = self.slots.get_mut(&id)?;
        if slot.paused || !slot.admitted || slot.next.is_none() || !slot.replay.is_empty() {
            return None;
        }
        slot.paused = true;
        self.sched.remove(id);
        let mark = Mark {
            tokens: std::mem::take(&mut slot.unmarked),
            rng_position: slot.sampler.rng_position(),
            logprobs: std::mem::take(&mut slot.unmarked_logprobs),
        };
        Some(Paused { mark, kv_tokens: slot.history.len() - 1 })
    }

    /// Puts a paused sequence back in the batch (it stays on this node).
    pub fn unpause(&mut self, id: u64) -> Result<()> {
        let Some(slot) = self.slots.get_mut(&id).filter(|s| s.paused) else {
            return Err(Error::invalid(format!("sequence {id} is not paused")));
        };
        slot.paused = false;
        let kv = slot.history.len() - 1;
        self.sched.add_prefilled(id, kv).map_err(|e| Error::invalid(e.to_string()))
    }

    /// A paused sequence's KV, block by block in its wire form (those before the window of
    /// its next token thin: `KvLayout::thin_blocks` of its length), for moving it.
    pub fn export(&self, engine: &Engine, id: u64) -> Result<Vec<Vec<u8>>> {
        let Some(slot) = self.slots.get(&id).filter(|s| s.paused) else {
            return Err(Error::invalid(format!("sequence {id} is not paused")));
        };
        let seq = slot.seq.expect("admitted sequences have one");
        // Its blocks are no longer its tokens' prefix: a receiver would read them as one.
        let evicted = engine.evicted_tokens(seq)?;
        if evicted > 0 {
            return Err(Error::invalid(format!(
                "sequence {id}'s lossy KV policy evicted {evicted} tokens: its KV cannot move"
            )));
        }
        let view = engine.kv_view();
        let layout = engine.kv_layout();
        let thin = layout.thin_blocks(view.len(seq)?);
        (0..view.block_count(seq)?)
            .map(|i| {
                let mut b = Vec::new();
                view.read_wire_block(seq, i, (&layout, thin), &mut b)?;
                Ok(b)
            })
            .collect()
    }

    /// Ends a sequence at the caller's request (its client left): `Finished(Cancelled)`.
    pub fn cancel(
        &mut self,
        engine: &mut Engine,
        connector: &mut dyn KvConnector,
        id: u64,
    ) -> Vec<Output> {
        let end = End::Finished { reason: FinishReason::Cancelled, stop_token: None };
        self.leave(engine, connector, id, end)
    }

    /// Ends a sequence with an error (its KV transfer broke).
    pub fn fail(
        &mut self,
        engine: &mut Engine,
        connector: &mut dyn KvConnector,
        id: u64,
        error: Error,
    ) -> Vec<Output> {
        self.leave(engine, connector, id, End::Failed(error))
    }

    /// Whether a step would do anything (after admitting what can be admitted).
    pub fn has_work(&mut self, engine: &mut Engine, connector: &mut dyn KvConnector) -> bool {
        self.admit(engine, connector);
        !self.sched.is_empty() || !self.pending.is_empty()
    }

    /// Admits what can be admitted and plans the next step (empty: nothing to compute).
    pub fn plan(&mut self, engine: &mut Engine, connector: &mut dyn KvConnector) -> Vec<Scheduled> {
        self.admit(engine, connector);
        // The last step's time is what its streams waited: from its start to this plan (the
        // caller's delivery and bookkeeping between steps included).
        if let Some((started, decoding, prompt)) = self.last_step.take() {
            self.pacer.observe(decoding, prompt, started.elapsed());
        }
        let pacer = &self.pacer;
        self.sched.plan_with(&|decoding| pacer.budget(decoding))
    }

    /// `plan` then `run`.
    pub fn step(
        &mut self,
        engine: &mut Engine,
        connector: &mut dyn KvConnector,
    ) -> Result<Vec<Output>, StepFailed> {
        let plan = self.plan(engine, connector);
        self.run(&plan, engine, connector, None)
    }

    /// Runs a planned step: computes it (the connector saving each layer as it is written),
    /// samples every sequence whose logits it produced, applies the finish rules, and returns
    /// what came out, in plan order. `on_logits` sees each row sampled from; without it, a
    /// step whose samplers all have a cut (`Sampler::cut`: greedy, or a small top-k, without
    /// penalties) has the device cut the logits to their candidates (`Logits::Cut`) instead of
    /// reading them back. A failed step changes no KV; every sequence in it fails.
    pub fn run(
        &mut self,
        plan: &[Scheduled],
        engine: &mut Engine,
        connector: &mut dyn KvConnector,
        mut on_logits: Option<&mut LogitsObserver<'_>>,
    ) -> Result<Vec<Output>, StepFailed> {
        let mut out = std::mem::take(&mut self.pending);
        if plan.is_empty() {
            return Ok(out);
        }
        let ctx = engine.max_seq_len();
        let toks: Vec<[u32; 1]> =
            plan.iter().map(|s| [self.slots[&s.id].next.unwrap_or(0)]).collect();
        let mut saved = Vec::new();
        for s in plan {
            let slot = self.slots.get_mut(&s.id).expect("planned sequences are running");
            slot.steps += 1;
            slot.largest_batch = slot.largest_batch.max(plan.len());
            if let Work::Prefill { offset, len, last } = s.work {
                saved.push(Saved {
                    id: s.id,
                    seq: slot.seq.expect("admitted sequences have one"),
                    computed: offset + len,
                    prompt_len: slot.prompt_len,
                    last,
                });
            }
        }
        let observed = on_logits.is_some();
        let items: Vec<StepItem<'_>> = plan
            .iter()
            .zip(&toks)
            .map(|(s, tok)| {
                let slot = &self.slots[&s.id];
                let seq = slot.seq.expect("admitted sequences have one");
                let sampled = match slot.sampler.cut() {
                    Some(cut) if !observed => Logits::Cut(cut),
                    _ => Logits::Last,
                };
                match s.work {
                    Work::Prefill { offset, len, last } => StepItem::prefill(
                        seq,
                        &slot.history[offset..offset + len],
                        if last { sampled } else { Logits::None },
                    ),
                    Work::Decode => StepItem { logits: sampled, ..StepItem::decode(seq, tok) },
                }
            })
            .collect();
        let decoding = plan.iter().filter(|s| s.work == Work::Decode).count();
        let prompt: usize = plan.iter().map(|s| s.work.tokens()).sum::<usize>() - decoding;
        self.last_step = Some((std::time::Instant::now(), decoding, prompt));
        let stepped =
            engine.step_observed(&items, &mut |l, kv| connector.save_layer(l, kv, &saved));
        drop(items);
        let logits = match stepped {
            Ok(l) => l,
            Err(e) => {
                let error = e;
                for s in plan {
                    out.extend(self.leave(engine, connector, s.id, End::Failed(error.clone())));
                }
                return Err(StepFailed { error, outputs: out });
            }
        };
        let mut ends = Vec::new();
        for (k, s) in plan.iter().enumerate() {
            let (row, cut) = (logits.last_of(k), logits.candidates_of(k));
            let pick = match (cut, row) {
                (Some(c), _) => Pick::Candidates(c),
                (None, Some(row)) => Pick::Sample(row),
                (None, None) => continue,
            };
            let slot = self.slots.get_mut(&s.id).expect("planned sequences are running");
            if let (Some(f), Some(row)) = (on_logits.as_mut(), row) {
                f(s.id, row);
            }
            if let Some(t) = slot.replay.pop_front() {
                // A resumed token: fed, not sampled (it was sampled before the move).
                slot.next = Some(t);
                continue;
            }
            let sampled = match pick {
                // Cut on the device: the token the whole row would have given.
                Pick::Candidates(c) => (slot.sampler.sample_candidates(c), None),
                Pick::Sample(row) => slot.sampler.sample(row, &slot.history, slot.prompt_len),
            };
            match slot.role {
                Role::Prefill => ends.push((
                    s.id,
                    End::Prefilled {
                        first_token: sampled.0,
                        rng_position: slot.sampler.rng_position(),
                        logprobs: sampled.1,
                    },
                )),
                Role::Generate => {
                    if let Some(end) = accept(&self.model, ctx, slot, sampled, s.id, &mut out) {
                        ends.push((s.id, end));
                    }
                }
            }
        }
        connector.save(&engine.kv_view(), &saved);
        // What the step's windows moved past is read by no one now.
        if connector.lets_window_go() {
            for s in plan {
                if let Some(seq) = self.slots.get(&s.id).and_then(|slot| slot.seq) {
                    engine.release_window(seq).expect("the runner's sequences exist");
                }
            }
        }
        // Prompts completed in this step go under their policies now, before their first
        // decode step.
        for s in plan {
            let Some(slot) = self.slots.get(&s.id) else { continue };
            if matches!(s.work, Work::Prefill { last: true, .. }) && slot.role == Role::Generate {
                let seq = slot.seq.expect("admitted sequences have one");
                if let Err(e) = engine.set_kv_policy(seq, slot.params.kv_policy) {
                    ends.push((s.id, End::Failed(e)));
                }
            }
        }
        for (id, end) in ends {
            out.extend(self.leave(engine, connector, id, end));
        }
        Ok(out)
    }

    /// Takes a sequence out of the runner: its remaining text, then its end.
    fn leave(
        &mut self,
        engine: &mut Engine,
        connector: &mut dyn KvConnector,
        id: u64,
        end: End,
    ) -> Vec<Output> {
        let Some(mut slot) = self.slots.remove(&id) else { return Vec::new() };
        self.sched.remove(id);
        self.waiting.retain(|&w| w != id);
        if slot.admitted && self.promise_blocks {
            self.promised -= slot.promised;
        }
        let mut out = Vec::new();
        if let (End::Finished { reason, .. }, Some(text)) = (&end, &mut slot.text) {
            let tail = text.finish();
            if !tail.is_empty() {
                // A sequence that ended by its own rule sends the tokens its text held back
                // with their mark (and logprob reports), or the last token's report would
                // never leave the node. A cancelled one (a client gone, a preemption, a move)
                // is not their end: the stream, if it goes on, goes on from the last mark,
                // and those tokens are generated again there.
                let mark = (*reason != FinishReason::Cancelled).then(|| Mark {
                    tokens: std::mem::take(&mut slot.unmarked),
                    rng_position: slot.sampler.rng_position(),
                    logprobs: std::mem::take(&mut slot.unmarked_logprobs),
                });
                out.push(Output { id, event: Event::Delta(tail, mark) });
            }
        }
        let evicted = slot.seq.and_then(|seq| engine.evicted_tokens(seq).ok()).unwrap_or(0);
        let kept = slot.seq.and_then(|seq| match connector.finished(id, seq, &engine.kv_view()) {
            Release::Free => {
                engine.free_sequence(seq).expect("the runner's sequences exist");
                None
            }
            Release::Keep => Some(seq),
        });
        let event = Event::Done {
            end,
            generated: slot.generated,
            steps: slot.steps,
            largest_batch: slot.largest_batch,
            kept,
            evicted,
        };
        out.push(Output { id, event });
        out
    }
}

/// Takes a sampled token into a generating sequence: emits its output and says whether a
/// finish rule ends the sequence. The one set of finish rules, for every role that generates.
fn accept(
    model: &Model,
    ctx: usize,
    s: &mut Slot,
    (tok, logprobs): (u32, Option<TokenLogprobs>),
    id: u64,
    out: &mut Vec<Output>,
) -> Option<End> {
    let stop = |reason| Some(End::Finished { reason, stop_token: Some(tok) });
    if !s.params.ignore_eos && model.tokenizer.is_eog(tok) {
        return stop(FinishReason::Eos);
    }
    if s.params.stop_tokens.contains(&tok) {
        return stop(FinishReason::Stop);
    }
    s.generated += 1;
    s.history.push(tok);
    s.unmarked.push(tok);
    s.unmarked_logprobs.extend(logprobs);
    let mut delta = |s: &mut Slot, piece: Piece| {
        let mark = Mark {
            tokens: std::mem::take(&mut s.unmarked),
            rng_position: s.sampler.rng_position(),
            logprobs: std::mem::take(&mut s.unmarked_logprobs),
        };
        out.push(Output { id, event: Event::Delta(piece, Some(mark)) });
    };
    let piece = match &mut s.text {
        Some(text) => match text.push(&model.tokenizer, tok) {
            Pushed::Stopped(piece) => {
                if !piece.is_empty() {
                    delta(s, piece);
                }
                return Some(End::Finished { reason: FinishReason::Stop, stop_token: None });
            }
            Pushed::Text(piece) => piece,
        },
        None => Piece { text: String::new(), tokens: vec![tok] },
    };
    if !piece.is_empty() {
        delta(s, piece);
    }
    let finished = |reason| Some(End::Finished { reason, stop_token: None });
    if s.generated >= s.params.max_tokens {
        return finished(FinishReason::Length);
    }
    if s.history.len() >= ctx {
        return finished(FinishReason::ContextFull);
    }
    s.next = Some(tok);
    None
}

mod admission;

#[cfg(test)]
mod tests;
