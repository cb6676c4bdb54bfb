//! The engine thread: owns the `DecodeCore`, takes commands from the async side through a
//! bounded channel, and steps the continuous batch whenever there is work. Between steps it
//! drains every waiting command (so KV writes never wait behind more than one step), frees
//! expired leases, and notices outputs whose client went away.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::core::{Attach, Counts, DecodeCore, Event, Output, Reserved};
use crate::error::DecodeError;

/// Most commands queued for the engine thread.
pub const COMMAND_QUEUE: usize = 64;
/// Longest the idle thread sleeps before checking leases and closed outputs again.
const IDLE_TICK: Duration = Duration::from_millis(20);

pub type Reply<T> = oneshot::Sender<Result<T, DecodeError>>;

#[derive(Debug)]
pub enum Command {
    Reserve {
        prompt_len: usize,
        max_tokens: usize,
        lease: Option<Duration>,
        remote_kv: bool,
        reply: Reply<Reserved>,
    },
    Release {
        id: u64,
        reply: oneshot::Sender<bool>,
    },
    KvBegin {
        id: u64,
        from: String,
        /// A UCX session: the sender puts into the blocks itself.
        writer: bool,
        reply: Reply<()>,
    },
    KvWrite {
        id: u64,
        first_block: usize,
        data: Bytes,
    },
    KvEnd {
        id: u64,
        blocks: usize,
        checksums: Vec<u64>,
        reply: Reply<()>,
    },
    /// A UCX session ended: its writer can put no more.
    WriterClosed {
        id: u64,
    },
    KvAbort {
        id: u64,
        why: DecodeError,
    },
    Attach {
        id: u64,
        attach: Box<Attach>,
        out: ChannelOutput,
        reply: Reply<()>,
    },
}

/// Output into a tokio channel sized so that `try_send` never finds it full (a request emits
/// at most max_tokens deltas plus a final delta and one end event).
#[derive(Debug)]
pub struct ChannelOutput(pub mpsc::Sender<Event>);

impl ChannelOutput {
    pub fn channel(max_tokens: usize) -> (Self, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(max_tokens + 4);
        (Self(tx), rx)
    }
}

impl Output for ChannelOutput {
    fn send(&mut self, event: Event) -> bool {
        match self.0.try_send(event) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::error!("decode output channel full; the capacity bound is wrong");
                true
            }
        }
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// Runs until every command sender is dropped and no request is left.
pub fn run(
    mut core: DecodeCore,
    mut rx: mpsc::Receiver<Command>,
    rt: tokio::runtime::Handle,
    counts: Arc<Mutex<Counts>>,
) {
    // Where each transfer comes from, to name the prefill node when it breaks.
    let mut sources: std::collections::HashMap<u64, String> = Default::default();
    let mut open = true;
    loop {
        let now = Instant::now();
        let next_lease = core.sweep(now);
        if !core.has_work() {
            if !open && {
                let c = core.counts();
                c.reserved + c.transferring + c.quarantined == 0
            } {
                break;
            }
            let wait =
                next_lease.map_or(IDLE_TICK, |d| d.saturating_duration_since(now)).min(IDLE_TICK);
            if open {
                match rt.block_on(async { tokio::time::timeout(wait, rx.recv()).await }) {
                    Ok(Some(cmd)) => handle(&mut core, cmd, &mut sources),
                    Ok(None) => open = false,
                    Err(_) => {}
                }
            } else {
                std::thread::sleep(wait);
            }
        }
        while open {
            match rx.try_recv() {
                Ok(cmd) => handle(&mut core, cmd, &mut sources),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        if core.has_work()
            && let Err(e) = core.step(Instant::now())
        {
            tracing::error!("engine step failed: {e}");
        }
        *counts.lock().expect("counts lock is never poisoned") = core.counts();
    }
}

fn handle(
    core: &mut DecodeCore,
    cmd: Command,
    sources: &mut std::collections::HashMap<u64, String>,
) {
    let now = Instant::now();
    match cmd {
        Command::Reserve { prompt_len, max_tokens, lease, remote_kv, reply } => {
            let _ = reply.send(core.reserve(prompt_len, max_tokens, lease, remote_kv, now));
        }
        Command::Release { id, reply } => {
            sources.remove(&id);
            let _ = reply.send(core.release(id));
        }
        Command::KvBegin { id, from, writer, reply } => {
            let r = core.kv_begin(id, writer);
            if r.is_ok() {
                sources.insert(id, from);
            }
            let _ = reply.send(r);
        }
        Command::KvWrite { id, first_block, data } => {
            if let Err(e) = core.kv_write(id, first_block, &data) {
                tracing::warn!(reservation = id, "bad KV write: {e}");
                core.kv_abort(id, e);
            }
        }
        Command::KvEnd { id, blocks, checksums, reply } => {
            let _ = reply.send(core.kv_end(id, blocks, &checksums));
        }
        Command::WriterClosed { id } => {
            let from = sources.remove(&id).unwrap_or_else(|| "the prefill node".into());
            core.writer_closed(id, &from);
        }
        Command::KvAbort { id, why } => {
            let from = sources.remove(&id).unwrap_or_default();
            let why = match why {
                DecodeError::TransferBroken { why, .. } => {
                    DecodeError::TransferBroken { from, why }
                }
                other => other,
            };
            core.kv_abort(id, why);
        }
        Command::Attach { id, attach, out, reply } => {
            let _ = reply.send(core.attach(id, *attach, Box::new(out), now));
        }
    }
}
