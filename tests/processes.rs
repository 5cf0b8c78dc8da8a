//! A real deployment shape: `cellmesh sidecar` and `cellmesh proxy` as separate processes, configured by
//! a TOML file and `CELLMESH_*` variables, the arena game talking to the sidecar over TCP, and a client
//! playing through the proxy.

use std::process::Stdio;
use std::time::Duration;

use cellmesh_arena::{schema, ArenaConfig};
use cellmesh_proto::edge::{client_message, server_message, DeltaKind, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use support::{free_port, wait_ready};
use tokio::process::Command;

mod support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_and_proxy_as_processes() {
    let bin = env!("CARGO_BIN_EXE_cellmesh");
    let (local, mesh, sc_admin) = (free_port(), free_port(), free_port());
    let (client, px_admin) = (free_port(), free_port());

    let mut sidecar = Command::new(bin)
        .arg("sidecar")
        .env("CELLMESH_NODE_ID", "7")
        .env("CELLMESH_LOCAL_LISTEN", format!("127.0.0.1:{local}"))
        .env("CELLMESH_MESH_LISTEN", format!("127.0.0.1:{mesh}"))
        .env("CELLMESH_ADMIN_LISTEN", format!("127.0.0.1:{sc_admin}"))
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("proxy.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"edge-test\"\nclient_listen = \"127.0.0.1:{client}\"\nadmin_listen = \"127.0.0.1:{px_admin}\"\n\
             gateways = [\"127.0.0.1:{mesh}\"]\ntoken_secret = \"from-the-file\"\n"
        ),
    )
    .unwrap();
    let mut proxy = Command::new(bin)
        .args(["proxy", "--config"])
        .arg(&cfg)
        // The environment overrides the file.
        .env("CELLMESH_TOKEN_SECRET", "from-the-env")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let arena_cfg = ArenaConfig {
        sidecar: SidecarAddr::Tcp(format!("127.0.0.1:{local}")),
        npcs: 5,
        center: (500.0, 500.0),
        spread: 40.0,
        ..ArenaConfig::default()
    };
    let arena = tokio::spawn(cellmesh_arena::run(
        arena_cfg,
        tokio::time::sleep(Duration::from_secs(60)),
    ));

    wait_ready(sc_admin, &mut sidecar).await;
    wait_ready(px_admin, &mut proxy).await;

    let addr = format!("127.0.0.1:{client}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
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

    let (status, metrics) =
        cellmesh_admin::http_get(format!("127.0.0.1:{px_admin}").parse().unwrap(), "/metrics")
            .await
            .unwrap();
    assert_eq!(status, 200);
    assert!(metrics.contains("session"), "{metrics}");

    // SIGTERM: the sidecar drains and exits cleanly.
    let pid = sidecar.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::time::timeout(Duration::from_secs(10), sidecar.wait())
        .await
        .expect("sidecar exits")
        .unwrap();
    assert!(status.success(), "sidecar exit status {status}");
    arena.abort();
}
