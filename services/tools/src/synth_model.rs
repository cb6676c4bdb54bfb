//! `pdmesh synth-model`: a GGUF with a model's metadata, vocabulary and tensor shapes and
//! formats, but seeded random weights. The kernels' speed and their agreement with the CPU
//! backend do not depend on what the weights are, so this is how a model reaches a machine
//! that its file cannot (the lent GPU machine takes 64 MiB a call): `--shape-only` writes the
//! shape alone (SmolLM2: 1.8 MB of its 98), and `--like` that shape file writes the model.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use pdmesh_engine::gguf::writer::GgufBuilder;
use pdmesh_engine::gguf::{GgmlType, GgufFile, Value};
use pdmesh_engine::model::weight_type;
use pdmesh_kernels::WeightType;
use rand::SeedableRng;

/// The metadata key a shape file lists its tensors under, one `name<TAB>ggml type<TAB>dims`
/// string each (dims comma-separated, GGML order).
const SHAPE_KEY: &str = "pdmesh.synth.tensors";

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:\n  \
    pdmesh synth-model --like models/SmolLM2-135M-Instruct.Q4_1.gguf --shape-only --out smollm2.shape.gguf\n  \
    pdmesh synth-model --like smollm2.shape.gguf --out smollm2-synth.gguf")]
pub struct SynthArgs {
    /// The model whose shape to take: a GGUF model, or a shape file `--shape-only` wrote.
    #[arg(long)]
    like: PathBuf,
    /// Where to write the model (or, with --shape-only, the shape file).
    #[arg(long)]
    out: PathBuf,
    /// Write only the shape: metadata, vocabulary and each tensor's name, format and dims.
    #[arg(long)]
    shape_only: bool,
    /// Seed of the random weights: the same seed and shape give the same file.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// One tensor of the shape.
#[derive(Debug, Clone, PartialEq)]
struct Tensor {
    name: String,
    ty: WeightType,
    dims: Vec<u64>,
}

impl Tensor {
    fn encode(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(u64::to_string).collect();
        format!("{}\t{}\t{}", self.name, self.ty.gguf_id(), dims.join(","))
    }

    fn decode(s: &str) -> anyhow::Result<Self> {
        let bad = || format!("{SHAPE_KEY} entry {s:?}: expected name<TAB>ggml type<TAB>dims");
        let mut parts = s.split('\t');
        let (Some(name), Some(ty), Some(dims), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            bail!(bad());
        };
        let ty: u32 = ty.parse().with_context(bad)?;
        let ty = WeightType::from_gguf_id(ty).ok_or_else(|| {
            anyhow::anyhow!("{}: type {ty} is not one pdmesh computes with", bad())
        })?;
        let dims =
            dims.split(',').map(str::parse).collect::<Result<Vec<u64>, _>>().with_context(bad)?;
        ensure!(!name.is_empty() && !dims.is_empty(), bad());
        Ok(Tensor { name: name.to_string(), ty, dims })
    }

    /// How many storage blocks it has, checked against its format's block size.
    fn blocks(&self) -> anyhow::Result<usize> {
        let elems = self
            .dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok())
            .with_context(|| format!("tensor {}: {:?} elements overflow", self.name, self.dims))?;
        ensure!(
            elems % self.ty.block_elems() == 0,
            "tensor {}: {elems} elements are not whole {} blocks of {}",
            self.name,
            self.ty,
            self.ty.block_elems()
        );
        Ok(elems / self.ty.block_elems())
    }
}

/// What a synthetic model copies of another: its metadata and its tensors' shapes.
struct Shape {
    metadata: Vec<(String, Value)>,
    tensors: Vec<Tensor>,
}

/// The shape of `path`, a model or a shape file.
fn read_shape(path: &Path) -> anyhow::Result<Shape> {
    let f = GgufFile::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut tensors: Vec<Tensor> = f
        .tensors
        .iter()
        .map(|t| Tensor { name: t.name.clone(), ty: weight_type(t.ty), dims: t.dims.clone() })
        .collect();
    if let Some(listed) = f.get_array(SHAPE_KEY)? {
        ensure!(tensors.is_empty(), "{}: a model with a shape list as well", path.display());
        for v in listed {
            let Value::String(s) = v else { bail!("{SHAPE_KEY} holds a non-string: {v:?}") };
            tensors.push(Tensor::decode(s)?);
        }
    }
    ensure!(!tensors.is_empty(), "{}: no tensors and no {SHAPE_KEY} list", path.display());
    // The writer aligns to 32 bytes; a stated alignment would contradict it.
    let metadata = f
        .metadata
        .into_iter()
        .filter(|(k, _)| k != SHAPE_KEY && k != "general.alignment")
        .collect();
    Ok(Shape { metadata, tensors })
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    let Shape { metadata, tensors } = read_shape(&a.like)?;
    let mut b = metadata.into_iter().fold(GgufBuilder::default(), |b, (k, v)| b.kv(&k, v));
    let mut bytes = 0usize;
    if a.shape_only {
        b = b.kv(
            SHAPE_KEY,
            Value::Array(tensors.iter().map(|t| Value::String(t.encode())).collect()),
        );
    } else {
        for (i, t) in tensors.iter().enumerate() {
            // A stream per tensor: its weights do not depend on the tensors before it.
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed);
            rng.set_stream(i as u64);
            let data = pdmesh_kernels::random::random_blocks(&mut rng, t.ty, t.blocks()?);
            bytes += data.len();
            let ty = GgmlType::from_gguf_id(t.ty.gguf_id()).map_err(anyhow::Error::msg)?;
            b = b.tensor(&t.name, &t.dims, ty, data);
        }
    }
    let image = b.build();
    std::fs::write(&a.out, &image).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote {} ({:.1} MB): {} tensors{}",
        a.out.display(),
        image.len() as f64 / 1e6,
        tensors.len(),
        if a.shape_only {
            " (shape only)".to_string()
        } else {
            format!(", {:.1} MB of random weights, seed {}", bytes as f64 / 1e6, a.seed)
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_entries_round_trip_and_bad_ones_are_named() {
        let t =
            Tensor { name: "blk.0.attn_q.weight".into(), ty: WeightType::Q4_K, dims: vec![256, 8] };
        assert_eq!(Tensor::decode(&t.encode()).unwrap(), t);
        assert_eq!(t.blocks().unwrap(), 8);
        for bad in
            ["x\t12", "x\t12\t256\textra", "x\tq4\t256", "x\t12\t256,a", "\t12\t256", "x\t999\t32"]
        {
            let e = Tensor::decode(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{bad:?}: {e}");
        }
        let ragged = Tensor { name: "r".into(), ty: WeightType::Q8_0, dims: vec![33, 2] };
        assert!(ragged.blocks().unwrap_err().to_string().contains("not whole Q8_0 blocks"));
        let huge = Tensor { name: "h".into(), ty: WeightType::F32, dims: vec![u64::MAX, 2] };
        assert!(huge.blocks().unwrap_err().to_string().contains("overflow"));
    }
}
