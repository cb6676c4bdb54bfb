//! The mesh's transport security as real processes: every internal port demands a certificate
//! of the mesh's CA (plaintext, no certificate, or a stranger's CA is refused by each), the
//! public port demands an API key instead, `--insecure` stays on loopback, and the whole mesh
//! rotates to a new CA on disk without a restart.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use pdmesh_common::tls::{self, MeshRole, MeshTls};
use pdmesh_integration::cluster::{endpoint_as, pki};
use pdmesh_integration::{Cluster, collect, eventually, greedy, pdmesh_bin};
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::kv_store_client::KvStoreClient;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{ListNodesRequest, StatsRequest};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Clusters are heavy on two cores: one test at a time in this binary.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Calls a harmless RPC of the service at `addr` over `ch` (each service has one).
async fn probe(ch: Channel, kind: &str) -> Result<(), tonic::Status> {
    match kind {
        "membership" => MembershipClient::new(ch).list_nodes(ListNodesRequest {}).await.map(|_| ()),
        "prefill" => PrefillClient::new(ch).stats(StatsRequest {}).await.map(|_| ()),
        "kvstore" => KvStoreClient::new(ch).stats(StatsRequest {}).await.map(|_| ()),
        _ => DecodeClient::new(ch).stats(StatsRequest {}).await.map(|_| ()),
    }
}

async fn tokens(client: &mut pdmesh_integration::Client) -> Result<usize, tonic::Status> {
    let ids: Vec<u32> = (0..40).map(|i| 500 + i).collect();
    let s = client.generate(greedy(&ids, 6)).await?.into_inner();
    Ok(collect(s).await?.0.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_internal_port_refuses_strangers_and_the_public_one_wants_a_key() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).kvstore().start().await;
    // An honest request crosses every hop (router → prefill → KV to decode → router).
    assert_eq!(tokens(&mut c.client().await).await.unwrap(), 6);

    // Mallory's certificate is well formed, for the right name, from a CA of her own; she
    // trusts the mesh's CA (a CA certificate is public), so only the servers' demand for a
    // client certificate from it stands in her way.
    let foreign = tempfile::tempdir().unwrap();
    tls::issue(foreign.path(), &[("mallory", MeshRole::Router)]).unwrap();
    let read = |p: std::path::PathBuf| std::fs::read(p).unwrap();
    let ca = Certificate::from_pem(read(pki().ca_file()));
    let theirs = Identity::from_pem(
        read(foreign.path().join("mallory.pem")),
        read(foreign.path().join("mallory.key")),
    );
    let with_foreign_cert = |role| {
        ClientTlsConfig::new()
            .ca_certificate(ca.clone())
            .identity(theirs.clone())
            .domain_name(tls::role_name(role))
    };
    let without_cert =
        |role| ClientTlsConfig::new().ca_certificate(ca.clone()).domain_name(tls::role_name(role));
    let expired = pki().expired_identity("router-old", MeshRole::Router);
    let internal = c.router.internal.clone().unwrap();
    for (addr, kind) in [
        (&internal, "membership"),
        (&c.prefills[0].addr, "prefill"),
        (&c.decodes[0].addr, "decode"),
        (&c.kvstore.as_ref().unwrap().addr, "kvstore"),
    ] {
        let role = c.role_at(addr);
        // The harness's own certificate works.
        probe(c.channel(addr).await, kind).await.unwrap();
        // Plaintext: told precisely what is wrong.
        let plain = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await;
        let e = probe(plain.unwrap(), kind).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{kind}: {e:?}");
        assert!(e.message().contains("plaintext"), "{kind}: {e:?}");
        // TLS without a client certificate, with one from another CA, and with the mesh's
        // own whose term has ended (certificates used to be good until 4096).
        for (what, cfg) in [
            ("no certificate", without_cert(role)),
            ("a foreign certificate", with_foreign_cert(role)),
            ("an expired certificate", expired.client(role)),
        ] {
            let ep =
                Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(cfg).unwrap();
            if let Ok(ch) = ep.connect().await {
                assert!(probe(ch, kind).await.is_err(), "{kind} answered a client with {what}");
            }
        }
    }

    // The public port: TLS without a client certificate is fine, but no key, a malformed
    // key or an unknown key is UNAUTHENTICATED.
    let public = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(pki().ca_file())))
        .domain_name(tls::MESH_NAME);
    let ep = Endpoint::from_shared(format!("https://{}", c.router.addr))
        .unwrap()
        .tls_config(public.clone())
        .unwrap();
    let ch = ep.connect().await.unwrap();
    for key in [None, Some("pdm_0123456789abcdef")] {
        let mut client = pdmesh_proto::v1::generation_client::GenerationClient::with_interceptor(
            ch.clone(),
            pdmesh_common::apikey::Bearer::new(key).unwrap(),
        );
        let e = tokens(&mut client).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{key:?}: {e:?}");
    }
    let mut keyed = pdmesh_proto::v1::generation_client::GenerationClient::with_interceptor(
        ch,
        pdmesh_common::apikey::Bearer::new(Some(c.api_key("test"))).unwrap(),
    );
    assert_eq!(tokens(&mut keyed).await.unwrap(), 6);
    // Traffic for a router, a decode node or the public API redirected to a process of
    // another role (here the KV-store, whose certificate is the mesh's): every certificate
    // carried the one name every client checked, so any was taken for any server. A client
    // now checks the name of the role it dials, which only that role's certificates carry.
    let store = c.kvstore.as_ref().unwrap().addr.clone();
    let router = pki().identity("router-x", MeshRole::Router);
    for (serves, taken) in [
        (MeshRole::KvStore, true),
        (MeshRole::Decode, false),
        (MeshRole::Router, false),
        (MeshRole::Prefill, false),
    ] {
        let r = endpoint_as(&store, &router, serves).connect().await;
        assert_eq!(r.is_ok(), taken, "a KV-store's certificate as a {serves}: {r:?}");
    }
    let ep = Endpoint::from_shared(format!("https://{}", c.decodes[0].addr)).unwrap();
    let r = ep.tls_config(public).unwrap().connect().await;
    assert!(r.is_err(), "a decode node's certificate taken for the public API");
    // An admin's certificate lists nodes but drives none of them.
    let admin = pki().identity("ops", MeshRole::Admin);
    let ch = c.endpoint_as(&c.decodes[0].addr, &admin).connect().await.unwrap();
    probe(ch.clone(), "decode").await.unwrap();
    let r = pdmesh_proto::v1::ReleaseRequest { reservation_id: "0".repeat(32) };
    let e = DecodeClient::new(ch).release(r).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
}

/// `--insecure` keeps a mesh on one machine: a service asked to listen on, advertise or dial
/// anything but loopback refuses to start, and without either TLS or `--insecure` nothing
/// starts at all.
#[test]
fn insecure_is_loopback_only_and_tls_is_the_default() {
    let model = pdmesh_integration::model_path();
    let model = model.to_str().unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(pdmesh_bin()).args(args).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = run(&["router", "--listen", "127.0.0.1:0", "--model", model]);
    assert!(!ok && err.contains("--insecure"), "{err}");
    for args in [
        &["router", "--insecure", "--allow-anonymous", "--listen", "0.0.0.0:0"][..],
        &["decode", "--insecure", "--listen", "127.0.0.1:0", "--advertise", "10.1.2.3:5000"],
        &["prefill", "--insecure", "--listen", "127.0.0.1:0", "--router", "192.0.2.1:50052"],
    ] {
        let mut a = args.to_vec();
        a.extend(["--model", model]);
        let (ok, err) = run(&a);
        assert!(!ok && err.contains("loopback"), "{args:?}: {err}");
    }
    // The HTTP and metrics ports are plaintext too under --insecure, and `pdmesh up
    // --insecure` adds --allow-anonymous: on 0.0.0.0 they served the whole mesh to the
    // network, without TLS or a key.
    let router = |port: &'static str| {
        let head = ["router", "--insecure", "--allow-anonymous", "--listen", "127.0.0.1:0"];
        [&head[..], &["--internal-listen", "127.0.0.1:0", port, "0.0.0.0:0"]].concat()
    };
    for args in [
        &router("--http-listen")[..],
        &router("--metrics-listen"),
        &["decode", "--insecure", "--listen", "127.0.0.1:0", "--metrics-listen", "0.0.0.0:0"],
        &["--insecure", "up", "--listen", "127.0.0.1:0", "--http-listen", "0.0.0.0:0"],
    ] {
        let mut a = args.to_vec();
        a.extend(["--model", model]);
        let (ok, err) = run(&a);
        assert!(!ok && err.contains("loopback") && err.contains("0.0.0.0"), "{args:?}: {err}");
    }
    // And a router without API keys must say it serves anyone.
    let (ok, err) = run(&["router", "--insecure", "--listen", "127.0.0.1:0", "--model", model]);
    assert!(!ok && err.contains("api_keys"), "{err}");
    // With TLS, a node without the seal key refuses to start: its UCX targets would carry a
    // checksum anyone can compute, so any member of the mesh could forge one.
    for (name, role, cmd) in
        [("decode-x", MeshRole::Decode, "decode"), ("prefill-x", MeshRole::Prefill, "prefill")]
    {
        let dir = pki().identity_dir(name, role);
        let dir = dir.to_str().unwrap();
        let args = [cmd, "--tls-dir", dir, "--tls-name", name, "--listen", "127.0.0.1:0"];
        let mut a = args.to_vec();
        a.extend(["--router", "127.0.0.1:1", "--model", model]);
        let (ok, err) = run(&a);
        assert!(!ok && err.contains("--seal-key"), "{cmd}: {err}");
    }
}

/// The CA is rotated under a running mesh: every process's files are replaced by ones from a
/// new CA. Within the reload period every process serves and dials with the new ones: a
/// client of the old CA is refused by a fresh connection, one of the new CA is served, and
/// requests keep completing throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_rotates_its_ca_without_a_restart() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::builder().prefill(1).decode(1).start().await;
    let mut client = c.client().await;
    assert_eq!(tokens(&mut client).await.unwrap(), 6);
    let dir = c.credentials();
    let new = tls::Ca::generate().unwrap();
    for (name, role) in [
        ("harness-2", MeshRole::Router),
        ("router", MeshRole::Router),
        ("prefill-0", MeshRole::Prefill),
        ("decode-0", MeshRole::Decode),
    ] {
        new.issue(dir, name, role).unwrap();
    }
    let rotated = MeshTls::load(dir, "harness-2").unwrap();
    let decode = c.decodes[0].addr.clone();
    eventually(Duration::from_secs(20), "the decode node serves the new CA", || async {
        let old = c_channel_works(&c.endpoint_as(&decode, &pki_harness())).await;
        let new = c_channel_works(&c.endpoint_as(&decode, &rotated)).await;
        !old && new
    })
    .await;
    // The router dials the nodes with its new certificate, and the nodes take it.
    eventually(Duration::from_secs(20), "a request across the rotated mesh", || async {
        let ep = c.endpoint_as(&c.router.addr, &rotated);
        let Ok(ch) = ep.connect().await else { return false };
        let mut client = pdmesh_proto::v1::generation_client::GenerationClient::with_interceptor(
            ch,
            pdmesh_common::apikey::Bearer::new(Some(c.api_key("test"))).unwrap(),
        );
        tokens(&mut client).await.is_ok_and(|n| n == 6)
    })
    .await;
}

/// The harness's certificate (of the process's CA, which the mesh no longer trusts after a
/// rotation).
fn pki_harness() -> MeshTls {
    pki().identity("harness-old", MeshRole::Router)
}

async fn c_channel_works(ep: &Endpoint) -> bool {
    match ep.clone().connect_timeout(Duration::from_secs(2)).connect().await {
        Ok(ch) => probe(ch, "decode").await.is_ok(),
        Err(_) => false,
    }
}
