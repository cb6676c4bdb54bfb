//! Mutual TLS between the mesh's processes. Each process holds a certificate, signed by the
//! mesh's CA, that names it (`CN`) and its role (a `pdmesh://ROLE/NAME` URI); every server
//! demands such a certificate from its clients and every client checks the server's against
//! the same CA. The process's TLS is set once at start (`init`); `endpoint` then dials
//! whatever a service dials with it, so no call site decides on its own.
//!
//! `issue` makes a throwaway CA and certificates (rcgen), as `pdmesh up --tls` and the tests
//! do; a deployment brings its own (cert-manager or a Secret) in the same files.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// The DNS name every mesh certificate carries and every client verifies: processes are
/// dialled by address, so identity is the CA's signature and the name inside, not the host.
pub const MESH_NAME: &str = "pdmesh.internal";

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
}

/// One process's TLS material: the mesh CA, its certificate and its key (PEM).
#[derive(Clone)]
pub struct MeshTls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTls").finish_non_exhaustive()
    }
}

fn check_name(name: &str) -> Result<(), TlsError> {
    let ok = !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok { Ok(()) } else { Err(TlsError::Name(name.into())) }
}

impl MeshTls {
    /// Reads `DIR/ca.pem`, `DIR/NAME.pem` and `DIR/NAME.key`.
    pub fn load(dir: &Path, name: &str) -> Result<Self, TlsError> {
        check_name(name)?;
        let read = |file: String| {
            let path = dir.join(file);
            std::fs::read(&path).map_err(|source| TlsError::Read { path, source })
        };
        Ok(Self {
            ca: read("ca.pem".into())?,
            cert: read(format!("{name}.pem"))?,
            key: read(format!("{name}.key"))?,
        })
    }

    /// What a server presents and demands: its certificate, and one from the mesh CA of every
    /// client.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
    }

    /// What a client presents and checks.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(Identity::from_pem(&self.cert, &self.key))
            .domain_name(MESH_NAME)
    }
}

static PROCESS_TLS: OnceLock<Option<MeshTls>> = OnceLock::new();

/// Sets this process's TLS (None: plaintext, for experiments on one machine). Once: a second
/// call changes nothing and returns false.
pub fn init(tls: Option<MeshTls>) -> bool {
    PROCESS_TLS.set(tls).is_ok()
}

/// This process's TLS, if it runs with it.
pub fn current() -> Option<&'static MeshTls> {
    PROCESS_TLS.get().and_then(Option::as_ref)
}

/// An endpoint to the mesh peer at `address` (host:port): TLS with this process's
/// certificate when it has one, plaintext otherwise.
pub fn endpoint(address: &str) -> Result<Endpoint, tonic::transport::Error> {
    match current() {
        Some(t) => Endpoint::from_shared(format!("https://{address}"))?.tls_config(t.client()),
        None => Endpoint::from_shared(format!("http://{address}")),
    }
}

/// Makes a throwaway CA in `dir` (`ca.pem`, `ca.key`) and, for each `(name, role)`, a
/// certificate and key (`NAME.pem`, `NAME.key`) for both ends of a connection. Keys are
/// written readable by their owner only.
pub fn issue(dir: &Path, nodes: &[(&str, &str)]) -> Result<(), TlsError> {
    let write = |file: String, data: &str| {
        let path = dir.join(file);
        write_private(&path, data.as_bytes()).map_err(|source| TlsError::Write { path, source })
    };
    std::fs::create_dir_all(dir)
        .map_err(|source| TlsError::Write { path: dir.to_path_buf(), source })?;
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "pdmesh mesh CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key)?;
    write("ca.pem".into(), &ca_cert.pem())?;
    write("ca.key".into(), &ca_key.serialize_pem())?;
    let issuer = Issuer::new(ca, ca_key);
    for (name, role) in nodes {
        check_name(name)?;
        check_name(role)?;
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(vec![MESH_NAME.to_string()])?;
        p.distinguished_name.push(DnType::CommonName, *name);
        p.subject_alt_names.push(SanType::URI(format!("pdmesh://{role}/{name}").try_into()?));
        p.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, &issuer)?;
        write(format!("{name}.pem"), &cert.pem())?;
        write(format!("{name}.key"), &key.serialize_pem())?;
    }
    Ok(())
}

fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)?.write_all(data)
}
