//! pdmesh's logits against llama.cpp's, bit for bit, on the synthetic model of each
//! architecture in `models/test/`: `synth-llama3` (Llama 3 RoPE frequency factors, untied
//! output; `synth-llama3-1b` has Llama 3.2 1B's shapes, tied), `synth-qwen2` (Q/K/V biases,
//! NEOX RoPE, tied), `synth-qwen3` (per-head Q/K norms, heads of 128 with hidden / heads = 64)
//! `synth-mistral` (arch llama, SentencePiece) and `synth-gemma3` (Gemma 3: Q/K norms,
//! post-norms, GeGLU, embeddings scaled, five of six layers attending through a 20-token
//! window with their own RoPE base; its 43-token prompt and 32 greedy tokens run past it).
//!
//! Every format of every family is required (`just test-models` makes them). The references are llama.cpp's logits for every
//! prompt position, computed in micro-batches of 4 (`scripts/arch_reference.py` says why that
//! size), and for greedy tokens fed one at a time after it: prompt and generated tokens sum
//! attention in different orders, and both are compared.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pdmesh_engine::{Engine, EngineConfig, Logits, Model, StepItem};
use pdmesh_kernels::KvDtype;

/// Every format `just test-models` makes of each family.
const FORMATS: [&str; 11] =
    ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K", "F16", "BF16", "F32"];

/// What the reference's llama.cpp build needs for pdmesh to match it bit for bit: pdmesh
/// follows llama.cpp's AVX-512 kernels (its attention and float sums are 16 lanes wide) and,
/// for BF16 weights, its `vdpbf16ps` kernels. llama.cpp built without them computes in other
/// orders (its AVX2 build agrees with its AVX-512 build on only ~88% of SmolLM2 Q4_K_M's
/// prompt argmaxes); against such a reference the test checks top-1 agreement instead.
fn bit_target_needs(fmt: &str) -> &'static [&'static str] {
    if fmt == "BF16" { &["AVX512 = 1", "AVX512_BF16 = 1"] } else { &["AVX512 = 1"] }
}
/// The share of rows whose argmax must agree with a reference from another llama.cpp build.
const MIN_TOP1_AGREEMENT: f64 = 0.8;

const HOW: &str = "run `just test-models` (the models by scripts/make_test_models.py, their \
     references by scripts/arch_reference.py)";

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/test")
}

struct Reference {
    text: String,
    tokens: Vec<u32>,
    n_vocab: usize,
    /// The prompt positions whose logits `logits` holds (a long prompt's are a sample).
    rows: Vec<usize>,
    /// Those positions' logits.
    logits: Vec<f32>,
    /// llama.cpp's greedy tokens after the prompt, and the logits after feeding each alone.
    greedy: Vec<u32>,
    decode: Vec<f32>,
    /// `llama_print_system_info()` of the build that made it.
    system_info: String,
}

fn floats(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}; {HOW}", path.display()));
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// The reference files' infix for a KV dtype: `ubatch4` for f16, `ubatch4.q8_0` and so on.
fn tag(kv: KvDtype) -> String {
    if kv == KvDtype::F16 { "ubatch4".into() } else { format!("ubatch4.{kv}") }
}

fn reference(model: &Path, kv: KvDtype) -> Reference {
    reference_at(model, &model.with_file_name("x"), &tag(kv))
}

/// The reference files `{stem}.{tag}.*` of `model`, in the directory of `at`.
fn reference_at(model: &Path, at: &Path, tag: &str) -> Reference {
    let stem = model.file_stem().unwrap().to_string_lossy().into_owned();
    let json = at.with_file_name(format!("{stem}.{tag}.json"));
    let meta =
        std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e}; {HOW}", json.display()));
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    let size = std::fs::metadata(model).unwrap().len();
    let stale = |what: &str| format!("{} is stale ({what}): {HOW}", json.display());
    assert_eq!(meta["model_size"].as_u64(), Some(size), "{}", stale("another model's"));
    assert!(meta["greedy"].is_array(), "{}", stale("no decode steps"));
    assert!(meta["system_info"].is_string(), "{}", stale("no llama.cpp build info"));
    let ids = |key: &str| -> Vec<u32> {
        meta[key].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let tokens = ids("prompt_tokens");
    let rows = match meta["rows"].as_array() {
        Some(r) => r.iter().map(|t| t.as_u64().unwrap() as usize).collect(),
        None => (0..tokens.len()).collect(),
    };
    Reference {
        text: meta["prompt_text"].as_str().unwrap().to_string(),
        tokens,
        rows,
        n_vocab: meta["n_vocab"].as_u64().unwrap() as usize,
        logits: floats(&at.with_file_name(format!("{stem}.{tag}.f32"))),
        greedy: ids("greedy"),
        decode: floats(&at.with_file_name(format!("{stem}.{tag}.decode.f32"))),
        system_info: meta["system_info"].as_str().unwrap().to_string(),
    }
}

/// Rows bit-identical to llama.cpp's, and rows compared: prompt positions, then decode steps;
/// and the largest difference of any logit.
struct Matched {
    prompt: (usize, usize),
    decode: (usize, usize),
    max_diff: f32,
    /// Rows whose argmax agrees with the reference's.
    top1: f64,
    /// The feature the reference's llama.cpp build lacked for a bit-for-bit comparison.
    lacks: Option<&'static str>,
}

fn compare(model: &Path, kv: KvDtype) -> Matched {
    compare_with(model, kv, &reference(model, kv), true)
}

/// pdmesh against reference `r` on `model` with a `kv` cache; `rechunk` also checks that a
/// prefill in chunks of 5 on one thread gives the same bits.
fn compare_with(model: &Path, kv: KvDtype, r: &Reference, rechunk: bool) -> Matched {
    let m = Arc::new(Model::load(model).unwrap());
    assert_eq!(m.config.vocab, r.n_vocab);
    let ours = m.tokenizer.encode(&r.text).unwrap();
    // A long reference keeps a prefix of the text's tokens.
    assert_eq!(
        ours.get(..r.tokens.len()),
        Some(&r.tokens[..]),
        "{}: pdmesh tokenizes the prompt otherwise than llama.cpp",
        model.display()
    );
    let (whole, decoded) = logits(&m, kv, &r.tokens, &r.rows, usize::MAX, 2, &r.greedy);
    assert_eq!(whole.len(), r.logits.len(), "{}: prompt rows", model.display());
    assert_eq!(decoded.len(), r.decode.len(), "{}: decode rows", model.display());
    if rechunk {
        // pdmesh's own promise, whatever the architecture: chunks and threads change no bit.
        let (chunked, chunked_decoded) = logits(&m, kv, &r.tokens, &r.rows, 5, 1, &r.greedy);
        assert!(
            bits(&chunked) == bits(&whole) && bits(&chunked_decoded) == bits(&decoded),
            "{}: a chunked prefill on one thread differs from one step on two",
            model.display()
        );
    }
    let n = r.n_vocab;
    let same = |a: &[f32], b: &[f32]| {
        let rows = a.len() / n;
        let eq =
            (0..rows).filter(|&i| bits(&a[i * n..(i + 1) * n]) == bits(&b[i * n..(i + 1) * n]));
        (eq.count(), rows)
    };
    let argmax =
        |row: &[f32]| row.iter().enumerate().fold(0, |b, (j, &v)| if v > row[b] { j } else { b });
    let fmt = model.file_stem().unwrap().to_string_lossy();
    let fmt = fmt.rsplit('-').next().unwrap();
    let lacks = bit_target_needs(fmt).iter().copied().find(|need| !r.system_info.contains(need));
    if lacks.is_none() {
        // Greedy decoding: each step's argmax (lowest id on ties, as the sampler and the
        // reference script break them) is the token llama.cpp generated next.
        let steps = decoded.chunks_exact(n).take(r.greedy.len().saturating_sub(1));
        for (i, row) in steps.enumerate() {
            let want = r.greedy[i + 1];
            assert_eq!(argmax(row) as u32, want, "{}: greedy token {}", model.display(), i + 1);
        }
    }
    let ours = whole.chunks_exact(n).chain(decoded.chunks_exact(n));
    let theirs = r.logits.chunks_exact(n).chain(r.decode.chunks_exact(n));
    let agree = ours.clone().zip(theirs.clone()).filter(|(a, b)| argmax(a) == argmax(b)).count();
    let max_diff = whole
        .iter()
        .zip(&r.logits)
        .chain(decoded.iter().zip(&r.decode))
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    Matched {
        prompt: same(&whole, &r.logits),
        decode: same(&decoded, &r.decode),
        max_diff,
        top1: agree as f64 / ours.count() as f64,
        lacks,
    }
}

/// The logits of prompt positions `rows` (increasing), the prompt computed in steps of at
/// most `chunk` tokens (cut also around each run of wanted rows, so that no step computes
/// logits nobody reads), then the logits after each of `then` is fed as a generated token.
fn logits(
    m: &Arc<Model>,
    kv_dtype: KvDtype,
    tokens: &[u32],
    rows: &[usize],
    chunk: usize,
    threads: usize,
    then: &[u32],
) -> (Vec<f32>, Vec<f32>) {
    let blocks = (tokens.len() + then.len()).div_ceil(16) + 4;
    let cfg = EngineConfig { threads, kv_blocks: blocks.max(64), kv_dtype, ..Default::default() };
    let mut e = Engine::new(Arc::clone(m), cfg).unwrap();
    let seq = e.create_sequence();
    let wanted = |i: usize| rows.binary_search(&i).is_ok();
    let mut prompt = Vec::new();
    let mut at = 0;
    while at < tokens.len() {
        // A run of positions all wanted or all not, at most `chunk` long.
        let want = wanted(at);
        let mut end = at + 1;
        while end < tokens.len() && end - at < chunk && wanted(end) == want {
            end += 1;
        }
        let kind = if want { Logits::All } else { Logits::None };
        let l = e.step(&[StepItem::prefill(seq, &tokens[at..end], kind)]).unwrap();
        if want {
            prompt.extend((0..l.len()).flat_map(|i| l.row(i).1.to_vec()));
        }
        at = end;
    }
    let mut decoded = Vec::new();
    for &t in then {
        let l = e.step(&[StepItem::decode(seq, &[t])]).unwrap();
        decoded.extend_from_slice(l.row(0).1);
    }
    (prompt, decoded)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_family(family: &str) {
    check(family, &FORMATS);
}

fn check(family: &str, formats: &[&str]) {
    check_kv(family, formats, KvDtype::F16);
}

/// Compares the `formats` of `family` with a `kv` cache, failing when one is absent.
fn check_kv(family: &str, formats: &[&str], kv: KvDtype) {
    let dir = models_dir();
    for fmt in formats {
        let path = dir.join(format!("{family}-{fmt}.gguf"));
        assert!(path.exists(), "{} is missing: {HOW}", path.display());
    }
    let mut failed = Vec::new();
    for fmt in formats {
        let path = dir.join(format!("{family}-{fmt}.gguf"));
        let Matched { prompt: (p, pn), decode: (d, dn), max_diff, top1, lacks } =
            compare(&path, kv);
        let line =
            format!("{fmt} ({kv} KV): prompt {p}/{pn}, decode {d}/{dn}, max |diff| {max_diff:e}");
        eprintln!("{family}-{line} rows bit-identical to llama.cpp");
        if let Some(need) = lacks {
            eprintln!(
                "{family}-{fmt}: the reference llama.cpp was built without {need:?}, whose \
                 kernels pdmesh follows; top-1 agreement {top1:.3} checked instead of bits"
            );
            if top1 < MIN_TOP1_AGREEMENT {
                failed.push(format!("{line}, top-1 agreement {top1:.3}"));
            }
        } else if p != pn || d != dn {
            failed.push(line);
        }
    }
    assert!(failed.is_empty(), "{family}: rows bit-identical to llama.cpp: {failed:?}");
}

/// SmolLM2 re-quantized by llama.cpp: its Q4_K_M mixes Q5_0, Q8_0, Q4_K and Q6_K (576 columns
/// are not a whole number of K-quant super-blocks).
#[test]
fn smollm2_matches_llama_cpp() {
    check_family("smollm2");
}

#[test]
fn llama3_matches_llama_cpp() {
    check_family("synth-llama3");
}

#[test]
fn qwen2_matches_llama_cpp() {
    check_family("synth-qwen2");
}

#[test]
fn qwen3_matches_llama_cpp() {
    check_family("synth-qwen3");
}

#[test]
fn mistral_matches_llama_cpp() {
    check_family("synth-mistral");
}

#[test]
fn gemma3_matches_llama_cpp() {
    check("synth-gemma3", &["Q8_0", "Q4_K_M", "F16"]);
}

/// Gemma 3 270M itself (`just fetch-gemma3`) on the first 2,560 tokens of Verne's novel, five
/// times its 512-token window: pdmesh's tokens of the text, the logits of every 256th group of
/// 4 positions and of the last, and 32 greedy tokens after it (each with its logits), all as
/// llama.cpp computes them (`scripts/arch_reference.py --long 2560`).
#[test]
fn gemma3_270m_matches_llama_cpp_past_its_window() {
    // In models/, beside models/test (which may be a link into the cache: not `test/..`).
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/gemma-3-270m-q4_k_m.gguf");
    assert!(model.exists(), "{} is missing: run `just fetch-gemma3`", model.display());
    // The reference lives with the test models (a cache shared by clones).
    let r = reference_at(&model, &models_dir().join("x"), "long2560.ubatch4");
    assert_eq!(r.tokens.len(), 2560);
    assert!(r.rows.iter().any(|&p| p > 4 * 512), "rows past the window: {:?}", r.rows);
    let Matched { prompt: (p, pn), decode: (d, dn), max_diff, lacks, .. } =
        compare_with(&model, KvDtype::F16, &r, false);
    eprintln!(
        "gemma-3-270m (2,560 tokens): prompt {p}/{pn}, decode {d}/{dn} rows bit-identical to \
         llama.cpp, max |diff| {max_diff:e}"
    );
    assert!(lacks.is_none(), "the reference llama.cpp lacks {lacks:?}");
    assert_eq!((p, d), (pn, dn), "rows bit-identical to llama.cpp");
}

/// The engine's GELU table (`gelu_table`) is the one llama.cpp's CPU backend builds at start
/// (`ggml_table_gelu_f16`, dumped by `scripts/arch_reference.py`), entry for entry: GeGLU
/// looks its values up, so one wrong entry is a wrong activation wherever an input rounds to
/// it.
#[test]
fn gelu_table_is_llama_cpps() {
    let path = models_dir().join("ggml-gelu-f16.bin");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}; {HOW}", path.display()));
    let theirs: Vec<u16> =
        bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
    let ours = pdmesh_kernels::cpu::gelu_table();
    assert_eq!(theirs.len(), ours.len());
    let wrong: Vec<usize> = (0..ours.len())
        .filter(|&i| !half::f16::from_bits(i as u16).is_nan())
        .filter(|&i| half::f16::from_f32(ours[i]).to_bits() != theirs[i])
        .collect();
    assert!(wrong.is_empty(), "{} entries differ, first at f16 {:#06x}", wrong.len(), wrong[0]);
}

/// Llama 3.2 1B's shapes (16 layers, hidden 2048, tied embeddings) in Q4_K_M.
#[test]
fn llama3_1b_matches_llama_cpp() {
    check("synth-llama3-1b", &["Q4_K_M"]);
}

/// The families with a q8_0 KV cache (`--kv-dtype q8_0`) against llama.cpp with q8_0 K and V:
/// its flash-attention path, with its default Hadamard rotation (heads of 64, and of 128 in
/// synth-qwen3) and without it (`q8_0-norot`). Two weight formats each: attention does not
/// depend on them, the rest of the model is checked above.
const KV_FAMILIES: [&str; 6] =
    ["smollm2", "synth-llama3", "synth-qwen2", "synth-qwen3", "synth-mistral", "synth-gemma3"];
const KV_FORMATS: [&str; 2] = ["Q8_0", "Q4_K_M"];

#[test]
fn q8_0_kv_matches_llama_cpp() {
    // The rotation changes llama.cpp's logits, so matching both modes tells them apart.
    let model = models_dir().join("smollm2-Q8_0.gguf");
    let (rot, norot) = (reference(&model, KvDtype::Q8_0), reference(&model, KvDtype::Q8_0NoRot));
    assert_ne!(bits(&rot.logits), bits(&norot.logits), "rotation changed nothing");
    for family in KV_FAMILIES {
        check_kv(family, &KV_FORMATS, KvDtype::Q8_0);
    }
}

#[test]
fn q8_0_kv_without_rotation_matches_llama_cpp() {
    for family in KV_FAMILIES {
        check_kv(family, &KV_FORMATS, KvDtype::Q8_0NoRot);
    }
}
