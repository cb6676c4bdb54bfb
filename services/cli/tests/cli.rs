//! Argument handling of the `pdmesh` binary: help text, and clear errors for bad input before
//! any model is loaded.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::process::Command;

fn pdmesh(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pdmesh")).args(args).output().expect("pdmesh runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn help_lists_commands_and_options() {
    let (code, out, _) = pdmesh(&["--help"]);
    assert_eq!(code, 0);
    for cmd in ["run", "perplexity", "bench"] {
        assert!(out.contains(cmd), "--help lacks {cmd}:\n{out}");
    }
    let (code, out, _) = pdmesh(&["run", "--help"]);
    assert_eq!(code, 0);
    for opt in [
        "--prompt",
        "--raw",
        "--max-tokens",
        "--temperature",
        "--seed",
        "--json",
        "--model",
        "--threads",
    ] {
        assert!(out.contains(opt), "run --help lacks {opt}:\n{out}");
    }
    // The tools run from the tools binary beside this one, as `pdmesh <tool>`.
    let tools = std::path::Path::new(env!("CARGO_BIN_EXE_pdmesh")).with_file_name("pdmesh-tools");
    if !tools.exists() {
        eprintln!(
            "SKIPPED: `pdmesh bench` (pdmesh-tools is not built; `cargo test --workspace` builds it)"
        );
        return;
    }
    let (code, out, _) = pdmesh(&["bench", "engine", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("--threads") && out.contains("--json"), "{out}");
    let (code, out, _) = pdmesh(&["collect", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("--listen"), "{out}");
}

#[test]
fn an_unknown_command_is_an_error_not_a_tool() {
    let (code, _, err) = pdmesh(&["frobnicate"]);
    assert_ne!(code, 0);
    assert!(err.contains("unknown command") && err.contains("frobnicate"), "{err}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let missing = "/nonexistent/model.gguf";
    let cases: &[(&[&str], &str)] = &[
        (&["run"], "--prompt"),
        (&["run", "--prompt", "x", "--temperature", "NaN", "--model", missing], "temperature"),
        (&["run", "--prompt", "x", "--temperature", "-1", "--model", missing], "temperature"),
        (&["run", "--prompt", "x", "--top-p", "0", "--model", missing], "top_p"),
        (&["run", "--prompt", "x", "--max-tokens", "0", "--model", missing], "--max-tokens"),
        (&["run", "--prompt", "x", "--model", missing], "run `just fetch-model`"),
        (&["run", "--prompt", "x", "--kv-dtype", "q4", "--model", missing], "f16, f32, q8_0"),
        (&["run", "--prompt", "x", "--simd", "neon", "--model", missing], "portable"),
        (&["perplexity", "--file", "/nonexistent.txt", "--model", missing], "/nonexistent.txt"),
        (&["run", "--prompt", "x", "--raw", "--system", "s"], "cannot be used with"),
        (&["run", "--prompt", "x", "--backend", "tpu"], "expected cpu, cuda or cuda-emu"),
        (&["run", "--prompt", "x", "--backend", "cuda-emu", "--simd", "avx2"], "--simd picks"),
        (&["run", "--prompt", "x", "--cuda-device", "1"], "--backend cuda only"),
        (
            &["run", "--prompt", "x", "--cuda-mma"],
            "--cuda-mma applies to --backend cuda or cuda-emu",
        ),
        (
            &["run", "--prompt", "x", "--cuda-flash"],
            "--cuda-flash applies to --backend cuda or cuda-emu",
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = pdmesh(args);
        assert_ne!(code, 0, "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: stderr lacks {want:?}:\n{err}");
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    }
}

/// `--backend cuda` where there is no GPU driver stops at start and says why, in one line,
/// instead of the panic the driver bindings raise when libcuda is absent.
#[test]
fn cuda_backend_without_a_driver_fails_at_start_with_the_reason() {
    if pdmesh_kernels::cuda::driver_missing().is_none() {
        eprintln!("SKIPPED: this machine has a CUDA driver (`just test-gpu` covers it)");
        return;
    }
    let model = default_model();
    let (code, out, err) =
        pdmesh(&["run", "--prompt", "x", "--backend", "cuda", "--model", &model]);
    assert_ne!(code, 0, "ran without a GPU: {out}");
    assert!(err.contains("--backend cuda: no CUDA driver: libcuda.so was not found"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.is_empty(), "generated without a GPU: {out}");
    // A node says it once, not once per layer of error that wraps it.
    let (code, _, err) = pdmesh(&[
        "decode",
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--backend",
        "cuda",
        "--model",
        &model,
    ]);
    assert_ne!(code, 0);
    assert_eq!(err.matches("libcuda.so was not found").count(), 1, "{err}");
}

#[test]
fn a_corrupt_model_file_is_reported_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    std::fs::write(&path, b"GGUF\x03\x00\x00\x00\xff\xff").unwrap();
    let (code, _, err) = pdmesh(&["run", "--prompt", "x", "--model", path.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("invalid GGUF") && err.contains("tensor_count"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The default model, as `just fetch-model` places it (the workspace root is two levels up).
fn default_model() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf").to_string_lossy().into_owned()
}

#[test]
fn models_inspect_reports_formats_vocabulary_and_ledger() {
    let model = default_model();
    let (code, out, err) = pdmesh(&["models", "inspect", &model, "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["architecture"], "llama");
    assert_eq!(v["loads"], true);
    assert_eq!(v["vocabulary"]["model"], "gpt2");
    assert_eq!(v["vocabulary"]["tokens"], 49152);
    assert_eq!(v["formats"]["Q4_1"]["tensors"], 210);
    assert_eq!(v["formats"]["Q8_0"]["tensors"], 1);
    assert_eq!(v["formats"]["F32"]["tensors"], 61);
    // 2 × 30 layers × 3 KV heads × 64 dims × 2 bytes.
    assert_eq!(v["kv_ledger"]["f16"]["bytes_per_token"], 23040);
    assert_eq!(v["kv_ledger"]["f32"]["bytes_per_block"], 16 * 46080);
    assert_eq!(v["kv_ledger"]["f16"]["bytes_full_context"], 23040 * 8192);

    let (code, out, _) = pdmesh(&["models", "inspect", &model, "--tensors"]);
    assert_eq!(code, 0);
    assert!(out.contains("serves:        yes") && out.contains("Q4_1 ×210"), "{out}");
    assert!(out.contains("blk.29.ffn_down.weight"), "--tensors lists every tensor: {out}");
}

#[test]
fn models_inspect_of_a_bad_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    std::fs::write(&path, b"GGUF\x03\x00\x00\x00\xff\xff").unwrap();
    let (code, _, err) = pdmesh(&["models", "inspect", path.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("invalid GGUF") && !err.contains("panicked"), "{err}");
    let (code, _, err) = pdmesh(&["models", "inspect", "/nonexistent.gguf"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent.gguf"), "{err}");
}

#[test]
fn models_inspect_says_why_a_model_is_refused() {
    use pdmesh_engine::gguf::Value;
    use pdmesh_engine::gguf::writer::GgufBuilder;
    let bytes = GgufBuilder::default()
        .kv("general.architecture", Value::String("gemma".into()))
        .kv("tokenizer.ggml.model", Value::String("llama".into()))
        .tensor(
            "token_embd.weight",
            &[256, 4],
            pdmesh_engine::gguf::GgmlType::Q4_K,
            vec![0; 4 * 144],
        )
        .build();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gemma.gguf");
    std::fs::write(&path, bytes).unwrap();
    let (code, out, err) = pdmesh(&["models", "inspect", path.to_str().unwrap()]);
    assert_eq!(code, 0, "inspecting a refused model is not an error: {err}");
    assert!(out.contains("serves:        no") && out.contains("gemma"), "{out}");
    assert!(out.contains("Q4_K ×1"), "{out}");
}
