//! The KV pool as a transport sees it: its memory, its geometry, and the few moves a
//! transport may ask of it before any KV is in it. The engine implements it; transports take
//! it instead of the engine, so a crate that offers KV memory (UCX, the KV-store's seam)
//! never links the model runtime.

use crate::{HostMemory, KvGeometry, MemoryRegion};

/// A node's KV pool, offered to a transport's writers.
pub trait KvPool {
    /// The geometry of the pool's blocks.
    fn kv_geometry(&self) -> KvGeometry;
    /// Bytes of KV memory the pool holds.
    fn kv_bytes(&self) -> usize;
    /// The pool's memory: one allocation that never moves or grows while the region lives;
    /// where `kv_blocks_whole`, block `b` starts at `addr + b * bytes_per_block`.
    fn kv_memory(&self) -> MemoryRegion;
    /// Whether each of the pool's blocks holds every layer of its tokens in the geometry's
    /// order, so that a writer may put a block straight into `kv_memory`. A pool that keeps
    /// some layers apart (sliding-window groups), or takes thin blocks (`KvLayout::
    /// thin_blocks`), is reached only through staging.
    fn kv_blocks_whole(&self) -> bool {
        true
    }
    /// Moves the pool into `memory` (host memory of `kv_bytes()` that the transport
    /// allocated for its peers to reach); only while the pool holds no KV.
    fn rehome_kv(&mut self, memory: HostMemory) -> Result<(), String>;
    /// `len` zeroed bytes of host memory the pool copies from fastest (page-locked for a
    /// GPU): a staging area for a pool the transport cannot reach itself.
    fn kv_staging_memory(&self, len: usize) -> Result<HostMemory, String>;
    /// Host memory the transport allocated, made as fast to copy from as
    /// `kv_staging_memory`'s; on failure the memory comes back, usable but slower, with why.
    fn kv_pin(&self, memory: HostMemory) -> Result<HostMemory, (HostMemory, String)>;
}
