//! Endpoints to peers' registered regions, cached by (worker address, packed remote key) so a
//! stream of transfers to one peer connects and unpacks once. A UCX failure on a peer evicts
//! it: the next transfer connects anew (the peer may have restarted at the same address).

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use lru::LruCache;

use super::{Endpoint, RemoteKey, UcxError, UcxNode};

/// An endpoint to one peer worker and the unpacked key of one of its regions.
pub struct Peer {
    pub ep: Endpoint,
    pub rkey: RemoteKey,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("ep", &self.ep).finish()
    }
}

/// Peers (worker, remote key) kept connected; the least recently used is closed past this.
pub const MAX_PEERS: usize = 64;

type PeerMap = LruCache<(Bytes, Bytes), Arc<Peer>>;

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

    /// The cached peer for a (sealed) worker address and remote key, connecting if needed.
    pub async fn get(&self, worker: &Bytes, rkey: &Bytes) -> Result<Arc<Peer>, UcxError> {
        let key = (worker.clone(), rkey.clone());
        if let Some(p) = self.lock().get(&key) {
            return Ok(Arc::clone(p));
        }
        let ep = self.node.connect(worker.clone()).await?;
        let rkey = ep.remote_key(rkey.clone()).await?;
        let p = Arc::new(Peer { ep, rkey });
        self.lock().put(key, Arc::clone(&p));
        Ok(p)
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
