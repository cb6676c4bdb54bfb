//! The prefill node's state, free of gRPC and tokio: the batch runner in its prefill role
//! (stop at the first token) with the push connector, which loads each prompt's cached prefix
//! and hands its KV to its transfer as it is computed. Prompts wait until the KV pool can hold
//! them, then run as chunks under the step's token budget (many prompts per step). A prompt
//! whose caller goes away is dropped and its blocks freed.

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use pdmesh_common::convert::ms;
use pdmesh_engine::{
    BatchRunner, End, Engine, Event as RunEvent, GenerateParams, Output as RunOutput,
    SamplingParams, SeqKind, SeqSpec, Work,
};
use pdmesh_kv_transfer::{Export, KvPiece, PushConnector, PushJob, PushMode};
use tokio::sync::mpsc;
use tracing::Span;

use crate::error::PrefillError;

/// How a prompt ends: its first token (the KV having gone to the transfer), or a failure.
#[derive(Debug, Clone)]
pub enum Done {
    Computed {
        first_token: u32,
        rng_position: u128,
        /// The first token's logprob report, when asked for.
        logprobs: Option<pdmesh_engine::TokenLogprobs>,
        queue_ms: f64,
        prefill_ms: f64,
        blocks: u32,
        export: Export,
    },
    Failed(PrefillError),
}

/// Where a prompt's end goes. `send` returns false when the receiver is gone.
pub trait DoneOutput: Send {
    fn send(&mut self, done: Done) -> bool;
    fn is_closed(&self) -> bool;
}

impl DoneOutput for mpsc::Sender<Done> {
    fn send(&mut self, done: Done) -> bool {
        self.try_send(done).is_ok()
    }
    fn is_closed(&self) -> bool {
        mpsc::Sender::is_closed(self)
    }
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
    done: Box<dyn DoneOutput>,
    blocks: usize,
    /// Prompt tokens to compute: those not read from the prefix cache.
    to_compute: usize,
    submitted: Instant,
    started: Option<Instant>,
    span: Span,
    /// `prefill.queue_wait` until the first chunk runs.
    waiting: Span,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub queued: u32,
    pub prefilling: u32,
    /// Prompt tokens queued or computing, not computed yet (see `Active::to_compute`).
    pub backlog_tokens: u64,
    pub free_blocks: u32,
    pub total_blocks: u32,
    pub completed: u64,
    pub cancelled: u64,
    pub failed: u64,
}

pub struct PrefillCore {
    engine: Engine,
    runner: BatchRunner,
    push: PushConnector,
    jobs: HashMap<u64, Active>,
    max_queued: usize,
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
        // A prompt is admitted only once the pool can hold all of its blocks.
        let runner = BatchRunner::new(&engine, max_running, true);
        let push = PushConnector::new(&engine, blocks_per_message);
        Self {
            engine,
            runner,
            push,
            jobs: HashMap::new(),
            max_queued,
            next_id: 1,
            counts: Counts::default(),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Room a prompt of `prompt_len` tokens needs for its pieces (see `submit`).
    pub fn piece_capacity(&self, prompt_len: usize) -> usize {
        self.push.piece_capacity(prompt_len)
    }

    /// Queues a prompt: its KV goes to `pieces` (of `piece_capacity`), its end to `done`.
    /// Checked here so a bad job never reaches a step.
    pub fn submit(
        &mut self,
        job: Job,
        pieces: mpsc::Sender<KvPiece>,
        done: Box<dyn DoneOutput>,
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
        let block_size = self.engine.config().block_size;
        let blocks = job.prompt.len().div_ceil(block_size);
        let total = self.engine.kv().total_blocks();
        if blocks > total {
            return Err(PrefillError::TooLong { need: blocks, total });
        }
        if self.runner.waiting() >= self.max_queued {
            return Err(PrefillError::QueueFull(self.runner.waiting()));
        }
        let id = self.next_id;
        let to_compute = job.prompt.len().saturating_sub(job.cached.len() * block_size);
        let push = PushJob {
            mode: job.push,
            checksums: job.checksums,
            cached: job.cached,
            publish: job.publish,
            pieces,
        };
        let bpb = self.engine.kv().geometry().bytes_per_block();
        self.push
            .add(id, job.prompt.len(), push, bpb)
            .map_err(|e| PrefillError::Invalid(e.to_string()))?;
        let spec = SeqSpec {
            prompt: job.prompt,
            params: GenerateParams { sampling: job.sampling, max_tokens: 1, ..Default::default() },
            rng_position: job.rng_position,
            seq: None,
            kind: SeqKind::Prefill,
        };
        if let Err(e) = self.runner.add(&mut self.engine, &mut self.push, id, spec) {
            self.push.remove(id);
            return Err(e.into());
        }
        self.next_id += 1;
        let waiting = tracing::info_span!(parent: &job.span, "prefill.queue_wait");
        let active = Active {
            done,
            blocks,
            to_compute,
            submitted: now,
            started: None,
            span: job.span,
            waiting,
        };
        self.jobs.insert(id, active);
        Ok(id)
    }

    /// Drops prompts whose caller went away.
    pub fn sweep(&mut self) {
        let gone: Vec<u64> =
            self.jobs.iter().filter(|(_, a)| a.done.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            self.runner.cancel(&mut self.engine, &mut self.push, id);
            self.push.remove(id);
            self.jobs.remove(&id);
            self.counts.cancelled += 1;
        }
    }

    pub fn has_work(&mut self) -> bool {
        self.runner.has_work(&mut self.engine, &mut self.push)
    }

    /// One engine step over the scheduled chunks; the connector ships completed blocks, and
    /// finished prompts report their first token.
    pub fn step(&mut self, now: Instant) {
        let plan = self.runner.plan(&mut self.engine, &mut self.push);
        tracing::debug!(?plan, "prefill step");
        let mut chunk_spans = Vec::with_capacity(plan.len());
        for s in &plan {
            let Some(a) = self.jobs.get_mut(&s.id) else { continue };
            a.started.get_or_insert(now);
            a.waiting = Span::none();
            if let Work::Prefill { offset, len, last } = s.work {
                chunk_spans.push(tracing::info_span!(
                    parent: &a.span,
                    "prefill.compute",
                    offset = offset as i64,
                    tokens = len as i64,
                    last,
                    batch_prompts = plan.len() as i64,
                ));
            }
        }
        let outputs = match self.runner.run(&plan, &mut self.engine, &mut self.push, None) {
            Ok(o) => o,
            Err(f) => {
                tracing::error!("prefill step failed: {}", f.error);
                f.outputs
            }
        };
        drop(chunk_spans);
        self.deliver(outputs, Instant::now());
    }

    fn deliver(&mut self, outputs: Vec<RunOutput>, done_at: Instant) {
        for o in outputs {
            let RunEvent::Done { end, .. } = o.event else { continue };
            let Some(mut a) = self.jobs.remove(&o.id) else { continue };
            let export = self.push.take_export(o.id).unwrap_or_default();
            let done = match end {
                End::Prefilled { first_token, rng_position, logprobs } => {
                    let started = a.started.unwrap_or(done_at);
                    Done::Computed {
                        first_token,
                        rng_position,
                        logprobs,
                        queue_ms: ms(started - a.submitted),
                        prefill_ms: ms(done_at - started),
                        blocks: a.blocks as u32,
                        export,
                    }
                }
                End::Failed(e) => Done::Failed(e.into()),
                End::Finished { .. } => unreachable!("prefill sequences end at their first token"),
            };
            let computed = matches!(done, Done::Computed { .. });
            match (computed, a.done.send(done)) {
                (true, true) => self.counts.completed += 1,
                (true, false) => self.counts.cancelled += 1,
                (false, _) => self.counts.failed += 1,
            }
        }
    }

    pub fn counts(&self) -> Counts {
        let mut c = self.counts;
        c.queued = 0;
        c.prefilling = 0;
        c.backlog_tokens = 0;
        for a in self.jobs.values() {
            c.backlog_tokens += a.to_compute as u64;
            if a.started.is_none() {
                c.queued += 1;
            } else {
                c.prefilling += 1;
            }
        }
        c.free_blocks = self.engine.kv().free_blocks() as u32;
        c.total_blocks = self.engine.kv().total_blocks() as u32;
        c
    }
}
