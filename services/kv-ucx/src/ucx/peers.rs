//! Endpoints to peers, cached by worker address so a stream of transfers to one peer connects
//! once (each transfer unpacks the keys of its own target: `scope::Keys`). A UCX failure on a
//! peer evicts it: the next transfer connects anew (the peer may have restarted at the same
//! address). A peer on this host whose memory is shared is mapped once, too (`Peer::shared`).

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use lru::LruCache;

use super::{Endpoint, RemoteKey, UcxError, UcxNode};

/// An endpoint to one peer worker.
pub struct Peer {
    pub ep: Endpoint,
    /// The peer's shared memory as mapped here, or why it could not be, by offered key, and
    /// when a transfer last asked for it.
    shared: tokio::sync::Mutex<Option<Shared>>,
}

struct Shared {
    /// The offered key, base and length the mapping was asked for.
    key: (Bytes, u64, u64),
    mapped: Result<Arc<Mapped>, UcxError>,
    used: Instant,
}

/// A mapping no transfer asked for this long is let go (on the next `Peers::get`): a decode
/// node that stopped or left would otherwise keep its whole pool alive in this process.
pub const MAPPING_IDLE: Duration = Duration::from_secs(60);

/// A peer's shared memory mapped into this process: `len` bytes whose peer address `base`
/// is at `local` here. The mapping lasts while the key does, and the key while its endpoint
/// does, so whoever writes through it holds the `Peer`.
pub struct Mapped {
    pub base: u64,
    pub len: u64,
    pub local: usize,
    _key: RemoteKey,
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapped").field("base", &self.base).field("len", &self.len).finish()
    }
}

impl Peer {
    /// The peer memory `[base, base + len)` under the key `offered`, mapped into this
    /// process (once per offer; a failure is remembered too, so a peer UCX cannot map is
    /// not retried on every transfer). `open` turns the offered key into the sealed one UCX
    /// takes; it runs only when the offer is new.
    pub async fn shared(
        &self,
        offered: &Bytes,
        base: u64,
        len: u64,
        open: impl FnOnce(&Bytes) -> Result<Bytes, UcxError>,
    ) -> Result<Arc<Mapped>, UcxError> {
        let mut cached = self.shared.lock().await;
        let key = (offered.clone(), base, len);
        if let Some(s) = &mut *cached
            && s.key == key
        {
            s.used = Instant::now();
            return s.mapped.clone();
        }
        let mapped = match open(offered) {
            Ok(rkey) => self.map(&rkey, base, len).await.map(Arc::new),
            Err(e) => Err(e),
        };
        *cached = Some(Shared { key, mapped: mapped.clone(), used: Instant::now() });
        mapped
    }

    /// Lets go of a mapping idle for `idle` (transfers still using it keep it until they end).
    fn unmap_idle(&self, idle: Duration) {
        if let Ok(mut cached) = self.shared.try_lock()
            && cached.as_ref().is_some_and(|s| s.used.elapsed() >= idle)
        {
            *cached = None;
        }
    }

    /// Whether this peer holds a mapping now.
    pub fn holds_mapping(&self) -> bool {
        self.shared.try_lock().map_or(true, |c| c.as_ref().is_some_and(|s| s.mapped.is_ok()))
    }

    async fn map(&self, rkey: &Bytes, base: u64, len: u64) -> Result<Mapped, UcxError> {
        if len == 0 || base.checked_add(len).is_none() {
            return Err(UcxError::Usage(format!("{len} bytes at {base:#x} is no memory")));
        }
        let key = self.ep.remote_key(rkey.clone()).await?;
        let local = self.ep.local_ptr(&key, base).await?;
        Ok(Mapped { base, len, local, _key: key })
    }
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("ep", &self.ep).finish()
    }
}

/// Peers kept connected; the least recently used is closed past this.
pub const MAX_PEERS: usize = 64;

type PeerMap = LruCache<Bytes, Arc<Peer>>;

#[derive(Debug, Clone)]
pub struct Peers {
    node: UcxNode,
    map: Arc<Mutex<PeerMap>>,
}

impl Peers {
    pub fn new(node: UcxNode) -> Self {
        let cap = NonZeroUsize::new(MAX_PEERS).expect("non-zero");
        Self { node, map: Arc::new(Mutex::new(LruCache::new(cap))) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PeerMap> {
        self.map.lock().expect("peer map lock is never poisoned")
    }

    /// The cached peer for a (sealed) worker address, connecting if needed.
    pub async fn get(&self, worker: &Bytes) -> Result<Arc<Peer>, UcxError> {
        self.unmap_idle(MAPPING_IDLE);
        if let Some(p) = self.lock().get(worker) {
            return Ok(Arc::clone(p));
        }
        let ep = self.node.connect(worker.clone()).await?;
        let p = Arc::new(Peer { ep, shared: tokio::sync::Mutex::new(None) });
        self.lock().put(worker.clone(), Arc::clone(&p));
        Ok(p)
    }

    /// Lets go of every peer's mapping idle for `idle`.
    pub fn unmap_idle(&self, idle: Duration) {
        for (_, p) in self.lock().iter() {
            p.unmap_idle(idle);
        }
    }

    /// Forgets `peer` after a failure on it.
    pub fn evict(&self, peer: &Arc<Peer>) {
        let mut map = self.lock();
        let stale: Vec<_> =
            map.iter().filter(|(_, p)| Arc::ptr_eq(p, peer)).map(|(k, _)| k.clone()).collect();
        for k in stale {
            map.pop(&k);
        }
    }
}
