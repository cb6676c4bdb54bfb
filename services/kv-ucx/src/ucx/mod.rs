//! A small safe layer over UCX for one-sided KV movement: a node (context + worker) whose
//! worker is owned by one progress thread, endpoints made from a peer's packed worker address,
//! registered memory with packed remote keys, and non-blocking put, get and flush whose
//! completions arrive as futures.
//!
//! The progress thread runs a one-thread tokio runtime. It sleeps on the worker's event fd
//! (armed with `ucp_worker_arm`) and on its command channel, so it uses no CPU while idle.
//! Every operation's memory is owned by the operation until UCX reports it complete, so a
//! caller that stops waiting (a cancelled request) never frees memory UCX still reads. A peer
//! that dies fails its endpoint's operations with UCX's status instead of hanging them.

mod ffi;
mod host;
mod peers;
mod seal;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use bytes::Bytes;
use pdmesh_kv_types::{MemoryKind, MemoryRegion};
use tokio::sync::{mpsc, oneshot};

pub use host::HostId;
pub use peers::{Mapped, Peer, Peers};
pub use seal::{new_seal_key, parse_seal_key, read_seal_key, set_seal_key};
use seal::{seal, unseal};

use ffi::{Completion, Context, Ep, EpFailure, MemHandle, Rkey, Worker};

/// What peers may do with a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Get from it (a KV-store's matched blocks).
    RemoteRead,
    /// Put into it (a decode node's reserved blocks).
    RemoteWrite,
    ReadWrite,
}

/// A failed UCX call, with UCX's own words for why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxError {
    #[error("UCX {op} failed: {text}")]
    Status { op: &'static str, code: i8, text: &'static str },
    #[error("UCX {0}: the endpoint's peer failed ({1})")]
    PeerFailed(&'static str, &'static str),
    #[error("the UCX progress thread is gone")]
    Closed,
    #[error("UCX: {0}")]
    Usage(String),
}

impl UcxError {
    fn status(op: &'static str, code: i8) -> Self {
        UcxError::Status { op, code, text: ffi::status_text(code) }
    }
}

/// Backstop for a missed event-fd wakeup: the progress thread also polls this often.
const IDLE_TICK: Duration = Duration::from_millis(100);
/// How long shutdown waits for closing endpoints to be released.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

enum Cmd {
    Connect { remote: Bytes, peer_failure: bool, reply: oneshot::Sender<Result<u64, UcxError>> },
    Unpack { ep: u64, packed: Bytes, reply: oneshot::Sender<Result<u64, UcxError>> },
    DropRkey { ep: u64, rkey: u64 },
    Put { ep: u64, rkey: u64, data: Bytes, remote: u64, done: Completion },
    Get { ep: u64, rkey: u64, len: usize, remote: u64, done: Completion },
    Ptr { ep: u64, rkey: u64, remote: u64, reply: oneshot::Sender<Result<usize, UcxError>> },
    Flush { ep: u64, done: oneshot::Sender<Result<(), UcxError>> },
    Close { ep: u64 },
}

struct Inner {
    name: String,
    peer_failure: bool,
    tx: mpsc::UnboundedSender<Cmd>,
    address: Bytes,
    ctx: Arc<Context>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel stops the loop; joining means no endpoint outlives the node.
        let (tx, _) = mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take())
            && t.join().is_err()
        {
            tracing::error!(node = self.name, "UCX progress thread panicked");
        }
    }
}

/// One process's UCX presence: a context, a worker and the thread that progresses it.
/// Cheap to clone; the thread stops when the last clone (and every endpoint) is dropped.
#[derive(Clone)]
pub struct UcxNode {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for UcxNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxNode").field("name", &self.inner.name).finish()
    }
}

impl UcxNode {
    /// Starts a node whose endpoints detect peer failure (see `start_with`).
    pub fn start(name: &str) -> Result<Self, UcxError> {
        Self::start_with(name, true)
    }

    /// Starts a node. `name` labels its thread and logs. With `peer_failure` its endpoints
    /// fail operations on a peer that died (UCX's peer error mode), which UCX provides on
    /// RDMA and TCP but not over shared memory; without it UCX may use single-copy shared
    /// memory (CMA) between processes of one host, and a dead peer is noticed through the
    /// control path instead. Fails with UCX's status when UCX cannot initialise (e.g.
    /// `UCX_TLS` names no usable transport).
    pub fn start_with(name: &str, peer_failure: bool) -> Result<Self, UcxError> {
        let ctx = Arc::new(Context::new()?);
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_ctx = Arc::clone(&ctx);
        let thread_name = name.to_string();
        let thread = std::thread::Builder::new()
            .name(format!("ucx-{name}"))
            .spawn(move || progress_thread(&thread_name, &thread_ctx, rx, ready_tx))
            .map_err(|e| UcxError::Usage(format!("cannot start the progress thread: {e}")))?;
        let address = match ready_rx.recv() {
            Ok(Ok(a)) => seal(&[HostId::here().to_bytes().as_slice(), &a].concat()),
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(UcxError::Closed);
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                name: name.to_string(),
                peer_failure,
                tx,
                address,
                ctx,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// The packed worker address peers connect to (sealed, see `seal`).
    pub fn address(&self) -> &Bytes {
        &self.inner.address
    }

    /// Makes an endpoint to the worker whose sealed address is `remote`. Refuses a peer that
    /// UCX would wrongly take for one it shares memory with (`HostId::check`).
    pub async fn connect(&self, remote: Bytes) -> Result<Endpoint, UcxError> {
        let remote = unseal(&remote, "worker address")?;
        let (host, remote) = HostId::split(&remote)
            .ok_or_else(|| UcxError::Usage("malformed UCX worker address: too short".into()))?;
        HostId::here().check(&host)?;
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Connect { remote, peer_failure: self.inner.peer_failure, reply })?;
        let id = rx.await.map_err(|_| UcxError::Closed)??;
        Ok(Endpoint { node: self.clone(), id })
    }

    /// Registers `memory` so peers can put into and get from it; the region's packed remote
    /// key is what they need. The registration keeps the memory allocated (the region holds
    /// it) and is undone before the region lets go of it.
    pub fn register(&self, memory: &MemoryRegion) -> Result<Region, UcxError> {
        self.register_within(memory, 0, memory.len(), Access::ReadWrite)
    }

    /// Registers `[offset, offset + len)` of `memory` for `access` only.
    pub fn register_within(
        &self,
        memory: &MemoryRegion,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<Region, UcxError> {
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > memory.len()) {
            return Err(UcxError::Usage(format!(
                "cannot register {len} bytes at {offset} of a {}-byte region",
                memory.len()
            )));
        }
        let cuda = matches!(memory.kind(), MemoryKind::Cuda { .. });
        if !self.reaches(memory.kind()) {
            return Err(UcxError::Usage(format!(
                "this UCX reaches host memory only, not {} memory (it has no CUDA transport)",
                memory.kind().name()
            )));
        }
        let (read, write) = match access {
            Access::RemoteRead => (true, false),
            Access::RemoteWrite => (false, true),
            Access::ReadWrite => (true, true),
        };
        let addr = memory.addr() + offset;
        // SAFETY: a `MemoryRegion` names one fixed allocation that stays allocated while it
        // lives, and the range is inside it; `Region` holds it until after the unmap.
        #[allow(unsafe_code)]
        let (memh, rkey) = unsafe { self.inner.ctx.map(addr, len, read, write, cuda)? };
        let rkey = seal(&rkey);
        Ok(Region {
            _mapping: Mapping { ctx: Arc::clone(&self.inner.ctx), memh: Some(memh) },
            rkey,
            base: addr as u64,
            _memory: memory.clone(),
        })
    }

    /// Whether peers can reach memory of `kind` through this node: host memory always, a
    /// CUDA device's when UCX was built with CUDA and a transport for it loaded.
    pub fn reaches(&self, kind: MemoryKind) -> bool {
        match kind {
            MemoryKind::Host => true,
            MemoryKind::Cuda { .. } => self.inner.ctx.reaches_cuda().unwrap_or_else(|e| {
                tracing::debug!(node = self.inner.name, "cannot ask UCX for memory types: {e}");
                false
            }),
        }
    }

    /// Allocates `len` zeroed bytes through UCX, readable and writable by peers holding the
    /// returned key. UCX allocates in System V shared memory when it can (its default
    /// allocation priority), so a peer on this host can map the memory itself (`local_ptr`)
    /// and write it with one memcpy instead of through a transport.
    pub fn allocate(&self, len: usize) -> Result<Allocation, UcxError> {
        if len == 0 {
            return Err(UcxError::Usage("cannot allocate 0 bytes".into()));
        }
        let (memh, addr, rkey) = self.inner.ctx.allocate(len)?;
        let keep = Arc::new(Mapping { ctx: Arc::clone(&self.inner.ctx), memh: Some(memh) });
        Ok(Allocation { addr, len, rkey: seal(&rkey), keep })
    }

    fn send(&self, cmd: Cmd) -> Result<(), UcxError> {
        self.inner.tx.send(cmd).map_err(|_| UcxError::Closed)
    }
}

/// Memory UCX allocated (`UcxNode::allocate`): the address, the length, the sealed key of the
/// whole allocation, and what keeps it allocated.
pub struct Allocation {
    pub addr: usize,
    pub len: usize,
    pub rkey: Bytes,
    /// Unmaps (frees) the memory when the last clone drops.
    pub keep: Arc<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

/// A `ucp_mem_map` of a context (a registration, or memory UCX allocated), unmapped when
/// dropped.
struct Mapping {
    ctx: Arc<Context>,
    memh: Option<MemHandle>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some(m) = self.memh.take()
            && let Err(e) = self.ctx.unmap(m)
        {
            tracing::error!("{e}");
        }
    }
}

// SAFETY: the handle is only touched in `Drop` (`&mut self`); the context's unmap is
// thread-safe (see `Context`).
#[allow(unsafe_code)]
unsafe impl Sync for Mapping {}

/// Registered memory. Dropping it unregisters the memory, then lets go of it (fields drop
/// in order).
pub struct Region {
    _mapping: Mapping,
    rkey: Bytes,
    base: u64,
    _memory: MemoryRegion,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("base", &self.base).field("memory", &self._memory).finish()
    }
}

impl Region {
    /// The packed remote key peers unpack to reach this region.
    pub fn rkey(&self) -> &Bytes {
        &self.rkey
    }

    /// The region's first address, as peers address it.
    pub fn base(&self) -> u64 {
        self.base
    }
}

/// A connection to one peer worker. Dropping it closes it (after its operations finish).
pub struct Endpoint {
    node: UcxNode,
    id: u64,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").field("id", &self.id).finish()
    }
}

impl Endpoint {
    /// Unpacks a peer region's (sealed) remote key for use on this endpoint.
    pub async fn remote_key(&self, packed: Bytes) -> Result<RemoteKey, UcxError> {
        let packed = unseal(&packed, "remote key")?;
        let (reply, rx) = oneshot::channel();
        self.node.send(Cmd::Unpack { ep: self.id, packed, reply })?;
        let id = rx.await.map_err(|_| UcxError::Closed)??;
        Ok(RemoteKey { node: self.node.clone(), ep: self.id, id })
    }

    /// Starts writing `data` at `remote` in the peer region of `rkey`. The returned future
    /// resolves when the data has left this side's buffer; `flush` says when it landed.
    /// Dropping the future does not cancel the write.
    pub fn put(&self, data: Bytes, remote: u64, rkey: &RemoteKey) -> Pending<()> {
        let (tx, rx) = oneshot::channel();
        let done = Completion::Unit(tx);
        match self.check_key(rkey) {
            Ok(()) => self.issue(Cmd::Put { ep: self.id, rkey: rkey.id, data, remote, done }),
            Err(e) => complete_unit(done, Err(e)),
        }
        Pending(rx)
    }

    /// Reads `len` bytes at `remote` in the peer region of `rkey`.
    pub fn get(&self, len: usize, remote: u64, rkey: &RemoteKey) -> Pending<Vec<u8>> {
        let (tx, rx) = oneshot::channel();
        match self.check_key(rkey) {
            Ok(()) => self.issue(Cmd::Get {
                ep: self.id,
                rkey: rkey.id,
                len,
                remote,
                done: Completion::Data(tx),
            }),
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
        Pending(rx)
    }

    /// Where the peer's address `remote`, in the region of `rkey`, is mapped in this process:
    /// the peer's memory is shared memory on this host that UCX attached for the key. Fails
    /// (with UCX's status) for a peer elsewhere or memory UCX cannot map. The mapping lives
    /// as long as the key and this endpoint both do.
    pub async fn local_ptr(&self, rkey: &RemoteKey, remote: u64) -> Result<usize, UcxError> {
        self.check_key(rkey)?;
        let (reply, rx) = oneshot::channel();
        self.node.send(Cmd::Ptr { ep: self.id, rkey: rkey.id, remote, reply })?;
        rx.await.map_err(|_| UcxError::Closed)?
    }

    /// Resolves when everything issued on this endpoint before it is complete at the peer.
    pub fn flush(&self) -> Pending<()> {
        let (tx, rx) = oneshot::channel();
        self.issue(Cmd::Flush { ep: self.id, done: tx });
        Pending(rx)
    }

    fn check_key(&self, rkey: &RemoteKey) -> Result<(), UcxError> {
        if rkey.ep == self.id && Arc::ptr_eq(&rkey.node.inner, &self.node.inner) {
            Ok(())
        } else {
            Err(UcxError::Usage("a remote key was used on another endpoint than its own".into()))
        }
    }

    fn issue(&self, cmd: Cmd) {
        // A closed channel drops the command, whose completion sender then reports Closed.
        let _ = self.node.send(cmd);
    }
}

fn complete_unit(done: Completion, r: Result<(), UcxError>) {
    if let Completion::Unit(tx) = done {
        let _ = tx.send(r);
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = self.node.send(Cmd::Close { ep: self.id });
    }
}

/// A peer region's remote key unpacked on one endpoint.
pub struct RemoteKey {
    node: UcxNode,
    ep: u64,
    id: u64,
}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey").field("ep", &self.ep).field("id", &self.id).finish()
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        let _ = self.node.send(Cmd::DropRkey { ep: self.ep, rkey: self.id });
    }
}

/// The outcome of one operation.
#[derive(Debug)]
pub struct Pending<T>(oneshot::Receiver<Result<T, UcxError>>);

impl<T> Pending<T> {
    /// The outcome, if the operation is over.
    pub fn try_take(&mut self) -> Option<Result<T, UcxError>> {
        match self.0.try_recv() {
            Ok(r) => Some(r),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(UcxError::Closed)),
        }
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T, UcxError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map(|r| r.unwrap_or(Err(UcxError::Closed)))
    }
}

struct EpState {
    ep: Ep,
    failure: Box<EpFailure>,
    rkeys: HashMap<u64, Rkey>,
}

/// What the progress thread owns.
/// An endpoint being closed: its completion, and the error cell UCX may write until then.
type Closing = (oneshot::Receiver<Result<(), UcxError>>, Box<EpFailure>);

/// A flush UCX is working on: endpoint, UCX's completion, and the caller's.
type Flushing =
    (u64, oneshot::Receiver<Result<(), UcxError>>, oneshot::Sender<Result<(), UcxError>>);

/// Field order is drop order: remote keys go before the worker is destroyed, and the error
/// cells of closing endpoints outlive it (UCX may call a handler while destroying).
struct State {
    name: String,
    eps: HashMap<u64, EpState>,
    worker: Worker,
    closing: Vec<Closing>,
    flushing: Vec<Flushing>,
    next_id: u64,
}

impl State {
    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Connect { remote, peer_failure, reply } => {
                let mut failure = Box::<EpFailure>::default();
                let r = self.worker.connect(&remote, &mut *failure, peer_failure).map(|ep| {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.eps.insert(id, EpState { ep, failure, rkeys: HashMap::new() });
                    id
                });
                let _ = reply.send(r);
            }
            Cmd::Unpack { ep, packed, reply } => {
                let id = self.next_id;
                let r = self.live(ep, "rkey unpack").and_then(|s| s.ep.unpack(&packed)).map(|k| {
                    self.next_id += 1;
                    self.eps.get_mut(&ep).expect("checked live above").rkeys.insert(id, k);
                    id
                });
                let _ = reply.send(r);
            }
            Cmd::DropRkey { ep, rkey } => {
                if let Some(s) = self.eps.get_mut(&ep) {
                    s.rkeys.remove(&rkey);
                }
            }
            Cmd::Put { ep, rkey, data, remote, done } => match self.key(ep, rkey, "put") {
                Ok((s, k)) => s.ep.put(data, remote, k, done),
                Err(e) => complete_unit(done, Err(e)),
            },
            Cmd::Get { ep, rkey, len, remote, done } => match self.key(ep, rkey, "get") {
                Ok((s, k)) => s.ep.get(len, remote, k, done),
                Err(e) => {
                    if let Completion::Data(tx) = done {
                        let _ = tx.send(Err(e));
                    }
                }
            },
            Cmd::Ptr { ep, rkey, remote, reply } => {
                let _ = reply.send(self.key(ep, rkey, "rkey ptr").and_then(|(_, k)| k.ptr(remote)));
            }
            Cmd::Flush { ep, done } => match self.live(ep, "flush") {
                Ok(s) => {
                    let (tx, rx) = oneshot::channel();
                    s.ep.flush(Completion::Unit(tx));
                    self.flushing.push((ep, rx, done));
                }
                Err(e) => {
                    let _ = done.send(Err(e));
                }
            },
            Cmd::Close { ep } => self.close(ep),
        }
    }

    fn live(&self, ep: u64, op: &'static str) -> Result<&EpState, UcxError> {
        let s = self.eps.get(&ep).ok_or(UcxError::Usage(format!("{op}: endpoint is closed")))?;
        match s.failure.0 {
            Some(st) => Err(UcxError::PeerFailed(op, ffi::status_text(st))),
            None => Ok(s),
        }
    }

    fn key(&self, ep: u64, rkey: u64, op: &'static str) -> Result<(&EpState, &Rkey), UcxError> {
        let s = self.live(ep, op)?;
        let k = s.rkeys.get(&rkey).ok_or(UcxError::Usage(format!("{op}: remote key is gone")))?;
        Ok((s, k))
    }

    fn close(&mut self, ep: u64) {
        if let Some(s) = self.eps.remove(&ep) {
            let EpState { ep, failure, rkeys } = s;
            drop(rkeys);
            let (tx, rx) = oneshot::channel();
            // A failed endpoint has nothing left to flush: force it closed.
            ep.close(failure.0.is_some(), Completion::Unit(tx));
            self.closing.push((rx, failure));
        }
    }

    fn reap(&mut self) {
        self.closing.retain_mut(|(rx, _)| {
            matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty))
        });
        // UCX completes the flush of an endpoint whose peer died once it purges what was in
        // flight, with success: nothing is left to flush. But what was put never arrived,
        // and a flush promises that it did, so the endpoint's failure is the answer.
        for (ep, mut rx, done) in std::mem::take(&mut self.flushing) {
            let r = match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => {
                    self.flushing.push((ep, rx, done));
                    continue;
                }
                Ok(r) => r,
                Err(oneshot::error::TryRecvError::Closed) => Err(UcxError::Closed),
            };
            let _ = done.send(r.and_then(|()| self.live(ep, "flush").map(|_| ())));
        }
    }

    /// Progresses until nothing more happens, then arms the event fd. False: not armed yet.
    fn settle(&mut self) -> bool {
        while self.worker.progress() {}
        self.reap();
        match self.worker.arm() {
            Ok(armed) => armed,
            Err(e) => {
                tracing::error!(node = self.name, "{e}");
                false
            }
        }
    }
}

fn progress_thread(
    name: &str,
    ctx: &Context,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    ready: std::sync::mpsc::Sender<Result<Bytes, UcxError>>,
) {
    let setup = || -> Result<(Worker, tokio::runtime::Runtime), UcxError> {
        let worker = Worker::new(ctx)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| UcxError::Usage(format!("cannot build the progress runtime: {e}")))?;
        Ok((worker, rt))
    };
    let (worker, rt) = match setup() {
        Ok(x) => x,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let fd = match worker.address().and_then(|a| Ok((a, worker.event_fd()?))) {
        Ok((address, fd)) => {
            let _ = ready.send(Ok(address));
            fd
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut st = State {
        name: name.into(),
        eps: HashMap::new(),
        worker,
        closing: Vec::new(),
        flushing: Vec::new(),
        next_id: 1,
    };
    rt.block_on(async {
        let afd = match st.worker.watch(fd) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(node = st.name, "cannot watch the UCX event fd: {e}");
                return;
            }
        };
        'run: loop {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => st.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => break 'run,
                }
            }
            if !st.settle() {
                // Events are pending (or arming failed): progress again before sleeping.
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(cmd) => st.handle(cmd),
                    None => break 'run,
                },
                ready = afd.readable() => {
                    if let Ok(mut g) = ready {
                        g.clear_ready();
                    }
                }
                () = tokio::time::sleep(IDLE_TICK) => {}
            }
        }
        // Shutdown: close every endpoint (cancelling what is in flight) and wait for UCX to
        // release them, so the worker is destroyed with nothing outstanding.
        let ids: Vec<u64> = st.eps.keys().copied().collect();
        for id in ids {
            if let Some(s) = st.eps.get_mut(&id) {
                s.failure.0.get_or_insert(ucx_rs::sys::ucs_status_t_UCS_ERR_CANCELED);
            }
            st.close(id);
        }
        let deadline = tokio::time::Instant::now() + CLOSE_GRACE;
        while !st.closing.is_empty() && tokio::time::Instant::now() < deadline {
            while st.worker.progress() {}
            st.reap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if !st.closing.is_empty() {
            tracing::warn!(
                node = st.name,
                "{} UCX endpoints did not close in time",
                st.closing.len()
            );
        }
    });
    drop(st);
}
