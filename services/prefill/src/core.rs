//! The prefill node's engine loop, free of gRPC and tokio: prompts wait in a queue until the KV
//! pool can hold them, then run as chunks under the step's token budget (chunked prefill, many
//! prompts per step). After each step the blocks each prompt completed are copied out for the
//! transport, and the last chunk's logits give the first token. A prompt whose output closes is
//! dropped and its blocks freed.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use pdmesh_engine::{
    Engine, Logits, Model, Sampler, SamplingParams, Scheduler, SeqId, StepItem, Work,
};
use pdmesh_kv_transfer::KvPiece;

use pdmesh_common::convert::ms;
use tracing::Span;

use crate::error::PrefillError;

/// When a prompt's KV is handed to the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
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

/// What a prompt produces, in order: KV pieces (as they are computed), then `Computed`.
#[derive(Debug, Clone)]
pub enum Out {
    Blocks(KvPiece),
    Computed {
        first_token: u32,
        rng_position: u128,
        queue_ms: f64,
        prefill_ms: f64,
        blocks: u32,
        /// Verify mode: each block's checksum; else empty.
        checksums: Vec<u64>,
        /// Prompt tokens whose KV came from the cache.
        cached_tokens: u32,
        /// With `publish`: the full blocks computed here (after the cached ones), in order.
        computed_blocks: Vec<Bytes>,
    },
    Failed(PrefillError),
}

pub trait JobOutput: Send {
    /// Returns false when the receiver is gone.
    fn send(&mut self, out: Out) -> bool;
    fn is_closed(&self) -> bool;
}

#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub rng_position: u128,
    pub push: PushMode,
    /// Compute each block's checksum for the receiver to verify.
    pub checksums: bool,
    /// The prompt's first blocks, already computed (from the prefix cache): written into the
    /// sequence instead of computed. Whole blocks, fewer than the prompt fills.
    pub cached: Vec<Bytes>,
    /// Return the full blocks this job computed (for publishing to the prefix cache).
    pub publish: bool,
    /// The request's span: queueing and compute chunks are traced under it.
    pub span: Span,
}

struct Active {
    job: Job,
    out: Box<dyn JobOutput>,
    seq: Option<SeqId>,
    blocks: usize,
    cached_blocks: usize,
    sent_blocks: usize,
    checksums: Vec<u64>,
    submitted: Instant,
    started: Option<Instant>,
    /// `prefill.queue_wait` until the first chunk runs.
    waiting: Span,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub queued: u32,
    pub prefilling: u32,
    pub free_blocks: u32,
    pub total_blocks: u32,
    pub completed: u64,
    pub cancelled: u64,
    pub failed: u64,
}

pub struct PrefillCore {
    engine: Engine,
    model: Arc<Model>,
    sched: Scheduler,
    waiting: VecDeque<u64>,
    jobs: HashMap<u64, Active>,
    promised: usize,
    max_queued: usize,
    blocks_per_message: usize,
    next_id: u64,
    counts: Counts,
}

impl std::fmt::Debug for PrefillCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillCore").field("jobs", &self.jobs.len()).finish()
    }
}

impl PrefillCore {
    pub fn new(
        engine: Engine,
        max_running: usize,
        max_queued: usize,
        blocks_per_message: usize,
    ) -> Self {
        let model = Arc::clone(engine.model());
        let sched = Scheduler::new(engine.config().max_batch_tokens, max_running);
        Self {
            engine,
            model,
            sched,
            waiting: VecDeque::new(),
            jobs: HashMap::new(),
            promised: 0,
            max_queued,
            blocks_per_message: blocks_per_message.max(1),
            next_id: 1,
            counts: Counts::default(),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Queues a prompt. Checked here so a bad job never reaches a step.
    pub fn submit(
        &mut self,
        job: Job,
        out: Box<dyn JobOutput>,
        now: Instant,
    ) -> Result<u64, PrefillError> {
        let ctx = self.engine.max_seq_len();
        if job.prompt.is_empty() {
            return Err(PrefillError::Invalid("prompt is empty".into()));
        }
        if job.prompt.len() >= ctx {
            return Err(PrefillError::Invalid(format!(
                "prompt of {} tokens leaves no room in the context of {ctx}",
                job.prompt.len()
            )));
        }
        let vocab = self.model.tokenizer.vocab_size() as u32;
        if let Some(t) = job.prompt.iter().find(|&&t| t >= vocab) {
            return Err(PrefillError::Invalid(format!("token id {t} is outside the vocabulary")));
        }
        // Checked now so the first token's sampler cannot fail later.
        Sampler::resume(job.sampling.clone(), job.rng_position)?;
        let bs = self.engine.config().block_size;
        let bpb = self.engine.kv().geometry().bytes_per_block();
        if job.cached.len() * bs >= job.prompt.len() {
            return Err(PrefillError::Invalid(format!(
                "{} cached blocks leave nothing of a {}-token prompt to compute",
                job.cached.len(),
                job.prompt.len()
            )));
        }
        if let Some((i, b)) = job.cached.iter().enumerate().find(|(_, b)| b.len() != bpb) {
            return Err(PrefillError::Invalid(format!(
                "cached block {i} has {} bytes, a block is {bpb}",
                b.len()
            )));
        }
        let blocks = job.prompt.len().div_ceil(bs);
        let total = self.engine.kv().total_blocks();
        if blocks > total {
            return Err(PrefillError::TooLong { need: blocks, total });
        }
        if self.waiting.len() >= self.max_queued {
            return Err(PrefillError::QueueFull(self.waiting.len()));
        }
        let id = self.next_id;
        self.next_id += 1;
        let waiting = tracing::info_span!(parent: &job.span, "prefill.queue_wait");
        self.jobs.insert(
            id,
            Active {
                job,
                out,
                seq: None,
                blocks,
                cached_blocks: 0,
                sent_blocks: 0,
                checksums: Vec::new(),
                submitted: now,
                started: None,
                waiting,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Moves waiting prompts to the scheduler while the pool can hold all of their blocks.
    fn admit(&mut self) {
        let total = self.engine.kv().total_blocks();
        while let Some(&id) = self.waiting.front() {
            let a = &self.jobs[&id];
            if self.promised + a.blocks > total {
                break;
            }
            self.waiting.pop_front();
            self.promised += a.blocks;
            let len = a.job.prompt.len();
            let seq = self.engine.create_sequence();
            let a = self.jobs.get_mut(&id).expect("waiting jobs exist");
            a.seq = Some(seq);
            let cached = std::mem::take(&mut a.job.cached);
            let done = cached.len() * self.engine.config().block_size;
            // The pool has room (checked above) and the blocks' sizes were checked at submit.
            let written = self.engine.extend_sequence(seq, done).and_then(|()| {
                cached.iter().enumerate().try_for_each(|(i, b)| self.engine.write_block(seq, i, b))
            });
            if let Err(e) = written {
                let a = self.jobs.get_mut(&id).expect("waiting jobs exist");
                a.out.send(Out::Failed(PrefillError::from(e)));
                self.counts.failed += 1;
                self.drop_job(id);
                continue;
            }
            self.jobs.get_mut(&id).expect("waiting jobs exist").cached_blocks = cached.len();
            self.sched.add_from(id, len, done).expect("ids are unique and prompts non-empty");
        }
    }

    fn drop_job(&mut self, id: u64) {
        if let Some(a) = self.jobs.remove(&id) {
            self.waiting.retain(|&w| w != id);
            self.sched.remove(id);
            if let Some(seq) = a.seq {
                self.promised -= a.blocks;
                self.engine.free_sequence(seq).expect("a job's sequence exists");
            }
        }
    }

    /// Drops prompts whose receiver went away.
    pub fn sweep(&mut self) {
        let gone: Vec<u64> =
            self.jobs.iter().filter(|(_, a)| a.out.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            self.counts.cancelled += 1;
            self.drop_job(id);
        }
    }

    pub fn has_work(&mut self) -> bool {
        self.admit();
        !self.sched.is_empty()
    }

    /// One engine step over the scheduled chunks; ships completed blocks and first tokens.
    pub fn step(&mut self, now: Instant) {
        self.admit();
        let plan = self.sched.plan();
        tracing::debug!(?plan, "prefill step");
        if plan.is_empty() {
            return;
        }
        let mut chunk_spans = Vec::with_capacity(plan.len());
        for s in &plan {
            let a = self.jobs.get_mut(&s.id).expect("scheduled jobs exist");
            a.started.get_or_insert(now);
            a.waiting = Span::none();
            if let Work::Prefill { offset, len, last } = s.work {
                chunk_spans.push(tracing::info_span!(
                    parent: &a.job.span,
                    "prefill.compute",
                    offset = offset as i64,
                    tokens = len as i64,
                    last,
                    batch_prompts = plan.len() as i64,
                ));
            }
        }
        let bs = self.engine.config().block_size;
        // The chunks' tokens are copied so the layer callback can reach the jobs' outputs
        // while the engine runs; and what each job ships after this step is fixed up front.
        let mut chunks = Vec::with_capacity(plan.len());
        let mut layered = Vec::new();
        for s in &plan {
            let a = &self.jobs[&s.id];
            let Work::Prefill { offset, len, last } = s.work else {
                unreachable!(
                    "prefill jobs never decode: they leave the scheduler at their last chunk"
                )
            };
            let seq = a.seq.expect("scheduled jobs have sequences");
            chunks.push((
                seq,
                a.job.prompt[offset..offset + len].to_vec(),
                if last { Logits::Last } else { Logits::None },
            ));
            let ready = ready_blocks(a, offset + len, last, bs);
            if a.job.push == PushMode::Layer && ready > a.sent_blocks {
                layered.push((s.id, seq, a.sent_blocks, ready));
            }
        }
        let items: Vec<StepItem<'_>> =
            chunks.iter().map(|(seq, t, l)| StepItem::prefill(*seq, t, *l)).collect();
        let jobs = &mut self.jobs;
        let result = self.engine.step_observed(&items, &mut |layer, kv| {
            for &(id, seq, from, to) in &layered {
                let mut buf = Vec::new();
                for i in from..to {
                    kv.read_block_layer(seq, i, layer, &mut buf)
                        .expect("blocks of a live sequence");
                }
                if let Some(a) = jobs.get_mut(&id) {
                    let piece = KvPiece {
                        first_block: from as u32,
                        layer: Some(layer as u32),
                        data: buf.into(),
                    };
                    // A closed output is noticed after the step.
                    a.out.send(Out::Blocks(piece));
                }
            }
        });
        let rows: Result<Vec<Option<Vec<f32>>>, _> =
            result.map(|l| (0..plan.len()).map(|k| l.last_of(k).map(<[f32]>::to_vec)).collect());
        drop(items);
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                let e = PrefillError::from(e);
                tracing::error!("prefill step failed: {e}");
                for s in &plan {
                    if let Some(a) = self.jobs.get_mut(&s.id) {
                        a.out.send(Out::Failed(e.clone()));
                    }
                    self.counts.failed += 1;
                    self.drop_job(s.id);
                }
                return;
            }
        };
        let done_at = Instant::now();
        drop(chunk_spans);
        let mut finished = Vec::new();
        for (s, row) in plan.iter().zip(rows) {
            let Work::Prefill { offset, len, last } = s.work else { continue };
            let a = self.jobs.get_mut(&s.id).expect("scheduled jobs exist");
            let seq = a.seq.expect("scheduled jobs have sequences");
            let ready = ready_blocks(a, offset + len, last, bs);
            if a.job.checksums {
                let mut buf = Vec::new();
                for i in a.sent_blocks..ready {
                    buf.clear();
                    self.engine.read_block(seq, i, &mut buf).expect("blocks of a live sequence");
                    a.checksums.push(pdmesh_kv_transfer::block_checksum(&buf));
                }
            }
            let mut ok = !a.out.is_closed();
            if a.job.push == PushMode::Layer {
                a.sent_blocks = ready;
            }
            while ok && a.sent_blocks < ready {
                let n = (ready - a.sent_blocks).min(self.blocks_per_message);
                let mut buf = Vec::new();
                for i in a.sent_blocks..a.sent_blocks + n {
                    self.engine.read_block(seq, i, &mut buf).expect("blocks of a live sequence");
                }
                let piece =
                    KvPiece { first_block: a.sent_blocks as u32, layer: None, data: buf.into() };
                ok = a.out.send(Out::Blocks(piece));
                a.sent_blocks += n;
            }
            if let (true, Some(row)) = (ok && last, row) {
                let mut sampler = Sampler::resume(a.job.sampling.clone(), a.job.rng_position)
                    .expect("checked at submit");
                let mut computed_blocks = Vec::new();
                if a.job.publish {
                    for i in a.cached_blocks..a.job.prompt.len() / bs {
                        let mut buf = Vec::new();
                        self.engine
                            .read_block(seq, i, &mut buf)
                            .expect("blocks of a live sequence");
                        computed_blocks.push(Bytes::from(buf));
                    }
                }
                let first_token = sampler.sample(&row, &a.job.prompt);
                let started = a.started.unwrap_or(now);
                a.out.send(Out::Computed {
                    first_token,
                    rng_position: sampler.rng_position(),
                    queue_ms: ms(started - a.submitted),
                    prefill_ms: ms(done_at - started),
                    blocks: a.blocks as u32,
                    checksums: std::mem::take(&mut a.checksums),
                    cached_tokens: (a.cached_blocks * bs) as u32,
                    computed_blocks,
                });
                self.counts.completed += 1;
                finished.push(s.id);
            } else if !ok {
                self.counts.cancelled += 1;
                finished.push(s.id);
            }
        }
        for id in finished {
            self.drop_job(id);
        }
    }

    pub fn counts(&self) -> Counts {
        let mut c = self.counts;
        c.queued = self.jobs.values().filter(|a| a.started.is_none()).count() as u32;
        c.prefilling = self.jobs.len() as u32 - c.queued;
        c.free_blocks = self.engine.kv().free_blocks() as u32;
        c.total_blocks = self.engine.kv().total_blocks() as u32;
        c
    }
}

/// Blocks of a job that can be shipped once its prompt is computed up to `done` tokens: the
/// full blocks (none before the end in `prompt` mode), and on the last chunk the tail block.
fn ready_blocks(a: &Active, done: usize, last: bool, block_size: usize) -> usize {
    if last {
        a.blocks
    } else if a.job.push == PushMode::Prompt {
        a.sent_blocks
    } else {
        done / block_size
    }
}
