//! The topology store's contract, run against the in-memory store and the real MongoDB named by
//! `CELLMESH_TEST_MONGO_URL` (`./scripts/test.sh` starts one and sets it; without it the MongoDB
//! tests fail, they never pass by skipping). The store keeps the time: the memory store's clock is
//! virtual here, MongoDB's is the server's own, so its lease tests use short leases and sleep.
//!
//! Each MongoDB test works in its own database, so tests run in parallel and re-run against the
//! same server without seeing each other's data.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::mongo::MongoTopology;
use cellmesh_stores::topology::{
    self, ids, Acquire, Commit, DirectorAcquire, Lease, LeasedIds, NodeRecord, PlayerSample,
    TopologyError, TopologyStore, MAX_PLAYER_SAMPLES,
};
use cellmesh_stores::StoreError;
use cellmesh_world::balance::{CellReport, EntityBoundLevels};
use cellmesh_world::geometry::{ChunkPos, ChunkRect, Pos, WorldShape};
use cellmesh_world::partition::{Bsp, Grid, Layout, Partition};
use futures::future::{join_all, BoxFuture};
use mongodb::bson::doc;

/// Virtual time: far from the real clock, so nothing here can depend on it.
const T0: u64 = 1_800_000_000_000;
const TTL: Duration = Duration::from_secs(10);
/// MongoDB's leases run in real time: long enough for a slow answer, short enough to wait out.
const MONGO_TTL: Duration = Duration::from_millis(1_500);

// ---------------------------------------------------------------------------------------------
// Backends

/// A database of the test server that no other test, nor an earlier run, uses; dropped on
/// [`TestDb::drop_all`].
struct TestDb {
    url: String,
    database: String,
}

impl TestDb {
    fn new(test: &str) -> Self {
        let base = match std::env::var("CELLMESH_TEST_MONGO_URL") {
            Ok(url) if !url.is_empty() => url,
            _ => panic!(
                "CELLMESH_TEST_MONGO_URL is not set: run ./scripts/test.sh, which starts a \
                 MongoDB-compatible server and sets it"
            ),
        };
        // Database names are at most 63 bytes; the unique part comes first.
        let database: String = cellmesh_test_support::unique_name(test)
            .chars()
            .take(60)
            .collect();
        Self {
            url: with_database(&base, &database),
            database,
        }
    }

    async fn open(&self) -> MongoTopology {
        MongoTopology::connect(&self.url)
            .await
            .expect("connect to the test MongoDB")
    }

    async fn client(&self) -> mongodb::Client {
        mongodb::Client::with_uri_str(&self.url).await.unwrap()
    }

    async fn drop_all(self) {
        self.client()
            .await
            .database(&self.database)
            .drop()
            .await
            .unwrap();
    }
}

/// `mongodb://h:p[/old][?opts]` with its database path replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let hosts_start = url.find("://").expect("mongodb url has a scheme") + 3;
    let (base, query) = url.split_at(url.find('?').unwrap_or(url.len()));
    let hosts_end = base[hosts_start..]
        .find('/')
        .map_or(base.len(), |i| hosts_start + i);
    format!("{}/{database}{query}", &base[..hosts_end])
}

// ---------------------------------------------------------------------------------------------
// The contract

fn granted(a: Acquire) -> Lease {
    match a {
        Acquire::Granted(l) => l,
        Acquire::Held(l) => panic!("expected a grant, the lease is held: {l:?}"),
    }
}

fn held(a: Acquire) -> Lease {
    match a {
        Acquire::Held(l) => l,
        Acquire::Granted(l) => panic!("expected a refusal, got a grant: {l:?}"),
    }
}

fn record(node: u32, tag: &str) -> NodeRecord {
    NodeRecord {
        node,
        geo: "eu".into(),
        mesh_addr: format!("{tag}:7200"),
        admin_addr: format!("{tag}:9100"),
    }
}

/// How a test lets the store's clock run: virtual time for the memory store, real time (a
/// short lease and sleeps) for MongoDB, whose clock is its own.
type Pass = Box<dyn Fn(Duration) -> BoxFuture<'static, ()> + Send + Sync>;

/// A memory store on a virtual clock starting at `T0`, and how to move that clock.
fn virtual_memory() -> (MemoryTopology, Pass) {
    let now = Arc::new(AtomicU64::new(T0));
    let read = now.clone();
    let store = MemoryTopology::with_clock(Arc::new(move || read.load(Ordering::SeqCst)));
    let pass: Pass = Box::new(move |d| {
        now.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
        Box::pin(async {})
    });
    (store, pass)
}

fn real_time() -> Pass {
    Box::new(|d| Box::pin(tokio::time::sleep(d)))
}

/// Leases: grants, refusals, renewals, lapses, take-overs and the fencing they imply. Every
/// instant is the store's own: no caller's clock can make a live lease look lapsed.
async fn leases(store: &dyn TopologyStore, ttl: Duration, pass: &Pass) {
    let lapse = ttl + ttl / 5;
    let a = granted(store.acquire_lease(3, "a", ttl).await.unwrap());
    assert_eq!(
        (a.node, a.holder.as_str(), a.epoch, a.ids_floor_unix_ms),
        (3, "a", 1, 0)
    );
    // Held: the refusal names the holder.
    assert_eq!(held(store.acquire_lease(3, "b", ttl).await.unwrap()), a);
    pass(ttl / 2).await;
    let a = store
        .renew_lease(&a, ttl)
        .await
        .unwrap()
        .expect("renewed while live");
    assert_eq!(a.epoch, 1);
    held(store.acquire_lease(3, "b", ttl).await.unwrap());
    assert!(store.nodes().await.unwrap()[0].live);

    // Lapsed by the store's clock: b takes over under a new epoch, and a is fenced off.
    pass(lapse).await;
    assert!(!store.nodes().await.unwrap()[0].live);
    let b = granted(store.acquire_lease(3, "b", ttl).await.unwrap());
    assert_eq!((b.holder.as_str(), b.epoch), ("b", 2));
    assert!(
        b.ids_floor_unix_ms >= a.expires_unix_ms,
        "b mints past every id a could have minted: {b:?} after {a:?}"
    );
    assert_eq!(store.renew_lease(&a, ttl).await.unwrap(), None);
    assert!(!store.release_lease(&a).await.unwrap());
    assert!(!store.publish_node(&a, &record(3, "a")).await.unwrap());
    assert_eq!(held(store.acquire_lease(3, "a", ttl).await.unwrap()), b);

    // The record belongs to the current holder and is shown with its lease.
    assert!(store.publish_node(&b, &record(3, "b")).await.unwrap());
    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(
        (&nodes[0].lease, nodes[0].record.as_ref(), nodes[0].live),
        (&b, Some(&record(3, "b")), true)
    );

    // A lapsed lease is not renewed even if nobody took it: the holder must ask again (and
    // re-read the partition), getting a new epoch and an empty record.
    pass(lapse).await;
    assert_eq!(store.renew_lease(&b, ttl).await.unwrap(), None);
    let b = granted(store.acquire_lease(3, "b", ttl).await.unwrap());
    assert_eq!(b.epoch, 3);
    assert_eq!(store.nodes().await.unwrap()[0].record, None);

    // A holder asking again while it holds gets a new epoch; its old grant is fenced off.
    let b4 = granted(store.acquire_lease(3, "b", ttl).await.unwrap());
    assert_eq!(b4.epoch, 4);
    assert_eq!(store.renew_lease(&b, ttl).await.unwrap(), None);

    // Released: free at once for anyone, whose ids still start past the released holder's.
    assert!(store.release_lease(&b4).await.unwrap());
    let a = granted(store.acquire_lease(3, "a", ttl).await.unwrap());
    assert_eq!(a.epoch, 5);
    assert!(
        a.ids_floor_unix_ms >= b4.expires_unix_ms,
        "{a:?} after {b4:?}"
    );

    // Nodes are independent; the list is by node id.
    let other = granted(store.acquire_lease(0, "b", ttl).await.unwrap());
    assert_eq!(other.epoch, 1);
    let ids: Vec<u32> = store
        .nodes()
        .await
        .unwrap()
        .iter()
        .map(|e| e.lease.node)
        .collect();
    assert_eq!(ids, vec![0, 3]);

    // Bad requests are refused before they reach the store.
    let err = |r: Result<Acquire, TopologyError>| r.unwrap_err().to_string();
    assert!(err(store.acquire_lease(1024, "a", ttl).await).contains("node id 1024"));
    assert!(err(store.acquire_lease(1, "", ttl).await).contains("holder"));
    assert!(err(store.acquire_lease(1, "a", Duration::ZERO).await).contains("ttl"));
    let e = store.publish_node(&a, &record(4, "a")).await.unwrap_err();
    assert!(
        e.to_string().contains("node 4") && e.to_string().contains("node 3"),
        "{e}"
    );
}

/// Takeovers: a process that proves its predecessor dead replaces that exact grant at once, live
/// or lapsed; any other grant is fenced as if it acquired.
async fn takeovers(store: &dyn TopologyStore, ttl: Duration, pass: &Pass) {
    let lapse = ttl + ttl / 5;
    let old = granted(store.acquire_lease(5, "old", ttl).await.unwrap());
    assert!(store.publish_node(&old, &record(5, "old")).await.unwrap());
    let old = store.renew_lease(&old, ttl).await.unwrap().expect("live");

    // Its recorded successor takes the live lease over under the next epoch; the old grant is
    // fenced off, and its record is gone with it.
    let new = granted(store.take_over_lease(&old, "new", ttl).await.unwrap());
    assert_eq!(
        (new.node, new.holder.as_str(), new.epoch),
        (5, "new", old.epoch + 1)
    );
    assert!(
        new.ids_floor_unix_ms >= old.expires_unix_ms,
        "the successor mints past every id the old holder could have: {new:?} after {old:?}"
    );
    assert_eq!(store.renew_lease(&old, ttl).await.unwrap(), None);
    assert!(!store.release_lease(&old).await.unwrap());
    assert!(!store.publish_node(&old, &record(5, "old")).await.unwrap());
    let entry = store.nodes().await.unwrap().remove(0);
    assert_eq!((&entry.lease, entry.record, entry.live), (&new, None, true));

    // Naming a grant that is not the current one is an ordinary request: the live holder keeps
    // it, whether the grant named is an older epoch or another holder's.
    assert_eq!(
        held(store.take_over_lease(&old, "third", ttl).await.unwrap()),
        new
    );
    let other_holder = Lease {
        holder: "someone-else".into(),
        ..new.clone()
    };
    assert_eq!(
        held(
            store
                .take_over_lease(&other_holder, "third", ttl)
                .await
                .unwrap()
        ),
        new
    );
    let new = store
        .renew_lease(&new, ttl)
        .await
        .unwrap()
        .expect("still live");

    // A lapsed grant that is still the current one is taken over too, ids past its expiry.
    pass(lapse).await;
    let next = granted(store.take_over_lease(&new, "next", ttl).await.unwrap());
    assert_eq!(next.epoch, new.epoch + 1);
    assert!(next.ids_floor_unix_ms >= new.expires_unix_ms, "{next:?}");

    // A released grant is free anyway; a stale one of a free node is simply a grant.
    assert!(store.release_lease(&next).await.unwrap());
    let after = granted(store.take_over_lease(&old, "after", ttl).await.unwrap());
    assert_eq!(after.epoch, next.epoch + 1);
    assert!(after.ids_floor_unix_ms >= next.expires_unix_ms, "{after:?}");

    // A node never leased has nothing to replace: the first grant.
    let fresh = Lease {
        node: 6,
        ..old.clone()
    };
    let first = granted(store.take_over_lease(&fresh, "first", ttl).await.unwrap());
    assert_eq!((first.node, first.epoch), (6, 1));

    // The new holder's name is checked like any other request's.
    let e = store.take_over_lease(&first, "", ttl).await.unwrap_err();
    assert!(e.to_string().contains("holder"), "{e}");
}

/// Contenders all naming the same grant: exactly one takes it over, the others are refused
/// naming the winner.
async fn takeover_races(stores: Vec<Arc<dyn TopologyStore>>) {
    for node in 20..24 {
        let dead = granted(stores[0].acquire_lease(node, "dead", TTL).await.unwrap());
        let attempts = stores.iter().cycle().take(8).enumerate().map(|(i, s)| {
            let (s, dead) = (s.clone(), dead.clone());
            async move {
                s.take_over_lease(&dead, &format!("s{i}"), TTL)
                    .await
                    .unwrap()
            }
        });
        let outcomes = join_all(attempts).await;
        let winners: Vec<&Lease> = outcomes
            .iter()
            .filter_map(|o| match o {
                Acquire::Granted(l) => Some(l),
                Acquire::Held(_) => None,
            })
            .collect();
        assert_eq!(winners.len(), 1, "node {node}: {outcomes:?}");
        assert_eq!(winners[0].epoch, dead.epoch + 1);
        for o in &outcomes {
            if let Acquire::Held(l) = o {
                assert_eq!(l, winners[0], "a refusal names the winner");
            }
        }
    }
}

/// The node part of ids comes from the lease, minting stops when the lease lapses, and a
/// successor's ids come after every id of the holder before it, whatever their clocks.
async fn ids_from_leases(store: &dyn TopologyStore, ttl: Duration, pass: &Pass) {
    let lease = granted(store.acquire_lease(17, "minter", ttl).await.unwrap());
    let mut minter = LeasedIds::new(&lease).unwrap();
    // A clock a little behind the store's.
    let now = lease.expires_unix_ms - ttl.as_millis() as u64 - 100;
    let id = minter.mint(now).unwrap();
    assert_eq!((ids::node_of(id), ids::unix_ms_of(id)), (17, now));
    assert!(
        minter.mint(lease.expires_unix_ms).is_err(),
        "minted past the lease"
    );
    let renewed = store.renew_lease(&lease, ttl).await.unwrap().unwrap();
    minter.renewed(&renewed).unwrap();
    // Right up to the lease's expiry, borrowing from the future if its clock says so.
    let last = minter.mint(renewed.expires_unix_ms - 1).unwrap();
    assert!(last > id);
    pass(ttl + ttl / 5).await;
    let next = granted(store.acquire_lease(17, "successor", ttl).await.unwrap());
    // Its clock runs far behind: its first id still follows the last of the old holder.
    let first = LeasedIds::new(&next).unwrap().mint(now).unwrap();
    assert!(first > last, "{first} after {last}");
}

fn shape() -> WorldShape {
    WorldShape {
        width: 2048.0,
        height: 2048.0,
        chunk_size: 32.0,
        region_size: 1024.0,
    }
}

fn grid_partition(epoch: u64, table: Vec<u32>) -> Partition {
    let grid = Grid::new(&shape(), 2, 2, table).unwrap();
    Partition::new(shape(), epoch, Layout::Grid(grid)).unwrap()
}

/// Compare-and-set commits of the partition.
/// A restored process is marked for good (twice is once), and a listing finds exactly the
/// marked ones.
async fn restored_marks(store: &dyn TopologyStore) {
    assert!(store.restored_among(&[]).await.unwrap().is_empty());
    assert!(store.restored_among(&[(3, 7)]).await.unwrap().is_empty());
    store.mark_restored(3, 7).await.unwrap();
    store.mark_restored(3, 7).await.unwrap();
    store.mark_restored(4, 1).await.unwrap();
    let asked = [(3, 6), (3, 7), (4, 1), (3, 8)];
    assert_eq!(
        store.restored_among(&asked).await.unwrap(),
        [(3, 7), (4, 1)]
    );
}

async fn commits(store: &dyn TopologyStore) {
    assert_eq!(store.partition().await.unwrap(), None);
    let p1 = grid_partition(1, vec![1, 2, 3, 4]);
    assert_eq!(
        store.commit_partition(0, &p1).await.unwrap(),
        Commit::Committed
    );
    assert_eq!(store.partition().await.unwrap().as_ref(), Some(&p1));
    // A second planner that also started from "nothing committed" is refused.
    let rival = grid_partition(1, vec![4, 3, 2, 1]);
    assert_eq!(
        store.commit_partition(0, &rival).await.unwrap(),
        Commit::Stale { current_epoch: 1 }
    );
    // A BSP successor goes in; a stale commit from epoch 1 is then refused.
    let p2 = p1
        .successor(Layout::Bsp(Bsp::even(&shape(), &[1, 2, 5]).unwrap()))
        .unwrap();
    assert_eq!(
        store.commit_partition(1, &p2).await.unwrap(),
        Commit::Committed
    );
    let stale = p1.successor(p1.layout().clone()).unwrap();
    assert_eq!(
        store.commit_partition(1, &stale).await.unwrap(),
        Commit::Stale { current_epoch: 2 }
    );
    assert_eq!(store.partition().await.unwrap().as_ref(), Some(&p2));
    // A commit must advance the epoch by exactly one.
    let e = store
        .commit_partition(2, &grid_partition(4, vec![1; 4]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            TopologyError::EpochGap {
                expected: 2,
                next: 4
            }
        ),
        "{e}"
    );
    assert_eq!(store.partition().await.unwrap().as_ref(), Some(&p2));
}

/// The director's lease: one director at a time, its commits fenced by its lease in the same
/// atomic step, a lapsed or released one refused, and plain commits (a node's restore) leaving
/// the lease alone.
async fn directors(store: &dyn TopologyStore, ttl: Duration, pass: &Pass) {
    let lapse = ttl + ttl / 5;
    assert!(matches!(
        store.acquire_director("a", ttl).await,
        Err(TopologyError::NoPartition)
    ));
    let p = |epoch| grid_partition(epoch, vec![1, 2, 3, (epoch % 4) as u32 + 1]);
    assert_eq!(
        store.commit_partition(0, &p(1)).await.unwrap(),
        Commit::Committed
    );
    let DirectorAcquire::Granted(a) = store.acquire_director("a", ttl).await.unwrap() else {
        panic!("the lease is free")
    };
    assert_eq!(a.epoch, 1);
    assert_eq!(
        store.acquire_director("b", ttl).await.unwrap(),
        DirectorAcquire::Held(a.clone())
    );
    assert_eq!(
        store.commit_partition_as(&a, 1, &p(2)).await.unwrap(),
        Commit::Committed
    );
    let a = store
        .renew_director(&a, ttl)
        .await
        .unwrap()
        .expect("renewed");
    // A stopped director: its lease lapses, its commits are refused, another takes over.
    pass(lapse).await;
    assert!(matches!(
        store.commit_partition_as(&a, 2, &p(3)).await.unwrap(),
        Commit::Fenced { .. }
    ));
    assert_eq!(store.renew_director(&a, ttl).await.unwrap(), None);
    let DirectorAcquire::Granted(b) = store.acquire_director("b", ttl).await.unwrap() else {
        panic!("a's lease lapsed")
    };
    assert_eq!(b.epoch, 2);
    assert_eq!(
        store.commit_partition_as(&a, 2, &p(3)).await.unwrap(),
        Commit::Fenced {
            director: Some(b.clone())
        },
        "the deposed director is refused, naming the one in office"
    );
    assert_eq!(
        store.commit_partition_as(&b, 2, &p(3)).await.unwrap(),
        Commit::Committed
    );
    assert_eq!(
        store.commit_partition_as(&b, 2, &p(3)).await.unwrap(),
        Commit::Stale { current_epoch: 3 }
    );
    // A node's plain commit (a restore) goes in, and the director keeps its lease.
    assert_eq!(
        store.commit_partition(3, &p(4)).await.unwrap(),
        Commit::Committed
    );
    let b = store.renew_director(&b, ttl).await.unwrap().expect("kept");
    assert_eq!(store.partition().await.unwrap().unwrap().epoch(), 4);
    // Released: refused at once, and free for another at once.
    assert!(store.release_director(&b).await.unwrap());
    assert!(!store.release_director(&b).await.unwrap(), "only once");
    assert!(matches!(
        store.commit_partition_as(&b, 4, &p(5)).await.unwrap(),
        Commit::Fenced { .. }
    ));
    let DirectorAcquire::Granted(c) = store.acquire_director("a", ttl).await.unwrap() else {
        panic!("released")
    };
    assert_eq!(c.epoch, 3);
}

/// Load reports: published under a live lease, listed while it lives, cleared by a new grant.
async fn load_reports(store: &dyn TopologyStore, ttl: Duration, pass: &Pass) {
    let lapse = ttl + ttl / 5;
    let a = granted(store.acquire_lease(3, "a", ttl).await.unwrap());
    granted(store.acquire_lease(4, "b", ttl).await.unwrap());
    let report = CellReport {
        load: 0.42,
        entities: 7,
        rect: ChunkRect::new(0, 0, 4, 2),
        levels: EntityBoundLevels::measure(
            ChunkRect::new(0, 0, 4, 2),
            [(ChunkPos { x: 1, y: 1 }, 7)],
            0.06,
        ),
        ghost_chunks: 7,
        partition_epoch: 5,
    };
    assert!(store.publish_load(&a, &report).await.unwrap());
    let loads = store.loads().await.unwrap();
    assert_eq!(loads.len(), 1, "node 4 published none");
    assert_eq!(loads[&3], report);
    pass(lapse).await;
    assert!(
        store.loads().await.unwrap().is_empty(),
        "lapsed leases' loads are not listed"
    );
    assert!(!store.publish_load(&a, &report).await.unwrap());
    let c = granted(store.acquire_lease(3, "c", ttl).await.unwrap());
    assert!(
        store.loads().await.unwrap().is_empty(),
        "a new grant starts without a load"
    );
    assert!(store.publish_load(&c, &report).await.unwrap());
    assert_eq!(store.loads().await.unwrap().len(), 1);
}

/// `n` players of a gateway, each different, measured from a geo or two.
fn player_samples(n: usize) -> Vec<PlayerSample> {
    (0..n)
        .map(|i| PlayerSample {
            account: format!("player-{i}"),
            session_id: i as u64 + 1,
            pos: Pos {
                x: i as f64 * 0.25,
                y: 2047.5,
            },
            speed_mps: 1.5 + i as f64,
            rtt_ms: [("eu".to_string(), 12.5), ("us-east".to_string(), 80.25)]
                .into_iter()
                .take(1 + i % 2)
                .collect(),
        })
        .collect()
}

/// Player samples: published under a live lease, replaced whole, listed while the lease lives,
/// cleared by a new grant, and capped at [`MAX_PLAYER_SAMPLES`].
async fn player_reports(store: &dyn TopologyStore, ttl: Duration, pass: &Pass) {
    let lapse = ttl + ttl / 5;
    let a = granted(store.acquire_lease(3, "a", ttl).await.unwrap());
    let b = granted(store.acquire_lease(4, "b", ttl).await.unwrap());
    granted(store.acquire_lease(5, "quiet", ttl).await.unwrap());
    assert!(store.players().await.unwrap().is_empty());
    assert!(store.publish_players(&a, &player_samples(3)).await.unwrap());
    assert!(store.publish_players(&b, &player_samples(1)).await.unwrap());
    let players = store.players().await.unwrap();
    assert_eq!(players.len(), 2, "node 5 published none");
    assert_eq!(players[&3], player_samples(3));
    assert_eq!(players[&4], player_samples(1));
    // A new list replaces the old one, even an empty one.
    assert!(store.publish_players(&a, &player_samples(2)).await.unwrap());
    assert!(store.publish_players(&b, &[]).await.unwrap());
    let players = store.players().await.unwrap();
    assert_eq!(players[&3], player_samples(2));
    assert_eq!(players[&4], []);

    // Released: not listed, and its holder can no longer publish.
    assert!(store.release_lease(&b).await.unwrap());
    assert!(!store.players().await.unwrap().contains_key(&4));
    assert!(!store.publish_players(&b, &player_samples(1)).await.unwrap());

    // Taken over: the new grant starts without the old holder's players, which is fenced off.
    let c = granted(store.take_over_lease(&a, "c", ttl).await.unwrap());
    assert!(store.players().await.unwrap().is_empty());
    assert!(!store.publish_players(&a, &player_samples(2)).await.unwrap());
    assert!(store.players().await.unwrap().is_empty());

    // More than the cap: the first ones are kept.
    let c = store.renew_lease(&c, ttl).await.unwrap().expect("live");
    let many = player_samples(MAX_PLAYER_SAMPLES + 5);
    assert!(store.publish_players(&c, &many).await.unwrap());
    let players = store.players().await.unwrap();
    assert_eq!(players[&3].len(), MAX_PLAYER_SAMPLES);
    assert_eq!(players[&3][..], many[..MAX_PLAYER_SAMPLES]);

    // Lapsed: not listed, and nothing more is published under it.
    pass(lapse).await;
    assert!(store.players().await.unwrap().is_empty());
    assert!(!store.publish_players(&c, &player_samples(1)).await.unwrap());
}

/// Many contenders at once for one node's lease, and many committers from one epoch.
async fn races(stores: Vec<Arc<dyn TopologyStore>>) {
    for node in 0..8 {
        let attempts = stores.iter().cycle().take(12).enumerate().map(|(i, s)| {
            let s = s.clone();
            async move { s.acquire_lease(node, &format!("c{i}"), TTL).await.unwrap() }
        });
        let outcomes = join_all(attempts).await;
        let winners: Vec<&Lease> = outcomes
            .iter()
            .filter_map(|o| match o {
                Acquire::Granted(l) => Some(l),
                Acquire::Held(_) => None,
            })
            .collect();
        assert_eq!(winners.len(), 1, "node {node}: {outcomes:?}");
        for o in &outcomes {
            if let Acquire::Held(l) = o {
                assert_eq!(l, winners[0], "a refusal names the winner");
            }
        }
    }
    for expected in 0..3u64 {
        let next = grid_partition(expected + 1, vec![expected as u32; 4]);
        let attempts = stores.iter().cycle().take(8).map(|s| {
            let (s, next) = (s.clone(), next.clone());
            async move { s.commit_partition(expected, &next).await.unwrap() }
        });
        let outcomes = join_all(attempts).await;
        let won = outcomes.iter().filter(|o| **o == Commit::Committed).count();
        assert_eq!(won, 1, "from epoch {expected}: {outcomes:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// In memory

#[tokio::test]
async fn memory_leases() {
    let (store, pass) = virtual_memory();
    leases(&store, TTL, &pass).await;
    let (store, pass) = virtual_memory();
    ids_from_leases(&store, TTL, &pass).await;
}

#[tokio::test]
async fn memory_takeovers() {
    let (store, pass) = virtual_memory();
    takeovers(&store, TTL, &pass).await;
    takeover_races(vec![Arc::new(MemoryTopology::default())]).await;
}

#[tokio::test]
async fn memory_commits() {
    commits(&MemoryTopology::default()).await;
}

#[tokio::test]
async fn memory_restored_marks() {
    restored_marks(&MemoryTopology::default()).await;
}

#[tokio::test]
async fn memory_directors() {
    let (store, pass) = virtual_memory();
    directors(&store, TTL, &pass).await;
    let (store, pass) = virtual_memory();
    load_reports(&store, TTL, &pass).await;
}

#[tokio::test]
async fn memory_players() {
    let (store, pass) = virtual_memory();
    player_reports(&store, TTL, &pass).await;
}

#[tokio::test]
async fn memory_races() {
    let store: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
    races(vec![store]).await;
}

#[tokio::test]
async fn urls_choose_the_store() {
    let store = topology::open("memory").await.unwrap();
    granted(store.acquire_lease(1, "a", TTL).await.unwrap());
    let e = topology::open("redis://u:secret@h:1")
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("redis://u:***@h:1") && !e.contains("secret"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// MongoDB

#[tokio::test]
async fn mongo_leases() {
    let db = TestDb::new("leases");
    leases(&db.open().await, MONGO_TTL, &real_time()).await;
    ids_from_leases(&db.open().await, MONGO_TTL, &real_time()).await;
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_takeovers() {
    let db = TestDb::new("takeovers");
    takeovers(&db.open().await, MONGO_TTL, &real_time()).await;
    // Separate connections stand for separate processes.
    let mut stores: Vec<Arc<dyn TopologyStore>> = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(db.open().await));
    }
    takeover_races(stores).await;
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_commits() {
    let db = TestDb::new("commits");
    commits(&db.open().await).await;
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_restored_marks() {
    let db = TestDb::new("restored-marks");
    restored_marks(&db.open().await).await;
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_directors() {
    let db = TestDb::new("directors");
    directors(&db.open().await, MONGO_TTL, &real_time()).await;
    load_reports(&db.open().await, MONGO_TTL, &real_time()).await;
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_players() {
    let db = TestDb::new("players");
    player_reports(&db.open().await, MONGO_TTL, &real_time()).await;
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_races_between_processes() {
    let db = TestDb::new("races");
    // Separate connections stand for separate processes.
    let mut stores: Vec<Arc<dyn TopologyStore>> = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(db.open().await));
    }
    races(stores).await;
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_refuses_a_corrupt_partition() {
    let db = TestDb::new("corrupt");
    let store = db.open().await;
    let bad_tree = doc! { "split": { "axis": "x", "at": 99_i64,
    "low": { "leaf": { "node": 1_i64 } }, "high": { "leaf": { "node": 2_i64 } } } };
    let world =
        doc! { "width": 2048.0, "height": 2048.0, "chunk_size": 32.0, "region_size": 1024.0 };
    db.client()
        .await
        .database(&db.database)
        .collection("partition")
        .insert_one(doc! { "_id": "current", "epoch": 1_i64,
            "partition": { "epoch": 1_i64, "world": world, "layout": { "bsp": { "root": bad_tree } } } })
        .await
        .unwrap();
    match store.partition().await {
        Err(TopologyError::Store(StoreError::Corrupt(why))) => {
            assert!(why.contains("split #0 on x at chunk 99"), "{why}")
        }
        other => panic!("expected a corrupt-data error, got {other:?}"),
    }
    db.drop_all().await;
}

#[tokio::test]
async fn mongo_unreachable_is_an_error_not_a_hang() {
    // Nothing listens on port 1; the error names the store without its password.
    let e = MongoTopology::connect("mongodb://u:pw@127.0.0.1:1/x?serverSelectionTimeoutMS=300")
        .await
        .err()
        .expect("no server there");
    let shown = e.to_string();
    assert!(
        matches!(e, TopologyError::Store(StoreError::Unavailable(_))),
        "{shown}"
    );
    assert!(
        shown.contains("u:***@127.0.0.1:1") && !shown.contains("pw"),
        "{shown}"
    );
}
