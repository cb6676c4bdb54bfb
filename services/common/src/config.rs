//! One conversion path for every service's Config: the struct's defaults, then an optional TOML
//! file, then `PDMESH_<SERVICE>_*` environment variables, then the few flags given on the
//! command line. Unknown keys are errors (the structs deny them), and messages name the key.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A config value out of range: which key, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct InvalidConfig {
    pub key: &'static str,
    pub problem: String,
}

impl InvalidConfig {
    pub fn new(key: &'static str, problem: impl Into<String>) -> Self {
        Self { key, problem: problem.into() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    MissingFile(String),
    #[error("{0}")]
    Parse(String),
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Layers `defaults`, `file`, environment variables starting with `env_prefix` (for example
/// `PDMESH_DECODE_`; nested keys use `__`) and `flags` (fields left out are not overridden).
pub fn load_config<T: Serialize + DeserializeOwned>(
    defaults: &T,
    file: Option<&Path>,
    env_prefix: &str,
    flags: &impl Serialize,
) -> Result<T, ConfigError> {
    let mut fig = Figment::from(Serialized::defaults(defaults));
    if let Some(file) = file {
        if !file.exists() {
            return Err(ConfigError::MissingFile(file.display().to_string()));
        }
        fig = fig.merge(Toml::file_exact(file));
    }
    fig = fig.merge(Env::prefixed(env_prefix).split("__")).merge(Serialized::defaults(flags));
    fig.extract().map_err(|e| {
        let e: Vec<String> = e.into_iter().map(|e| e.to_string()).collect();
        ConfigError::Parse(e.join("; "))
    })
}

/// When a file last changed, as far as a watcher can tell (modification time and length; None
/// when it cannot be read): what reloads compare to notice a rewritten file.
pub type FileStamp = Option<(std::time::SystemTime, u64)>;

/// `path`'s stamp now.
pub fn file_stamp(path: &Path) -> FileStamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Writes a secret (a key, a certificate) readable by its owner only, whole or not at all: it
/// is written aside and renamed, so a reader watching the file never sees half of it.
pub fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    // Whatever sits at the temporary name goes first, and the file is made new (O_EXCL, which
    // never follows a link): a link planted there would otherwise take the secret wherever
    // it points. The rename then replaces `path` itself, never what a link there points to.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(&tmp).and_then(|mut f| f.write_all(data)).and_then(|()| std::fs::rename(&tmp, path))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::result_large_err)] // figment's Jail API
    use super::*;
    use serde::Deserialize;

    /// An attacker who can write where the credentials go plants links at the file's
    /// temporary and final names, pointing at a file of the victim's: the secret must land in
    /// a new file of its own, owner-only, and the victim's file must stay as it was.
    #[cfg(unix)]
    #[test]
    fn a_planted_link_does_not_redirect_a_secret() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let key = dir.path().join("api-key");
        std::os::unix::fs::symlink(&victim, key.with_extension("tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, &key).unwrap();
        write_private(&key, b"secret").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(!std::fs::symlink_metadata(&key).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "secret");
        assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Cfg {
        listen: String,
        blocks: u32,
        lease_ms: u64,
    }

    #[derive(Serialize, Default)]
    struct Flags {
        #[serde(skip_serializing_if = "Option::is_none")]
        listen: Option<String>,
    }

    fn defaults() -> Cfg {
        Cfg { listen: "127.0.0.1:1".into(), blocks: 8, lease_ms: 100 }
    }

    #[test]
    fn layers_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "blocks = 16\nlease_ms = 5\n").unwrap();
        figment::Jail::expect_with(|jail| {
            jail.set_env("PDMESH_TEST1_LEASE_MS", "7");
            let flags = Flags { listen: Some("0.0.0.0:9".into()) };
            let c: Cfg = load_config(&defaults(), Some(&f), "PDMESH_TEST1_", &flags).unwrap();
            assert_eq!(c, Cfg { listen: "0.0.0.0:9".into(), blocks: 16, lease_ms: 7 });
            let c: Cfg =
                load_config(&defaults(), None, "PDMESH_TEST1_", &Flags::default()).unwrap();
            assert_eq!(c.listen, "127.0.0.1:1");
            Ok(())
        });
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "blokcs = 16\n").unwrap();
        let e = load_config::<Cfg>(&defaults(), Some(&f), "PDMESH_TEST2_", &Flags::default())
            .unwrap_err();
        assert!(e.to_string().contains("blokcs"), "{e}");
        std::fs::write(&f, "blocks = \"many\"\n").unwrap();
        let e = load_config::<Cfg>(&defaults(), Some(&f), "PDMESH_TEST2_", &Flags::default())
            .unwrap_err();
        assert!(e.to_string().contains("blocks"), "{e}");
        let e = load_config::<Cfg>(
            &defaults(),
            Some(&dir.path().join("nope.toml")),
            "PDMESH_TEST2_",
            &Flags::default(),
        )
        .unwrap_err();
        assert!(matches!(e, ConfigError::MissingFile(_)));
    }
}
