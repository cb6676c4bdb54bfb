//! The decode node's side of UCX: its whole KV pool registered once at startup, and the
//! `UcxTarget` each reservation hands out (the pool's key and its blocks' addresses).
#![allow(unsafe_code)]

use bytes::Bytes;
use pdmesh_engine::Engine;
use pdmesh_proto::v1::UcxTarget;

use crate::ucx::{UcxError, UcxNode};

/// A registered KV pool.
#[derive(Debug, Clone)]
pub struct KvPool {
    /// Keeps the worker (and its progress thread, which serves incoming puts) alive.
    _node: UcxNode,
    worker_address: Bytes,
    rkey: Bytes,
    base: u64,
    bytes_per_block: u64,
    blocks: u32,
}

/// Registers `engine`'s KV pool with `node`. The registration is handed to the engine, which
/// drops it before the pool's memory, so peers can never be given a key to freed memory.
///
/// Peers then write into the pool while the engine thread owns it, as a NIC's DMA would. The
/// protocol confines those writes to a reservation's blocks between its session's accept and
/// commit, which the engine neither reads nor writes in that window (and the commit reaches
/// the engine thread through a channel, which orders the writes before any read). Rust's
/// memory model does not describe memory written by another process; that is the trade.
pub fn register_kv_pool(node: &UcxNode, engine: &mut Engine) -> Result<KvPool, UcxError> {
    let (addr, len) = engine.kv_region();
    let geometry = *engine.kv().geometry();
    // SAFETY: the pool is one allocation that never moves or grows while the engine lives
    // (`Engine::kv_region`), and the region is stored in the engine, which drops it before
    // the pool (`Engine::hold_kv_guard`).
    let region = unsafe { node.register(addr, len)? };
    let pool = KvPool {
        _node: node.clone(),
        worker_address: node.address().clone(),
        rkey: region.rkey().clone(),
        base: region.base(),
        bytes_per_block: geometry.bytes_per_block() as u64,
        blocks: engine.kv().total_blocks() as u32,
    };
    engine.hold_kv_guard(Box::new(region));
    Ok(pool)
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
