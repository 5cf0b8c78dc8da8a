//! `cellmesh director` as processes against the real MongoDB-wire server: one balances while a
//! second stands by; a stalled director is deposed by the standby within a lease and never
//! commits again under its old lease, a crashed one likewise, and a stopped one hands its lease
//! back at once. The nodes are stand-ins that publish load reports under real node leases: a
//! hotspot in one cell, measured against the layout as committed.

use std::sync::Arc;
use std::time::Duration;

use cellmesh_stores::topology::{
    self, Acquire, Commit, DirectorAcquire, DirectorLease, Lease, TopologyStore,
};
use cellmesh_test_support::{
    admin_state, director_command, required, run_id, DirectorProcess, PATIENCE,
};
use cellmesh_world::balance::{CellReport, EntityBoundLevels};
use cellmesh_world::geometry::{ChunkPos, WorldShape};
use cellmesh_world::partition::{Bsp, Layout, Partition};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use support::CELLMESH;

mod support;

const LEASE_MS: u64 = 2_000;
const POLL_MS: u64 = 100;
const COST: f64 = 0.001;

fn director(topology: &str, name: &str) -> tokio::process::Command {
    let mut cmd = director_command(CELLMESH);
    cmd.env("CELLMESH_TOPOLOGY_URL", topology)
        .env("CELLMESH_NAME", name)
        .env("CELLMESH_LEASE_MS", LEASE_MS.to_string())
        .env("CELLMESH_STANDBY_POLL_MS", POLL_MS.to_string())
        .env("CELLMESH_BALANCE__BALANCE_PERIOD_MS", "200")
        .env("RUST_LOG", "info");
    cmd
}

async fn state(d: &DirectorProcess) -> serde_json::Value {
    admin_state(d.admin)
        .await
        .unwrap_or_else(|| panic!("{} answers /state:\n{}", d.holder, d.process.tail()))
}

/// Waits until `d`'s `/state` says `role`; returns how long it took.
async fn until_role(d: &DirectorProcess, role: &str, limit: Duration) -> Duration {
    let since = Instant::now();
    loop {
        if state(d).await["role"] == role {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < limit,
            "{} not {role} within {limit:?}: {:#}\n{}",
            d.holder,
            state(d).await,
            d.process.tail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The store's partition epoch once it passes `past`.
async fn epoch_past(store: &dyn TopologyStore, past: u64, what: &str) -> u64 {
    let since = Instant::now();
    loop {
        let epoch = store.partition().await.unwrap().map_or(0, |p| p.epoch());
        if epoch > past {
            return epoch;
        }
        assert!(since.elapsed() < PATIENCE, "{what}: epoch still {epoch}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Four stand-in nodes under real leases: 600 entities over 30 × 20 chunks in node 1's cell, some twenty chunks
/// from the corner where the four cells meet (a line moves by at most the ghost band a round,
/// so a crowd a thousand chunks off would take minutes to reach), and 400 spread over the world, each node reporting what lies in its cell of the partition as
/// committed (so every epoch is acknowledged as soon as it is read).
async fn stand_in_nodes(store: Arc<dyn TopologyStore>, stop: CancellationToken) {
    let p = store.partition().await.unwrap().expect("a partition");
    let shape = *p.shape();
    let hot = p.area_of(1)[0];
    let (cx, cy) = (hot.x1 - 20, hot.y1 - 12);
    let mut entities: Vec<(ChunkPos, u32)> = Vec::new();
    for dx in -15..15 {
        for dy in -10..10 {
            entities.push((
                ChunkPos {
                    x: cx + dx,
                    y: cy + dy,
                },
                1,
            ));
        }
    }
    for i in 0..400 {
        let x = (i * 7919) % shape.chunks_x();
        let y = (i * 104_729) % shape.chunks_y();
        entities.push((ChunkPos { x, y }, 1));
    }
    let mut leases: Vec<Lease> = Vec::new();
    for node in 1..=4 {
        match store
            .acquire_lease(node, &format!("stand-in-{node}"), Duration::from_secs(30))
            .await
            .unwrap()
        {
            Acquire::Granted(l) => leases.push(l),
            other => panic!("node {node}'s lease: {other:?}"),
        }
    }
    while !stop.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A store that stalls a moment is asked again on the next turn, as a node would.
        let Ok(Some(p)) = store.partition().await else {
            continue;
        };
        for lease in &mut leases {
            match store.renew_lease(lease, Duration::from_secs(30)).await {
                Ok(Some(l)) => *lease = l,
                Ok(None) => panic!("stand-in {} lost its lease", lease.node),
                Err(_) => continue,
            }
            let rect = p.area_of(lease.node).first().copied().unwrap_or_default();
            let levels = EntityBoundLevels::measure(rect, entities.iter().copied(), COST);
            let report = CellReport {
                load: levels.load,
                entities: levels.entities,
                rect,
                levels,
                ghost_chunks: 4,
                partition_epoch: p.epoch(),
            };
            assert!(store.publish_load(lease, &report).await.unwrap_or(true));
        }
    }
}

/// The most loaded cell over the average, by the stand-ins' reports.
async fn max_over_avg(store: &dyn TopologyStore) -> f64 {
    let loads: Vec<f64> = store
        .loads()
        .await
        .unwrap()
        .values()
        .map(|r| r.load)
        .collect();
    let avg = loads.iter().sum::<f64>() / loads.len() as f64;
    loads.iter().copied().fold(0.0, f64::max) / avg
}

fn lease_of(state: &serde_json::Value) -> DirectorLease {
    serde_json::from_value(state["lease"].clone()).expect("an active director's lease")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_director_takes_over_within_a_lease_and_a_deposed_one_never_commits() {
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let topology = format!("{}/cm_director_{}", mongo.trim_end_matches('/'), run_id());
    let store = topology::open(&topology).await.unwrap();
    let shape = WorldShape::default();
    let even = Bsp::even(&shape, &[1, 2, 3, 4]).unwrap();
    let first = Partition::new(shape, 1, Layout::Bsp(even)).unwrap();
    assert_eq!(
        store.commit_partition(0, &first).await.unwrap(),
        Commit::Committed
    );
    let stop = CancellationToken::new();
    let nodes = tokio::spawn(stand_in_nodes(store.clone(), stop.clone()));
    let since = Instant::now();
    while store.loads().await.unwrap().len() < 4 {
        assert!(since.elapsed() < PATIENCE, "the stand-ins report");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let imbalance_at_start = max_over_avg(&*store).await;
    assert!(imbalance_at_start > 2.0, "{imbalance_at_start}");

    let a = DirectorProcess::start("director-a", &mut director(&topology, "a")).await;
    until_role(&a, "active", PATIENCE).await;
    let mut b = DirectorProcess::start("director-b", &mut director(&topology, "b")).await;
    cellmesh_test_support::wait_ready(b.admin, &mut b.process).await;
    assert_eq!(state(&b).await["role"], "standby");
    assert_eq!(state(&b).await["other"]["holder"], a.holder.as_str());

    // Each draws the live map from the store, the standby too: the four cells of the layout,
    // each with the load its stand-in reported.
    for d in [&a, &b] {
        let (status, page) = cellmesh_admin::http_get(d.admin, "/map").await.unwrap();
        assert_eq!(status, 200);
        assert!(page.contains("api/world"), "{page}");
        let (status, body) = cellmesh_admin::http_get(d.admin, "/api/world")
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
        let w: serde_json::Value = serde_json::from_str(&body).unwrap();
        let cells = w["cells"].as_array().unwrap();
        assert_eq!(cells.len(), 4, "{w:#}");
        assert!(cells.iter().all(|c| c["load"].as_f64().is_some()), "{w:#}");
        assert!(w["partition_epoch"].as_u64().unwrap() >= 1);
    }

    // A balances: its layouts move lines into the hot cell.
    let epoch = epoch_past(&*store, 2, "a's layouts").await;
    let a_lease = lease_of(&state(&a).await);

    // A stalls (a hung process, a long pause): B takes over within one lease (and a poll).
    a.process.signal("STOP");
    let stalled = Instant::now();
    until_role(&b, "active", Duration::from_millis(LEASE_MS * 3)).await;
    let takeover = stalled.elapsed();
    assert!(
        takeover <= Duration::from_millis(LEASE_MS + 4 * POLL_MS + 500),
        "standby took {takeover:?} with a lease of {LEASE_MS} ms"
    );
    let b_lease = lease_of(&state(&b).await);
    assert!(
        b_lease.epoch > a_lease.epoch,
        "{b_lease:?} after {a_lease:?}"
    );
    let taken_at = store.partition().await.unwrap().unwrap().epoch();
    assert!(taken_at >= epoch);

    // A commit under A's lease is refused by the store, naming B's (read again when B
    // committed in between).
    loop {
        let current = store.partition().await.unwrap().unwrap();
        let next = current.successor(current.layout().clone()).unwrap();
        match store
            .commit_partition_as(&a_lease, current.epoch(), &next)
            .await
            .unwrap()
        {
            Commit::Fenced { director } => {
                assert_eq!(director.map(|d| d.holder), Some(b.holder.clone()));
                break;
            }
            Commit::Stale { .. } => continue,
            Commit::Committed => panic!("a deposed director's commit went through"),
        }
    }

    // B balances on; A wakes, finds its lease gone and stands by without committing.
    let under_b = epoch_past(&*store, taken_at, "b's layouts").await;
    a.process.signal("CONT");
    until_role(&a, "standby", PATIENCE).await;
    let a_state = state(&a).await;
    assert_eq!(a_state["leases_lost"], 1, "{a_state:#}");
    let a_epochs: Vec<u64> = a_state["epochs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["epoch"].as_u64().unwrap())
        .collect();
    assert!(
        !a_epochs.is_empty(),
        "a committed layouts before it stalled"
    );
    assert!(
        a_epochs.iter().all(|e| *e <= taken_at),
        "a committed {a_epochs:?} after b took over at epoch {taken_at}"
    );
    assert!(under_b > taken_at);

    // B crashes: A, standing by, takes over within a lease.
    b.process.kill().await;
    let crashed = Instant::now();
    until_role(&a, "active", Duration::from_millis(LEASE_MS * 3)).await;
    assert!(crashed.elapsed() <= Duration::from_millis(LEASE_MS + 4 * POLL_MS + 500));

    // The world ends up balanced, within the bound the balancer aims at.
    let since = Instant::now();
    loop {
        let m = max_over_avg(&*store).await;
        if m <= 1.3 {
            break;
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "max/avg still {m:.2} (from {imbalance_at_start:.2}): {:#}",
            state(&a).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let a_state = state(&a).await;
    assert!(a_state["balance_moves"].as_u64().unwrap() > 0);
    assert!(a_state["chunks_moved"].as_u64().unwrap() > 0);
    let (status, metrics) = cellmesh_admin::http_get(a.admin, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(metrics.contains("cellmesh_director_active 1"), "{metrics}");
    assert!(metrics.contains("cellmesh_director_line_decisions_total{reason=\"gain\"}"));

    // A stopped director hands its lease back: another is granted it at once.
    a.process.terminate().await;
    match store
        .acquire_director("probe", Duration::from_secs(1))
        .await
        .unwrap()
    {
        DirectorAcquire::Granted(l) => assert!(l.epoch > b_lease.epoch),
        DirectorAcquire::Held(l) => panic!("still held after a clean stop: {l:?}"),
    }
    stop.cancel();
    nodes.await.unwrap();
    store.close().await;
}
