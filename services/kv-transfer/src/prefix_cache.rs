//! The prefill node's prefix cache, in two tiers. Its own LRU of recently computed or fetched
//! blocks is looked up first (no network), then its disk tier when it has one (every block
//! of its own is written through to it, so a restarted or replacement node resumes with its
//! prefixes); the KV-store is asked only for the blocks after what the node holds. The store's blocks are read with one-sided gets (UCX) from its
//! registered pool when both sides run the same such transport (the match pins them while
//! they are read), else streamed over gRPC; a failed get falls back to the stream. After a prompt is computed, its new full
//! blocks go into the node's tier at once and to the KV-store in the background. Every
//! failure of the KV-store (down, slow, refusing) only costs the cache: the prompt is then
//! computed in full, a slower request and never a failed one.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use lru::LruCache;
use pdmesh_common::trace::Channel;
use pdmesh_kv_types::{BlockHash, BlockHasher, KvLayout};

use pdmesh_common::blocks::BlockLog;
use pdmesh_common::channels::ChannelCache;

use crate::disk::DiskTier;
use crate::transport::RemoteReader;
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::kv_write_chunk::Chunk;
use pdmesh_proto::v1::{
    KvMatchRequest, KvReadRequest, KvReleaseMatchRequest, KvStoreBlock, KvWriteChunk,
    KvWriteHeader, PrefixCacheStats,
};
use tokio::sync::Semaphore;
use tracing::field::Empty;
use tracing::{Instrument, Span};

/// Why a prefix cache cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("the KV layout has no block size")]
    NoBlockSize,
    #[error("kvstore address {address:?}: {source}")]
    Address { address: String, source: tonic::transport::Error },
}

/// What a lookup found: the prompt's chain (full blocks) and the cached prefix's bytes.
#[derive(Debug, Default)]
pub struct Lookup {
    pub chain: Vec<BlockHash>,
    pub cached: Vec<Bytes>,
    /// Where the cached blocks came from, in tokens.
    pub tiers: pdmesh_proto::v1::CachedTokens,
}

/// The node's own tier: at most the LRU's capacity in blocks, least recently used evicted first. The
/// bytes are shared (`Bytes`), so a block being read by a job outlives its eviction. Every
/// block stored or evicted is told to `log` under the LRU's lock, for the routers' indexes.
/// With a disk tier, every block stored is written through to it, and a block counts as held
/// (for the log and the digest) while RAM or disk has it.
#[derive(Debug)]
struct Local {
    blocks: Arc<Mutex<LruCache<BlockHash, Bytes>>>,
    log: Arc<BlockLog>,
    disk: Option<Arc<DiskTier>>,
}

impl Local {
    fn new(capacity: NonZeroUsize, disk: Option<DiskTier>) -> Self {
        let log = Arc::new(BlockLog::default());
        if let Some(d) = &disk {
            // What the last run wrote is held from the start.
            log.record(d.hashes().into_iter().map(|h| h.0), []);
        }
        let blocks = Arc::new(Mutex::new(LruCache::new(capacity)));
        Self { blocks, log, disk: disk.map(Arc::new) }
    }

    /// The longest run of `chain`'s blocks held in RAM, from its start.
    fn prefix(&self, chain: &[BlockHash]) -> Vec<Bytes> {
        let mut l = self.blocks.lock().expect("never poisoned");
        chain.iter().map_while(|h| l.get(h).cloned()).collect()
    }

    /// The longest run of `chain`'s blocks on disk, from its start (up to a missing or torn
    /// one), read off the async threads; they are kept in RAM too.
    async fn disk_prefix(&self, chain: &[BlockHash], block_bytes: usize) -> Vec<Bytes> {
        let Some(disk) = self.disk.clone() else { return Vec::new() };
        if chain.is_empty() || !disk.contains(chain[0]) {
            return Vec::new();
        }
        let wanted = chain.to_vec();
        let read = tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            for h in wanted {
                let mut buf = vec![0u8; block_bytes];
                match disk.read(h, &mut buf) {
                    Ok(()) => out.push(Bytes::from(buf)),
                    Err(crate::disk::ReadError::Absent) => break,
                    Err(e) => {
                        tracing::warn!(block = %h, "reading a cached KV block from disk: {e}");
                        break;
                    }
                }
            }
            out
        })
        .await
        .unwrap_or_default();
        self.remember(&chain[..read.len()], &read);
        read
    }

    /// Blocks that left one tier: logged as gone unless the other still has them.
    fn forget(&self, l: &LruCache<BlockHash, Bytes>, left: Vec<BlockHash>) {
        let gone: Vec<u128> = left
            .into_iter()
            .filter(|h| !l.contains(h) && !self.disk.as_ref().is_some_and(|d| d.contains(*h)))
            .map(|h| h.0)
            .collect();
        if !gone.is_empty() {
            self.log.record([], gone);
        }
    }

    /// Keeps blocks in RAM (and logs them held).
    fn remember(&self, hashes: &[BlockHash], blocks: &[Bytes]) {
        let mut l = self.blocks.lock().expect("never poisoned");
        let mut evicted = Vec::new();
        for (h, b) in hashes.iter().zip(blocks) {
            // `push` hands back the evicted entry, or this one's old value when it was held.
            if let Some((old, _)) = l.push(*h, b.clone())
                && old != *h
            {
                evicted.push(old);
            }
        }
        let stored: Vec<u128> = hashes.iter().take(blocks.len()).map(|h| h.0).collect();
        self.log.record(stored, []);
        // A block evicted and stored again within this call is held: the log ends where the
        // tiers do.
        self.forget(&l, evicted);
    }

    /// Keeps blocks in RAM and writes them through to disk in the background.
    fn insert(&self, hashes: &[BlockHash], blocks: &[Bytes]) {
        self.remember(hashes, blocks);
        let Some(disk) = self.disk.clone() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let todo: Vec<(BlockHash, Bytes)> =
            hashes.iter().copied().zip(blocks.iter().cloned()).collect();
        let (ram, log) = (Arc::clone(&self.blocks), Arc::clone(&self.log));
        rt.spawn_blocking(move || {
            let mut evicted = Vec::new();
            for (h, data) in todo {
                match disk.put(h, &data) {
                    Ok(e) => evicted.extend(e),
                    Err(e) => tracing::warn!(block = %h, "writing a cached KV block to disk: {e}"),
                }
            }
            // A block the disk let go of is gone unless RAM has it.
            let l = ram.lock().expect("never poisoned");
            let gone: Vec<u128> =
                evicted.into_iter().filter(|h| !l.contains(h)).map(|h| h.0).collect();
            if !gone.is_empty() {
                log.record([], gone);
            }
        });
    }

    fn len(&self) -> usize {
        self.blocks.lock().expect("never poisoned").len()
    }

    fn digest(&self) -> u64 {
        let l = self.blocks.lock().expect("never poisoned");
        let mut held: std::collections::HashSet<BlockHash> = l.iter().map(|(h, _)| *h).collect();
        if let Some(d) = &self.disk {
            held.extend(d.hashes());
        }
        pdmesh_kv_types::digest(held)
    }
}

#[derive(Debug, Clone)]
struct Store {
    address: String,
    /// The one channel, redialled after a certificate reload.
    channel: Arc<ChannelCache<KvStoreClient<Channel>>>,
    /// Longest a lookup (match + read) may take before the prompt is computed in full.
    timeout: Duration,
    /// Publishes in flight: each holds its blocks' bytes until the store answers, so a store
    /// that hangs must not make every prompt add one more.
    publishing: Arc<Semaphore>,
}

impl Store {
    fn dial(
        address: &str,
        timeout: Duration,
    ) -> Result<KvStoreClient<Channel>, tonic::transport::Error> {
        let ep = pdmesh_common::tls::endpoint(address, pdmesh_common::tls::MeshRole::KvStore)?
            .connect_timeout(timeout)
            .tcp_nodelay(true);
        Ok(KvStoreClient::new(pdmesh_common::trace::channel(ep.connect_lazy()))
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20))
    }

    /// The store's client (redialled once this process's certificates were renewed).
    fn client(&self) -> Result<KvStoreClient<Channel>, tonic::Status> {
        self.channel
            .get(&self.address, || Self::dial(&self.address, self.timeout))
            .map_err(|e| tonic::Status::unavailable(format!("KV-store at {}: {e}", self.address)))
    }
}

/// Publishes to the KV-store in flight at once; past it, blocks are not published (the cache
/// is an optimisation: the next prompt with this prefix publishes them).
const MAX_PUBLISHING: usize = 16;

#[derive(Debug, Default)]
struct Counters {
    local_hit_tokens: AtomicU64,
    /// Of `local_hit_tokens`, those read back from the node's disk tier.
    local_disk_hit_tokens: AtomicU64,
    store_hit_tokens: AtomicU64,
    /// Of `store_hit_tokens`, those the KV-store read back from its disk tier.
    store_disk_hit_tokens: AtomicU64,
    miss_tokens: AtomicU64,
    store_failures: AtomicU64,
    remote_blocks: AtomicU64,
    grpc_blocks: AtomicU64,
    remote_fallbacks: AtomicU64,
}

#[derive(Debug)]
pub struct PrefixCache {
    hasher: BlockHasher,
    layout: KvLayout,
    bytes_per_block: usize,
    node_id: String,
    local: Option<Local>,
    store: Option<Store>,
    /// Reads the KV-store's pool, when this node runs a one-sided transport.
    remote: Option<Arc<dyn RemoteReader>>,
    counters: Counters,
}

impl PrefixCache {
    /// A cache holding up to `local_bytes` of blocks itself and backed by the KV-store at
    /// `store` (dialled lazily), read through `remote` when given and the store offers it. None when both tiers
    /// are off.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layout: KvLayout,
        node_id: &str,
        local_bytes: u64,
        disk: Option<DiskTier>,
        store: Option<&str>,
        timeout: Duration,
        remote: Option<Arc<dyn RemoteReader>>,
    ) -> Result<Option<Self>, CacheError> {
        let hasher = BlockHasher::new(&layout).ok_or(CacheError::NoBlockSize)?;
        let bytes_per_block = layout.bytes_per_block();
        let local = usize::try_from(local_bytes / bytes_per_block as u64)
            .ok()
            .and_then(NonZeroUsize::new)
            .map(|n| Local::new(n, disk));
        let store = match store {
            Some(address) => {
                let channel = Arc::new(ChannelCache::new(1));
                channel
                    .get(address, || Store::dial(address, timeout))
                    .map_err(|source| CacheError::Address { address: address.into(), source })?;
                Some(Store {
                    address: address.to_string(),
                    channel,
                    timeout,
                    publishing: Arc::new(Semaphore::new(MAX_PUBLISHING)),
                })
            }
            None => None,
        };
        if local.is_none() && store.is_none() {
            return Ok(None);
        }
        Ok(Some(Self {
            hasher,
            layout,
            bytes_per_block,
            node_id: node_id.to_string(),
            local,
            store,
            remote,
            counters: Counters::default(),
        }))
    }

    /// The changes to the node's own tier, for its routers (None: it has no tier of its own).
    pub fn block_log(&self) -> Option<Arc<BlockLog>> {
        self.local.as_ref().map(|l| Arc::clone(&l.log))
    }

    /// Blocks the node's own tier holds at most (0: it has none).
    pub fn local_capacity(&self) -> usize {
        self.local.as_ref().map_or(0, |l| l.blocks.lock().expect("never poisoned").cap().get())
    }

    pub fn stats(&self) -> PrefixCacheStats {
        let c = &self.counters;
        let local_blocks = self.local.as_ref().map_or(0, Local::len) as u64;
        let disk = self.local.as_ref().and_then(|l| l.disk.as_ref()).map(|d| d.stats());
        let disk = disk.unwrap_or_default();
        PrefixCacheStats {
            local_hit_tokens: c.local_hit_tokens.load(Relaxed),
            local_disk_hit_tokens: c.local_disk_hit_tokens.load(Relaxed),
            disk_blocks: disk.blocks,
            disk_bytes: disk.bytes,
            disk_corrupt: disk.corrupt,
            disk_recovered: disk.recovered,
            store_hit_tokens: c.store_hit_tokens.load(Relaxed),
            store_disk_hit_tokens: c.store_disk_hit_tokens.load(Relaxed),
            miss_tokens: c.miss_tokens.load(Relaxed),
            local_blocks,
            local_bytes: local_blocks * self.bytes_per_block as u64,
            store_failures: c.store_failures.load(Relaxed),
            remote_blocks: c.remote_blocks.load(Relaxed),
            grpc_blocks: c.grpc_blocks.load(Relaxed),
            remote_fallbacks: c.remote_fallbacks.load(Relaxed),
            local_digest: self.local.as_ref().map_or(0, Local::digest),
        }
    }

    /// The cached prefix of `prompt` in the cache space `salt` (its tenant's group), leaving
    /// at least its last token to compute (the first token's logits come from it). Never
    /// fails: trouble means less cache.
    pub async fn lookup(&self, prompt: &[u32], salt: &[u8]) -> Lookup {
        let span = tracing::info_span!(
            "prefill.cache_match",
            prompt_blocks = Empty,
            own_blocks = Empty,
            own_disk_blocks = Empty,
            kvstore_disk_blocks = Empty,
            kvstore_blocks = Empty,
            kvstore_transport = Empty,
            kvstore_failed = Empty,
            cached_tokens = Empty,
        );
        self.lookup_traced(prompt, salt).instrument(span).await
    }

    async fn lookup_traced(&self, prompt: &[u32], salt: &[u8]) -> Lookup {
        let span = Span::current();
        let chain = self.hasher.salted(salt).chain(prompt);
        let bs = self.hasher.block_size();
        let usable = (prompt.len().saturating_sub(1) / bs).min(chain.len());
        let mut cached = self.local.as_ref().map_or_else(Vec::new, |l| l.prefix(&chain[..usable]));
        let ram = cached.len();
        if let Some(l) = &self.local {
            cached.extend(l.disk_prefix(&chain[ram..usable], self.bytes_per_block).await);
        }
        let local = cached.len();
        let mut store_disk = 0;
        if let Some(store) = &self.store
            && local < usable
        {
            // Hashes name their whole history, so asking for the chain past what is held here
            // finds exactly the blocks that continue it.
            let rest = &chain[local..usable];
            match tokio::time::timeout(store.timeout, self.read(store, rest)).await {
                Ok(Ok((more, from_disk))) => {
                    if let Some(l) = &self.local {
                        l.insert(&chain[local..local + more.len()], &more);
                    }
                    store_disk = from_disk.min(more.len());
                    cached.extend(more);
                }
                Ok(Err(e)) => {
                    self.counters.store_failures.fetch_add(1, Relaxed);
                    span.record("kvstore_failed", true);
                    tracing::warn!("KV-store unavailable, computing the rest of the prompt: {e}");
                }
                Err(_) => {
                    self.counters.store_failures.fetch_add(1, Relaxed);
                    span.record("kvstore_failed", true);
                    tracing::warn!(
                        "KV-store slower than {:?}, computing the rest of the prompt",
                        store.timeout
                    );
                }
            }
        }
        let c = &self.counters;
        c.local_hit_tokens.fetch_add((local * bs) as u64, Relaxed);
        c.local_disk_hit_tokens.fetch_add(((local - ram) * bs) as u64, Relaxed);
        c.store_disk_hit_tokens.fetch_add((store_disk * bs) as u64, Relaxed);
        c.store_hit_tokens.fetch_add(((cached.len() - local) * bs) as u64, Relaxed);
        c.miss_tokens.fetch_add((prompt.len() - 1 - cached.len() * bs) as u64, Relaxed);
        span.record("prompt_blocks", chain.len() as i64);
        span.record("own_blocks", local as i64);
        span.record("own_disk_blocks", (local - ram) as i64);
        span.record("kvstore_blocks", (cached.len() - local) as i64);
        span.record("kvstore_disk_blocks", store_disk as i64);
        span.record("cached_tokens", (cached.len() * bs) as i64);
        let tokens = |blocks: usize| (blocks * bs) as u32;
        let tiers = pdmesh_proto::v1::CachedTokens {
            node_ram: tokens(ram),
            node_disk: tokens(local - ram),
            kvstore_ram: tokens(cached.len() - local - store_disk),
            kvstore_disk: tokens(store_disk),
        };
        Lookup { chain, cached, tiers }
    }

    /// The blocks of `chain` the KV-store holds, from its start, and how many of them it read
    /// back from its disk tier.
    async fn read(
        &self,
        store: &Store,
        chain: &[BlockHash],
    ) -> Result<(Vec<Bytes>, usize), tonic::Status> {
        if chain.is_empty() {
            return Ok((Vec::new(), 0));
        }
        let mut c = store.client()?;
        let hashes = chain.iter().map(|h| Bytes::copy_from_slice(&h.to_bytes())).collect();
        let req = KvMatchRequest {
            layout: Some(self.layout.into()),
            hashes,
            lease_ms: 0,
            transports: self.remote.iter().map(|r| r.transport().to_string()).collect(),
        };
        let m = c.r#match(req).await?.into_inner();
        if m.blocks == 0 {
            return Ok((Vec::new(), 0));
        }
        let from_disk = m.disk_blocks as usize;
        // A store claiming more than it was asked would have the caller index past the chain.
        if m.blocks as usize > chain.len() {
            return Err(tonic::Status::data_loss(format!(
                "the store matched {} blocks of a {}-block chain",
                m.blocks,
                chain.len()
            )));
        }
        let lease = m.lease;
        let read = async {
            let remote = self.remote.as_ref().zip(m.remote.as_ref());
            if let Some((r, d)) = remote.filter(|(r, d)| r.transport() == d.transport) {
                let bpb = self.bytes_per_block as u64;
                match r.read(d, m.blocks as usize, bpb).await {
                    Ok(blocks) => {
                        self.counters.remote_blocks.fetch_add(blocks.len() as u64, Relaxed);
                        Span::current().record("kvstore_transport", r.transport());
                        return Ok(blocks);
                    }
                    Err(e) => {
                        self.counters.remote_fallbacks.fetch_add(1, Relaxed);
                        let t = r.transport();
                        tracing::warn!("{t} read from the KV-store failed, streaming instead: {e}");
                    }
                }
            }
            let mut s = c.read(KvReadRequest { lease: lease.clone() }).await?.into_inner();
            let mut out = Vec::with_capacity(m.blocks as usize);
            while let Some(b) = s.message().await? {
                // The store answers for the hashes it was asked; anything else is not used.
                let want = chain.get(out.len()).map(|h| h.to_bytes());
                if want.as_ref().map(|w| &w[..]) != Some(&b.hash[..]) {
                    return Err(tonic::Status::data_loss("the store returned another block"));
                }
                if b.data.len() != self.bytes_per_block {
                    return Err(tonic::Status::data_loss(format!(
                        "the store returned a block of {} bytes, a block is {}",
                        b.data.len(),
                        self.bytes_per_block
                    )));
                }
                out.push(b.data);
            }
            self.counters.grpc_blocks.fetch_add(out.len() as u64, Relaxed);
            Span::current().record("kvstore_transport", "grpc");
            Ok(out)
        }
        .await;
        // The pins are not needed once the bytes are here (the lease would end them anyway).
        let mut rc = c.clone();
        tokio::spawn(
            async move {
                let _ = rc.release_match(KvReleaseMatchRequest { lease }).await;
            }
            .in_current_span(),
        );
        read.map(|blocks| (blocks, from_disk))
    }

    /// Keeps `blocks`, the prompt's full blocks from `first` on, in the node's tier at once
    /// and publishes them to the KV-store in the background.
    pub fn publish(&self, chain: &[BlockHash], first: usize, blocks: Vec<Bytes>) {
        if blocks.is_empty() {
            return;
        }
        if let Some(l) = &self.local {
            l.insert(&chain[first..], &blocks);
        }
        let Some(store) = &self.store else { return };
        let Ok(permit) = store.publishing.clone().try_acquire_owned() else {
            tracing::debug!(
                blocks = blocks.len(),
                "{MAX_PUBLISHING} publishes in flight; not publishing"
            );
            return;
        };
        let mut msgs = vec![KvWriteChunk {
            chunk: Some(Chunk::Header(KvWriteHeader {
                layout: Some(self.layout.into()),
                from: self.node_id.clone(),
            })),
        }];
        for (h, data) in chain[first..].iter().zip(blocks) {
            let hash = Bytes::copy_from_slice(&h.to_bytes());
            msgs.push(KvWriteChunk { chunk: Some(Chunk::Block(KvStoreBlock { hash, data })) });
        }
        let Ok(mut c) = store.client() else { return };
        let timeout = store.timeout.max(Duration::from_secs(5));
        let span = pdmesh_common::span!(
            "prefill.publish",
            blocks = (msgs.len() - 1) as i64,
            stored = Empty,
            duplicates = Empty,
        );
        let publish = async move {
            let _permit = permit;
            let span = Span::current();
            match tokio::time::timeout(timeout, c.write(tokio_stream::iter(msgs))).await {
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    span.record("stored", i64::from(r.stored));
                    span.record("duplicates", i64::from(r.duplicates));
                    tracing::debug!(
                        stored = r.stored,
                        duplicates = r.duplicates,
                        full = r.full,
                        "published"
                    );
                }
                Ok(Err(e)) => {
                    pdmesh_common::trace::fail(&span, &e);
                    tracing::warn!("publishing to the KV-store failed: {e}");
                }
                Err(_) => {
                    let why = format!("no answer within {timeout:?}");
                    pdmesh_common::trace::record_status(&span, tonic::Code::DeadlineExceeded, &why);
                    tracing::warn!("publishing to the KV-store timed out");
                }
            }
        };
        tokio::spawn(publish.instrument(span));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_kv_types::{KvDtype, KvGeometry};

    /// A KV-store that accepts connections and never answers: every publish hangs until its
    /// timeout. Prompts keep coming; at most `MAX_PUBLISHING` publishes (and their bytes) are
    /// held, the rest are dropped at once.
    #[tokio::test]
    async fn a_hung_store_holds_at_most_the_bounded_publishes() {
        let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = hung.local_addr().unwrap().to_string();
        let held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((s, _)) = hung.accept().await {
                conns.push(s);
            }
        });
        let geometry =
            KvGeometry { dtype: KvDtype::F16, block_size: 4, layers: 1, kv_heads: 1, head_dim: 8 };
        let layout = KvLayout { model_fingerprint: 7, geometry, window: None };
        let timeout = Duration::from_secs(30);
        let cache =
            PrefixCache::new(layout, "p", 0, None, Some(&addr), timeout, None).unwrap().unwrap();
        let block = Bytes::from(vec![1u8; layout.bytes_per_block()]);
        for i in 0..(MAX_PUBLISHING as u32 + 20) {
            let chain = cache.hasher.chain(&[i, i + 1, i + 2, i + 3]);
            cache.publish(&chain, 0, vec![block.clone()]);
        }
        let store = cache.store.as_ref().unwrap();
        assert_eq!(store.publishing.available_permits(), 0, "every publish slot is taken");
        // The 20 past the bound spawned nothing: besides the publishes only the fake store
        // and the channel's few tasks are alive (unbounded, this was 37 and more).
        let alive = tokio::runtime::Handle::current().metrics().num_alive_tasks();
        assert!(alive <= MAX_PUBLISHING + 6, "{alive} tasks alive");
        held.abort();
    }
}
