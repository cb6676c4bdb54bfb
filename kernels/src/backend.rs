//! The one interface the engine computes through. The CPU backend implements it today; a CUDA
//! backend will implement the same operations on device buffers.
//!
//! Every operation computes each output element with a fixed sequence of floating-point
//! operations that does not depend on how many tokens share the call or how work is split
//! across threads: that is what makes a sequence's logits bit-identical whatever else is in its
//! batch and however its prompt was chunked.

use crate::kv::{AttnQuery, KvBuffer, KvSlot};
use crate::quant::{Activations, WeightMatrix};

/// One weight matrix applied to the shared activations: `out[t * rows + r] = W[r] · x[t]`.
#[derive(Debug)]
pub struct MatmulJob<'w, 'o> {
    pub weight: WeightMatrix<'w>,
    pub out: &'o mut [f32],
}

/// Compute operations of the llama forward pass.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// A short description, e.g. `cpu/avx2 x2`.
    fn describe(&self) -> String;

    /// Threads this backend computes with.
    fn threads(&self) -> usize;

    /// Stores `x` (`rows × cols`) in `out`, quantizing it for integer dot products when `cols`
    /// is a whole number of blocks.
    fn quantize(&self, x: &[f32], rows: usize, cols: usize, out: &mut Activations);

    /// Runs every job against `x` in one parallel region (q/k/v or gate/up share an input).
    fn matmul(&self, x: &Activations, jobs: &mut [MatmulJob<'_, '_>]);

    /// `out[t] = x[t] / rms(x[t]) * weight` for each row of `weight.len()` elements.
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]);

    /// Rotates adjacent pairs of each head of each token (llama.cpp's "normal" RoPE, which is
    /// what GGUF llama weights expect). `cos`/`sin` hold `head_dim / 2` entries per token.
    fn rope(&self, x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]);

    /// `out = silu(gate) * up`.
    fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]);

    /// `x += y`.
    fn add_assign(&self, x: &mut [f32], y: &[f32]);

    /// Writes one token's K and V rows (`kv_heads × head_dim` each) per slot into layer `layer`.
    fn kv_write(&self, kv: &mut KvBuffer, layer: usize, k: &[f32], v: &[f32], slots: &[KvSlot]);

    /// Causal attention of each query token (`heads × head_dim` in `q`) over its sequence's
    /// paged KV in layer `layer`; writes `heads × head_dim` per token to `out`.
    fn attention(
        &self,
        kv: &KvBuffer,
        layer: usize,
        heads: usize,
        q: &[f32],
        queries: &[AttnQuery<'_>],
        out: &mut [f32],
    );

    /// Looks up (dequantizes) embedding rows.
    fn embed(&self, table: &WeightMatrix<'_>, tokens: &[u32], out: &mut [f32]);
}
