//! The decode node's state, free of gRPC and tokio: KV reservations under leases, KV arriving
//! block by block, requests attached to their reservations, and continuous batching over all of
//! them with the engine's step API. The worker thread drives it; unit tests drive it directly.
//!
//! Blocks are promised at reservation (prompt + max_tokens) so a running request never runs
//! out of KV mid-stream; the engine allocates them as the prompt's KV arrives and tokens are
//! generated. Every exit path (finish, cancel, failure, lease expiry) frees the sequence.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_engine::{
    Engine, FinishReason, Logits, Model, Sampler, SamplingParams, Scheduler, SeqId, StepItem, Work,
};

use pdmesh_common::convert::{finish_reason, ms};
use tracing::Span;
use tracing::field::Empty;

use crate::error::DecodeError;
use crate::text::{Piece, Pushed, TextStream};

/// Where a request's output goes. `send` returns false when the receiver is gone.
pub trait Output: Send {
    fn send(&mut self, event: Event) -> bool;
    fn is_closed(&self) -> bool;
}

#[derive(Debug, Clone)]
pub enum Event {
    Delta(Piece),
    Finished { reason: FinishReason, completion_tokens: u32, queue_ms: f64, prefill_ms: f64 },
    Failed(DecodeError),
}

/// How an attached request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The prefill node sampled this first token; the KV comes (or came) over a transport.
    FirstToken(u32),
    /// Compute the prompt here.
    Local,
}

/// Everything needed to run a reserved request.
#[derive(Debug, Clone)]
pub struct Attach {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub rng_position: u128,
    pub max_tokens: usize,
    pub stops: Vec<String>,
    pub ignore_eos: bool,
    pub start: Start,
    /// The request's span: waiting and batching are traced under it.
    pub span: Span,
}

/// Phase counts and totals, for stats and heartbeats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub reserved: u32,
    pub transferring: u32,
    pub queued: u32,
    pub prefilling: u32,
    pub decoding: u32,
    pub committed_blocks: u32,
    /// Ended reservations whose blocks wait for their remote writer to close.
    pub quarantined: u32,
    pub free_blocks: u32,
    pub total_blocks: u32,
    pub completed: u64,
    pub cancelled: u64,
    pub failed: u64,
    pub leases_expired: u64,
}

struct Running {
    sampler: Sampler,
    history: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    text: TextStream,
    out: Box<dyn Output>,
    generated: usize,
    next: Option<u32>,
    local: bool,
    attached_at: Instant,
    prefill_started: Option<Instant>,
    prefill_ms: f64,
    queue_ms: f64,
    /// `decode.queue_wait` from attach to the first step (the KV's arrival included), then
    /// `decode.batch` until the request leaves the batch.
    phase: Span,
    span: Span,
    steps: u32,
    largest_batch: usize,
}

struct Reservation {
    seq: SeqId,
    prompt_len: usize,
    committed: usize,
    /// Freed at this instant unless a transfer has begun or a local prefill is attached.
    lease: Option<Instant>,
    /// Prompt blocks written so far (remote KV), and whether the sender said it is complete.
    kv_started: bool,
    kv_blocks: usize,
    kv_complete: bool,
    /// The prompt's blocks were allocated at reservation (their addresses went out).
    preallocated: bool,
    /// A remote writer (a UCX session) may still put into the blocks.
    writer: bool,
    run: Option<Running>,
    scheduled: bool,
}

/// A new reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub id: u64,
    /// Blocks the prompt's KV fills.
    pub prompt_blocks: usize,
    pub lease: Duration,
    /// Pool blocks of the prompt, in order, when they were allocated at reservation.
    pub pool_blocks: Vec<u32>,
}

pub struct DecodeCore {
    engine: Engine,
    model: Arc<Model>,
    sched: Scheduler,
    reservations: HashMap<u64, Reservation>,
    next_id: u64,
    committed: usize,
    default_lease: Duration,
    max_lease: Duration,
    counts: Counts,
    /// Sequences of ended reservations whose remote writer had not closed yet: their blocks
    /// are reused only when it has (a late put must not land in another request's KV).
    quarantine: HashMap<u64, (SeqId, usize)>,
}

impl std::fmt::Debug for DecodeCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeCore").field("reservations", &self.reservations.len()).finish()
    }
}

impl DecodeCore {
    pub fn new(
        engine: Engine,
        max_running: usize,
        default_lease: Duration,
        max_lease: Duration,
    ) -> Self {
        let model = Arc::clone(engine.model());
        let sched = Scheduler::new(engine.config().max_batch_tokens, max_running);
        Self {
            engine,
            model,
            sched,
            reservations: HashMap::new(),
            next_id: 1,
            committed: 0,
            default_lease,
            max_lease,
            counts: Counts::default(),
            quarantine: HashMap::new(),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.engine.config().block_size)
    }

    /// Promises blocks for a prompt of `prompt_len` tokens plus `max_tokens` more. With
    /// `remote_kv` the prompt's blocks are allocated now, so a transport can write them in
    /// place.
    pub fn reserve(
        &mut self,
        prompt_len: usize,
        max_tokens: usize,
        lease: Option<Duration>,
        remote_kv: bool,
        now: Instant,
    ) -> Result<Reserved, DecodeError> {
        let ctx = self.engine.max_seq_len();
        if prompt_len == 0 {
            return Err(DecodeError::Invalid("prompt_tokens must be at least 1".into()));
        }
        if max_tokens == 0 {
            return Err(DecodeError::Invalid("max_tokens must be at least 1".into()));
        }
        if prompt_len + max_tokens > ctx {
            return Err(DecodeError::Invalid(format!(
                "prompt_tokens {prompt_len} + max_tokens {max_tokens} exceed the context of {ctx}"
            )));
        }
        let need = self.blocks_for(prompt_len + max_tokens);
        let total = self.engine.kv().total_blocks();
        if self.committed + need > total {
            return Err(DecodeError::NoBlocks { need, free: total - self.committed });
        }
        let lease = lease.unwrap_or(self.default_lease).min(self.max_lease);
        let id = self.next_id;
        self.next_id += 1;
        let seq = self.engine.create_sequence();
        let mut pool_blocks = Vec::new();
        if remote_kv {
            let grown = self.engine.extend_sequence(seq, prompt_len).and_then(|()| {
                (0..self.blocks_for(prompt_len)).map(|i| self.engine.pool_block(seq, i)).collect()
            });
            match grown {
                Ok(b) => pool_blocks = b,
                Err(e) => {
                    self.engine.free_sequence(seq).expect("just created");
                    return Err(e.into());
                }
            }
        }
        self.committed += need;
        self.reservations.insert(
            id,
            Reservation {
                seq,
                prompt_len,
                committed: need,
                lease: Some(now + lease),
                kv_started: false,
                kv_blocks: 0,
                kv_complete: false,
                preallocated: remote_kv,
                writer: false,
                run: None,
                scheduled: false,
            },
        );
        Ok(Reserved { id, prompt_blocks: self.blocks_for(prompt_len), lease, pool_blocks })
    }

    fn get(&mut self, id: u64) -> Result<&mut Reservation, DecodeError> {
        self.reservations.get_mut(&id).ok_or(DecodeError::UnknownReservation(id))
    }

    /// A transfer into the reservation starts: its prompt's blocks are allocated (if they
    /// were not at reservation). A `writer` puts into them directly (UCX) and needs them
    /// preallocated; until `writer_closed` they are never reused.
    pub fn kv_begin(&mut self, id: u64, writer: bool) -> Result<(), DecodeError> {
        let r = self.reservations.get(&id).ok_or(DecodeError::UnknownReservation(id))?;
        if r.kv_started {
            return Err(DecodeError::Invalid(format!("reservation {id} already receives KV")));
        }
        if matches!(r.run.as_ref(), Some(run) if run.local) {
            return Err(DecodeError::Invalid(format!("reservation {id} prefills locally")));
        }
        if writer && !r.preallocated {
            return Err(DecodeError::Invalid(format!(
                "reservation {id} was made without remote_kv; its blocks have no addresses"
            )));
        }
        let (seq, n) = (r.seq, r.prompt_len);
        if !r.preallocated {
            self.engine.extend_sequence(seq, n).map_err(DecodeError::from)?;
        }
        let r = self.get(id)?;
        r.kv_started = true;
        r.writer = writer;
        // From here the open transfer keeps the reservation: its end without the KV aborts
        // it, and the router's deadline bounds it. A lease would expire prompts that merely
        // wait in a busy prefill node's queue with their stream already open.
        r.lease = None;
        Ok(())
    }

    /// Writes whole prompt blocks starting at `first_block`.
    pub fn kv_write(
        &mut self,
        id: u64,
        first_block: usize,
        data: &[u8],
    ) -> Result<(), DecodeError> {
        let bpb = self.engine.kv().geometry().bytes_per_block();
        let r = self.reservations.get(&id).ok_or(DecodeError::UnknownReservation(id))?;
        if !r.kv_started || r.kv_complete || r.writer {
            return Err(DecodeError::Invalid(format!("reservation {id} is not receiving KV")));
        }
        if data.is_empty() || !data.len().is_multiple_of(bpb) {
            return Err(DecodeError::Invalid(format!(
                "KV data of {} bytes is not whole blocks of {bpb}",
                data.len()
            )));
        }
        let n = data.len() / bpb;
        let blocks = self.blocks_for(r.prompt_len);
        if first_block + n > blocks {
            return Err(DecodeError::Invalid(format!(
                "KV blocks {first_block}..{} are past the prompt's {blocks} blocks",
                first_block + n
            )));
        }
        if first_block != r.kv_blocks {
            return Err(DecodeError::Invalid(format!(
                "KV block {first_block} arrived, expected {}",
                r.kv_blocks
            )));
        }
        let seq = r.seq;
        for (i, chunk) in data.chunks_exact(bpb).enumerate() {
            self.engine.write_block(seq, first_block + i, chunk).map_err(DecodeError::from)?;
        }
        self.get(id)?.kv_blocks += n;
        Ok(())
    }

    /// The sender says the KV is complete with `blocks` blocks. A remote writer says so only
    /// after its writes completed, so its blocks count as written now. Non-empty `checksums`
    /// (verify mode) are checked against each block; a mismatch fails the reservation.
    pub fn kv_end(&mut self, id: u64, blocks: usize, checksums: &[u64]) -> Result<(), DecodeError> {
        let want = self.blocks_for(self.reservations.get(&id).map_or(0, |r| r.prompt_len));
        let r = self.get(id)?;
        if !r.kv_started || r.kv_complete {
            return Err(DecodeError::Invalid(format!("reservation {id} is not receiving KV")));
        }
        if r.writer {
            r.kv_blocks = blocks.min(want);
            r.writer = false;
        }
        if r.kv_blocks != want || blocks != want {
            return Err(DecodeError::Invalid(format!(
                "KV ended after {} blocks (sender says {blocks}), the prompt needs {want}",
                r.kv_blocks
            )));
        }
        let seq = r.seq;
        if !checksums.is_empty()
            && let Err(e) = self.verify(seq, checksums, want)
        {
            self.kv_abort(id, e.clone());
            return Err(e);
        }
        self.get(id)?.kv_complete = true;
        self.maybe_schedule(id);
        Ok(())
    }

    fn verify(&self, seq: SeqId, checksums: &[u64], blocks: usize) -> Result<(), DecodeError> {
        if checksums.len() != blocks {
            return Err(DecodeError::Invalid(format!(
                "{} checksums for {blocks} blocks",
                checksums.len()
            )));
        }
        let mut buf = Vec::new();
        for (i, &want) in checksums.iter().enumerate() {
            buf.clear();
            self.engine.read_block(seq, i, &mut buf).map_err(DecodeError::from)?;
            if pdmesh_kv_transfer::block_checksum(&buf) != want {
                return Err(DecodeError::Corrupt { block: i });
            }
        }
        Ok(())
    }

    /// The remote writer of reservation `id` can write no more (its session ended). Its
    /// quarantined blocks are freed; a reservation still waiting for that writer's KV fails.
    pub fn writer_closed(&mut self, id: u64, from: &str) {
        if let Some((seq, committed)) = self.quarantine.remove(&id) {
            self.committed -= committed;
            self.engine.free_sequence(seq).expect("a quarantined sequence exists");
            return;
        }
        if let Some(r) = self.reservations.get_mut(&id)
            && r.writer
        {
            r.writer = false;
            let why = DecodeError::TransferBroken {
                from: from.into(),
                why: "the UCX session ended before its commit".into(),
            };
            self.finish_with(id, Err(why));
        }
    }

    /// The transfer broke: the reservation fails and its blocks are freed.
    pub fn kv_abort(&mut self, id: u64, why: DecodeError) {
        if self.reservations.contains_key(&id) {
            self.finish_with(id, Err(why));
        }
    }

    /// Attaches a request to its reservation; output goes to `out`.
    pub fn attach(
        &mut self,
        id: u64,
        a: Attach,
        mut out: Box<dyn Output>,
        now: Instant,
    ) -> Result<(), DecodeError> {
        let ctx = self.engine.max_seq_len();
        let r = self.reservations.get(&id).ok_or(DecodeError::UnknownReservation(id))?;
        if r.run.is_some() {
            return Err(DecodeError::Invalid(format!("reservation {id} is already attached")));
        }
        if a.prompt.len() != r.prompt_len {
            return Err(DecodeError::Invalid(format!(
                "prompt has {} tokens, the reservation {}",
                a.prompt.len(),
                r.prompt_len
            )));
        }
        if a.max_tokens == 0 || self.blocks_for(r.prompt_len + a.max_tokens) > r.committed {
            return Err(DecodeError::Invalid(format!(
                "max_tokens {} is not covered by the reservation",
                a.max_tokens
            )));
        }
        if a.start == Start::Local && r.kv_started {
            return Err(DecodeError::Invalid(format!("reservation {id} already receives KV")));
        }
        let vocab = self.model.tokenizer.vocab_size() as u32;
        if let Some(t) = a.prompt.iter().find(|&&t| t >= vocab) {
            return Err(DecodeError::Invalid(format!("token id {t} is outside the vocabulary")));
        }
        let sampler = Sampler::resume(a.sampling, a.rng_position).map_err(DecodeError::from)?;
        let local = a.start == Start::Local;
        let mut run = Running {
            sampler,
            history: a.prompt,
            max_tokens: a.max_tokens,
            ignore_eos: a.ignore_eos,
            text: TextStream::new(a.stops),
            out: Box::new(NullOutput),
            generated: 0,
            next: None,
            local,
            attached_at: now,
            prefill_started: None,
            prefill_ms: 0.0,
            queue_ms: 0.0,
            phase: tracing::info_span!(
                parent: &a.span,
                "decode.queue_wait",
                kv_complete = r.kv_complete || local,
            ),
            span: a.span,
            steps: 0,
            largest_batch: 0,
        };
        let prompt_len = r.prompt_len;
        if let Start::FirstToken(t) = a.start {
            if t >= vocab {
                return Err(DecodeError::Invalid(format!(
                    "first token {t} is outside the vocabulary"
                )));
            }
            // The first token goes out at once: it does not wait for the KV.
            match accept(&self.model, &mut run, &mut *out, t, ctx, prompt_len) {
                None => {}
                Some(reason) => {
                    out.send(Event::Finished {
                        reason,
                        completion_tokens: run.generated as u32,
                        queue_ms: 0.0,
                        prefill_ms: 0.0,
                    });
                    self.counts.completed += 1;
                    self.free(id);
                    return Ok(());
                }
            }
        }
        run.out = out;
        let r = self.get(id)?;
        r.run = Some(run);
        if local {
            r.lease = None;
        }
        self.maybe_schedule(id);
        Ok(())
    }

    fn maybe_schedule(&mut self, id: u64) {
        let Some(r) = self.reservations.get_mut(&id) else { return };
        let Some(run) = r.run.as_mut() else { return };
        if r.scheduled {
            return;
        }
        let ok = if run.local {
            self.sched.add(id, r.prompt_len)
        } else if r.kv_complete {
            self.sched.add_prefilled(id, r.prompt_len)
        } else {
            return;
        };
        ok.expect("reservation ids are unique and prompts non-empty");
        r.scheduled = true;
        r.lease = None;
    }

    /// Frees a reservation nobody attached to. Attached requests are cancelled by closing
    /// their output.
    pub fn release(&mut self, id: u64) -> bool {
        match self.reservations.get(&id) {
            Some(r) if r.run.is_none() => {
                self.counts.cancelled += 1;
                self.free(id);
                true
            }
            _ => false,
        }
    }

    fn free(&mut self, id: u64) {
        if let Some(r) = self.reservations.remove(&id) {
            self.sched.remove(id);
            if r.writer {
                self.quarantine.insert(id, (r.seq, r.committed));
                return;
            }
            self.committed -= r.committed;
            self.engine.free_sequence(r.seq).expect("a reservation's sequence exists");
        }
    }

    fn finish_with(&mut self, id: u64, outcome: Result<FinishReason, DecodeError>) {
        if let Some(run) = self.reservations.get(&id).and_then(|r| r.run.as_ref()) {
            let p = &run.phase;
            p.record("tokens", run.generated as i64);
            p.record("steps", i64::from(run.steps));
            p.record("largest_batch", run.largest_batch as i64);
            match &outcome {
                Ok(reason) => p.record("finish_reason", finish_reason(*reason).as_str_name()),
                Err(e) => {
                    p.record("otel.status_code", "ERROR");
                    p.record("otel.status_description", tracing::field::display(e))
                }
            };
        }
        if let Some(r) = self.reservations.get_mut(&id) {
            match (&outcome, r.run.as_mut()) {
                (Ok(reason), Some(run)) => {
                    let piece = run.text.finish();
                    if !piece.text.is_empty() || !piece.tokens.is_empty() {
                        run.out.send(Event::Delta(piece));
                    }
                    run.out.send(Event::Finished {
                        reason: *reason,
                        completion_tokens: run.generated as u32,
                        queue_ms: run.queue_ms,
                        prefill_ms: run.prefill_ms,
                    });
                }
                (Err(e), Some(run)) => {
                    run.out.send(Event::Failed(e.clone()));
                }
                _ => {}
            }
            match outcome {
                Ok(FinishReason::Cancelled) => self.counts.cancelled += 1,
                Ok(_) => self.counts.completed += 1,
                Err(_) => self.counts.failed += 1,
            }
        }
        self.free(id);
    }

    /// Frees reservations whose lease ran out and requests whose client went away. Returns
    /// the next lease deadline, if any.
    pub fn sweep(&mut self, now: Instant) -> Option<Instant> {
        let mut expired = Vec::new();
        let mut gone = Vec::new();
        let mut next: Option<Instant> = None;
        for (&id, r) in &self.reservations {
            if let Some(run) = &r.run
                && run.out.is_closed()
            {
                gone.push(id);
                continue;
            }
            if let Some(l) = r.lease {
                if l <= now {
                    expired.push(id);
                } else {
                    next = Some(next.map_or(l, |n| n.min(l)));
                }
            }
        }
        for id in gone {
            self.finish_with(id, Ok(FinishReason::Cancelled));
        }
        for id in expired {
            tracing::warn!(reservation = id, "lease expired before the KV arrived; freeing");
            self.counts.leases_expired += 1;
            self.finish_with(id, Err(DecodeError::LeaseExpired(id)));
        }
        next
    }

    pub fn has_work(&self) -> bool {
        !self.sched.is_empty()
    }

    /// Runs one engine step over every scheduled request and delivers what it produced.
    pub fn step(&mut self, now: Instant) -> Result<(), DecodeError> {
        let plan = self.sched.plan();
        if plan.is_empty() {
            return Ok(());
        }
        let ctx = self.engine.max_seq_len();
        let toks: Vec<[u32; 1]> = plan
            .iter()
            .map(|s| [self.reservations[&s.id].run.as_ref().and_then(|r| r.next).unwrap_or(0)])
            .collect();
        for s in &plan {
            let r = self.reservations.get_mut(&s.id).expect("scheduled requests are reserved");
            let run = r.run.as_mut().expect("scheduled requests are attached");
            if run.steps == 0 {
                run.phase = pdmesh_common::span!(
                    parent: &run.span,
                    "decode.batch",
                    tokens = Empty,
                    steps = Empty,
                    largest_batch = Empty,
                    finish_reason = Empty,
                );
            }
            run.steps += 1;
            run.largest_batch = run.largest_batch.max(plan.len());
            if matches!(s.work, Work::Prefill { offset: 0, .. }) {
                run.queue_ms = ms(now - run.attached_at);
                run.prefill_started = Some(now);
            }
        }
        let items: Vec<StepItem<'_>> = plan
            .iter()
            .zip(&toks)
            .map(|(s, tok)| {
                let r = &self.reservations[&s.id];
                match s.work {
                    Work::Prefill { offset, len, last } => StepItem::prefill(
                        r.seq,
                        &r.run.as_ref().expect("attached").history[offset..offset + len],
                        if last { Logits::Last } else { Logits::None },
                    ),
                    Work::Decode => StepItem::decode(r.seq, tok),
                }
            })
            .collect();
        let logits = match self.engine.step(&items) {
            Ok(l) => l,
            Err(e) => {
                // A step fails as a whole and changes nothing; fail its requests rather than
                // retrying forever.
                drop(items);
                let e = DecodeError::from(e);
                for s in &plan {
                    self.finish_with(s.id, Err(e.clone()));
                }
                return Err(e);
            }
        };
        let rows: Vec<Option<Vec<f32>>> =
            (0..plan.len()).map(|k| logits.last_of(k).map(<[f32]>::to_vec)).collect();
        drop(items);
        let done_at = Instant::now();
        let mut finished = Vec::new();
        for (s, row) in plan.iter().zip(rows) {
            let Some(row) = row else { continue };
            let r = self.reservations.get_mut(&s.id).expect("scheduled requests are reserved");
            let prompt_len = r.prompt_len;
            let run = r.run.as_mut().expect("attached");
            if let (Work::Prefill { .. }, Some(t0)) = (s.work, run.prefill_started) {
                run.prefill_ms = ms(done_at - t0);
            }
            let tok = run.sampler.sample(&row, &run.history);
            let mut out = std::mem::replace(&mut run.out, Box::new(NullOutput));
            let end = accept(&self.model, run, &mut *out, tok, ctx, prompt_len);
            run.out = out;
            if let Some(reason) = end {
                finished.push((s.id, reason));
            }
        }
        for (id, reason) in finished {
            self.finish_with(id, Ok(reason));
        }
        Ok(())
    }

    pub fn counts(&self) -> Counts {
        let mut c = self.counts;
        c.reserved = 0;
        c.transferring = 0;
        c.queued = 0;
        c.prefilling = 0;
        c.decoding = 0;
        for r in self.reservations.values() {
            match &r.run {
                None if r.kv_started && !r.kv_complete => c.transferring += 1,
                None => c.reserved += 1,
                Some(run) if run.local && run.prefill_started.is_none() => c.queued += 1,
                Some(run) if run.local && run.generated == 0 => c.prefilling += 1,
                Some(_) if !r.scheduled => c.transferring += 1,
                Some(_) => c.decoding += 1,
            }
        }
        c.committed_blocks = self.committed as u32;
        c.quarantined = self.quarantine.len() as u32;
        c.free_blocks = self.engine.kv().free_blocks() as u32;
        c.total_blocks = self.engine.kv().total_blocks() as u32;
        c
    }
}

/// Takes a sampled token into a request: sends its text, and says whether the request ends.
fn accept(
    model: &Model,
    run: &mut Running,
    out: &mut dyn Output,
    tok: u32,
    ctx: usize,
    prompt_len: usize,
) -> Option<FinishReason> {
    if !run.ignore_eos && model.tokenizer.is_eog(tok) {
        return Some(FinishReason::Eos);
    }
    run.generated += 1;
    run.history.push(tok);
    match run.text.push(&model.tokenizer, tok) {
        Pushed::Stopped(piece) => {
            if !piece.text.is_empty() || !piece.tokens.is_empty() {
                out.send(Event::Delta(piece));
            }
            return Some(FinishReason::Stop);
        }
        Pushed::Text(piece) => {
            if (!piece.text.is_empty() || !piece.tokens.is_empty())
                && !out.send(Event::Delta(piece))
            {
                return Some(FinishReason::Cancelled);
            }
        }
    }
    if run.generated >= run.max_tokens || prompt_len + run.generated >= ctx {
        return Some(FinishReason::Length);
    }
    run.next = Some(tok);
    None
}

/// Placeholder output while a request's real output is borrowed.
struct NullOutput;

impl Output for NullOutput {
    fn send(&mut self, _: Event) -> bool {
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}
