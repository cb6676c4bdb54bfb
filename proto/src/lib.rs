//! The pdmesh.v1 gRPC API, generated once for every client and server in the workspace, plus
//! the encoded descriptor set that server reflection serves and the conversions between the
//! KV layout on the wire and `pdmesh_kv_types::KvLayout`.

pub mod v1 {
    #![allow(missing_debug_implementations, unused_qualifications, clippy::all)]
    tonic::include_proto!("pdmesh.v1");
}

mod layout;

pub use layout::layout_from_wire;

/// Encoded `FileDescriptorSet` of every pdmesh proto, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("pdmesh_descriptor");
/// `generation.proto` alone: what reflection on the public port describes.
pub const PUBLIC_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/pdmesh_public_descriptor.bin"));
