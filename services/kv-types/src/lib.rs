//! The KV vocabulary every pdmesh crate shares, with no pdmesh dependency of its own: the KV
//! element type, the geometry of a paged KV block (whose byte layout is a contract between
//! nodes), the layout handshake (model fingerprint + geometry), block content addresses, block
//! checksums, the memory regions a transport registers, and the KV pool a transport offers
//! to its writers. Router, KV-store, transports, kernels and engine all name KV through it,
//! so none of them has to link another's machinery to agree on a block.

mod hash;
mod layout;
mod memory;
mod policy;
mod pool;
mod window;

pub use hash::{BlockHash, BlockHasher, digest};
pub use layout::{KvDtype, KvGeometry, KvLayout, KvShape, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
pub use memory::{HOST_ALIGN, HostMemory, MemoryKind, MemoryRegion};
pub use policy::KvPolicy;
pub use pool::KvPool;
pub use window::{KvWindow, LayerMask, MAX_WINDOW_LAYERS};

/// The checksum of one KV block in verify mode (xxh3-64 of its bytes).
pub fn block_checksum(block: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(block)
}
