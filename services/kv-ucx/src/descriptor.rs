//! What the UCX transport puts inside the proto's opaque `TransportDescriptor`s: its own
//! messages, encoded with prost. Only this crate reads them; the worker address and remote
//! keys inside are each sealed (`ucx::seal`), and the shared pool's key sealed again under a
//! secret of its host (`same_host`).

use bytes::Bytes;
use pdmesh_proto::v1::TransportDescriptor;
use prost::Message;

/// The transport's name, in `kv_transport` and on its descriptors.
pub const NAME: &str = "ucx";

/// Blocks granted for one-sided access: a reservation's (remote write) or a lease's (remote
/// read).
#[derive(Clone, PartialEq, Message)]
pub struct UcxTarget {
    /// The node's UCX worker address (sealed).
    #[prost(bytes = "bytes", tag = "1")]
    pub worker_address: Bytes,
    /// Address of each block, in prompt (or chain) order. A block is one region of
    /// bytes_per_block; layer L's part starts L * bytes_per_block / layers into it.
    #[prost(fixed64, repeated, tag = "2")]
    pub block_addrs: Vec<u64>,
    /// The memory registered for this grant alone, revoked when it ends. Every block lies
    /// inside one range.
    #[prost(message, repeated, tag = "3")]
    pub ranges: Vec<UcxRange>,
}

#[derive(Clone, PartialEq, Message)]
pub struct UcxRange {
    #[prost(fixed64, tag = "1")]
    pub base: u64,
    #[prost(uint64, tag = "2")]
    pub len: u64,
    /// The packed remote key of this range (sealed).
    #[prost(bytes = "bytes", tag = "3")]
    pub rkey: Bytes,
}

/// A decode node's whole pool in shared memory, offered to a writer on its host: the range
/// with its key sealed under the secret in `key_file`, an owner-only file there.
#[derive(Clone, PartialEq, Message)]
pub struct UcxShared {
    #[prost(message, optional, tag = "1")]
    pub range: Option<UcxRange>,
    #[prost(string, tag = "2")]
    pub key_file: String,
}

/// `msg` as the proto carries it.
pub fn wrap(msg: &impl Message) -> TransportDescriptor {
    TransportDescriptor { transport: NAME.into(), sealed: msg.encode_to_vec().into() }
}

/// The message of type `M` inside `d`, when `d` is this transport's.
pub fn open<M: Message + Default>(d: &TransportDescriptor) -> Result<M, String> {
    if d.transport != NAME {
        return Err(format!("a {:?} descriptor, not {NAME}'s", d.transport));
    }
    M::decode(d.sealed.clone()).map_err(|e| format!("a malformed {NAME} descriptor: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_foreign_ones_are_refused() {
        let t = UcxTarget {
            worker_address: Bytes::from_static(b"w"),
            block_addrs: vec![1, 2],
            ranges: vec![UcxRange { base: 1, len: 2, rkey: Bytes::from_static(b"k") }],
        };
        let d = wrap(&t);
        assert_eq!(open::<UcxTarget>(&d).unwrap(), t);
        let other = TransportDescriptor { transport: "nixl".into(), ..d.clone() };
        assert!(open::<UcxTarget>(&other).unwrap_err().contains("not ucx's"));
        let garbled = TransportDescriptor { sealed: Bytes::from_static(&[0xff; 3]), ..d };
        assert!(open::<UcxTarget>(&garbled).unwrap_err().contains("malformed"));
    }
}
