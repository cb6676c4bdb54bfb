//! The decode node's state, free of gRPC and tokio: KV reservations under leases, their KV
//! arriving through the receive connector, requests attached to them, and the batch runner
//! that generates for all of them. The worker thread drives it; unit tests drive it directly.
//!
//! Blocks are promised at reservation: for the prompt and all of max_tokens, so the request
//! never runs out mid-stream, or (a growing reservation) for the prompt and a first slice of
//! its output, promised one more block at a time as tokens are generated. A node with no block
//! left to promise preempts its youngest growing request: its stream ends with
//! `DecodeError::Preempted` and its caller recomputes it where there is room. The engine
//! allocates blocks as the prompt's KV arrives and tokens are generated. Every exit path
//! (finish, cancel, failure, preemption, lease expiry) frees the sequence, or quarantines it
//! while a remote writer may still reach its blocks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use pdmesh_common::ids::Capability;
use pdmesh_engine::{
    BatchRunner, End, Engine, Event as RunEvent, FinishReason, GenerateParams, Mark, Origin,
    Output as RunOutput, Piece, Release, SamplingParams, SeqId, SeqKind, SeqSpec,
};
use pdmesh_kv_transfer::Receiver;
use pdmesh_kv_types::KvPolicy;
use pdmesh_wire::finish_reason;
use tracing::Span;

use crate::error::DecodeError;

/// Where a request's output goes. `send` returns false when the receiver is gone.
pub trait Output: Send {
    fn send(&mut self, event: Event) -> bool;
    fn is_closed(&self) -> bool;
}

mod kv;
mod moving;
mod run;

#[derive(Debug, Clone)]
pub enum Event {
    /// Output, and where the request stands after it (none on the final flush).
    Delta(Piece, Option<Mark>),
    /// The node is draining: the request is paused until `hand_off` says where it goes.
    Moving {
        mark: Mark,
        kv_tokens: usize,
    },
    /// Its KV went to another node: the stream ends here and continues there.
    Moved,
    Finished {
        reason: FinishReason,
        completion_tokens: u32,
        queue_ms: f64,
        prefill_ms: f64,
        /// KV tokens the request's lossy policy evicted.
        kv_evicted_tokens: u32,
    },
    Failed(DecodeError),
}

/// What the runner says of a request that left it.
struct Ended {
    generated: usize,
    largest_batch: usize,
    kept: Option<SeqId>,
    /// KV tokens its lossy policy evicted.
    evicted: usize,
}

/// How an attached request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The prefill node sampled this first token; the KV comes (or came) over a transport.
    FirstToken(u32),
    /// Compute the prompt here.
    Local,
    /// The request moved here with its KV (`Attach::resumed`, `SeqSpec::handed_off`).
    HandedOff,
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
    /// The request's lossy KV policy, put on its sequence once its prompt's KV is here.
    pub kv_policy: Option<KvPolicy>,
    pub start: Start,
    /// The request's own output so far, from another node (`SeqSpec::resumed`).
    pub resumed: Vec<u32>,
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
    /// Requests handed off to another node with their KV.
    pub moved: u64,
    /// Growing requests ended because no block was left to promise them.
    pub preempted: u64,
    pub draining: bool,
}

/// A request attached to its reservation: the runner has its sequence.
struct Attached {
    out: Box<dyn Output>,
    local: bool,
    /// Until a transfer begins for a request whose first token came from elsewhere.
    lease: Option<Instant>,
    attached_at: Instant,
    prefill_started: Option<Instant>,
    queue_ms: f64,
    prefill_ms: f64,
    /// `decode.queue_wait` from attach to the first step (the KV's arrival included), then
    /// `decode.batch` until the request leaves the batch.
    phase: Span,
    span: Span,
    steps: u32,
    moving: Moving,
}

/// Where an attached request stands in a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moving {
    No,
    /// Paused; its caller was asked where it goes.
    Asked,
    /// No node could take it: it finishes here.
    Stays,
}

/// Where a reservation stands. Each phase holds only what it can have.
enum Phase {
    /// Blocks promised, no KV and no request yet: freed at `lease`.
    Reserved { lease: Instant },
    /// A transfer is writing the KV and no request is attached; the open transfer holds it
    /// (its end without the KV fails it).
    Receiving,
    /// The KV is complete and waits for its request until `lease`.
    Ready { lease: Instant },
    /// A request is attached: running, or waiting in the runner for its KV.
    Attached(Box<Attached>),
    /// Ended while a remote writer may still put into its blocks: they stay committed until
    /// the writer's session ends.
    Quarantined,
}

struct Reservation {
    /// What the caller must present to use it (keyed in `reservations` by its key).
    cap: Capability,
    seq: SeqId,
    prompt_len: usize,
    /// Blocks promised now.
    committed: usize,
    /// Blocks the prompt and all of max_tokens take: what `committed` may grow to.
    ceiling: usize,
    phase: Phase,
    /// Remote access granted to the prompt's blocks (a transport's registration of them alone):
    /// dropped, which revokes it, once the KV is complete or the reservation ends.
    remote: Option<Box<dyn pdmesh_kv_transfer::Grant>>,
    /// The digest of what was granted (`Grant::digest`): a writer's session must name it.
    granted: Option<u64>,
    /// The staging blocks the writer puts into, when the pool is staged: copied into the
    /// prompt's blocks at the commit, and kept until no writer can reach them.
    staged: Option<pdmesh_kv_transfer::StagedBlocks>,
    /// Whose request it is and its id (`name`), for a cancel from any router.
    request: Option<(String, String)>,
    /// Cancelled before its request attached: it finishes as soon as it does.
    cancelled: bool,
}

/// A new reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// What `Reserve` hands out: the only way to name the reservation from outside.
    pub cap: Capability,
    /// Blocks the prompt's KV fills.
    pub prompt_blocks: usize,
    pub lease: Duration,
    /// What a writer is granted for the prompt's blocks, in order, when they were allocated at
    /// reservation (`Engine::writer_blocks`).
    pub pool_blocks: Vec<u32>,
}

impl Reserved {
    /// The reservation's key inside this node (its capability's key).
    pub fn id(&self) -> u64 {
        self.cap.key()
    }
}

/// Longest complete KV waits for its request (or the node's default lease, if shorter). The
/// caller attaches as soon as it hears the transfer ended; one that has not by then is gone,
/// and may have stopped releasing the reservation long ago (at the lease it was granted).
const READY_GRACE: Duration = Duration::from_secs(10);

pub struct DecodeCore {
    engine: Engine,
    runner: BatchRunner,
    receiver: Receiver,
    reservations: HashMap<u64, Reservation>,
    /// Reservations by the request they serve (`name`): a cancel through any router finds
    /// its own in one lookup, on the engine thread, instead of scanning every reservation.
    named: HashMap<(String, String), Vec<u64>>,
    /// Grants of completed KV, dropped (revoked) right after the commit is answered.
    revoking: Vec<Box<dyn pdmesh_kv_transfer::Grant>>,
    committed: usize,
    default_lease: Duration,
    max_lease: Duration,
    counts: Counts,
    /// Attached requests being ended with an error of the node's (the runner reports them
    /// cancelled).
    failing: HashMap<u64, DecodeError>,
    /// Attached requests being ended because they moved (the runner reports them cancelled).
    moved: HashSet<u64>,
    /// Stopping: no new reservations, and running requests are asked to move.
    draining: bool,
    /// The old blocks of reservations moved onto fresh ones when their writer gave up its
    /// session (`writer_abandoned`), kept (and counted in `committed`) until that session ends.
    parked: HashMap<u64, (SeqId, usize)>,
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
        // Blocks are promised by reservations, not by the runner.
        let runner = BatchRunner::new(&engine, max_running, false);
        Self {
            engine,
            runner,
            receiver: Receiver::new(),
            reservations: HashMap::new(),
            named: HashMap::new(),
            revoking: Vec::new(),
            parked: HashMap::new(),
            committed: 0,
            default_lease,
            max_lease,
            counts: Counts::default(),
            failing: HashMap::new(),
            moved: HashSet::new(),
            draining: false,
        }
    }

    /// Steps that prefill a prompt here beside running streams are sized to `target`
    /// (`pdmesh_engine::pacing`); None: each takes the engine's `max_batch_tokens`.
    pub fn set_itl_target(&mut self, target: Option<Duration>) {
        self.runner.set_itl_target(&self.engine, target);
    }

    /// The sequence holding reservation `id`'s KV.
    pub fn seq_of(&self, id: u64) -> Option<SeqId> {
        self.reservations.get(&id).map(|r| r.seq)
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
        self.reserve_growing(prompt_len, max_tokens, max_tokens, lease, remote_kv, now)
    }

    /// `reserve`, promising blocks for only the first `up_front` of the `max_tokens` (at least
    /// one): the rest are promised as they are generated, and the request may be preempted.
    pub fn reserve_growing(
        &mut self,
        prompt_len: usize,
        max_tokens: usize,
        up_front: usize,
        lease: Option<Duration>,
        remote_kv: bool,
        now: Instant,
    ) -> Result<Reserved, DecodeError> {
        let ctx = self.engine.max_seq_len();
        if self.draining {
            return Err(DecodeError::Draining);
        }
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
        let ceiling = self.blocks_for(prompt_len + max_tokens);
        let need = self.blocks_for(prompt_len + up_front.clamp(1, max_tokens));
        let total = self.engine.kv().total_blocks();
        // A request the whole pool could not hold would only ever be preempted.
        if self.committed + need > total || ceiling > total {
            let need = if ceiling > total { ceiling } else { need };
            return Err(DecodeError::NoBlocks { need, free: total - self.committed });
        }
        let lease = lease.unwrap_or(self.default_lease).min(self.max_lease);
        let seq = self.engine.create_sequence();
        let mut pool_blocks = Vec::new();
        if remote_kv {
            let grown = self
                .engine
                .extend_sequence(seq, prompt_len)
                .and_then(|()| self.engine.writer_blocks(seq, self.blocks_for(prompt_len)));
            match grown {
                Ok(b) => pool_blocks = b,
                Err(e) => {
                    self.engine.free_sequence(seq).expect("just created");
                    return Err(e.into());
                }
            }
        }
        let cap = Capability::fresh(|k| self.reservations.contains_key(&k));
        let id = cap.key();
        self.committed += need;
        let phase = Phase::Reserved { lease: now + lease };
        self.reservations.insert(
            id,
            Reservation {
                cap,
                seq,
                prompt_len,
                committed: need,
                ceiling,
                phase,
                remote: None,
                granted: None,
                staged: None,
                request: None,
                cancelled: false,
            },
        );
        Ok(Reserved { cap, prompt_blocks: self.blocks_for(prompt_len), lease, pool_blocks })
    }

    /// A live reservation (not quarantined).
    fn live(&self, id: u64) -> Result<&Reservation, DecodeError> {
        match self.reservations.get(&id) {
            Some(r) if !matches!(r.phase, Phase::Quarantined) => Ok(r),
            _ => Err(DecodeError::UnknownReservation(id)),
        }
    }

    /// Attaches a request to its reservation; output goes to `out`.
    pub fn attach(
        &mut self,
        id: u64,
        a: Attach,
        out: Box<dyn Output>,
        now: Instant,
    ) -> Result<(), DecodeError> {
        let r = self.live(id)?;
        let lease = match r.phase {
            Phase::Attached(_) => {
                return Err(DecodeError::Invalid(format!("reservation {id} is already attached")));
            }
            Phase::Reserved { lease } => Some(lease),
            _ => None,
        };
        // A request moved here with its KV brings that of its output too, but the last token.
        let kv_tokens = match a.start {
            Start::HandedOff => (a.prompt.len() + a.resumed.len()).saturating_sub(1),
            _ => a.prompt.len(),
        };
        if kv_tokens != r.prompt_len {
            return Err(DecodeError::Invalid(format!(
                "the request has {kv_tokens} tokens of KV, the reservation {}",
                r.prompt_len
            )));
        }
        if a.max_tokens == 0 || self.blocks_for(a.prompt.len() + a.max_tokens) > r.ceiling {
            return Err(DecodeError::Invalid(format!(
                "max_tokens {} is not covered by the reservation",
                a.max_tokens
            )));
        }
        let local = a.start == Start::Local;
        let known = self.receiver.is_receiving(id) || self.receiver.is_complete(id);
        if local && known {
            return Err(DecodeError::Invalid(format!("reservation {id} already receives KV")));
        }
        let from = match (a.start, a.resumed) {
            (Start::HandedOff, tokens) => Origin::HandedOff { tokens },
            (Start::FirstToken(t), tokens) if tokens.is_empty() => Origin::FirstToken(t),
            (Start::FirstToken(t), tokens) => Origin::Resumed { tokens, first_token: Some(t) },
            (Start::Local, tokens) if tokens.is_empty() => Origin::Here,
            (Start::Local, tokens) => Origin::Resumed { tokens, first_token: None },
        };
        let spec = SeqSpec {
            prompt: a.prompt,
            params: GenerateParams {
                sampling: a.sampling,
                max_tokens: a.max_tokens,
                stop_tokens: Vec::new(),
                stop_strings: a.stops,
                ignore_eos: a.ignore_eos,
                kv_policy: a.kv_policy,
            },
            rng_position: a.rng_position,
            seq: Some(r.seq),
            kind: SeqKind::Generate { text: true, from },
        };
        if !local && !known {
            self.receiver.await_kv(id);
        }
        let added = self.runner.add(&mut self.engine, &mut self.receiver, id, spec);
        let outputs = match added {
            Ok(o) => o,
            Err(e) => {
                if !local && !known {
                    self.receiver.abort(id);
                }
                return Err(e.into());
            }
        };
        let complete = self.receiver.is_complete(id);
        let attached = Attached {
            out,
            local,
            // A lease holds only while nothing else does: no transfer, no local prefill.
            lease: lease.filter(|_| !local && !known),
            attached_at: now,
            prefill_started: None,
            queue_ms: 0.0,
            prefill_ms: 0.0,
            phase: tracing::info_span!(
                parent: &a.span,
                "decode.queue_wait",
                kv_complete = complete || local,
            ),
            span: a.span,
            steps: 0,
            moving: Moving::No,
        };
        let r = self.reservations.get_mut(&id).expect("checked above");
        r.phase = Phase::Attached(Box::new(attached));
        let cancelled = r.cancelled;
        // The first token goes out at once: it does not wait for the KV.
        self.deliver(outputs);
        if cancelled {
            let out = self.runner.cancel(&mut self.engine, &mut self.receiver, id);
            self.deliver(out);
        }
        Ok(())
    }

    /// Frees a reservation nobody attached to. Attached requests are cancelled by closing
    /// their output.
    pub fn release(&mut self, id: u64) -> bool {
        match self.reservations.get(&id).map(|r| &r.phase) {
            Some(Phase::Reserved { .. } | Phase::Receiving | Phase::Ready { .. }) => {
                self.counts.cancelled += 1;
                self.receiver.abort(id);
                self.free(id);
                true
            }
            _ => false,
        }
    }

    /// Ends a reservation that is not (or no longer) in the runner: its blocks return to the
    /// pool, or wait in quarantine while a remote writer may reach them.
    fn free(&mut self, id: u64) {
        let Some(r) = self.reservations.get_mut(&id) else { return };
        // Revoked first: a writer still putting is cut off, and the blocks wait for its
        // session to end before reuse.
        r.remote = None;
        if self.receiver.forget(id) == Release::Keep {
            r.phase = Phase::Quarantined;
            return;
        }
        let r = self.reservations.remove(&id).expect("looked up above");
        self.unname(id, r.request.as_ref());
        self.committed -= r.committed;
        self.engine.free_sequence(r.seq).expect("a reservation's sequence exists");
    }

    /// Fails a reservation with one of the node's errors.
    fn fail(&mut self, id: u64, why: DecodeError) {
        match self.reservations.get(&id).map(|r| &r.phase) {
            Some(Phase::Attached(_)) => {
                self.failing.insert(id, why);
                let out = self.runner.cancel(&mut self.engine, &mut self.receiver, id);
                self.deliver(out);
            }
            Some(Phase::Quarantined) | None => {}
            Some(_) => {
                self.counts.failed += 1;
                self.free(id);
            }
        }
    }

    /// Delivers what the runner produced to the requests' outputs. A request whose output is
    /// gone is cancelled.
    fn deliver(&mut self, outputs: Vec<RunOutput>) {
        let mut queue: VecDeque<RunOutput> = outputs.into();
        let mut gone = HashSet::new();
        while let Some(o) = queue.pop_front() {
            match o.event {
                RunEvent::Delta(piece, mark) => {
                    let Some(a) = self.attached(o.id) else { continue };
                    if !gone.contains(&o.id) && !a.out.send(Event::Delta(piece, mark)) {
                        gone.insert(o.id);
                        queue.extend(self.runner.cancel(
                            &mut self.engine,
                            &mut self.receiver,
                            o.id,
                        ));
                    }
                }
                RunEvent::Done { end, generated, largest_batch, kept, evicted, .. } => {
                    let end = if gone.contains(&o.id) {
                        End::Finished { reason: FinishReason::Cancelled, stop_token: None }
                    } else {
                        end
                    };
                    self.finish(o.id, end, Ended { generated, largest_batch, kept, evicted });
                }
            }
        }
    }

    fn attached(&mut self, id: u64) -> Option<&mut Attached> {
        match &mut self.reservations.get_mut(&id)?.phase {
            Phase::Attached(a) => Some(a),
            _ => None,
        }
    }

    /// A request left the runner: report its end and settle its reservation.
    fn finish(&mut self, id: u64, end: End, ended: Ended) {
        let Ended { generated, largest_batch, kept, evicted } = ended;
        let failing = self.failing.remove(&id);
        let moved = self.moved.remove(&id);
        let Some(r) = self.reservations.get_mut(&id) else { return };
        let phase = std::mem::replace(&mut r.phase, Phase::Quarantined);
        let Phase::Attached(mut a) = phase else {
            r.phase = phase;
            return;
        };
        let p = &a.phase;
        p.record("tokens", generated as i64);
        p.record("steps", i64::from(a.steps));
        p.record("largest_batch", largest_batch as i64);
        let outcome = match (failing, end) {
            (Some(why), _) => Err(why),
            (None, End::Finished { reason, .. }) => Ok(reason),
            (None, End::Failed(e)) => Err(DecodeError::from(e)),
            (None, End::Prefilled { .. }) => unreachable!("decode requests generate"),
        };
        match outcome {
            Ok(_) if moved => {
                p.record("finish_reason", "moved");
                a.out.send(Event::Moved);
                self.counts.moved += 1;
            }
            Ok(reason) => {
                p.record("finish_reason", finish_reason(reason).as_str_name());
                a.out.send(Event::Finished {
                    reason,
                    completion_tokens: generated as u32,
                    queue_ms: a.queue_ms,
                    prefill_ms: a.prefill_ms,
                    kv_evicted_tokens: evicted as u32,
                });
                if reason == FinishReason::Cancelled {
                    self.counts.cancelled += 1;
                } else {
                    self.counts.completed += 1;
                }
            }
            Err(e) => {
                p.record("otel.status_code", "ERROR");
                p.record("otel.status_description", tracing::field::display(&e));
                if matches!(e, DecodeError::Preempted { .. }) {
                    self.counts.preempted += 1;
                } else {
                    self.counts.failed += 1;
                }
                a.out.send(Event::Failed(e));
            }
        }
        // The runner released the sequence; quarantined, it waits for the writer.
        if kept.is_none() {
            let r = self.reservations.remove(&id).expect("looked up above");
            self.unname(id, r.request.as_ref());
            self.committed -= r.committed;
        }
    }
}
