//! Sealing what a UCX node hands to peers (worker addresses, remote keys): UCX trusts them
//! and aborts on a malformed one, so each carries a magic, its length and a tag, checked
//! before UCX sees it — an HMAC under the mesh's seal key, or without one a checksum.

use bytes::Bytes;

use super::UcxError;

const SEAL_MAGIC: &[u8; 4] = b"PDU1";
const KEYED_MAGIC: &[u8; 4] = b"PDU2";

/// The mesh's seal key (`set_seal_key`), when it has one.
static SEAL_KEY: std::sync::OnceLock<ring::hmac::Key> = std::sync::OnceLock::new();

/// Seals every worker address and remote key this process hands out, and refuses any not
/// sealed with it, by HMAC-SHA256 under `secret` (the mesh's shared seal key): a target
/// crafted by anyone without the key never reaches UCX. Set once, before any UCX node
/// starts; false if a key was set already.
pub fn set_seal_key(secret: &[u8]) -> bool {
    SEAL_KEY.set(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret)).is_ok()
}

/// A new seal key, as its file holds it (64 hex digits).
pub fn new_seal_key() -> String {
    let mut b = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .expect("the OS random source works");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Reads a seal key file (64 hex digits; surrounding whitespace ignored).
pub fn read_seal_key(path: &std::path::Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_seal_key(&text).ok_or_else(|| format!("{}: a seal key is 64 hex digits", path.display()))
}

/// A seal key's 32 bytes from its 64 hex digits (surrounding whitespace ignored).
pub fn parse_seal_key(text: &str) -> Option<Vec<u8>> {
    let hex = text.trim();
    let ok = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| {
        (0..32).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex")).collect()
    })
}

/// UCX trusts the worker addresses and remote keys it is given (a malformed one trips an
/// assertion that aborts the process), so the ones pdmesh hands to peers are sealed: a magic,
/// the length and a tag of the bytes, checked before UCX ever sees them. The tag is an
/// HMAC under the mesh's seal key when it has one, else a checksum (which stops accidents, not
/// forgers).
pub(super) fn seal(raw: &[u8]) -> Bytes {
    seal_with(SEAL_KEY.get(), raw)
}

pub(super) fn unseal(sealed: &Bytes, what: &str) -> Result<Bytes, UcxError> {
    unseal_with(SEAL_KEY.get(), sealed, what)
}

fn seal_with(key: Option<&ring::hmac::Key>, raw: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(raw.len() + 40);
    match key {
        Some(k) => {
            out.extend_from_slice(KEYED_MAGIC);
            out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
            out.extend_from_slice(ring::hmac::sign(k, raw).as_ref());
        }
        None => {
            out.extend_from_slice(SEAL_MAGIC);
            out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
            out.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(raw).to_le_bytes());
        }
    }
    out.extend_from_slice(raw);
    out.into()
}

fn unseal_with(
    key: Option<&ring::hmac::Key>,
    sealed: &Bytes,
    what: &str,
) -> Result<Bytes, UcxError> {
    let bad = |why: &str| UcxError::Usage(format!("malformed UCX {what}: {why}"));
    let (magic, tag_len) = match key {
        Some(_) => (KEYED_MAGIC, 32),
        None => (SEAL_MAGIC, 8),
    };
    let head = 8 + tag_len;
    if sealed.len() < head || &sealed[..4] != magic {
        return Err(bad(if key.is_some() {
            "not sealed with this mesh's key"
        } else {
            "not made by a pdmesh UCX node"
        }));
    }
    let len = u32::from_le_bytes(sealed[4..8].try_into().expect("4 bytes")) as usize;
    let raw = sealed.slice(head..);
    if raw.len() != len {
        return Err(bad("length does not match"));
    }
    let tag = &sealed[8..head];
    let ok = match key {
        Some(k) => ring::hmac::verify(k, &raw, tag).is_ok(),
        None => xxhash_rust::xxh3::xxh3_64(&raw).to_le_bytes() == tag,
    };
    if ok { Ok(raw) } else { Err(bad("its seal does not match")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_mesh_key_seals_what_its_nodes_accept() {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[7u8; 32]);
        let other = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[8u8; 32]);
        let raw = b"a packed remote key".as_slice();
        let sealed = seal_with(Some(&key), raw);
        assert_eq!(unseal_with(Some(&key), &sealed, "key").unwrap(), raw);
        // Another mesh's key, the unkeyed checksum anyone can compute, and a flipped byte.
        assert!(unseal_with(Some(&other), &sealed, "key").is_err());
        assert!(unseal_with(Some(&key), &seal_with(None, raw), "key").is_err());
        let mut bad = sealed.to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(unseal_with(Some(&key), &Bytes::from(bad), "key").is_err());
        // Without a key, the checksum still catches accidents.
        assert_eq!(unseal_with(None, &seal_with(None, raw), "key").unwrap(), raw);
        assert!(unseal_with(None, &sealed, "key").is_err());
    }
}
