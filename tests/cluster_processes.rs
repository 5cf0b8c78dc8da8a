//! Two `cellmesh sidecar` processes as one world, the way an operator deploys them: the partition is
//! committed with `cellmesh partition plan --commit` into the real MongoDB, the nodes take their
//! leases there and share the geo's session directory in the real Redis, a `cellmesh proxy` process
//! spreads sessions over both, and one client sees the NPCs of both nodes.

use std::collections::HashSet;
use std::time::Duration;

use cellmesh_arena::{schema, ArenaConfig};
use cellmesh_proto::edge::{client_message, server_message, DeltaKind, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_test_support::{
    commit_plan, proxy_command, required, run_id, unix_now, wait_ready, ProxyProcess,
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
