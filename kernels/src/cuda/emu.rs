//! The emulated CUDA device: the kernels compiled for the host by build.rs (against
//! `cuda/emu/cuda_emu.h`), device memory as aligned host memory, copies as `memcpy`, and each
//! launch run to completion before it returns (blocks one after another, each block's threads
//! as OS threads). Slow, but the same sources, launch geometry and host orchestration as on a
//! GPU, so CI checks all of the CUDA backend except cudarc's calls.

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Arc;

use pdmesh_kv_types::{HostMemory, MemoryKind};

use super::{Arg, DeviceError, DeviceMem, Dims, Graph, Launch, PackedArgs};

unsafe extern "C" {
    /// Runs kernel `name` over `grid` × `block` with the arguments `args` points at (as
    /// `cuLaunchKernel`). Returns 0, or -1 with a NUL-terminated reason in `err`.
    fn pdmesh_emu_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        args: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// The CUDA backend's device, emulated on the host's CPUs.
#[derive(Debug, Default)]
pub struct EmuDevice;

impl EmuDevice {
    pub fn new() -> Self {
        EmuDevice
    }
}

impl super::Device for EmuDevice {
    fn describe(&self) -> String {
        "cuda/emu".into()
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceMem, DeviceError> {
        self.adopt_host(HostMemory::zeroed(bytes).map_err(DeviceError::Memory)?)
    }

    fn htod(&self, src: &[u8], dst: &DeviceMem, offset: usize) -> Result<(), DeviceError> {
        dst.check(offset, src.len())?;
        // SAFETY: the range is inside `dst`'s live allocation (checked); launches have
        // returned, so no kernel is writing it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                (dst.addr() as usize as *mut u8).add(offset),
                src.len(),
            )
        };
        Ok(())
    }

    fn dtoh(&self, src: &DeviceMem, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        src.check(offset, dst.len())?;
        // SAFETY: as in `htod`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src.addr() as usize as *const u8).add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    fn dtod(
        &self,
        src: &DeviceMem,
        src_offset: usize,
        dst: &DeviceMem,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        src.check(src_offset, len)?;
        dst.check(dst_offset, len)?;
        // SAFETY: both ranges are inside live allocations (checked); `copy` allows overlap.
        unsafe {
            std::ptr::copy(
                (src.addr() as usize as *const u8).add(src_offset),
                (dst.addr() as usize as *mut u8).add(dst_offset),
                len,
            )
        };
        Ok(())
    }

    fn launch(&self, kernel: &str, dims: Dims, args: &[Arg]) -> Result<(), DeviceError> {
        let fail = |reason: String| DeviceError::Launch { kernel: kernel.into(), reason };
        let name = CString::new(kernel).map_err(|e| fail(e.to_string()))?;
        let mut packed = PackedArgs::new(args);
        let mut err = [0 as c_char; 256];
        // SAFETY: the name is NUL-terminated, the geometry arrays hold three values each, the
        // arguments are packed as the kernel's C parameters (the backend builds them per
        // kernel), and `err` has the length passed.
        let rc = unsafe {
            pdmesh_emu_launch(
                name.as_ptr(),
                dims.grid.as_ptr(),
                dims.block.as_ptr(),
                packed.as_mut_ptr(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            // SAFETY: the launcher wrote a NUL-terminated string within `err`.
            let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
            return Err(fail(msg.to_string_lossy().into_owned()));
        }
        Ok(())
    }

    /// The emulated graph is the list itself: replaying it launches each in turn.
    fn capture(&self, launches: &[Launch]) -> Result<Graph, DeviceError> {
        Ok(Box::new(launches.to_vec()))
    }

    fn replay(&self, graph: &Graph) -> Result<(), DeviceError> {
        let list = graph.downcast_ref::<Vec<Launch>>().ok_or_else(|| DeviceError::Launch {
            kernel: "graph".into(),
            reason: "not a graph of the emulated device".into(),
        })?;
        for l in list {
            super::Device::launch(self, &l.kernel, l.dims, &l.args)?;
        }
        Ok(())
    }

    fn adopt_host(&self, memory: HostMemory) -> Result<DeviceMem, DeviceError> {
        let region = memory.region();
        let keep: Arc<dyn std::any::Any + Send + Sync> = Arc::new(memory);
        // SAFETY: the region is `memory`'s allocation, kept alive by `keep`.
        Ok(unsafe { DeviceMem::new(region.addr() as u64, region.len(), MemoryKind::Host, keep) })
    }

    fn host_alloc(&self, bytes: usize) -> Result<HostMemory, DeviceError> {
        HostMemory::zeroed(bytes).map_err(DeviceError::Memory)
    }

    fn host_register(&self, memory: HostMemory) -> Result<HostMemory, super::Unregistered> {
        // Copies are memcpys: any host memory is as fast as any other.
        Ok(memory)
    }

    fn sync(&self) -> Result<(), DeviceError> {
        // Every copy and launch has finished when its call returns.
        Ok(())
    }
}
