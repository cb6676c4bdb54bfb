//! The transport seam. The gRPC stream is built in; every other transport — one-sided ones
//! such as UCX, which put straight into registered memory — is a `Fabric` that the binary
//! registers (`register`) and each node starts by name (`kv_transport`). A fabric has both
//! halves: the sending `KvTransport`, and the receiving `PoolOffer` that grants a
//! reservation's blocks as an opaque `TransportDescriptor` the proto carries unread. A
//! KV-store offers its blocks for remote reads (`ReadOffer`) and a prefill node reads them
//! (`RemoteReader`) the same way. The decode node, the KV-store and the router see only these
//! traits; adding a transport is one `Fabric` and one `register` call.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pdmesh_kv_types::{KvPool, MemoryRegion};
use pdmesh_proto::v1::TransportDescriptor;
use serde::{Deserialize, Serialize};

use crate::grpc::GrpcTransport;
use crate::pool::{Grant, PoolOffer, PoolOptions};
use crate::{KvTransport, StallBound};

/// One transport beyond the gRPC stream, started on one node.
pub trait Fabric: Send + Sync + std::fmt::Debug {
    /// The name `kv_transport` selects it by, and its descriptors carry.
    fn name(&self) -> &'static str;
    /// The sending half. `grpc` carries the sessions' control path; sessions making no
    /// progress within `stall` are given up.
    fn sender(&self, grpc: Arc<GrpcTransport>, stall: StallBound) -> Box<dyn KvTransport>;
    /// The receiving half: a node's KV pool offered to this transport's writers (it may
    /// move the pool, before the pool holds any KV).
    fn offer_pool(
        &self,
        pool: &mut dyn KvPool,
        options: &PoolOptions,
    ) -> Result<Arc<dyn PoolOffer>, String>;
    /// A KV-store's blocks (in `memory`, of `bytes_per_block` each) offered for remote reads.
    fn offer_reads(
        &self,
        memory: &MemoryRegion,
        bytes_per_block: u64,
    ) -> Result<Arc<dyn ReadOffer>, String>;
    /// Reads what another node's `ReadOffer` granted.
    fn reader(&self) -> Arc<dyn RemoteReader>;
}

/// A KV-store's blocks offered to one transport's readers.
pub trait ReadOffer: Send + Sync + std::fmt::Debug {
    fn transport(&self) -> &'static str;
    /// Grants remote reads of the store's blocks `slots`, in the order a reader gets them,
    /// until the grant is dropped.
    fn grant(&self, slots: &[u32]) -> Result<(TransportDescriptor, Box<dyn Grant>), String>;
}

/// Reads blocks a `ReadOffer` granted, by one-sided gets.
#[async_trait::async_trait]
pub trait RemoteReader: Send + Sync + std::fmt::Debug {
    fn transport(&self) -> &'static str;
    /// The first `blocks` blocks `descriptor` grants, of `bytes_per_block` each, in order:
    /// exactly that many, or an error.
    async fn read(
        &self,
        descriptor: &TransportDescriptor,
        blocks: usize,
        bytes_per_block: u64,
    ) -> Result<Vec<Bytes>, String>;
}

/// Starts a registered transport on the node named by its argument.
pub type Start = fn(node: &str) -> Result<Arc<dyn Fabric>, String>;

static REGISTERED: Mutex<Vec<(&'static str, Start)>> = Mutex::new(Vec::new());

/// Makes transport `name` available to every node of this process. Registering a name again
/// replaces its start.
pub fn register(name: &'static str, start: Start) {
    let mut r = REGISTERED.lock().expect("never poisoned");
    match r.iter_mut().find(|(n, _)| *n == name) {
        Some(entry) => entry.1 = start,
        None => r.push((name, start)),
    }
}

/// The transports registered, in registration order (`auto` prefers the first).
pub fn registered() -> Vec<&'static str> {
    REGISTERED.lock().expect("never poisoned").iter().map(|(n, _)| *n).collect()
}

fn find(name: &str) -> Option<Start> {
    let r = REGISTERED.lock().expect("never poisoned");
    r.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// `kv_transport` in the prefill, decode and KV-store configs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TransportKind {
    /// The gRPC stream only.
    Grpc,
    /// The first registered transport when it starts and reaches the peer, else the stream.
    #[default]
    Auto,
    /// This registered transport (e.g. "ucx"); a transfer that cannot use it fails
    /// (FAILED_PRECONDITION), and a node where it cannot start does not start.
    Named(String),
}

impl TransportKind {
    /// The kind that asks for transport `name`.
    pub fn named(name: &str) -> Self {
        Self::Named(name.to_string())
    }

    pub fn name(&self) -> &str {
        match self {
            TransportKind::Grpc => "grpc",
            TransportKind::Auto => "auto",
            TransportKind::Named(n) => n,
        }
    }

    /// Starts the transport this kind needs on node `node`: none for `grpc`; for `auto`, the
    /// first registered, or none when none is or it cannot start (logged); for a name, that
    /// one, or an error.
    pub fn start(&self, node: &str) -> Result<Option<Arc<dyn Fabric>>, String> {
        match self {
            TransportKind::Grpc => Ok(None),
            TransportKind::Named(name) => match find(name) {
                Some(start) => {
                    start(node).map(Some).map_err(|e| format!("kv_transport = {name}: {e}"))
                }
                None => Err(format!(
                    "kv_transport {name:?} is not built into this binary (it has: grpc{})",
                    registered().iter().map(|n| format!(", {n}")).collect::<String>()
                )),
            },
            TransportKind::Auto => {
                let first = REGISTERED.lock().expect("never poisoned").first().copied();
                let Some((name, start)) = first else { return Ok(None) };
                match start(node) {
                    Ok(f) => Ok(Some(f)),
                    Err(e) => {
                        tracing::warn!("{name} unavailable, KV moves over gRPC: {e}");
                        Ok(None)
                    }
                }
            }
        }
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.to_ascii_lowercase();
        match s.as_str() {
            "grpc" => Ok(TransportKind::Grpc),
            "auto" => Ok(TransportKind::Auto),
            "" => Err("kv_transport is empty (expected grpc, auto or a transport's name)".into()),
            n if n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') => {
                Ok(TransportKind::Named(s))
            }
            other => Err(format!(
                "unknown kv_transport {other:?} (expected grpc, auto or a transport's name)"
            )),
        }
    }
}

impl TryFrom<String> for TransportKind {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<TransportKind> for String {
    fn from(k: TransportKind) -> String {
        k.name().to_string()
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_unregistered_names_fail_to_start() {
        assert_eq!("GRPC".parse(), Ok(TransportKind::Grpc));
        assert_eq!("auto".parse(), Ok(TransportKind::Auto));
        assert_eq!("ucx".parse(), Ok(TransportKind::named("ucx")));
        assert!("u c x".parse::<TransportKind>().is_err());
        assert!("".parse::<TransportKind>().is_err());
        let e = TransportKind::named("nixl-test").start("n").expect_err("not registered");
        assert!(e.contains("not built into this binary"), "{e}");
        assert!(TransportKind::Grpc.start("n").unwrap().is_none());
    }
}
