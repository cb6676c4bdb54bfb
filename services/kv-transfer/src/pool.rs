//! The decode node's side of UCX: its whole KV pool registered once at startup, and the
//! `UcxTarget` each reservation hands out (the pool's key and its blocks' addresses).

use bytes::Bytes;
use pdmesh_kv_types::{KvGeometry, MemoryRegion};
use pdmesh_proto::v1::UcxTarget;

use crate::ucx::{Region, UcxError, UcxNode};

/// A registered KV pool.
#[derive(Debug, Clone)]
pub struct KvPool {
    /// Keeps the worker (and its progress thread, which serves incoming puts) alive.
    _node: UcxNode,
    /// The registration, which keeps the pool's memory allocated while peers may reach it.
    _region: std::sync::Arc<Region>,
    worker_address: Bytes,
    rkey: Bytes,
    base: u64,
    bytes_per_block: u64,
    blocks: u32,
}

/// Registers the KV pool in `memory` (blocks of `geometry`) with `node`.
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
    let region = node.register(memory)?;
    let bytes_per_block = geometry.bytes_per_block() as u64;
    Ok(KvPool {
        _node: node.clone(),
        worker_address: node.address().clone(),
        rkey: region.rkey().clone(),
        base: region.base(),
        bytes_per_block,
        blocks: (memory.len() as u64 / bytes_per_block.max(1)) as u32,
        _region: std::sync::Arc::new(region),
    })
}

impl KvPool {
    /// The target for a reservation whose prompt occupies `pool_blocks`, in prompt order.
    pub fn target(&self, pool_blocks: &[u32]) -> UcxTarget {
        debug_assert!(pool_blocks.iter().all(|&b| b < self.blocks));
        UcxTarget {
            worker_address: self.worker_address.clone(),
            rkey: self.rkey.clone(),
            block_addrs: pool_blocks
                .iter()
                .map(|&b| self.base + u64::from(b) * self.bytes_per_block)
                .collect(),
        }
    }
}
