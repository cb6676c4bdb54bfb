//! UCX reads of the KV-store's blocks: the store registers a lease's matched blocks for
//! remote read alone (`UcxReads`), and a prefill node gets them all at once (`UcxReader`).

use bytes::Bytes;
use pdmesh_kv_transfer::{Grant, ReadOffer, RemoteReader};
use pdmesh_kv_types::MemoryRegion;
use pdmesh_proto::v1::TransportDescriptor;

use crate::descriptor::{self, UcxTarget};
use crate::pool::UcxGrant;
use crate::scope::Keys;
use crate::ucx::{Access, Peers, UcxError, UcxNode};

/// A KV-store's blocks offered for remote reads.
#[derive(Debug)]
pub struct UcxReads {
    node: UcxNode,
    memory: MemoryRegion,
    bytes_per_block: u64,
}

impl UcxReads {
    /// The store's blocks in `memory`; one block is registered and revoked now, so a store
    /// that cannot register finds out at start.
    pub fn new(
        node: UcxNode,
        memory: MemoryRegion,
        bytes_per_block: u64,
    ) -> Result<Self, UcxError> {
        if memory.is_empty() || bytes_per_block == 0 {
            return Err(UcxError::Usage("the KV-store's pool is empty".into()));
        }
        drop(UcxGrant::new(&node, &memory, &[0], bytes_per_block, Access::RemoteRead)?);
        Ok(Self { node, memory, bytes_per_block })
    }
}

impl ReadOffer for UcxReads {
    fn transport(&self) -> &'static str {
        descriptor::NAME
    }

    fn grant(&self, slots: &[u32]) -> Result<(TransportDescriptor, Box<dyn Grant>), String> {
        let blocks = self.memory.len() as u64 / self.bytes_per_block;
        if let Some(s) = slots.iter().find(|&&s| u64::from(s) >= blocks) {
            return Err(format!("slot {s} is past the store's {blocks} blocks"));
        }
        let (target, grant) = UcxGrant::new(
            &self.node,
            &self.memory,
            slots,
            self.bytes_per_block,
            Access::RemoteRead,
        )
        .map_err(|e| e.to_string())?;
        Ok((descriptor::wrap(&target), Box::new(grant)))
    }
}

/// Reads what a KV-store granted, over endpoints cached per store.
#[derive(Debug)]
pub struct UcxReader {
    peers: Peers,
}

impl UcxReader {
    pub fn new(node: UcxNode) -> Self {
        Self { peers: Peers::new(node) }
    }
}

#[async_trait::async_trait]
impl RemoteReader for UcxReader {
    fn transport(&self) -> &'static str {
        descriptor::NAME
    }

    /// All the gets in flight at once.
    async fn read(
        &self,
        d: &TransportDescriptor,
        blocks: usize,
        bpb: u64,
    ) -> Result<Vec<Bytes>, String> {
        let t: UcxTarget = descriptor::open(d)?;
        if t.block_addrs.len() != blocks {
            return Err(format!(
                "the store named {} addresses for {blocks} blocks",
                t.block_addrs.len()
            ));
        }
        let len = usize::try_from(bpb).map_err(|e| e.to_string())?;
        crate::scope::check(&t.ranges, &t.block_addrs, bpb).map_err(|e| e.to_string())?;
        let peers = &self.peers;
        let peer = peers.get(&t.worker_address).await.map_err(|e| e.to_string())?;
        let keys = Keys::unpack(&peer.ep, &t.ranges).await.map_err(|e| {
            peers.evict(&peer);
            e.to_string()
        })?;
        let mut pending = Vec::with_capacity(blocks);
        for &a in &t.block_addrs {
            let key =
                keys.key(a, bpb).ok_or_else(|| format!("block at {a:#x} outside the lease"))?;
            pending.push(peer.ep.get(len, a, key));
        }
        let mut out = Vec::with_capacity(blocks);
        for p in pending {
            match p.await {
                Ok(data) => out.push(Bytes::from(data)),
                Err(e) => {
                    peers.evict(&peer);
                    return Err(e.to_string());
                }
            }
        }
        Ok(out)
    }
}
