//! The proof that a writer offered the decode node's shared pool runs on its host as its user.
//!
//! The shared pool is registered whole, so its key reaches every reservation in it. Socket
//! addresses cannot decide who gets it (a proxy or SNAT makes a remote peer look local), so the
//! key travels sealed (ChaCha20-Poly1305) under a secret that lives only in an owner-only file
//! on the decode node's host: a writer that can read that file runs as the decode node's user
//! on its host, and can read that node's certificate key and seal key as well (owner-only
//! files of the same user), so it could act as the node itself: the whole-pool key grants it
//! nothing new. Anyone else holds a sealed key it cannot open and puts through its
//! reservation's own scoped keys.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

/// The secret's file name: an offer naming any other file is refused unread.
pub const KEY_FILE: &str = "pdmesh-shared-pool.key";

/// The shared pool's range as writers receive it: its key sealed (once, when the pool is
/// offered) under the secret in `file`, which lives as long as the offer.
#[derive(Clone)]
pub struct SharedOffer {
    range: crate::descriptor::UcxRange,
    file: String,
    _dir: Arc<KeyDir>,
}

impl std::fmt::Debug for SharedOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedOffer").field("key_file", &self.file).finish()
    }
}

impl SharedOffer {
    /// Seals `range`'s key under a new secret, in a new owner-only file under the temporary
    /// directory.
    pub fn new(range: crate::descriptor::UcxRange) -> std::io::Result<Self> {
        Self::under(&std::env::temp_dir(), range)
    }

    fn under(parent: &Path, mut range: crate::descriptor::UcxRange) -> std::io::Result<Self> {
        let hex = crate::ucx::new_seal_key();
        let dir = parent.join(format!("pdmesh-kv-{}", &crate::ucx::new_seal_key()[..16]));
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        // `create` fails on anything already there: a directory planted under the same name
        // (by a user who shares the temporary directory) is never written into.
        b.create(&dir)?;
        let dir = KeyDir(dir);
        let file = dir.0.join(KEY_FILE);
        pdmesh_common::config::write_private(&file, hex.as_bytes())?;
        let secret = crate::ucx::parse_seal_key(&hex).expect("a seal key made above");
        range.rkey = seal(&key_of(&secret), &range.rkey);
        Ok(Self { range, file: file.display().to_string(), _dir: Arc::new(dir) })
    }

    /// The range with its key sealed, and the file whose secret opens it.
    pub fn offer(&self) -> (crate::descriptor::UcxRange, String) {
        (self.range.clone(), self.file.clone())
    }
}

/// The directory of an offer's secret, removed with the offer.
struct KeyDir(PathBuf);

impl Drop for KeyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `plain` sealed under `key` with a random 96-bit nonce (written first).
fn seal(key: &LessSafeKey, plain: &[u8]) -> Bytes {
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new().fill(&mut nonce).expect("the OS random source works");
    let mut body = plain.to_vec();
    key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut body)
        .expect("an rkey is far below ChaCha20's length limit");
    let mut out = nonce.to_vec();
    out.extend_from_slice(&body);
    out.into()
}

fn key_of(secret: &[u8]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, secret).expect("a 32-byte key"))
}

/// Opens a key `sealed` under the secret in `key_file`: only a process that can read that file
/// (the decode node's user on its host) can. The file is named by the decode node, so only
/// an absolute path to a file called `KEY_FILE` holding a key is read.
pub fn open(key_file: &str, sealed: &[u8]) -> Result<Bytes, String> {
    let path = Path::new(key_file);
    if !path.is_absolute() || path.file_name().is_none_or(|n| n != KEY_FILE) {
        return Err(format!("{key_file:?} is not a shared pool's key file"));
    }
    let secret = crate::ucx::read_seal_key(path)?;
    if sealed.len() < NONCE_LEN {
        return Err("the sealed key is too short".into());
    }
    let (nonce, body) = sealed.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| "a bad nonce".to_string())?;
    let mut body = body.to_vec();
    let plain = key_of(&secret)
        .open_in_place(nonce, Aad::empty(), &mut body)
        .map_err(|_| format!("{key_file}'s key does not open this offer"))?;
    Ok(Bytes::copy_from_slice(plain))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::descriptor::UcxRange;

    fn offer() -> SharedOffer {
        let range = UcxRange { base: 0x1000, len: 4096, rkey: Bytes::from_static(b"pool-key") };
        SharedOffer::new(range).unwrap()
    }

    #[test]
    fn a_writer_that_reads_the_file_opens_the_key() {
        let o = offer();
        let (range, file) = o.offer();
        assert_eq!((range.base, range.len), (0x1000, 4096));
        assert_eq!(open(&file, &range.rkey).unwrap(), Bytes::from_static(b"pool-key"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(Path::new(&file)), 0o600);
            assert_eq!(mode(Path::new(&file).parent().unwrap()), 0o700);
        }
    }

    /// The attacker holds a node certificate and a capability, and reaches the decode node
    /// through an address that looks local (a proxy on its host), but runs elsewhere: it sees
    /// the offer and the file's name, never the file. Before the proof the offer carried the
    /// whole pool's key itself.
    #[test]
    fn an_offer_without_the_file_opens_nothing() {
        let o = offer();
        let (range, file) = o.offer();
        assert_ne!(&range.rkey[..], b"pool-key", "the pool's key crossed the wire as it is");
        // Its own host has no such file, or one of another node's.
        let elsewhere = offer();
        let (_, other) = elsewhere.offer();
        assert!(open(&other, &range.rkey).is_err());
        // Tampered or truncated offers are refused, even with the right file.
        let mut bent = range.rkey.to_vec();
        *bent.last_mut().unwrap() ^= 1;
        assert!(open(&file, &bent).is_err());
        assert!(open(&file, &range.rkey[..4]).is_err());
        assert!(open(&file, &range.rkey).is_ok());
        drop(o);
        assert!(open(&file, &range.rkey).is_err(), "the key outlived the pool's node");
        // A decode node that names another file gets it unread.
        assert!(open("/etc/passwd", &range.rkey).unwrap_err().contains("not a shared pool"));
        assert!(open(KEY_FILE, &range.rkey).unwrap_err().contains("not a shared pool"));
    }

    #[test]
    fn each_secret_has_a_directory_of_its_own_gone_with_it() {
        let base = std::env::temp_dir().join(format!("pdmesh-plant-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let range = || UcxRange { base: 0, len: 1, rkey: Bytes::from_static(b"k") };
        let s = SharedOffer::under(&base, range()).unwrap();
        let t = SharedOffer::under(&base, range()).unwrap();
        let dir = |o: &SharedOffer| Path::new(&o.file).parent().unwrap().to_path_buf();
        assert_ne!(dir(&s), dir(&t));
        let gone = dir(&s);
        drop(s);
        assert!(!gone.exists(), "the secret stays on disk after its node");
        drop(t);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
