//! A request leaving this node before its end: cancelled through any router (by its owner
//! and id), or moved when the node drains (paused, its KV exported, then ended here as moved,
//! or kept when nothing could take it).

use super::{DecodeCore, DecodeError, Event, Moving, Phase};

impl DecodeCore {
    /// Names a reservation's request: `owner`'s `request_id`.
    pub fn name(&mut self, id: u64, owner: String, request_id: String) {
        let Some(r) = self.reservations.get_mut(&id) else { return };
        let request = (owner, request_id);
        let before = r.request.replace(request.clone());
        self.unname(id, before.as_ref());
        self.named.entry(request).or_default().push(id);
    }

    /// Takes reservation `id` out of the index under `request`, its name if it had one.
    pub(super) fn unname(&mut self, id: u64, request: Option<&(String, String)>) {
        let Some(request) = request else { return };
        let Some(ids) = self.named.get_mut(request) else { return };
        ids.retain(|&i| i != id);
        if ids.is_empty() {
            self.named.remove(request);
        }
    }

    /// Reservations named now (what the index holds: none once they are all gone).
    pub fn named_requests(&self) -> usize {
        self.named.len()
    }

    /// Cancels `owner`'s request `request_id`: a running one ends now (`Finished(Cancelled)`),
    /// one not attached yet as soon as it attaches. False when the node holds no such request.
    pub fn cancel(&mut self, owner: &str, request_id: &str) -> bool {
        let key = (owner.to_string(), request_id.to_string());
        let Some(ids) = self.named.get(&key).cloned() else { return false };
        for &id in &ids {
            let r = self.reservations.get_mut(&id).expect("the index holds live reservations");
            match r.phase {
                Phase::Attached(_) => {
                    let out = self.runner.cancel(&mut self.engine, &mut self.receiver, id);
                    self.deliver(out);
                }
                Phase::Quarantined => {}
                _ => r.cancelled = true,
            }
        }
        !ids.is_empty()
    }

    /// Starts draining: no new reservations from now on, and every decoding request is paused
    /// and asked to move (`Event::Moving`); those still on their way are asked once they
    /// decode. Returns the requests the node holds.
    pub fn drain(&mut self) -> usize {
        if !self.draining {
            self.draining = true;
            tracing::info!(requests = self.reservations.len(), "draining");
        }
        self.ask_to_move();
        self.reservations.len()
    }

    /// While draining: pauses each decoding request not yet asked, and asks it to move.
    pub(super) fn ask_to_move(&mut self) {
        if !self.draining {
            return;
        }
        let ids: Vec<u64> = self.reservations.keys().copied().collect();
        for id in ids {
            let Some(a) = self.attached(id) else { continue };
            if a.moving != Moving::No {
                continue;
            }
            let Some(p) = self.runner.pause(id) else { continue };
            let a = self.attached(id).expect("looked up above");
            a.moving = Moving::Asked;
            let moving = Event::Moving { mark: p.mark, kv_tokens: p.kv_tokens };
            if !a.out.send(moving) {
                let out = self.runner.cancel(&mut self.engine, &mut self.receiver, id);
                self.deliver(out);
            }
        }
    }

    /// Whether the node holds no request or reservation (a drain is done).
    pub fn is_empty(&self) -> bool {
        self.reservations.is_empty()
    }

    /// The KV of a request asked to move, block by block, and how many tokens it covers.
    pub fn export(&self, id: u64) -> Result<(Vec<Vec<u8>>, usize), DecodeError> {
        match &self.live(id)?.phase {
            Phase::Attached(a) if a.moving == Moving::Asked => {}
            _ => return Err(DecodeError::Invalid(format!("request {id} is not moving"))),
        }
        let blocks = self.runner.export(&self.engine, id)?;
        let kv = self.engine.seq_len(self.live(id)?.seq)?;
        Ok((blocks, kv))
    }

    /// A request asked to move went (its KV is on the other node): its stream ends with
    /// `Event::Moved` and its blocks are freed.
    pub fn moved(&mut self, id: u64) {
        if self.attached(id).is_some_and(|a| a.moving == Moving::Asked) {
            self.moved.insert(id);
            let out = self.runner.cancel(&mut self.engine, &mut self.receiver, id);
            self.deliver(out);
        }
    }

    /// A request asked to move stays (no node could take it, or its KV did not get there):
    /// it goes on here, and is not asked again.
    pub fn stay(&mut self, id: u64) -> Result<(), DecodeError> {
        match self.attached(id) {
            Some(a) if a.moving == Moving::Asked => a.moving = Moving::Stays,
            _ => return Err(DecodeError::Invalid(format!("request {id} is not moving"))),
        }
        self.runner.unpause(id)?;
        Ok(())
    }
}
