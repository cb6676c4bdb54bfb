//! CUDA graphs without the engine's help: `Recorder<D>` stands between the backend and its
//! device and holds launches back instead of issuing them one by one. Whatever must see their
//! effects — a copy to the host (the step's logits, a KV layer read for a transfer), a copy to
//! memory a held launch reads, a new allocation (it may replace memory a held launch uses) —
//! first flushes them. A flushed list of launches that was seen before (the same kernels,
//! geometry and arguments: a decode step of the same batch, whose inputs sit in the same
//! staging buffers) runs as one captured graph; memory a held launch reads is not freed before
//! the launch is issued (dropping it flushes first); the second time a list is seen it is captured,
//! before that it runs launch by launch. On a GPU a graph is one `cuGraphLaunch` instead of
//! hundreds of `cuLaunchKernel`s; on the emulated device it is the recorded list, so CI runs
//! all of this bookkeeping.

use std::any::Any;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use pdmesh_kv_types::{HostMemory, MemoryKind};

use super::{Arg, Device, DeviceError, DeviceMem, Dims, Unregistered};

/// A launch as the recorder holds it.
#[derive(Debug, Clone)]
pub struct Launch {
    pub kernel: String,
    pub dims: Dims,
    pub args: Vec<Arg>,
}

impl Launch {
    /// The launch's arguments as bits, so that lists compare exactly (an f32 by its bits).
    fn key(&self) -> (&str, Dims, Vec<u64>) {
        (&self.kernel, self.dims, self.args.iter().map(|a| a.bits()).collect())
    }

    /// Whether any pointer argument points into `mem`.
    fn reads(&self, mem: &DeviceMem) -> bool {
        let (lo, hi) = (mem.addr(), mem.addr() + mem.len() as u64);
        self.args.iter().any(|a| matches!(*a, Arg::Ptr(p) if p >= lo && p < hi))
    }
}

fn same(a: &[Launch], b: &[Launch]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.key() == y.key())
}

fn hash(list: &[Launch]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for l in list {
        l.key().hash(&mut h);
    }
    h.finish()
}

/// A list of launches the device replays as one: a CUDA graph on a GPU.
pub type Graph = Box<dyn Any + Send + Sync>;

/// Lists seen this many times are captured.
const CAPTURE_AFTER: u32 = 2;
/// Shorter lists are not worth a graph.
const MIN_LAUNCHES: usize = 8;
/// Graphs kept (each holds its device's executable graph); past it, lists run launch by launch.
const MAX_GRAPHS: usize = 64;
/// Distinct lists remembered for `CAPTURE_AFTER`; the count starts over past it.
const MAX_SEEN: usize = 4096;

/// How the recorder's flushed lists ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Lists run as a captured graph.
    pub replayed: u64,
    /// Lists captured (and then run as their graph).
    pub captured: u64,
    /// Lists run launch by launch.
    pub direct: u64,
}

#[derive(Default)]
struct State {
    pending: Vec<Launch>,
    graphs: HashMap<u64, (Vec<Launch>, Graph)>,
    seen: HashMap<u64, u32>,
    stats: GraphStats,
}

/// `D` with its launches held back and replayed as graphs (see the module doc).
pub struct Recorder<D: Device> {
    core: Arc<Core<D>>,
}

/// What the recorder and the memory it hands out share: memory being freed flushes first.
struct Core<D: Device> {
    inner: D,
    state: Mutex<State>,
}

/// Keeps an allocation alive until the launches held against it have been issued.
struct FlushOnDrop<D: Device> {
    core: Arc<Core<D>>,
    mem: DeviceMem,
}

impl<D: Device> Drop for FlushOnDrop<D> {
    fn drop(&mut self) {
        // A launch that cannot be issued now fails the same way at the next flush, which
        // reports it; here there is no one to tell.
        let _ = self.core.flush_if_read(&self.mem);
    }
}

impl<D: Device> std::fmt::Debug for Recorder<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder").field("inner", &self.core.inner).finish_non_exhaustive()
    }
}

impl<D: Device> Recorder<D> {
    pub fn new(inner: D) -> Self {
        Self { core: Arc::new(Core { inner, state: Mutex::new(State::default()) }) }
    }

    pub fn inner(&self) -> &D {
        &self.core.inner
    }

    pub fn stats(&self) -> GraphStats {
        self.core.lock().stats
    }

    /// Issues every held launch (see `Core::flush`).
    pub fn flush(&self) -> Result<(), DeviceError> {
        self.core.flush()
    }

    /// `mem` handed out so that dropping it issues the launches that read it first.
    fn guard(&self, mem: DeviceMem) -> DeviceMem {
        let (addr, len, kind) = (mem.addr(), mem.len(), mem.kind);
        let keep: Arc<dyn Any + Send + Sync> =
            Arc::new(FlushOnDrop { core: Arc::clone(&self.core), mem });
        // SAFETY: the same allocation, kept alive by `keep`, which holds the original.
        unsafe { DeviceMem::new(addr, len, kind, keep) }
    }
}

impl<D: Device> Core<D> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Issues every held launch: as a graph when this list has one, capturing it when it
    /// has been seen often enough, else one by one.
    pub fn flush(&self) -> Result<(), DeviceError> {
        let mut st = self.lock();
        if st.pending.is_empty() {
            return Ok(());
        }
        let inner = &self.inner;
        let list = std::mem::take(&mut st.pending);
        let h = hash(&list);
        if let Some((known, graph)) = st.graphs.get(&h)
            && same(known, &list)
        {
            inner.replay(graph)?;
            st.stats.replayed += 1;
            return Ok(());
        }
        if st.seen.len() >= MAX_SEEN {
            st.seen.clear();
        }
        let seen = st.seen.entry(h).or_insert(0);
        *seen += 1;
        let capture = *seen >= CAPTURE_AFTER
            && list.len() >= MIN_LAUNCHES
            && st.graphs.len() < MAX_GRAPHS
            && !st.graphs.contains_key(&h);
        if capture {
            let graph = inner.capture(&list)?;
            inner.replay(&graph)?;
            st.stats.captured += 1;
            st.graphs.insert(h, (list, graph));
            return Ok(());
        }
        for l in &list {
            inner.launch(&l.kernel, l.dims, &l.args)?;
        }
        st.stats.direct += 1;
        Ok(())
    }

    /// Flushes when a held launch reads `mem` (a copy into it must not overtake them).
    fn flush_if_read(&self, mem: &DeviceMem) -> Result<(), DeviceError> {
        let read = self.lock().pending.iter().any(|l| l.reads(mem));
        if read { self.flush() } else { Ok(()) }
    }
}

impl<D: Device> Device for Recorder<D> {
    fn describe(&self) -> String {
        self.core.inner.describe()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.core.inner.memory_kind()
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceMem, DeviceError> {
        Ok(self.guard(self.core.inner.alloc(bytes)?))
    }

    fn htod(&self, src: &[u8], dst: &DeviceMem, offset: usize) -> Result<(), DeviceError> {
        self.core.flush_if_read(dst)?;
        self.core.inner.htod(src, dst, offset)
    }

    fn dtoh(&self, src: &DeviceMem, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.core.flush()?;
        self.core.inner.dtoh(src, offset, dst)
    }

    fn dtod(
        &self,
        src: &DeviceMem,
        src_offset: usize,
        dst: &DeviceMem,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.core.flush()?;
        self.core.inner.dtod(src, src_offset, dst, dst_offset, len)
    }

    fn launch(&self, kernel: &str, dims: Dims, args: &[Arg]) -> Result<(), DeviceError> {
        let l = Launch { kernel: kernel.into(), dims, args: args.to_vec() };
        self.core.lock().pending.push(l);
        Ok(())
    }

    fn adopt_host(&self, memory: HostMemory) -> Result<DeviceMem, DeviceError> {
        Ok(self.guard(self.core.inner.adopt_host(memory)?))
    }

    fn host_alloc(&self, bytes: usize) -> Result<HostMemory, DeviceError> {
        self.core.inner.host_alloc(bytes)
    }

    fn host_register(&self, memory: HostMemory) -> Result<HostMemory, Unregistered> {
        self.core.inner.host_register(memory)
    }

    fn sync(&self) -> Result<(), DeviceError> {
        self.core.flush()?;
        self.core.inner.sync()
    }

    fn capture(&self, launches: &[Launch]) -> Result<Graph, DeviceError> {
        self.core.flush()?;
        self.core.inner.capture(launches)
    }

    fn replay(&self, graph: &Graph) -> Result<(), DeviceError> {
        self.core.flush()?;
        self.core.inner.replay(graph)
    }
}
