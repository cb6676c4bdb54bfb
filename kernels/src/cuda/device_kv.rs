//! The paged KV pool in device memory (`DeviceKv`, in `KvGeometry`'s byte layout, moved in and
//! out whole blocks at a time for transports), and what the kernels read of a step's use of it:
//! each token's slot, and the query tiles `attention_tiled` takes.

use std::sync::Arc;

use pdmesh_kv_types::{HostMemory, KvDtype, KvGeometry, MemoryKind, MemoryRegion};

use super::backend::ok;
use super::{Arg, Device, DeviceMem, Recorder};
use crate::backend::{KvError, KvStorage, check_writes};
use crate::kv::{AttnQuery, KvSlot};

/// The paged KV pool in device memory, in `KvGeometry`'s byte layout.
#[derive(Debug)]
pub struct DeviceKv<D: Device> {
    dev: Arc<Recorder<D>>,
    pub(super) geometry: KvGeometry,
    pub(super) n_blocks: usize,
    mem: DeviceMem,
}

impl<D: Device> DeviceKv<D> {
    pub(super) fn new(
        dev: Arc<Recorder<D>>,
        geometry: KvGeometry,
        n_blocks: usize,
        mem: DeviceMem,
    ) -> Self {
        Self { dev, geometry, n_blocks, mem }
    }

    fn block_range(&self, block: usize) -> (usize, usize) {
        let n = self.geometry.bytes_per_block();
        (block * n, n)
    }

    /// The dtype as the kernels number it (`PD_KV_*` in attention.cu).
    fn dtype_code(&self) -> i32 {
        match self.geometry.dtype {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::Q8_0 | KvDtype::Q8_0NoRot => 2,
        }
    }

    pub(super) fn is_q8(&self) -> bool {
        self.geometry.dtype.is_q8_0()
    }

    /// The pool and its layout as the kernels' first arguments.
    pub(super) fn args(&self) -> [Arg; 6] {
        let g = &self.geometry;
        [
            Arg::ptr(&self.mem),
            Arg::I32(self.dtype_code()),
            Arg::int(g.layers),
            Arg::int(g.kv_heads),
            Arg::int(g.head_dim),
            Arg::int(g.block_size),
        ]
    }
}

impl<D: Device> KvStorage for DeviceKv<D> {
    fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    fn read_block(&self, block: usize, out: &mut Vec<u8>) {
        let (at, n) = self.block_range(block);
        let start = out.len();
        out.resize(start + n, 0);
        ok(self.dev.dtoh(&self.mem, at, &mut out[start..]));
    }

    fn read_layer(&self, block: usize, layer: usize, out: &mut Vec<u8>) {
        let (at, _) = self.block_range(block);
        let n = self.geometry.bytes_per_layer();
        let start = out.len();
        out.resize(start + n, 0);
        ok(self.dev.dtoh(&self.mem, at + layer * n, &mut out[start..]));
    }

    fn write_block(&mut self, block: usize, data: &[u8]) -> Result<(), KvError> {
        self.write_blocks(&[(block, data)])
    }

    fn write_blocks(&mut self, writes: &[(usize, &[u8])]) -> Result<(), KvError> {
        let want = self.geometry.bytes_per_block();
        check_writes(want, self.n_blocks, writes)?;
        for &(block, data) in writes {
            ok(self.dev.htod(data, &self.mem, block * want));
        }
        // From page-locked memory (`staging`) the copies are asynchronous; the caller may
        // reuse the sources once this returns.
        ok(self.dev.sync());
        Ok(())
    }

    fn copy_block(&mut self, src: usize, dst: usize) {
        let (s, n) = self.block_range(src);
        let (d, _) = self.block_range(dst);
        ok(self.dev.dtod(&self.mem, s, &self.mem, d, n));
    }

    fn region(&self) -> MemoryRegion {
        self.mem.region()
    }

    fn rehome(&mut self, memory: HostMemory) -> Result<(), KvError> {
        if self.dev.memory_kind() != MemoryKind::Host {
            return Err(KvError::Rehome("a KV pool in GPU memory stays there".into()));
        }
        if memory.len() != self.mem.len() {
            return Err(KvError::Rehome(format!(
                "the new memory is {} bytes, the pool {}",
                memory.len(),
                self.mem.len()
            )));
        }
        self.mem = self.dev.adopt_host(memory).map_err(|e| KvError::Rehome(e.to_string()))?;
        Ok(())
    }

    fn staging(&self, len: usize) -> Result<HostMemory, KvError> {
        self.dev.host_alloc(len).map_err(|e| KvError::Alloc(e.to_string()))
    }

    fn pin(&self, memory: HostMemory) -> Result<HostMemory, (HostMemory, KvError)> {
        self.dev.host_register(memory).map_err(|u| (u.memory, KvError::Alloc(u.reason.to_string())))
    }
}

/// The tiles `attention_tiled` takes, per chunk of `chunk` queries: (first query within the
/// chunk, count) for runs of up to 16 queries of one sequence (block table) and phase at
/// consecutive positions.
pub(super) fn attention_tiles(
    queries: &[AttnQuery<'_>],
    table_at: &[u32],
    chunk: usize,
) -> Vec<Vec<(u32, u32)>> {
    const TILE: u32 = 16;
    let mut chunks = Vec::new();
    for t0 in (0..queries.len()).step_by(chunk) {
        let mut tiles: Vec<(u32, u32)> = Vec::new();
        for t in t0..(t0 + chunk).min(queries.len()) {
            let joins = tiles.last().is_some_and(|&(f, k)| {
                let prev = t0 + (f + k) as usize - 1;
                k < TILE
                    && prev == t - 1
                    && table_at[prev] == table_at[t]
                    && queries[prev].phase == queries[t].phase
                    && queries[prev].pos + 1 == queries[t].pos
            });
            match tiles.last_mut() {
                Some(last) if joins => last.1 += 1,
                _ => tiles.push(((t - t0) as u32, 1)),
            }
        }
        chunks.push(tiles);
    }
    chunks
}

/// `(block, slot)` of each token as the kernels read them, each checked against the pool.
pub(super) fn slot_pairs<D: Device>(kv: &DeviceKv<D>, slots: &[KvSlot]) -> Vec<u8> {
    let mut pairs = Vec::with_capacity(slots.len() * 8);
    for s in slots {
        assert!(
            (s.block as usize) < kv.n_blocks && (s.slot as usize) < kv.geometry.block_size,
            "kv_write: bad slot {s:?}"
        );
        pairs.extend_from_slice(&s.block.to_le_bytes());
        pairs.extend_from_slice(&s.slot.to_le_bytes());
    }
    pairs
}
