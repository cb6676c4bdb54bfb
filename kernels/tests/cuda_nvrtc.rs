//! The compile tier of the CUDA backend: every kernel module compiled by NVRTC for the
//! Ampere (sm_80) and Hopper (sm_90) architectures, the PTX defining every kernel the backend
//! launches. NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel (`just test` installs it and
//! puts it on LD_LIBRARY_PATH); without it the test fails in CI and says SKIPPED elsewhere.

use pdmesh_kernels::cuda::MODULES;
use pdmesh_kernels::cuda::nvrtc::{compile, nvrtc_missing};

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if let Some(why) = nvrtc_missing() {
        assert!(std::env::var_os("CI").is_none(), "CI must compile the kernels: {why}");
        eprintln!("SKIPPED: {why}");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        for (name, src, kernels) in MODULES {
            let ptx = compile(name, src, arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            let target = arch.replace("compute_", "sm_");
            assert!(text.contains(&format!(".target {target}")), "{name}: not for {target}");
            for k in *kernels {
                assert!(text.contains(&format!(".entry {k}(")), "{name} for {arch}: no {k}");
            }
        }
    }
}
