//! The KV-store service: holds the KV blocks of shared prompt prefixes once for the whole mesh,
//! addressed by content (`pdmesh_kv_transfer::BlockHash`). `store` is its state: a byte budget
//! of block slots, matching of hash chains with pins under leases, deduplicating puts, and LRU
//! eviction of what no lease pins. `trace` reads Mooncake workload traces and computes their
//! ideal hit rate.

pub mod service;
pub mod store;
pub mod trace;

pub use service::KvStoreService;
pub use store::{Matched, PutSlot, Store, StoreStats};
