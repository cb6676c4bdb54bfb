//! The engine part of a worker's config file: plain serializable settings that become an
//! `EngineConfig` and a loaded engine. Prefill and decode configs embed it as `[engine]`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use pdmesh_kernels::KvDtype;
use serde::{Deserialize, Serialize};

use crate::engine::{BackendKind, CudaOptions, Engine, EngineConfig};
use crate::error::{Error, Result};
use crate::model::Model;

/// The backend a config file names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendName {
    /// The host CPU, with the best kernels it supports.
    #[default]
    Cpu,
    /// The first CUDA GPU.
    Cuda,
    /// The CUDA backend on its emulated device (no GPU; slow, for checking it).
    #[serde(rename = "cuda-emu")]
    CudaEmu,
}

impl std::str::FromStr for BackendName {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(BackendName::Cpu),
            "cuda" => Ok(BackendName::Cuda),
            "cuda-emu" => Ok(BackendName::CudaEmu),
            other => Err(format!("unknown backend {other:?} (expected cpu, cuda or cuda-emu)")),
        }
    }
}

impl std::fmt::Display for BackendName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendName::Cpu => "cpu",
            BackendName::Cuda => "cuda",
            BackendName::CudaEmu => "cuda-emu",
        })
    }
}

/// Whether a node runs the model or simulates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineName {
    /// The model, computed on the backend.
    #[default]
    Real,
    /// Calibrated step times and deterministic tokens, no computation: for driving the real
    /// router and planner with more nodes than the machine could compute for.
    Sim,
}

impl std::str::FromStr for EngineName {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "real" => Ok(EngineName::Real),
            "sim" => Ok(EngineName::Sim),
            other => Err(format!("unknown engine {other:?} (expected real or sim)")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, pdmesh_settings::Settings)]
#[serde(deny_unknown_fields, default)]
#[settings(flags = EngineFlags)]
pub struct EngineSettings {
    /// A GGUF model (llama, qwen2, qwen3 or gemma3 architecture).
    #[arg(env = "PDMESH_MODEL")]
    pub model: PathBuf,
    /// real, or sim: no computation, each step takes the time the real engine would (see
    /// --sim-profile) and tokens are a fixed function of the sequence; for driving the router
    /// and planner with more nodes than this machine could compute for.
    pub engine: EngineName,
    /// With the sim engine: `pdmesh bench engine --json` output to take step times from
    /// (none: the calibration pdmesh bundles).
    #[arg(value_name = "FILE")]
    pub sim_profile: Option<PathBuf>,
    /// What computes: cpu; cuda (the first NVIDIA GPU, through the driver found at run time);
    /// or cuda-emu (the CUDA backend on an emulation of the GPU on this CPU: slow, for checking
    /// it without a GPU).
    pub backend: BackendName,
    /// Compute threads (0 = one per core).
    pub threads: usize,
    /// KV cache element type: f16, f32, q8_0 (llama.cpp's 8-bit blocks with its Hadamard
    /// rotation: half of f16's memory and transfer bytes) or q8_0-norot (without it).
    pub kv_dtype: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool: the memory of this many blocks of every layer. A model with
    /// sliding-window layers keeps theirs in blocks apart, which go once the window has left
    /// them, so a long sequence needs far fewer than its tokens / block-size.
    pub kv_blocks: usize,
    /// Most tokens one engine step processes.
    pub max_batch_tokens: usize,
    /// With a cuda backend: prompt matmuls of quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
    /// and the K-quants) on the int8 tensor cores, within a stated bound of the CPU's logits
    /// instead of bit for bit.
    #[arg(value_name = "BOOL")]
    pub cuda_mma: bool,
    /// With a cuda backend: attention of batches with prompt tokens (f16/f32 KV) with flash
    /// attention's running softmax, within a stated bound of the CPU's logits instead of bit
    /// for bit.
    #[arg(value_name = "BOOL")]
    pub cuda_flash: bool,
}

impl Default for EngineSettings {
    fn default() -> Self {
        let d = EngineConfig::default();
        Self {
            model: PathBuf::from(crate::DEFAULT_MODEL_PATH),
            engine: EngineName::Real,
            sim_profile: None,
            backend: BackendName::Cpu,
            threads: d.threads,
            kv_dtype: d.kv_dtype.name().into(),
            block_size: d.block_size,
            kv_blocks: d.kv_blocks,
            max_batch_tokens: d.max_batch_tokens,
            cuda_mma: false,
            cuda_flash: false,
        }
    }
}

impl EngineSettings {
    /// The engine config these settings describe; errors name the field.
    pub fn engine_config(&self) -> Result<EngineConfig> {
        let kv_dtype: KvDtype = self
            .kv_dtype
            .parse()
            .map_err(|e: String| Error::invalid(format!("engine.kv_dtype: {e}")))?;
        let opts = CudaOptions { mma: self.cuda_mma, flash: self.cuda_flash };
        let c = EngineConfig {
            threads: self.threads,
            block_size: self.block_size,
            kv_dtype,
            kv_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            backend: match (self.engine, self.backend) {
                (EngineName::Sim, _) => BackendKind::Sim(match &self.sim_profile {
                    Some(p) => crate::sim::SimProfile::load(p)?,
                    None => crate::sim::SimProfile::builtin(),
                }),
                (EngineName::Real, BackendName::Cpu) => BackendKind::Cpu { simd: None },
                (EngineName::Real, BackendName::Cuda) => BackendKind::Cuda { device: 0, opts },
                (EngineName::Real, BackendName::CudaEmu) => BackendKind::CudaEmu { opts },
            },
        };
        let cuda = matches!(c.backend, BackendKind::Cuda { .. } | BackendKind::CudaEmu { .. });
        for (key, on) in [("cuda_mma", self.cuda_mma), ("cuda_flash", self.cuda_flash)] {
            if on && !cuda {
                return Err(Error::invalid(format!(
                    "engine.{key} applies to the cuda and cuda-emu backends only"
                )));
            }
        }
        if self.sim_profile.is_some() && self.engine != EngineName::Sim {
            return Err(Error::invalid("engine.sim_profile is for engine = \"sim\" only"));
        }
        c.validate().map_err(|e| Error::invalid(format!("engine: {e}")))?;
        Ok(c)
    }

    /// Loads the model and builds the engine.
    pub fn load(&self) -> Result<Engine> {
        let config = self.engine_config()?;
        if !self.model.exists() {
            return Err(Error::invalid(format!(
                "engine.model: {} not found (run `just fetch-model` or set the path)",
                self.model.display()
            )));
        }
        let model = match self.engine {
            EngineName::Real => Arc::new(Model::load(&self.model)?),
            EngineName::Sim => shared_model(&self.model)?,
        };
        Engine::new(model, config)
    }
}

/// `path`'s model, loaded once however many simulated nodes one process hosts (each would
/// otherwise hold its own copy of the vocabulary).
fn shared_model(path: &Path) -> Result<Arc<Model>> {
    static LOADED: OnceLock<Mutex<HashMap<PathBuf, Weak<Model>>>> = OnceLock::new();
    let mut loaded = LOADED.get_or_init(Default::default).lock().expect("never poisoned");
    if let Some(m) = loaded.get(path).and_then(Weak::upgrade) {
        return Ok(m);
    }
    let m = Arc::new(Model::load(path)?);
    loaded.insert(path.to_path_buf(), Arc::downgrade(&m));
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_fields_are_named() {
        let s = EngineSettings { kv_dtype: "q4".into(), ..Default::default() };
        assert!(s.engine_config().unwrap_err().to_string().contains("engine.kv_dtype"));
        let s = EngineSettings { block_size: 0, ..Default::default() };
        assert!(s.engine_config().unwrap_err().to_string().contains("block_size"));
        let s = EngineSettings { model: "/nonexistent.gguf".into(), ..Default::default() };
        assert!(s.load().unwrap_err().to_string().contains("engine.model"));
        let s = EngineSettings { sim_profile: Some("p.json".into()), ..Default::default() };
        assert!(s.engine_config().unwrap_err().to_string().contains("sim_profile"));
        let s = EngineSettings {
            engine: EngineName::Sim,
            sim_profile: Some("/nonexistent.json".into()),
            ..Default::default()
        };
        assert!(s.engine_config().unwrap_err().to_string().contains("cannot read"));
        let s = EngineSettings { cuda_mma: true, ..Default::default() };
        assert!(s.engine_config().unwrap_err().to_string().contains("engine.cuda_mma"));
        let s = EngineSettings { cuda_flash: true, ..Default::default() };
        assert!(s.engine_config().unwrap_err().to_string().contains("engine.cuda_flash"));
        let s = EngineSettings {
            cuda_mma: true,
            cuda_flash: true,
            backend: BackendName::CudaEmu,
            ..Default::default()
        };
        let opts = CudaOptions { mma: true, flash: true };
        assert_eq!(s.engine_config().unwrap().backend, BackendKind::CudaEmu { opts });
    }
}
