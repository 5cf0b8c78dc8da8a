//! A node restarted in place within this process, the way `cellmesh up --chaos` restarts one:
//! dropping its runtime (every task at once, as a crash ends a process) lets go of its state dir,
//! so a fresh node takes the still-live lease over at once; while the first runs, a second is
//! refused by the lock before it asks the store for anything.

use std::sync::Arc;
use std::time::Duration;

use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::{NodeEntry, TopologyStore};
use cellmesh_stores::Stores;
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Grid, Layout, Partition};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

/// A runtime of one node's own, as `--chaos` gives each.
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_node_whose_runtime_is_dropped_takes_its_lease_over_when_started_again() {
    let dir = tempfile::tempdir().unwrap();
    let world = WorldShape::default();
    let whole = Grid::new(&world, 1, 1, vec![1]).unwrap();
    let partition = Partition::new(world, 1, Layout::Grid(whole)).unwrap();
    let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
    let here = runtime();
    here.block_on(topology.commit_partition(0, &partition))
        .unwrap();
    let cfg = SidecarConfig {
        node_id: 1,
        world,
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        state_dir: dir.path().to_string_lossy().into_owned(),
        ..SidecarConfig::default()
    };
    let start = |rt: &Runtime| -> anyhow::Result<SidecarHandle> {
        rt.block_on(cellmesh_sidecar::start_in(
            cfg.clone(),
            Stores::in_memory(),
            topology.clone(),
            CancellationToken::new(),
        ))
    };
    let entry = || -> NodeEntry { here.block_on(topology.nodes()).unwrap().remove(0) };

    let first_runtime = runtime();
    let first = start(&first_runtime).expect("the first node starts");
    let granted = entry().lease;
    assert_eq!(granted.epoch, 1);

    let e = format!(
        "{:#}",
        start(&runtime()).err().expect("a second node 1 is refused")
    );
    assert!(
        e.contains("another sidecar on this host runs as node 1") && e.contains("is locked"),
        "{e}"
    );
    assert_eq!(entry().lease, granted, "the refused node touched the lease");

    // A crash: every task of the node goes at once, its lease is neither released nor lapsed.
    drop(first);
    first_runtime.shutdown_timeout(Duration::from_secs(2));
    let before = entry();
    assert!(before.live, "{before:?}");

    let again_runtime = runtime();
    let _again = start(&again_runtime).expect("the node starts again at once");
    let after = entry().lease;
    assert_eq!(
        (after.holder != before.lease.holder, after.epoch),
        (true, 2),
        "{after:?}"
    );
    assert!(
        after.ids_floor_unix_ms >= before.lease.expires_unix_ms,
        "{after:?} after {before:?}"
    );
    again_runtime.shutdown_timeout(Duration::from_secs(2));
}
