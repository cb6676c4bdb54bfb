//! The CUDA backend: the kernels in `kernels/cuda/*.cu`, driven through a small `Device` trait
//! (memory, copies, launches by kernel name). Two devices implement it: `EmuDevice`, the same
//! sources built for the host against `cuda/emu/cuda_emu.h` (CUDA's execution model on OS
//! threads), which runs everywhere and is what CI tests; and the real GPU through cudarc.
//! `CudaBackend<D>` is the whole host side — buffers, weights, the KV pool, launch geometry,
//! block tables — written once over `Device`, so CI exercises all of it but the last layer.

mod backend;
mod device_kv;
mod emu;
mod gpu;
pub mod graph;
pub mod nvrtc;

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use pdmesh_kv_types::{HostMemory, MemoryKind, MemoryRegion};

pub use backend::{CudaBackend, CudaWeight, DeviceVec};
pub use device_kv::DeviceKv;
pub use emu::EmuDevice;
pub use gpu::{GpuDevice, driver_missing};
pub use graph::{Graph, GraphStats, Launch, Recorder};

// The kernel sources with their includes inlined and the kernels each defines (build.rs).
include!(concat!(env!("OUT_DIR"), "/cuda_modules.rs"));

/// Why a device operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("device memory: {0}")]
    Memory(String),
    #[error("copy out of bounds: {offset} + {len} bytes of a {size}-byte allocation")]
    Bounds { offset: usize, len: usize, size: usize },
    #[error("launch of {kernel}: {reason}")]
    Launch { kernel: String, reason: String },
    #[error("{0}")]
    Unavailable(String),
}

/// A device allocation: its address in the device's address space, freed when the last clone
/// of its owner is dropped.
#[derive(Clone)]
pub struct DeviceMem {
    addr: u64,
    len: usize,
    kind: MemoryKind,
    keep: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMem")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

impl DeviceMem {
    /// # Safety
    /// `[addr, addr + len)` must be one allocation of `kind` that `keep` frees only when
    /// dropped.
    pub unsafe fn new(
        addr: u64,
        len: usize,
        kind: MemoryKind,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Self { addr, len, kind, keep }
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation as a region a transport registers, keeping it alive.
    pub fn region(&self) -> MemoryRegion {
        // SAFETY: the allocation is fixed and freed only when `keep` (cloned here) is dropped.
        unsafe { MemoryRegion::new(self.addr as usize, self.len, self.kind, self.keep.clone()) }
    }

    /// Checks that `len` bytes from `offset` lie inside the allocation.
    pub fn check(&self, offset: usize, len: usize) -> Result<(), DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(DeviceError::Bounds { offset, len, size: self.len }),
        }
    }
}

/// Host memory `host_register` could not page-lock, given back with the reason.
#[derive(Debug)]
pub struct Unregistered {
    pub memory: HostMemory,
    pub reason: DeviceError,
}

/// One kernel argument, as the kernel's C parameter type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    I32(i32),
    /// A C `long` (64-bit on every target CUDA and this emulator run on).
    I64(i64),
    F32(f32),
}

impl Arg {
    pub fn ptr(mem: &DeviceMem) -> Arg {
        Arg::Ptr(mem.addr)
    }

    /// A count as a C `int`; the backend checks shapes against `i32::MAX` before launching.
    pub fn int(v: usize) -> Arg {
        Arg::I32(i32::try_from(v).expect("kernel sizes are checked to fit an int"))
    }

    pub fn long(v: usize) -> Arg {
        Arg::I64(i64::try_from(v).expect("sizes fit an i64"))
    }

    /// The value in the low bytes of an 8-byte slot (little-endian), as a launch passes it.
    pub fn bits(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => u64::from(v as u32),
            Arg::I64(v) => v as u64,
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

/// Arguments laid out as `cuLaunchKernel` takes them: an array of pointers, one to each value.
#[derive(Debug)]
pub struct PackedArgs {
    values: Vec<u64>,
    ptrs: Vec<*mut c_void>,
}

impl PackedArgs {
    pub fn new(args: &[Arg]) -> Self {
        // Each value at the start of its own 8-byte slot.
        let mut values: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let ptrs = values.iter_mut().map(|v| (v as *mut u64).cast::<c_void>()).collect();
        Self { values, ptrs }
    }

    /// The `void**` a launch takes, valid while `self` lives (the pointers point into the
    /// heap buffer of `values`, which moving `self` does not move).
    pub fn as_mut_ptr(&mut self) -> *mut *mut c_void {
        self.as_mut_slice().as_mut_ptr()
    }

    pub fn as_mut_slice(&mut self) -> &mut [*mut c_void] {
        debug_assert_eq!(self.ptrs.len(), self.values.len());
        &mut self.ptrs
    }
}

/// A launch's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

impl Dims {
    /// `grid` blocks of `block` threads along x.
    pub fn linear(grid: usize, block: u32) -> Dims {
        Dims { grid: [to_u32(grid), 1, 1], block: [block, 1, 1] }
    }

    /// Enough blocks of `block` threads for one thread per item.
    pub fn per_item(items: usize, block: u32) -> Dims {
        Dims::linear(items.div_ceil(block as usize).max(1), block)
    }
}

fn to_u32(v: usize) -> u32 {
    u32::try_from(v).expect("grid dimensions are checked to fit a u32")
}

/// A device chosen at run time (the emulated one or a GPU) is a device too.
impl Device for Box<dyn Device> {
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn memory_kind(&self) -> MemoryKind {
        (**self).memory_kind()
    }
    fn alloc(&self, bytes: usize) -> Result<DeviceMem, DeviceError> {
        (**self).alloc(bytes)
    }
    fn htod(&self, src: &[u8], dst: &DeviceMem, offset: usize) -> Result<(), DeviceError> {
        (**self).htod(src, dst, offset)
    }
    fn dtoh(&self, src: &DeviceMem, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        (**self).dtoh(src, offset, dst)
    }
    fn dtod(
        &self,
        src: &DeviceMem,
        src_offset: usize,
        dst: &DeviceMem,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        (**self).dtod(src, src_offset, dst, dst_offset, len)
    }
    fn launch(&self, kernel: &str, dims: Dims, args: &[Arg]) -> Result<(), DeviceError> {
        (**self).launch(kernel, dims, args)
    }
    fn adopt_host(&self, memory: HostMemory) -> Result<DeviceMem, DeviceError> {
        (**self).adopt_host(memory)
    }
    fn host_alloc(&self, bytes: usize) -> Result<HostMemory, DeviceError> {
        (**self).host_alloc(bytes)
    }
    fn host_register(&self, memory: HostMemory) -> Result<HostMemory, Unregistered> {
        (**self).host_register(memory)
    }
    fn sync(&self) -> Result<(), DeviceError> {
        (**self).sync()
    }
    fn capture(&self, launches: &[Launch]) -> Result<Graph, DeviceError> {
        (**self).capture(launches)
    }
    fn replay(&self, graph: &Graph) -> Result<(), DeviceError> {
        (**self).replay(graph)
    }
}

/// What the CUDA backend needs of a device: zeroed allocations, copies, and launches of the
/// kernels in `MODULES` by name, in order (a device runs them one after another on one
/// stream; copies to the host wait for what came before).
pub trait Device: Send + Sync + std::fmt::Debug + 'static {
    /// E.g. `cuda/emu` or `cuda/NVIDIA H200 sm_90`.
    fn describe(&self) -> String;
    /// Where allocations live (what a transport registers them as).
    fn memory_kind(&self) -> MemoryKind;
    /// `bytes` zeroed bytes.
    fn alloc(&self, bytes: usize) -> Result<DeviceMem, DeviceError>;
    fn htod(&self, src: &[u8], dst: &DeviceMem, offset: usize) -> Result<(), DeviceError>;
    fn dtoh(&self, src: &DeviceMem, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError>;
    fn dtod(
        &self,
        src: &DeviceMem,
        src_offset: usize,
        dst: &DeviceMem,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DeviceError>;
    fn launch(&self, kernel: &str, dims: Dims, args: &[Arg]) -> Result<(), DeviceError>;
    /// Takes host memory someone else allocated (a transport's shared memory) as device
    /// memory, where the device computes on host memory; others refuse.
    fn adopt_host(&self, memory: HostMemory) -> Result<DeviceMem, DeviceError>;
    /// `bytes` zeroed bytes of host memory this device copies from fastest (page-locked for
    /// a GPU). A copy from such memory may still run when `htod` returns: `sync` waits.
    fn host_alloc(&self, bytes: usize) -> Result<HostMemory, DeviceError>;
    /// Page-locks `memory` — fresh host memory someone else allocated, such as a transport's
    /// shared memory — so that `htod` copies from it as fast as from `host_alloc`'s, for as
    /// long as the returned memory lives; a device that computes on host memory takes it as
    /// it is. On failure the memory comes back with the reason.
    fn host_register(&self, memory: HostMemory) -> Result<HostMemory, Unregistered>;
    /// Waits until every copy and launch queued so far has finished.
    fn sync(&self) -> Result<(), DeviceError>;
    /// `launches` made into one graph, without running them.
    fn capture(&self, launches: &[Launch]) -> Result<Graph, DeviceError>;
    /// Runs a graph `capture` made.
    fn replay(&self, graph: &Graph) -> Result<(), DeviceError>;
}
