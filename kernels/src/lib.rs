//! pdmesh compute kernels: the `Backend` trait the engine runs the llama forward pass through
//! (buffers, KV pool and weights are each backend's own types), the weight and KV-cache
//! storage formats those kernels read, and the CPU backend (portable Rust plus AVX2/FMA/F16C
//! chosen at run time, on a low-latency thread pool).
//!
//! The CUDA backend (`cuda`) goes behind the same trait, over a device that is a GPU (cudarc)
//! or the same kernels emulated on the host; nothing outside `cpu` assumes host memory.

// KV blocks travel between machines as raw bytes in the host's order; every target this runs
// on is little-endian, and a big-endian build would silently exchange garbage.
#[cfg(target_endian = "big")]
compile_error!("pdmesh assumes a little-endian target (KV blocks travel as raw bytes)");

pub mod backend;
pub mod candidates;
pub mod cpu;
pub mod cuda;
pub mod formats;
pub mod kv;
pub mod pool;
pub mod quant;
pub mod random;

pub use backend::{Backend, KvError, KvStorage, MatmulJob, Rope, RopeMode};
pub use candidates::{Candidates, Cut, MAX_CANDIDATES, argmax, argmax_of};
pub use cpu::{CpuBackend, Simd};
pub use formats::ActForm;
pub use kv::{
    AttnQuery, KvBuffer, KvData, KvDataMut, KvDtype, KvGeometry, KvSlot, Phase, Q8_0_BLOCK,
    Q8_0_BLOCK_BYTES,
};
pub use pdmesh_kv_types::{MemoryKind, MemoryRegion};
pub use quant::{ActNeeds, Activations, HostWeight, SharedBytes, WeightMatrix, WeightType};
