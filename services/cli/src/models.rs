//! `pdmesh models inspect FILE`: what a GGUF holds and what serving it costs — architecture,
//! hyper-parameters, the weight format of every tensor, the vocabulary and the KV ledger — and,
//! when pdmesh refuses the file, exactly why (the same error `run` or `up` would give).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use pdmesh_engine::Model;
use pdmesh_engine::gguf::{GgufFile, Value};
use pdmesh_kernels::KvDtype;
use serde_json::json;

#[derive(Debug, Args)]
pub struct ModelsArgs {
    #[command(subcommand)]
    command: ModelsCommand,
}

#[derive(Debug, Subcommand)]
enum ModelsCommand {
    /// Print a GGUF's architecture, shape, context, vocabulary, the weight format of its
    /// tensors and its KV ledger (bytes of KV per token, per block, per full context), and
    /// whether pdmesh serves it.
    Inspect(InspectArgs),
}

#[derive(Debug, Args)]
struct InspectArgs {
    /// The GGUF file.
    file: PathBuf,
    /// List every tensor with its format, shape and size.
    #[arg(long)]
    tensors: bool,
    /// Tokens per KV block, for the ledger.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: ModelsArgs) -> anyhow::Result<()> {
    match args.command {
        ModelsCommand::Inspect(a) => inspect(a),
    }
}

fn inspect(a: InspectArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.block_size > 0, "--block-size must be at least 1");
    let gguf = GgufFile::open(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let meta_str = |k: &str| gguf.get_str(k).ok().flatten().map(str::to_string);
    let arch = meta_str("general.architecture").unwrap_or_else(|| "(none)".into());
    let vocab_model = meta_str("tokenizer.ggml.model").unwrap_or_else(|| "(none)".into());
    let vocab_pre = meta_str("tokenizer.ggml.pre");
    let n_tokens = match gguf.get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) => t.len(),
        _ => 0,
    };

    // Formats: tensors and bytes per type.
    let tensors: Vec<(String, &str, Vec<u64>, usize)> = gguf
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.ty.name(), t.dims.clone(), t.size))
        .collect();
    let mut formats: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for (_, ty, _, size) in &tensors {
        let e = formats.entry(*ty).or_default();
        e.0 += 1;
        e.1 += size;
    }

    // Whether it loads, and the shape and ledger pdmesh would serve it with.
    let loaded = Model::from_gguf(gguf, a.file.clone());
    let file_size = std::fs::metadata(&a.file).map(|m| m.len()).unwrap_or(0);

    if a.json {
        let mut out = json!({
            "file": a.file,
            "file_bytes": file_size,
            "architecture": arch,
            "vocabulary": {"model": vocab_model, "pre": vocab_pre, "tokens": n_tokens},
            "formats": formats.iter().map(|(k, (n, b))| (k.to_string(), json!({"tensors": n, "bytes": b}))).collect::<serde_json::Map<_, _>>(),
        });
        match &loaded {
            Ok(m) => {
                let c = &m.config;
                out["loads"] = json!(true);
                out["name"] = json!(c.name);
                out["context"] = json!(c.context);
                out["shape"] = json!({
                    "layers": c.layers, "hidden": c.hidden, "ffn": c.ffn, "heads": c.heads,
                    "kv_heads": c.kv_heads, "head_dim": c.head_dim, "vocab": c.vocab,
                });
                out["rope_base"] = json!(c.rope_base);
                let ledger: serde_json::Map<_, _> = [KvDtype::F16, KvDtype::F32, KvDtype::Q8_0]
                    .into_iter()
                    .filter(|d| d.row_bytes(c.head_dim).is_some())
                    .map(|d| {
                        let g = c.kv_geometry(a.block_size, d);
                        let per_token = g.bytes_per_token();
                        (
                            d.to_string(),
                            json!({
                                "bytes_per_token": per_token,
                                "bytes_per_block": g.bytes_per_block(),
                                "bytes_full_context": per_token * c.context,
                            }),
                        )
                    })
                    .collect();
                out["kv_ledger"] = json!(ledger);
            }
            Err(e) => {
                out["loads"] = json!(false);
                out["refused"] = json!(e.to_string());
            }
        }
        if a.tensors {
            out["tensors"] = tensors
                .iter()
                .map(|(name, ty, dims, size)| {
                    json!({"name": name, "format": ty, "dims": dims, "bytes": size})
                })
                .collect();
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }

    println!("file:          {} ({})", a.file.display(), mb(file_size as usize));
    println!("architecture:  {arch}");
    match &loaded {
        Ok(m) => {
            let c = &m.config;
            println!("name:          {}", c.name);
            println!("serves:        yes");
            println!("context:       {} tokens", c.context);
            println!(
                "shape:         {} layers, hidden {}, FFN {}, {} heads / {} KV heads, head dim {}, vocab {}",
                c.layers, c.hidden, c.ffn, c.heads, c.kv_heads, c.head_dim, c.vocab
            );
            println!("RoPE base:     {}", c.rope_base);
        }
        Err(e) => println!("serves:        no: {e}"),
    }
    let pre = vocab_pre.map(|p| format!(", pre-tokenizer {p}")).unwrap_or_default();
    println!("vocabulary:    {vocab_model}{pre}, {n_tokens} tokens");
    let list: Vec<String> =
        formats.iter().map(|(k, (n, b))| format!("{k} ×{n} ({})", mb(*b))).collect();
    println!("formats:       {}", list.join(", "));
    if let Ok(m) = &loaded {
        let c = &m.config;
        for d in [KvDtype::F16, KvDtype::F32, KvDtype::Q8_0] {
            if d.row_bytes(c.head_dim).is_none() {
                continue;
            }
            let g = c.kv_geometry(a.block_size, d);
            println!(
                "KV ledger {d}: {} B/token (2 × {} layers × {} KV heads × {} B per {}-value head row), {} KB per {}-token block, {} for the full {}-token context",
                g.bytes_per_token(),
                c.layers,
                c.kv_heads,
                g.row_bytes(),
                c.head_dim,
                g.bytes_per_block() / 1024,
                a.block_size,
                mb(g.bytes_per_token() * c.context),
                c.context
            );
        }
    }
    if a.tensors {
        for (name, ty, dims, size) in &tensors {
            println!("  {name:<32} {ty:<5} {dims:?} {}", mb(*size));
        }
    }
    Ok(())
}

fn mb(bytes: usize) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}
