//! Memory that another party may reach while its owner computes in it: a KV pool that a UCX
//! registration exposes to remote writers. A `MemoryRegion` names such memory (address,
//! length, host or device) and keeps it allocated for as long as anyone holds the region, so a
//! registration can never outlive the memory it exposes, whatever order owners drop in.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

/// Where a region's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host memory.
    Host,
    /// Memory of a CUDA device (by ordinal).
    Cuda { device: usize },
}

impl MemoryKind {
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda { .. } => "cuda",
        }
    }
}

/// A fixed span of memory, kept allocated while this value (or a clone) lives.
#[derive(Clone)]
pub struct MemoryRegion {
    addr: usize,
    len: usize,
    kind: MemoryKind,
    _keep: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

impl MemoryRegion {
    /// A region over memory that `keep` owns and frees only when dropped.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be one allocation of kind `kind` that stays at that address,
    /// without being freed, until `keep` is dropped.
    pub unsafe fn new(
        addr: usize,
        len: usize,
        kind: MemoryKind,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Self { addr, len, kind, _keep: keep }
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn kind(&self) -> MemoryKind {
        self.kind
    }
}

/// The alignment of every `HostMemory`: enough for any element type and a cache line.
pub const HOST_ALIGN: usize = 64;

struct Alloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `Alloc` owns a plain heap block; it is only freed (in `Drop`), never accessed through
// `&Alloc`. Access to the bytes goes through `HostMemory`'s borrow rules.
unsafe impl Send for Alloc {}
// SAFETY: as above: a shared `&Alloc` gives no access to the bytes.
unsafe impl Sync for Alloc {}

impl Drop for Alloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostMemory::zeroed` with this layout, freed once (here).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A fixed host allocation whose bytes its one owner reads and writes, and which `region()`
/// can expose (address only) to others — a KV pool that UCX registers. Zeroed by this
/// module, or adopted from an allocator that hands out zeroed memory (UCX's shared memory).
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
    keep: Arc<dyn Any + Send + Sync>,
}

// SAFETY: `HostMemory` owns its bytes like a `Box<[u8]>` does: access goes through `&self` /
// `&mut self` only, and `keep` is `Send + Sync`.
unsafe impl Send for HostMemory {}
// SAFETY: as above; `&HostMemory` gives shared (read) access only.
unsafe impl Sync for HostMemory {}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory").field("len", &self.len).finish()
    }
}

impl HostMemory {
    /// `len` zero bytes aligned to `HOST_ALIGN`; an error rather than an abort when memory is
    /// short.
    pub fn zeroed(len: usize) -> Result<Self, String> {
        let layout = Layout::from_size_align(len.max(1), HOST_ALIGN)
            .map_err(|e| format!("cannot allocate {len} bytes: {e}"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| format!("cannot allocate {len} bytes"))?;
        Ok(Self { ptr, len, keep: Arc::new(Alloc { ptr, layout }) })
    }

    /// Adopts `len` bytes at `addr` that `keep` owns, e.g. memory a transport allocated so
    /// that peers can reach it.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be one zeroed, readable and writable host allocation aligned
    /// to `HOST_ALIGN`, that stays at that address, unfreed, until `keep` is dropped, and that
    /// nothing else in this process reads or writes while the `HostMemory` lives.
    pub unsafe fn adopt(
        addr: usize,
        len: usize,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Result<Self, String> {
        let ptr = NonNull::new(addr as *mut u8).ok_or("cannot adopt a null address")?;
        if !addr.is_multiple_of(HOST_ALIGN) {
            return Err(format!("{addr:#x} is not aligned to {HOST_ALIGN} bytes"));
        }
        Ok(Self { ptr, len, keep })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` initialised (zeroed) bytes kept alive by `keep`; other holders of the
        // allocation (regions) never make references to it, so this borrow follows `self`'s.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The allocation as a region that keeps it alive. Whoever writes into the region from
    /// outside (another process, a NIC) must confine itself to memory the owner is not
    /// using at that moment: Rust's model does not describe such writes, the protocol does.
    pub fn region(&self) -> MemoryRegion {
        // SAFETY: the allocation is fixed and freed only when its last keeper (this one
        // included) drops.
        unsafe {
            MemoryRegion::new(
                self.ptr.as_ptr() as usize,
                self.len,
                MemoryKind::Host,
                Arc::clone(&self.keep),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_keeps_its_memory_past_its_owner() {
        let mut m = HostMemory::zeroed(4096).expect("4 KiB");
        assert!(m.bytes().iter().all(|&b| b == 0));
        assert_eq!(m.bytes().as_ptr() as usize % HOST_ALIGN, 0);
        m.bytes_mut()[7] = 42;
        let r = m.region();
        assert_eq!(
            (r.addr(), r.len(), r.kind()),
            (m.bytes().as_ptr() as usize, 4096, MemoryKind::Host)
        );
        drop(m);
        // The region still names live memory.
        // SAFETY: the region keeps the allocation alive and nobody else holds it now.
        let b = unsafe { *(r.addr() as *const u8).add(7) };
        assert_eq!(b, 42);
    }

    #[test]
    fn adopted_memory_is_kept_by_its_keeper_and_must_be_aligned() {
        let backing = HostMemory::zeroed(256).expect("256 B");
        let addr = backing.bytes().as_ptr() as usize;
        let keep: Arc<dyn Any + Send + Sync> = Arc::new(backing);
        // SAFETY: `keep` owns 256 zeroed, aligned bytes and nothing else touches them.
        let mut m = unsafe { HostMemory::adopt(addr, 256, Arc::clone(&keep)) }.expect("adopted");
        m.bytes_mut()[3] = 9;
        assert_eq!((m.region().addr(), m.len()), (addr, 256));
        // SAFETY: as above; the error paths never touch the memory.
        assert!(unsafe { HostMemory::adopt(addr + 1, 8, Arc::clone(&keep)) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { HostMemory::adopt(0, 8, keep) }.is_err());
        let r = m.region();
        drop(m);
        // SAFETY: the region keeps the keeper, and with it the bytes, alive.
        assert_eq!(unsafe { *(r.addr() as *const u8).add(3) }, 9);
    }

    #[test]
    fn an_impossible_size_is_an_error() {
        assert!(HostMemory::zeroed(usize::MAX - 8).is_err());
    }
}
