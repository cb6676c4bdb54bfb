//! How a client of a mesh (`pdmesh generate`, `bench`, `replay`) reaches its router: with the
//! mesh's CA and an API key. `pdmesh up` keeps its throwaway credentials in a directory named
//! after the router's address (`local_mesh_dir`), where a client aimed at that address finds
//! them by itself; any other mesh is reached with `--tls-dir/--tls-name` and `--api-key`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use pdmesh_common::apikey::{Bearer, GenerationClient};
use pdmesh_common::tls::MeshTls;

/// The certificate `pdmesh up` makes for its operator (`generate`, the tools): an admin's,
/// which may list nodes and read their statistics but reaches no node's work.
pub const OPERATOR: &str = "operator";
/// In a `pdmesh up` directory: the operator's API key (the router holds only its hash).
pub const API_KEY_FILE: &str = "api-key";
/// In a `pdmesh up` directory: the router's key file.
pub const KEY_RING_FILE: &str = "api-keys.toml";

/// The TLS flags every `pdmesh` command shares, services and clients alike.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsFlags {
    /// Mutual TLS (always on unless --insecure): DIR holds the mesh CA (`ca.pem`) and this
    /// process's certificate and key (`NAME.pem`, `NAME.key`, NAME from --tls-name), whose
    /// `pdmesh://ROLE/NAME` URI says what it may do. Files are re-read when they change.
    /// `pdmesh up` makes throwaway ones, which clients aimed at it find without this flag.
    #[arg(long, global = true, value_name = "DIR", env = "PDMESH_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// This process's certificate in --tls-dir.
    #[arg(long, global = true, value_name = "NAME", env = "PDMESH_TLS_NAME")]
    pub tls_name: Option<String>,
    /// Plaintext, no certificates and no roles: for experiments on one machine. A service
    /// refuses it unless every address it listens on or dials is loopback.
    #[arg(long, global = true, env = "PDMESH_INSECURE", value_parser = clap::builder::BoolishValueParser::new())]
    pub insecure: bool,
}

impl TlsFlags {
    /// What the flags ask for: `Some(Some(tls))` certificates, `Some(None)` plaintext, `None`
    /// neither (then a service refuses to start and a client looks for `pdmesh up`'s).
    pub fn explicit(&self) -> anyhow::Result<Option<Option<MeshTls>>> {
        Ok(match (&self.tls_dir, &self.tls_name, self.insecure) {
            (None, None, false) => None,
            (None, None, true) => Some(None),
            (Some(_), _, true) | (_, Some(_), true) => {
                anyhow::bail!("--insecure contradicts --tls-dir/--tls-name")
            }
            (Some(d), Some(n), false) => Some(Some(MeshTls::load(d, n)?)),
            (Some(_), None, _) => {
                anyhow::bail!("--tls-dir needs --tls-name: which certificate is this process's")
            }
            (None, Some(_), _) => {
                anyhow::bail!("--tls-name needs --tls-dir: where the certificates are")
            }
        })
    }

    /// Sets this process's TLS for a client of the router at `target`: as the flags say,
    /// else with the credentials of a `pdmesh up` mesh there. Returns that mesh's directory
    /// when its credentials were used.
    pub fn init_client(&self, target: &str) -> anyhow::Result<Option<PathBuf>> {
        let (tls, found) = match self.explicit()? {
            Some(tls) => (tls, None),
            None => {
                let d = local_mesh_dir(target).context(NO_HOME)?;
                anyhow::ensure!(
                    d.join("ca.pem").exists(),
                    "no credentials for the mesh at {target}: `pdmesh up` keeps them in {} \
                     while it runs there; for another mesh give --tls-dir DIR --tls-name NAME \
                     (and --api-key), or --insecure for a plaintext mesh on loopback",
                    d.display()
                );
                (Some(MeshTls::load(&d, OPERATOR)?), Some(d))
            }
        };
        pdmesh_common::tls::init(tls);
        Ok(found)
    }
}

/// How a client proves who it is: flags every client command shares.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Access {
    #[command(flatten)]
    pub tls: TlsFlags,
    /// The API key to send (default: that of the `pdmesh up` mesh at the target).
    #[arg(long, global = true, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

impl Access {
    /// Sets up this process's TLS for the router at `target` and returns the API key to send.
    pub fn init(&self, target: &str) -> anyhow::Result<Option<String>> {
        let found = self.tls.init_client(target)?;
        api_key(self.api_key.clone(), found.as_deref())
    }
}

/// Why there is no `local_mesh_dir`.
pub const NO_HOME: &str =
    "neither PDMESH_HOME nor HOME is set: say where `pdmesh up` keeps its credentials";

/// Where `pdmesh up` with its router on `listen` keeps its credentials:
/// `$PDMESH_HOME/up/HOST_PORT` (`$PDMESH_HOME` defaults to `~/.pdmesh`).
/// None when neither is set: a shared directory such as /tmp would hand the mesh's keys to
/// whoever made the path first.
pub fn local_mesh_dir(listen: &str) -> Option<PathBuf> {
    let home = std::env::var_os("PDMESH_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pdmesh")))?;
    let name: String = listen
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' })
        .collect();
    Some(home.join("up").join(name))
}

/// The API key to send: the one given, else the one of the `pdmesh up` mesh found.
pub fn api_key(given: Option<String>, found: Option<&Path>) -> anyhow::Result<Option<String>> {
    if given.is_some() {
        return Ok(given);
    }
    let Some(d) = found else { return Ok(None) };
    let f = d.join(API_KEY_FILE);
    let key = std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
    Ok(Some(key.trim().to_string()))
}

/// A `Generation` client of the router at `target` that sends `api_key`.
pub async fn connect(target: &str, api_key: Option<&str>) -> anyhow::Result<GenerationClient> {
    let channel = async {
        pdmesh_common::tls::endpoint(target, pdmesh_common::tls::MeshRole::Router)?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
    };
    let channel = channel.await.with_context(|| {
        format!("cannot reach the router at {target} (is `pdmesh up` running?)")
    })?;
    let bearer = Bearer::new(api_key).context("the API key is not a valid header value")?;
    Ok(pdmesh_proto::v1::generation_client::GenerationClient::with_interceptor(channel, bearer))
}
