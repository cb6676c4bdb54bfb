//! API keys for the public API. A client sends `authorization: Bearer KEY`; the router keeps
//! only SHA-256 hashes of keys, in a TOML file it re-reads when it changes, each mapped to a
//! tenant with its own in-flight limit and prefix-cache group:
//!
//! ```toml
//! [[key]]
//! tenant = "search"
//! sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//! max_in_flight = 64          # optional: this tenant's requests at once
//! cache_group = "search"      # optional: tenants naming one group share cached prefixes
//! kv_policy = "sinks:4096"    # optional: the lossy KV policy of requests that name none
//! default_model = "auto"      # optional: the model of requests that name none
//! ```
//!
//! `pdmesh api-key --tenant NAME --file FILE` makes a key, appends its hash and prints the key
//! once. [`Bearer`] is the client half.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use pdmesh_kv_types::KvPolicy;
use serde::{Deserialize, Serialize};
use tonic::metadata::MetadataValue;

use crate::config::{FileStamp, file_stamp};

/// The prefix of every key pdmesh makes (it tells a leaked secret's origin at a glance).
pub const KEY_PREFIX: &str = "pdm_";

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {problem}")]
    Invalid { path: PathBuf, problem: String },
}

/// One tenant's settings, as its key's entry gives them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub tenant: String,
    /// Its requests in flight at once (none: only the router's own limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<usize>,
    /// Tenants naming the same group share cached prefixes (a common system prompt); by
    /// default each tenant is a group of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_group: Option<String>,
    /// The lossy KV policy (`GenerateRequest.kv_policy`'s form) of this tenant's requests that
    /// name none; none: full attention.
    #[serde(default, with = "policy_text", skip_serializing_if = "Option::is_none")]
    pub kv_policy: Option<KvPolicy>,
    /// The model of this tenant's requests that name none (a served model's id, or `auto`
    /// for tiered routing); none: the router's default model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_model: Option<String>,
}

/// A KV policy in the key file: its text form, checked as the file is read.
mod policy_text {
    use pdmesh_kv_types::KvPolicy;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(p: &Option<KvPolicy>, s: S) -> Result<S::Ok, S::Error> {
        match p {
            Some(p) => s.serialize_str(&p.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<KvPolicy>, D::Error> {
        let text: Option<String> = Option::deserialize(d)?;
        // The key's entry is flattened, so the parser's message would not name the field.
        let bad = |e: String| serde::de::Error::custom(format!("kv_policy: {e}"));
        text.map(|t| t.parse().map_err(bad)).transpose()
    }
}

impl Tenant {
    /// The caller of a mesh without API keys (`allow_anonymous`).
    pub fn anonymous() -> Self {
        Self::named("anonymous")
    }

    /// A tenant called `tenant` with every setting at its default.
    pub fn named(tenant: impl Into<String>) -> Self {
        Self {
            tenant: tenant.into(),
            max_in_flight: None,
            cache_group: None,
            kv_policy: None,
            default_model: None,
        }
    }

    /// The salt of this tenant's prefix-cache hashes: equal only within a cache group.
    pub fn cache_salt(&self) -> [u8; 16] {
        // Tenant and group names are separate spaces: a group named like a tenant is not it.
        let name = match &self.cache_group {
            Some(g) => format!("pdmesh-cache-group\0{g}"),
            None => format!("pdmesh-cache-tenant\0{}", self.tenant),
        };
        let d = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
        d.as_ref()[..16].try_into().expect("SHA-256 has 32 bytes")
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    sha256: String,
    #[serde(flatten)]
    tenant: Tenant,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    key: Vec<Entry>,
}

/// The hex SHA-256 of a key: what the file stores.
pub fn hash(key: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A new random key.
pub fn generate() -> String {
    let mut b = [0u8; 24];
    getrandom::fill(&mut b).expect("the OS random source works");
    format!("{KEY_PREFIX}{}", b.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

fn invalid(path: &Path, problem: impl Into<String>) -> KeyError {
    KeyError::Invalid { path: path.to_path_buf(), problem: problem.into() }
}

fn parse(path: &Path) -> Result<HashMap<String, Arc<Tenant>>, KeyError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| KeyError::Io { path: path.to_path_buf(), source })?;
    let f: File = toml::from_str(&text).map_err(|e| invalid(path, e.to_string()))?;
    let mut out = HashMap::new();
    // A tenant is one set of settings, whichever of its keys is presented: limits that
    // differed by key would let two keys, alternated, replace the limit at every request.
    let mut tenants: HashMap<String, Tenant> = HashMap::new();
    for e in f.key {
        let ok = e.sha256.len() == 64 && e.sha256.bytes().all(|b| b.is_ascii_hexdigit());
        if !ok {
            return Err(invalid(path, format!("{:?}: sha256 must be 64 hex digits", e.sha256)));
        }
        if e.tenant.tenant.is_empty() || e.tenant.max_in_flight == Some(0) {
            return Err(invalid(path, "every key needs a tenant, and max_in_flight ≥ 1"));
        }
        if e.tenant.default_model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err(invalid(path, "default_model, when given, names a model"));
        }
        if let Some(first) = tenants.get(&e.tenant.tenant) {
            if *first != e.tenant {
                return Err(invalid(path, disagree(first, &e.tenant)));
            }
        } else {
            tenants.insert(e.tenant.tenant.clone(), e.tenant.clone());
        }
        if out.insert(e.sha256.to_ascii_lowercase(), Arc::new(e.tenant)).is_some() {
            return Err(invalid(path, format!("{} is listed twice", e.sha256)));
        }
    }
    Ok(out)
}

fn disagree(first: &Tenant, other: &Tenant) -> String {
    let show = |t: &Tenant| {
        format!(
            "max_in_flight {}, cache_group {}, kv_policy {}, default_model {}",
            t.max_in_flight.map_or("none".into(), |m| m.to_string()),
            t.cache_group.as_deref().unwrap_or("none"),
            t.kv_policy.map_or("none".into(), |p| p.to_string()),
            t.default_model.as_deref().unwrap_or("none")
        )
    };
    format!(
        "the keys of tenant {:?} disagree ({} against {}): every key of a tenant must give \
         the same max_in_flight, cache_group, kv_policy and default_model",
        first.tenant,
        show(first),
        show(other)
    )
}

/// Appends a new key for `tenant` to `path` (made if missing, owner-only) and returns it.
pub fn add(path: &Path, tenant: Tenant) -> Result<String, KeyError> {
    use std::io::Write;
    if path.exists() {
        let same = parse(path)?.into_values().find(|t| t.tenant == tenant.tenant);
        if let Some(first) = same.filter(|t| **t != tenant) {
            return Err(invalid(path, disagree(&first, &tenant)));
        }
    }
    let key = generate();
    let entry = File { key: vec![Entry { sha256: hash(&key), tenant }] };
    let text = toml::to_string(&entry).map_err(|e| invalid(path, e.to_string()))?;
    let mut o = std::fs::OpenOptions::new();
    o.append(true).create(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
        .and_then(|mut f| f.write_all(format!("\n{text}").as_bytes()))
        .map_err(|source| KeyError::Io { path: path.to_path_buf(), source })?;
    Ok(key)
}

/// Why a caller was not let in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("no API key: send `authorization: Bearer KEY`")]
    Missing,
    #[error("the authorization header is not `Bearer KEY`")]
    Malformed,
    #[error("unknown API key")]
    Unknown,
}

/// The router's keys: read from a file and re-read when it changes.
#[derive(Debug)]
pub struct KeyRing {
    path: PathBuf,
    keys: RwLock<(FileStamp, Keys)>,
}

/// Tenants by the hex SHA-256 of their key.
type Keys = Arc<HashMap<String, Arc<Tenant>>>;

impl KeyRing {
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let s = file_stamp(path);
        let keys = parse(path)?;
        Ok(Self { path: path.to_path_buf(), keys: RwLock::new((s, Arc::new(keys))) })
    }

    /// Tenants known now.
    pub fn len(&self) -> usize {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).1.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-reads the file if it changed: Ok(true) when new keys are in use; on an error the
    /// old keys stay.
    pub fn reload(&self) -> Result<bool, KeyError> {
        let s = file_stamp(&self.path);
        if s == self.keys.read().unwrap_or_else(|p| p.into_inner()).0 {
            return Ok(false);
        }
        let keys = parse(&self.path)?;
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = (s, Arc::new(keys));
        Ok(true)
    }

    /// Re-reads the file every `every` while `self` lives elsewhere.
    pub fn watch(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let ring = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(ring) = ring.upgrade() else { return };
                match ring.reload() {
                    Ok(true) => tracing::info!(keys = ring.len(), "API keys reloaded"),
                    Ok(false) => {}
                    Err(e) => tracing::error!("API keys changed but cannot be used: {e}"),
                }
            }
        })
    }

    /// The tenant whose key `metadata` carries.
    pub fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Arc<Tenant>, Refused> {
        self.tenant_of(bearer(metadata)?)
    }

    /// The tenant whose key HTTP `headers` carry (`Authorization: Bearer KEY`).
    pub fn authenticate_http(&self, headers: &http::HeaderMap) -> Result<Arc<Tenant>, Refused> {
        let v = headers.get(http::header::AUTHORIZATION);
        let v = v.map(|v| v.to_str().map_err(|_| Refused::Malformed)).transpose()?;
        self.tenant_of(v.map(parse_bearer).transpose()?)
    }

    fn tenant_of(&self, key: Option<&str>) -> Result<Arc<Tenant>, Refused> {
        let key = key.ok_or(Refused::Missing)?;
        let keys = Arc::clone(&self.keys.read().unwrap_or_else(|p| p.into_inner()).1);
        keys.get(&hash(key)).cloned().ok_or(Refused::Unknown)
    }
}

/// The key in `authorization: Bearer KEY`, if the header is there.
pub fn bearer(metadata: &tonic::metadata::MetadataMap) -> Result<Option<&str>, Refused> {
    let Some(v) = metadata.get("authorization") else { return Ok(None) };
    let v = v.to_str().map_err(|_| Refused::Malformed)?;
    parse_bearer(v).map(Some)
}

/// The key of a `Bearer KEY` value.
fn parse_bearer(v: &str) -> Result<&str, Refused> {
    let (scheme, key) = v.split_once(' ').ok_or(Refused::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") || key.trim().is_empty() {
        return Err(Refused::Malformed);
    }
    Ok(key.trim())
}

/// A client interceptor that sends an API key with every call (none: sends nothing).
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<tonic::metadata::Ascii>>);

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Bearer(…)" } else { "Bearer(none)" })
    }
}

impl Bearer {
    /// Fails on a key that cannot be a header value.
    pub fn new(key: Option<&str>) -> Result<Self, Refused> {
        let v = key
            .map(|k| {
                let mut v = MetadataValue::try_from(format!("Bearer {k}"))
                    .map_err(|_| Refused::Malformed)?;
                v.set_sensitive(true);
                Ok(v)
            })
            .transpose()?;
        Ok(Self(v))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A `Generation` client that sends an API key.
pub type GenerationClient = pdmesh_proto::v1::generation_client::GenerationClient<
    tonic::codegen::InterceptedService<tonic::transport::Channel, Bearer>,
>;

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(v: &str) -> tonic::metadata::MetadataMap {
        let mut m = tonic::metadata::MetadataMap::new();
        m.insert("authorization", v.parse().unwrap());
        m
    }

    #[test]
    fn keys_map_to_tenants_and_strangers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("keys.toml");
        let a = add(
            &f,
            Tenant {
                tenant: "a".into(),
                max_in_flight: Some(2),
                cache_group: None,
                kv_policy: None,
                default_model: None,
            },
        )
        .unwrap();
        let ring = Arc::new(KeyRing::load(&f).unwrap());
        assert_eq!(ring.authenticate(&meta(&format!("Bearer {a}"))).unwrap().tenant, "a");
        assert_eq!(ring.authenticate(&meta(&format!("bearer  {a} "))).unwrap().tenant, "a");
        let none = tonic::metadata::MetadataMap::new();
        assert_eq!(ring.authenticate(&none), Err(Refused::Missing));
        assert_eq!(ring.authenticate(&meta("Basic abc")), Err(Refused::Malformed));
        assert_eq!(ring.authenticate(&meta("Bearer pdm_guess")), Err(Refused::Unknown));
        // Another key appears in the file: picked up by a reload, the first still works.
        let b = add(
            &f,
            Tenant {
                tenant: "b".into(),
                max_in_flight: None,
                cache_group: None,
                kv_policy: None,
                default_model: None,
            },
        )
        .unwrap();
        assert!(ring.reload().unwrap());
        assert_eq!(ring.authenticate(&meta(&format!("Bearer {b}"))).unwrap().tenant, "b");
        // A broken file keeps the keys in use.
        std::fs::write(&f, "[[key]]\nsha256 = \"xyz\"\ntenant = \"c\"\n").unwrap();
        assert!(ring.reload().is_err());
        assert_eq!(ring.authenticate(&meta(&format!("Bearer {a}"))).unwrap().tenant, "a");
        // The file never holds a key itself.
        assert!(!std::fs::read_to_string(&f).unwrap().contains(&a));
    }

    /// The attacker holds two keys of one tenant with different limits and alternates them:
    /// each request replaced the tenant's places with a fresh set, so there was no limit at
    /// all. A key file whose keys of one tenant disagree is refused now, and so is a new key
    /// that would make it so.
    #[test]
    fn the_keys_of_one_tenant_cannot_disagree_on_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("keys.toml");
        let t = |limit| Tenant {
            tenant: "t".into(),
            max_in_flight: limit,
            cache_group: None,
            kv_policy: None,
            default_model: None,
        };
        add(&f, t(Some(1))).unwrap();
        add(&f, t(Some(1))).unwrap();
        let e = add(&f, t(Some(2))).unwrap_err().to_string();
        assert!(e.contains("disagree") && e.contains("max_in_flight 1"), "{e}");
        let e = add(&f, t(None)).unwrap_err().to_string();
        assert!(e.contains("disagree"), "{e}");
        assert_eq!(KeyRing::load(&f).unwrap().len(), 2);
        // Written by hand, the file is refused as a whole.
        let entry = |limit: u32| {
            format!(
                "[[key]]\nsha256 = \"{}\"\ntenant = \"t\"\nmax_in_flight = {limit}\n",
                hash(&generate())
            )
        };
        std::fs::write(&f, format!("{}{}", entry(1), entry(2))).unwrap();
        let e = KeyRing::load(&f).unwrap_err().to_string();
        assert!(e.contains("disagree"), "{e}");
    }

    /// A tenant's KV policy is checked when the file is read: a typo would otherwise
    /// silently serve that tenant with full attention, or fail each of its requests.
    #[test]
    fn a_tenants_kv_policy_is_checked_on_load() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("keys.toml");
        let entry = |policy: &str| {
            format!(
                "[[key]]\nsha256 = \"{}\"\ntenant = \"t\"\nkv_policy = \"{policy}\"\n",
                hash(&generate())
            )
        };
        std::fs::write(&f, entry("sinks:1024")).unwrap();
        let ring = KeyRing::load(&f).unwrap();
        assert_eq!(ring.len(), 1);
        std::fs::write(&f, entry("sinks:lots")).unwrap();
        let e = KeyRing::load(&f).unwrap_err().to_string();
        assert!(e.contains("kv_policy") && e.contains("sinks:lots"), "{e}");
    }

    #[test]
    fn cache_salts_differ_by_group_only() {
        let t = |name: &str, group: Option<&str>| Tenant {
            tenant: name.into(),
            max_in_flight: None,
            cache_group: group.map(String::from),
            kv_policy: None,
            default_model: None,
        };
        assert_ne!(t("a", None).cache_salt(), t("b", None).cache_salt());
        assert_eq!(t("a", Some("g")).cache_salt(), t("b", Some("g")).cache_salt());
        assert_ne!(t("a", Some("g")).cache_salt(), t("a", None).cache_salt());
        assert_ne!(t("x", Some("a")).cache_salt(), t("a", None).cache_salt());
    }
}
