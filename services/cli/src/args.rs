//! Options shared by every command that loads a model.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Args;
use pdmesh_engine::{
    BackendKind, BackendName, CudaOptions, DEFAULT_MODEL_PATH, Engine, EngineConfig, Model,
};
use pdmesh_kernels::{KvDtype, Simd};

#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Path to a GGUF model (llama, qwen2, qwen3 or gemma3 architecture).
    #[arg(long, env = "PDMESH_MODEL", default_value = DEFAULT_MODEL_PATH)]
    pub model: PathBuf,
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// KV cache element type: f16, f32, q8_0 (llama.cpp's 8-bit blocks with its Hadamard
    /// rotation: half of f16's memory and transfer bytes) or q8_0-norot (without it).
    #[arg(long, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Blocks in the KV pool (the ledger line printed at start says what that costs). A model
    /// with sliding-window layers (Gemma 3) lets theirs go once the window has left them, so a
    /// long prompt fits in far fewer than its tokens / block-size.
    #[arg(long, default_value_t = 512)]
    pub kv_blocks: usize,
    /// Most tokens one engine step processes (prompt chunk size).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Force a kernel set of the cpu backend: portable or avx2 (default: best available).
    #[arg(long)]
    pub simd: Option<Simd>,
    /// What computes: cpu; cuda (an NVIDIA GPU through the driver found at run time; fails at
    /// start, saying why, where there is none); or cuda-emu (the CUDA backend's kernels on an
    /// emulation of the GPU on this CPU: slow, for checking the CUDA backend without a GPU).
    #[arg(long, default_value = "cpu")]
    pub backend: BackendName,
    /// Which GPU `--backend cuda` computes on (CUDA device ordinal).
    #[arg(long, default_value_t = 0)]
    pub cuda_device: usize,
    /// With --backend cuda or cuda-emu: prompt matmuls of quantized weights (Q8_0, Q4_0, Q4_1,
    /// Q5_0, Q5_1 and the K-quants) on the int8 tensor cores. Logits are then within a stated
    /// bound of the CPU's, no longer bit for bit.
    #[arg(long)]
    pub cuda_mma: bool,
    /// With --backend cuda or cuda-emu: attention of batches with prompt tokens (f16/f32 KV)
    /// with flash attention's running softmax (no scores through GPU memory). Logits are then
    /// within a stated bound of the CPU's, no longer bit for bit.
    #[arg(long)]
    pub cuda_flash: bool,
}

impl EngineArgs {
    pub fn config(&self) -> anyhow::Result<EngineConfig> {
        if self.simd.is_some() && self.backend != BackendName::Cpu {
            bail!(
                "--simd picks the cpu backend's kernels; it does not apply to --backend {}",
                self.backend
            );
        }
        if self.cuda_device != 0 && self.backend != BackendName::Cuda {
            bail!("--cuda-device applies to --backend cuda only");
        }
        for (flag, on) in [("--cuda-mma", self.cuda_mma), ("--cuda-flash", self.cuda_flash)] {
            if on && self.backend == BackendName::Cpu {
                bail!("{flag} applies to --backend cuda or cuda-emu only");
            }
        }
        let opts = CudaOptions { mma: self.cuda_mma, flash: self.cuda_flash };
        Ok(EngineConfig {
            threads: self.threads,
            block_size: self.block_size,
            kv_dtype: self.kv_dtype,
            kv_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            backend: match self.backend {
                BackendName::Cpu => BackendKind::Cpu { simd: self.simd },
                BackendName::Cuda => BackendKind::Cuda { device: self.cuda_device, opts },
                BackendName::CudaEmu => BackendKind::CudaEmu { opts },
            },
        })
    }

    pub fn load_model(&self) -> anyhow::Result<Arc<Model>> {
        if !self.model.exists() {
            bail!(
                "model file {} not found: run `just fetch-model` (or pass --model PATH)",
                self.model.display()
            );
        }
        let model = Model::load(&self.model)
            .with_context(|| format!("loading {}", self.model.display()))?;
        Ok(Arc::new(model))
    }

    /// Loads the model and builds an engine, printing the memory ledger to stderr.
    pub fn engine(&self) -> anyhow::Result<Engine> {
        // Flag mistakes first: they are caught without loading the model.
        let config = self.config()?;
        let model = self.load_model()?;
        let engine = Engine::new(model, config)?;
        let g = engine.kv().geometry();
        eprintln!(
            "model: {} ({} layers, {} MB) on {}; KV {}: {} B/token, {} KB/block, {} blocks = {} MB",
            engine.model().config.name,
            engine.model().config.layers,
            engine.model().file_size() / 1_000_000,
            engine.describe_backend(),
            g.dtype,
            g.bytes_per_token(),
            g.bytes_per_block() / 1024,
            engine.kv().total_blocks(),
            engine.kv_bytes() / 1_000_000,
        );
        Ok(engine)
    }
}
