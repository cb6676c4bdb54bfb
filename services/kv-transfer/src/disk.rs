//! A warm tier of KV blocks on local disk, for the KV-store and for a prefill node's own prefix
//! cache: every block stored is also written to a file in a directory, under a byte budget of
//! its own, so that they hold more than their RAM and a restarted (or replacement) process
//! serves what the last one held.
//!
//! - One file per block, `<dir>/<layout>/<hash>.kv`: a header (magic, the layout's tag, the
//!   block's hash, its length and the xxh3-64 checksum of its bytes), then the bytes. The
//!   layout's directory keeps another model's or block size's blocks apart.
//! - Written crash-safe: to a temporary name, synced (`sync`), then renamed over the final
//!   name, so a file under a block's name is whole or absent; a torn one (a crash between
//!   write and sync on a machine that lost power, a disk that lied) fails its checksum.
//! - Read back checked: a file whose header or checksum is wrong is deleted and counted,
//!   never served.
//! - At start, the directory is scanned (headers only) and its blocks indexed, oldest first in
//!   LRU order; leftover temporary files are removed.
//! - Past the budget, the least recently used block's file is deleted.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use pdmesh_kv_types::{BlockHash, KvLayout, block_checksum};

const MAGIC: &[u8; 8] = b"PDKVBLK1";
/// magic, layout tag, hash, length, checksum.
const HEADER: usize = 8 + 8 + 16 + 8 + 8;

/// Counters of the disk tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub blocks: u64,
    pub bytes: u64,
    pub capacity_blocks: u64,
    /// Blocks written, and reads of blocks back into RAM.
    pub writes: u64,
    pub reads: u64,
    /// Files deleted to stay in the budget.
    pub evictions: u64,
    /// Files found torn or foreign (bad header, length or checksum) and deleted.
    pub corrupt: u64,
    /// Writes that failed (a full disk, a permission): the block stays in RAM only.
    pub write_errors: u64,
    /// Blocks found on disk at start.
    pub recovered: u64,
}

#[derive(Debug)]
struct Index {
    /// Each block's last use: its key in `lru`.
    ticks: HashMap<BlockHash, u64>,
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    stats: DiskStats,
}

impl Index {
    fn touch(&mut self, h: BlockHash) {
        self.tick += 1;
        if let Some(old) = self.ticks.insert(h, self.tick) {
            self.lru.remove(&old);
        }
        self.lru.insert(self.tick, h);
    }

    fn forget(&mut self, h: BlockHash) -> bool {
        match self.ticks.remove(&h) {
            Some(t) => {
                self.lru.remove(&t);
                true
            }
            None => false,
        }
    }
}

/// Blocks of one layout in a directory.
#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    tag: u64,
    block_bytes: usize,
    capacity: usize,
    sync: bool,
    index: Mutex<Index>,
}

/// Why a block read from disk is not served.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("not on disk")]
    Absent,
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}: deleted")]
    Corrupt(String),
}

impl DiskTier {
    /// The tier for `layout` in `root` (its own subdirectory), holding at most `budget_bytes`
    /// of blocks: what is there already is indexed. `sync`: each file is synced to the disk
    /// before it counts as written.
    pub fn open(root: &Path, layout: &KvLayout, budget_bytes: u64, sync: bool) -> io::Result<Self> {
        let block_bytes = layout.bytes_per_block();
        let tag = layout_tag(layout);
        let dir = root.join(format!("{tag:016x}"));
        fs::create_dir_all(&dir)?;
        let capacity =
            usize::try_from(budget_bytes / (HEADER + block_bytes) as u64).unwrap_or(usize::MAX);
        let tier = Self {
            dir,
            tag,
            block_bytes,
            capacity,
            sync,
            index: Mutex::new(Index {
                ticks: HashMap::new(),
                lru: BTreeMap::new(),
                tick: 0,
                stats: DiskStats { capacity_blocks: capacity as u64, ..Default::default() },
            }),
        };
        tier.recover()?;
        Ok(tier)
    }

    /// `open` off the async threads, logging what it found; the error names the directory.
    pub async fn open_logged(
        root: &Path,
        layout: &KvLayout,
        budget_bytes: u64,
        sync: bool,
        what: &'static str,
    ) -> Result<Self, String> {
        let (dir, layout) = (root.to_path_buf(), *layout);
        let opened =
            tokio::task::spawn_blocking(move || Self::open(&dir, &layout, budget_bytes, sync))
                .await
                .map_err(|e| format!("{}: {e}", root.display()))?
                .map_err(|e| format!("{}: {e}", root.display()))?;
        let s = opened.stats();
        tracing::info!(dir = %opened.dir().display(), recovered = s.recovered, corrupt = s.corrupt, capacity_blocks = s.capacity_blocks, "{what} disk tier open");
        Ok(opened)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn path(&self, h: BlockHash) -> PathBuf {
        self.dir.join(format!("{:032x}.kv", h.0))
    }

    /// Indexes the blocks in the directory, least recently written first; deletes temporary
    /// files, and files that are not a block of this layout by their name, size or header.
    fn recover(&self) -> io::Result<()> {
        let mut found = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let hash = name
                .strip_suffix(".kv")
                .and_then(|hex| u128::from_str_radix(hex, 16).ok())
                .map(BlockHash);
            let Some(h) = hash else {
                // An interrupted write's temporary file, or something that is no block.
                if name.contains(".tmp") {
                    let _ = fs::remove_file(&path);
                }
                continue;
            };
            match self.header_of(&path) {
                Ok(header) if header.hash == h && header.len == self.block_bytes => {
                    let modified = entry.metadata()?.modified()?;
                    found.push((modified, h));
                }
                _ => {
                    tracing::warn!(file = %path.display(), "a KV block file that is not one of this layout's: deleted");
                    let _ = fs::remove_file(&path);
                    self.lock().stats.corrupt += 1;
                }
            }
        }
        found.sort();
        let mut ix = self.lock();
        let recovered = found.len();
        for (_, h) in found {
            ix.touch(h);
        }
        ix.stats.recovered = recovered as u64;
        drop(ix);
        // A smaller budget than the last run's: the oldest go.
        self.evict_to(self.capacity);
        Ok(())
    }

    fn header_of(&self, path: &Path) -> io::Result<Header> {
        let mut buf = [0u8; HEADER];
        File::open(path)?.read_exact(&mut buf)?;
        Header::parse(&buf, self.tag)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a KV block header"))
    }

    /// Whether block `h` is on disk.
    pub fn contains(&self, h: BlockHash) -> bool {
        self.lock().ticks.contains_key(&h)
    }

    /// Every block on disk.
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.lock().ticks.keys().copied().collect()
    }

    /// Writes block `h` (unless it is there), evicting the least recently used beyond the
    /// budget. Returns the blocks evicted.
    pub fn put(&self, h: BlockHash, data: &[u8]) -> io::Result<Vec<BlockHash>> {
        assert_eq!(data.len(), self.block_bytes, "a block of this layout");
        if self.capacity == 0 || self.contains(h) {
            return Ok(Vec::new());
        }
        if let Err(e) = self.write_file(h, data) {
            self.lock().stats.write_errors += 1;
            return Err(e);
        }
        let mut ix = self.lock();
        ix.touch(h);
        ix.stats.writes += 1;
        drop(ix);
        Ok(self.evict_to(self.capacity))
    }

    fn write_file(&self, h: BlockHash, data: &[u8]) -> io::Result<()> {
        let header =
            Header { tag: self.tag, hash: h, len: data.len(), checksum: block_checksum(data) };
        // A temporary file of its own per writer (two puts of one block never share one),
        // deleted if the write fails before the rename.
        let mut f = tempfile::Builder::new()
            .prefix(&format!("{:032x}.", h.0))
            .suffix(".tmp")
            .tempfile_in(&self.dir)?;
        f.write_all(&header.bytes())?;
        f.write_all(data)?;
        if self.sync {
            f.as_file().sync_all()?;
        }
        f.persist(self.path(h)).map(drop).map_err(|e| e.error)
    }

    /// Block `h`'s bytes into `out` (one block long), checked against its header and checksum;
    /// a file that fails is deleted and counted. Marks the block used.
    pub fn read(&self, h: BlockHash, out: &mut [u8]) -> Result<(), ReadError> {
        if !self.contains(h) {
            return Err(ReadError::Absent);
        }
        let path = self.path(h);
        let checked = (|| -> Result<(), ReadError> {
            let short = |e: io::Error| match e.kind() {
                io::ErrorKind::UnexpectedEof => {
                    ReadError::Corrupt("shorter than its header".into())
                }
                _ => ReadError::Io(e),
            };
            let mut f = File::open(&path)?;
            let mut head = [0u8; HEADER];
            f.read_exact(&mut head).map_err(short)?;
            let header = Header::parse(&head, self.tag)
                .ok_or_else(|| ReadError::Corrupt("a foreign or torn header".into()))?;
            if header.hash != h || header.len != out.len() {
                return Err(ReadError::Corrupt(format!(
                    "header names {} of {} bytes",
                    header.hash, header.len
                )));
            }
            f.read_exact(out).map_err(short)?;
            if f.read(&mut [0u8; 1])? != 0 {
                return Err(ReadError::Corrupt("longer than its header".into()));
            }
            if block_checksum(out) != header.checksum {
                return Err(ReadError::Corrupt("checksum mismatch".into()));
            }
            Ok(())
        })();
        let mut ix = self.lock();
        match &checked {
            Ok(()) => {
                ix.touch(h);
                ix.stats.reads += 1;
            }
            Err(ReadError::Corrupt(why)) => {
                tracing::warn!(block = %h, file = %path.display(), "KV block file {why}: deleted, not served");
                ix.forget(h);
                ix.stats.corrupt += 1;
                let _ = fs::remove_file(&path);
            }
            Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                // Deleted behind our back: it is not on disk.
                ix.forget(h);
            }
            Err(_) => {}
        }
        checked
    }

    /// Deletes least recently used files until at most `keep` remain; returns their blocks.
    fn evict_to(&self, keep: usize) -> Vec<BlockHash> {
        let mut gone = Vec::new();
        let mut ix = self.lock();
        while ix.ticks.len() > keep {
            let Some((_, h)) = ix.lru.pop_first() else { break };
            ix.ticks.remove(&h);
            ix.stats.evictions += 1;
            gone.push(h);
        }
        drop(ix);
        for h in &gone {
            let _ = fs::remove_file(self.path(*h));
        }
        gone
    }

    pub fn stats(&self) -> DiskStats {
        let ix = self.lock();
        let mut s = ix.stats;
        s.blocks = ix.ticks.len() as u64;
        s.bytes = s.blocks * self.block_bytes as u64;
        s
    }

    /// The directory its files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A layout's identity in file headers and directory names: its fingerprint and geometry.
fn layout_tag(layout: &KvLayout) -> u64 {
    let g = &layout.geometry;
    let s = format!(
        "{:016x}/{}/{}/{}/{}/{}",
        layout.model_fingerprint, g.layers, g.kv_heads, g.head_dim, g.block_size, g.dtype
    );
    xxhash_rust::xxh3::xxh3_64(s.as_bytes())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    tag: u64,
    hash: BlockHash,
    len: usize,
    checksum: u64,
}

impl Header {
    fn bytes(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[..8].copy_from_slice(MAGIC);
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..32].copy_from_slice(&self.hash.0.to_le_bytes());
        b[32..40].copy_from_slice(&(self.len as u64).to_le_bytes());
        b[40..48].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// The header in `b`, if it is one of layout `tag`'s.
    fn parse(b: &[u8; HEADER], tag: u64) -> Option<Self> {
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if &b[..8] != MAGIC || u64_at(8) != tag {
            return None;
        }
        let hash = BlockHash(u128::from_le_bytes(b[16..32].try_into().expect("16 bytes")));
        let len = usize::try_from(u64_at(32)).ok()?;
        Some(Self { tag, hash, len, checksum: u64_at(40) })
    }
}
