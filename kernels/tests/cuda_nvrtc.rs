//! The compile tier of the CUDA backend: every kernel module compiled by NVRTC for the
//! Ampere (sm_80) and Hopper (sm_90) architectures, the PTX defining every kernel the backend
//! launches, then assembled by `ptxas` for each (which checks the inline PTX, such as the
//! tensor-core `mma.sync`, that NVRTC passes through unread) and whose report must show no
//! kernel keeping per-thread arrays in local memory. NVRTC and ptxas come from the
//! CUDA 12.9 wheels `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvcc-cu12`; `just test` installs
//! them and sets LD_LIBRARY_PATH and PDMESH_PTXAS, then runs this test again with CUDA 13.0's
//! (what a CUDA 13 machine, such as the lent H200, compiles with), `PDMESH_NVRTC_MAJOR=13`
//! checking that those were the ones loaded. Without them the test fails in CI and says
//! SKIPPED elsewhere.

use pdmesh_kernels::cuda::MODULES;
use pdmesh_kernels::cuda::nvrtc::{compile, nvrtc_missing, nvrtc_version};

#[test]
fn every_kernel_compiles_and_assembles_for_sm80_and_sm90() {
    if let Some(why) = nvrtc_missing() {
        assert!(std::env::var_os("CI").is_none(), "CI must compile the kernels: {why}");
        eprintln!("SKIPPED: {why}");
        return;
    }
    let version = nvrtc_version().expect("the loaded NVRTC's version");
    eprintln!("NVRTC {}.{}", version.0, version.1);
    if let Ok(want) = std::env::var("PDMESH_NVRTC_MAJOR") {
        assert_eq!(version.0.to_string(), want, "PDMESH_NVRTC_MAJOR: another NVRTC was loaded");
    }
    let ptxas = std::env::var_os("PDMESH_PTXAS").map(std::path::PathBuf::from);
    if ptxas.is_none() {
        assert!(std::env::var_os("CI").is_none(), "CI must assemble the kernels: no PDMESH_PTXAS");
        eprintln!("SKIPPED assembling: PDMESH_PTXAS is not set (just test sets it)");
    }
    let dir = std::env::temp_dir().join(format!("pdmesh-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for arch in ["compute_80", "compute_90"] {
        for (name, src, kernels) in MODULES {
            let ptx = compile(name, src, arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            let target = arch.replace("compute_", "sm_");
            assert!(text.contains(&format!(".target {target}")), "{name}: not for {target}");
            for k in *kernels {
                assert!(text.contains(&format!(".entry {k}(")), "{name} for {arch}: no {k}");
            }
            if let Some(ptxas) = &ptxas {
                let file = dir.join(format!("{name}.{target}.ptx"));
                std::fs::write(&file, &text).unwrap();
                let out = std::process::Command::new(ptxas)
                    .arg("-v")
                    .arg(format!("-arch={target}"))
                    .arg(&file)
                    .arg("-o")
                    .arg(dir.join(format!("{name}.{target}.cubin")))
                    .output()
                    .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.display()));
                assert!(
                    out.status.success(),
                    "ptxas {name} for {target}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let report = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                let local = local_memory(&report);
                assert!(
                    local.is_empty(),
                    "{name} for {target}: kernels with a stack frame or spills: {local:?}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The kernels whose `ptxas -v` properties show a stack frame or spills: per-thread arrays
/// the compiler could not keep in registers (a runtime index, a loop it did not unroll), so
/// every access is a round trip through local memory. Each kernel here has none; a change
/// that brings one back fails (it has happened: the prompt matmuls' and attention's
/// accumulators). Only entries are checked: a device function ptxas kept out of line
/// reports its own frame.
fn local_memory(report: &str) -> Vec<String> {
    const CLEAN: &str = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads";
    let mut entry = None;
    let mut bad = Vec::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            entry = rest.split('\'').next().map(str::to_owned);
        } else if line.contains("bytes stack frame")
            && let Some(name) = entry.take()
            && !line.trim().starts_with(CLEAN)
        {
            bad.push(format!("{name}: {}", line.trim()));
        }
    }
    bad
}

#[test]
fn local_memory_reads_ptxas_reports() {
    let report = "ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for helper
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
    768 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'c' for 'sm_90'
ptxas info    : Function properties for c
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
";
    let bad = local_memory(report);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(bad[0].starts_with("b: 768 bytes") && bad[1].starts_with("c: 0 bytes"), "{bad:?}");
}
