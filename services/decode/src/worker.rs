//! What the decode node's engine thread (`pdmesh_common::worker`) runs: the commands the
//! async side sends the `DecodeCore`, and the output channel each request's tokens go to.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pdmesh_common::ids::Capability;
use pdmesh_common::worker::Core;
use pdmesh_kv_transfer::Granted;
use pdmesh_proto::v1::TransportDescriptor;
use tokio::sync::{mpsc, oneshot};

use crate::core::{Attach, Counts, DecodeCore, Event, Output, Reserved};
use crate::error::DecodeError;

pub type Reply<T> = oneshot::Sender<Result<T, DecodeError>>;

/// Makes a reservation's blocks reachable by peers (a transport's registration of them alone), on the
/// engine thread right after they are allocated: the target to hand out, and the grant the
/// reservation keeps until its KV is complete.
pub struct RemoteGrant(pub Box<GrantFn>);

/// Given a reservation's pool blocks: what peers are granted, or `None` when this one takes
/// its KV over a stream (every staging block is taken).
pub type GrantFn = dyn FnOnce(&[u32]) -> Result<Option<Granted>, String> + Send;

impl std::fmt::Debug for RemoteGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RemoteGrant")
    }
}

#[derive(Debug)]
pub enum Command {
    Reserve {
        prompt_len: usize,
        max_tokens: usize,
        /// Of `max_tokens`, those promised now (the rest as they are generated).
        up_front: usize,
        lease: Option<Duration>,
        remote_kv: bool,
        /// With `remote_kv`, when peers write the KV in place (a one-sided transport).
        grant: Option<RemoteGrant>,
        /// Whose request it is, and its id.
        request: (String, String),
        reply: Reply<(Reserved, Option<TransportDescriptor>)>,
    },
    /// Wire entry points carry the capability `Reserve` handed out; the worker admits it.
    Release {
        cap: Capability,
        reply: oneshot::Sender<bool>,
    },
    KvBegin {
        cap: Capability,
        from: String,
        /// A one-sided session: the sender puts into the blocks itself, into the memory whose grant
        /// has this digest.
        writer: Option<u64>,
        /// The reservation's key, for the transfer's later commands.
        reply: Reply<u64>,
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
        /// How long copying staged blocks into the pool took, when they were staged.
        reply: Reply<Option<Duration>>,
    },
    /// A one-sided session ended: its writer can put no more.
    WriterClosed {
        id: u64,
    },
    KvAbort {
        id: u64,
        why: DecodeError,
    },
    /// A one-sided writer gave up its session; its KV will come over a stream.
    KvWriterAbandoned {
        id: u64,
        reply: Reply<()>,
    },
    Attach {
        cap: Capability,
        attach: Box<Attach>,
        out: ChannelOutput,
        reply: Reply<()>,
    },
    /// Stop taking work and ask running requests to move; replies with the requests held.
    Drain {
        reply: oneshot::Sender<usize>,
    },
    /// A moving request's KV (its key, blocks, tokens covered), to push to its new node.
    Export {
        cap: Capability,
        reply: Reply<(u64, Vec<Vec<u8>>, usize)>,
    },
    /// The moving request's KV reached its new node: end it here.
    Moved {
        id: u64,
    },
    /// Cancel `owner`'s request `request_id`; replies whether the node holds it.
    Cancel {
        owner: String,
        request_id: String,
        reply: oneshot::Sender<bool>,
    },
    /// The moving request stays (no new node, or its KV did not get there).
    Stay {
        cap: Capability,
        reply: Reply<()>,
    },
}

/// Output into a tokio channel sized so that `try_send` never finds it full (a request emits
/// at most max_tokens deltas plus a final delta and one end event).
#[derive(Debug)]
pub struct ChannelOutput(pub mpsc::Sender<Event>);

impl ChannelOutput {
    pub fn channel(max_tokens: usize) -> (Self, mpsc::Receiver<Event>) {
        // Deltas, the final one, the end, and a drain's moving and moved.
        let (tx, rx) = mpsc::channel(max_tokens + 6);
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

/// The decode node's core with what the engine thread keeps beside it.
#[derive(Debug)]
pub struct Worker {
    core: DecodeCore,
    /// Where each transfer comes from, to name the prefill node when it breaks.
    sources: HashMap<u64, String>,
}

impl Worker {
    pub fn new(core: DecodeCore) -> Self {
        Self { core, sources: HashMap::new() }
    }
}

impl Core for Worker {
    type Command = Command;
    type Counts = Counts;

    fn handle(&mut self, cmd: Command, now: Instant) {
        let (core, sources) = (&mut self.core, &mut self.sources);
        match cmd {
            Command::Reserve {
                prompt_len,
                max_tokens,
                up_front,
                lease,
                remote_kv,
                grant,
                request,
                reply,
            } => {
                let r = core
                    .reserve_growing(prompt_len, max_tokens, up_front, lease, remote_kv, now)
                    .and_then(|res| {
                        core.name(res.id(), request.0, request.1);
                        let Some(RemoteGrant(grant)) = grant else { return Ok((res, None)) };
                        match grant(&res.pool_blocks) {
                            Ok(Some(Granted { descriptor, grant, staged })) => {
                                core.hold(res.id(), grant);
                                if let Some(s) = staged {
                                    core.stage(res.id(), s);
                                }
                                Ok((res, Some(descriptor)))
                            }
                            Ok(None) => Ok((res, None)),
                            Err(why) => {
                                core.release(res.id());
                                Err(DecodeError::Remote(why))
                            }
                        }
                    });
                // Its caller is gone (it gave up waiting, e.g. while this node was hung):
                // nobody can name the reservation, so it is freed now rather than at its lease.
                if let Err(Ok((res, _))) = reply.send(r) {
                    tracing::debug!(reservation = res.id(), "reserved for a caller that left");
                    core.release(res.id());
                }
            }
            Command::Release { cap, reply } => {
                // Releasing what you do not hold releases nothing, as for an expired one.
                let released = core.admit(&cap).is_ok_and(|id| {
                    sources.remove(&id);
                    core.release(id)
                });
                let _ = reply.send(released);
            }
            Command::KvBegin { cap, from, writer, reply } => {
                let r = core.admit(&cap).and_then(|id| {
                    if let Some(digest) = writer {
                        core.check_grant(id, digest)?;
                    }
                    core.kv_begin(id, writer.is_some()).map(|()| id)
                });
                if let Ok(id) = r {
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
                let _ = reply.send(core.kv_end(id, blocks, &checksums, now));
                core.revoke_completed();
            }
            Command::WriterClosed { id } => {
                let from = sources.remove(&id).unwrap_or_else(|| "the prefill node".into());
                core.writer_closed(id, &from);
            }
            Command::KvWriterAbandoned { id, reply } => {
                let _ = reply.send(core.writer_abandoned(id));
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
            Command::Attach { cap, attach, out, reply } => {
                let r =
                    core.admit(&cap).and_then(|id| core.attach(id, *attach, Box::new(out), now));
                let _ = reply.send(r);
            }
            Command::Drain { reply } => {
                let _ = reply.send(core.drain());
            }
            Command::Export { cap, reply } => {
                let r = core.admit(&cap).and_then(|id| core.export(id).map(|(b, n)| (id, b, n)));
                let _ = reply.send(r);
            }
            Command::Moved { id } => core.moved(id),
            Command::Cancel { owner, request_id, reply } => {
                let _ = reply.send(core.cancel(&owner, &request_id));
            }
            Command::Stay { cap, reply } => {
                let _ = reply.send(core.admit(&cap).and_then(|id| core.stay(id)));
            }
        }
    }

    fn sweep(&mut self, now: Instant) -> Option<Instant> {
        self.core.sweep(now)
    }

    fn has_work(&mut self) -> bool {
        self.core.has_work()
    }

    fn step(&mut self, now: Instant) {
        if let Err(e) = self.core.step(now) {
            tracing::error!("engine step failed: {e}");
        }
    }

    fn is_idle(&self) -> bool {
        let c = self.core.counts();
        c.reserved + c.transferring + c.quarantined == 0
    }

    fn counts(&self) -> Counts {
        self.core.counts()
    }
}
