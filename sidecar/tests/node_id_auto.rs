//! Nodes that share one configuration, as the pods of a fleet do: with `node_id_auto` each takes
//! the lowest free node id at or above `node_id` from the topology store. Ids the partition does
//! not name join as spares. A node restarted in place takes back the id its state dir recorded,
//! and two processes of one host sharing a state dir never run as one id.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::{Lease, TopologyStore};
use cellmesh_stores::Stores;
use cellmesh_test_support::within;
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Grid, Layout, Partition};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

/// A topology store whose partition names node 1 alone: every other node is a spare.
async fn store() -> Arc<dyn TopologyStore> {
    let world = WorldShape::default();
    let whole = Grid::new(&world, 1, 1, vec![1]).unwrap();
    let partition = Partition::new(world, 1, Layout::Grid(whole)).unwrap();
    let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
    topology.commit_partition(0, &partition).await.unwrap();
    topology
}

/// The one configuration every node shares: node ids from `floor` up.
fn shared(floor: u32, state_dir: &str) -> SidecarConfig {
    SidecarConfig {
        node_id: floor,
        node_id_auto: true,
        // The store itself is handed to `start_in`; the key says the node is clustered.
        topology_url: "memory".into(),
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        state_dir: state_dir.into(),
        ..SidecarConfig::default()
    }
}

struct Node {
    handle: SidecarHandle,
    stop: CancellationToken,
}

async fn start(cfg: SidecarConfig, topology: &Arc<dyn TopologyStore>) -> anyhow::Result<Node> {
    let stop = CancellationToken::new();
    let handle =
        cellmesh_sidecar::start_in(cfg, Stores::in_memory(), topology.clone(), stop.clone())
            .await?;
    Ok(Node { handle, stop })
}

/// The node id `/state` shows.
async fn shown_id(h: &SidecarHandle) -> u64 {
    let (status, body) = cellmesh_admin::http_get(h.admin_addr, "/state")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    state["node_id"].as_u64().expect("node_id in /state")
}

async fn lease_of(topology: &dyn TopologyStore, node: u32) -> (Lease, bool) {
    let entry = topology
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .find(|e| e.lease.node == node)
        .unwrap_or_else(|| panic!("node {node} never held a lease"));
    (entry.lease, entry.live)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_of_one_configuration_take_distinct_ids_and_a_freed_one_is_taken_again() {
    let topology = store().await;
    // Three at once: the store's grant settles who gets which id.
    let (a, b, c) = tokio::join!(
        start(shared(1, ""), &topology),
        start(shared(1, ""), &topology),
        start(shared(1, ""), &topology),
    );
    let mut nodes = vec![a.unwrap(), b.unwrap(), c.unwrap()];
    let ids: BTreeSet<u32> = nodes.iter().map(|n| n.handle.node_id).collect();
    assert_eq!(ids, BTreeSet::from([1, 2, 3]));
    for n in &nodes {
        assert_eq!(shown_id(&n.handle).await, u64::from(n.handle.node_id));
        assert!(lease_of(topology.as_ref(), n.handle.node_id).await.1);
    }
    // The spares (ids the partition does not name) run and link to every other node.
    within("every peer link up", async {
        while !nodes.iter().all(|n| n.handle.stats().peers_up == 2) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    // Node 2 stops (SIGTERM's last step): its lease is given up...
    let two = nodes.remove(nodes.iter().position(|n| n.handle.node_id == 2).unwrap());
    let (held, _) = lease_of(topology.as_ref(), 2).await;
    two.stop.cancel();
    two.handle.wait().await;
    let (released, live) = lease_of(topology.as_ref(), 2).await;
    assert!(!live && released.expires_unix_ms == 0, "{released:?}");

    // ...and the next node of the same configuration takes that lowest free id.
    let fourth = start(shared(1, ""), &topology).await.unwrap();
    assert_eq!(fourth.handle.node_id, 2);
    assert_eq!(shown_id(&fourth.handle).await, 2);
    let (lease, live) = lease_of(topology.as_ref(), 2).await;
    assert!(live && lease.epoch > held.epoch, "{lease:?} after {held:?}");

    // The floor is kept to: none below it, and none past the last node id.
    let high = start(shared(1022, ""), &topology).await.unwrap();
    assert_eq!(high.handle.node_id, 1022);
    let last = start(shared(1022, ""), &topology).await.unwrap();
    assert_eq!(last.handle.node_id, 1023);
    let e = format!(
        "{:#}",
        start(shared(1022, ""), &topology)
            .await
            .err()
            .expect("no id left")
    );
    assert!(
        e.contains("no node id is free from node_id 1022 up to 1023"),
        "{e}"
    );

    nodes.extend([fourth, high, last]);
    for n in nodes {
        n.stop.cancel();
        n.handle.wait().await;
    }
}

/// A runtime of one node's own: dropping it ends every task of the node at once, as a crash
/// ends a process (the lease is neither released nor lapsed).
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_node_restarted_in_place_takes_back_its_id_and_a_shared_state_dir_keeps_ids_apart() {
    let here = runtime();
    let topology = here.block_on(store());
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let dir = |i: usize| dirs[i].path().to_string_lossy().into_owned();
    let start_on = |rt: &Runtime, cfg: SidecarConfig| rt.block_on(start(cfg, &topology));

    let first_rt = runtime();
    let first = start_on(&first_rt, shared(1, &dir(0))).unwrap();
    let second_rt = runtime();
    let second = start_on(&second_rt, shared(1, &dir(1))).unwrap();
    assert_eq!((first.handle.node_id, second.handle.node_id), (1, 2));

    // The second crashes: its lease stays live, so a node of another host passes its id over.
    drop(second);
    second_rt.shutdown_timeout(Duration::from_secs(2));
    let (before, live) = here.block_on(lease_of(topology.as_ref(), 2));
    assert!(live, "{before:?}");
    let third_rt = runtime();
    let third = start_on(&third_rt, shared(1, &dir(2))).unwrap();
    assert_eq!(third.handle.node_id, 3);

    // Restarted in place, it takes its own id back at once, over the grant its dir recorded.
    let again_rt = runtime();
    let again = start_on(&again_rt, shared(1, &dir(1))).unwrap();
    assert_eq!(again.handle.node_id, 2);
    let (after, _) = here.block_on(lease_of(topology.as_ref(), 2));
    assert!(
        after.epoch == before.epoch + 1 && after.holder != before.holder,
        "{after:?} after {before:?}"
    );

    // A second process sharing the first's state dir: node 1's lock is held, so it runs as
    // the next free id, and locks that one in the dir.
    let shared_rt = runtime();
    let sharing = start_on(&shared_rt, shared(1, &dir(0))).unwrap();
    assert_eq!(sharing.handle.node_id, 4);
    assert!(dirs[0].path().join("node-4.lease").exists());

    for (node, rt) in [
        (first, first_rt),
        (third, third_rt),
        (again, again_rt),
        (sharing, shared_rt),
    ] {
        node.stop.cancel();
        rt.block_on(node.handle.wait());
        rt.shutdown_timeout(Duration::from_secs(2));
    }
}
