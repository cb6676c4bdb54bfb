//! pdmesh's UCX transport, behind kv-transfer's transport seam: one-sided puts from prefill
//! nodes straight into a decode node's registered KV pool (`sender`, `pool`), a direct copy
//! into that pool when both share a host (`same_host`), and gets of the KV-store's blocks
//! (`store`). Access is scoped to each reservation's or lease's blocks (`scope`); every
//! address and key handed out is sealed (`ucx`). Only the binary links this crate: it calls
//! `register`, and nodes start it by name (`kv_transport = ucx`, or `auto`).

pub mod descriptor;
pub mod pool;
pub mod same_host;
pub mod scope;
pub mod sender;
pub mod store;
pub mod ucx;

use std::sync::Arc;

use pdmesh_kv_transfer::{
    Fabric, GrpcTransport, KvTransport, PoolOffer, PoolOptions, ReadOffer, RemoteReader, StallBound,
};
use pdmesh_kv_types::{KvPool, MemoryRegion};

pub use descriptor::NAME;
pub use sender::UcxTransport;
pub use ucx::{UcxError, UcxNode, new_seal_key, parse_seal_key, read_seal_key, set_seal_key};

/// Makes UCX available to the nodes of this process, as `kv_transport = ucx` (and `auto`).
pub fn register() {
    pdmesh_kv_transfer::transport::register(NAME, start);
}

fn start(node: &str) -> Result<Arc<dyn Fabric>, String> {
    let node = UcxNode::start(node).map_err(|e| e.to_string())?;
    Ok(Arc::new(Ucx { node }))
}

/// UCX started on one node.
#[derive(Debug, Clone)]
pub struct Ucx {
    node: UcxNode,
}

impl Ucx {
    pub fn new(node: UcxNode) -> Self {
        Self { node }
    }
}

impl Fabric for Ucx {
    fn name(&self) -> &'static str {
        NAME
    }

    fn sender(&self, grpc: Arc<GrpcTransport>, stall: StallBound) -> Box<dyn KvTransport> {
        Box::new(UcxTransport::new(self.node.clone(), grpc).with_stall(stall))
    }

    fn offer_pool(
        &self,
        kv: &mut dyn KvPool,
        options: &PoolOptions,
    ) -> Result<Arc<dyn PoolOffer>, String> {
        Ok(Arc::new(pool::offer(&self.node, kv, options)?))
    }

    fn offer_reads(
        &self,
        memory: &MemoryRegion,
        bytes_per_block: u64,
    ) -> Result<Arc<dyn ReadOffer>, String> {
        let reads = store::UcxReads::new(self.node.clone(), memory.clone(), bytes_per_block);
        Ok(Arc::new(reads.map_err(|e| e.to_string())?))
    }

    fn reader(&self) -> Arc<dyn RemoteReader> {
        Arc::new(store::UcxReader::new(self.node.clone()))
    }
}
