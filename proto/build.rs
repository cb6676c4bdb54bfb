//! Generates the pdmesh.v1 clients and servers once, for every crate, into OUT_DIR. protoc
//! comes from `protoc-bin-vendored`, so a fresh machine needs nothing installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build finds protoc through PROTOC. Edition 2024 makes `set_var` unsafe.
    #[allow(unsafe_code)]
    // SAFETY: a build script runs on one thread; nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("PROTOC", protoc);
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let files = ["pdmesh/v1/generation.proto", "pdmesh/v1/internal.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("pdmesh_descriptor.bin"))
        // KV block data moves as `Bytes`: no copy between the engine and the wire.
        .bytes(".")
        .compile_protos(&files, &["."])?;
    // The public port's reflection describes the public API alone: the internal services'
    // schema is no business of a caller without a mesh certificate.
    let public = out.join("pdmesh_public_descriptor.bin");
    let status = std::process::Command::new(protoc_bin_vendored::protoc_bin_path()?)
        .arg("--include_imports")
        .arg(format!("--descriptor_set_out={}", public.display()))
        .args(["-I.", files[0]])
        .status()?;
    if !status.success() {
        return Err(format!("protoc for the public descriptor set: {status}").into());
    }
    Ok(())
}
