//! Paged KV storage: a fixed pool of blocks, each holding `block_size` tokens of keys and values
//! for every layer, in the byte layout `pdmesh_kv_types::KvGeometry` fixes (a contract: prefill
//! ships blocks to decode nodes and the prefix cache stores them), next to the attention that
//! reads it. The pool is one `HostMemory` allocation, so a transport can register it as a
//! `MemoryRegion` that keeps it alive.

use half::f16;
use pdmesh_kv_types::{HostMemory, MemoryRegion};

use crate::backend::{KvError, KvStorage};

pub use pdmesh_kv_types::{KvDtype, KvGeometry, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};

/// Where one token's K/V goes: a block of the pool and a slot in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSlot {
    pub block: u32,
    pub slot: u32,
}

/// The elements of a KV block pool, as the kernels read them.
#[derive(Debug, Clone, Copy)]
pub enum KvData<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
    /// q8_0 rows (either rotation): `row_bytes` bytes per row, blocks of an f16 scale and 32
    /// `i8`. Read the scale with `u16::from_le_bytes`: it is not aligned.
    Q8_0(&'a [u8]),
}

/// The elements of a KV block pool, as the kernels write them.
#[derive(Debug)]
pub enum KvDataMut<'a> {
    F16(&'a mut [f16]),
    F32(&'a mut [f32]),
    Q8_0(&'a mut [u8]),
}

/// One contiguous allocation holding `n_blocks` blocks.
#[derive(Debug)]
pub struct KvBuffer {
    geometry: KvGeometry,
    n_blocks: usize,
    memory: HostMemory,
}

impl KvBuffer {
    /// Allocates `n_blocks` zeroed blocks. Fails rather than aborting when memory is short.
    pub fn new(geometry: KvGeometry, n_blocks: usize) -> Result<Self, KvError> {
        let bytes = geometry.bytes_per_block().checked_mul(n_blocks).ok_or_else(|| {
            KvError::Alloc(format!("{n_blocks} KV blocks overflow the address space"))
        })?;
        let memory = HostMemory::zeroed(bytes).map_err(KvError::Alloc)?;
        Ok(Self { geometry, n_blocks, memory })
    }

    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn data(&self) -> KvData<'_> {
        // The allocation is aligned to 64 bytes and a whole number of elements long.
        let b = self.memory.bytes();
        match self.geometry.dtype {
            KvDtype::F16 => KvData::F16(bytemuck::cast_slice(b)),
            KvDtype::F32 => KvData::F32(bytemuck::cast_slice(b)),
            KvDtype::Q8_0 | KvDtype::Q8_0NoRot => KvData::Q8_0(b),
        }
    }

    pub fn data_mut(&mut self) -> KvDataMut<'_> {
        let dtype = self.geometry.dtype;
        let b = self.memory.bytes_mut();
        match dtype {
            KvDtype::F16 => KvDataMut::F16(bytemuck::cast_slice_mut(b)),
            KvDtype::F32 => KvDataMut::F32(bytemuck::cast_slice_mut(b)),
            KvDtype::Q8_0 | KvDtype::Q8_0NoRot => KvDataMut::Q8_0(b),
        }
    }

    pub fn size_bytes(&self) -> usize {
        self.n_blocks * self.geometry.bytes_per_block()
    }

    /// Copies block `src` over block `dst` (copy-on-write of a shared partial block).
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        let n = self.geometry.bytes_per_block();
        self.memory.bytes_mut().copy_within(src * n..(src + 1) * n, dst * n);
    }

    /// Appends block `block`'s bytes to `out`: what a KV transfer sends. Elements are in the
    /// machine's byte order, which is little-endian on every supported target (checked at
    /// compile time in lib.rs), so the wire format is little-endian.
    pub fn read_block_bytes(&self, block: usize, out: &mut Vec<u8>) {
        let n = self.geometry.bytes_per_block();
        out.extend_from_slice(&self.memory.bytes()[block * n..(block + 1) * n]);
    }

    /// Appends layer `layer`'s part of block `block` (K and V, `layer_elems` elements).
    pub fn read_layer_bytes(&self, block: usize, layer: usize, out: &mut Vec<u8>) {
        let g = &self.geometry;
        let start = block * g.bytes_per_block() + layer * g.bytes_per_layer();
        out.extend_from_slice(&self.memory.bytes()[start..start + g.bytes_per_layer()]);
    }

    /// The pool's memory: one allocation, fixed for the buffer's life and kept alive by the
    /// region; block `b` starts at `addr + b * bytes_per_block`.
    pub fn region(&self) -> MemoryRegion {
        self.memory.region()
    }

    /// Overwrites block `block` with bytes made by `read_block_bytes` on a pool of the same
    /// geometry. Fails, changing nothing, when `data` is not exactly one block.
    pub fn write_block_bytes(&mut self, block: usize, data: &[u8]) -> Result<(), KvError> {
        let want = self.geometry.bytes_per_block();
        if data.len() != want {
            return Err(KvError::BlockSize { want, got: data.len() });
        }
        if block >= self.n_blocks {
            return Err(KvError::NoSuchBlock { block, blocks: self.n_blocks });
        }
        self.memory.bytes_mut()[block * want..(block + 1) * want].copy_from_slice(data);
        Ok(())
    }

    /// Reads one element as f32 (for tests and checksums; kernels read the slices directly).
    /// `idx` counts elements as `KvGeometry::offset` does; q8_0 ones are dequantized.
    pub fn get(&self, idx: usize) -> f32 {
        match self.data() {
            KvData::F16(v) => v[idx].to_f32(),
            KvData::F32(v) => v[idx],
            KvData::Q8_0(b) => {
                let g = &self.geometry;
                let (row, within) = (idx / g.head_dim, idx % g.head_dim);
                let at = row * g.row_bytes() + within / Q8_0_BLOCK * Q8_0_BLOCK_BYTES;
                f32::from(b[at + 2 + within % Q8_0_BLOCK] as i8) * crate::quant::f16_at(&b[at..])
            }
        }
    }
}

impl KvStorage for KvBuffer {
    fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }
    fn n_blocks(&self) -> usize {
        self.n_blocks
    }
    fn read_block(&self, block: usize, out: &mut Vec<u8>) {
        self.read_block_bytes(block, out);
    }
    fn read_layer(&self, block: usize, layer: usize, out: &mut Vec<u8>) {
        self.read_layer_bytes(block, layer, out);
    }
    fn write_block(&mut self, block: usize, data: &[u8]) -> Result<(), KvError> {
        self.write_block_bytes(block, data)
    }
    fn copy_block(&mut self, src: usize, dst: usize) {
        KvBuffer::copy_block(self, src, dst);
    }
    fn region(&self) -> MemoryRegion {
        KvBuffer::region(self)
    }
    fn rehome(&mut self, memory: HostMemory) -> Result<(), KvError> {
        if memory.len() != self.memory.len() {
            return Err(KvError::Rehome(format!(
                "the new memory is {} bytes, the pool {}",
                memory.len(),
                self.memory.len()
            )));
        }
        self.memory = memory;
        Ok(())
    }
}

/// Whether a token is part of a prompt (prefill) or a generated token (decode).
///
/// The two use different but fixed summation orders inside attention: those of llama.cpp's
/// batched (prompt) and single-token (decode) attention kernels, so pdmesh reproduces its
/// results exactly. The phase belongs to the token, never to the batch: a prompt gives the
/// same logits however it is chunked and whatever shares its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Phase {
    #[default]
    Prefill,
    Decode,
}

/// One token's attention: attend to positions `first..=pos` of a sequence whose KV lives in
/// `blocks` (its block table). `first` is 0 for full attention and `pos + 1 - window` past
/// the start of a sliding window; the positions before it are masked, exactly as a mask of
/// -inf would: they take no part in the maximum and add exact zeros to every sum, so the
/// positions still attended to keep the summation lanes (counted from position 0) they would
/// have without the mask.
#[derive(Debug, Clone, Copy)]
pub struct AttnQuery<'a> {
    pub pos: usize,
    pub first: usize,
    pub blocks: &'a [u32],
    pub phase: Phase,
}

impl<'a> AttnQuery<'a> {
    /// Full attention to `0..=pos`.
    pub fn full(pos: usize, blocks: &'a [u32], phase: Phase) -> Self {
        Self { pos, first: 0, blocks, phase }
    }

    /// The same query through a sliding window of `window` tokens (itself included), or
    /// unchanged for `None`.
    pub fn windowed(self, window: Option<usize>) -> Self {
        let first = window.map_or(0, |w| (self.pos + 1).saturating_sub(w));
        Self { first, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_bytes_round_trip_between_pools() {
        for dtype in KvDtype::ALL {
            let head_dim = if dtype.is_q8_0() { 32 } else { 4 };
            let g = KvGeometry { layers: 2, kv_heads: 1, head_dim, block_size: 2, dtype };
            let mut a = KvBuffer::new(g, 3).unwrap();
            match a.data_mut() {
                KvDataMut::F16(v) => {
                    v.iter_mut().enumerate().for_each(|(i, x)| *x = f16::from_f32(i as f32))
                }
                KvDataMut::F32(v) => {
                    v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 * 0.5)
                }
                // Scale 1/4 (f16 0x3400) and quants counting up, wrapping.
                KvDataMut::Q8_0(v) => {
                    for (i, x) in v.iter_mut().enumerate() {
                        *x = match i % 34 {
                            0 => 0x00,
                            1 => 0x34,
                            _ => i as u8,
                        }
                    }
                }
            }
            let mut bytes = Vec::new();
            a.read_block_bytes(1, &mut bytes);
            assert_eq!(bytes.len(), g.bytes_per_block());
            let mut b = KvBuffer::new(g, 2).unwrap();
            b.write_block_bytes(0, &bytes).unwrap();
            for i in 0..g.block_elems() {
                assert_eq!(b.get(i), a.get(g.block_elems() + i), "{dtype:?} element {i}");
            }
            assert_eq!(b.get(g.block_elems()), 0.0, "wrote past the block");
            assert!(b.write_block_bytes(0, &bytes[1..]).is_err());
            assert!(b.write_block_bytes(2, &bytes).is_err());
        }
    }

    #[test]
    fn copy_block_copies_only_that_block() {
        let g =
            KvGeometry { layers: 1, kv_heads: 1, head_dim: 2, block_size: 2, dtype: KvDtype::F32 };
        let mut kv = KvBuffer::new(g, 3).unwrap();
        if let KvDataMut::F32(v) = kv.data_mut() {
            for (i, x) in v.iter_mut().enumerate() {
                *x = i as f32;
            }
        }
        kv.copy_block(0, 2);
        assert_eq!(kv.get(g.offset(2, 0, 1, 0, 1) + 1), kv.get(g.offset(0, 0, 1, 0, 1) + 1));
        assert_eq!(kv.get(g.offset(1, 0, 0, 0, 0)), 8.0);
    }
}
