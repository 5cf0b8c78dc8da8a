//! Players' connections over TLS (`client_tls`): a client that trusts the proxy's CA logs in and
//! plays; a plaintext client and a client that trusts another CA get nothing, and the proxy
//! counts them and carries on.

mod support;

use cellmesh_proto::client::{self, ClientError, ClientTls, Login};
use cellmesh_proxy::ProxyConfig;
use cellmesh_trust::ClientTlsConfig;
use support::*;

/// An edge certificate for loopback, and a client that trusts its CA.
fn loopback_certs(dir: &std::path::Path) -> (ClientTlsConfig, ClientTls) {
    let (cfg, ca) = edge_certs(dir, &["127.0.0.1", "localhost"]);
    (cfg, ClientTls::from_ca_file(&ca).unwrap())
}

#[tokio::test]
async fn players_log_in_over_tls_and_plaintext_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (tls_cfg, trusting) = loopback_certs(dir.path());
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        client_tls: tls_cfg,
        hello_timeout_ms: 1000,
        ..config(&[&gw])
    })
    .await;
    let addr = proxy.addr();

    let login = Login {
        tls: Some(trusting.clone()),
        ..Login::token(&token("alice"))
    };
    let (mut tx, mut rx, welcome) = client::login_with(&addr, &login).await.unwrap();
    assert_eq!(welcome.account, "alice");
    // Its input reaches the gateway and the echo comes back, through TLS both ways.
    tx.input(1, bytes::Bytes::from_static(b"over tls"))
        .await
        .unwrap();
    let echoed = tokio::time::timeout(PATIENCE, async {
        loop {
            match rx.next().await {
                Some(Ok(m)) => {
                    if let Some(cellmesh_proto::edge::server_message::Body::Batch(_)) = m.body {
                        return;
                    }
                }
                other => panic!("the TLS session ended: {other:?}"),
            }
        }
    })
    .await;
    assert!(echoed.is_ok(), "no batch came back over TLS");

    // A plaintext client waits for a challenge that never comes in clear, and the proxy for a
    // TLS handshake that never comes: the hello's deadline ends it.
    let plain = client::login(&addr, &token("bob")).await;
    assert!(plain.is_err(), "a plaintext login was admitted");
    // A client that trusts another CA refuses the proxy's certificate.
    let other_dir = tempfile::tempdir().unwrap();
    let (_, stranger) = loopback_certs(other_dir.path());
    let err = client::login_with(
        &addr,
        &Login {
            tls: Some(stranger),
            ..Login::token(&token("carol"))
        },
    )
    .await
    .err()
    .expect("a client trusting another CA logged in");
    assert!(matches!(err, ClientError::Tls(_)), "{err}");

    let page = cellmesh_admin::http_get(proxy.handle.admin_addr, "/metrics")
        .await
        .unwrap()
        .1;
    let count = |kind: &str| {
        page.lines()
            .find(|l| l.starts_with(&format!("cellmesh_proxy_errors_total{{kind=\"{kind}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(
        (count("client_tls_timeout"), count("client_tls_refused")),
        (1, 1),
        "{page}"
    );
    // Alice played on throughout.
    tx.input(2, bytes::Bytes::from_static(b"still here"))
        .await
        .unwrap();
    proxy.wait_sessions(1).await;
}

/// A `Transfer` or a `ProbeTarget` names a proxy by the address its name resolved to, and the
/// name beside it: the client checks the certificate against that name.
#[tokio::test]
async fn a_proxy_dialled_by_address_is_checked_against_the_name_it_was_given_by() {
    let dir = tempfile::tempdir().unwrap();
    let (tls_cfg, ca) = edge_certs(dir.path(), &["localhost"]);
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        client_tls: tls_cfg,
        ..config(&[&gw])
    })
    .await;
    let tls = ClientTls::from_ca_file(&ca).unwrap();
    let by_address = Login {
        tls: Some(tls.clone()),
        ..Login::token(&token("dave"))
    };
    let err = client::login_with(&proxy.addr(), &by_address)
        .await
        .err()
        .expect("a certificate without the address was taken for it");
    assert!(matches!(err, ClientError::Tls(_)), "{err}");
    let by_name = Login {
        server_name: "localhost".into(),
        ..by_address
    };
    let (_, _, welcome) = client::login_with(&proxy.addr(), &by_name).await.unwrap();
    assert_eq!(welcome.account, "dave");
}
