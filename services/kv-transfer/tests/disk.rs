//! The disk tier of KV blocks on its own: blocks written and read back, found again by a tier
//! opened on the same directory (a restart), torn or foreign files detected and deleted rather
//! than served, and the byte budget kept by deleting the least recently used.

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::PathBuf;

use pdmesh_kv_transfer::disk::{DiskTier, ReadError};
use pdmesh_kv_types::{BlockHash, KvDtype, KvGeometry, KvLayout};

fn layout(fingerprint: u64) -> KvLayout {
    let geometry =
        KvGeometry { dtype: KvDtype::F16, block_size: 4, layers: 2, kv_heads: 1, head_dim: 8 };
    KvLayout { model_fingerprint: fingerprint, geometry, window: None }
}

fn block(i: u8) -> Vec<u8> {
    (0..layout(1).bytes_per_block()).map(|j| i.wrapping_mul(31).wrapping_add(j as u8)).collect()
}

/// Room for `blocks` blocks with their headers.
fn budget(blocks: u64) -> u64 {
    blocks * (layout(1).bytes_per_block() as u64 + 48)
}

fn file_of(tier: &DiskTier, h: BlockHash) -> PathBuf {
    tier.dir().join(format!("{:032x}.kv", h.0))
}

fn read(tier: &DiskTier, h: BlockHash) -> Result<Vec<u8>, ReadError> {
    let mut out = vec![0u8; layout(1).bytes_per_block()];
    tier.read(h, &mut out).map(|()| out)
}

#[test]
fn blocks_written_are_read_back_and_found_again_after_a_restart() {
    let root = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(root.path(), &layout(1), budget(10), true).unwrap();
    for i in 1..=3 {
        assert!(tier.put(BlockHash(i), &block(i as u8)).unwrap().is_empty());
    }
    // A second put of a block it has writes nothing.
    tier.put(BlockHash(2), &block(2)).unwrap();
    assert_eq!((tier.stats().blocks, tier.stats().writes), (3, 3));
    assert_eq!(read(&tier, BlockHash(2)).unwrap(), block(2));
    assert!(matches!(read(&tier, BlockHash(9)), Err(ReadError::Absent)));
    drop(tier);

    // The process dies and another opens the directory: everything is there.
    let again = DiskTier::open(root.path(), &layout(1), budget(10), true).unwrap();
    let s = again.stats();
    assert_eq!((s.recovered, s.blocks, s.corrupt), (3, 3, 0), "{s:?}");
    for i in 1..=3u8 {
        assert_eq!(read(&again, BlockHash(u128::from(i))).unwrap(), block(i));
    }
    // Another layout (another model) in the same root sees none of them, and keeps its own.
    let other = DiskTier::open(root.path(), &layout(2), budget(10), true).unwrap();
    assert_eq!(other.stats().blocks, 0);
    assert_ne!(other.dir(), again.dir());
}

/// What a crash mid-write can leave, and what a disk can do to a file: each is detected by its
/// header, length or checksum, deleted, counted, and never handed out as a block.
#[test]
fn torn_and_corrupted_files_are_detected_and_never_served() {
    let root = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(root.path(), &layout(1), budget(10), false).unwrap();
    for i in 1..=4 {
        tier.put(BlockHash(i), &block(i as u8)).unwrap();
    }
    // Torn: the tail of the data never reached the disk.
    let torn = file_of(&tier, BlockHash(1));
    let len = fs::metadata(&torn).unwrap().len();
    fs::OpenOptions::new().write(true).open(&torn).unwrap().set_len(len - 100).unwrap();
    // Rotted: one bit of the data flipped.
    let rotted = file_of(&tier, BlockHash(2));
    let mut bytes = fs::read(&rotted).unwrap();
    bytes[200] ^= 0x10;
    fs::write(&rotted, &bytes).unwrap();
    // Grown: bytes past the block.
    let grown = file_of(&tier, BlockHash(3));
    let mut bytes = fs::read(&grown).unwrap();
    bytes.push(0);
    fs::write(&grown, &bytes).unwrap();
    for h in [1, 2, 3] {
        let e = read(&tier, BlockHash(h)).unwrap_err();
        assert!(matches!(e, ReadError::Corrupt(_)), "block {h}: {e}");
        assert!(!tier.contains(BlockHash(h)), "block {h} still indexed");
        assert!(!file_of(&tier, BlockHash(h)).exists(), "block {h}'s file kept");
    }
    assert_eq!(tier.stats().corrupt, 3);
    assert_eq!(read(&tier, BlockHash(4)).unwrap(), block(4), "a sound file is untouched");

    // At start: a header torn off, a file under another block's name, and an interrupted
    // write's temporary file are all cleared; the sound block stays.
    let short = file_of(&tier, BlockHash(5));
    fs::write(&short, b"PDKVBL").unwrap();
    fs::copy(file_of(&tier, BlockHash(4)), file_of(&tier, BlockHash(6))).unwrap();
    let tmp = tier.dir().join(format!("{:032x}.tmp.1.0", 7u128));
    fs::write(&tmp, b"half a block").unwrap();
    drop(tier);
    let again = DiskTier::open(root.path(), &layout(1), budget(10), true).unwrap();
    let s = again.stats();
    assert_eq!((s.blocks, s.recovered, s.corrupt), (1, 1, 2), "{s:?}");
    assert!(!short.exists() && !tmp.exists());
    assert!(matches!(read(&again, BlockHash(6)), Err(ReadError::Absent)));
}

#[test]
fn the_budget_deletes_the_least_recently_used() {
    let root = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(root.path(), &layout(1), budget(2), true).unwrap();
    assert_eq!(tier.stats().capacity_blocks, 2);
    tier.put(BlockHash(1), &block(1)).unwrap();
    tier.put(BlockHash(2), &block(2)).unwrap();
    // Reading block 1 makes block 2 the least recently used.
    read(&tier, BlockHash(1)).unwrap();
    assert_eq!(tier.put(BlockHash(3), &block(3)).unwrap(), vec![BlockHash(2)]);
    assert!(!file_of(&tier, BlockHash(2)).exists());
    assert_eq!(tier.stats().evictions, 1);
    drop(tier);
    // A smaller budget next time: the oldest go at start.
    let one = DiskTier::open(root.path(), &layout(1), budget(1), true).unwrap();
    assert_eq!(one.stats().blocks, 1);
}
