//! One file per architecture, and the registry from a GGUF's `general.architecture` to it.
//!
//! A model file says which tensors its layers read and which shared blocks (`blocks`) they
//! make: the attention over the paged cache (with its Q/K/V biases, per-head norms and
//! window as properties), the MLP variant and the norms. The runtime computes any layer made
//! of those blocks, so a model whose layers are made of them is its file and one line in
//! `REGISTRY`; one that needs a new kind of block adds it to `blocks` and to the runtime's
//! block functions.

mod blocks;
mod gemma3;
mod llama;
mod qwen2;
mod qwen3;

use std::collections::BTreeSet;

pub use blocks::{Activation, Attention, HeadNorm, Layer, Mlp, RopeFreq, WeightRef, Weights};
use pdmesh_kernels::WeightType;

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::model::ModelConfig;

/// One architecture: how its weights are read from a GGUF, into the shared blocks.
pub(crate) trait Architecture: Sync {
    /// Its `general.architecture`.
    fn name(&self) -> &'static str;
    /// Its weights (the hyperparameters `c` come from the model card).
    fn load(&self, t: &mut Tensors<'_>, c: &ModelConfig) -> Result<Weights>;
}

/// Every architecture the engine computes, by `general.architecture`.
static REGISTRY: &[&dyn Architecture] =
    &[&llama::Llama, &qwen2::Qwen2, &qwen3::Qwen3, &gemma3::Gemma3];

/// The architecture named `name`.
pub(crate) fn architecture(name: &str) -> Result<&'static dyn Architecture> {
    REGISTRY.iter().copied().find(|a| a.name() == name).ok_or_else(|| {
        let known: Vec<_> = REGISTRY.iter().map(|a| a.name()).collect();
        Error::UnsupportedModel(format!(
            "architecture {name:?} (general.architecture): the engine computes {}",
            known.join(", ")
        ))
    })
}

/// Reads `gguf`'s weights as its architecture does, refusing a tensor the architecture would
/// not use.
pub(crate) fn load(gguf: &GgufFile, c: &ModelConfig) -> Result<Weights> {
    let arch = architecture(&c.arch)?;
    let mut t = Tensors { gguf, used: BTreeSet::new() };
    let weights = arch.load(&mut t, c)?;
    t.all_used(arch.name())?;
    Ok(weights)
}

/// The kernels' format for a GGUF tensor type: every type the reader accepts is one the kernels
/// compute with (`ggml_types_match_the_kernels` holds the two lists together).
pub fn weight_type(t: GgmlType) -> WeightType {
    WeightType::from_gguf_id(t.gguf_id()).expect("every GGUF type pdmesh reads has a kernel")
}

/// Looks tensors up by name, keeping the set of those used: a file with a tensor the graph
/// does not use is one whose arithmetic pdmesh does not know (llama.cpp, for its part, fails
/// to load it: its tensor count comes out short).
pub(crate) struct Tensors<'a> {
    gguf: &'a GgufFile,
    used: BTreeSet<String>,
}

impl<'a> Tensors<'a> {
    fn get(&mut self, name: &str) -> Result<&'a TensorInfo> {
        let t = self
            .gguf
            .tensor(name)
            .ok_or_else(|| Error::gguf(format!("tensor {name:?}"), "missing"))?;
        self.used.insert(name.to_string());
        Ok(t)
    }

    /// Whether the file has the tensor.
    pub fn has(&self, name: &str) -> bool {
        self.gguf.tensor(name).is_some()
    }

    /// A 2-D weight with `cols` columns (and `rows` rows when known).
    pub fn weight(&mut self, name: &str, cols: usize, rows: Option<usize>) -> Result<WeightRef> {
        let t = self.get(name)?;
        let (c, r) = t.matrix_shape();
        if t.dims.len() != 2 || c != cols || rows.is_some_and(|rows| rows != r) {
            return Err(Error::gguf(
                format!("tensor {name:?}"),
                format!(
                    "shape {:?}, expected [{cols}, {}]",
                    t.dims,
                    rows.map_or("?".into(), |r| r.to_string())
                ),
            ));
        }
        Ok(WeightRef { ty: weight_type(t.ty), rows: r, cols: c, offset: t.offset, size: t.size })
    }

    /// A 1-D tensor of `n` values (a norm weight, a bias), as f32.
    pub fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.get(name)?;
        if t.dims != [n as u64] {
            return Err(Error::gguf(
                format!("tensor {name:?}"),
                format!("shape {:?}, expected [{n}]", t.dims),
            ));
        }
        let mut out = vec![0f32; n];
        pdmesh_kernels::quant::dequantize_row(
            weight_type(t.ty),
            self.gguf.tensor_data(t),
            &mut out,
        );
        Ok(out)
    }

    /// The 1-D tensor `name` of `n` values when the file has it.
    pub fn optional_vector(&mut self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        self.has(name).then(|| self.vector(name, n)).transpose()
    }

    fn all_used(&self, arch: &str) -> Result<()> {
        match self.gguf.tensors.iter().find(|t| !self.used.contains(&t.name)) {
            None => Ok(()),
            Some(t) => Err(Error::UnsupportedModel(format!(
                "tensor {:?} is not part of pdmesh's {arch} graph",
                t.name
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use pdmesh_model::Arch;

    #[test]
    fn every_architecture_the_card_reads_has_a_model_file() {
        for arch in Arch::ALL {
            let a = super::architecture(arch.name()).unwrap();
            assert_eq!(a.name(), arch.name());
        }
        assert_eq!(super::REGISTRY.len(), Arch::ALL.len(), "a model file the card refuses");
        let e = super::architecture("gemma2").err().expect("no gemma2 file").to_string();
        assert!(e.contains("gemma2") && e.contains("llama, qwen2, qwen3, gemma3"), "{e}");
    }
}
