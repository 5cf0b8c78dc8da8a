//! Two `cellmesh sidecar` processes as one world, the way an operator deploys them: the partition is
//! committed with `cellmesh partition plan --commit` into the real MongoDB, the nodes take their
//! leases there and share the geo's session directory in the real Redis, a `cellmesh proxy` process
//! spreads sessions over both, and one client sees the NPCs of both nodes. And the geo's Redis
//! restarted empty under a playing client, who is not kicked, and under a login, which attaches.

use std::collections::HashSet;
use std::time::Duration;

use cellmesh_arena::{schema, ArenaConfig};
use cellmesh_proto::edge::{client_message, server_message, DeltaKind, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_test_support::{
    commit_plan, proxy_command, required, run_id, sidecar_command, unix_now, wait_ready, within,
    Process, ProxyProcess, SidecarProcess,
};
use support::{start_sidecar, CELLMESH};

mod support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecar_processes_serve_one_world() {
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let run = run_id();
    let topology = format!("{}/cm_cluster_{run}", mongo.trim_end_matches('/'));
    let geo = format!("cluster-{run}");

    // The operator commits a 2×1 grid: node 1 west of x = 65 536 m, node 2 east of it.
    commit_plan(CELLMESH, &topology, "2x1", "1,2");

    let mut n1 = start_sidecar(1, &topology, &redis, &geo).await;
    let mut n2 = start_sidecar(2, &topology, &redis, &geo).await;

    // Both arenas stand at the border, so one view holds NPCs of both nodes.
    let mut arenas = Vec::new();
    for (node, x) in [(&n1, 65_500.0), (&n2, 65_572.0)] {
        let cfg = ArenaConfig {
            sidecar: SidecarAddr::Tcp(node.local.to_string()),
            npcs: 4,
            center: (x, 1000.0),
            spread: 50.0,
            ..ArenaConfig::default()
        };
        arenas.push(tokio::spawn(cellmesh_arena::run(
            cfg,
            tokio::time::sleep(Duration::from_secs(90)),
        )));
    }
    wait_ready(n1.admin, &mut n1.process).await;
    wait_ready(n2.admin, &mut n2.process).await;

    let mut proxy = ProxyProcess::start(
        "proxy",
        proxy_command(CELLMESH)
            .env("CELLMESH_GEO", &geo)
            .env(
                "CELLMESH_GATEWAYS",
                format!("[\"{}\", \"{}\"]", n1.mesh, n2.mesh),
            )
            .env("CELLMESH_TOKEN_SECRET", "cluster-test"),
    )
    .await;
    wait_ready(proxy.admin, &mut proxy.process).await;

    let token = cellmesh_proto::token::sign(b"cluster-test", "ada", unix_now() + 120);
    let (mut tx, mut rx, welcome) =
        cellmesh_proto::client::login(&proxy.clients.to_string(), &token)
            .await
            .expect("login");
    assert!([1, 2].contains(&welcome.gateway_node), "{welcome:?}");

    // NPC ids carry the node part of the sidecar that minted them.
    let mut npc_nodes = HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while npc_nodes.len() < 2 {
        let msg = tokio::time::timeout_at(deadline, rx.next())
            .await
            .unwrap_or_else(|_| panic!("saw NPCs of nodes {npc_nodes:?} only"))
            .expect("connection open")
            .unwrap();
        match msg.body {
            Some(server_message::Body::Batch(b)) => {
                for d in b.deltas {
                    let npc = d
                        .components
                        .iter()
                        .any(|c| c.r#type == schema::KIND && c.payload.starts_with(b"npc:"));
                    if d.kind == DeltaKind::Appear as i32 && npc {
                        npc_nodes.insert(cellmesh_sidecar::ids::split(d.entity_id).node);
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
    assert_eq!(npc_nodes, HashSet::from([1, 2]));
    for a in arenas {
        a.abort();
    }
}

/// A Redis of the test's own on `port`, with no persistence: a restart forgets everything, as a
/// geo's Redis without its append-only file does.
fn redis_server(port: u16, dir: &std::path::Path) -> Process {
    Process::spawn(
        format!("redis-server :{port}"),
        tokio::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir),
    )
}

/// The session's epoch as the directory holds it, read with redis-cli.
fn directory_epoch(port: u16, geo: &str, account: &str) -> Option<u64> {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "HGET"])
        .arg(format!("cellmesh:{geo}:{{{account}}}:session"))
        .arg("epoch")
        .output()
        .expect("redis-cli runs (./scripts/test.sh installs redis-server and redis-cli)");
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// One sidecar process, its arena and a proxy, on a Redis of the test's own (its directory) and
/// the shared MongoDB (its topology); the session lease is short (renewed every second).
struct OwnRedisNode {
    redis: Process,
    port: u16,
    dir: tempfile::TempDir,
    geo: String,
    node: SidecarProcess,
    proxy: ProxyProcess,
    arena: tokio::task::JoinHandle<anyhow::Result<cellmesh_arena::ArenaStats>>,
}

async fn own_redis_node(name: &str) -> OwnRedisNode {
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let run = run_id();
    let topology = format!("{}/cm_{name}_{run}", mongo.trim_end_matches('/'));
    let geo = format!("{name}-{run}");
    let dir = tempfile::tempdir().expect("a temp dir");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().unwrap().port()
    };
    let redis = redis_server(port, dir.path());
    let redis_url = format!("redis://127.0.0.1:{port}");
    within("the test's Redis to answer", async {
        while directory_ping(port).is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;

    commit_plan(CELLMESH, &topology, "1x1", "1");
    let mut node = SidecarProcess::start(
        "sidecar 1",
        sidecar_command(CELLMESH)
            .env("CELLMESH_NODE_ID", "1")
            .env("CELLMESH_GEO", &geo)
            .env("CELLMESH_TOPOLOGY_URL", &topology)
            .env("CELLMESH_DIRECTORY_URL", &redis_url)
            .env("CELLMESH_SESSION_LEASE_MS", "3000"),
    )
    .await;
    let arena = tokio::spawn(cellmesh_arena::run(
        ArenaConfig {
            sidecar: SidecarAddr::Tcp(node.local.to_string()),
            npcs: 0,
            ..ArenaConfig::default()
        },
        tokio::time::sleep(Duration::from_secs(90)),
    ));
    wait_ready(node.admin, &mut node.process).await;
    let mut proxy = ProxyProcess::start(
        "proxy",
        proxy_command(CELLMESH)
            .env("CELLMESH_GEO", &geo)
            .env("CELLMESH_GATEWAYS", format!("[\"{}\"]", node.mesh))
            .env("CELLMESH_TOKEN_SECRET", "restart-test"),
    )
    .await;
    wait_ready(proxy.admin, &mut proxy.process).await;
    OwnRedisNode {
        redis,
        port,
        dir,
        geo,
        node,
        proxy,
        arena,
    }
}

/// The lab's `restart-redis`, quick: the geo's Redis dies and comes back empty after longer
/// than the session lease. The sidecar finds the session's entry gone and registers it again
/// above the epoch it held instead of kicking the player, who plays on through the same
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_kicks_no_session() {
    let OwnRedisNode {
        mut redis,
        port,
        dir,
        geo,
        node,
        proxy,
        arena,
    } = own_redis_node("redis_restart").await;
    let token = cellmesh_proto::token::sign(b"restart-test", "ada", unix_now() + 120);
    let (mut tx, mut rx, welcome) =
        cellmesh_proto::client::login(&proxy.clients.to_string(), &token)
            .await
            .expect("login");
    let held = directory_epoch(port, &geo, "ada").expect("the session is in the directory");
    assert_eq!(held, welcome.session_epoch, "{welcome:?}");

    // Down for twice the lease, then back with nothing in it.
    redis.kill().await;
    let outage = tokio::time::Instant::now() + Duration::from_secs(6);
    let mut redis = None;
    let back_by = outage + Duration::from_secs(10);
    let mut reregistered = None;
    while tokio::time::Instant::now() < back_by {
        if redis.is_none() && tokio::time::Instant::now() >= outage {
            redis = Some(redis_server(port, dir.path()));
        }
        if redis.is_some() {
            if let Some(epoch) = directory_epoch(port, &geo, "ada") {
                reregistered = Some(epoch);
                break;
            }
        }
        // The client keeps answering pings; a kick ends the test.
        if let Ok(msg) = tokio::time::timeout(Duration::from_millis(100), rx.next()).await {
            match msg.expect("the connection stays open").unwrap().body {
                Some(server_message::Body::Ping(p)) => tx
                    .send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await
                    .unwrap(),
                Some(server_message::Body::Kick(k)) => {
                    panic!("kicked: {k:?}\n{}", node.process.tail())
                }
                _ => {}
            }
        }
    }
    let epoch = reregistered
        .unwrap_or_else(|| panic!("the session never came back:\n{}", node.process.tail()));
    assert!(
        epoch > held,
        "registered again at {epoch}, not above {held}"
    );

    // Still playing: the session outlives a few more renewals with no kick.
    let calm = tokio::time::Instant::now() + Duration::from_secs(4);
    while let Ok(msg) = tokio::time::timeout_at(calm, rx.next()).await {
        match msg.expect("the connection stays open").unwrap().body {
            Some(server_message::Body::Ping(p)) => tx
                .send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                .await
                .unwrap(),
            Some(server_message::Body::Kick(k)) => {
                panic!("kicked after the restart: {k:?}\n{}", node.process.tail())
            }
            _ => {}
        }
    }
    assert_eq!(directory_epoch(port, &geo, "ada"), Some(epoch));
    let (_, metrics) = cellmesh_admin::http_get(node.admin, "/metrics")
        .await
        .expect("the sidecar's /metrics");
    assert!(
        metrics.contains("cellmesh_sidecar_sessions_reregistered_total 1"),
        "no re-registration counted:\n{metrics}"
    );
    arena.abort();
}

/// The lab's `restart-redis` met a login: a player attaching while the geo's Redis restarts is
/// registered once it answers again (the sidecar tries the registration again for a while),
/// not kicked with `GATEWAY_UNAVAILABLE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_while_redis_restarts_is_attached_not_kicked() {
    let OwnRedisNode {
        mut redis,
        port,
        dir,
        geo,
        node,
        proxy,
        arena,
    } = own_redis_node("login_redis_restart").await;
    redis.kill().await;
    let token = cellmesh_proto::token::sign(b"restart-test", "ada", unix_now() + 120);
    let login = tokio::spawn({
        let addr = proxy.clients.to_string();
        async move { cellmesh_proto::client::login(&addr, &token).await }
    });
    tokio::time::sleep(Duration::from_millis(600)).await;
    let _redis = redis_server(port, dir.path());
    let (_tx, _rx, welcome) = login
        .await
        .expect("the login task")
        .unwrap_or_else(|e| panic!("the login failed: {e}\n{}", node.process.tail()));
    assert_eq!(
        directory_epoch(port, &geo, "ada"),
        Some(welcome.session_epoch),
        "{welcome:?}"
    );
    let (_, metrics) = cellmesh_admin::http_get(node.admin, "/metrics")
        .await
        .expect("the sidecar's /metrics");
    assert!(
        metrics.contains("cellmesh_sidecar_errors_total{kind=\"register_retried\"}"),
        "no retry counted:\n{metrics}"
    );
    arena.abort();
}

fn directory_ping(port: u16) -> Result<(), ()> {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "PING"])
        .output()
        .map_err(|_| ())?;
    (String::from_utf8_lossy(&out.stdout).trim() == "PONG")
        .then_some(())
        .ok_or(())
}
