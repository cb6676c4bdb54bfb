//! Host blocks that stand in for a KV pool peers cannot reach: a GPU's pool where UCX has no
//! CUDA transport. A reservation takes as many staging blocks as its prompt has; peers put
//! the KV there, and at the commit the decode node copies each staged block into its pool
//! block (a host-to-device copy from page-locked memory). The blocks go back when no writer
//! can reach them any more — its session ended — so a late put never lands in another
//! reservation's blocks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pdmesh_kv_types::{HostMemory, MemoryRegion};

/// Why a reservation got no staging blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the KV staging area has {free} free blocks of {total}, {want} wanted")]
pub struct StagingFull {
    pub want: usize,
    pub free: usize,
    pub total: usize,
}

/// A fixed set of host blocks, handed out to reservations and taken back.
#[derive(Debug)]
pub struct StagingArea {
    memory: HostMemory,
    bytes_per_block: usize,
    blocks: usize,
    free: Mutex<Vec<u32>>,
    /// Requests for blocks that found too few free.
    full: AtomicU64,
}

impl StagingArea {
    /// The whole blocks of `bytes_per_block` that fit in `memory`.
    pub fn new(memory: HostMemory, bytes_per_block: usize) -> Result<Arc<Self>, String> {
        let blocks = memory.len().checked_div(bytes_per_block).unwrap_or(0);
        if blocks == 0 {
            return Err(format!(
                "a staging area of {} bytes holds no {bytes_per_block}-byte KV block",
                memory.len()
            ));
        }
        let blocks = blocks.min(u32::MAX as usize);
        // Popped from the end: low blocks first, so a light load stays in few pages.
        let free = (0..blocks as u32).rev().collect();
        let free = Mutex::new(free);
        Ok(Arc::new(Self { memory, bytes_per_block, blocks, free, full: AtomicU64::new(0) }))
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    /// Blocks not handed out.
    pub fn free_blocks(&self) -> usize {
        self.free.lock().expect("never poisoned").len()
    }

    /// How many times blocks were asked for and too few were free.
    pub fn full(&self) -> u64 {
        self.full.load(Ordering::Relaxed)
    }

    /// The memory peers put into.
    pub fn region(&self) -> MemoryRegion {
        self.memory.region()
    }

    /// `n` blocks for one reservation, all or none.
    pub fn take(self: &Arc<Self>, n: usize) -> Result<StagedBlocks, StagingFull> {
        let mut free = self.free.lock().expect("never poisoned");
        if n == 0 || n > free.len() {
            if n > 0 {
                self.full.fetch_add(1, Ordering::Relaxed);
            }
            return Err(StagingFull { want: n, free: free.len(), total: self.blocks });
        }
        let at = free.len() - n;
        let blocks = free.split_off(at);
        Ok(StagedBlocks { area: Arc::clone(self), blocks })
    }
}

/// One reservation's staging blocks, in prompt order; back to the area when dropped.
#[derive(Debug)]
pub struct StagedBlocks {
    area: Arc<StagingArea>,
    blocks: Vec<u32>,
}

impl StagedBlocks {
    /// The staging blocks, in prompt order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The address of the `i`-th prompt block's staging block.
    pub fn addr(&self, i: usize) -> usize {
        let b = self.area.bytes_per_block;
        self.area.memory.bytes().as_ptr() as usize + self.blocks[i] as usize * b
    }

    /// The bytes of the `i`-th prompt block, as its writer left them.
    ///
    /// Peers write these bytes from outside the process, as a NIC would: read them only after
    /// the writer's commit, which the protocol orders after its last put.
    pub fn block(&self, i: usize) -> &[u8] {
        let b = self.area.bytes_per_block;
        let at = self.blocks[i] as usize * b;
        &self.area.memory.bytes()[at..at + b]
    }
}

impl Drop for StagedBlocks {
    fn drop(&mut self) {
        let mut free = self.area.free.lock().expect("never poisoned");
        free.append(&mut self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_all_or_none_and_come_back_when_dropped() {
        let area =
            StagingArea::new(HostMemory::zeroed(4 * 64 + 10).expect("mem"), 64).expect("4 blocks");
        assert_eq!((area.blocks(), area.free_blocks()), (4, 4));
        let a = area.take(3).expect("3 of 4");
        assert_eq!(a.len(), 3);
        let full = area.take(2).expect_err("1 left");
        assert_eq!(full, StagingFull { want: 2, free: 1, total: 4 });
        assert_eq!(area.full(), 1);
        assert!(area.take(0).is_err(), "a reservation without blocks stages nothing");
        let b = area.take(1).expect("the last one");
        let mut all: Vec<u32> = a.blocks().iter().chain(b.blocks()).copied().collect();
        all.sort_unstable();
        assert_eq!(all, [0, 1, 2, 3], "each block handed out once");
        let base = area.region().addr();
        assert_eq!(b.addr(0), base + b.blocks()[0] as usize * 64);
        assert_eq!(a.block(1).len(), 64);
        drop(a);
        assert_eq!(area.free_blocks(), 3);
        drop(b);
        assert_eq!(area.take(4).expect("all back").len(), 4);
    }

    #[test]
    fn an_area_smaller_than_a_block_is_refused() {
        assert!(StagingArea::new(HostMemory::zeroed(63).expect("mem"), 64).is_err());
        assert!(StagingArea::new(HostMemory::zeroed(64).expect("mem"), 0).is_err());
    }
}
