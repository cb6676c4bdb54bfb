//! Paged KV storage: a fixed pool of blocks, each holding `block_size` tokens of keys and values
//! for every layer. The byte layout is a contract (prefill ships blocks to decode nodes and the
//! prefix cache stores them), so it lives here next to the attention that reads it.
//!
//! One block is `[layer][K|V][kv_head][slot][head_dim]` elements: a block is one contiguous
//! region, a layer's part of a block is contiguous (so a layer can be shipped as soon as it is
//! computed), and one head's keys for consecutive tokens are contiguous (so attention streams).

use half::f16;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub const fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            other => Err(format!("unknown KV dtype {other:?} (expected f16 or f32)")),
        }
    }
}

/// The shape of a KV cache: everything needed to locate an element in a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl KvGeometry {
    /// Elements of K (or of V) for one token in one layer.
    pub const fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements in one layer's part of a block (K and V).
    pub const fn layer_elems(&self) -> usize {
        2 * self.kv_heads * self.block_size * self.head_dim
    }

    pub const fn block_elems(&self) -> usize {
        self.layers * self.layer_elems()
    }

    /// The memory ledger: bytes of KV one token costs (2 × layers × kv_heads × head_dim × bytes).
    pub const fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype.bytes()
    }

    pub const fn bytes_per_block(&self) -> usize {
        self.block_elems() * self.dtype.bytes()
    }

    /// Element offset of `(block, layer, kv, head, slot)`'s first dim; `kv` is 0 for K, 1 for V.
    #[inline(always)]
    pub const fn offset(
        &self,
        block: usize,
        layer: usize,
        kv: usize,
        head: usize,
        slot: usize,
    ) -> usize {
        block * self.block_elems()
            + layer * self.layer_elems()
            + ((kv * self.kv_heads + head) * self.block_size + slot) * self.head_dim
    }
}

/// Where one token's K/V goes: a block of the pool and a slot in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSlot {
    pub block: u32,
    pub slot: u32,
}

/// The storage of a KV block pool.
#[derive(Debug)]
pub enum KvData {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

/// One contiguous allocation holding `n_blocks` blocks.
#[derive(Debug)]
pub struct KvBuffer {
    geometry: KvGeometry,
    n_blocks: usize,
    data: KvData,
}

impl KvBuffer {
    /// Allocates `n_blocks` zeroed blocks. Fails rather than aborting when memory is short.
    pub fn new(geometry: KvGeometry, n_blocks: usize) -> Result<Self, String> {
        let elems = geometry
            .block_elems()
            .checked_mul(n_blocks)
            .ok_or_else(|| format!("{n_blocks} KV blocks overflow the address space"))?;
        let data = match geometry.dtype {
            KvDtype::F16 => KvData::F16(zeroed(elems, f16::ZERO)?),
            KvDtype::F32 => KvData::F32(zeroed(elems, 0.0)?),
        };
        Ok(Self { geometry, n_blocks, data })
    }

    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn data(&self) -> &KvData {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut KvData {
        &mut self.data
    }

    pub fn size_bytes(&self) -> usize {
        self.n_blocks * self.geometry.bytes_per_block()
    }

    /// Copies block `src` over block `dst` (copy-on-write of a shared partial block).
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        let n = self.geometry.block_elems();
        match &mut self.data {
            KvData::F16(v) => v.copy_within(src * n..(src + 1) * n, dst * n),
            KvData::F32(v) => v.copy_within(src * n..(src + 1) * n, dst * n),
        }
    }

    /// Appends block `block`'s bytes to `out`: what a KV transfer sends. Elements are in the
    /// machine's byte order, which is little-endian on every supported target (checked at
    /// compile time in lib.rs), so the wire format is little-endian.
    pub fn read_block_bytes(&self, block: usize, out: &mut Vec<u8>) {
        let n = self.geometry.block_elems();
        let range = block * n..(block + 1) * n;
        match &self.data {
            KvData::F16(v) => out.extend_from_slice(bytemuck::cast_slice(&v[range])),
            KvData::F32(v) => out.extend_from_slice(bytemuck::cast_slice(&v[range])),
        }
    }

    /// Appends layer `layer`'s part of block `block` (K and V, `layer_elems` elements).
    pub fn read_layer_bytes(&self, block: usize, layer: usize, out: &mut Vec<u8>) {
        let g = &self.geometry;
        let start = block * g.block_elems() + layer * g.layer_elems();
        let range = start..start + g.layer_elems();
        match &self.data {
            KvData::F16(v) => out.extend_from_slice(bytemuck::cast_slice(&v[range])),
            KvData::F32(v) => out.extend_from_slice(bytemuck::cast_slice(&v[range])),
        }
    }

    /// The pool's memory as `(address, bytes)`: one allocation, fixed for the buffer's life.
    pub fn region(&self) -> (usize, usize) {
        let addr = match &self.data {
            KvData::F16(v) => v.as_ptr() as usize,
            KvData::F32(v) => v.as_ptr() as usize,
        };
        (addr, self.size_bytes())
    }

    /// Overwrites block `block` with bytes made by `read_block_bytes` on a pool of the same
    /// geometry. Fails, changing nothing, when `data` is not exactly one block.
    pub fn write_block_bytes(&mut self, block: usize, data: &[u8]) -> Result<(), String> {
        let want = self.geometry.bytes_per_block();
        if data.len() != want {
            return Err(format!("a KV block is {want} bytes, got {}", data.len()));
        }
        if block >= self.n_blocks {
            return Err(format!("block {block} is outside a pool of {}", self.n_blocks));
        }
        let n = self.geometry.block_elems();
        let range = block * n..(block + 1) * n;
        match &mut self.data {
            KvData::F16(v) => {
                bytemuck::cast_slice_mut::<f16, u8>(&mut v[range]).copy_from_slice(data)
            }
            KvData::F32(v) => {
                bytemuck::cast_slice_mut::<f32, u8>(&mut v[range]).copy_from_slice(data)
            }
        }
        Ok(())
    }

    /// Reads one element as f32 (for tests and checksums; kernels read the slices directly).
    pub fn get(&self, idx: usize) -> f32 {
        match &self.data {
            KvData::F16(v) => v[idx].to_f32(),
            KvData::F32(v) => v[idx],
        }
    }
}

fn zeroed<T: Clone>(n: usize, zero: T) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| format!("cannot allocate {n} KV elements: {e}"))?;
    v.resize(n, zero);
    Ok(v)
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

/// One token's attention: attend to positions `0..=pos` of a sequence whose KV lives in
/// `blocks` (its block table).
#[derive(Debug, Clone, Copy)]
pub struct AttnQuery<'a> {
    pub pos: usize,
    pub blocks: &'a [u32],
    pub phase: Phase,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom() -> KvGeometry {
        KvGeometry { layers: 30, kv_heads: 3, head_dim: 64, block_size: 16, dtype: KvDtype::F16 }
    }

    #[test]
    fn ledger_matches_smollm2() {
        let g = geom();
        assert_eq!(g.bytes_per_token(), 2 * 30 * 3 * 64 * 2);
        assert_eq!(g.bytes_per_block(), 16 * g.bytes_per_token());
    }

    #[test]
    fn offsets_tile_a_block_without_overlap() {
        let g =
            KvGeometry { layers: 2, kv_heads: 2, head_dim: 4, block_size: 3, dtype: KvDtype::F32 };
        let mut seen = vec![false; 2 * g.block_elems()];
        for b in 0..2 {
            for l in 0..2 {
                for kv in 0..2 {
                    for h in 0..2 {
                        for s in 0..3 {
                            for d in 0..4 {
                                let o = g.offset(b, l, kv, h, s) + d;
                                assert!(!seen[o]);
                                seen[o] = true;
                            }
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn block_bytes_round_trip_between_pools() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let g = KvGeometry { layers: 2, kv_heads: 1, head_dim: 4, block_size: 2, dtype };
            let mut a = KvBuffer::new(g, 3).unwrap();
            match a.data_mut() {
                KvData::F16(v) => {
                    v.iter_mut().enumerate().for_each(|(i, x)| *x = f16::from_f32(i as f32))
                }
                KvData::F32(v) => v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 * 0.5),
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
        if let KvData::F32(v) = kv.data_mut() {
            for (i, x) in v.iter_mut().enumerate() {
                *x = i as f32;
            }
        }
        kv.copy_block(0, 2);
        assert_eq!(kv.get(g.offset(2, 0, 1, 0, 1) + 1), kv.get(g.offset(0, 0, 1, 0, 1) + 1));
        assert_eq!(kv.get(g.offset(1, 0, 0, 0, 0)), 8.0);
    }
}
