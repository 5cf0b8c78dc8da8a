//! Graceful drain of a `cellmesh sidecar` process, the way an operator retires a node: SIGTERM
//! flips `/ready` to false; the partition is re-planned without the node (`cellmesh partition plan
//! --commit`), which hands every entity it holds to the remaining node; then it exits by itself.
//! The real MongoDB holds the topology, the real Redis the session directory.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cellmesh_arena::{ArenaConfig, Census};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_test_support::{admin_state, commit_plan, required, run_id, wait_ready, PATIENCE};
use support::{start_sidecar, CELLMESH};

mod support;

async fn state(admin: SocketAddr) -> serde_json::Value {
    admin_state(admin).await.expect("the node answers /state")
}

async fn ready(admin: SocketAddr) -> Option<u16> {
    cellmesh_admin::http_get(admin, "/ready")
        .await
        .ok()
        .map(|r| r.0)
}

async fn reals(admin: SocketAddr) -> u64 {
    state(admin).await["reals"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_node_once_the_partition_moves_its_area_away() {
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let run = run_id();
    let topology = format!("{}/cm_drain_{run}", mongo.trim_end_matches('/'));
    let geo = format!("drain-{run}");
    commit_plan(CELLMESH, &topology, "2x1", "1,2");

    let mut n1 = start_sidecar(1, &topology, &redis, &geo).await;
    let mut n2 = start_sidecar(2, &topology, &redis, &geo).await;

    // Six NPCs deep inside each node's half of the world.
    let census = Arc::new(Census::default());
    let mut arenas = Vec::new();
    for (node, x) in [(&n1, 30_000.0), (&n2, 100_000.0)] {
        let cfg = ArenaConfig {
            sidecar: SidecarAddr::Tcp(node.local.to_string()),
            npcs: 6,
            center: (x, 1000.0),
            spread: 100.0,
            census: Some(census.clone()),
            ..ArenaConfig::default()
        };
        arenas.push(tokio::spawn(cellmesh_arena::run(
            cfg,
            tokio::time::sleep(Duration::from_secs(120)),
        )));
    }
    // A sidecar is ready once its game is connected.
    wait_ready(n1.admin, &mut n1.process).await;
    wait_ready(n2.admin, &mut n2.process).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !(reals(n1.admin).await == 6 && reals(n2.admin).await == 6) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the arenas did not spawn their NPCs"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // SIGTERM: node 2 stops being ready but keeps serving (its area is still its own).
    n2.process.signal("TERM");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while ready(n2.admin).await != Some(503) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "node 2 still ready after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        n2.process.child.try_wait().unwrap().is_none(),
        "node 2 left before anyone could take its entities"
    );
    assert_eq!(reals(n2.admin).await, 6, "nothing moved yet");

    // The operator gives the whole world to node 1: node 2 hands everything over, then exits.
    commit_plan(CELLMESH, &topology, "1x1", "1");
    let status = tokio::time::timeout(Duration::from_secs(30), n2.process.child.wait())
        .await
        .expect("node 2 exits once drained")
        .unwrap();
    assert!(status.success(), "node 2 exited with {status}");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while reals(n1.admin).await != 12 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "node 1 holds {} entities, not 12",
            reals(n1.admin).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s1 = state(n1.admin).await;
    assert_eq!(s1["partition_epoch"], 2, "{s1}");

    // The games' own census agrees: every NPC held by exactly one arena.
    let report = census.report();
    assert_eq!(report.alive.len(), 12);
    assert!(report.lost().is_empty(), "lost {:?}", report.lost());
    assert!(
        report.duplicated().is_empty(),
        "held twice {:?}",
        report.duplicated()
    );
    for a in arenas {
        a.abort();
    }
}
