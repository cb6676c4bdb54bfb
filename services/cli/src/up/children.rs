//! What `pdmesh up` hands each child: its whole config, built from `up`'s flags on top of the
//! service's defaults, written as TOML for the child's `--config`.

use std::path::Path;

use pdmesh_cli::client::KEY_RING_FILE;

use super::UpArgs;
use super::supervise::Launch;

/// One child's settings: `pdmesh up` writes them to the child's config file (every key, so
/// the file says exactly what the child runs with) and hands it over with `--config`.
#[derive(Debug, Clone)]
pub(super) enum Settings {
    Router(Box<pdmesh_router::RouterConfig>),
    KvStore(Box<pdmesh_kvstore::KvStoreConfig>),
    Prefill(Box<pdmesh_prefill::PrefillConfig>),
    Decode(Box<pdmesh_decode::DecodeConfig>),
}

impl Settings {
    pub(super) fn service(&self) -> &'static str {
        match self {
            Settings::Router(_) => "router",
            Settings::KvStore(_) => "kvstore",
            Settings::Prefill(_) => "prefill",
            Settings::Decode(_) => "decode",
        }
    }

    pub(super) fn toml(&self) -> Result<String, toml::ser::Error> {
        match self {
            Settings::Router(c) => toml::to_string(c),
            Settings::KvStore(c) => toml::to_string(c),
            Settings::Prefill(c) => toml::to_string(c),
            Settings::Decode(c) => toml::to_string(c),
        }
    }

    /// Restarted, a process others dial must be where they already dial it: its listeners
    /// take the addresses it announced (`spawn_announcing`'s order). Nodes re-register
    /// wherever they land.
    pub(super) fn pin(&mut self, announced: &[String]) {
        match self {
            Settings::Router(c) => {
                c.listen.clone_from(&announced[0]);
                c.internal_listen.clone_from(&announced[1]);
                c.http_listen = Some(announced[2].clone());
            }
            Settings::KvStore(c) => c.listen.clone_from(&announced[0]),
            Settings::Prefill(_) | Settings::Decode(_) => {}
        }
    }
}

/// Where every process of the mesh listens for its metrics: any free port.
pub(super) const ANY_PORT: &str = "127.0.0.1:0";

/// The router's settings from `up`'s flags.
pub(super) fn router_config(a: &UpArgs, dir: Option<&Path>) -> pdmesh_router::RouterConfig {
    let mut c = pdmesh_router::RouterConfig {
        listen: a.listen.clone(),
        internal_listen: ANY_PORT.into(),
        http_listen: Some(a.http_listen.clone()),
        metrics_listen: Some(ANY_PORT.into()),
        model: a.model().to_path_buf(),
        models: a.models[1..]
            .iter()
            .map(|m| pdmesh_router::config::ServedModel { path: m.clone(), name: None })
            .collect(),
        colocate_below_tokens: a.colocate_below_tokens,
        api_keys: dir.map(|d| d.join(KEY_RING_FILE)),
        allow_anonymous: dir.is_none(),
        ..Default::default()
    };
    c.tiers = tiers(a);
    let p = &mut c.planner;
    p.min_prefill = count(a.nodes("prefill", 0).max(1));
    p.max_prefill = count(a.most("prefill", 0).max(1));
    p.min_decode = count(a.nodes("decode", 0));
    p.max_decode = count(a.most("decode", 0));
    set(&mut p.ttft_slo_ms, a.ttft_slo_ms);
    set(&mut p.itl_slo_ms, a.itl_slo_ms);
    set(&mut p.window_s, a.planner_window_s);
    set(&mut p.cooldown_s, a.planner_cooldown_s);
    set(&mut c.prefill_policy, a.prefill_policy);
    c
}

/// The router's `[tiers]` from `--tiers` and `--tier-*`; None without `--tiers`.
pub(super) fn tiers(a: &UpArgs) -> Option<pdmesh_router::config::Tiers> {
    if a.tiers.is_empty() {
        return None;
    }
    // The router may run elsewhere than `up`'s directory: the file by its whole path.
    let file = a.tier_classifier.as_ref().map(|f| std::path::absolute(f).unwrap_or(f.clone()));
    Some(pdmesh_router::config::Tiers {
        ladder: a.tiers.clone(),
        policy: a.tier_policy,
        min_mean_logprob: a.tier_min_logprob,
        classifier: file,
        min_p_correct: a.tier_min_p,
    })
}

/// The KV-store's settings from `up`'s flags: the mesh's block size, dtype and transport.
pub(super) fn kvstore_config(a: &UpArgs, router: &str) -> pdmesh_kvstore::KvStoreConfig {
    let mut c = pdmesh_kvstore::KvStoreConfig {
        listen: ANY_PORT.into(),
        metrics_listen: Some(ANY_PORT.into()),
        // Its certificate's name: the router hears it only as that.
        node_id: Some("kvstore".into()),
        routers: vec![router.to_string()],
        budget_bytes: a.kvstore_budget_bytes,
        disk_dir: a.kvstore_disk_dir.clone(),
        model: a.model().to_path_buf(),
        ..Default::default()
    };
    set(&mut c.block_size, a.block_size);
    set(&mut c.kv_dtype, a.kv_dtype.map(|d| d.name().to_string()));
    set(&mut c.kv_transport, a.kv_transport.clone());
    c
}

/// A setting `up` was given, over the default.
fn set<T>(setting: &mut T, given: Option<T>) {
    if let Some(v) = given {
        *setting = v;
    }
}

/// A node count as the planner's settings hold it.
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// What every node of the mesh is started with; `start_node` adds its name.
pub(super) struct NodeTemplate<'a> {
    pub(super) a: &'a UpArgs,
    pub(super) internal: String,
    pub(super) threads: usize,
    pub(super) kvstore: Option<String>,
    pub(super) launch: Launch,
}

/// The settings of a prefill or decode node of model `k` (`up`'s `--model`s in order) from
/// `up`'s flags, and the CPUs it is pinned to.
pub(super) fn node_settings(
    t: &NodeTemplate<'_>,
    k: usize,
    prefill: bool,
    name: &str,
) -> (Settings, Option<String>) {
    let a = t.a;
    let mut engine = pdmesh_engine::EngineSettings {
        model: a.models[k].clone(),
        threads: t.threads,
        ..if prefill {
            pdmesh_prefill::PrefillConfig::default().engine
        } else {
            pdmesh_decode::DecodeConfig::default().engine
        }
    };
    set(&mut engine.block_size, a.block_size);
    set(&mut engine.kv_dtype, a.kv_dtype.map(|d| d.name().to_string()));
    set(&mut engine.backend, if prefill { a.prefill_backend } else { a.decode_backend });
    let (listen, metrics_listen) = (ANY_PORT.to_string(), Some(ANY_PORT.to_string()));
    let (routers, node_id) = (vec![t.internal.clone()], Some(name.to_string()));
    if prefill {
        let mut c = pdmesh_prefill::PrefillConfig {
            listen,
            metrics_listen,
            routers,
            node_id,
            // The KV-store keeps the default model's prefixes only.
            kvstore: t.kvstore.clone().filter(|_| k == 0),
            engine,
            ..Default::default()
        };
        set(&mut c.kv_transport, a.kv_transport.clone());
        set(&mut c.kv_push, a.kv_push);
        set(&mut c.cache_bytes, a.cache_bytes);
        c.cache_disk_dir = a.cache_disk_dir.as_ref().map(|d| d.join(name));
        (Settings::Prefill(c.into()), a.prefill_cpus.clone())
    } else {
        let mut c = pdmesh_decode::DecodeConfig {
            listen,
            metrics_listen,
            routers,
            node_id,
            engine,
            ..Default::default()
        };
        set(&mut c.kv_transport, a.kv_transport.clone());
        set(&mut c.engine.kv_blocks, a.kv_blocks);
        (Settings::Decode(c.into()), a.decode_cpus.clone())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use pdmesh_kv_transfer::PushMode;

    use super::super::supervise::Launch;
    use super::*;

    #[derive(Parser)]
    struct Up {
        #[command(flatten)]
        a: UpArgs,
    }

    /// What `up` writes for a child reads back through the child's own loader as exactly the
    /// settings `up` meant, and carries what its flags asked for.
    fn reads_back<C>(s: &Settings, file: &Path) -> C
    where
        C: serde::Serialize + serde::de::DeserializeOwned + Default + PartialEq + std::fmt::Debug,
    {
        std::fs::write(file, s.toml().expect("serializes")).expect("written");
        let none = serde_json::json!({});
        pdmesh_common::load_config(&C::default(), Some(file), "PDMESH_TEST_UP_", &none)
            .expect("loads")
    }

    #[test]
    fn children_get_what_up_was_asked_for() {
        let up = Up::try_parse_from([
            "up",
            "--prefill",
            "2",
            "--kv-dtype",
            "q8_0",
            "--kv-blocks",
            "77",
            "--ttft-slo-ms",
            "500",
            "--prefill-policy",
            "least-load",
            "--kv-push",
            "chunk",
            "--threads",
            "3",
        ])
        .expect("parses");
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("c.toml");
        let r = router_config(&up.a, Some(dir.path()));
        let back: pdmesh_router::RouterConfig =
            reads_back(&Settings::Router(r.clone().into()), &file);
        assert_eq!(back, r);
        assert_eq!(
            (r.planner.ttft_slo_ms, r.planner.min_prefill, r.planner.min_decode),
            (500.0, 2, 1)
        );
        assert_eq!(r.prefill_policy, pdmesh_router::placement::PrefillPolicy::LeastLoad);
        assert_eq!(r.api_keys, Some(dir.path().join(KEY_RING_FILE)));
        assert!(!r.allow_anonymous, "with credentials the router takes keys");
        assert!(router_config(&up.a, None).allow_anonymous, "--insecure runs without keys");
        let launch = Launch { tls_dir: None, configs: dir.path().into() };
        let t = NodeTemplate {
            a: &up.a,
            internal: "127.0.0.1:9".into(),
            threads: 3,
            kvstore: None,
            launch,
        };
        let (decode, _) = node_settings(&t, 0, false, "decode-0");
        let Settings::Decode(d) = &decode else { panic!("a decode node") };
        let back: pdmesh_decode::DecodeConfig = reads_back(&decode, &file);
        assert_eq!(&back, &**d);
        assert_eq!(
            (d.engine.kv_blocks, d.engine.kv_dtype.as_str(), d.engine.threads),
            (77, "q8_0", 3)
        );
        assert_eq!(
            (d.node_id.as_deref(), d.routers.as_slice()),
            (Some("decode-0"), &["127.0.0.1:9".to_string()][..])
        );
        let (prefill, _) = node_settings(&t, 0, true, "prefill-1");
        let Settings::Prefill(p) = &prefill else { panic!("a prefill node") };
        let back: pdmesh_prefill::PrefillConfig = reads_back(&prefill, &file);
        assert_eq!(&back, &**p);
        assert_eq!(p.kv_push, PushMode::Chunk);
        assert_eq!(
            p.engine.kv_blocks,
            pdmesh_prefill::PrefillConfig::default().engine.kv_blocks,
            "--kv-blocks is the decode nodes'"
        );
    }

    /// Each of `up`'s mesh-wide flags changes the child setting its `--help` names the default
    /// of (`serve::UP_SETS`): the help and what `up` does cannot drift apart.
    #[test]
    fn each_mesh_wide_flag_sets_the_setting_its_help_names() {
        let value = |id: &str| match id {
            "kv_dtype" => "q8_0",
            "kv_transport" => "grpc",
            "prefill_backend" | "decode_backend" => "cuda-emu",
            "kv_push" => "chunk",
            "prefill_policy" => "round-robin",
            _ => "7",
        };
        let launch = Launch { tls_dir: None, configs: std::env::temp_dir() };
        for (id, pointer) in crate::serve::UP_SETS {
            let flag = format!("--{}", id.replace('_', "-"));
            let up = Up::try_parse_from(["up", flag.as_str(), value(id)]).expect("parses");
            let t = NodeTemplate {
                a: &up.a,
                internal: String::new(),
                threads: 1,
                kvstore: None,
                launch: launch.clone(),
            };
            let json = |s: &Settings| match s {
                Settings::Router(c) => serde_json::to_value(c),
                Settings::KvStore(c) => serde_json::to_value(c),
                Settings::Prefill(c) => serde_json::to_value(c),
                Settings::Decode(c) => serde_json::to_value(c),
            };
            let children = serde_json::json!({
                "router": json(&Settings::Router(router_config(&up.a, None).into())).unwrap(),
                "prefill": json(&node_settings(&t, 0, true, "p").0).unwrap(),
                "decode": json(&node_settings(&t, 0, false, "d").0).unwrap(),
            });
            let got = children.pointer(pointer).expect("the setting exists");
            let shown = match got {
                serde_json::Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            assert!(
                shown == value(id) || shown == format!("{}.0", value(id)),
                "{flag} {} left {pointer} at {shown}",
                value(id)
            );
        }
    }

    /// Several `--model`s: the router serves each beside the first, each model's nodes load
    /// it and are named apart, and only the first model's prefill nodes use the KV-store.
    #[test]
    fn several_models_each_get_nodes_of_their_own() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (a, b) = (dir.path().join("small.gguf"), dir.path().join("large.gguf"));
        for m in [&a, &b] {
            std::fs::write(m, b"weights").expect("written");
        }
        let (sa, sb) = (a.display().to_string(), b.display().to_string());
        let up = Up::try_parse_from(["up", "--model", &sa, "--model", &sb, "--decode", "1,2"])
            .expect("parses");
        up.a.check().expect("a valid mesh");
        assert_eq!((up.a.total("prefill"), up.a.total("decode")), (2, 3));
        assert_eq!(UpArgs::node_name(1, "decode", 1), "m1-decode-1");
        let r = router_config(&up.a, None);
        assert_eq!((r.model.as_path(), r.models.len()), (a.as_path(), 1));
        assert_eq!(r.served()[1], ("large".to_string(), b.clone()));
        let t = NodeTemplate {
            a: &up.a,
            internal: String::new(),
            threads: 1,
            kvstore: Some("127.0.0.1:7".into()),
            launch: Launch { tls_dir: None, configs: dir.path().into() },
        };
        for (k, model, kvstore) in [(0, &a, true), (1, &b, false)] {
            let (s, _) = node_settings(&t, k, true, "p");
            let Settings::Prefill(p) = s else { panic!("a prefill node") };
            assert_eq!((&p.engine.model, p.kvstore.is_some()), (model, kvstore), "model {k}");
        }

        let refused = |args: &[&str]| {
            let mut argv = vec!["up", "--model", &sa, "--model", &sb];
            argv.extend(args);
            let up = Up::try_parse_from(argv).expect("parses");
            up.a.check().expect_err("refused").to_string()
        };
        assert!(refused(&["--decode", "1,1,1"]).contains("--decode has 3 counts for 2"));
        assert!(refused(&["--decode", "1,0"]).contains("large.gguf has none"));
        let up = Up::try_parse_from(["up", "--model", &sa, "--model", &sb, "--autoscale"]);
        up.expect("parses").a.check().expect("each model's pools scale on their own");
        let e = refused(&["--autoscale", "--prefill", "1,0"]);
        assert!(e.contains("--autoscale needs --prefill") && e.contains("large.gguf"), "{e}");
        let twice = Up::try_parse_from(["up", "--model", &sa, "--model", &sa]).expect("parses");
        assert!(twice.a.check().expect_err("refused").to_string().contains("\"small\""));

        // `auto` along both, by either policy; a ladder or a file that does not fit is refused.
        let argv = |args: &[&str]| {
            let mut argv = vec!["up", "--model", &sa, "--model", &sb];
            argv.extend(args);
            Up::try_parse_from(argv).expect("parses")
        };
        let up = argv(&["--tiers", "small,large", "--tier-min-logprob", "-0.2"]);
        up.a.check().expect("a cascade");
        let t = router_config(&up.a, None).tiers.expect("tiers");
        assert_eq!((t.ladder.len(), t.min_mean_logprob), (2, -0.2));
        assert!(refused(&["--tiers", "small,huge"]).contains("\"huge\" is not served"));
        let policy = ["--tiers", "small,large", "--tier-policy", "classifier"];
        assert!(refused(&policy).contains("needs `classifier`"));
        let missing = dir.path().join("none.json").display().to_string();
        let e = refused(&[&policy[..], &["--tier-classifier", &missing]].concat());
        assert!(e.contains("--tier-classifier") && e.contains("none.json"), "{e}");
        assert!(Up::try_parse_from(["up", "--tier-policy", "classifier"]).is_err(), "no --tiers");
    }
}
