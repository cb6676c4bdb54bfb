//! The decode node's side of UCX: the KV pool peers may write into, and the `UcxTarget` each
//! reservation hands out — its prompt's blocks registered for remote write alone, under keys
//! of their own, revoked when the reservation's KV is complete (`scope`).
//!
//! On one host a put still crosses a transport (TCP, or shared memory through a bounce
//! buffer). So the pool can live in shared memory that UCX allocates (`share_kv_pool`); a
//! writer on the same host maps it once and copies each block in with one memcpy. The trade:
//! such a writer could reach every block of the pool, not only its reservation's. It is an
//! authenticated prefill or decode node on this host, where processes of one user can already
//! reach each other's memory through the kernel (CMA, which UCX itself uses); it keeps to its
//! target's blocks as a remote writer does, and `--kv-shared-pool false` turns the offer off.

use std::sync::Arc;

use bytes::Bytes;
use pdmesh_engine::Engine;
use pdmesh_kv_types::{HostMemory, KvGeometry, MemoryRegion};
use pdmesh_proto::v1::{UcxRange, UcxTarget};

use crate::scope::{self, Grant};
use crate::ucx::{Access, UcxError, UcxNode};

/// A KV pool peers may be granted access to.
#[derive(Debug, Clone)]
pub struct KvPool {
    /// Keeps the worker (and its progress thread, which serves incoming puts) alive.
    node: UcxNode,
    memory: MemoryRegion,
    worker_address: Bytes,
    bytes_per_block: u64,
    blocks: u32,
    shared: Option<UcxRange>,
}

/// Moves `engine`'s KV pool into shared memory that `node` allocates, before the engine holds
/// any KV. Returns what a writer on this host needs to map it (`KvPool::with_shared`).
pub fn share_kv_pool(node: &UcxNode, engine: &mut Engine) -> Result<UcxRange, String> {
    let len = engine.kv_bytes();
    let a = node.allocate(len).map_err(|e| e.to_string())?;
    let base = a.addr;
    let keep: Arc<dyn std::any::Any + Send + Sync> = a.keep;
    // SAFETY: UCX allocated at least `len` bytes at `base` (page-aligned shared memory,
    // zero when fresh) that `keep` holds until dropped; the engine becomes their only user
    // in this process.
    #[allow(unsafe_code)]
    let mut memory = unsafe { HostMemory::adopt(base, len, keep)? };
    if std::env::var_os("UCX_ALLOC_PRIO").is_some() {
        // An operator's allocation priority may pick memory that is not fresh.
        memory.bytes_mut().fill(0);
    }
    engine.rehome_kv(memory).map_err(|e| e.to_string())?;
    Ok(UcxRange { base: base as u64, len: len as u64, rkey: a.rkey })
}

/// The KV pool in `memory` (blocks of `geometry`), reachable through `node`.
///
/// Peers then write into the pool while the engine thread owns it, as a NIC's DMA would. The
/// protocol confines those writes to a reservation's blocks between its session's accept and
/// commit, which the engine neither reads nor writes in that window (and the commit reaches
/// the engine thread through a channel, which orders the writes before any read). Rust's
/// memory model does not describe memory written by another process; that is the trade.
pub fn register_kv_pool(
    node: &UcxNode,
    memory: &MemoryRegion,
    geometry: &KvGeometry,
) -> Result<KvPool, UcxError> {
    let bytes_per_block = geometry.bytes_per_block() as u64;
    if memory.is_empty() || bytes_per_block == 0 {
        return Err(UcxError::Usage("the KV pool is empty".into()));
    }
    // One block registered and revoked now: a node that cannot register finds out at start,
    // not at its first request.
    drop(scope::grant(node, memory, &[0], bytes_per_block, Access::RemoteWrite)?);
    Ok(KvPool {
        node: node.clone(),
        memory: memory.clone(),
        worker_address: node.address().clone(),
        bytes_per_block,
        blocks: (memory.len() as u64 / bytes_per_block) as u32,
        shared: None,
    })
}

impl KvPool {
    /// The pool as `share_kv_pool` placed it: offered to writers on this host.
    pub fn with_shared(mut self, shared: UcxRange) -> Self {
        self.shared = Some(shared);
        self
    }

    /// What a writer on this host needs to map the pool, when it is shared.
    pub fn shared(&self) -> Option<&UcxRange> {
        self.shared.as_ref()
    }

    /// The target for a reservation whose prompt occupies `pool_blocks`, in prompt order, and
    /// the grant that keeps those blocks (only) writable by peers until it is dropped.
    pub fn target(&self, pool_blocks: &[u32]) -> Result<(UcxTarget, Grant), UcxError> {
        if let Some(b) = pool_blocks.iter().find(|&&b| b >= self.blocks) {
            return Err(UcxError::Usage(format!("block {b} is past the pool's {}", self.blocks)));
        }
        let (ranges, block_addrs, grant) = scope::grant(
            &self.node,
            &self.memory,
            pool_blocks,
            self.bytes_per_block,
            Access::RemoteWrite,
        )?;
        let t = UcxTarget { worker_address: self.worker_address.clone(), block_addrs, ranges };
        Ok((t, grant))
    }
}
