//! pdmesh compute kernels: the `Backend` trait the engine runs the llama forward pass through,
//! the weight and KV-cache storage formats those kernels read, and the CPU backend (portable
//! Rust plus AVX2/FMA/F16C chosen at run time, on a low-latency thread pool).
//!
//! A CUDA backend is planned behind the same trait; nothing here assumes host memory beyond
//! the CPU backend itself.

// KV blocks travel between machines as raw bytes in the host's order; every target this runs
// on is little-endian, and a big-endian build would silently exchange garbage.
#[cfg(target_endian = "big")]
compile_error!("pdmesh assumes a little-endian target (KV blocks travel as raw bytes)");

pub mod backend;
pub mod cpu;
pub mod kv;
pub mod pool;
pub mod quant;

pub use backend::{Backend, MatmulJob};
pub use cpu::{CpuBackend, Simd};
pub use kv::{AttnQuery, KvBuffer, KvData, KvDataMut, KvDtype, KvGeometry, KvSlot, Phase};
pub use pdmesh_kv_types::{MemoryKind, MemoryRegion};
pub use quant::{Activations, WeightMatrix, WeightType};
