//! The receiving side of the transport seam: a decode node's KV pool offered to one
//! transport's writers (`PoolOffer`), and each reservation's blocks granted to them as a
//! revocable `Grant` whose descriptor the reservation's target carries.
//!
//! Writers put into the pool itself where the transport reaches its memory (host memory; a
//! GPU's where the transport can). Else they put into host staging blocks (`staging`), which
//! the node copies into the pool at the commit; `KvPath` says which, in stats and traces.

use std::sync::Arc;

use pdmesh_kv_types::MemoryKind;
use pdmesh_proto::v1::TransportDescriptor;
use serde::{Deserialize, Serialize};

use crate::staging::{StagedBlocks, StagingArea, StagingFull};

/// `kv_staging` in the decode config: whether peers put into the pool or into host staging
/// blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvStaging {
    /// Into the pool where the transport reaches its memory, else staged.
    #[default]
    Auto,
    /// Into the pool; a node whose pool the transport cannot reach does not start with it.
    Direct,
    /// Always staged, even where the transport reaches the pool.
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

    /// Whether a pool is staged under this policy, given whether the transport reaches its
    /// memory.
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

/// How a decode node wants its pool offered (its `kv_staging*` and `kv_shared_pool`).
#[derive(Debug, Clone, Copy)]
pub struct PoolOptions {
    pub staging: KvStaging,
    /// Bytes of staging blocks, when staged (at most the pool's size).
    pub staging_bytes: u64,
    /// Whether writers on this host may be offered the pool mapped into them.
    pub same_host: bool,
}

/// Memory granted to a transport's peers. Dropping it revokes the grant: nothing a peer
/// holds reaches that memory any more (on hardware that enforces keys; see the transport).
pub trait Grant: Send + Sync + std::fmt::Debug {
    /// What a session names to show it writes this grant's memory (`KvHeader.grant`).
    fn digest(&self) -> u64;
}

/// A reservation's blocks granted to writers.
#[derive(Debug)]
pub struct Granted {
    /// What the writer is handed (`KvTarget.remote`).
    pub descriptor: TransportDescriptor,
    /// Keeps the blocks writable by peers until dropped.
    pub grant: Box<dyn Grant>,
    /// Where the puts land when the pool is staged, to copy into the pool at the commit.
    /// Keep it until the writer's session has ended: its blocks are then reused.
    pub staged: Option<StagedBlocks>,
}

/// Why a reservation's blocks could not be granted to peers.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("{0}")]
    Failed(String),
    /// Every staging block is taken: this reservation's KV comes over a stream instead.
    #[error(transparent)]
    StagingFull(#[from] StagingFull),
}

/// A decode node's KV pool, offered to one transport's writers.
///
/// Peers then write into the pool while the engine thread owns it, as a NIC's DMA would. The
/// protocol confines those writes to a reservation's blocks between its session's accept and
/// commit, which the engine neither reads nor writes in that window (and the commit reaches
/// the engine thread through a channel, which orders the writes before any read).
pub trait PoolOffer: Send + Sync + std::fmt::Debug {
    /// The transport offering it (stats, spans, the descriptors' name).
    fn transport(&self) -> &'static str;
    /// How peers' puts reach the pool.
    fn path(&self) -> KvPath;
    /// The staging area, when the pool is staged.
    fn staging(&self) -> Option<&Arc<StagingArea>>;
    /// Grants the blocks of a reservation whose prompt occupies `pool_blocks`, in prompt
    /// order: the pool blocks themselves, or as many staging blocks (a staged pool reads
    /// only their count).
    fn grant(&self, pool_blocks: &[u32]) -> Result<Granted, GrantError>;
    /// What an accepted session tells a writer on this host beyond its grant (the pool
    /// mapped into it), when the pool is offered so (`KvAccepted.direct`).
    fn same_host(&self) -> Option<TransportDescriptor> {
        None
    }
}
