//! Builds the CUDA kernels for the host: every `cuda/*.cu` file compiled by the C++ compiler
//! against `cuda/emu/cuda_emu.h` (CUDA's execution model on OS threads) into one static
//! library, with a table of its `extern "C" __global__` kernels by name. Also writes, for the
//! NVRTC path, each `.cu` file with its local includes inlined and the kernel names it defines.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    let dir = PathBuf::from(env("CARGO_MANIFEST_DIR")).join("cuda");
    let out = PathBuf::from(env("OUT_DIR"));
    println!("cargo:rerun-if-changed={}", dir.display());

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for entry in std::fs::read_dir(&dir)
        .expect("cuda dir")
        .chain(std::fs::read_dir(dir.join("emu")).expect("cuda/emu dir"))
    {
        println!("cargo:rerun-if-changed={}", entry.expect("entry").path().display());
    }

    let mut unity = String::from("#include \"cuda_emu.h\"\n");
    let mut table = String::new();
    let mut modules =
        String::from("/// Each kernel source, its includes inlined, and the kernels it defines.\n");
    modules.push_str("pub const MODULES: &[(&str, &str, &[&str])] = &[\n");
    for src in &sources {
        let text = std::fs::read_to_string(src).expect("a .cu file");
        let names = kernel_names(&text);
        assert!(!names.is_empty(), "{} defines no extern \"C\" __global__ kernel", src.display());
        writeln!(unity, "#include \"{}\"", src.display()).expect("string");
        for n in &names {
            writeln!(table, "    PDMESH_EMU_ENTRY({n}),").expect("string");
        }
        let flat = inline_includes(src, &mut HashSet::new());
        let stem = src.file_stem().expect("stem").to_string_lossy().to_string();
        let flat_path = out.join(format!("{stem}.flat.cu"));
        std::fs::write(&flat_path, flat).expect("write flattened source");
        writeln!(
            modules,
            "    ({stem:?}, include_str!({:?}), &[{}]),",
            flat_path.display(),
            names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
        )
        .expect("string");
    }
    modules.push_str("];\n");
    write!(
        unity,
        "static const pdmesh_emu::KernelEntry PDMESH_KERNELS[] = {{\n{table}}};\n\
         extern \"C\" int pdmesh_emu_launch(const char* name, const unsigned* grid,\n\
             const unsigned* block, void** args, char* err, size_t err_len) {{\n\
             return pdmesh_emu::launch(PDMESH_KERNELS, sizeof(PDMESH_KERNELS) / sizeof(PDMESH_KERNELS[0]),\n\
                 name, grid, block, args, err, err_len);\n\
         }}\n"
    )
    .expect("string");
    let unity_path = out.join("emu_kernels.cpp");
    std::fs::write(&unity_path, unity).expect("write emu_kernels.cpp");
    std::fs::write(out.join("cuda_modules.rs"), modules).expect("write cuda_modules.rs");

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include(dir.join("emu"))
        .file(&unity_path)
        // Only the multiply-adds a kernel writes as `fmaf` are fused, as NVRTC's --fmad=false.
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false);
    let runtimes = sanitize(&mut build);
    build.compile("pdmesh_cuda_emu");
    for lib in runtimes {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-link-lib=stdc++");
}

/// The emulated kernels under a sanitizer when `PDMESH_EMU_SANITIZE` asks (`just
/// test-emu-asan`, `test-emu-tsan`): only this library is instrumented, and its runtime linked
/// into whatever links it, so a sanitizer run rebuilds this crate and its dependents rather
/// than the whole dependency tree (as RUSTFLAGS or CXXFLAGS would). Returns the runtime
/// libraries to link.
fn sanitize(build: &mut cc::Build) -> &'static [&'static str] {
    println!("cargo:rerun-if-env-changed=PDMESH_EMU_SANITIZE");
    let which = std::env::var("PDMESH_EMU_SANITIZE").unwrap_or_default();
    let (flags, runtimes): (&[&str], &[&str]) = match which.as_str() {
        "" => (&[], &[]),
        "address" => (
            &[
                "-fsanitize=address,undefined",
                "-fno-sanitize-recover=undefined",
                "-fno-omit-frame-pointer",
                "-g",
            ],
            &["asan", "ubsan"],
        ),
        "thread" => (&["-fsanitize=thread", "-g", "-O1"], &["tsan"]),
        other => panic!("PDMESH_EMU_SANITIZE={other:?}: use address or thread"),
    };
    for f in flags {
        build.flag(f);
    }
    runtimes
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// Names of the kernels a source defines: `extern "C" __global__ void NAME(`.
fn kernel_names(text: &str) -> Vec<String> {
    const MARK: &str = "extern \"C\" __global__ void ";
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix(MARK))
        .map(|rest| rest.split('(').next().unwrap_or_default().trim().to_string())
        .collect()
}

/// `path` with each `#include "local"` replaced by that file's text, once per file (every
/// local header has `#pragma once`).
fn inline_includes(path: &Path, seen: &mut HashSet<PathBuf>) -> String {
    let canon = path.canonicalize().expect("a source path");
    if !seen.insert(canon) {
        return String::new();
    }
    let text = std::fs::read_to_string(path).expect("a source file");
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("#include \"") {
            let name = rest.split('"').next().unwrap_or_default();
            let inc = path.parent().expect("parent").join(name);
            out.push_str(&inline_includes(&inc, seen));
        } else if t != "#pragma once" {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}
