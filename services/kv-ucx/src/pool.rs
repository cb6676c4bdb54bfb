//! The decode node's side of UCX: the KV pool peers may write into, and the target each
//! reservation hands out — its prompt's blocks registered for remote write alone, under keys
//! of their own, revoked when the reservation's KV is complete (`scope`).
//!
//! Peers put into the pool itself where UCX reaches its memory (host memory; a GPU's where
//! UCX has a CUDA transport). Else they put into host staging blocks (kv-transfer's
//! `staging`), which the node copies into the pool at the commit.
//!
//! On one host a put still crosses a transport (TCP, or shared memory through a bounce
//! buffer). So the pool — or its staging area — can live in shared memory that UCX allocates;
//! a writer on the same host maps it once and copies each block in with one memcpy. The
//! trade: such a writer could reach every block of it, not only its reservation's. It is an
//! authenticated prefill or decode node on this host, where processes of one user can already
//! reach each other's memory through the kernel (CMA, which UCX itself uses); it keeps to its
//! target's blocks as a remote writer does, and `--kv-shared-pool false` turns the offer off.

use std::sync::Arc;

use pdmesh_kv_transfer::{
    Grant, GrantError, Granted, KvPath, KvStaging, PoolOffer, PoolOptions, StagingArea,
};
use pdmesh_kv_types::{HostMemory, KvGeometry, KvPool, MemoryRegion};
use pdmesh_proto::v1::TransportDescriptor;

use crate::descriptor::{self, UcxRange, UcxShared, UcxTarget};
use crate::same_host::SharedOffer;
use crate::scope::{self, Registered};
use crate::ucx::{Access, UcxError, UcxNode};

/// A KV pool peers may be granted access to.
#[derive(Debug, Clone)]
pub struct UcxPool {
    /// Keeps the worker (and its progress thread, which serves incoming puts) alive.
    node: UcxNode,
    /// What peers put into: the pool, or its staging area.
    memory: MemoryRegion,
    bytes_per_block: u64,
    /// Blocks of the engine's pool.
    blocks: u32,
    /// The shared pool's offer (its key file lives as long as it), and the descriptor a
    /// writer on this host is handed, made once.
    shared: Option<(SharedOffer, TransportDescriptor)>,
    staging: Option<Arc<StagingArea>>,
    path: KvPath,
}

/// Offers a node's KV pool to UCX writers: the pool itself, or host staging blocks in
/// front of it, as `options.staging` and what UCX reaches decide; in shared memory for
/// writers on this host when `options.same_host` and UCX can allocate it.
pub fn offer(
    node: &UcxNode,
    kv: &mut dyn KvPool,
    options: &PoolOptions,
) -> Result<UcxPool, String> {
    let memory = kv.kv_memory();
    if !kv.kv_blocks_whole() {
        // Its blocks' layers are apart in the pool: only the engine can put a block there.
        if options.staging == KvStaging::Direct {
            return Err("this KV pool keeps its sliding-window layers' blocks apart: UCX writers \
                        reach it only through staging (--kv-staging auto or staged)"
                .into());
        }
        return stage_pool(node, kv, options);
    }
    if options.staging.stages(node.reaches(memory.kind())) {
        return stage_pool(node, kv, options);
    }
    let shared = if options.same_host { share_pool(node, kv) } else { None };
    // Moved into shared memory, or not: the region names where it is now.
    let memory = kv.kv_memory();
    let pool = register_kv_pool(node, &memory, &kv.kv_geometry()).map_err(|e| e.to_string())?;
    Ok(shared.into_iter().fold(pool, UcxPool::with_shared))
}

/// Moves the KV pool into UCX-allocated shared memory for writers on this host; without
/// it (UCX cannot allocate shared memory here) the pool stays where it is, reached by puts.
fn share_pool(node: &UcxNode, kv: &mut dyn KvPool) -> Option<UcxRange> {
    let moved = allocate_shared(node, kv.kv_bytes())
        .and_then(|(memory, range)| kv.rehome_kv(memory).map(|()| range));
    match moved {
        Ok(s) => {
            tracing::info!(bytes = s.len, "KV pool in shared memory for writers on this host");
            Some(s)
        }
        Err(e) => {
            tracing::warn!("KV pool not in shared memory, writers on this host put KV: {e}");
            None
        }
    }
}

/// The staging area in front of the pool: `staging_bytes` (at most the pool's size) of
/// shared memory for writers on this host when allowed and UCX can allocate it, else of the
/// memory the engine copies from fastest (page-locked for a GPU).
fn stage_pool(node: &UcxNode, kv: &dyn KvPool, options: &PoolOptions) -> Result<UcxPool, String> {
    let geometry = kv.kv_geometry();
    let bpb = geometry.bytes_per_block();
    let want = usize::try_from(options.staging_bytes).unwrap_or(usize::MAX);
    let len = want.min(kv.kv_bytes()) / bpb * bpb;
    if len == 0 {
        return Err(format!(
            "{} bytes of KV staging hold no KV block of {bpb} bytes",
            options.staging_bytes
        ));
    }
    let shared = if options.same_host {
        match allocate_shared(node, len) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!("KV staging not in shared memory, writers on this host put: {e}");
                None
            }
        }
    } else {
        None
    };
    let (memory, range) = match shared {
        // Page-locked like `kv_staging_memory`'s where the pool is a GPU's, so the copy at
        // the commit is a DMA rather than a pass through the driver's bounce buffers.
        Some((m, r)) => match kv.kv_pin(m) {
            Ok(m) => (m, Some(r)),
            Err((m, e)) => {
                tracing::warn!(
                    "KV staging in shared memory is not page-locked, copies are slower: {e}"
                );
                (m, Some(r))
            }
        },
        None => (kv.kv_staging_memory(len)?, None),
    };
    let area = StagingArea::new(memory, bpb)?;
    let blocks = area.blocks();
    let pool = stage_kv_pool(node, area, &kv.kv_memory(), &geometry).map_err(|e| e.to_string())?;
    tracing::info!(
        blocks,
        bytes = len,
        shared = range.is_some(),
        pool = kv.kv_memory().kind().name(),
        "KV staged: writers put into host staging blocks, copied into the pool at each commit"
    );
    Ok(range.into_iter().fold(pool, UcxPool::with_shared))
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
/// Rust's memory model does not describe memory written by another process; peers writing
/// into the pool while the engine owns it is that trade (see `PoolOffer`).
pub fn register_kv_pool(
    node: &UcxNode,
    memory: &MemoryRegion,
    geometry: &KvGeometry,
) -> Result<UcxPool, UcxError> {
    let bytes_per_block = geometry.bytes_per_block() as u64;
    if memory.is_empty() || bytes_per_block == 0 {
        return Err(UcxError::Usage("the KV pool is empty".into()));
    }
    probe(node, memory, bytes_per_block)?;
    Ok(UcxPool {
        node: node.clone(),
        memory: memory.clone(),
        bytes_per_block,
        blocks: (memory.len() as u64 / bytes_per_block) as u32,
        shared: None,
        staging: None,
        path: KvPath::Direct(memory.kind()),
    })
}

/// The KV pool `pool` (blocks of `geometry`), reached by peers through the host staging
/// blocks of `area`.
pub fn stage_kv_pool(
    node: &UcxNode,
    area: Arc<StagingArea>,
    pool: &MemoryRegion,
    geometry: &KvGeometry,
) -> Result<UcxPool, UcxError> {
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
    Ok(UcxPool {
        node: node.clone(),
        memory,
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

/// A target's ranges kept registered; dropping it revokes them.
#[derive(Debug)]
pub struct UcxGrant {
    _registered: Registered,
    digest: u64,
}

impl UcxGrant {
    /// `blocks` of `memory` granted for `access`, and what the peer is handed.
    pub fn new(
        node: &UcxNode,
        memory: &MemoryRegion,
        blocks: &[u32],
        bytes_per_block: u64,
        access: Access,
    ) -> Result<(UcxTarget, Self), UcxError> {
        let (ranges, block_addrs, registered) =
            scope::grant(node, memory, blocks, bytes_per_block, access)?;
        let digest = scope::digest(&ranges);
        let target = UcxTarget { worker_address: node.address().clone(), block_addrs, ranges };
        Ok((target, Self { _registered: registered, digest }))
    }
}

impl Grant for UcxGrant {
    fn digest(&self) -> u64 {
        self.digest
    }
}

impl UcxPool {
    /// The pool as `allocate_shared` placed it: offered to writers on this host that prove it
    /// (`same_host`). Without a secret to seal its key under, it is offered to none.
    pub fn with_shared(mut self, shared: UcxRange) -> Self {
        match SharedOffer::new(shared) {
            Ok(o) => {
                let (range, key_file) = o.offer();
                let d = descriptor::wrap(&UcxShared { range: Some(range), key_file });
                self.shared = Some((o, d));
            }
            Err(e) => tracing::warn!("KV pool not offered in shared memory, writers put: {e}"),
        }
        self
    }
}

impl PoolOffer for UcxPool {
    fn transport(&self) -> &'static str {
        descriptor::NAME
    }

    fn path(&self) -> KvPath {
        self.path
    }

    fn staging(&self) -> Option<&Arc<StagingArea>> {
        self.staging.as_ref()
    }

    /// The grant keeps the blocks the descriptor names (only) writable by peers until
    /// dropped: the pool blocks themselves, or as many staging blocks.
    fn grant(&self, pool_blocks: &[u32]) -> Result<Granted, GrantError> {
        let staged = match &self.staging {
            Some(area) => Some(area.take(pool_blocks.len())?),
            None => {
                if let Some(b) = pool_blocks.iter().find(|&&b| b >= self.blocks) {
                    return Err(GrantError::Failed(format!(
                        "block {b} is past the pool's {}",
                        self.blocks
                    )));
                }
                None
            }
        };
        let blocks = staged.as_ref().map_or(pool_blocks, |s| s.blocks());
        let (target, grant) = UcxGrant::new(
            &self.node,
            &self.memory,
            blocks,
            self.bytes_per_block,
            Access::RemoteWrite,
        )
        .map_err(|e| GrantError::Failed(e.to_string()))?;
        Ok(Granted { descriptor: descriptor::wrap(&target), grant: Box::new(grant), staged })
    }

    fn same_host(&self) -> Option<TransportDescriptor> {
        self.shared.as_ref().map(|(_, d)| d.clone())
    }
}
