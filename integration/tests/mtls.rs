//! The mesh with mutual TLS on every hop, as real processes: requests flow through router,
//! prefill (pushing KV to decode) and decode, while a client without a certificate, or with
//! one from another CA, is refused by each of them. TLS is per process, so this runs in a
//! test binary of its own.

#![allow(clippy::unwrap_used)]

use pdmesh_common::tls::{self, MeshTls};
use pdmesh_integration::Cluster;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{
    GenerateRequest, ListNodesRequest, StatsRequest, TokenIds, generate_request, generate_response,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Calls a harmless RPC of the service at `addr` over `ch` (each service has one).
async fn probe(ch: Channel, kind: &str) -> Result<(), tonic::Status> {
    match kind {
        "router" => MembershipClient::new(ch).list_nodes(ListNodesRequest {}).await.map(|_| ()),
        "prefill" => PrefillClient::new(ch).stats(StatsRequest {}).await.map(|_| ()),
        _ => DecodeClient::new(ch).stats(StatsRequest {}).await.map(|_| ()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hop_is_mutual_tls_and_strangers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = [
        ("router", "router"),
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
        ("client", "client"),
    ];
    tls::issue(dir.path(), &nodes).unwrap();
    // Mallory's certificate is well formed, for the right name, from a CA of her own.
    let foreign = tempfile::tempdir().unwrap();
    tls::issue(foreign.path(), &[("mallory", "router")]).unwrap();
    assert!(tls::init(Some(MeshTls::load(dir.path(), "client").unwrap())));
    let d = dir.path().display().to_string();
    let flags = |name: &'static str| -> [String; 4] {
        ["--tls-dir".into(), d.clone(), "--tls-name".into(), name.into()]
    };
    let (r, p, dc) = (flags("router"), flags("prefill-0"), flags("decode-0"));
    fn strs(v: &[String; 4]) -> [&str; 4] {
        v.each_ref().map(String::as_str)
    }
    let c = Cluster::builder()
        .prefill(1)
        .decode(1)
        .router_args(&strs(&r))
        .prefill_args(&strs(&p))
        .decode_args(&strs(&dc))
        .start()
        .await;
    c.wait_nodes(1, 1).await;

    // An honest request crosses every hop (router → prefill → KV to decode → router).
    let mut client = c.client().await;
    let req = GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds {
            ids: (0..40).map(|i| 500 + i).collect(),
        })),
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = client.generate(req).await.unwrap().into_inner();
    let (mut toks, mut finished) = (0, None);
    while let Some(m) = s.message().await.unwrap() {
        match m.event {
            Some(generate_response::Event::Delta(d)) => toks += d.token_ids.len(),
            Some(generate_response::Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    assert_eq!(toks, 6);
    let t = finished.unwrap().timings.unwrap();
    assert_eq!((t.prefill_node.as_str(), t.decode_node.as_str()), ("prefill-0", "decode-0"));

    // Mallory trusts the mesh's CA (a CA certificate is public), so only the servers'
    // demand for a client certificate from it stands in her way.
    let read = |p: std::path::PathBuf| std::fs::read(p).unwrap();
    let ca = Certificate::from_pem(read(dir.path().join("ca.pem")));
    let theirs = Identity::from_pem(
        read(foreign.path().join("mallory.pem")),
        read(foreign.path().join("mallory.key")),
    );
    let with_foreign_cert = ClientTlsConfig::new()
        .ca_certificate(ca.clone())
        .identity(theirs)
        .domain_name(tls::MESH_NAME);
    let without_cert = ClientTlsConfig::new().ca_certificate(ca).domain_name(tls::MESH_NAME);
    for (addr, kind) in [
        (&c.router.addr, "router"),
        (&c.prefills[0].addr, "prefill"),
        (&c.decodes[0].addr, "decode"),
    ] {
        // Our own certificate works.
        let ours = tls::endpoint(addr).unwrap().connect().await.unwrap();
        probe(ours, kind).await.unwrap();
        // Plaintext.
        let plain = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await;
        if let Ok(ch) = plain {
            assert!(probe(ch, kind).await.is_err(), "{kind} answered a plaintext client");
        }
        // TLS without a client certificate, and with one from another CA.
        for (what, cfg) in
            [("no certificate", &without_cert), ("a foreign certificate", &with_foreign_cert)]
        {
            let ep = Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(cfg.clone())
                .unwrap();
            if let Ok(ch) = ep.connect().await {
                assert!(probe(ch, kind).await.is_err(), "{kind} answered a client with {what}");
            }
        }
    }
}
