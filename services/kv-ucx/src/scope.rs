//! RDMA access scoped to one reservation (decode) or one lease (KV-store). Instead of one
//! remote key for a whole pool, the blocks a peer may touch are registered for that purpose
//! alone — remote write into a reservation's prompt blocks, remote read of a lease's matched
//! blocks — as a few ranges (runs of neighbouring blocks), each with its own key, and the
//! registration is dropped (revoked) when the reservation's KV is complete or the lease ends.
//! The peer checks every address against the ranges it was given before UCX sees it.
//!
//! On RDMA hardware the NIC enforces a key's range and rights; UCX's TCP, shared-memory and
//! software paths check neither, so there the scoping keeps honest peers inside their blocks
//! and the mesh's roles keep others from holding a key at all.

use crate::descriptor::UcxRange;
use pdmesh_kv_types::MemoryRegion;

use crate::ucx::{Access, Endpoint, Region, RemoteKey, UcxError, UcxNode};

/// Ranges one target may name: more would be a fragmented pool (or a forged target), and
/// each costs a registration and an unpack.
pub const MAX_RANGES: usize = 4096;

/// The registrations behind one target; dropping it revokes them.
#[derive(Debug)]
pub struct Registered {
    _regions: Vec<Region>,
}

/// Registers the pool `blocks` (indices into `memory`, of `bytes_per_block` each) for `access`
/// as runs of neighbouring blocks. Returns the ranges (base, length, sealed key), the address
/// of each block in the order given, and the grant that keeps them registered.
pub fn grant(
    node: &UcxNode,
    memory: &MemoryRegion,
    blocks: &[u32],
    bytes_per_block: u64,
    access: Access,
) -> Result<(Vec<UcxRange>, Vec<u64>, Registered), UcxError> {
    let base = memory.addr() as u64;
    let addrs = blocks.iter().map(|&b| base + u64::from(b) * bytes_per_block).collect();
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut ranges = Vec::new();
    let mut regions = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut run = 1;
        while i + run < sorted.len() && sorted[i + run] == sorted[i] + run as u32 {
            run += 1;
        }
        let offset = u64::from(sorted[i]) * bytes_per_block;
        let len = run as u64 * bytes_per_block;
        let region = node.register_within(memory, offset as usize, len as usize, access)?;
        ranges.push(UcxRange { base: region.base(), len, rkey: region.rkey().clone() });
        regions.push(region);
        i += run;
    }
    Ok((ranges, addrs, Registered { _regions: regions }))
}

/// Why a target's ranges or addresses are refused.
fn invalid(why: String) -> UcxError {
    UcxError::Usage(format!("UCX target: {why}"))
}

/// Checks that `ranges` are well formed (not empty, within the count limit, non-overlapping)
/// and that every `[addr, addr + unit)` of `addrs` lies inside one of them.
pub fn check(ranges: &[UcxRange], addrs: &[u64], unit: u64) -> Result<(), UcxError> {
    if ranges.is_empty() || ranges.len() > MAX_RANGES {
        return Err(invalid(format!("{} ranges (1..={MAX_RANGES} allowed)", ranges.len())));
    }
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for r in ranges {
        let end = r.base.checked_add(r.len).filter(|_| r.len > 0);
        let end =
            end.ok_or_else(|| invalid(format!("range at {:#x} of {} bytes", r.base, r.len)))?;
        spans.push((r.base, end));
    }
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(invalid("overlapping ranges".into()));
    }
    for &a in addrs {
        if find(&spans, a, unit).is_none() {
            return Err(invalid(format!("block at {a:#x} lies outside every range")));
        }
    }
    Ok(())
}

/// The index of the span in sorted `spans` that holds `[addr, addr + len)`.
fn find(spans: &[(u64, u64)], addr: u64, len: u64) -> Option<usize> {
    let i = spans.partition_point(|s| s.0 <= addr).checked_sub(1)?;
    let end = addr.checked_add(len)?;
    (end <= spans[i].1).then_some(i)
}

/// What a UCX session names as the memory it writes: a digest of the ranges (order aside).
pub fn digest(ranges: &[UcxRange]) -> u64 {
    let mut sorted: Vec<&UcxRange> = ranges.iter().collect();
    sorted.sort_unstable_by_key(|r| r.base);
    let mut buf = Vec::new();
    for r in sorted {
        buf.extend_from_slice(&r.base.to_le_bytes());
        buf.extend_from_slice(&r.len.to_le_bytes());
        buf.extend_from_slice(&(r.rkey.len() as u32).to_le_bytes());
        buf.extend_from_slice(&r.rkey);
    }
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// A target's ranges with their keys unpacked on one endpoint.
#[derive(Debug)]
pub struct Keys {
    spans: Vec<(u64, u64)>,
    keys: Vec<RemoteKey>,
}

impl Keys {
    /// Unpacks the keys of `ranges` (checked with `check` first) on `ep`.
    pub async fn unpack(ep: &Endpoint, ranges: &[UcxRange]) -> Result<Self, UcxError> {
        let mut sorted: Vec<&UcxRange> = ranges.iter().collect();
        sorted.sort_unstable_by_key(|r| r.base);
        let mut spans = Vec::with_capacity(sorted.len());
        let mut keys = Vec::with_capacity(sorted.len());
        for r in sorted {
            keys.push(ep.remote_key(r.rkey.clone()).await?);
            spans.push((r.base, r.base + r.len));
        }
        Ok(Self { spans, keys })
    }

    /// The key for `[addr, addr + len)`, if one range holds all of it.
    pub fn key(&self, addr: u64, len: u64) -> Option<&RemoteKey> {
        find(&self.spans, addr, len).map(|i| &self.keys[i])
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn range(base: u64, len: u64) -> UcxRange {
        UcxRange { base, len, rkey: Bytes::new() }
    }

    #[test]
    fn every_block_must_lie_inside_a_range() {
        let r = [range(1000, 300), range(2000, 100)];
        assert!(check(&r, &[1000, 1100, 1200, 2000], 100).is_ok());
        // One byte past the end of a range, a block between ranges, one straddling an end.
        for bad in [1201, 1500, 1250, 2001, 999] {
            assert!(check(&r, &[bad], 100).is_err(), "{bad}");
        }
        assert!(check(&r, &[u64::MAX - 10], 100).is_err());
        assert!(check(&[], &[], 100).is_err());
        assert!(check(&[range(0, 0)], &[], 100).is_err());
        assert!(check(&[range(u64::MAX, 2)], &[], 100).is_err());
        assert!(check(&[range(0, 200), range(100, 200)], &[], 100).is_err(), "overlap");
    }
}
