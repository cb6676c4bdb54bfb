//! The node's clock and engine steps: leases swept, running requests stepped and their
//! growing reservations promised more blocks (the youngest preempted when none are left), and
//! the counts the node reports.

use std::time::Instant;

use pdmesh_common::convert::ms;
use pdmesh_engine::{SeqStatus, Work};
use tracing::field::Empty;

use super::{Counts, DecodeCore, Moving, Phase, Reservation};
use crate::error::DecodeError;

impl DecodeCore {
    /// Frees reservations whose lease ran out and requests whose client went away. Returns
    /// the next lease deadline, if any.
    pub fn sweep(&mut self, now: Instant) -> Option<Instant> {
        let mut expired = Vec::new();
        let mut gone = Vec::new();
        let mut next: Option<Instant> = None;
        for (&id, r) in &self.reservations {
            let lease = match &r.phase {
                Phase::Attached(a) if a.out.is_closed() => {
                    gone.push(id);
                    continue;
                }
                Phase::Reserved { lease } | Phase::Ready { lease } => Some(*lease),
                Phase::Attached(a) => a.lease,
                Phase::Receiving | Phase::Quarantined => None,
            };
            if let Some(l) = lease {
                if l <= now {
                    expired.push(id);
                } else {
                    next = Some(next.map_or(l, |n| n.min(l)));
                }
            }
        }
        for id in gone {
            let out = self.runner.cancel(&mut self.engine, &mut self.receiver, id);
            self.deliver(out);
        }
        for id in expired {
            tracing::warn!(reservation = id, "lease expired before the KV arrived; freeing");
            self.counts.leases_expired += 1;
            self.receiver.abort(id);
            self.fail(id, DecodeError::LeaseExpired(id));
        }
        next
    }

    pub fn has_work(&mut self) -> bool {
        self.runner.has_work(&mut self.engine, &mut self.receiver)
    }

    /// Runs one engine step over every scheduled request and delivers what it produced.
    pub fn step(&mut self, now: Instant) -> Result<(), DecodeError> {
        self.grow();
        let plan = self.runner.plan(&mut self.engine, &mut self.receiver);
        for s in &plan {
            let Some(a) = self.attached(s.id) else { continue };
            if a.steps == 0 {
                a.phase = pdmesh_common::span!(
                    parent: &a.span,
                    "decode.batch",
                    tokens = Empty,
                    steps = Empty,
                    largest_batch = Empty,
                    finish_reason = Empty,
                );
            }
            a.steps += 1;
            if matches!(s.work, Work::Prefill { offset: 0, .. }) {
                a.queue_ms = ms(now - a.attached_at);
                a.prefill_started = Some(now);
            }
        }
        let ran = self.runner.run(&plan, &mut self.engine, &mut self.receiver, None);
        let done_at = Instant::now();
        for s in &plan {
            if let (Work::Prefill { last: true, .. }, Some(a)) = (s.work, self.attached(s.id))
                && let Some(t0) = a.prefill_started
            {
                a.prefill_ms = ms(done_at - t0);
            }
        }
        match ran {
            Ok(outputs) => {
                self.deliver(outputs);
                self.ask_to_move();
                Ok(())
            }
            // A step fails as a whole and changes nothing; its requests fail rather than
            // retrying forever.
            Err(f) => {
                self.deliver(f.outputs);
                Err(f.error.into())
            }
        }
    }

    /// Before a step: each growing request about to decode past the blocks promised to it is
    /// promised one more, oldest first. With none left to promise, the youngest growing
    /// request (it may be this one) is preempted and its blocks go to the older ones: the
    /// oldest always make progress, so a full node never stalls all of its streams.
    fn grow(&mut self) {
        let total = self.engine.kv().total_blocks();
        let mut short = Vec::new();
        for (&id, r) in &self.reservations {
            if !self.preemptible(id, r) {
                continue;
            }
            let Phase::Attached(a) = &r.phase else { continue };
            let Ok(len) = self.engine.seq_len(r.seq) else { continue };
            let need = self.blocks_for(len + 1).min(r.ceiling);
            if need > r.committed {
                short.push((a.attached_at, id, need));
            }
        }
        short.sort_unstable();
        for (_, id, need) in short {
            while let Some(r) = self.reservations.get_mut(&id) {
                if !matches!(r.phase, Phase::Attached(_)) {
                    break;
                }
                let more = need.saturating_sub(r.committed);
                if self.committed + more <= total {
                    r.committed += more;
                    self.committed += more;
                    break;
                }
                let youngest = self
                    .reservations
                    .iter()
                    .filter(|&(&v, r)| self.preemptible(v, r))
                    .filter_map(|(&v, r)| match &r.phase {
                        Phase::Attached(a) => Some((a.attached_at, v)),
                        _ => None,
                    })
                    .max();
                let Some((_, victim)) = youngest else { break };
                tracing::info!(
                    reservation = victim,
                    for_reservation = id,
                    "no KV block left to promise; preempting the youngest growing request"
                );
                self.fail(victim, DecodeError::Preempted { blocks: total });
                if victim == id {
                    break;
                }
            }
        }
    }

    /// Whether `r` is a growing request decoding here, not being moved or failed: one that
    /// may be promised more blocks, or preempted.
    fn preemptible(&self, id: u64, r: &Reservation) -> bool {
        let Phase::Attached(a) = &r.phase else { return false };
        r.ceiling > r.committed
            && a.moving == Moving::No
            && !self.failing.contains_key(&id)
            && self.runner.status(id) == Some(SeqStatus::Decoding)
    }

    pub fn counts(&self) -> Counts {
        let mut c = self.counts;
        c.reserved = 0;
        c.transferring = 0;
        c.queued = 0;
        c.prefilling = 0;
        c.decoding = 0;
        c.quarantined = 0;
        for (&id, r) in &self.reservations {
            match &r.phase {
                Phase::Reserved { .. } | Phase::Ready { .. } => c.reserved += 1,
                Phase::Receiving => c.transferring += 1,
                Phase::Quarantined => c.quarantined += 1,
                Phase::Attached(a) => match self.runner.status(id) {
                    Some(SeqStatus::Waiting) if a.local => c.queued += 1,
                    Some(SeqStatus::Waiting) | None => c.transferring += 1,
                    Some(SeqStatus::Prefilling) => c.prefilling += 1,
                    Some(SeqStatus::Decoding) => c.decoding += 1,
                },
            }
        }
        c.draining = self.draining;
        c.committed_blocks = self.committed as u32;
        c.free_blocks = self.engine.kv().free_blocks() as u32;
        c.total_blocks = self.engine.kv().total_blocks() as u32;
        c
    }
}
