//! The real GPU through cudarc: the driver (`libcuda.so`) and NVRTC loaded at run time, one
//! context and one stream per device, every kernel module compiled by NVRTC for the device's
//! architecture (PTX cached on disk) and loaded once. `open` checks each step and says which
//! one failed — no driver, no device, no NVRTC — instead of the panic cudarc raises when a
//! library it needs is absent.
//!
//! Copies and launches are queued on the one stream in order; a copy to the host waits for it.
//! Device memory is allocated with `cuMemAlloc` (not the stream-ordered pool), so UCX can
//! register it.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, result};
use pdmesh_kv_types::{HostMemory, MemoryKind};

use super::nvrtc::{arch_for, module_ptx, nvrtc_missing};
use super::{Arg, DeviceError, DeviceMem, Dims, Graph, Launch, MODULES, PackedArgs};

/// An NVIDIA GPU the CUDA backend computes on.
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    ordinal: usize,
    name: String,
    arch: &'static str,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

fn driver(what: &str) -> impl Fn(result::DriverError) -> DeviceError + '_ {
    move |e| DeviceError::Unavailable(format!("{what}: {e:?}"))
}

/// Why the CUDA driver cannot be used here, or None when it can (it says nothing yet of
/// devices).
pub fn driver_missing() -> Option<String> {
    // SAFETY: only tries to dlopen the library and drops the handle.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    (!present).then(|| {
        "no CUDA driver: libcuda.so was not found on the dynamic loader's path \
         (LD_LIBRARY_PATH, ld.so.cache); --backend cuda needs an NVIDIA GPU and its driver"
            .to_string()
    })
}

impl GpuDevice {
    /// Opens GPU `ordinal`: driver, device, context, stream, and every kernel compiled for it.
    pub fn open(ordinal: usize) -> Result<Self, DeviceError> {
        if let Some(why) = driver_missing() {
            return Err(DeviceError::Unavailable(why));
        }
        let count = CudaContext::device_count().map_err(driver("the CUDA driver did not start"))?;
        if count <= 0 {
            return Err(DeviceError::Unavailable("the CUDA driver sees no GPU".into()));
        }
        if ordinal >= count as usize {
            return Err(DeviceError::Unavailable(format!(
                "there is no CUDA device {ordinal}: this machine has {count}"
            )));
        }
        if let Some(why) = nvrtc_missing() {
            return Err(DeviceError::Unavailable(why));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("cannot open the CUDA device"))?;
        let name = ctx.name().map_err(driver("cannot read the device's name"))?;
        let (major, minor) =
            ctx.compute_capability().map_err(driver("cannot read the compute capability"))?;
        let arch = arch_for(major, minor)?;
        let stream = ctx.new_stream().map_err(driver("cannot create a stream"))?;
        let mut functions = HashMap::new();
        for (module, _, kernels) in MODULES {
            let ptx = module_ptx(module, arch)?;
            let m = ctx.load_module(ptx).map_err(driver("cannot load the kernels"))?;
            for &k in *kernels {
                let f =
                    m.load_function(k).map_err(driver("a kernel is missing from its module"))?;
                functions.insert(k, f);
            }
        }
        Ok(Self { ctx, stream, functions, ordinal, name, arch })
    }

    fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(driver("cannot bind the CUDA context"))
    }
}

/// An instantiated CUDA graph. cudarc leaves it neither `Send` nor `Sync` (its handles are raw
/// pointers and the driver forbids concurrent use of one graph); the mutex serialises every use.
struct GpuGraph(std::sync::Mutex<cudarc::driver::CudaGraph>);

// SAFETY: the graph's handles belong to the context, not to a thread; every use goes through
// the mutex, so no two threads touch the graph at once.
unsafe impl Send for GpuGraph {}
// SAFETY: as above.
unsafe impl Sync for GpuGraph {}

/// A `cuMemAlloc` allocation, freed (after the stream's work) when dropped.
struct GpuAlloc {
    ptr: u64,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl Drop for GpuAlloc {
    fn drop(&mut self) {
        // Kernels queued before the drop may still read it: wait for them, then free. A
        // failure here leaks the allocation; there is no one to tell.
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: allocated by `malloc_sync` in `alloc`, freed once, here.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A `cuMemHostAlloc` allocation, freed when dropped.
struct PinnedAlloc {
    ptr: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        // Copies from it are waited for by whoever queued them (`sync`) before it is let go.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_host` in `host_alloc`, freed once, here.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// Host memory page-locked by `cuMemHostRegister`: unregistered when dropped, before the
/// memory itself is let go (it is a field, dropped after `drop` runs).
struct Registered {
    ptr: usize,
    ctx: Arc<CudaContext>,
    _memory: HostMemory,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Copies from it are waited for by whoever queued them (`sync`) before it is let go.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered by `host_register`, unregistered once, here.
        let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut c_void) };
    }
}

impl super::Device for GpuDevice {
    fn describe(&self) -> String {
        format!("cuda/{} {} (device {})", self.name, self.arch, self.ordinal)
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Cuda { device: self.ordinal }
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceMem, DeviceError> {
        self.bind()?;
        let mem = |e| DeviceError::Memory(format!("cannot allocate {bytes} bytes: {e:?}"));
        // SAFETY: a plain allocation of a positive size, zeroed on the stream before use.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(mem)?;
        let keep = GpuAlloc { ptr, ctx: Arc::clone(&self.ctx), stream: Arc::clone(&self.stream) };
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }.map_err(mem)?;
        // SAFETY: `keep` frees exactly this allocation when the last clone drops.
        Ok(unsafe { DeviceMem::new(ptr, bytes, self.memory_kind(), Arc::new(keep)) })
    }

    fn htod(&self, src: &[u8], dst: &DeviceMem, offset: usize) -> Result<(), DeviceError> {
        dst.check(offset, src.len())?;
        self.bind()?;
        // SAFETY: the range is inside `dst` (checked); pageable host memory is staged by the
        // driver before the call returns, so `src` may go after it.
        unsafe {
            result::memcpy_htod_async(dst.addr() + offset as u64, src, self.stream.cu_stream())
        }
        .map_err(|e| DeviceError::Memory(format!("copy to the device: {e:?}")))
    }

    fn dtoh(&self, src: &DeviceMem, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        src.check(offset, dst.len())?;
        self.bind()?;
        let err = |e| DeviceError::Memory(format!("copy from the device: {e:?}"));
        // SAFETY: the range is inside `src` (checked); the stream is synchronised before `dst`
        // is used.
        unsafe {
            result::memcpy_dtoh_async(dst, src.addr() + offset as u64, self.stream.cu_stream())
        }
        .map_err(err)?;
        self.stream.synchronize().map_err(err)
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
        self.bind()?;
        // SAFETY: both ranges are inside live allocations (checked).
        unsafe {
            result::memcpy_dtod_async(
                dst.addr() + dst_offset as u64,
                src.addr() + src_offset as u64,
                len,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| DeviceError::Memory(format!("copy on the device: {e:?}")))
    }

    fn launch(&self, kernel: &str, dims: Dims, args: &[Arg]) -> Result<(), DeviceError> {
        let fail = |reason: String| DeviceError::Launch { kernel: kernel.into(), reason };
        let f = self.functions.get(kernel).ok_or_else(|| fail("no such kernel".into()))?;
        self.bind()?;
        let mut packed = PackedArgs::new(args);
        let [gx, gy, gz] = dims.grid;
        let [bx, by, bz] = dims.block;
        // SAFETY: the arguments are packed as the kernel's C parameters (the backend builds
        // them per kernel) and outlive the call, which copies them.
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                (gx, gy, gz),
                (bx, by, bz),
                0,
                self.stream.cu_stream(),
                packed.as_mut_slice(),
            )
        }
        .map_err(|e| fail(format!("{e:?}")))
    }

    fn adopt_host(&self, _memory: HostMemory) -> Result<DeviceMem, DeviceError> {
        Err(DeviceError::Unavailable("a GPU computes on its own memory".into()))
    }

    fn host_alloc(&self, bytes: usize) -> Result<HostMemory, DeviceError> {
        self.bind()?;
        let mem =
            |e| DeviceError::Memory(format!("cannot pin {bytes} bytes of host memory: {e:?}"));
        // SAFETY: a plain page-locked allocation of a positive size, zeroed below.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }.map_err(mem)?;
        let keep = PinnedAlloc { ptr: ptr as usize, ctx: Arc::clone(&self.ctx) };
        // SAFETY: the driver returned `bytes` writable bytes at `ptr`.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        // SAFETY: zeroed, page-aligned and owned by `keep` alone until it drops.
        unsafe { HostMemory::adopt(ptr as usize, bytes, Arc::new(keep)) }
            .map_err(DeviceError::Memory)
    }

    fn host_register(&self, memory: HostMemory) -> Result<HostMemory, super::Unregistered> {
        if let Err(reason) = self.bind() {
            return Err(super::Unregistered { memory, reason });
        }
        let region = memory.region();
        if !region.addr().is_multiple_of(pdmesh_kv_types::HOST_ALIGN) {
            let reason = DeviceError::Memory(format!("{:#x} is not aligned", region.addr()));
            return Err(super::Unregistered { memory, reason });
        }
        // SAFETY: `region` is `memory`'s allocation, which `Registered` keeps until it has
        // unregistered it.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(region.addr() as *mut c_void, region.len(), 0)
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            let reason =
                DeviceError::Memory(format!("cannot page-lock {} bytes: {r:?}", region.len()));
            return Err(super::Unregistered { memory, reason });
        }
        let keep = Registered { ptr: region.addr(), ctx: Arc::clone(&self.ctx), _memory: memory };
        // SAFETY: the same allocation, still zeroed (fresh, as `host_register` asks), owned by
        // `keep` (through the `HostMemory` it holds and never touches) until it drops.
        let adopted = unsafe { HostMemory::adopt(region.addr(), region.len(), Arc::new(keep)) };
        Ok(adopted.expect("a non-null, aligned address (checked above)"))
    }

    fn sync(&self) -> Result<(), DeviceError> {
        self.bind()?;
        self.stream.synchronize().map_err(|e| DeviceError::Memory(format!("synchronize: {e:?}")))
    }

    fn capture(&self, launches: &[Launch]) -> Result<Graph, DeviceError> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let fail = |e: result::DriverError| DeviceError::Launch {
            kernel: "graph".into(),
            reason: format!("capture: {e:?}"),
        };
        self.bind()?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(fail)?;
        let launched: Result<(), DeviceError> =
            launches.iter().try_for_each(|l| self.launch(&l.kernel, l.dims, &l.args));
        // End the capture whatever happened, so the stream leaves capture mode.
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0)).map_err(fail);
        launched?;
        let graph = graph?.ok_or_else(|| DeviceError::Launch {
            kernel: "graph".into(),
            reason: "capture produced no graph".into(),
        })?;
        Ok(Box::new(GpuGraph(std::sync::Mutex::new(graph))))
    }

    fn replay(&self, graph: &Graph) -> Result<(), DeviceError> {
        let fail = |reason: String| DeviceError::Launch { kernel: "graph".into(), reason };
        let g = graph.downcast_ref::<GpuGraph>().ok_or_else(|| fail("not a GPU graph".into()))?;
        self.bind()?;
        let g = g.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        g.launch().map_err(|e| fail(format!("{e:?}")))
    }
}
