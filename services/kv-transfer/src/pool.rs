//! The decode node's side of UCX: the KV pool peers may write into, and the `UcxTarget` each
//! reservation hands out — its prompt's blocks registered for remote write alone, under keys
//! of their own, revoked when the reservation's KV is complete (`scope`).

use bytes::Bytes;
use pdmesh_kv_types::{KvGeometry, MemoryRegion};
use pdmesh_proto::v1::UcxTarget;

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
    })
}

impl KvPool {
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
