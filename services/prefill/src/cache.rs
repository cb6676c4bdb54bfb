//! The prefill node's use of the KV-store: before a prompt is computed, the longest stored
//! prefix of its block-hash chain is matched and read; after, the full blocks it computed are
//! published in the background. Every failure here (store down, slow, refusing) only costs
//! the cache: the prompt is then computed in full, a slower request and never a failed one.

use std::time::Duration;

use bytes::Bytes;
use pdmesh_kv_transfer::{BlockHash, BlockHasher};
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::kv_write_chunk::Chunk;
use pdmesh_proto::v1::{
    KvLayout, KvMatchRequest, KvReadRequest, KvReleaseMatchRequest, KvStoreBlock, KvWriteChunk,
    KvWriteHeader,
};
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Clone)]
pub struct PrefixCache {
    client: KvStoreClient<Channel>,
    hasher: BlockHasher,
    layout: KvLayout,
    node_id: String,
    /// Longest a lookup (match + read) may take before the prompt is computed in full.
    timeout: Duration,
}

/// What a lookup found: the prompt's chain (full blocks) and the stored prefix's bytes.
#[derive(Debug, Default)]
pub struct Lookup {
    pub chain: Vec<BlockHash>,
    pub cached: Vec<Bytes>,
}

impl PrefixCache {
    /// A client of the KV-store at `address` (dialled lazily).
    pub fn new(
        address: &str,
        layout: KvLayout,
        node_id: &str,
        timeout: Duration,
    ) -> Result<Self, String> {
        let hasher = BlockHasher::new(&layout).ok_or("the KV layout has no block size")?;
        let ep = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| format!("kvstore address {address:?}: {e}"))?
            .connect_timeout(timeout)
            .tcp_nodelay(true);
        let client = KvStoreClient::new(ep.connect_lazy())
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        Ok(Self { client, hasher, layout, node_id: node_id.to_string(), timeout })
    }

    /// Matches and reads the stored prefix of `prompt`, leaving at least its last token to
    /// compute (the first token's logits come from it). Never fails: trouble means no cache.
    pub async fn lookup(&self, prompt: &[u32]) -> Lookup {
        let chain = self.hasher.chain(prompt);
        let usable = (prompt.len() - 1) / self.hasher.block_size();
        let cached = match tokio::time::timeout(self.timeout, self.read(&chain[..usable])).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::warn!("prefix cache unavailable, computing the whole prompt: {e}");
                Vec::new()
            }
            Err(_) => {
                tracing::warn!(
                    "prefix cache slower than {:?}, computing the whole prompt",
                    self.timeout
                );
                Vec::new()
            }
        };
        Lookup { chain, cached }
    }

    async fn read(&self, chain: &[BlockHash]) -> Result<Vec<Bytes>, tonic::Status> {
        if chain.is_empty() {
            return Ok(Vec::new());
        }
        let mut c = self.client.clone();
        let hashes = chain.iter().map(|h| Bytes::copy_from_slice(&h.to_bytes())).collect();
        let req = KvMatchRequest { layout: Some(self.layout.clone()), hashes, lease_ms: 0 };
        let m = c.r#match(req).await?.into_inner();
        if m.blocks == 0 {
            return Ok(Vec::new());
        }
        let lease = m.lease;
        let read = async {
            let mut s = c.read(KvReadRequest { lease }).await?.into_inner();
            let mut out = Vec::with_capacity(m.blocks as usize);
            while let Some(b) = s.message().await? {
                // The store answers for the hashes it was asked; anything else is not used.
                let want = chain.get(out.len()).map(|h| h.to_bytes());
                if want.as_ref().map(|w| &w[..]) != Some(&b.hash[..]) {
                    return Err(tonic::Status::data_loss("the store returned another block"));
                }
                out.push(b.data);
            }
            Ok(out)
        }
        .await;
        // The pins are not needed once the bytes are here (the lease would end them anyway).
        let mut rc = self.client.clone();
        tokio::spawn(async move {
            let _ = rc.release_match(KvReleaseMatchRequest { lease }).await;
        });
        read
    }

    /// Publishes `blocks`, the prompt's full blocks from `first` on, in the background.
    pub fn publish(&self, chain: &[BlockHash], first: usize, blocks: Vec<Bytes>) {
        if blocks.is_empty() {
            return;
        }
        let mut msgs = vec![KvWriteChunk {
            chunk: Some(Chunk::Header(KvWriteHeader {
                layout: Some(self.layout.clone()),
                from: self.node_id.clone(),
            })),
        }];
        for (h, data) in chain[first..].iter().zip(blocks) {
            let hash = Bytes::copy_from_slice(&h.to_bytes());
            msgs.push(KvWriteChunk { chunk: Some(Chunk::Block(KvStoreBlock { hash, data })) });
        }
        let mut c = self.client.clone();
        let timeout = self.timeout.max(Duration::from_secs(5));
        tokio::spawn(async move {
            match tokio::time::timeout(timeout, c.write(tokio_stream::iter(msgs))).await {
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    tracing::debug!(
                        stored = r.stored,
                        duplicates = r.duplicates,
                        full = r.full,
                        "published"
                    );
                }
                Ok(Err(e)) => tracing::warn!("publishing to the prefix cache failed: {e}"),
                Err(_) => tracing::warn!("publishing to the prefix cache timed out"),
            }
        });
    }
}
