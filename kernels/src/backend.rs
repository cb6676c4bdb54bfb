//! The one interface the engine computes through, for any device. A backend owns its memory:
//! activation buffers, quantized activations, the paged KV pool and the weights are its own
//! associated types (as candle's `BackendStorage`), made by the backend, so a device backend
//! keeps them in device memory and the engine never touches them directly. The host only
//! hands over token ids, RoPE tables and KV slot lists, and reads logits back.
//!
//! Every operation computes each output element with a fixed sequence of floating-point
//! operations that does not depend on how many tokens share the call or how work is split
//! across threads: that is what makes a sequence's logits bit-identical whatever else is in its
//! batch and however its prompt was chunked.

use pdmesh_kv_types::{HostMemory, KvGeometry, MemoryRegion};

use crate::candidates::{Candidates, Cut, MAX_CANDIDATES};
use crate::kv::{AttnQuery, KvSlot, Phase};
use crate::quant::{ActNeeds, HostWeight};

/// One weight matrix applied to the shared activations: `out[t * rows + r] = W[r] · x[t]`.
#[derive(Debug)]
pub struct MatmulJob<'a, W, O> {
    pub weight: &'a W,
    pub out: &'a mut O,
}

/// Which dimensions of a head RoPE rotates together (llama.cpp's rope types). The type belongs
/// to the architecture, not the file: conversion lays out Q and K for the one its family uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeMode {
    /// Adjacent pairs `(2i, 2i + 1)`: `LLAMA_ROPE_TYPE_NORM` (llama; its conversion permutes
    /// the Q and K rows from Hugging Face's half-split order into this one).
    Normal,
    /// Pairs `(i, i + head_dim / 2)`: `LLAMA_ROPE_TYPE_NEOX` (Qwen2, Qwen3 and most others).
    Neox,
}

/// The angles RoPE rotates by: `head_dim / 2` cosines and sines per token, and which pairs.
#[derive(Debug)]
pub struct Rope<'a, B> {
    pub cos: &'a B,
    pub sin: &'a B,
    pub mode: RopeMode,
}

// By hand: derived, they would ask for `B: Copy`, and buffers are not.
impl<B> Clone for Rope<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Rope<'_, B> {}

/// Why a KV pool cannot be made or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("cannot allocate the KV pool: {0}")]
    Alloc(String),
    #[error("a KV block is {want} bytes, got {got}")]
    BlockSize { want: usize, got: usize },
    #[error("block {block} is outside a pool of {blocks}")]
    NoSuchBlock { block: usize, blocks: usize },
    #[error("cannot move the KV pool: {0}")]
    Rehome(String),
}

/// A paged KV pool in some backend's memory, as everything outside the kernels sees it: whole
/// blocks and layers of blocks in and out as the bytes of the wire format (`KvGeometry`), and
/// the memory region a transport registers.
pub trait KvStorage: Send + std::fmt::Debug {
    fn geometry(&self) -> &KvGeometry;
    fn n_blocks(&self) -> usize;
    /// Appends block `block`'s bytes to `out`.
    fn read_block(&self, block: usize, out: &mut Vec<u8>);
    /// Appends layer `layer`'s part of block `block` to `out`.
    fn read_layer(&self, block: usize, layer: usize, out: &mut Vec<u8>);
    /// Overwrites block `block` with one block's bytes; on error nothing changed.
    fn write_block(&mut self, block: usize, data: &[u8]) -> Result<(), KvError>;
    /// `write_block` for each `(block, bytes)`, all checked before any is written; a device
    /// waits for its copies once, at the end, rather than after each.
    fn write_blocks(&mut self, writes: &[(usize, &[u8])]) -> Result<(), KvError> {
        check_writes(self.geometry().bytes_per_block(), self.n_blocks(), writes)?;
        writes.iter().try_for_each(|&(b, d)| self.write_block(b, d))
    }
    /// Copies block `src` over block `dst` (copy-on-write of a shared partial block).
    fn copy_block(&mut self, src: usize, dst: usize);
    /// The pool's memory, kept alive by the region.
    fn region(&self) -> MemoryRegion;
    /// Moves the pool into `memory`, host memory of exactly the pool's size that someone
    /// else allocated (a transport whose peers reach it directly). The blocks' bytes are not
    /// carried over: the caller holds no KV yet. A pool that must stay where it is (device
    /// memory) refuses.
    fn rehome(&mut self, memory: HostMemory) -> Result<(), KvError>;
    /// `len` zeroed bytes of host memory that `write_block` copies from fastest: where a
    /// transport that cannot reach the pool's own memory stages blocks (page-locked for a
    /// GPU).
    fn staging(&self, len: usize) -> Result<HostMemory, KvError> {
        HostMemory::zeroed(len).map_err(KvError::Alloc)
    }

    /// Makes fresh host memory someone else allocated (a transport's shared staging area)
    /// as fast for `write_block` to copy from as `staging`'s, for as long as the returned
    /// memory lives: page-locked for a GPU; a pool in host memory takes it as it is. On
    /// failure the memory comes back with the reason.
    fn pin(&self, memory: HostMemory) -> Result<HostMemory, (HostMemory, KvError)> {
        Ok(memory)
    }
}

/// Checks `KvStorage::write_blocks`'s writes against a pool of `blocks` blocks of `bytes`.
pub fn check_writes(bytes: usize, blocks: usize, writes: &[(usize, &[u8])]) -> Result<(), KvError> {
    for &(block, data) in writes {
        if data.len() != bytes {
            return Err(KvError::BlockSize { want: bytes, got: data.len() });
        }
        if block >= blocks {
            return Err(KvError::NoSuchBlock { block, blocks });
        }
    }
    Ok(())
}

/// Compute operations of the llama forward pass, on the backend's own memory.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// A buffer of f32 values.
    type Buffer: Send + std::fmt::Debug;
    /// A batch of activation rows prepared for the matmuls (quantized for integer dot
    /// products when the weights are).
    type Activations: Send + std::fmt::Debug;
    /// The paged KV pool.
    type Kv: KvStorage;
    /// A weight matrix as this backend computes with it.
    type Weight: Send + Sync + std::fmt::Debug;

    /// A short description, e.g. `cpu/avx2 x2`.
    fn describe(&self) -> String;

    /// Threads (or streams) this backend computes with.
    fn threads(&self) -> usize;

    /// An empty buffer.
    fn buffer(&self) -> Self::Buffer;

    /// Empty activations.
    fn activations(&self) -> Self::Activations;

    /// Makes `buf` hold `len` values (contents unspecified), keeping its memory when it can.
    fn resize(&self, buf: &mut Self::Buffer, len: usize);

    /// Copies host values into `buf`, sizing it.
    fn upload(&self, host: &[f32], buf: &mut Self::Buffer);

    /// The values of `buf` on the host: a view when they are there already, else copied into
    /// `host`.
    fn read<'a>(&self, buf: &'a Self::Buffer, host: &'a mut Vec<f32>) -> &'a [f32];

    /// A zeroed KV pool of `blocks` blocks.
    fn kv(&self, geometry: KvGeometry, blocks: usize) -> Result<Self::Kv, KvError>;

    /// A weight ready to compute with (a device backend uploads it here, once).
    fn weight(&self, w: &HostWeight) -> Self::Weight;

    /// Stores `x` (`rows × cols`) in `out`, quantized or rounded into the forms `needs` names
    /// (those the weights it will be multiplied with consume); `phases` holds each row's token
    /// phase, which picks the summation order of float weights.
    fn quantize(
        &self,
        x: &Self::Buffer,
        rows: usize,
        cols: usize,
        needs: ActNeeds,
        phases: &[Phase],
        out: &mut Self::Activations,
    );

    /// `rms_norm` of `x` (`rows × cols`) by `weight` into `scratch` (sized by the caller),
    /// then `quantize` of it into `out`. A backend that fuses the two (one pass through memory) may leave
    /// `scratch` untouched: nothing reads it after.
    #[allow(clippy::too_many_arguments)]
    fn norm_quantize(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
        (rows, cols): (usize, usize),
        needs: ActNeeds,
        phases: &[Phase],
        scratch: &mut Self::Buffer,
        out: &mut Self::Activations,
    ) {
        self.rms_norm(x, weight, eps, scratch);
        self.quantize(scratch, rows, cols, needs, phases, out);
    }

    /// Runs every job against `x` in one parallel region (q/k/v or gate/up share an input).
    fn matmul(&self, x: &Self::Activations, jobs: &mut [MatmulJob<'_, Self::Weight, Self::Buffer>]);

    /// `out[t] = x[t] / rms(x[t]) * weight` for each row of `weight`'s length.
    fn rms_norm(&self, x: &Self::Buffer, weight: &Self::Buffer, eps: f32, out: &mut Self::Buffer);

    /// Rotates the pairs `mode` names in each head of each token by the angles whose cosines
    /// and sines `cos`/`sin` hold (`head_dim / 2` entries per token, pair `i` at entry `i`).
    fn rope(
        &self,
        x: &mut Self::Buffer,
        heads: usize,
        head_dim: usize,
        cos: &Self::Buffer,
        sin: &Self::Buffer,
        mode: RopeMode,
    );

    /// `out = silu(gate) * up`.
    fn swiglu(&self, gate: &Self::Buffer, up: &Self::Buffer, out: &mut Self::Buffer);

    /// `out = gelu(gate) * up`, GELU's tanh approximation as llama.cpp's CPU backend computes
    /// it: looked up by the input rounded to f16 in a table of f16 values (`gelu_f16`), the
    /// input itself past ±10.
    fn geglu(&self, gate: &Self::Buffer, up: &Self::Buffer, out: &mut Self::Buffer);

    /// `x *= s`.
    fn scale(&self, x: &mut Self::Buffer, s: f32);

    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Buffer, y: &Self::Buffer);

    /// Adds `bias` to every row of `x` (rows of `bias`'s length): a linear layer's bias.
    fn add_rows(&self, x: &mut Self::Buffer, bias: &Self::Buffer);

    /// Writes one token's K and V rows (`kv_heads × head_dim` each) per slot into layer `layer`.
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Buffer,
        v: &Self::Buffer,
        slots: &[KvSlot],
    );

    /// `rope` of `q` (`heads` per token) and `k` (the pool's `kv_heads`), then `kv_write` of
    /// `k` and `v` into layer `layer`. A backend that fuses them stores the rotated K straight
    /// into the pool and may leave `k` as it was: nothing reads it after.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &Self::Buffer,
        heads: usize,
        rope: Rope<'_, Self::Buffer>,
        slots: &[KvSlot],
    ) {
        let (kv_heads, hd) = (kv.geometry().kv_heads, kv.geometry().head_dim);
        self.rope(q, heads, hd, rope.cos, rope.sin, rope.mode);
        self.rope(k, kv_heads, hd, rope.cos, rope.sin, rope.mode);
        self.kv_write(kv, layer, k, v, slots);
    }

    /// Causal attention of each query token (`heads × head_dim` in `q`) over its sequence's
    /// paged KV in layer `layer`, positions `first..=pos` of each query, scores `q·k` times
    /// `scale`; writes `heads × head_dim` per token to `out`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        kv: &Self::Kv,
        layer: usize,
        heads: usize,
        q: &Self::Buffer,
        scale: f32,
        queries: &[AttnQuery<'_>],
        out: &mut Self::Buffer,
    );

    /// The Hadamard transform of every run of `n` values (a power of two) of `x`, scaled by
    /// `1/√n`: the rotation llama.cpp applies around attention over a quantized KV cache.
    fn fwht(&self, x: &mut Self::Buffer, n: usize);

    /// Looks up (dequantizes) embedding rows.
    fn embed(&self, table: &Self::Weight, tokens: &[u32], out: &mut Self::Buffer);

    /// Copies rows `rows` (each `width` values) of `x` into `out`, in that order.
    fn gather_rows(&self, x: &Self::Buffer, rows: &[usize], width: usize, out: &mut Self::Buffer);

    /// Each of `cuts.len()` rows of `cols` values in `x` cut to its candidates
    /// (`Cut::apply`), into `out`: a device reduces the rows where they are and reads back
    /// only the candidates. `false` (and `out` unspecified) when a row has more than
    /// `MAX_CANDIDATES`: read the rows whole instead.
    fn candidates(
        &self,
        x: &Self::Buffer,
        cols: usize,
        cuts: &[Cut],
        out: &mut Candidates,
    ) -> bool {
        let mut host = Vec::new();
        let v = self.read(x, &mut host);
        out.clear();
        for (row, cut) in v.chunks_exact(cols.max(1)).zip(cuts) {
            cut.apply(row, &mut out.items);
            if out.items.len() - out.offsets[out.offsets.len() - 1] > MAX_CANDIDATES {
                return false;
            }
            out.offsets.push(out.items.len());
        }
        true
    }
}
