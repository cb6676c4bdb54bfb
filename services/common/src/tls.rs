//! Mutual TLS between the mesh's processes, and who a caller is. Each process holds a
//! certificate, signed by the mesh's CA, that names it (`CN`) and its role (a
//! `pdmesh://ROLE/NAME` URI); internal servers demand such a certificate from every client,
//! every client checks the server's against the same CA, and [`Peer`] is what a server reads
//! from the caller's certificate to decide what it may do (`authz`).
//!
//! The process's TLS is set once at start (`init`); `endpoint` then dials whatever a service
//! dials with it, so no call site decides on its own. The files are watched (`watch`): a
//! certificate renewed on disk (cert-manager rewriting a Secret) is served to the next
//! connection without a restart, and clients dial with it from then on.
//!
//! [`Ca`] makes a throwaway CA and certificates (rcgen), as `pdmesh up` and the tests do; a
//! deployment brings its own in the same files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::config::{FileStamp, file_stamp};

/// The name a client of the public API verifies: only routers' certificates carry it.
/// Processes are dialled by address, so identity is the CA's signature and the name inside,
/// not the host.
pub const MESH_NAME: &str = "pdmesh.internal";

/// The DNS name a certificate of `role` carries and a client dialling a process of that
/// role verifies (`decode.pdmesh.internal`): a certificate of another role (an admin's, a
/// KV-store's) is refused as that server, whoever redirects the traffic to its holder.
pub fn role_name(role: MeshRole) -> String {
    format!("{role}.{MESH_NAME}")
}

/// The scheme of the URI that names a certificate's role and node.
const ROLE_URI: &str = "pdmesh://";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("making certificates: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("{0:?} is not a valid certificate name (letters, digits, '-', '_' and '.')")]
    Name(String),
    #[error("{path}: {problem}")]
    Pem { path: PathBuf, problem: String },
    #[error("{0}: the certificate names no pdmesh role (a pdmesh://ROLE/NAME URI)")]
    NoRole(PathBuf),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("TLS client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// What a certificate lets its holder do in the mesh (`authz` maps calls to roles).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MeshRole {
    Router,
    Prefill,
    Decode,
    KvStore,
    /// Operators and their tools: membership listings and node statistics, no requests.
    Admin,
}

impl MeshRole {
    pub const ALL: [MeshRole; 5] =
        [Self::Router, Self::Prefill, Self::Decode, Self::KvStore, Self::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Self::Router => "router",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::KvStore => "kvstore",
            Self::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }
}

impl std::fmt::Display for MeshRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A verified caller: the role and node name its certificate carries. Servers put it in
/// each request's extensions (`authz`), where handlers that care about *which* node calls
/// (a heartbeat only for itself, a store write only from a prefill node) read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub role: MeshRole,
    pub name: String,
}

impl Peer {
    /// The identity in a (CA-verified) certificate: its first `pdmesh://ROLE/NAME` URI.
    pub fn from_der(der: &[u8]) -> Option<Peer> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        san.value.general_names.iter().find_map(|g| match g {
            x509_parser::extensions::GeneralName::URI(u) => {
                let (role, name) = u.strip_prefix(ROLE_URI)?.split_once('/')?;
                check_name(name).ok()?;
                Some(Peer { role: MeshRole::parse(role)?, name: name.to_string() })
            }
            _ => None,
        })
    }
}

fn check_name(name: &str) -> Result<(), TlsError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok { Ok(()) } else { Err(TlsError::Name(name.into())) }
}

/// The three files of one process's TLS, as last read, with the configurations made of them.
struct Material {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
    /// Internal listeners: a client certificate from the mesh CA is required.
    internal: Arc<rustls::ServerConfig>,
    /// The public listener: clients authenticate with API keys; a certificate is optional.
    public: Arc<rustls::ServerConfig>,
    /// `public` for HTTPS: HTTP/1.1 offered beside HTTP/2.
    https: Arc<rustls::ServerConfig>,
    /// The mesh CA, for clients that check a server by it.
    roots: Arc<rustls::RootCertStore>,
    peer: Peer,
    stamp: Vec<FileStamp>,
}

/// One process's TLS: the mesh CA, its certificate and key, from `DIR/ca.pem`, `DIR/NAME.pem`
/// and `DIR/NAME.key`, re-read by `reload`.
pub struct MeshTls {
    dir: PathBuf,
    name: String,
    current: RwLock<Arc<Material>>,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTls").field("dir", &self.dir).field("name", &self.name).finish()
    }
}

/// ring's suites with AES-128-GCM first: every mesh connection is ours at both ends, and
/// AES-128 (10 rounds to AES-256's 14) is what bounds how fast KV moves over gRPC.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    let first = rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
    p.cipher_suites.sort_by_key(|s| s.suite() != first);
    Arc::new(p)
}

fn pem_error(path: &Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::Pem { path: path.to_path_buf(), problem: e.to_string() }
}

impl MeshTls {
    fn files(dir: &Path, name: &str) -> [PathBuf; 3] {
        [dir.join("ca.pem"), dir.join(format!("{name}.pem")), dir.join(format!("{name}.key"))]
    }

    fn stamp(files: &[PathBuf; 3]) -> Vec<FileStamp> {
        files.iter().map(|f| file_stamp(f)).collect()
    }

    fn read(dir: &Path, name: &str) -> Result<Material, TlsError> {
        check_name(name)?;
        let files = Self::files(dir, name);
        let stamp = Self::stamp(&files);
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|source| TlsError::Read { path: path.clone(), source })
        };
        let (ca, cert, key) = (read(&files[0])?, read(&files[1])?, read(&files[2])?);
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&ca) {
            roots
                .add(c.map_err(|e| pem_error(&files[0], e))?)
                .map_err(|e| pem_error(&files[0], e))?;
        }
        let chain = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_error(&files[1], e))?;
        let leaf = chain.first().ok_or_else(|| pem_error(&files[1], "no certificate"))?;
        let peer = Peer::from_der(leaf).ok_or_else(|| TlsError::NoRole(files[1].clone()))?;
        let private = PrivateKeyDer::from_pem_slice(&key).map_err(|e| pem_error(&files[2], e))?;
        let roots = Arc::new(roots);
        let server =
            |optional: bool, alpn: &[&[u8]]| -> Result<Arc<rustls::ServerConfig>, TlsError> {
                let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::clone(&roots),
                    provider(),
                );
                let v = if optional { v.allow_unauthenticated().build()? } else { v.build()? };
                let mut c = rustls::ServerConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()?
                    .with_client_cert_verifier(v)
                    .with_single_cert(chain.clone(), private.clone_key())?;
                c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
                // Ours, not the client's (tonic's client builds its own provider's order).
                c.ignore_client_order = true;
                Ok(Arc::new(c))
            };
        // gRPC is HTTP/2 only, and tonic's clients insist on negotiating it; most HTTP
        // clients (the OpenAI SDK's) ask for HTTP/1.1.
        let (h2, http11): (&[u8], &[u8]) = (b"h2", b"http/1.1");
        Ok(Material {
            internal: server(false, &[h2])?,
            public: server(true, &[h2])?,
            https: server(true, &[h2, http11])?,
            roots,
            ca,
            cert,
            key,
            peer,
            stamp,
        })
    }

    /// Reads and checks `DIR/ca.pem`, `DIR/NAME.pem` (which must carry a pdmesh role) and
    /// `DIR/NAME.key`.
    pub fn load(dir: &Path, name: &str) -> Result<Self, TlsError> {
        let m = Self::read(dir, name)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            name: name.to_string(),
            current: RwLock::new(Arc::new(m)),
        })
    }

    fn material(&self) -> Arc<Material> {
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Re-reads the files if any changed since the last read. Ok(true) when new material is
    /// in use; an error leaves the old in use.
    pub fn reload(&self) -> Result<bool, TlsError> {
        if Self::stamp(&Self::files(&self.dir, &self.name)) == self.material().stamp {
            return Ok(false);
        }
        let m = Self::read(&self.dir, &self.name)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(m);
        GENERATION.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Who this process is, by its certificate.
    pub fn identity(&self) -> Peer {
        self.material().peer.clone()
    }

    /// What an internal server presents and demands, as of the last read.
    pub fn internal_server(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.material().internal)
    }

    /// What the public server presents (a client certificate is optional there).
    pub fn public_server(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.material().public)
    }

    /// What the public HTTPS server (the OpenAI API) presents: `public_server`, offering
    /// HTTP/1.1 and HTTP/2.
    pub fn https_server(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.material().https)
    }

    /// An HTTPS client of the mesh's public servers (HTTP/2 negotiated): it trusts the mesh
    /// CA and presents no certificate (public callers authenticate with API keys). The server
    /// is checked as `MESH_NAME`.
    pub fn https_client(&self) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let mut c = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(Arc::clone(&self.material().roots))
            .with_no_client_auth();
        c.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(c))
    }

    /// What a client of a process of role `serves` presents and checks.
    pub fn client(&self, serves: MeshRole) -> ClientTlsConfig {
        let m = self.material();
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&m.ca))
            .identity(Identity::from_pem(&m.cert, &m.key))
            .domain_name(role_name(serves))
    }
}

static PROCESS_TLS: OnceLock<Option<MeshTls>> = OnceLock::new();
/// Bumped at every reload: caches of client channels drop channels dialled before it.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Sets this process's TLS (None: plaintext, `--insecure`). Once: a second call changes
/// nothing and returns false.
pub fn init(tls: Option<MeshTls>) -> bool {
    PROCESS_TLS.set(tls).is_ok()
}

/// This process's TLS, if it runs with it.
pub fn current() -> Option<&'static MeshTls> {
    PROCESS_TLS.get().and_then(Option::as_ref)
}

/// Changes whenever this process's certificates are reloaded.
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// Re-reads this process's certificates every `every` until the process ends, logging what
/// changed. Harmless to call more than once or without TLS.
pub fn watch(every: Duration) {
    static STARTED: OnceLock<()> = OnceLock::new();
    let Some(tls) = current() else { return };
    if STARTED.set(()).is_err() {
        return;
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match tls.reload() {
                Ok(true) => tracing::info!(dir = %tls.dir.display(), "certificates reloaded"),
                Ok(false) => {}
                Err(e) => tracing::error!("certificates changed but cannot be used: {e}"),
            }
        }
    });
}

/// An endpoint to the mesh process of role `serves` at `address` (host:port): TLS with this
/// process's certificate when it has one, plaintext otherwise.
pub fn endpoint(address: &str, serves: MeshRole) -> Result<Endpoint, tonic::transport::Error> {
    match current() {
        Some(t) => endpoint_with(address, t, serves),
        None => Endpoint::from_shared(format!("http://{address}")),
    }
}

/// An endpoint to the process of role `serves` at `address` with the certificate of `tls` (a
/// test acting as some node).
pub fn endpoint_with(
    address: &str,
    tls: &MeshTls,
    serves: MeshRole,
) -> Result<Endpoint, tonic::transport::Error> {
    Endpoint::from_shared(format!("https://{address}"))?.tls_config(tls.client(serves))
}

/// How long `pdmesh certs ca` makes a CA good for: it signs, it is never presented alone,
/// and replacing it is a rotation of the whole mesh.
pub const CA_VALIDITY: Duration = Duration::from_secs(5 * 365 * 86_400);
/// How long a process's certificate is good for by default: cert-manager renews at two
/// thirds (deploy/), and a stolen one stops working within the term.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(90 * 86_400);
/// Backdating, so a clock a little behind the issuer's still takes a fresh certificate.
const CLOCK_SKEW: Duration = Duration::from_secs(300);

/// When a certificate is good: from `from` until `until`.
#[derive(Debug, Clone, Copy)]
pub struct Validity {
    pub from: std::time::SystemTime,
    pub until: std::time::SystemTime,
}

impl Validity {
    /// From now (less a few minutes of clock skew) for `term`.
    pub fn next(term: Duration) -> Self {
        let now = std::time::SystemTime::now();
        Self { from: now - CLOCK_SKEW, until: now + term }
    }

    fn apply(&self, p: &mut CertificateParams) {
        p.not_before = self.from.into();
        p.not_after = self.until.into();
    }
}

/// A mesh CA: its certificate and key, which sign each process's certificate.
pub struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
    /// The term of the certificates `issue` makes.
    leaf: Duration,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

impl Ca {
    /// A new CA, good for `CA_VALIDITY`.
    pub fn generate() -> Result<Self, TlsError> {
        Self::generate_for(CA_VALIDITY)
    }

    /// A new CA good for `term`.
    pub fn generate_for(term: Duration) -> Result<Self, TlsError> {
        let key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "pdmesh mesh CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Validity::next(term).apply(&mut ca);
        let pem = ca.self_signed(&key)?.pem();
        Ok(Self { pem, issuer: Issuer::new(ca, key), leaf: LEAF_VALIDITY })
    }

    /// This CA issuing certificates good for `term` (`LEAF_VALIDITY` unless set).
    pub fn with_leaf_validity(mut self, term: Duration) -> Self {
        self.leaf = term;
        self
    }

    /// The CA in `DIR/ca.pem` and `DIR/ca.key`.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let read = |f: &str| {
            let path = dir.join(f);
            std::fs::read_to_string(&path).map_err(|source| TlsError::Read { path, source })
        };
        let (pem, key) = (read("ca.pem")?, read("ca.key")?);
        let key = KeyPair::from_pem(&key)?;
        Ok(Self { issuer: Issuer::from_ca_cert_pem(&pem, key)?, pem, leaf: LEAF_VALIDITY })
    }

    /// Writes `DIR/ca.pem`, and `DIR/ca.key` when `with_key` (the key only where certificates
    /// are made).
    pub fn write(&self, dir: &Path, with_key: bool) -> Result<(), TlsError> {
        create_dir(dir)?;
        write_private(&dir.join("ca.pem"), self.pem.as_bytes())?;
        if with_key {
            write_private(&dir.join("ca.key"), self.issuer.key().serialize_pem().as_bytes())?;
        }
        Ok(())
    }

    /// Makes `DIR/NAME.pem` and `DIR/NAME.key` for `name` in `role`, good for both ends of a
    /// connection, with `DIR/ca.pem` beside them.
    pub fn issue(&self, dir: &Path, name: &str, role: MeshRole) -> Result<(), TlsError> {
        self.issue_for_hosts(dir, name, role, &[])
    }

    /// `issue`, good also for the `hosts` (DNS names or IP addresses) HTTPS clients dial the
    /// process by: the router's OpenAI API, whose clients check the name they dialed. The
    /// certificate carries its role's name (`role_name`), and a router's `MESH_NAME` too.
    pub fn issue_for_hosts(
        &self,
        dir: &Path,
        name: &str,
        role: MeshRole,
        hosts: &[String],
    ) -> Result<(), TlsError> {
        self.issue_within(dir, name, role, hosts, Validity::next(self.leaf))
    }

    /// `issue_for_hosts`, good for `validity`.
    pub fn issue_within(
        &self,
        dir: &Path,
        name: &str,
        role: MeshRole,
        hosts: &[String],
        validity: Validity,
    ) -> Result<(), TlsError> {
        check_name(name)?;
        create_dir(dir)?;
        let key = KeyPair::generate()?;
        let public = (role == MeshRole::Router).then(|| MESH_NAME.to_string());
        let names = std::iter::once(role_name(role)).chain(public).chain(hosts.iter().cloned());
        let mut p = CertificateParams::new(names.collect::<Vec<_>>())?;
        p.distinguished_name.push(DnType::CommonName, name);
        p.subject_alt_names.push(SanType::URI(format!("{ROLE_URI}{role}/{name}").try_into()?));
        p.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        validity.apply(&mut p);
        let cert = p.signed_by(&key, &self.issuer)?;
        // The key first: a process that reloads between the two writes sees a certificate
        // that does not match its key, refuses the pair and keeps its old one until the next
        // look, rather than serving a new certificate with an old key.
        write_private(&dir.join(format!("{name}.key")), key.serialize_pem().as_bytes())?;
        write_private(&dir.join(format!("{name}.pem")), cert.pem().as_bytes())?;
        write_private(&dir.join("ca.pem"), self.pem.as_bytes())
    }
}

/// Makes a throwaway CA in `dir` (`ca.pem`, `ca.key`) and, for each `(name, role)`, a
/// certificate and key (`NAME.pem`, `NAME.key`). Keys are readable by their owner only.
pub fn issue(dir: &Path, nodes: &[(&str, MeshRole)]) -> Result<Ca, TlsError> {
    let ca = Ca::generate()?;
    ca.write(dir, true)?;
    for (name, role) in nodes {
        ca.issue(dir, name, *role)?;
    }
    Ok(ca)
}

fn create_dir(dir: &Path) -> Result<(), TlsError> {
    std::fs::create_dir_all(dir)
        .map_err(|source| TlsError::Write { path: dir.to_path_buf(), source })
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), TlsError> {
    crate::config::write_private(path, data)
        .map_err(|source| TlsError::Write { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_names_its_role_and_node() {
        let dir = tempfile::tempdir().unwrap();
        issue(dir.path(), &[("decode-3", MeshRole::Decode), ("ops", MeshRole::Admin)]).unwrap();
        let t = MeshTls::load(dir.path(), "decode-3").unwrap();
        assert_eq!(t.identity(), Peer { role: MeshRole::Decode, name: "decode-3".into() });
        assert_eq!(MeshTls::load(dir.path(), "ops").unwrap().identity().role, MeshRole::Admin);
        assert!(matches!(MeshTls::load(dir.path(), "../ca"), Err(TlsError::Name(_))));
        assert!(matches!(MeshTls::load(dir.path(), "nobody"), Err(TlsError::Read { .. })));
    }

    /// Certificates were good from 1975 to 4096: one copied off a mesh never stopped working.
    /// Now each carries its term, the CA's and each process's apart.
    #[test]
    fn certificates_carry_the_term_they_were_issued_for() {
        let term = |pem: &[u8]| {
            let der = CertificateDer::from_pem_slice(pem).unwrap();
            let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
            let v = c.validity();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64;
            (now - v.not_before.timestamp(), v.not_after.timestamp() - now)
        };
        let dir = tempfile::tempdir().unwrap();
        let day = Duration::from_secs(86_400);
        let ca = Ca::generate_for(30 * day).unwrap().with_leaf_validity(day);
        ca.write(dir.path(), true).unwrap();
        ca.issue(dir.path(), "decode-0", MeshRole::Decode).unwrap();
        let (before, after) = term(&std::fs::read(dir.path().join("decode-0.pem")).unwrap());
        assert!((295..=310).contains(&before), "backdated by the skew only: {before}s");
        assert!((86_390..=86_400).contains(&after), "good for a day: {after}s");
        let (_, after) = term(&std::fs::read(dir.path().join("ca.pem")).unwrap());
        assert!((30 * 86_400 - 10..=30 * 86_400).contains(&after), "{after}s");
        // Loaded again from its files, the CA issues for the default term.
        let (_, after) = {
            Ca::load(dir.path()).unwrap().issue(dir.path(), "p", MeshRole::Prefill).unwrap();
            term(&std::fs::read(dir.path().join("p.pem")).unwrap())
        };
        let lv = LEAF_VALIDITY.as_secs() as i64;
        assert!((lv - 10..=lv).contains(&after), "{after}s");
    }

    /// KV moves over these connections: every mesh server picks AES-128-GCM even for a client
    /// that prefers AES-256 (rustls' own order, which tonic's clients use).
    #[test]
    fn mesh_servers_choose_aes_128_whatever_the_client_prefers() {
        use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
        let dir = tempfile::tempdir().unwrap();
        issue(dir.path(), &[("r", MeshRole::Router)]).unwrap();
        let t = MeshTls::load(dir.path(), "r").unwrap();
        let ring = Arc::new(rustls::crypto::ring::default_provider());
        assert_eq!(ring.cipher_suites[0].suite(), TLS13_AES_256_GCM_SHA384);
        let client = rustls::ClientConfig::builder_with_provider(ring)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(Arc::clone(&t.material().roots))
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from(MESH_NAME).unwrap();
        for server in [t.public_server(), t.https_server()] {
            let c = rustls::ClientConnection::new(Arc::new(client.clone()), name.clone());
            let mut c = rustls::Connection::from(c.unwrap());
            let mut s = rustls::Connection::from(rustls::ServerConnection::new(server).unwrap());
            let pass = |from: &mut rustls::Connection, to: &mut rustls::Connection| {
                let mut wire = Vec::new();
                while from.wants_write() {
                    from.write_tls(&mut wire).unwrap();
                }
                let mut rest = &wire[..];
                while !rest.is_empty() {
                    to.read_tls(&mut rest).unwrap();
                    to.process_new_packets().unwrap();
                }
            };
            for _ in 0..10 {
                pass(&mut c, &mut s);
                pass(&mut s, &mut c);
            }
            assert!(!c.is_handshaking() && !s.is_handshaking());
            let got = s.negotiated_cipher_suite().unwrap().suite();
            assert_eq!(got, TLS13_AES_128_GCM_SHA256);
        }
    }

    #[test]
    fn a_renewed_certificate_is_picked_up_and_a_broken_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let ca = issue(dir.path(), &[("p", MeshRole::Prefill)]).unwrap();
        let t = MeshTls::load(dir.path(), "p").unwrap();
        assert!(!t.reload().unwrap(), "nothing changed");
        let before = t.material().cert.clone();
        // Renewed (same name, new key), as cert-manager does; mtimes may tie within a
        // second, so the length of the new file or its time tells.
        std::thread::sleep(Duration::from_millis(20));
        ca.issue(dir.path(), "p", MeshRole::Prefill).unwrap();
        let g = generation();
        assert!(t.reload().unwrap());
        assert_ne!(t.material().cert, before);
        assert!(generation() > g);
        std::fs::write(dir.path().join("p.key"), "not a key").unwrap();
        assert!(t.reload().is_err());
        assert_eq!(t.identity().name, "p", "the old material stays in use");
    }
}
