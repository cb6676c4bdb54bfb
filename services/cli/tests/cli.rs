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
        (&["run", "--prompt", "x", "--kv-dtype", "q4", "--model", missing], "f16 or f32"),
        (&["run", "--prompt", "x", "--simd", "neon", "--model", missing], "portable"),
        (&["perplexity", "--file", "/nonexistent.txt", "--model", missing], "/nonexistent.txt"),
        (&["run", "--prompt", "x", "--raw", "--system", "s"], "cannot be used with"),
    ];
    for (args, want) in cases {
        let (code, _, err) = pdmesh(args);
        assert_ne!(code, 0, "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: stderr lacks {want:?}:\n{err}");
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    }
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
