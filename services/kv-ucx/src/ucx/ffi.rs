//! The only code in pdmesh that calls UCX: thin wrappers over `ucx_rs::sys` that turn raw
//! handles into owned values, statuses into `UcxError`, and the tri-state result of every
//! `*_nbx` call into one completion path. Everything here runs on the progress thread that owns
//! the worker (the worker is created in single-thread mode), except `Context`, which UCX lets
//! any thread use for memory mapping.
#![allow(unsafe_code)]

use std::ffi::{CString, c_void};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr;

use bytes::Bytes;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use ucx_rs::sys;

use super::UcxError;

fn check(op: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::ucs_status_t_UCS_OK { Ok(()) } else { Err(UcxError::status(op, status)) }
}

/// Settings pdmesh changes from UCX's defaults, unless the environment sets them.
/// Shared-memory transports report a dead peer only with `POSIX_ERROR_HANDLING` on; without
/// it, endpoints that detect peer failure (pdmesh's) reach a process on the same host over TCP
/// alone. `ALLOC_PRIO` makes memory UCX allocates (a decode node's KV pool) System V shared
/// memory, which a peer on the host can map, or nothing: the node then allocates the pool
/// itself. Not POSIX shared memory: that is a file in /dev/shm, often a small tmpfs in
/// containers, where a pool larger than it allocates fine and faults (SIGBUS) when touched.
const DEFAULTS: &[(&str, &str)] = &[("POSIX_ERROR_HANDLING", "y"), ("ALLOC_PRIO", "md:sysv")];

/// A UCP context with the RMA and wakeup features. UCX reads its `UCX_*` environment
/// variables (transports, devices, logging) here.
#[derive(Debug)]
pub(super) struct Context(sys::ucp_context_h);

// SAFETY: a UCP context is created with `mt_workers_shared`, which makes the context-level
// calls used from other threads (`ucp_mem_map`, `ucp_mem_unmap`, `ucp_rkey_pack`) thread-safe.
unsafe impl Send for Context {}
// SAFETY: as above; the handle itself is never mutated after creation.
unsafe impl Sync for Context {}

impl Context {
    pub(super) fn new() -> Result<Self, UcxError> {
        // SAFETY: the params struct is plain old data for which all-zero is the documented
        // "no field set" state; only the fields named in field_mask are read.
        let mut params: sys::ucp_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        params.field_mask = (sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES
            | sys::ucp_params_field_UCP_PARAM_FIELD_MT_WORKERS_SHARED)
            as u64;
        params.features =
            (sys::ucp_feature_UCP_FEATURE_RMA | sys::ucp_feature_UCP_FEATURE_WAKEUP) as u64;
        params.mt_workers_shared = 1;
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix and file make UCX read its `UCX_*` environment; `config` is
        // released below on every path.
        check("ucp_config_read", unsafe {
            sys::ucp_config_read(ptr::null(), ptr::null(), &mut config)
        })?;
        for (name, value) in DEFAULTS {
            if std::env::var_os(format!("UCX_{name}")).is_some() {
                continue; // The operator's setting wins.
            }
            let (n, v) = (CString::new(*name), CString::new(*value));
            let (Ok(n), Ok(v)) = (n, v) else { continue };
            // SAFETY: `config` is live; both strings are NUL-terminated and outlive the call.
            let st = unsafe { sys::ucp_config_modify(config, n.as_ptr(), v.as_ptr()) };
            if st != sys::ucs_status_t_UCS_OK {
                tracing::debug!("UCX_{name}={value} not applied: {}", status_text(st));
            }
        }
        let mut ctx: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: `ucp_init` is a static inline; `ucp_init_version` with the header's API
        // version is its real entry point. `params`, `config` and `ctx` outlive the call.
        let st = unsafe {
            sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config, &mut ctx)
        };
        // SAFETY: read above and no longer needed: UCX copied what it uses.
        unsafe { sys::ucp_config_release(config) };
        check("ucp_init", st)?;
        Ok(Self(ctx))
    }

    /// Whether this context's transports reach memory of CUDA devices (UCX built with CUDA
    /// and a `cuda_copy`, `cuda_ipc` or GPUDirect-capable transport loaded).
    pub(super) fn reaches_cuda(&self) -> Result<bool, UcxError> {
        // SAFETY: all-zero is the empty attribute query; only the memory types are asked for.
        let mut attr: sys::ucp_context_attr_t = unsafe { MaybeUninit::zeroed().assume_init() };
        attr.field_mask = sys::ucp_context_attr_field_UCP_ATTR_FIELD_MEMORY_TYPES as u64;
        // SAFETY: the context is live and `attr` outlives the call.
        check("ucp_context_query", unsafe { sys::ucp_context_query(self.0, &mut attr) })?;
        Ok(attr.memory_types & (1 << sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA) != 0)
    }

    /// Registers `[addr, addr + len)` (host memory, or a CUDA device's when `cuda`) for
    /// remote access and packs its remote key.
    ///
    /// # Safety
    /// The memory must stay allocated (and not move) until the returned handle is passed to
    /// `unmap`: remote peers holding the key write into it.
    pub(super) unsafe fn map(
        &self,
        addr: usize,
        len: usize,
        remote_read: bool,
        remote_write: bool,
        cuda: bool,
    ) -> Result<(MemHandle, Bytes), UcxError> {
        // SAFETY: all-zero is the empty parameter set; the address, length, protection and
        // (for device memory) memory type fields are set and flagged below.
        let mut p: sys::ucp_mem_map_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.field_mask = (sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_PROT)
            as u64;
        if cuda {
            // Said rather than detected: UCX would otherwise probe the pointer on every map.
            p.field_mask |=
                sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as u64;
            p.memory_type = sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA;
        }
        p.address = addr as *mut c_void;
        p.length = len;
        let mut prot = sys::UCP_MEM_MAP_PROT_LOCAL_READ | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE;
        if remote_read {
            prot |= sys::UCP_MEM_MAP_PROT_REMOTE_READ;
        }
        if remote_write {
            prot |= sys::UCP_MEM_MAP_PROT_REMOTE_WRITE;
        }
        p.prot = prot as _;
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the context is live; the caller guarantees the memory outlives the mapping.
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(self.0, &p, &mut memh) })?;
        let memh = MemHandle(memh);
        match self.pack(memh.0) {
            Ok(rkey) => Ok((memh, rkey)),
            Err(e) => {
                let _ = self.unmap(memh);
                Err(e)
            }
        }
    }

    /// Allocates `len` bytes that UCX maps for remote write and read, in the memory its
    /// allocation priority picks first (System V shared memory by default, which a peer on
    /// the same host can map through `Rkey::ptr`). Returns the handle, the address and the
    /// packed remote key of the whole allocation. The memory is zero (fresh pages) and lives
    /// until the handle is unmapped.
    pub(super) fn allocate(&self, len: usize) -> Result<(MemHandle, usize, Bytes), UcxError> {
        // SAFETY: all-zero is the empty parameter set; length, flags and protection are set
        // and flagged below (no address: UCX picks it).
        let mut p: sys::ucp_mem_map_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.field_mask = (sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_FLAGS
            | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_PROT)
            as u64;
        p.length = len;
        p.flags = sys::UCP_MEM_MAP_ALLOCATE as _;
        p.prot = (sys::UCP_MEM_MAP_PROT_LOCAL_READ
            | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
            | sys::UCP_MEM_MAP_PROT_REMOTE_READ
            | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE) as _;
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the context is live; UCX owns the allocation until `unmap`.
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(self.0, &p, &mut memh) })?;
        let memh = MemHandle(memh);
        // SAFETY: all-zero is the empty attribute query; address and length are asked for.
        let mut attr: sys::ucp_mem_attr_t = unsafe { MaybeUninit::zeroed().assume_init() };
        attr.field_mask = (sys::ucp_mem_attr_field_UCP_MEM_ATTR_FIELD_ADDRESS
            | sys::ucp_mem_attr_field_UCP_MEM_ATTR_FIELD_LENGTH) as u64;
        // SAFETY: `memh` was just mapped on this context.
        let queried = check("ucp_mem_query", unsafe { sys::ucp_mem_query(memh.0, &mut attr) });
        let packed = queried.and_then(|()| {
            if attr.address.is_null() || attr.length < len {
                return Err(UcxError::Usage(format!(
                    "UCX allocated {} bytes at {:p} for {len}",
                    attr.length, attr.address
                )));
            }
            self.pack(memh.0)
        });
        match packed {
            Ok(rkey) => Ok((memh, attr.address as usize, rkey)),
            Err(e) => {
                let _ = self.unmap(memh);
                Err(e)
            }
        }
    }

    /// The packed remote key of a mapping of this context.
    fn pack(&self, memh: sys::ucp_mem_h) -> Result<Bytes, UcxError> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: `memh` was just mapped on this context; `ucp_rkey_pack` is the packer that
        // works on UCX 1.22 (see the ucx-rs crate docs).
        let st = unsafe { sys::ucp_rkey_pack(self.0, memh, &mut buf, &mut size) };
        check("ucp_rkey_pack", st)?;
        // SAFETY: UCX returned a buffer of `size` bytes; it is copied before being released
        // with the matching release call.
        Ok(unsafe {
            let packed = Bytes::copy_from_slice(std::slice::from_raw_parts(buf as *const u8, size));
            sys::ucp_rkey_buffer_release(buf);
            packed
        })
    }

    pub(super) fn unmap(&self, memh: MemHandle) -> Result<(), UcxError> {
        // SAFETY: `MemHandle`s only come from `map` on this context and are consumed here, so
        // each mapping is unmapped exactly once.
        check("ucp_mem_unmap", unsafe { sys::ucp_mem_unmap(self.0, memh.0) })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker of this context is destroyed before the context is dropped
        // (the progress thread owns both and drops the worker first).
        unsafe { sys::ucp_cleanup(self.0) };
    }
}

/// A registered memory region's handle.
#[derive(Debug)]
pub(super) struct MemHandle(sys::ucp_mem_h);

// SAFETY: a memory handle is an opaque token that the thread-safe context calls accept from
// any thread.
unsafe impl Send for MemHandle {}

/// A UCP worker in single-thread mode: only the progress thread touches it.
pub(super) struct Worker(sys::ucp_worker_h);

impl Worker {
    pub(super) fn new(ctx: &Context) -> Result<Self, UcxError> {
        // SAFETY: all-zero is the empty parameter set; the thread mode is set and flagged.
        let mut p: sys::ucp_worker_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.field_mask = sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
        p.thread_mode = sys::ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
        let mut w: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: the context is live and outlives the worker (see `Context::drop`).
        check("ucp_worker_create", unsafe { sys::ucp_worker_create(ctx.0, &p, &mut w) })?;
        Ok(Self(w))
    }

    /// The packed address peers create endpoints from.
    pub(super) fn address(&self) -> Result<Bytes, UcxError> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is live; the returned buffer is copied then released.
        unsafe {
            check(
                "ucp_worker_get_address",
                sys::ucp_worker_get_address(self.0, &mut addr, &mut len),
            )?;
            let out = Bytes::copy_from_slice(std::slice::from_raw_parts(addr as *const u8, len));
            sys::ucp_worker_release_address(self.0, addr);
            Ok(out)
        }
    }

    pub(super) fn event_fd(&self) -> Result<RawFd, UcxError> {
        let mut fd: RawFd = -1;
        // SAFETY: the worker was made by a context with the WAKEUP feature.
        check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(self.0, &mut fd) })?;
        Ok(fd)
    }

    /// Registers the event fd with the current tokio reactor.
    pub(super) fn watch(&self, fd: RawFd) -> std::io::Result<AsyncFd<EventFd>> {
        // SAFETY: the fd belongs to this worker and stays open until the worker is destroyed;
        // the progress loop drops the `AsyncFd` before the worker.
        unsafe { AsyncFd::register_with_interest(EventFd(fd), Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
    }

    /// Runs callbacks of finished operations; true when something happened.
    pub(super) fn progress(&self) -> bool {
        // SAFETY: called only on the thread that owns the worker.
        unsafe { sys::ucp_worker_progress(self.0) != 0 }
    }

    /// Arms the event fd. `Ok(false)` means events are pending: progress again first.
    pub(super) fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: called only on the owning thread.
        let st = unsafe { sys::ucp_worker_arm(self.0) };
        if st == sys::ucs_status_t_UCS_ERR_BUSY {
            return Ok(false);
        }
        check("ucp_worker_arm", st).map(|()| true)
    }

    /// Creates an endpoint to the worker at `remote`. With `peer_failure` a peer that dies
    /// fails the endpoint's operations instead of hanging them, and `flag` is set; UCX then
    /// uses only transports that can detect that (on one host: not shared memory).
    pub(super) fn connect(
        &self,
        remote: &[u8],
        flag: *mut EpFailure,
        peer_failure: bool,
    ) -> Result<Ep, UcxError> {
        // SAFETY: all-zero is the empty parameter set; the fields used are flagged below.
        let mut p: sys::ucp_ep_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.field_mask = (sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLER)
            as u64;
        p.address = remote.as_ptr() as *const sys::ucp_address_t;
        p.err_mode = if peer_failure {
            sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER
        } else {
            sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_NONE
        };
        p.err_handler.cb = Some(on_ep_error);
        p.err_handler.arg = flag as *mut c_void;
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: `remote` is a packed worker address (UCX validates its contents and fails
        // cleanly on garbage); `flag` is a heap cell the caller keeps alive until the endpoint
        // is closed, which is when UCX stops calling the handler.
        check("ucp_ep_create", unsafe { sys::ucp_ep_create(self.0, &p, &mut ep) })?;
        Ok(Ep(ep))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: every endpoint of the worker has been closed by the progress loop first.
        unsafe { sys::ucp_worker_destroy(self.0) };
    }
}

/// The worker's event fd, borrowed for tokio's reactor.
pub(super) struct EventFd(RawFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Where an endpoint's error handler records the failure.
#[derive(Debug, Default)]
pub(super) struct EpFailure(pub(super) Option<sys::ucs_status_t>);

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the `EpFailure` box registered in `connect`, alive until the endpoint is
    // closed; the handler runs inside `ucp_worker_progress` on the owning thread, the only
    // thread that reads the cell.
    unsafe { (*(arg as *mut EpFailure)).0 = Some(status) };
}

pub(super) fn status_text(status: sys::ucs_status_t) -> &'static str {
    ucx_rs::status_string(status)
}

/// An endpoint handle (owned by the progress thread's table).
pub(super) struct Ep(sys::ucp_ep_h);

/// An unpacked remote key, tied to the endpoint it was unpacked on.
pub(super) struct Rkey(sys::ucp_rkey_h);

impl Ep {
    pub(super) fn unpack(&self, packed: &[u8]) -> Result<Rkey, UcxError> {
        let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: UCX parses the buffer and reports a malformed one as an error status.
        let st =
            unsafe { sys::ucp_ep_rkey_unpack(self.0, packed.as_ptr() as *const c_void, &mut rkey) };
        check("ucp_ep_rkey_unpack", st)?;
        Ok(Rkey(rkey))
    }

    /// Writes `data` to `remote` in the peer's memory. The op owns `data` until it completes.
    pub(super) fn put(&self, data: Bytes, remote: u64, rkey: &Rkey, done: Completion) {
        let (ptr, len) = (data.as_ptr(), data.len());
        let op = Box::new(Op { name: "put", done, keep: Keep::Put(data) });
        // SAFETY: `ptr..ptr+len` stays valid because the op box owning `data` is freed only
        // when the operation completed (immediately, with an error, or in the callback).
        submit(op, |param| unsafe {
            sys::ucp_put_nbx(self.0, ptr as *const c_void, len, remote, rkey.0, param)
        });
    }

    /// Reads `len` bytes at `remote` in the peer's memory.
    pub(super) fn get(&self, len: usize, remote: u64, rkey: &Rkey, done: Completion) {
        let mut buf = vec![0u8; len];
        let ptr = buf.as_mut_ptr();
        let op = Box::new(Op { name: "get", done, keep: Keep::Get(buf) });
        // SAFETY: the buffer's heap allocation is owned by the op box and does not move when
        // the box's Vec header does; it is handed to the caller only after completion.
        submit(op, |param| unsafe {
            sys::ucp_get_nbx(self.0, ptr as *mut c_void, len, remote, rkey.0, param)
        });
    }

    /// Completes when every put and get issued on the endpoint before it has completed at
    /// the peer too.
    pub(super) fn flush(&self, done: Completion) {
        let op = Box::new(Op { name: "flush", done, keep: Keep::None });
        // SAFETY: the endpoint is live (closed only by `close`, which consumes it).
        submit(op, |param| unsafe { sys::ucp_ep_flush_nbx(self.0, param) });
    }

    /// Closes the endpoint, cancelling what is still in flight when `force` (their callbacks
    /// then report an error). `done` fires when UCX has released it.
    pub(super) fn close(self, force: bool, done: Completion) {
        let op = Box::new(Op { name: "endpoint close", done, keep: Keep::None });
        let ep = self.0;
        submit_flags(
            op,
            if force { sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE } else { 0 },
            // SAFETY: `self` is consumed, so the handle is never used after closing.
            |param| unsafe { sys::ucp_ep_close_nbx(ep, param) },
        );
    }
}

impl Rkey {
    /// Where the peer's `remote` is mapped in this process, when the key's memory can be
    /// reached directly (shared memory of a peer on this host); an error otherwise.
    pub(super) fn ptr(&self, remote: u64) -> Result<usize, UcxError> {
        let mut local: *mut c_void = ptr::null_mut();
        // SAFETY: the key is live; UCX maps the peer's segment (once per key) and reports
        // an unreachable or unsupported one as an error status.
        check("ucp_rkey_ptr", unsafe { sys::ucp_rkey_ptr(self.0, remote, &mut local) })?;
        Ok(local as usize)
    }
}

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: the key is destroyed once, before its endpoint is closed (the progress thread
        // drops an endpoint's keys first).
        unsafe { sys::ucp_rkey_destroy(self.0) };
    }
}

/// How a finished operation reports back.
pub(super) enum Completion {
    Unit(oneshot::Sender<Result<(), UcxError>>),
    Data(oneshot::Sender<Result<Vec<u8>, UcxError>>),
}

enum Keep {
    None,
    Put(#[allow(dead_code)] Bytes),
    Get(Vec<u8>),
}

/// One operation in flight: what it reports to and what memory it must keep alive.
struct Op {
    name: &'static str,
    done: Completion,
    keep: Keep,
}

impl Op {
    fn finish(self, status: sys::ucs_status_t) {
        let result = check(self.name, status);
        match (self.done, self.keep) {
            (Completion::Data(tx), Keep::Get(buf)) => {
                let _ = tx.send(result.map(|()| buf));
            }
            (Completion::Data(tx), _) => {
                let _ = tx.send(result.map(|()| Vec::new()));
            }
            (Completion::Unit(tx), _) => {
                let _ = tx.send(result);
            }
        }
    }
}

unsafe extern "C" fn on_complete(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user: *mut c_void,
) {
    // SAFETY: `user` is the `Op` box leaked in `submit` for exactly this request; UCX calls the
    // callback once, so the box is reclaimed once. The request is released after its callback,
    // as the API requires for requests returned by `*_nbx`.
    unsafe {
        let op = Box::from_raw(user as *mut Op);
        sys::ucp_request_free(request);
        op.finish(status);
    }
}

fn submit(
    op: Box<Op>,
    call: impl FnOnce(*const sys::ucp_request_param_t) -> sys::ucs_status_ptr_t,
) {
    submit_flags(op, 0, call)
}

fn submit_flags(
    op: Box<Op>,
    flags: u32,
    call: impl FnOnce(*const sys::ucp_request_param_t) -> sys::ucs_status_ptr_t,
) {
    let user = Box::into_raw(op);
    // SAFETY: all-zero is the empty parameter set; callback and user data are set and flagged.
    let mut param: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
    param.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_CALLBACK
        | sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_USER_DATA;
    param.flags = flags;
    param.cb.send = Some(on_complete);
    param.user_data = user as *mut c_void;
    match ucx_rs::decode_status_ptr(call(&param)) {
        // Done already, or failed at once: UCX will not call back, so the box is ours again.
        // SAFETY: `user` came from `Box::into_raw` above and UCX holds no request for it.
        Ok(None) => unsafe { Box::from_raw(user) }.finish(sys::ucs_status_t_UCS_OK),
        // SAFETY: as above.
        Err(st) => unsafe { Box::from_raw(user) }.finish(st),
        // In flight: `on_complete` reclaims the box.
        Ok(Some(_request)) => {}
    }
}
