//! The kernels compiled for a GPU architecture by NVRTC, loaded at run time from wherever the
//! dynamic loader finds `libnvrtc.so` or `libnvrtc.so.12` (the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12` ships one; CUDA 13's, linked as `libnvrtc.so`, compiles them too), so
//! no CUDA toolkit is needed to build or to compile. PTX is cached per architecture and source
//! under `$PDMESH_CUDA_CACHE` (default `$XDG_CACHE_HOME/pdmesh/cuda` or `~/.cache/pdmesh/cuda`).

use std::path::PathBuf;

use cudarc::nvrtc::{CompileOptions, Ptx};

use super::{DeviceError, MODULES};

/// Whether NVRTC can be loaded, without the panic cudarc raises on a missing library.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library and drops the handle.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The loaded NVRTC's (major, minor) version, or None when there is none.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); nvrtcVersion only writes the two ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// Why NVRTC cannot be used here, or None when it can.
pub fn nvrtc_missing() -> Option<String> {
    (!nvrtc_present()).then(|| {
        "neither libnvrtc.so nor libnvrtc.so.12 is on the dynamic loader's path: install \
         the nvidia-cuda-nvrtc-cu12 wheel and put its nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH \
         (a later NVRTC, such as CUDA 13's libnvrtc.so.13, works linked as libnvrtc.so)"
            .to_string()
    })
}

/// The NVRTC options every kernel is compiled with: no multiply-add fused unless the source
/// writes `fmaf` (the CPU backend's order depends on where FMAs are), IEEE division and square
/// root, subnormals kept.
fn options(arch: &'static str, name: &str) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        use_fast_math: Some(false),
        arch: Some(arch),
        name: Some(format!("{name}.cu")),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    }
}

/// The `compute_XY` architecture NVRTC targets for compute capability `(major, minor)`.
pub fn arch_for(major: i32, minor: i32) -> Result<&'static str, DeviceError> {
    Ok(match (major, minor) {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (m, _) if m >= 10 => "compute_90",
        (m, n) => {
            return Err(DeviceError::Unavailable(format!(
                "compute capability {m}.{n}: pdmesh's CUDA kernels need 8.0 (Ampere) or newer"
            )));
        }
    })
}

/// PTX of module `name` (one of `MODULES`) for `arch`, from the cache or compiled now.
pub fn module_ptx(name: &str, arch: &'static str) -> Result<Ptx, DeviceError> {
    let (_, src, _) = MODULES
        .iter()
        .find(|(n, _, _)| *n == name)
        .ok_or_else(|| DeviceError::Unavailable(format!("no kernel module {name}")))?;
    let cached = cache_dir().map(|d| d.join(format!("{name}-{arch}-{:016x}.ptx", hash(src))));
    if let Some(text) = cached.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(Ptx::from_src(text));
    }
    let ptx = compile(name, src, arch)?;
    if let Some(path) = cached {
        // A cache that cannot be written only costs a compile next time.
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(ptx)
}

/// Compiles one module's source for `arch` with NVRTC.
pub fn compile(name: &str, src: &str, arch: &'static str) -> Result<Ptx, DeviceError> {
    if let Some(why) = nvrtc_missing() {
        return Err(DeviceError::Unavailable(why));
    }
    cudarc::nvrtc::compile_ptx_with_opts(src, options(arch, name)).map_err(|e| {
        let why = match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        DeviceError::Unavailable(format!("NVRTC could not compile {name}.cu for {arch}: {why}"))
    })
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("PDMESH_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("pdmesh").join("cuda"))
}

/// FNV-1a of the source: names its cached PTX, so an edited kernel is compiled afresh.
fn hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}
