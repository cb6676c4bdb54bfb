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

/// The shared pool's range with the secret its key is sealed under for each writer.
#[derive(Clone)]
pub struct SharedOffer {
    range: pdmesh_proto::v1::UcxRange,
    secret: Arc<HostSecret>,
}

impl std::fmt::Debug for SharedOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedOffer").field("key_file", &self.secret.file).finish()
    }
}

impl SharedOffer {
    /// Makes the secret for `range` (a new owner-only file under the temporary directory).
    pub fn new(range: pdmesh_proto::v1::UcxRange) -> std::io::Result<Self> {
        Ok(Self { range, secret: Arc::new(HostSecret::create(&std::env::temp_dir())?) })
    }

    /// The range as one writer receives it, its key sealed, and the file that opens it.
    pub fn offer(&self) -> (pdmesh_proto::v1::UcxRange, String) {
        let mut range = self.range.clone();
        range.rkey = self.secret.seal(&range.rkey);
        (range, self.secret.file.display().to_string())
    }

    /// The range with its key unsealed, as this node registered it.
    pub fn range(&self) -> &pdmesh_proto::v1::UcxRange {
        &self.range
    }
}

/// A random key in an owner-only file of a directory of its own, removed with it.
struct HostSecret {
    key: LessSafeKey,
    dir: PathBuf,
    file: PathBuf,
}

impl HostSecret {
    fn create(under: &Path) -> std::io::Result<Self> {
        let hex = crate::ucx::new_seal_key();
        let dir = under.join(format!("pdmesh-kv-{}", &crate::ucx::new_seal_key()[..16]));
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        // `create` fails on anything already there: a directory planted under the same name
        // (by a user who shares the temporary directory) is never written into.
        b.create(&dir)?;
        let file = dir.join(KEY_FILE);
        if let Err(e) = pdmesh_common::config::write_private(&file, hex.as_bytes()) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let key = key_of(&crate::ucx::read_seal_key(&file).map_err(std::io::Error::other)?);
        Ok(Self { key, dir, file })
    }

    fn seal(&self, plain: &[u8]) -> Bytes {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new().fill(&mut nonce).expect("the OS random source works");
        let mut body = plain.to_vec();
        // A random 96-bit nonce per offer: a repeat is as likely as guessing the key.
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut body)
            .expect("an rkey is far below ChaCha20's length limit");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&body);
        out.into()
    }
}

impl Drop for HostSecret {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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
    use pdmesh_proto::v1::UcxRange;

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
        // Each offer is sealed anew: one seen on the wire says nothing of the next.
        assert_ne!(o.offer().0.rkey, range.rkey);
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
        assert_ne!(range.rkey, o.range().rkey, "the pool's key crossed the wire as it is");
        // Its own host has no such file, or one of another node's.
        let elsewhere = offer();
        let (_, other) = elsewhere.offer();
        assert!(open(&other, &range.rkey).is_err());
        drop(o);
        assert!(open(&file, &range.rkey).is_err(), "the key outlived the pool's node");
        // A decode node that names another file gets it unread.
        assert!(open("/etc/passwd", &range.rkey).unwrap_err().contains("not a shared pool"));
        assert!(open(KEY_FILE, &range.rkey).unwrap_err().contains("not a shared pool"));
        // Tampered or truncated offers are refused, never opened to something else.
        let mut bent = range.rkey.to_vec();
        *bent.last_mut().unwrap() ^= 1;
        assert!(open(&other, &bent).is_err());
        assert!(open(&other, &range.rkey[..4]).is_err());
    }

    #[test]
    fn each_secret_has_a_directory_of_its_own_gone_with_it() {
        let base = std::env::temp_dir().join(format!("pdmesh-plant-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let s = HostSecret::create(&base).unwrap();
        // A second secret under the same parent gets a directory of its own.
        let t = HostSecret::create(&base).unwrap();
        assert_ne!(s.dir, t.dir);
        let dir = s.dir.clone();
        drop(s);
        assert!(!dir.exists(), "the secret stays on disk after its node");
        drop(t);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
