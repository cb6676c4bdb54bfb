//! Argument handling of the tools binary: help text for each tool, and clear errors for bad
//! input before anything connects. (Being an integration test of this package also makes
//! `cargo test --workspace` build `pdmesh-tools`, which `pdmesh bench|replay|collect|synth-model` runs.)

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::process::Command;

fn tools(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pdmesh-tools")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_tool_explains_itself() {
    let (code, out, _) = tools(&["--help"]);
    assert_eq!(code, 0);
    for cmd in ["bench", "replay", "collect", "synth-model"] {
        assert!(out.contains(cmd), "--help lacks {cmd}:\n{out}");
    }
    for (args, want) in [
        (&["bench", "engine", "--help"][..], "--threads"),
        (&["bench", "kv", "--help"], "--tokens"),
        (&["bench", "--help"], "--concurrency"),
        (&["replay", "--help"], "--trace"),
        (&["collect", "--help"], "--listen"),
        (&["synth-model", "--help"], "--shape-only"),
    ] {
        let (code, out, _) = tools(args);
        assert_eq!(code, 0, "{args:?}");
        assert!(out.contains(want), "{args:?} lacks {want}:\n{out}");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let (code, _, err) = tools(&["replay", "--trace", "/nonexistent/trace.jsonl"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
    let (code, _, err) = tools(&["collect", "--listen", "not-an-address"]);
    assert_ne!(code, 0);
    assert!(err.contains("not-an-address"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `synth-model`: a model's shape travels without its weights (`--shape-only`) and comes back
/// as a model with the same metadata, tensor names, formats and dims and seeded random
/// weights — the same seed the same bytes — that the engine loads and runs to finite logits.
#[test]
fn synth_model_keeps_the_shape_and_seeds_the_weights() {
    use pdmesh_engine::gguf::GgufFile;
    use pdmesh_engine::{Engine, EngineConfig, GenerateParams, Model, generate_batch_observed};
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let src = path("tiny.gguf");
    std::fs::write(&src, pdmesh_engine::testing::TinyModel::default().gguf()).unwrap();
    let synth = |args: &[&str]| {
        let (code, _, err) = tools(&[&["synth-model"][..], args].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
    };
    synth(&["--like", &src, "--shape-only", "--out", &path("shape.gguf")]);
    synth(&["--like", &path("shape.gguf"), "--out", &path("a.gguf"), "--seed", "5"]);
    synth(&["--like", &path("shape.gguf"), "--out", &path("b.gguf"), "--seed", "5"]);
    synth(&["--like", &src, "--out", &path("c.gguf"), "--seed", "6"]);

    let size = |p: &str| std::fs::metadata(p).unwrap().len();
    assert!(size(&path("shape.gguf")) * 4 < size(&src), "the shape carries weights");
    let read = |p: &str| std::fs::read(p).unwrap();
    assert_eq!(read(&path("a.gguf")), read(&path("b.gguf")), "one seed, two files");
    assert_ne!(read(&path("a.gguf")), read(&path("c.gguf")), "two seeds, one file");

    let want = GgufFile::open(src.as_ref()).unwrap();
    let got = GgufFile::open(path("a.gguf").as_ref()).unwrap();
    assert_eq!(got.metadata, want.metadata);
    assert_eq!(got.tensors.len(), want.tensors.len());
    let mut same_bytes = 0;
    for (g, w) in got.tensors.iter().zip(&want.tensors) {
        assert_eq!((&g.name, g.ty, &g.dims), (&w.name, w.ty, &w.dims));
        same_bytes += usize::from(got.tensor_data(g) == want.tensor_data(w));
    }
    assert_eq!(same_bytes, 0, "tensors kept the source's weights");

    let model = Arc::new(Model::load(path("a.gguf").as_ref()).unwrap());
    let mut e = Engine::new(Arc::clone(&model), EngineConfig::default()).unwrap();
    let params = GenerateParams { max_tokens: 4, ignore_eos: true, ..Default::default() };
    let reqs = [(model.tokenizer.encode("hello").unwrap(), params)];
    let mut rows = 0;
    let out = generate_batch_observed(
        &mut e,
        &reqs,
        1,
        |_, l| {
            rows += 1;
            assert!(l.iter().all(|v| v.is_finite()), "non-finite logits");
        },
        |_, _| true,
    )
    .unwrap();
    assert_eq!((out[0].tokens.len(), rows), (4, 4));
}

#[test]
fn synth_model_rejects_what_it_cannot_copy() {
    let (code, _, err) =
        tools(&["synth-model", "--like", "/nonexistent/m.gguf", "--out", "/tmp/x"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/m.gguf"), "{err}");
    // A GGUF with neither tensors nor a shape list.
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.gguf");
    let image = pdmesh_engine::gguf::writer::GgufBuilder::default()
        .kv("general.architecture", pdmesh_engine::gguf::Value::String("llama".into()))
        .build();
    std::fs::write(&empty, image).unwrap();
    let out = dir.path().join("out.gguf");
    let (code, _, err) =
        tools(&["synth-model", "--like", empty.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("no tensors"), "{err}");
    assert!(!err.contains("panicked") && !out.exists(), "{err}");
}
