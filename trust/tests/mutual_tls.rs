//! Mutual TLS over real sockets: who gets through, what each side learns of the other, and a
//! CA rotation taken without a restart.

use std::path::Path;
use std::sync::Arc;

use cellmesh_trust::certs;
use cellmesh_trust::identity::sidecar_node_name;
use cellmesh_trust::{Identity, MeshTls, MeshTlsConfig, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn sidecar(n: u32) -> Identity {
    Identity::new(Role::Sidecar, Some(n), Some("eu")).unwrap()
}

fn proxy() -> Identity {
    Identity::new(Role::Proxy, None, Some("eu")).unwrap()
}

fn issue(ca: &Path, who: &Identity, out: &Path) -> Arc<MeshTls> {
    certs::issue(ca, who, out, 30).unwrap();
    MeshTls::load(&MeshTlsConfig::in_dir(out)).unwrap()
}

/// Accepts one connection with `server`'s TLS and echoes a line; returns what the client proved.
async fn serve_once(
    server: Arc<MeshTls>,
) -> (String, tokio::task::JoinHandle<std::io::Result<Identity>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await?;
        let (mut s, id) = server.accept(tcp).await?;
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await?;
        s.write_all(&buf).await?;
        s.flush().await?;
        Ok(id)
    });
    (addr, task)
}

async fn dial(client: &MeshTls, addr: &str, name: &str) -> std::io::Result<(Identity, [u8; 5])> {
    let tcp = TcpStream::connect(addr).await?;
    let (mut s, id) = client.connect(tcp, name).await?;
    s.write_all(b"hello").await?;
    s.flush().await?;
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).await?;
    Ok((id, buf))
}

#[tokio::test]
async fn both_ends_learn_who_the_other_is() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    certs::init(&ca, "test").unwrap();
    let node3 = issue(&ca, &sidecar(3), &dir.path().join("n3"));
    let edge = issue(&ca, &proxy(), &dir.path().join("p"));
    assert_eq!(node3.own(), sidecar(3));

    let (addr, server) = serve_once(node3.clone()).await;
    let (id, echoed) = dial(&edge, &addr, &Role::Sidecar.server_name())
        .await
        .unwrap();
    assert_eq!(id, sidecar(3), "the proxy learns which sidecar it reached");
    assert_eq!(&echoed, b"hello");
    assert_eq!(
        server.await.unwrap().unwrap(),
        proxy(),
        "the sidecar learns a proxy dialled"
    );

    // A sidecar dialling node 3 by its node name gets through; expecting node 2 there does not.
    let node1 = issue(&ca, &sidecar(1), &dir.path().join("n1"));
    let (addr, _server) = serve_once(node3.clone()).await;
    assert!(dial(&node1, &addr, &sidecar_node_name(3)).await.is_ok());
    let (addr, _server) = serve_once(node3.clone()).await;
    assert!(dial(&node1, &addr, &sidecar_node_name(2)).await.is_err());
}

#[tokio::test]
async fn a_proxy_certificate_cannot_serve_as_a_sidecar() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    certs::init(&ca, "test").unwrap();
    let edge = issue(&ca, &proxy(), &dir.path().join("p"));
    let other_edge = issue(&ca, &proxy(), &dir.path().join("p2"));
    let (addr, _server) = serve_once(other_edge).await;
    let e = dial(&edge, &addr, &Role::Sidecar.server_name())
        .await
        .unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
}

#[tokio::test]
async fn a_certificate_of_another_ca_is_refused_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, rogue_ca) = (dir.path().join("ca"), dir.path().join("rogue"));
    certs::init(&ca, "test").unwrap();
    certs::init(&rogue_ca, "rogue").unwrap();
    let node3 = issue(&ca, &sidecar(3), &dir.path().join("n3"));
    let rogue = issue(&rogue_ca, &sidecar(1), &dir.path().join("r"));

    // A rogue client: the server refuses its certificate.
    let (addr, server) = serve_once(node3.clone()).await;
    let _ = dial(&rogue, &addr, &sidecar_node_name(3)).await;
    assert!(server.await.unwrap().is_err());

    // A rogue server: the client refuses its certificate.
    let rogue3 = issue(&rogue_ca, &sidecar(3), &dir.path().join("r3"));
    let (addr, _server) = serve_once(rogue3).await;
    let n1 = issue(&ca, &sidecar(1), &dir.path().join("n1"));
    assert!(dial(&n1, &addr, &sidecar_node_name(3)).await.is_err());

    // A client with no certificate at all.
    let (addr, server) = serve_once(node3).await;
    let tcp = TcpStream::connect(&addr).await.unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let _ = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect("sidecar.cellmesh".try_into().unwrap(), tcp)
        .await;
    assert!(server.await.unwrap().is_err());
}

#[tokio::test]
async fn a_new_ca_and_keys_are_taken_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (old_ca, new_ca) = (dir.path().join("ca1"), dir.path().join("ca2"));
    certs::init(&old_ca, "one").unwrap();
    certs::init(&new_ca, "two").unwrap();
    let node3 = issue(&old_ca, &sidecar(3), &dir.path().join("n3"));
    let edge = issue(&old_ca, &proxy(), &dir.path().join("p"));
    assert!(!node3.reload(false, None).unwrap(), "nothing changed yet");

    // Overlap: both sides trust both CAs, then take certificates of the new one.
    let bundle = [
        std::fs::read_to_string(old_ca.join(certs::CA_CERT)).unwrap(),
        std::fs::read_to_string(new_ca.join(certs::CA_CERT)).unwrap(),
    ]
    .concat();
    for (who, out, tls) in [(sidecar(3), "n3", &node3), (proxy(), "p", &edge)] {
        let out = dir.path().join(out);
        certs::issue(&new_ca, &who, &out, 30).unwrap();
        std::fs::write(out.join(certs::CA_CERT), &bundle).unwrap();
        assert!(tls.reload(false, Some(&who)).unwrap());
    }
    // A proxy that has the bundle but still its old CA's certificate, and one issued by the new
    // CA that trusts only it.
    certs::issue(&old_ca, &proxy(), &dir.path().join("old-p"), 30).unwrap();
    std::fs::write(dir.path().join("old-p").join(certs::CA_CERT), &bundle).unwrap();
    let old_edge = MeshTls::load(&MeshTlsConfig::in_dir(&dir.path().join("old-p"))).unwrap();
    let new_only = issue(&new_ca, &proxy(), &dir.path().join("new-p"));
    for client in [&edge, &old_edge, &new_only] {
        let (addr, server) = serve_once(node3.clone()).await;
        dial(client, &addr, &Role::Sidecar.server_name())
            .await
            .unwrap();
        server.await.unwrap().unwrap();
    }
    assert_eq!(node3.reloads(), (1, 0));

    // Files that do not load leave the last good ones in use.
    std::fs::write(dir.path().join("n3").join(certs::KEY), "not a key").unwrap();
    assert!(node3.reload(false, None).is_err());
    let (addr, server) = serve_once(node3.clone()).await;
    dial(&edge, &addr, &Role::Sidecar.server_name())
        .await
        .unwrap();
    server.await.unwrap().unwrap();

    // A certificate proving someone else is not taken.
    certs::issue(&new_ca, &sidecar(4), &dir.path().join("n3"), 30).unwrap();
    let e = node3.reload(false, Some(&sidecar(3))).unwrap_err();
    assert!(format!("{e:#}").contains("node 4"), "{e:#}");
    assert_eq!(node3.own(), sidecar(3));
}

#[test]
fn a_partial_section_and_a_bare_listener_off_loopback_are_refused() {
    use cellmesh_trust::tls::{is_loopback_listen, require_tls_off_loopback};
    let partial = MeshTlsConfig {
        ca: "ca.pem".into(),
        ..Default::default()
    };
    assert!(partial.enabled().is_err());
    assert!(is_loopback_listen("127.0.0.1:7100"));
    assert!(is_loopback_listen("[::1]:7100"));
    assert!(is_loopback_listen("localhost:7100"));
    assert!(!is_loopback_listen("0.0.0.0:7100"));
    assert!(!is_loopback_listen("10.0.0.5:7100"));
    let off = MeshTlsConfig::default();
    assert!(require_tls_off_loopback("mesh_listen", "127.0.0.1:0", &off).is_ok());
    let e = require_tls_off_loopback("mesh_listen", "0.0.0.0:7100", &off).unwrap_err();
    assert!(e.to_string().contains("mesh_tls"), "{e}");
}
