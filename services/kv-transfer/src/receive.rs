//! The receiving side of every transport on a decode node, as a `KvConnector`: which
//! reservations' KV is arriving and how far each has got, whole blocks written in order as a
//! stream delivers them (gRPC), or a remote writer putting them itself until its commit (UCX),
//! with checksums verified in verify mode. Blocks come in their wire form (a sliding-window
//! model's blocks before the window, thin: `KvLayout::thin_blocks`). The batch runner learns
//! from it when a request's KV is complete, and a reservation a remote writer may still reach
//! keeps its blocks until the writer's session ends.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pdmesh_engine::{Engine, KvConnector, KvView, Release, SeqId};

use crate::staging::StagedBlocks;

/// Why KV could not be taken in.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReceiveError {
    #[error("reservation {0} already receives KV")]
    AlreadyReceiving(u64),
    #[error("reservation {0} is not receiving KV")]
    NotReceiving(u64),
    #[error("reservation {0} was made without remote_kv; its blocks have no addresses")]
    NotPreallocated(u64),
    #[error("KV data of {len} bytes is not whole blocks (the first is {block} bytes)")]
    PartialBlock { len: usize, block: usize },
    #[error("KV blocks {first}..{end} are past the prompt's {blocks} blocks")]
    PastPrompt { first: usize, end: usize, blocks: usize },
    #[error("KV block {got} arrived, expected {want}")]
    OutOfOrder { got: usize, want: usize },
    #[error("the KV ended with {got} blocks, the prompt has {want}")]
    Incomplete { got: usize, want: usize },
    #[error("{got} checksums for {want} blocks")]
    Checksums { got: usize, want: usize },
    #[error("KV block {block} failed its checksum: the transfer corrupted it")]
    Corrupt { block: usize },
    #[error("{staged} staging blocks for a prompt of {want} blocks")]
    Staging { staged: usize, want: usize },
    #[error("engine: {0}")]
    Engine(#[from] pdmesh_engine::Error),
}

/// Where one reservation's KV stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transfer {
    /// A request waits for KV whose transfer has not begun.
    Awaited,
    /// Whole blocks arrive over a stream, in order; `next` is the next one expected.
    Streaming { next: usize },
    /// A remote writer puts the blocks itself until its commit.
    Remote,
    /// Every block is in place.
    Complete,
}

/// What the receiver needs to know of a reservation to write its blocks.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub seq: SeqId,
    pub prompt_len: usize,
}

/// The decode node's receiving side.
#[derive(Debug, Default)]
pub struct Receiver {
    transfers: HashMap<u64, Transfer>,
    /// Reservations whose remote writer may still put into their blocks: its session is open
    /// and it has not committed.
    sessions: HashSet<u64>,
}

impl Receiver {
    pub fn new() -> Self {
        Self::default()
    }

    fn blocks(engine: &Engine, prompt_len: usize) -> usize {
        prompt_len.div_ceil(engine.config().block_size)
    }

    /// A request waits for `id`'s KV (it was sampled elsewhere): until the KV is complete the
    /// runner does not schedule it. A no-op when the transfer already began.
    pub fn await_kv(&mut self, id: u64) {
        self.transfers.entry(id).or_insert(Transfer::Awaited);
    }

    /// Whether a transfer into `id` has begun (and not failed).
    pub fn is_receiving(&self, id: u64) -> bool {
        matches!(self.transfers.get(&id), Some(Transfer::Streaming { .. } | Transfer::Remote))
    }

    pub fn is_complete(&self, id: u64) -> bool {
        self.transfers.get(&id) == Some(&Transfer::Complete)
    }

    /// Whether a remote writer may still put into `id`'s blocks.
    pub fn session_open(&self, id: u64) -> bool {
        self.sessions.contains(&id)
    }

    /// A transfer into `t` begins: its prompt's blocks are allocated (if they were not at
    /// reservation). A `remote` writer puts into them directly and needs them preallocated;
    /// until `writer_closed` they are never reused.
    pub fn begin(
        &mut self,
        id: u64,
        t: Target,
        remote: bool,
        engine: &mut Engine,
    ) -> Result<(), ReceiveError> {
        if matches!(self.transfers.get(&id), Some(x) if *x != Transfer::Awaited) {
            return Err(ReceiveError::AlreadyReceiving(id));
        }
        let preallocated = engine.seq_len(t.seq)? == t.prompt_len;
        if remote && !preallocated {
            return Err(ReceiveError::NotPreallocated(id));
        }
        if !preallocated {
            engine.extend_sequence(t.seq, t.prompt_len)?;
        }
        let state = if remote { Transfer::Remote } else { Transfer::Streaming { next: 0 } };
        self.transfers.insert(id, state);
        if remote {
            self.sessions.insert(id);
        }
        Ok(())
    }

    /// Writes whole prompt blocks of a streamed transfer, starting at `first_block`.
    pub fn write(
        &mut self,
        id: u64,
        t: Target,
        first_block: usize,
        data: &[u8],
        engine: &mut Engine,
    ) -> Result<(), ReceiveError> {
        let Some(Transfer::Streaming { next }) = self.transfers.get(&id).copied() else {
            return Err(ReceiveError::NotReceiving(id));
        };
        let layout = engine.kv_layout();
        let thin = layout.thin_blocks(t.prompt_len);
        let parts = layout.split_wire(first_block, thin, data).filter(|p| !p.is_empty());
        let Some(parts) = parts else {
            let block = layout.wire_block_bytes(first_block, thin);
            return Err(ReceiveError::PartialBlock { len: data.len(), block });
        };
        let n = parts.len();
        let blocks = Self::blocks(engine, t.prompt_len);
        if first_block + n > blocks {
            return Err(ReceiveError::PastPrompt {
                first: first_block,
                end: first_block + n,
                blocks,
            });
        }
        if first_block != next {
            return Err(ReceiveError::OutOfOrder { got: first_block, want: next });
        }
        engine.write_wire_blocks(t.seq, first_block, thin, parts)?;
        self.transfers.insert(id, Transfer::Streaming { next: next + n });
        Ok(())
    }

    /// The sender says the KV is complete with `blocks` blocks. A remote writer says so only
    /// after its writes completed (and could put no more), so its blocks count as written now;
    /// when it put into `staged` blocks, they are copied into the pool here, and the time that
    /// took is returned. Too few blocks is refused and the transfer stays open; non-empty
    /// `checksums` (verify mode) are checked against each block in the pool, and a mismatch
    /// ends the transfer.
    pub fn end(
        &mut self,
        id: u64,
        t: Target,
        blocks: usize,
        checksums: &[u64],
        staged: Option<&StagedBlocks>,
        engine: &mut Engine,
    ) -> Result<Option<Duration>, ReceiveError> {
        let want = Self::blocks(engine, t.prompt_len);
        let (got, remote) = match self.transfers.get(&id) {
            Some(Transfer::Streaming { next }) => (*next, false),
            Some(Transfer::Remote) => {
                self.sessions.remove(&id);
                (blocks.min(want), true)
            }
            _ => return Err(ReceiveError::NotReceiving(id)),
        };
        if got != want || blocks != want {
            return Err(ReceiveError::Incomplete { got: got.min(blocks), want });
        }
        let unstaged = match staged.filter(|_| remote) {
            Some(s) => match Self::unstage(engine, t, s, want) {
                Ok(d) => Some(d),
                Err(e) => {
                    self.abort(id);
                    return Err(e);
                }
            },
            None => None,
        };
        if let Err(e) = Self::verify(engine, t, checksums, want) {
            self.abort(id);
            return Err(e);
        }
        self.transfers.insert(id, Transfer::Complete);
        Ok(unstaged)
    }

    /// Copies the `want` staged blocks of `t`'s prompt into its pool blocks. A staged block
    /// holds its wire form from its start (a thin one, its global layers).
    fn unstage(
        engine: &mut Engine,
        t: Target,
        staged: &StagedBlocks,
        want: usize,
    ) -> Result<Duration, ReceiveError> {
        if staged.len() != want {
            return Err(ReceiveError::Staging { staged: staged.len(), want });
        }
        let started = Instant::now();
        let layout = engine.kv_layout();
        let thin = layout.thin_blocks(t.prompt_len);
        let blocks = (0..want).map(|i| &staged.block(i)[..layout.wire_block_bytes(i, thin)]);
        engine.write_wire_blocks(t.seq, 0, thin, blocks)?;
        Ok(started.elapsed())
    }

    /// Checks each block's wire form against its checksum.
    fn verify(
        engine: &Engine,
        t: Target,
        checksums: &[u64],
        want: usize,
    ) -> Result<(), ReceiveError> {
        if checksums.is_empty() {
            return Ok(());
        }
        if checksums.len() != want {
            return Err(ReceiveError::Checksums { got: checksums.len(), want });
        }
        let thin = engine.kv_layout().thin_blocks(t.prompt_len);
        let mut buf = Vec::new();
        for (i, &sum) in checksums.iter().enumerate() {
            buf.clear();
            engine.read_wire_block(t.seq, i, thin, &mut buf)?;
            if pdmesh_kv_types::block_checksum(&buf) != sum {
                return Err(ReceiveError::Corrupt { block: i });
            }
        }
        Ok(())
    }

    /// `id`'s remote writer gave up (its blocks were replaced): its KV is awaited anew, from
    /// a stream. The writer's session stays open until it ends, but no longer carries the
    /// transfer.
    pub fn writer_abandoned(&mut self, id: u64) {
        self.transfers.insert(id, Transfer::Awaited);
    }

    /// The transfer into `id` is over without its KV (it broke, or its reservation ended).
    pub fn abort(&mut self, id: u64) {
        self.transfers.remove(&id);
    }

    /// `id`'s remote writer can put no more (its session ended). Returns whether its transfer
    /// was still in progress, i.e. ended without its commit.
    pub fn writer_closed(&mut self, id: u64) -> bool {
        self.sessions.remove(&id);
        let broke = self.transfers.get(&id) == Some(&Transfer::Remote);
        if broke {
            self.abort(id);
        }
        broke
    }

    /// Forgets `id` (its reservation is gone); whether its blocks must wait for a writer.
    pub fn forget(&mut self, id: u64) -> Release {
        self.abort(id);
        if self.sessions.contains(&id) { Release::Keep } else { Release::Free }
    }
}

impl KvConnector for Receiver {
    fn available(&mut self, id: u64, prompt: &[u32]) -> Option<usize> {
        match self.transfers.get(&id) {
            // No transfer: the prompt is computed here.
            None => Some(0),
            Some(Transfer::Complete) => Some(prompt.len()),
            Some(_) => None,
        }
    }

    fn finished(&mut self, id: u64, _seq: SeqId, _kv: &KvView<'_>) -> Release {
        self.forget(id)
    }

    /// A decode node's sequences are scheduled once their KV is whole, and nothing here
    /// reads them whole after that (a migration's export reads what a continuation needs).
    fn lets_window_go(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_engine::testing::tiny_model;
    use pdmesh_engine::{EngineConfig, KvConnector};

    fn engine() -> Engine {
        let cfg = EngineConfig { threads: 1, block_size: 4, kv_blocks: 16, ..Default::default() };
        Engine::new(tiny_model(), cfg).expect("engine")
    }

    #[test]
    fn streamed_blocks_arrive_in_order_whole_and_verified() {
        let mut e = engine();
        let mut r = Receiver::new();
        let bpb = e.kv().geometry().bytes_per_block();
        let seq = e.create_sequence();
        let t = Target { seq, prompt_len: 10 }; // 3 blocks of 4
        assert!(matches!(
            r.write(1, t, 0, &vec![0; bpb], &mut e),
            Err(ReceiveError::NotReceiving(1))
        ));
        r.await_kv(1);
        assert_eq!(r.available(1, &[0; 10]), None, "awaited KV holds the request back");
        r.begin(1, t, false, &mut e).expect("begin");
        assert!(matches!(r.begin(1, t, false, &mut e), Err(ReceiveError::AlreadyReceiving(1))));
        let data: Vec<u8> = (0..3 * bpb).map(|i| (i % 251) as u8).collect();
        let sums: Vec<u64> = data.chunks(bpb).map(pdmesh_kv_types::block_checksum).collect();
        assert!(matches!(
            r.write(1, t, 0, &data[..bpb - 1], &mut e),
            Err(ReceiveError::PartialBlock { .. })
        ));
        assert!(matches!(
            r.write(1, t, 1, &data[..bpb], &mut e),
            Err(ReceiveError::OutOfOrder { got: 1, want: 0 })
        ));
        assert!(matches!(
            r.write(1, t, 2, &data[..2 * bpb], &mut e),
            Err(ReceiveError::PastPrompt { .. })
        ));
        r.write(1, t, 0, &data[..2 * bpb], &mut e).expect("two blocks");
        assert_eq!(r.available(1, &[0; 10]), None);
        r.write(1, t, 2, &data[2 * bpb..], &mut e).expect("the tail block");
        r.end(1, t, 3, &sums, None, &mut e).expect("complete and verified");
        assert_eq!(r.available(1, &[0; 10]), Some(10));
        assert_eq!(r.finished(1, seq, &e.kv_view()), Release::Free);
        assert_eq!(r.available(1, &[0; 10]), Some(0), "forgotten");
    }

    #[test]
    fn a_corrupted_or_short_transfer_fails() {
        let mut e = engine();
        let mut r = Receiver::new();
        let bpb = e.kv().geometry().bytes_per_block();
        let data: Vec<u8> = (0..2 * bpb).map(|i| (i % 253) as u8).collect();
        let sums: Vec<u64> = data.chunks(bpb).map(pdmesh_kv_types::block_checksum).collect();
        let t = Target { seq: e.create_sequence(), prompt_len: 8 };
        r.begin(1, t, false, &mut e).expect("begin");
        let mut bad = data.clone();
        bad[bpb + 7] ^= 0x40;
        r.write(1, t, 0, &bad, &mut e).expect("written");
        assert!(matches!(
            r.end(1, t, 2, &sums, None, &mut e),
            Err(ReceiveError::Corrupt { block: 1 })
        ));
        assert!(!r.is_receiving(1), "a failed end ends the transfer");
        let t = Target { seq: e.create_sequence(), prompt_len: 8 };
        r.begin(2, t, false, &mut e).expect("begin");
        r.write(2, t, 0, &data[..bpb], &mut e).expect("one block");
        assert!(matches!(
            r.end(2, t, 2, &[], None, &mut e),
            Err(ReceiveError::Incomplete { got: 1, want: 2 })
        ));
        assert!(r.is_receiving(2), "a short end leaves the transfer open");
        r.write(2, t, 1, &data[bpb..], &mut e).expect("the last block");
        r.end(2, t, 2, &sums, None, &mut e).expect("complete");
    }

    #[test]
    fn a_remote_writer_needs_preallocated_blocks_and_keeps_them_until_it_closes() {
        let mut e = engine();
        let mut r = Receiver::new();
        let plain = Target { seq: e.create_sequence(), prompt_len: 8 };
        assert!(matches!(r.begin(1, plain, true, &mut e), Err(ReceiveError::NotPreallocated(1))));
        let seq = e.create_sequence();
        e.extend_sequence(seq, 8).expect("preallocated");
        let t = Target { seq, prompt_len: 8 };
        r.begin(2, t, true, &mut e).expect("begin");
        assert!(matches!(r.write(2, t, 0, &[0; 4], &mut e), Err(ReceiveError::NotReceiving(2))));
        // Until its commit the writer may be putting: the blocks stay out of reuse.
        assert!(r.session_open(2));
        assert_eq!(r.forget(2), Release::Keep, "the writer's session is open");
        r.begin(4, t, true, &mut e).expect("begin");
        r.end(4, t, 2, &[], None, &mut e).expect("committed: every put has landed");
        assert!(!r.session_open(4));
        assert_eq!(r.finished(4, seq, &e.kv_view()), Release::Free);
        assert!(!r.writer_closed(4), "it had committed");
        // A session that ends before its commit broke the transfer.
        let seq = e.create_sequence();
        e.extend_sequence(seq, 8).expect("preallocated");
        r.begin(3, Target { seq, prompt_len: 8 }, true, &mut e).expect("begin");
        assert!(r.writer_closed(3));
        assert_eq!(r.forget(3), Release::Free);
    }

    #[test]
    fn staged_blocks_are_copied_into_the_pool_at_the_commit_in_prompt_order() {
        let mut e = engine();
        let mut r = Receiver::new();
        let bpb = e.kv().geometry().bytes_per_block();
        // What a remote writer left in a staging area of 4 blocks.
        let mut mem = pdmesh_kv_types::HostMemory::zeroed(4 * bpb).expect("staging");
        for (i, b) in mem.bytes_mut().iter_mut().enumerate() {
            *b = (i % 241) as u8;
        }
        let area = crate::staging::StagingArea::new(mem, bpb).expect("area");
        let staged = area.take(2).expect("2 blocks");
        assert_ne!(staged.blocks(), [0, 1], "not the identity: the order must be followed");
        let want: Vec<u8> = (0..2).flat_map(|i| staged.block(i).to_vec()).collect();
        let sums: Vec<u64> = want.chunks(bpb).map(pdmesh_kv_types::block_checksum).collect();
        let seq = e.create_sequence();
        e.extend_sequence(seq, 8).expect("preallocated");
        let t = Target { seq, prompt_len: 8 };
        r.begin(1, t, true, &mut e).expect("begin");
        let took = r.end(1, t, 2, &sums, Some(&staged), &mut e).expect("unstaged and verified");
        assert!(took.is_some(), "the copy is timed");
        let mut got = Vec::new();
        for i in 0..2 {
            e.read_block(seq, i, &mut got).expect("read");
        }
        assert_eq!(got, want);
        // A staged set that does not match the prompt fails the transfer, not the node.
        let seq = e.create_sequence();
        e.extend_sequence(seq, 8).expect("preallocated");
        let t = Target { seq, prompt_len: 8 };
        let one = area.take(1).expect("1 block");
        r.begin(2, t, true, &mut e).expect("begin");
        assert!(matches!(
            r.end(2, t, 2, &[], Some(&one), &mut e),
            Err(ReceiveError::Staging { staged: 1, want: 2 })
        ));
        assert!(!r.is_receiving(2));
    }
}
