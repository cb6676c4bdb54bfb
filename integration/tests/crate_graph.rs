//! The transport seam holds in the crate graph: the decode node, the KV-store, the prefill
//! node, the router and the OpenAI frontend link no UCX (only the binary, through
//! `pdmesh-kv-ucx`), and the proto names no UCX message — a transport's details travel as
//! opaque descriptors, and the binary starts only the transports it registered.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

/// Every package in `krate`'s dependency tree, dev and build dependencies included.
fn tree(krate: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO"))
        .current_dir(&root)
        .args(["tree", "--offline", "-p", krate, "-e", "normal,build,dev"])
        .args(["--prefix", "none", "--format", "{p}"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo tree -p {krate}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect()
}

fn links_ucx(packages: &[String]) -> Vec<&String> {
    packages
        .iter()
        .filter(|p| p.starts_with("pdmesh-kv-ucx ") || p.starts_with("ucx-rs "))
        .collect()
}

#[test]
fn only_the_binary_links_ucx() {
    for krate in [
        "pdmesh-decode",
        "pdmesh-kvstore",
        "pdmesh-prefill",
        "pdmesh-router",
        "pdmesh-frontend-openai",
        "pdmesh-kv-transfer",
    ] {
        let t = tree(krate);
        assert!(t.iter().any(|p| p.starts_with(&format!("{krate} "))), "{krate}: {t:?}");
        assert!(links_ucx(&t).is_empty(), "{krate} links {:?}", links_ucx(&t));
    }
    // The check can fail: the binary does link it.
    assert!(!links_ucx(&tree("pdmesh-cli")).is_empty(), "the binary carries UCX");
}

#[test]
fn the_proto_names_no_ucx_message() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/pdmesh/v1");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "proto") {
            continue;
        }
        seen += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("").to_ascii_lowercase();
            let named = code.split_whitespace().collect::<Vec<_>>();
            let declares = named.windows(2).any(|w| {
                matches!(w[0], "message" | "enum" | "service" | "rpc") && w[1].contains("ucx")
            });
            // A field typed or named after UCX is the same leak as a message.
            let field = code.contains("ucx") && code.contains('=');
            assert!(!declares && !field, "{}:{}: {line}", path.display(), i + 1);
        }
    }
    assert!(seen > 0, "no .proto files under {}", dir.display());
}

/// A node asked for a transport this binary does not carry stops with a status naming it and
/// the ones it has, rather than starting on another.
#[test]
fn a_transport_the_binary_lacks_is_refused_by_name() {
    let out = pdmesh_integration::pdmesh(&["decode", "--insecure", "--listen", "127.0.0.1:0"])
        .args(["--kv-transport", "nixl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("kv_transport \"nixl\" is not built into this binary (it has: grpc, ucx)"),
        "{err}"
    );
}
