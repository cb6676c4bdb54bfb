//! What the prefill node's engine thread (`pdmesh_common::worker`) runs: prompts submitted by
//! the async side to the `PrefillCore`.

use std::time::Instant;

use pdmesh_common::worker::Core;
use pdmesh_kv_transfer::KvPiece;
use tokio::sync::{mpsc, oneshot};

use crate::core::{Counts, Done, Job, PrefillCore};
use crate::error::PrefillError;

/// A prompt for the engine thread: its KV goes to `pieces`, its end to `done`, and whether it
/// was accepted to `reply`.
#[derive(Debug)]
pub struct Submit {
    pub job: Job,
    pub pieces: mpsc::Sender<KvPiece>,
    pub done: mpsc::Sender<Done>,
    pub reply: oneshot::Sender<Result<u64, PrefillError>>,
}

impl Core for PrefillCore {
    type Command = Submit;
    type Counts = Counts;

    fn handle(&mut self, s: Submit, now: Instant) {
        let r = self.submit(s.job, s.pieces, Box::new(s.done), now);
        let _ = s.reply.send(r);
    }

    fn sweep(&mut self, _now: Instant) -> Option<Instant> {
        PrefillCore::sweep(self);
        None
    }

    fn has_work(&mut self) -> bool {
        PrefillCore::has_work(self)
    }

    fn step(&mut self, now: Instant) {
        PrefillCore::step(self, now);
    }

    fn is_idle(&self) -> bool {
        let c = PrefillCore::counts(self);
        c.queued + c.prefilling == 0
    }

    fn counts(&self) -> Counts {
        PrefillCore::counts(self)
    }
}
