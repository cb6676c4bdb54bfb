//! The engine thread of a prefill node: takes prompts from a bounded channel, steps the engine
//! while there is work, and notices prompts whose caller went away.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::core::{Counts, Job, JobOutput, Out, PrefillCore};
use crate::error::PrefillError;

pub const COMMAND_QUEUE: usize = 64;
const IDLE_TICK: Duration = Duration::from_millis(20);

#[derive(Debug)]
pub struct Submit {
    pub job: Job,
    pub out: ChannelOutput,
    pub reply: oneshot::Sender<Result<u64, PrefillError>>,
}

/// A prompt's output: blocks go to one channel, sized to hold every block message so the
/// engine thread never waits on a slow transport; the first token (or the failure) to another,
/// so the caller learns of it at once even while blocks are still being sent.
#[derive(Debug)]
pub struct ChannelOutput {
    blocks: mpsc::Sender<Out>,
    done: mpsc::Sender<Out>,
}

impl ChannelOutput {
    pub fn channel(blocks: usize) -> (Self, mpsc::Receiver<Out>, mpsc::Receiver<Out>) {
        let (btx, brx) = mpsc::channel(blocks + 1);
        let (dtx, drx) = mpsc::channel(1);
        (Self { blocks: btx, done: dtx }, brx, drx)
    }
}

impl JobOutput for ChannelOutput {
    fn send(&mut self, out: Out) -> bool {
        let tx = match out {
            Out::Blocks { .. } => &self.blocks,
            Out::Computed { .. } | Out::Failed(_) => &self.done,
        };
        match tx.try_send(out) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::error!("prefill output channel full; the capacity bound is wrong");
                false
            }
        }
    }
    fn is_closed(&self) -> bool {
        self.done.is_closed()
    }
}

pub fn run(
    mut core: PrefillCore,
    mut rx: mpsc::Receiver<Submit>,
    rt: tokio::runtime::Handle,
    counts: Arc<Mutex<Counts>>,
) {
    let mut open = true;
    while open || core.has_work() {
        core.sweep();
        if !core.has_work() && open {
            match rt.block_on(async { tokio::time::timeout(IDLE_TICK, rx.recv()).await }) {
                Ok(Some(s)) => submit(&mut core, s),
                Ok(None) => open = false,
                Err(_) => {}
            }
        }
        while open {
            match rx.try_recv() {
                Ok(s) => submit(&mut core, s),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        if core.has_work() {
            core.step(Instant::now());
        }
        *counts.lock().expect("counts lock is never poisoned") = core.counts();
    }
}

fn submit(core: &mut PrefillCore, s: Submit) {
    let r = core.submit(s.job, Box::new(s.out), Instant::now());
    let _ = s.reply.send(r);
}
