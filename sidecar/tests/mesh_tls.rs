//! The mesh listener with mutual TLS: only a certificate of the cluster CA gets a hello read, and
//! the hello must say what the certificate proves.

mod support;

use std::sync::Arc;
use std::time::Duration;

use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::mesh::{mesh_message, MeshFrame};
use cellmesh_trust::{certs, Identity, MeshTls, MeshTlsConfig, Role};
use futures::{SinkExt, StreamExt};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

struct Cluster {
    dir: tempfile::TempDir,
}

impl Cluster {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        certs::init(&dir.path().join("ca"), "test").unwrap();
        Self { dir }
    }

    fn issue(&self, label: &str, who: Identity) -> MeshTlsConfig {
        let out = self.dir.path().join(label);
        certs::issue(&self.dir.path().join("ca"), &who, &out, 1).unwrap();
        MeshTlsConfig::in_dir(&out)
    }

    /// Sidecar node 7 (the harness's) of geo `local`, with mesh TLS.
    async fn sidecar(&self) -> TestSidecar {
        let mut cfg = test_config();
        cfg.mesh_tls = self.issue(
            "node-7",
            Identity::new(Role::Sidecar, Some(7), Some("local")).unwrap(),
        );
        TestSidecar::start_with(cfg).await
    }
}

/// Dials `s` over TLS as `who` and says `hello`; returns the first frame back (`None`: closed).
async fn hello_over_tls(s: &TestSidecar, tls: &MeshTls, hello: MeshFrame) -> Option<MeshFrame> {
    let tcp = TcpStream::connect(s.mesh()).await.unwrap();
    let (stream, proven) = tls
        .connect(tcp, &Role::Sidecar.server_name())
        .await
        .expect("the sidecar's certificate is good");
    assert_eq!(proven.node, Some(7));
    let mut framed = Framed::new(stream, FrameCodec::<MeshFrame>::default());
    framed.send(hello).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), framed.next())
        .await
        .expect("answered before the hello timeout")
        .and_then(Result::ok)
}

fn refused(answer: Option<MeshFrame>) -> String {
    match answer
        .and_then(|f| f.messages.into_iter().next())
        .and_then(|m| m.body)
    {
        Some(mesh_message::Body::Refused(r)) => r.reason,
        other => panic!("expected LinkRefused, got {other:?}"),
    }
}

fn accepted(answer: Option<MeshFrame>) {
    match answer
        .and_then(|f| f.messages.into_iter().next())
        .and_then(|m| m.body)
    {
        Some(mesh_message::Body::Hello(h)) => assert_eq!(h.node_id, 7),
        other => panic!("expected LinkHello, got {other:?}"),
    }
}

#[tokio::test]
async fn a_stranger_without_a_certificate_gets_nothing() {
    let cluster = Cluster::new();
    let s = cluster.sidecar().await;

    // Plaintext, as a peer of a cluster without TLS (or an attacker with the mesh.proto) would.
    let mut plain = TcpStream::connect(s.mesh()).await.unwrap();
    let mut framed = Framed::new(&mut plain, FrameCodec::<MeshFrame>::default());
    framed.send(link_hello("stranger", 1)).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), framed.next())
        .await
        .expect("closed before the hello timeout");
    assert!(
        !matches!(answer, Some(Ok(_))),
        "a plaintext peer read a frame: {answer:?}"
    );

    // TLS without a client certificate.
    let tcp = TcpStream::connect(s.mesh()).await.unwrap();
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read(cluster.dir.path().join("ca").join(certs::CA_CERT)).unwrap();
    for c in rustls_pki_types::pem::PemObject::pem_slice_iter(&ca) {
        roots.add(c.unwrap()).unwrap();
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect("sidecar.cellmesh".try_into().unwrap(), tcp)
        .await
        .expect("TLS 1.3 completes before the server checks the client");
    let _ = tls.write_all(b"\0\0\0\x10hello").await;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf))
        .await
        .expect("closed before the hello timeout");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");

    // A certificate of another CA.
    let rogue = Cluster::new();
    let rogue_tls = MeshTls::load(&rogue.issue(
        "proxy",
        Identity::new(Role::Proxy, None, Some("local")).unwrap(),
    ))
    .unwrap();
    let tcp = TcpStream::connect(s.mesh()).await.unwrap();
    assert!(
        rogue_tls
            .connect(tcp, &Role::Sidecar.server_name())
            .await
            .is_err(),
        "the rogue proxy does not trust the sidecar either"
    );

    cellmesh_test_support::within("the refusals are counted", async {
        loop {
            let m = s.metrics().await;
            if m.contains("cellmesh_sidecar_errors_total{kind=\"tls_refused\"} 3") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_proxy_certificate_posing_as_a_sidecar_is_refused() {
    let cluster = Cluster::new();
    let s = cluster.sidecar().await;
    let proxy = MeshTls::load(&cluster.issue(
        "proxy",
        Identity::new(Role::Proxy, None, Some("local")).unwrap(),
    ))
    .unwrap();
    let reason = refused(hello_over_tls(&s, &proxy, sidecar_hello(2, 0)).await);
    assert!(reason.contains("certificate proves proxy"), "{reason}");
    // Said as what it is, it gets in.
    accepted(hello_over_tls(&s, &proxy, link_hello("proxy-a", 1)).await);
}

#[tokio::test]
async fn a_sidecar_certificate_for_node_3_claiming_node_2_is_refused() {
    let cluster = Cluster::new();
    let s = cluster.sidecar().await;
    let node3 = MeshTls::load(&cluster.issue(
        "node-3",
        Identity::new(Role::Sidecar, Some(3), Some("local")).unwrap(),
    ))
    .unwrap();
    let reason = refused(hello_over_tls(&s, &node3, sidecar_hello(2, 0)).await);
    assert!(
        reason.contains("node 2") && reason.contains("node 3"),
        "{reason}"
    );
    accepted(hello_over_tls(&s, &node3, sidecar_hello(3, 0)).await);
    let m = s.metrics().await;
    assert!(
        m.contains("cellmesh_sidecar_errors_total{kind=\"link_refused\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn a_sidecar_refuses_to_start_with_a_certificate_of_another_node() {
    let cluster = Cluster::new();
    let mut cfg = test_config();
    cfg.mesh_tls = cluster.issue(
        "node-3",
        Identity::new(Role::Sidecar, Some(3), Some("local")).unwrap(),
    );
    let e = cellmesh_sidecar::start(
        cfg,
        cellmesh_stores::Stores::in_memory(),
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .err()
    .expect("refused");
    let e = format!("{e:#}");
    assert!(e.contains("not this node's") && e.contains("node 3"), "{e}");
}

#[test]
fn a_mesh_listener_off_loopback_needs_mesh_tls() {
    let mut cfg = test_config();
    cfg.mesh_listen = "0.0.0.0:7200".into();
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("mesh_tls") && e.contains("0.0.0.0:7200"), "{e}");
    cfg.mesh_tls = MeshTlsConfig {
        ca: "ca.pem".into(),
        cert: "cert.pem".into(),
        key: "key.pem".into(),
    };
    // Off loopback, the attach attestations need a key of the deployment's too.
    cfg.attest_keys = vec!["a1:shared".into()];
    cfg.validate().unwrap();
}
