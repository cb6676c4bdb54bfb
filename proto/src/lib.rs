//! The pdmesh.v1 gRPC API, generated once for every client and server in the workspace, plus
//! the encoded descriptor set that server reflection serves.

#![allow(missing_debug_implementations, unused_qualifications, clippy::all)]

pub mod v1 {
    tonic::include_proto!("pdmesh.v1");
}

/// Encoded `FileDescriptorSet` of every pdmesh proto, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("pdmesh_descriptor");
