//! Endpoints to peers, cached by worker address so a stream of transfers to one peer connects
//! once (each transfer unpacks the keys of its own target: `scope::Keys`). A UCX failure on a
//! peer evicts it: the next transfer connects anew (the peer may have restarted at the same
//! address).

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use lru::LruCache;

use super::{Endpoint, UcxError, UcxNode};

/// An endpoint to one peer worker.
pub struct Peer {
    pub ep: Endpoint,
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
        if let Some(p) = self.lock().get(worker) {
            return Ok(Arc::clone(p));
        }
        let ep = self.node.connect(worker.clone()).await?;
        let p = Arc::new(Peer { ep });
        self.lock().put(worker.clone(), Arc::clone(&p));
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
