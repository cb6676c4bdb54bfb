//! The decode node's side of UCX: the KV pool peers may write into, and the `UcxTarget` each
//! reservation hands out — its prompt's blocks registered for remote write alone, under keys
//! of their own, revoked when the reservation's KV is complete (`scope`).
//!
//! Peers put into the pool itself where UCX reaches its memory (host memory; a GPU's where
//! UCX has a CUDA transport). Else they put into host staging blocks (`staging`), which the
//! node copies into the pool at the commit; `KvPath` says which, in stats and traces.
//!
//! On one host a put still crosses a transport (TCP, or shared memory through a bounce
//! buffer). So the pool — or its staging area — can live in shared memory that UCX allocates
//! (`share_kv_pool`); a writer on the same host maps it once and copies each block in with
//! one memcpy. The trade: such a writer could reach every block of it, not only its
//! reservation's. It is an authenticated prefill or decode node on this host, where processes
//! of one user can already reach each other's memory through the kernel (CMA, which UCX itself
//! uses); it keeps to its target's blocks as a remote writer does, and `--kv-shared-pool false`
//! turns the offer off.

use std::sync::Arc;

use bytes::Bytes;
use pdmesh_engine::Engine;
use pdmesh_kv_types::{HostMemory, KvGeometry, MemoryKind, MemoryRegion};
use pdmesh_proto::v1::{UcxRange, UcxTarget};
use serde::{Deserialize, Serialize};

use crate::same_host::SharedOffer;
use crate::scope::{self, Grant};
use crate::staging::{StagedBlocks, StagingArea, StagingFull};
use crate::ucx::{Access, UcxError, UcxNode};

/// `kv_staging` in the decode config: whether peers put into the pool or into host staging
/// blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvStaging {
    /// Into the pool where UCX reaches its memory, else staged.
    #[default]
    Auto,
    /// Into the pool; a node whose pool UCX cannot reach does not start (with `ucx`).
    Direct,
    /// Always staged, even where UCX reaches the pool.
    Staged,
}

impl KvStaging {
    pub fn name(self) -> &'static str {
        match self {
            KvStaging::Auto => "auto",
            KvStaging::Direct => "direct",
            KvStaging::Staged => "staged",
        }
    }

    /// Whether a pool of `kind` is staged under this policy, given whether UCX reaches
    /// that memory.
    pub fn stages(self, reaches_pool: bool) -> bool {
        match self {
            KvStaging::Auto => !reaches_pool,
            KvStaging::Direct => false,
            KvStaging::Staged => true,
        }
    }
}

impl std::str::FromStr for KvStaging {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(KvStaging::Auto),
            "direct" => Ok(KvStaging::Direct),
            "staged" => Ok(KvStaging::Staged),
            other => Err(format!("unknown kv_staging {other:?} (expected auto, direct or staged)")),
        }
    }
}

impl std::fmt::Display for KvStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How peers' puts reach a decode node's KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPath {
    /// Into the pool itself, memory of this kind.
    Direct(MemoryKind),
    /// Into host staging blocks, copied at the commit into the pool (memory of this kind).
    Staged(MemoryKind),
}

impl KvPath {
    /// What stats and traces show: `direct-host`, `direct-cuda`, `staged-host` (a pool in
    /// host memory, staged on request) or `staged-cuda`.
    pub fn name(self) -> &'static str {
        match self {
            KvPath::Direct(MemoryKind::Host) => "direct-host",
            KvPath::Direct(MemoryKind::Cuda { .. }) => "direct-cuda",
            KvPath::Staged(MemoryKind::Host) => "staged-host",
            KvPath::Staged(MemoryKind::Cuda { .. }) => "staged-cuda",
        }
    }
}

/// Why a reservation's blocks could not be granted to peers.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error(transparent)]
    Ucx(#[from] UcxError),
    /// Every staging block is taken: this reservation's KV comes over a stream instead.
    #[error(transparent)]
    StagingFull(#[from] StagingFull),
}

/// A reservation's blocks granted to peers.
#[derive(Debug)]
pub struct Granted {
    /// What the writer is handed.
    pub target: UcxTarget,
    /// Keeps the target's ranges registered; dropping it revokes them.
    pub grant: Grant,
    /// Where the puts land when the pool is staged, to copy into the pool at the commit.
    /// Keep it until the writer's session has ended: its blocks are then reused.
    pub staged: Option<StagedBlocks>,
}

/// A KV pool peers may be granted access to.
#[derive(Debug, Clone)]
pub struct KvPool {
    /// Keeps the worker (and its progress thread, which serves incoming puts) alive.
    node: UcxNode,
    /// What peers put into: the pool, or its staging area.
    memory: MemoryRegion,
    worker_address: Bytes,
    bytes_per_block: u64,
    /// Blocks of the engine's pool.
    blocks: u32,
    shared: Option<SharedOffer>,
    staging: Option<Arc<StagingArea>>,
    path: KvPath,
}

/// Moves `engine`'s KV pool into shared memory that `node` allocates, before the engine holds
/// any KV. Returns what a writer on this host needs to map it (`KvPool::with_shared`).
pub fn share_kv_pool(node: &UcxNode, engine: &mut Engine) -> Result<UcxRange, String> {
    let (memory, range) = allocate_shared(node, engine.kv_bytes())?;
    engine.rehome_kv(memory).map_err(|e| e.to_string())?;
    Ok(range)
}

/// `len` zeroed bytes of shared memory that `node` allocates, and what a writer on this host
/// needs to map them.
pub fn allocate_shared(node: &UcxNode, len: usize) -> Result<(HostMemory, UcxRange), String> {
    let a = node.allocate(len).map_err(|e| e.to_string())?;
    let base = a.addr;
    let keep: Arc<dyn std::any::Any + Send + Sync> = a.keep;
    // SAFETY: UCX allocated at least `len` bytes at `base` (page-aligned shared memory,
    // zero when fresh) that `keep` holds until dropped; the engine becomes their only user
    // in this process.
    #[allow(unsafe_code)]
    let mut memory = unsafe { HostMemory::adopt(base, len, keep)? };
    if std::env::var_os("UCX_ALLOC_PRIO").is_some() {
        // An operator's allocation priority may pick memory that is not fresh.
        memory.bytes_mut().fill(0);
    }
    Ok((memory, UcxRange { base: base as u64, len: len as u64, rkey: a.rkey }))
}

/// The KV pool in `memory` (blocks of `geometry`), reachable through `node`.
///
/// Peers then write into the pool while the engine thread owns it, as a NIC's DMA would. The
/// protocol confines those writes to a reservation's blocks between its session's accept and
/// commit, which the engine neither reads nor writes in that window (and the commit reaches
/// the engine thread through a channel, which orders the writes before any read). Rust's
/// memory model does not describe memory written by another process; that is the trade.
pub fn register_kv_pool(
    node: &UcxNode,
    memory: &MemoryRegion,
    geometry: &KvGeometry,
) -> Result<KvPool, UcxError> {
    let bytes_per_block = geometry.bytes_per_block() as u64;
    if memory.is_empty() || bytes_per_block == 0 {
        return Err(UcxError::Usage("the KV pool is empty".into()));
    }
    probe(node, memory, bytes_per_block)?;
    Ok(KvPool {
        node: node.clone(),
        memory: memory.clone(),
        worker_address: node.address().clone(),
        bytes_per_block,
        blocks: (memory.len() as u64 / bytes_per_block) as u32,
        shared: None,
        staging: None,
        path: KvPath::Direct(memory.kind()),
    })
}

/// The KV pool `pool` (blocks of `geometry`), reached by peers through the host staging
/// blocks of `area` (see `staging`).
pub fn stage_kv_pool(
    node: &UcxNode,
    area: Arc<StagingArea>,
    pool: &MemoryRegion,
    geometry: &KvGeometry,
) -> Result<KvPool, UcxError> {
    let bytes_per_block = geometry.bytes_per_block() as u64;
    if pool.is_empty() || bytes_per_block == 0 {
        return Err(UcxError::Usage("the KV pool is empty".into()));
    }
    if area.bytes_per_block() as u64 != bytes_per_block {
        return Err(UcxError::Usage(format!(
            "staging blocks of {} bytes for KV blocks of {bytes_per_block}",
            area.bytes_per_block()
        )));
    }
    let memory = area.region();
    probe(node, &memory, bytes_per_block)?;
    Ok(KvPool {
        node: node.clone(),
        memory,
        worker_address: node.address().clone(),
        bytes_per_block,
        blocks: (pool.len() as u64 / bytes_per_block) as u32,
        shared: None,
        staging: Some(area),
        path: KvPath::Staged(pool.kind()),
    })
}

/// One block registered and revoked now: a node that cannot register finds out at start, not
/// at its first request.
fn probe(node: &UcxNode, memory: &MemoryRegion, bytes_per_block: u64) -> Result<(), UcxError> {
    drop(scope::grant(node, memory, &[0], bytes_per_block, Access::RemoteWrite)?);
    Ok(())
}

impl KvPool {
    /// The pool as `share_kv_pool` placed it: offered to writers on this host that prove it
    /// (`same_host`). Without a secret to seal its key under, it is offered to none.
    pub fn with_shared(mut self, shared: UcxRange) -> Self {
        match SharedOffer::new(shared) {
            Ok(o) => self.shared = Some(o),
            Err(e) => tracing::warn!("KV pool not offered in shared memory, writers put: {e}"),
        }
        self
    }

    /// What a writer on this host needs to map the pool (or its staging area), when it is
    /// shared.
    pub fn shared(&self) -> Option<&SharedOffer> {
        self.shared.as_ref()
    }

    /// How peers' puts reach the pool.
    pub fn path(&self) -> KvPath {
        self.path
    }

    /// The staging area, when the pool is staged.
    pub fn staging(&self) -> Option<&Arc<StagingArea>> {
        self.staging.as_ref()
    }

    /// The target for a reservation whose prompt occupies `pool_blocks`, in prompt order,
    /// and the grant that keeps the blocks it names (only) writable by peers until dropped:
    /// the pool blocks themselves, or as many staging blocks.
    pub fn target(&self, pool_blocks: &[u32]) -> Result<Granted, TargetError> {
        if let Some(b) = pool_blocks.iter().find(|&&b| b >= self.blocks) {
            let why = format!("block {b} is past the pool's {}", self.blocks);
            return Err(UcxError::Usage(why).into());
        }
        let staged = match &self.staging {
            Some(area) => Some(area.take(pool_blocks.len())?),
            None => None,
        };
        let blocks = staged.as_ref().map_or(pool_blocks, |s| s.blocks());
        let (ranges, block_addrs, grant) = scope::grant(
            &self.node,
            &self.memory,
            blocks,
            self.bytes_per_block,
            Access::RemoteWrite,
        )?;
        let target = UcxTarget { worker_address: self.worker_address.clone(), block_addrs, ranges };
        Ok(Granted { target, grant, staged })
    }
}
