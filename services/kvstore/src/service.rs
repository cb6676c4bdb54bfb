//! The `pdmesh.v1.KvStore` service: validation, the store's decisions, and the bytes of the
//! pool. Writes arrive over gRPC. Reads go either way: a caller that can use UCX gets the
//! matched blocks' addresses in the pool (registered once with UCX) and reads them with
//! one-sided gets while the match's lease pins them; any other caller streams them with `Read`.
//!
//! With a disk tier (`disk`), every block stored is also written to disk; a match whose chain
//! goes on past what RAM holds reads the next blocks back from disk into RAM first (checked:
//! a torn file ends the match there), so the caller reads them as any other. A block counts
//! as held (for routers, stats and its digest) while either tier has it.

use pdmesh_common::ids::Capability;
use pdmesh_common::trace;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pdmesh_kv_transfer::check_layout;
use pdmesh_kv_transfer::{Fabric, Grant, ReadOffer};
use pdmesh_kv_types::{BlockHash, HostMemory, KvLayout};
use pdmesh_proto::v1::kv_store_server::KvStore;
use pdmesh_proto::v1::kv_write_chunk::Chunk;
use pdmesh_proto::v1::{
    KvMatchRequest, KvMatchResponse, KvReadRequest, KvReleaseMatchRequest, KvReleaseMatchResponse,
    KvStoreBlock, KvStoreStats, KvWriteChunk, KvWriteResponse, StatsRequest,
};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::error::StartError;
use crate::store::{PutSlot, Store, StoreStats};
use pdmesh_common::blocks::BlockLog;
use pdmesh_kv_transfer::disk::DiskTier;

/// Most hashes one Match may carry (a 128k-token prompt in 16-token blocks is 8,192).
pub const MAX_CHAIN: usize = 65_536;

#[derive(Debug)]
struct State {
    store: Store,
    pool: HostMemory,
    /// Remote read access to each lease's blocks, by lease key: dropped (revoked) with the
    /// lease.
    grants: HashMap<u64, Box<dyn Grant>>,
}

impl State {
    /// Ends expired leases, and with them their remote access.
    fn sweep(&mut self, now: Instant) {
        if self.store.sweep(now) > 0 {
            let store = &self.store;
            self.grants.retain(|k, _| store.has_lease(*k));
        }
    }
}

#[derive(Debug, Clone)]
pub struct KvStoreService {
    node_id: String,
    layout: KvLayout,
    block_bytes: usize,
    default_lease: Duration,
    max_lease: Duration,
    /// A one-sided transport, when the store offers reads by get: each match's blocks are
    /// registered for remote read under its lease alone.
    reads: Option<Arc<dyn ReadOffer>>,
    state: Arc<Mutex<State>>,
    /// The warm tier, when the store has one.
    disk: Option<Arc<DiskTier>>,
    /// The blocks it holds, as changes for the routers it reports to.
    log: Arc<BlockLog>,
}

impl KvStoreService {
    /// A store of `budget_bytes` for blocks of `layout`, its pool offered for reads through
    /// `fabric` when given. Fails when the layout is unusable or the pool cannot be allocated
    /// or offered.
    pub fn new(
        node_id: &str,
        layout: KvLayout,
        budget_bytes: usize,
        default_lease: Duration,
        max_lease: Duration,
        fabric: Option<&dyn Fabric>,
        disk: Option<DiskTier>,
    ) -> Result<Self, StartError> {
        layout.validate().map_err(StartError::Layout)?;
        let block_bytes = layout.bytes_per_block();
        let log = Arc::new(BlockLog::default());
        let mut store =
            Store::new(budget_bytes, block_bytes, layout.block_size()).with_log(Arc::clone(&log));
        if disk.is_some() {
            store = store.backed();
        }
        let len = store.capacity() * block_bytes;
        let pool = HostMemory::zeroed(len).map_err(StartError::Pool)?;
        let reads = match fabric {
            Some(f) if len > 0 => {
                Some(f.offer_reads(&pool.region(), block_bytes as u64).map_err(|e| {
                    StartError::Transport(format!("kv_transport = {}: {e}", f.name()))
                })?)
            }
            _ => None,
        };
        Ok(Self {
            node_id: node_id.to_string(),
            layout,
            block_bytes,
            default_lease,
            max_lease,
            reads,
            state: Arc::new(Mutex::new(State { store, pool, grants: HashMap::new() })),
            disk: disk.map(|d| {
                // What the last run left on disk is held from the start.
                log.record(d.hashes().into_iter().map(|h| h.0), []);
                Arc::new(d)
            }),
            log,
        })
    }

    /// Logs as gone the blocks that left one tier and are in no other.
    fn forget(&self, st: &State, left: Vec<BlockHash>) {
        let gone: Vec<u128> = left
            .into_iter()
            .filter(|h| {
                !st.store.is_ready(h) && !self.disk.as_ref().is_some_and(|d| d.contains(*h))
            })
            .map(|h| h.0)
            .collect();
        if !gone.is_empty() {
            self.log.record([], gone);
        }
    }

    /// Writes stored blocks through to the disk tier, off the async threads.
    async fn write_through(&self, blocks: Vec<(BlockHash, Bytes)>) {
        let Some(disk) = self.disk.clone() else { return };
        if blocks.is_empty() {
            return;
        }
        let evicted = tokio::task::spawn_blocking(move || {
            let mut evicted = Vec::new();
            for (h, data) in blocks {
                match disk.put(h, &data) {
                    Ok(e) => evicted.extend(e),
                    Err(e) => tracing::warn!(block = %h, "writing a KV block to disk: {e}"),
                }
            }
            evicted
        })
        .await
        .unwrap_or_default();
        let st = self.state();
        self.forget(&st, evicted);
    }

    /// Reads the blocks of `chain` that follow on from RAM's on disk back into RAM, in chain
    /// order, up to the first block neither tier has, a torn file, or as many as RAM has room
    /// for beside what is pinned. Returns the blocks it read.
    async fn promote(&self, chain: &[BlockHash]) -> Vec<BlockHash> {
        let Some(disk) = self.disk.clone() else { return Vec::new() };
        let wanted: Vec<BlockHash> = {
            let st = self.state();
            let s = st.store.stats();
            let mut room = (s.capacity_blocks.saturating_sub(s.pinned_blocks)) as usize;
            let mut wanted = Vec::new();
            for h in chain {
                if st.store.is_ready(h) {
                    room = room.saturating_sub(1);
                } else if disk.contains(*h) && wanted.len() < room {
                    wanted.push(*h);
                } else {
                    break;
                }
            }
            wanted
        };
        if wanted.is_empty() {
            return wanted;
        }
        let bytes = self.block_bytes;
        let read = tokio::task::spawn_blocking(move || {
            let mut read = Vec::new();
            for h in wanted {
                let mut buf = vec![0u8; bytes];
                match disk.read(h, &mut buf) {
                    Ok(()) => read.push((h, buf)),
                    Err(e) => {
                        tracing::warn!(block = %h, "reading a KV block from disk: {e}");
                        break;
                    }
                }
            }
            read
        })
        .await
        .unwrap_or_default();
        let mut st = self.state();
        // The chain's blocks in RAM are not what the room is made from.
        st.store.touch_ready(chain);
        let mut promoted = Vec::new();
        for (h, data) in read {
            match st.store.reserve_put(h) {
                PutSlot::Write(slot) => {
                    let at = slot as usize * self.block_bytes;
                    st.pool.bytes_mut()[at..at + self.block_bytes].copy_from_slice(&data);
                    st.store.commit_put(h);
                    promoted.push(h);
                }
                // Put by a writer meanwhile: in RAM already.
                PutSlot::Duplicate => {}
                PutSlot::Full => break,
            }
        }
        let evicted = st.store.take_evicted();
        self.forget(&st, evicted);
        promoted
    }

    /// What it holds, as numbered changes.
    pub fn block_log(&self) -> Arc<BlockLog> {
        Arc::clone(&self.log)
    }

    /// RAM's counters alone (what the node's load reports).
    pub fn ram_stats(&self) -> StoreStats {
        self.state().store.stats()
    }

    /// Both tiers' counters; `blocks`, `bytes` and `digest` are RAM's and the disk's together
    /// (a block in both counted once).
    pub fn store_stats(&self) -> StoreStats {
        let st = self.state();
        let mut s = st.store.stats();
        if let Some(d) = &self.disk {
            let ds = d.stats();
            let mut held: std::collections::HashSet<BlockHash> = st.store.ready().collect();
            held.extend(d.hashes());
            s.digest = pdmesh_kv_types::digest(held.iter().copied());
            s.disk = ds;
            s.held_blocks = held.len() as u64;
        } else {
            s.held_blocks = s.blocks;
        }
        s
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("store lock is never poisoned")
    }

    fn check(&self, theirs: Option<&pdmesh_proto::v1::KvLayout>, from: &str) -> Result<(), Status> {
        check_layout(&self.layout, theirs, from)
            .map_err(|s| Status::new(s.code(), format!("node {}: {}", self.node_id, s.message())))
    }

    fn invalid(&self, why: String) -> Status {
        Status::invalid_argument(format!("node {}: {why}", self.node_id))
    }

    /// A lease as `Match` handed it out (its form only; the store checks it is the lease's).
    fn parse_lease(&self, s: &str) -> Result<Capability, Status> {
        Capability::parse(s)
            .ok_or_else(|| self.invalid("lease must be the 32 hex digits Match returned".into()))
    }
}

type BlockStream = Pin<Box<dyn Stream<Item = Result<KvStoreBlock, Status>> + Send>>;

#[tonic::async_trait]
impl KvStore for KvStoreService {
    async fn r#match(
        &self,
        req: Request<KvMatchRequest>,
    ) -> Result<Response<KvMatchResponse>, Status> {
        let r = req.into_inner();
        self.check(r.layout.as_ref(), "the caller")?;
        if r.hashes.len() > MAX_CHAIN {
            return Err(
                self.invalid(format!("hashes: {} blocks, at most {MAX_CHAIN}", r.hashes.len()))
            );
        }
        let chain = r
            .hashes
            .iter()
            .enumerate()
            .map(|(i, b)| {
                BlockHash::from_bytes(b).ok_or_else(|| {
                    self.invalid(format!("hashes[{i}]: {} bytes, a block hash is 16", b.len()))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A hash names its block's whole history, so a real chain never repeats one; a repeat
        // would only pin one block many times over.
        let mut seen = HashMap::with_capacity(chain.len());
        for (i, h) in chain.iter().enumerate() {
            if let Some(j) = seen.insert(*h, i) {
                return Err(self.invalid(format!("hashes[{i}] repeats hashes[{j}]: not a chain")));
            }
        }
        let lease = match r.lease_ms {
            0 => self.default_lease,
            ms => Duration::from_millis(u64::from(ms)).min(self.max_lease),
        };
        let promoted = self.promote(&chain).await;
        let now = Instant::now();
        let mut st = self.state();
        st.sweep(now);
        let m = st.store.match_prefix(&chain, lease, now);
        // The matched blocks that came from disk for this match: its disk tier hits.
        let from_disk = m.blocks.iter().filter(|(h, _)| promoted.contains(h)).count() as u32;
        st.store.count_disk_hits(u64::from(from_disk));
        let reads = self.reads.as_ref().filter(|o| r.transports.iter().any(|t| t == o.transport()));
        let remote = match (reads, m.lease) {
            (Some(o), Some(lease)) => {
                let slots: Vec<u32> = m.blocks.iter().map(|&(_, slot)| slot).collect();
                match o.grant(&slots) {
                    Ok((descriptor, grant)) => {
                        st.grants.insert(lease.key(), grant);
                        Some(descriptor)
                    }
                    Err(e) => {
                        // The caller reads over gRPC instead.
                        tracing::warn!("cannot grant {} reads of a match: {e}", o.transport());
                        None
                    }
                }
            }
            _ => None,
        };
        drop(st);
        let span = tracing::Span::current();
        trace::attr(&span, "chain_blocks", chain.len() as i64);
        trace::attr(&span, "matched_blocks", m.blocks.len() as i64);
        trace::attr(&span, "disk_blocks", i64::from(from_disk));
        trace::attr(
            &span,
            "remote",
            remote.as_ref().map_or(String::new(), |d| d.transport.clone()),
        );
        Ok(Response::new(KvMatchResponse {
            lease: m.lease.map(|c| c.to_string()).unwrap_or_default(),
            blocks: m.blocks.len() as u32,
            remote,
            disk_blocks: from_disk,
        }))
    }

    async fn release_match(
        &self,
        req: Request<KvReleaseMatchRequest>,
    ) -> Result<Response<KvReleaseMatchResponse>, Status> {
        let lease = self.parse_lease(&req.into_inner().lease)?;
        let mut st = self.state();
        let released = st.store.release(lease);
        if released {
            st.grants.remove(&lease.key());
        }
        Ok(Response::new(KvReleaseMatchResponse { released }))
    }

    type ReadStream = BlockStream;

    async fn read(&self, req: Request<KvReadRequest>) -> Result<Response<BlockStream>, Status> {
        let lease = self.parse_lease(&req.into_inner().lease)?;
        let blocks = {
            let mut st = self.state();
            st.sweep(Instant::now());
            st.store.lease_blocks(lease)
        }
        .ok_or_else(|| {
            Status::not_found(format!(
                "node {}: the lease is unknown (released or expired)",
                self.node_id
            ))
        })?;
        // The lease pins the blocks, so their slots hold them while it lasts; each is copied
        // out under the lock as the stream is read, and only while the lease still holds (a
        // lease released or expired mid-read could see its slots reused by other blocks).
        let this = self.clone();
        let stream = tokio_stream::iter(blocks).map(move |(h, slot)| {
            let st = this.state();
            if !st.store.holds(lease) {
                return Err(Status::aborted(format!(
                    "node {}: the lease ended during the read",
                    this.node_id
                )));
            }
            let at = slot as usize * this.block_bytes;
            let data = Bytes::copy_from_slice(&st.pool.bytes()[at..at + this.block_bytes]);
            Ok(KvStoreBlock { hash: Bytes::copy_from_slice(&h.to_bytes()), data })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn write(
        &self,
        req: Request<Streaming<KvWriteChunk>>,
    ) -> Result<Response<KvWriteResponse>, Status> {
        // Who writes is who its certificate says (authz let only prefill nodes in), not the
        // name it gives itself.
        let certified = pdmesh_common::authz::caller(&req).map(|p| p.name.clone());
        let mut s = req.into_inner();
        let from = match s.message().await? {
            Some(KvWriteChunk { chunk: Some(Chunk::Header(h)) }) => {
                let given = if h.from.is_empty() { "a writer".to_string() } else { h.from };
                let from = certified.unwrap_or(given);
                self.check(h.layout.as_ref(), &from)?;
                from
            }
            _ => return Err(self.invalid("a write starts with a header".into())),
        };
        let mut out = KvWriteResponse::default();
        let mut n = 0usize;
        let mut stored = Vec::new();
        let mut written = std::collections::HashSet::new();
        while let Some(chunk) = s.message().await? {
            let Some(Chunk::Block(b)) = chunk.chunk else {
                return Err(self.invalid(format!("message {} of the write is not a block", n + 1)));
            };
            let h = BlockHash::from_bytes(&b.hash).ok_or_else(|| {
                self.invalid(format!(
                    "block {n}: hash of {} bytes, a block hash is 16",
                    b.hash.len()
                ))
            })?;
            if n >= MAX_CHAIN {
                return Err(self.invalid(format!("a write of more than {MAX_CHAIN} blocks")));
            }
            if !written.insert(h) {
                return Err(self.invalid(format!("block {n}: {h} is written twice: not a chain")));
            }
            if b.data.len() != self.block_bytes {
                return Err(self.invalid(format!(
                    "block {n}: {} bytes, a block of this layout is {}",
                    b.data.len(),
                    self.block_bytes
                )));
            }
            let mut st = self.state();
            match st.store.reserve_put(h) {
                PutSlot::Write(slot) => {
                    let at = slot as usize * self.block_bytes;
                    st.pool.bytes_mut()[at..at + self.block_bytes].copy_from_slice(&b.data);
                    st.store.commit_put(h);
                    out.stored += 1;
                    stored.push((h, b.data));
                }
                PutSlot::Duplicate => out.duplicates += 1,
                PutSlot::Full => out.full += 1,
            }
            let evicted = st.store.take_evicted();
            self.forget(&st, evicted);
            drop(st);
            n += 1;
        }
        self.write_through(stored).await;
        let span = tracing::Span::current();
        trace::attr(&span, "from", from.clone());
        trace::attr(&span, "stored", i64::from(out.stored));
        trace::attr(&span, "duplicates", i64::from(out.duplicates));
        trace::attr(&span, "full", i64::from(out.full));
        tracing::debug!(
            from,
            stored = out.stored,
            duplicates = out.duplicates,
            full = out.full,
            "write"
        );
        Ok(Response::new(out))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<KvStoreStats>, Status> {
        let s = self.store_stats();
        Ok(Response::new(KvStoreStats {
            layout: Some(self.layout.into()),
            blocks: s.blocks,
            bytes: s.bytes,
            capacity_blocks: s.capacity_blocks,
            hit_tokens: s.hit_tokens,
            miss_tokens: s.miss_tokens,
            evictions: s.evictions,
            dedup: s.dedup,
            pinned_blocks: s.pinned_blocks,
            leases: s.leases,
            leases_expired: s.leases_expired,
            digest: s.digest,
            disk_blocks: s.disk.blocks,
            disk_bytes: s.disk.bytes,
            disk_capacity_blocks: s.disk.capacity_blocks,
            disk_hit_tokens: s.disk_hit_tokens,
            disk_evictions: s.disk.evictions,
            disk_corrupt: s.disk.corrupt,
            disk_recovered: s.disk.recovered,
            held_blocks: s.held_blocks,
        }))
    }
}

#[cfg(test)]
mod tests {
    use pdmesh_kv_types::{KvDtype, KvGeometry};
    use pdmesh_proto::v1::KvMatchRequest;
    use tokio_stream::StreamExt;

    use super::*;

    fn service() -> (KvStoreService, KvLayout) {
        let layout = KvLayout {
            model_fingerprint: 7,
            geometry: KvGeometry {
                dtype: KvDtype::F16,
                block_size: 4,
                layers: 2,
                kv_heads: 1,
                head_dim: 8,
            },
            window: None,
        };
        let s = KvStoreService::new(
            "store",
            layout,
            1 << 20,
            Duration::from_secs(5),
            Duration::from_secs(60),
            None,
            None,
        )
        .unwrap();
        (s, layout)
    }

    fn hashes(h: &[BlockHash]) -> Vec<Bytes> {
        h.iter().map(|h| Bytes::copy_from_slice(&h.to_bytes())).collect()
    }

    /// A read copies a block only while its lease still pins it: once the lease is released,
    /// the rest of the stream ends ABORTED instead of returning whatever reused the slots.
    #[tokio::test]
    async fn a_read_stops_when_its_lease_ends() {
        let (s, layout) = service();
        let chain: Vec<BlockHash> = (1..=3u128).map(BlockHash).collect();
        {
            let mut st = s.state();
            for h in &chain {
                let PutSlot::Write(_) = st.store.reserve_put(*h) else { panic!("no slot") };
                st.store.commit_put(*h);
            }
        }
        let m = KvMatchRequest {
            layout: Some(layout.into()),
            hashes: hashes(&chain),
            lease_ms: 60_000,
            transports: Vec::new(),
        };
        let lease = s.r#match(Request::new(m)).await.unwrap().into_inner().lease;
        let read = KvReadRequest { lease: lease.clone() };
        let mut stream = s.read(Request::new(read)).await.unwrap().into_inner();
        assert!(stream.next().await.unwrap().is_ok());
        let r = s.release_match(Request::new(KvReleaseMatchRequest { lease })).await.unwrap();
        assert!(r.into_inner().released);
        let e = stream.next().await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
    }

    /// A chain never repeats a hash; a match that does would pin one block once per copy.
    #[tokio::test]
    async fn a_match_that_repeats_a_hash_is_refused() {
        let (s, layout) = service();
        let h = BlockHash(9);
        let m = KvMatchRequest {
            layout: Some(layout.into()),
            hashes: hashes(&[h, BlockHash(10), h]),
            lease_ms: 0,
            transports: Vec::new(),
        };
        let e = s.r#match(Request::new(m)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("hashes[2] repeats hashes[0]"), "{e:?}");
    }
}
