//! A real proxy and a real sidecar over mutual TLS: a player plays through them, the cluster's CA
//! and every key rotate without a restart, and the player's session carries on through it.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::client;
use cellmesh_proto::local::sidecar_message;
use cellmesh_proto::sdk::{self, GameReceiver, SdkConfig};
use cellmesh_proxy::{ProxyConfig, ProxyHandle};
use cellmesh_sidecar::config::SidecarConfig;
use cellmesh_sidecar::SidecarHandle;
use cellmesh_stores::Stores;
use cellmesh_test_support::{unix_now, within};
use cellmesh_trust::{certs, Identity, MeshTlsConfig, Role};
use tokio_util::sync::CancellationToken;

const SECRET: &str = "mesh-tls-test-secret";

fn node1() -> Identity {
    Identity::new(Role::Sidecar, Some(1), Some("local")).unwrap()
}

fn edge() -> Identity {
    Identity::new(Role::Proxy, None, Some("local")).unwrap()
}

async fn sidecar(tls: MeshTlsConfig, stop: &CancellationToken) -> SidecarHandle {
    let cfg = SidecarConfig {
        node_id: 1,
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        mesh_tls: tls,
        ..SidecarConfig::default()
    };
    cellmesh_sidecar::start(cfg, Stores::in_memory(), stop.clone())
        .await
        .expect("sidecar starts")
}

async fn proxy(name: &str, gateway: &SidecarHandle, tls: MeshTlsConfig) -> ProxyHandle {
    let cfg = ProxyConfig {
        name: name.into(),
        client_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        gateways: vec![gateway.mesh_addr.to_string()],
        token_secret: SECRET.into(),
        drain_grace_ms: 0,
        drain_spread_ms: 0,
        mesh_tls: tls,
        ..ProxyConfig::default()
    };
    cellmesh_proxy::start(cfg, CancellationToken::new())
        .await
        .expect("proxy starts")
}

async fn ready(p: ProxyHandle) -> ProxyHandle {
    within("the proxy's gateway link is up", async {
        while !p.admin.is_ready() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    p
}

async fn login(
    p: &ProxyHandle,
    account: &str,
) -> (
    client::ClientSender,
    client::ClientReceiver,
    cellmesh_proto::edge::Welcome,
) {
    let token = cellmesh_proto::token::sign(SECRET.as_bytes(), account, unix_now() + 3600);
    within(
        "a login over the TLS link",
        client::login(&p.client_addr.to_string(), &token),
    )
    .await
    .expect("logged in")
}

/// Waits until the game is told of `account`'s input `payload`.
async fn input_reaches_game(game: &mut GameReceiver, payload: &str) {
    within("the input at the game", async {
        loop {
            let m = game.next().await.expect("game connected").unwrap();
            if let Some(sidecar_message::Body::Input(i)) = m.body {
                if i.payload == payload.as_bytes() {
                    return;
                }
            }
        }
    })
    .await
}

fn issue(ca: &Path, who: &Identity, out: &Path, bundle: Option<&str>) -> MeshTlsConfig {
    certs::issue(ca, who, out, 1).unwrap();
    if let Some(b) = bundle {
        std::fs::write(out.join(certs::CA_CERT), b).unwrap();
    }
    MeshTlsConfig::in_dir(out)
}

#[tokio::test]
async fn a_new_ca_and_keys_are_taken_without_a_restart_while_sessions_continue() {
    let dir = tempfile::tempdir().unwrap();
    let (ca1, ca2) = (dir.path().join("ca1"), dir.path().join("ca2"));
    certs::init(&ca1, "one").unwrap();
    certs::init(&ca2, "two").unwrap();
    let (node_dir, edge_dir) = (dir.path().join("node-1"), dir.path().join("proxy"));
    let stop = CancellationToken::new();
    let s = sidecar(issue(&ca1, &node1(), &node_dir, None), &stop).await;
    let (_game_tx, mut game, _) = sdk::connect(SdkConfig::tcp(s.local_addr.to_string(), "game"))
        .await
        .expect("game connects");
    let p = ready(proxy("proxy-a", &s, issue(&ca1, &edge(), &edge_dir, None)).await).await;

    let (mut alice_tx, _alice_rx, _) = login(&p, "alice").await;
    alice_tx
        .input(1, Bytes::from_static(b"before"))
        .await
        .unwrap();
    input_reaches_game(&mut game, "before").await;

    // The rotation: every process first trusts both CAs, then takes a certificate of the new one.
    let bundle = [
        std::fs::read_to_string(ca1.join(certs::CA_CERT)).unwrap(),
        std::fs::read_to_string(ca2.join(certs::CA_CERT)).unwrap(),
    ]
    .concat();
    issue(&ca2, &node1(), &node_dir, Some(&bundle));
    issue(&ca2, &edge(), &edge_dir, Some(&bundle));

    // A proxy that knows only the new CA gets in once the sidecar has taken its new files (the
    // sidecar reads them again within seconds, without a signal): the sidecar trusts the new CA
    // and proves itself with the new certificate.
    let fresh_dir = dir.path().join("fresh");
    let fresh = ready(proxy("proxy-b", &s, issue(&ca2, &edge(), &fresh_dir, None)).await).await;
    let (mut bob_tx, _bob_rx, _) = login(&fresh, "bob").await;
    bob_tx.input(1, Bytes::from_static(b"bob")).await.unwrap();
    input_reaches_game(&mut game, "bob").await;

    // Alice never noticed: the same connection, the same link, still playing.
    alice_tx
        .input(2, Bytes::from_static(b"after"))
        .await
        .unwrap();
    input_reaches_game(&mut game, "after").await;
    let (_, body) = cellmesh_admin::http_get(p.admin_addr, "/state")
        .await
        .unwrap();
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    let links = state["links"].as_array().expect("links");
    assert_eq!(links.len(), 1, "{state}");
    assert_eq!(
        links[0]["connects"], 1,
        "the link was never dialled again: {state}"
    );

    // The old CA leaves the bundle: a proxy still holding its certificate is refused.
    for d in [&node_dir, &edge_dir] {
        std::fs::copy(ca2.join(certs::CA_CERT), d.join(certs::CA_CERT)).unwrap();
    }
    // Past the sidecar's next look at its files.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let stale_dir = dir.path().join("stale");
    let stale = proxy(
        "proxy-c",
        &s,
        issue(&ca1, &edge(), &stale_dir, Some(&bundle)),
    )
    .await;
    let token = cellmesh_proto::token::sign(SECRET.as_bytes(), "carol", unix_now() + 3600);
    let refused = tokio::time::timeout(
        Duration::from_secs(3),
        client::login(&stale.client_addr.to_string(), &token),
    )
    .await;
    assert!(
        !matches!(refused, Ok(Ok(_))),
        "a proxy of the retired CA reached a gateway"
    );
    stop.cancel();
}
