//! Content addresses of KV blocks, the one definition router, prefill nodes and the KV-store
//! share: `h_i = H(h_{i-1}, tokens of full block i)`, with `h_{-1}` derived from the model
//! fingerprint and the KV layout. A block's hash therefore names its tokens *and* everything
//! before them *and* the model and layout that computed it: equal tokens at another position,
//! or under another model, dtype or block size, never share an address.
//!
//! Hashes are 128-bit (xxh3-128): a collision would serve one prompt another's KV silently,
//! and at 64 bits a mesh storing a billion blocks would see one with a few percent chance.

use xxhash_rust::xxh3::xxh3_128;

use crate::KvLayout;

/// A block's content address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    /// Parses 16 little-endian bytes (what `to_bytes` wrote).
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        Some(Self(u128::from_le_bytes(b.try_into().ok()?)))
    }
}

/// An order-free digest of a set of blocks: two holders with equal digests (and counts) hold
/// the same blocks but for a 2^-64 chance. For checking a router's index against a node's
/// cache, never for addressing.
pub fn digest(blocks: impl IntoIterator<Item = BlockHash>) -> u64 {
    blocks.into_iter().fold(0, |d, h| d ^ (h.0 as u64) ^ ((h.0 >> 64) as u64))
}

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Hashes token blocks for one model and KV layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    seed: BlockHash,
    block_size: usize,
}

impl BlockHasher {
    /// `None` when the layout has no block size.
    pub fn new(layout: &KvLayout) -> Option<Self> {
        let g = &layout.geometry;
        if g.block_size == 0 {
            return None;
        }
        let mut s = Vec::with_capacity(64);
        s.extend_from_slice(b"pdmesh-kv-block-v1");
        s.extend_from_slice(&layout.model_fingerprint.to_le_bytes());
        let dtype = g.dtype.name();
        s.extend_from_slice(&(dtype.len() as u32).to_le_bytes());
        s.extend_from_slice(dtype.as_bytes());
        for v in [g.block_size, g.layers, g.kv_heads, g.head_dim] {
            s.extend_from_slice(&(v as u32).to_le_bytes());
        }
        Some(Self { seed: BlockHash(xxh3_128(&s)), block_size: g.block_size })
    }

    /// This hasher in a tenant's own space: chains under different salts never share a block,
    /// so one tenant's cached prefix can neither serve nor reveal another's prompt. An empty
    /// salt is the shared space.
    pub fn salted(self, salt: &[u8]) -> Self {
        if salt.is_empty() {
            return self;
        }
        let mut s = Vec::with_capacity(16 + 4 + salt.len());
        s.extend_from_slice(&self.seed.to_bytes());
        s.extend_from_slice(b"salt");
        s.extend_from_slice(salt);
        Self { seed: BlockHash(xxh3_128(&s)), ..self }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of the block of `tokens` that follows the block hashed `prev` (`None`: the
    /// first block).
    pub fn next(&self, prev: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut buf = Vec::with_capacity(16 + 4 * tokens.len());
        buf.extend_from_slice(&prev.unwrap_or(self.seed).to_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        BlockHash(xxh3_128(&buf))
    }

    /// The chain of a prompt: one hash per *full* block (a partial tail block has none: its
    /// KV changes as tokens are added, so it is never shared).
    pub fn chain(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut prev = None;
        for block in tokens.chunks_exact(self.block_size) {
            let h = self.next(prev, block);
            out.push(h);
            prev = Some(h);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvDtype, KvGeometry};

    fn layout() -> KvLayout {
        KvLayout {
            model_fingerprint: 0x5eed,
            geometry: KvGeometry {
                dtype: KvDtype::F16,
                block_size: 4,
                layers: 30,
                kv_heads: 3,
                head_dim: 64,
            },
            window: None,
        }
    }

    fn with(f: impl FnOnce(&mut KvLayout)) -> KvLayout {
        let mut l = layout();
        f(&mut l);
        l
    }

    #[test]
    fn salts_separate_spaces() {
        let h = BlockHasher::new(&layout()).expect("block size");
        let t: Vec<u32> = (0..8).collect();
        assert_eq!(h.salted(&[]).chain(&t), h.chain(&t));
        let (a, b) = (h.salted(b"tenant-a").chain(&t), h.salted(b"tenant-b").chain(&t));
        assert!(a.iter().all(|x| !b.contains(x) && !h.chain(&t).contains(x)));
        assert_eq!(h.salted(b"tenant-a").chain(&t), a);
    }

    #[test]
    fn chain_covers_full_blocks_and_extends_prefixes() {
        let h = BlockHasher::new(&layout()).expect("block size");
        let t: Vec<u32> = (0..11).collect();
        let c = h.chain(&t);
        assert_eq!(c.len(), 2, "the partial tail block has no hash");
        // A longer prompt with the same start extends the chain, never changes it.
        let longer: Vec<u32> = (0..17).collect();
        assert_eq!(&h.chain(&longer)[..2], &c[..]);
        assert_eq!(c[1], h.next(Some(c[0]), &t[4..8]));
    }

    #[test]
    fn equal_tokens_at_another_position_differ() {
        let h = BlockHasher::new(&layout()).expect("block size");
        // Block [1,2,3,4] first, and the same block second.
        let a = h.chain(&[1, 2, 3, 4]);
        let b = h.chain(&[9, 9, 9, 9, 1, 2, 3, 4]);
        assert_ne!(a[0], b[1]);
        // A change in an earlier block changes every later hash.
        let c = h.chain(&[9, 9, 9, 8, 1, 2, 3, 4]);
        assert_ne!(b[0], c[0]);
        assert_ne!(b[1], c[1]);
    }

    #[test]
    fn model_and_layout_are_part_of_the_address() {
        let t: Vec<u32> = (0..8).collect();
        let base = BlockHasher::new(&layout()).expect("block size").chain(&t);
        for other in [
            with(|l| l.model_fingerprint = 0x5eee),
            with(|l| l.geometry.dtype = KvDtype::F32),
            with(|l| l.geometry.layers = 29),
            with(|l| l.geometry.head_dim = 32),
        ] {
            let c = BlockHasher::new(&other).expect("block size").chain(&t);
            assert_ne!(base, c, "{other:?} shares addresses with {:?}", layout());
        }
        assert!(BlockHasher::new(&with(|l| l.geometry.block_size = 0)).is_none());
    }

    #[test]
    fn bytes_round_trip() {
        let h = BlockHash(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
        assert_eq!(BlockHash::from_bytes(&h.to_bytes()), Some(h));
        assert_eq!(BlockHash::from_bytes(&[1, 2, 3]), None);
    }
}
