//! A reservation's KV arriving: remote write grants and their checks, the capability that
//! admits a sender, and a transfer's begin, writes, end, abort and writer closing, through
//! the receive connector into the engine's blocks.

use std::time::{Duration, Instant};

use pdmesh_common::ids::Capability;
use pdmesh_kv_transfer::{Grant, StagedBlocks, Target};

use super::{DecodeCore, DecodeError, Phase, Reservation};

impl DecodeCore {
    /// Keeps `grant` (remote access to reservation `id`'s blocks) until its KV is complete or
    /// it ends. False, dropping the grant at once, when there is no such reservation.
    pub fn hold(&mut self, id: u64, grant: Box<dyn Grant>) -> bool {
        match self.reservations.get_mut(&id) {
            Some(r) if !matches!(r.phase, Phase::Quarantined) => {
                r.granted = Some(grant.digest());
                r.remote = Some(grant);
                true
            }
            _ => false,
        }
    }

    /// Keeps the staging blocks reservation `id`'s writer puts into (see `Reservation::staged`).
    /// False, dropping them at once, when there is no such reservation.
    pub fn stage(&mut self, id: u64, staged: StagedBlocks) -> bool {
        match self.reservations.get_mut(&id) {
            Some(r) if !matches!(r.phase, Phase::Quarantined) => {
                r.staged = Some(staged);
                true
            }
            _ => false,
        }
    }

    /// A remote writer's session into reservation `id` names the memory it will put into by
    /// `digest`: it must be what this reservation was granted, not another's.
    pub fn check_grant(&self, id: u64, digest: u64) -> Result<(), DecodeError> {
        match self.live(id)?.granted {
            Some(g) if g == digest => Ok(()),
            Some(_) => Err(DecodeError::Forbidden(format!(
                "the session into reservation {id} names memory granted to another"
            ))),
            None => {
                Err(DecodeError::Forbidden(format!("reservation {id} granted no remote access")))
            }
        }
    }

    /// Revokes the remote access of reservations whose KV completed (see `kv_end`).
    pub fn revoke_completed(&mut self) {
        self.revoking.clear();
    }

    /// Whether reservation `id` still grants remote access to its blocks.
    pub fn grants_remote(&self, id: u64) -> bool {
        self.reservations.get(&id).is_some_and(|r| r.remote.is_some())
    }

    /// The key of the reservation `cap` names, if it is that reservation's capability. A
    /// wrong secret is answered exactly as an unknown key is.
    pub fn admit(&self, cap: &Capability) -> Result<u64, DecodeError> {
        match self.reservations.get(&cap.key()) {
            Some(r) if r.cap.admits(cap) => Ok(cap.key()),
            _ => Err(DecodeError::UnknownReservation(cap.key())),
        }
    }

    fn target(r: &Reservation) -> Target {
        Target { seq: r.seq, prompt_len: r.prompt_len }
    }

    /// A transfer into the reservation starts: its prompt's blocks are allocated (if they
    /// were not at reservation). A `writer` puts into them directly (a one-sided transport) and needs them
    /// preallocated; until `writer_closed` they are never reused.
    pub fn kv_begin(&mut self, id: u64, writer: bool) -> Result<(), DecodeError> {
        let r = self.live(id)?;
        if let Phase::Attached(a) = &r.phase
            && a.local
        {
            return Err(DecodeError::Invalid(format!("reservation {id} prefills locally")));
        }
        let t = Self::target(r);
        self.receiver.begin(id, t, writer, &mut self.engine)?;
        let r = self.reservations.get_mut(&id).expect("checked above");
        if !writer {
            // A stream writes the pool itself: the staging blocks are of no use to it.
            r.staged = None;
        }
        // From here the open transfer keeps the reservation: its end without the KV aborts
        // it, and the router's deadline bounds it. A lease would expire prompts that merely
        // wait in a busy prefill node's queue with their stream already open.
        match &mut r.phase {
            Phase::Attached(a) => a.lease = None,
            p => *p = Phase::Receiving,
        }
        Ok(())
    }

    /// Writes whole prompt blocks starting at `first_block`.
    pub fn kv_write(
        &mut self,
        id: u64,
        first_block: usize,
        data: &[u8],
    ) -> Result<(), DecodeError> {
        let t = Self::target(self.live(id)?);
        Ok(self.receiver.write(id, t, first_block, data, &mut self.engine)?)
    }

    /// The sender says the KV is complete with `blocks` blocks (see `Receiver::end`): staged
    /// KV is copied into the pool, and the time that took returned. A checksum mismatch fails
    /// the reservation. KV that no request waits for yet is kept for the node's default lease
    /// from `now`, at most `READY_GRACE`.
    pub fn kv_end(
        &mut self,
        id: u64,
        blocks: usize,
        checksums: &[u64],
        now: Instant,
    ) -> Result<Option<Duration>, DecodeError> {
        let t = Self::target(self.live(id)?);
        let staged = self.reservations.get(&id).and_then(|r| r.staged.as_ref());
        let unstaged = match self.receiver.end(id, t, blocks, checksums, staged, &mut self.engine) {
            Ok(d) => d,
            Err(e) => {
                let e = DecodeError::from(e);
                // These end the transfer (its KV is unusable), and so the reservation.
                let ended = matches!(
                    e,
                    DecodeError::Corrupt { .. } | DecodeError::Remote(_) | DecodeError::Engine(_)
                );
                if ended {
                    self.fail(id, e.clone());
                }
                return Err(e);
            }
        };
        let r = self.reservations.get_mut(&id).expect("checked above");
        let lease = now + self.default_lease.min(super::READY_GRACE);
        // The KV is complete: no peer has anything more to write. Revoked once the caller
        // has its answer (`revoke_completed`), so the commit does not wait on it.
        if let Some(g) = r.remote.take() {
            self.revoking.push(g);
        }
        if matches!(r.phase, Phase::Receiving) {
            r.phase = Phase::Ready { lease };
        }
        Ok(unstaged)
    }

    /// The remote writer of reservation `id` can write no more (its session ended). Its
    /// quarantined blocks are freed; a reservation still waiting for that writer's KV fails.
    pub fn writer_closed(&mut self, id: u64, from: &str) {
        let broke = self.receiver.writer_closed(id);
        if let Some((seq, blocks)) = self.parked.remove(&id) {
            self.committed -= blocks;
            self.engine.free_sequence(seq).expect("a parked sequence exists");
        }
        if let Some(r) = self.reservations.get_mut(&id) {
            // Nobody can put into them any more: back to the staging area.
            r.staged = None;
        }
        match self.reservations.get(&id).map(|r| &r.phase) {
            Some(Phase::Quarantined) => self.free(id),
            Some(_) if broke => {
                let why = DecodeError::TransferBroken {
                    from: from.into(),
                    why: "the writer's session ended before its commit".into(),
                };
                self.fail(id, why);
            }
            _ => {}
        }
    }

    /// Reservation `id`'s remote writer gave up its session (it stalled) and will send the KV
    /// over a stream instead. Its puts may still land in the blocks it was granted, so the
    /// reservation moves onto fresh blocks and the old ones stay parked until the writer's
    /// session ends; the grant is revoked. Fails with NoBlocks when there is no room for a
    /// second copy (the transfer then fails as any broken one does).
    pub fn writer_abandoned(&mut self, id: u64) -> Result<(), DecodeError> {
        let r = self.live(id)?;
        if !self.receiver.session_open(id) || self.receiver.is_complete(id) {
            return Err(DecodeError::Invalid(format!(
                "reservation {id} has no remote writer to replace"
            )));
        }
        if self.parked.contains_key(&id) {
            return Err(DecodeError::Invalid(format!("reservation {id} was moved once already")));
        }
        let (seq, prompt_len) = (r.seq, r.prompt_len);
        let need = self.blocks_for(prompt_len);
        let total = self.engine.kv().total_blocks();
        if self.committed + need > total {
            return Err(DecodeError::NoBlocks { need, free: total - self.committed });
        }
        let fresh = self.engine.create_sequence();
        if let Err(e) = self.engine.extend_sequence(fresh, prompt_len) {
            self.engine.free_sequence(fresh).expect("just created");
            return Err(e.into());
        }
        self.engine.swap_sequences(seq, fresh)?;
        self.committed += need;
        self.parked.insert(id, (fresh, need));
        self.receiver.writer_abandoned(id);
        let r = self.reservations.get_mut(&id).expect("checked above");
        r.remote = None;
        r.granted = None;
        r.staged = None;
        Ok(())
    }

    /// The transfer broke: the reservation fails and its blocks are freed.
    pub fn kv_abort(&mut self, id: u64, why: DecodeError) {
        if self.live(id).is_ok() {
            self.receiver.abort(id);
            self.fail(id, why);
        }
    }
}
