//! A real deployment shape: `cellmesh sidecar` and `cellmesh proxy` as separate processes, configured by
//! a TOML file and `CELLMESH_*` variables, the arena game talking to the sidecar over TCP, and a client
//! playing through the proxy.

use std::time::Duration;

use cellmesh_arena::{schema, ArenaConfig};
use cellmesh_proto::edge::{client_message, server_message, DeltaKind, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_test_support::{
    proxy_command, sidecar_command, unix_now, wait_ready, ProxyProcess, SidecarProcess,
};
use support::CELLMESH;

mod support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_and_proxy_as_processes() {
    let mut sidecar = SidecarProcess::start(
        "sidecar",
        sidecar_command(CELLMESH).env("CELLMESH_NODE_ID", "7"),
    )
    .await;

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("proxy.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"edge-test\"\ngateways = [\"{}\"]\ntoken_secret = \"from-the-file\"\n",
            sidecar.mesh
        ),
    )
    .unwrap();
    let mut proxy = ProxyProcess::start(
        "proxy",
        proxy_command(CELLMESH)
            .arg("--config")
            .arg(&cfg)
            // The environment overrides the file.
            .env("CELLMESH_TOKEN_SECRET", "from-the-env"),
    )
    .await;

    let arena_cfg = ArenaConfig {
        sidecar: SidecarAddr::Tcp(sidecar.local.to_string()),
        npcs: 5,
        center: (500.0, 500.0),
        spread: 40.0,
        ..ArenaConfig::default()
    };
    let arena = tokio::spawn(cellmesh_arena::run(
        arena_cfg,
        tokio::time::sleep(Duration::from_secs(60)),
    ));

    wait_ready(sidecar.admin, &mut sidecar.process).await;
    wait_ready(proxy.admin, &mut proxy.process).await;

    let addr = proxy.clients.to_string();
    let now = unix_now();
    let stale_secret = cellmesh_proto::token::sign(b"from-the-file", "ada", now + 60);
    assert!(
        cellmesh_proto::client::login(&addr, &stale_secret)
            .await
            .is_err(),
        "file secret must be overridden"
    );
    let token = cellmesh_proto::token::sign(b"from-the-env", "ada", now + 60);
    let (mut tx, mut rx, welcome) = cellmesh_proto::client::login(&addr, &token)
        .await
        .expect("login");
    assert_eq!(welcome.gateway_node, 7);

    let mut npcs = std::collections::HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while npcs.len() < 5 {
        let msg = tokio::time::timeout_at(deadline, rx.next())
            .await
            .expect("NPCs in time")
            .expect("open")
            .unwrap();
        match msg.body {
            Some(server_message::Body::Batch(b)) => {
                for d in b.deltas {
                    let npc = d
                        .components
                        .iter()
                        .any(|c| c.r#type == schema::KIND && c.payload.starts_with(b"npc:"));
                    if d.kind == DeltaKind::Appear as i32 && npc {
                        npcs.insert(d.entity_id);
                    }
                }
            }
            Some(server_message::Body::Ping(p)) => tx
                .send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                .await
                .unwrap(),
            _ => {}
        }
    }

    let (status, metrics) = cellmesh_admin::http_get(proxy.admin, "/metrics")
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(metrics.contains("session"), "{metrics}");

    // SIGTERM: the sidecar drains and exits cleanly.
    sidecar.process.terminate().await;
    arena.abort();
}

/// SIGTERM drains the proxy process: not ready at once, players still served through the grace;
/// a second SIGTERM stops it at once, each player told why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_process_drains_on_sigterm_and_stops_on_the_second() {
    let sidecar = SidecarProcess::start("sidecar", &mut sidecar_command(CELLMESH)).await;
    let mut proxy = ProxyProcess::start(
        "proxy",
        proxy_command(CELLMESH)
            .env("CELLMESH_GATEWAYS", sidecar.mesh.to_string())
            .env("CELLMESH_TOKEN_SECRET", "drain-test")
            .env("CELLMESH_DRAIN_GRACE_MS", "60000"),
    )
    .await;
    wait_ready(proxy.admin, &mut proxy.process).await;
    let token = cellmesh_proto::token::sign(b"drain-test", "ada", unix_now() + 60);
    let (mut tx, mut rx, _) = cellmesh_proto::client::login(&proxy.clients.to_string(), &token)
        .await
        .expect("login");

    proxy.process.signal("TERM");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = cellmesh_admin::http_get(proxy.admin, "/ready")
            .await
            .expect("the admin server still answers while draining");
        if status == 503 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "still ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Within the grace the player is still served: a ping is answered.
    tx.send(client_message::Body::Ping(cellmesh_proto::edge::Ping {
        nonce: 77,
    }))
    .await
    .unwrap();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), rx.next())
            .await
            .expect("served during the grace")
            .expect("open")
            .unwrap();
        match m.body {
            Some(server_message::Body::Pong(p)) if p.nonce == 77 => break,
            Some(server_message::Body::Kick(k)) => panic!("kicked within the grace: {k:?}"),
            _ => {}
        }
    }

    proxy.process.signal("TERM");
    let kick = loop {
        let m = tokio::time::timeout(Duration::from_secs(5), rx.next())
            .await
            .expect("kicked at once on the second signal")
            .expect("open")
            .unwrap();
        if let Some(server_message::Body::Kick(k)) = m.body {
            break k;
        }
    };
    assert_eq!(
        kick.reason,
        cellmesh_proto::edge::KickReason::Shutdown as i32
    );
    let status = tokio::time::timeout(Duration::from_secs(5), proxy.process.child.wait())
        .await
        .expect("the proxy exits at once on the second signal")
        .unwrap();
    assert!(status.success(), "{status}");
    drop(sidecar);
}
