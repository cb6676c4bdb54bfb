//! Argument handling of the tools binary: help text for each tool, and clear errors for bad
//! input before anything connects. (Being an integration test of this package also makes
//! `cargo test --workspace` build `pdmesh-tools`, which `pdmesh bench|replay|collect` runs.)

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
    for cmd in ["bench", "replay", "collect"] {
        assert!(out.contains(cmd), "--help lacks {cmd}:\n{out}");
    }
    for (args, want) in [
        (&["bench", "engine", "--help"][..], "--threads"),
        (&["bench", "kv", "--help"], "--tokens"),
        (&["bench", "--help"], "--concurrency"),
        (&["replay", "--help"], "--trace"),
        (&["collect", "--help"], "--listen"),
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
