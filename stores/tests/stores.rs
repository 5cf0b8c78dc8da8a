//! One behavioural contract for the stores, run against every implementation: the in-memory
//! stores and the real Redis and MongoDB servers named by `CELLMESH_TEST_REDIS_URL` and
//! `CELLMESH_TEST_MONGO_URL` (`./scripts/test.sh` starts both and sets them). A real-store test
//! without its variable fails; it never passes by skipping.
//!
//! Every test works under its own geo name or database, so tests run in parallel and re-run
//! against the same servers without seeing each other's data.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use cellmesh_stores::memory::{MemoryBoard, MemoryDirectory, MemoryPlayers};
use cellmesh_stores::mongo::MongoPlayers;
use cellmesh_stores::redis::RedisDirectory;
use cellmesh_stores::{
    EdgeBoard, FarRtt, MasterEntry, PlayerRecord, PlayerRecords, SessionDirectory, SessionEntry,
    StoreError,
};
use cellmesh_test_support::{required, unique_name as unique};

const LONG_LEASE: Duration = Duration::from_secs(60);
/// Generous: bounds waits for things that must happen, never asserted as a latency.
const DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Backends

/// Opens session directories; opening the same geo twice gives two handles (two gateways) on the
/// same data.
#[async_trait]
trait Directories: Send + Sync {
    async fn open(&self, geo: &str) -> Arc<dyn SessionDirectory>;
    /// Removes what the test wrote.
    async fn clean_up(&self) {}
}

/// Opens a geo's board; opening the same geo twice gives two handles (two proxies).
#[async_trait]
trait Boards: Send + Sync {
    async fn open_board(&self, geo: &str) -> Arc<dyn EdgeBoard>;
    async fn clean_up(&self) {}
}

/// Opens handles on one player-record store.
#[async_trait]
trait Players: Send + Sync {
    async fn open(&self) -> Arc<dyn PlayerRecords>;
    async fn clean_up(&self) {}
}

#[derive(Default)]
struct MemoryBackend {
    directories: Mutex<HashMap<String, Arc<MemoryDirectory>>>,
    boards: Mutex<HashMap<String, Arc<MemoryBoard>>>,
    players: Arc<MemoryPlayers>,
}

#[async_trait]
impl Boards for MemoryBackend {
    async fn open_board(&self, geo: &str) -> Arc<dyn EdgeBoard> {
        let mut map = self.boards.lock().unwrap();
        map.entry(geo.to_string()).or_default().clone()
    }
}

#[async_trait]
impl Directories for MemoryBackend {
    async fn open(&self, geo: &str) -> Arc<dyn SessionDirectory> {
        let mut map = self.directories.lock().unwrap();
        map.entry(geo.to_string()).or_default().clone()
    }
}

#[async_trait]
impl Players for MemoryBackend {
    async fn open(&self) -> Arc<dyn PlayerRecords> {
        self.players.clone()
    }
}

struct RedisBackend {
    url: String,
    /// Prepended to every geo name the test uses.
    prefix: String,
}

impl RedisBackend {
    fn new(test: &str) -> Self {
        Self {
            url: required("CELLMESH_TEST_REDIS_URL"),
            prefix: unique(test),
        }
    }
}

#[async_trait]
impl Directories for RedisBackend {
    async fn open(&self, geo: &str) -> Arc<dyn SessionDirectory> {
        let geo = format!("{}-{geo}", self.prefix);
        Arc::new(RedisDirectory::connect(&self.url, &geo).await.unwrap())
    }

    async fn clean_up(&self) {
        let client = ::redis::Client::open(self.url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = ::redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("cellmesh:{}-*", self.prefix))
                .query_async(&mut conn)
                .await
                .unwrap();
            if !keys.is_empty() {
                let _: () = ::redis::cmd("DEL")
                    .arg(keys)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
}

#[async_trait]
impl Boards for RedisBackend {
    async fn open_board(&self, geo: &str) -> Arc<dyn EdgeBoard> {
        let geo = format!("{}-{geo}", self.prefix);
        Arc::new(RedisDirectory::connect(&self.url, &geo).await.unwrap())
    }

    async fn clean_up(&self) {
        Directories::clean_up(self).await;
    }
}

struct MongoBackend {
    /// The test URL with the test's own database as its path.
    url: String,
    database: String,
}

impl MongoBackend {
    fn new(test: &str) -> Self {
        let base = required("CELLMESH_TEST_MONGO_URL");
        // Database names are at most 63 bytes; the unique part comes first.
        let database: String = unique(test).chars().take(60).collect();
        Self {
            url: with_database(&base, &database),
            database,
        }
    }
}

/// `mongodb://h:p[/old][?opts]` with its database path replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let hosts_start = url.find("://").expect("mongodb url has a scheme") + 3;
    let (base, query) = match url.find('?') {
        Some(q) => url.split_at(q),
        None => (url, ""),
    };
    let hosts_end = base[hosts_start..]
        .find('/')
        .map_or(base.len(), |i| hosts_start + i);
    format!("{}/{database}{query}", &base[..hosts_end])
}

#[async_trait]
impl Players for MongoBackend {
    async fn open(&self) -> Arc<dyn PlayerRecords> {
        Arc::new(MongoPlayers::connect(&self.url).await.unwrap())
    }

    async fn clean_up(&self) {
        let client = ::mongodb::Client::with_uri_str(&self.url).await.unwrap();
        client.database(&self.database).drop().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// The session directory contract

async fn register_bumps_the_epoch_and_displaces(backend: impl Directories) {
    let gateway_a = backend.open("eu").await;
    let gateway_b = backend.open("eu").await;
    assert_eq!(gateway_a.lookup("alice").await.unwrap(), None);

    let first = gateway_a.register("alice", 1, LONG_LEASE).await.unwrap();
    let entry = SessionEntry {
        gateway_node: 1,
        session_epoch: first,
    };
    assert_eq!(gateway_a.lookup("alice").await.unwrap(), Some(entry));
    assert_eq!(gateway_b.lookup("alice").await.unwrap(), Some(entry));

    let second = gateway_b.register("alice", 2, LONG_LEASE).await.unwrap();
    assert!(second > first, "epoch {second} after {first}");
    let entry = SessionEntry {
        gateway_node: 2,
        session_epoch: second,
    };
    assert_eq!(gateway_a.lookup("alice").await.unwrap(), Some(entry));
    assert_eq!(gateway_b.lookup("alice").await.unwrap(), Some(entry));
    // Another account is untouched.
    assert_eq!(gateway_a.lookup("bob").await.unwrap(), None);
    backend.clean_up().await;
}

async fn stale_epochs_renew_and_release_nothing(backend: impl Directories) {
    let dir = backend.open("eu").await;
    let old = dir.register("alice", 1, LONG_LEASE).await.unwrap();
    let current = dir.register("alice", 2, LONG_LEASE).await.unwrap();
    let entry = Some(SessionEntry {
        gateway_node: 2,
        session_epoch: current,
    });

    assert!(!dir.renew("alice", old, LONG_LEASE).await.unwrap());
    assert!(!dir.release("alice", old).await.unwrap());
    assert!(!dir.renew("alice", current + 1, LONG_LEASE).await.unwrap());
    assert!(!dir.release("alice", current + 1).await.unwrap());
    assert!(!dir.renew("nobody", current, LONG_LEASE).await.unwrap());
    assert!(!dir.release("nobody", current).await.unwrap());
    assert_eq!(dir.lookup("alice").await.unwrap(), entry);

    assert!(dir.renew("alice", current, LONG_LEASE).await.unwrap());
    assert_eq!(dir.lookup("alice").await.unwrap(), entry);
    assert!(dir.release("alice", current).await.unwrap());
    assert_eq!(dir.lookup("alice").await.unwrap(), None);
    assert!(!dir.release("alice", current).await.unwrap());
    assert!(!dir.renew("alice", current, LONG_LEASE).await.unwrap());
    assert_eq!(dir.lookup("alice").await.unwrap(), None);
    backend.clean_up().await;
}

/// Polls until `account` has no live session; returns how long that took from `since`.
async fn wait_until_gone(dir: &dyn SessionDirectory, account: &str, since: Instant) -> Duration {
    loop {
        if dir.lookup(account).await.unwrap().is_none() {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < DEADLINE,
            "session of {account} never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn an_unrenewed_lease_expires(backend: impl Directories) {
    let dir = backend.open("eu").await;
    let lease = Duration::from_millis(300);
    let start = Instant::now();
    let epoch = dir.register("alice", 1, lease).await.unwrap();
    let seen = dir.lookup("alice").await.unwrap();
    assert!(
        seen.is_some() || start.elapsed() >= lease,
        "gone before its lease ran out"
    );

    let gone_after = wait_until_gone(dir.as_ref(), "alice", start).await;
    // Redis keeps expiry times in whole milliseconds of its own clock.
    assert!(
        gone_after + Duration::from_millis(2) >= lease,
        "expired after {gone_after:?}, lease {lease:?}"
    );
    assert!(!dir.renew("alice", epoch, LONG_LEASE).await.unwrap());
    assert!(!dir.release("alice", epoch).await.unwrap());
    assert_eq!(dir.lookup("alice").await.unwrap(), None);
    backend.clean_up().await;
}

async fn renew_extends_the_lease(backend: impl Directories) {
    let dir = backend.open("eu").await;
    let lease = Duration::from_secs(1);
    let epoch = dir.register("alice", 1, lease).await.unwrap();
    assert!(dir.renew("alice", epoch, LONG_LEASE).await.unwrap());
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    assert_eq!(
        dir.lookup("alice").await.unwrap(),
        Some(SessionEntry {
            gateway_node: 1,
            session_epoch: epoch
        })
    );
    backend.clean_up().await;
}

async fn epochs_never_repeat_across_expiry_and_release(backend: impl Directories) {
    let dir = backend.open("eu").await;
    let first = dir.register("alice", 1, LONG_LEASE).await.unwrap();
    assert!(dir.release("alice", first).await.unwrap());
    let second = dir
        .register("alice", 1, Duration::from_millis(50))
        .await
        .unwrap();
    assert!(second > first, "epoch {second} after release of {first}");

    wait_until_gone(dir.as_ref(), "alice", Instant::now()).await;
    let third = dir.register("alice", 1, LONG_LEASE).await.unwrap();
    assert!(third > second, "epoch {third} after expiry of {second}");
    backend.clean_up().await;
}

async fn concurrent_registers_get_distinct_epochs_and_the_last_wins(backend: impl Directories) {
    const GATEWAYS: u32 = 8;
    let mut tasks = Vec::new();
    for node in 1..=GATEWAYS {
        let dir = backend.open("eu").await;
        tasks.push(tokio::spawn(async move {
            let epoch = dir.register("alice", node, LONG_LEASE).await.unwrap();
            (epoch, node)
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    let mut epochs: Vec<u64> = results.iter().map(|(epoch, _)| *epoch).collect();
    epochs.sort_unstable();
    epochs.dedup();
    assert_eq!(epochs.len(), results.len(), "epochs repeated: {results:?}");

    let (epoch, node) = *results.iter().max().unwrap();
    let dir = backend.open("eu").await;
    assert_eq!(
        dir.lookup("alice").await.unwrap(),
        Some(SessionEntry {
            gateway_node: node,
            session_epoch: epoch
        })
    );
    backend.clean_up().await;
}

async fn geos_are_isolated(backend: impl Directories) {
    let eu = backend.open("eu").await;
    let eu_west = backend.open("eu-west").await;
    let in_eu = eu.register("alice", 1, LONG_LEASE).await.unwrap();
    assert_eq!(eu_west.lookup("alice").await.unwrap(), None);
    assert!(!eu_west.renew("alice", in_eu, LONG_LEASE).await.unwrap());
    assert!(!eu_west.release("alice", in_eu).await.unwrap());

    eu_west.register("alice", 2, LONG_LEASE).await.unwrap();
    let again = eu_west.register("alice", 2, LONG_LEASE).await.unwrap();
    assert!(eu_west.release("alice", again).await.unwrap());
    // eu's session, and its epoch, did not move while eu-west registered twice and released.
    assert_eq!(
        eu.lookup("alice").await.unwrap(),
        Some(SessionEntry {
            gateway_node: 1,
            session_epoch: in_eu
        })
    );
    assert!(eu.renew("alice", in_eu, LONG_LEASE).await.unwrap());
    backend.clean_up().await;
}

fn master(node: u32, entity_id: u64, entity_epoch: u64) -> MasterEntry {
    MasterEntry {
        node,
        lease_epoch: 7,
        entity_id,
        entity_epoch,
    }
}

async fn the_master_record_keeps_the_latest_owner(backend: impl Directories) {
    let dir = backend.open("eu").await;
    assert_eq!(dir.master("alice").await.unwrap(), None);
    dir.set_master("alice", master(1, 10, 3)).await.unwrap();
    // The next owner of the same avatar writes a later epoch; the previous owner's late write
    // of an older one loses.
    dir.set_master("alice", master(2, 10, 4)).await.unwrap();
    dir.set_master("alice", master(1, 10, 3)).await.unwrap();
    assert_eq!(dir.master("alice").await.unwrap(), Some(master(2, 10, 4)));
    // A clear by the previous owner does nothing; the current owner's does.
    dir.clear_master("alice", 10, 3).await.unwrap();
    assert_eq!(dir.master("alice").await.unwrap(), Some(master(2, 10, 4)));
    // Another avatar (a new spawn) replaces whatever epoch the old one had.
    dir.set_master("alice", master(3, 11, 1)).await.unwrap();
    assert_eq!(dir.master("alice").await.unwrap(), Some(master(3, 11, 1)));
    dir.clear_master("alice", 10, 4).await.unwrap();
    assert_eq!(dir.master("alice").await.unwrap(), Some(master(3, 11, 1)));
    dir.clear_master("alice", 11, 1).await.unwrap();
    assert_eq!(dir.master("alice").await.unwrap(), None);
    // Sessions and the master record are independent: a released session keeps the avatar.
    let epoch = dir.register("bob", 1, LONG_LEASE).await.unwrap();
    dir.set_master("bob", master(4, 20, 1)).await.unwrap();
    assert!(dir.release("bob", epoch).await.unwrap());
    assert_eq!(dir.master("bob").await.unwrap(), Some(master(4, 20, 1)));
    let other = backend.open("eu-west").await;
    assert_eq!(other.master("bob").await.unwrap(), None);
    backend.clean_up().await;
}

// ---------------------------------------------------------------------------------------------
// The player records contract

fn record(account: &str, position: Option<[f64; 3]>, home_geo: &str) -> PlayerRecord {
    PlayerRecord {
        account: account.into(),
        last_position: position,
        home_geo: home_geo.into(),
        updated_unix_ms: 1_790_000_000_123,
        gateway_geo: format!("{home_geo}-gw"),
        session_epoch: 1_790_000_000_123_456,
        last_handover_unix_ms: position.map(|_| 1_790_000_000_100),
    }
}

async fn a_player_record_round_trips(backend: impl Players) {
    let writer = backend.open().await;
    let reader = backend.open().await;
    let alice = record("alice", Some([131_071.5, -0.25, 1e-9]), "eu");
    // Account names are user data: dots and dollars must not be read as paths or operators.
    let odd = record("$set.a b.ü", None, "us");
    writer.save(&alice).await.unwrap();
    writer.save(&odd).await.unwrap();
    assert_eq!(reader.load("alice").await.unwrap(), Some(alice));
    assert_eq!(reader.load(&odd.account).await.unwrap(), Some(odd));
    backend.clean_up().await;
}

async fn save_replaces_the_whole_record(backend: impl Players) {
    let players = backend.open().await;
    players
        .save(&record("alice", Some([1.0, 2.0, 3.0]), "eu"))
        .await
        .unwrap();
    let moved = PlayerRecord {
        updated_unix_ms: 1_790_000_009_999,
        ..record("alice", None, "us")
    };
    players.save(&moved).await.unwrap();
    assert_eq!(players.load("alice").await.unwrap(), Some(moved));
    backend.clean_up().await;
}

async fn a_missing_player_is_none(backend: impl Players) {
    let players = backend.open().await;
    players.save(&record("alice", None, "eu")).await.unwrap();
    assert_eq!(players.load("bob").await.unwrap(), None);
    assert_eq!(players.load("").await.unwrap(), None);
    backend.clean_up().await;
}

// ---------------------------------------------------------------------------------------------
// Every contract test, against every implementation of its trait.

macro_rules! contract {
    (
        directory: [$($dir_test:ident),* $(,)?],
        players: [$($players_test:ident),* $(,)?],
        boards: [$($board_test:ident),* $(,)?] $(,)?
    ) => {
        mod memory {
            $(#[tokio::test]
            async fn $board_test() {
                super::$board_test(super::MemoryBackend::default()).await;
            })*
            $(#[tokio::test]
            async fn $dir_test() {
                super::$dir_test(super::MemoryBackend::default()).await;
            })*
            $(#[tokio::test]
            async fn $players_test() {
                super::$players_test(super::MemoryBackend::default()).await;
            })*
        }
        mod redis {
            $(#[tokio::test]
            async fn $board_test() {
                super::$board_test(super::RedisBackend::new(stringify!($board_test))).await;
            })*
            $(#[tokio::test]
            async fn $dir_test() {
                super::$dir_test(super::RedisBackend::new(stringify!($dir_test))).await;
            })*
        }
        mod mongo {
            $(#[tokio::test]
            async fn $players_test() {
                super::$players_test(super::MongoBackend::new(stringify!($players_test))).await;
            })*
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Across geos

async fn register_above_a_floor_goes_above_it(backend: impl Directories) {
    let montreal = backend.open("montreal").await;
    // Paris's directory handed out a high epoch (a time-based one, say); Montreal's never saw the
    // account. A login handed over from Paris goes above it there.
    let floor = 9_000_000_000_000_000;
    let epoch = montreal
        .register_above("alice", 1, LONG_LEASE, floor)
        .await
        .unwrap();
    assert!(epoch > floor, "{epoch} <= {floor}");
    let next = montreal.register("alice", 2, LONG_LEASE).await.unwrap();
    assert!(next > epoch, "the floor is remembered: {next} <= {epoch}");
    // A floor below what the directory has handed out changes nothing.
    let again = montreal
        .register_above("alice", 1, LONG_LEASE, 1)
        .await
        .unwrap();
    assert!(again > next);
    Directories::clean_up(&backend).await;
}

async fn a_moved_session_registers_only_if_no_login_came_since(backend: impl Directories) {
    let dir = backend.open("relogin").await;
    // Alice's session moves from its lost gateway (node 1) to node 2: nothing came since.
    let first = dir.register("alice", 1, LONG_LEASE).await.unwrap();
    let moved = dir
        .register_moved("alice", 2, LONG_LEASE, first)
        .await
        .unwrap()
        .expect("no login since: the move registers");
    assert!(moved > first, "{moved} <= {first}");
    let entry = dir.lookup("alice").await.unwrap().unwrap();
    assert_eq!((entry.gateway_node, entry.session_epoch), (2, moved));

    // She logs in again while the session moves once more: the newer login stays, and the
    // move writes nothing.
    let newer = dir.register("alice", 3, LONG_LEASE).await.unwrap();
    assert_eq!(
        dir.register_moved("alice", 1, LONG_LEASE, moved)
            .await
            .unwrap(),
        None
    );
    let entry = dir.lookup("alice").await.unwrap().unwrap();
    assert_eq!((entry.gateway_node, entry.session_epoch), (3, newer));
    assert!(dir.renew("alice", newer, LONG_LEASE).await.unwrap());

    // Its lease expired meanwhile, the moved session still registers: it is the latest one.
    let bob = dir
        .register("bob", 1, Duration::from_millis(50))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(dir.lookup("bob").await.unwrap(), None);
    let bob_moved = dir
        .register_moved("bob", 2, LONG_LEASE, bob)
        .await
        .unwrap()
        .expect("registers after expiry");
    assert!(bob_moved > bob);
    // And a later plain login still goes above the moved one.
    assert!(dir.register("bob", 1, LONG_LEASE).await.unwrap() > bob_moved);
    Directories::clean_up(&backend).await;
}

async fn a_hint_is_taken_once_and_expires(backend: impl Boards) {
    let (paris, montreal) = (
        backend.open_board("paris").await,
        backend.open_board("montreal").await,
    );
    let other_proxy = backend.open_board("montreal").await;
    assert_eq!(montreal.take_hint("alice").await.unwrap(), None);
    let sealed = vec![2u8, 0, 255, 7, b'a'];
    paris
        .put_hint("alice", b"for paris", LONG_LEASE)
        .await
        .unwrap();
    montreal
        .put_hint("alice", &sealed, LONG_LEASE)
        .await
        .unwrap();
    // Any proxy of the geo finds it, once; the other geo's stays apart.
    assert_eq!(other_proxy.take_hint("alice").await.unwrap(), Some(sealed));
    assert_eq!(montreal.take_hint("alice").await.unwrap(), None);
    assert_eq!(
        paris.take_hint("alice").await.unwrap().as_deref(),
        Some(&b"for paris"[..])
    );
    montreal
        .put_hint("bob", b"x", Duration::from_millis(50))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(montreal.take_hint("bob").await.unwrap(), None, "expired");
    Boards::clean_up(&backend).await;
}

/// A cookie's nonce is used once across every proxy of a geo, and remembered for its life only.
async fn a_nonce_is_used_once_then_forgotten(backend: impl Boards) {
    let (paris, montreal) = (
        backend.open_board("paris").await,
        backend.open_board("montreal").await,
    );
    let other_proxy = backend.open_board("montreal").await;
    let nonce = [7u8; 16];
    assert!(montreal
        .use_nonce("alice", &nonce, LONG_LEASE)
        .await
        .unwrap());
    assert!(!other_proxy
        .use_nonce("alice", &nonce, LONG_LEASE)
        .await
        .unwrap());
    assert!(!montreal
        .use_nonce("alice", &nonce, LONG_LEASE)
        .await
        .unwrap());
    // Another account's, another nonce, another geo's board: each its own first use.
    assert!(montreal.use_nonce("bob", &nonce, LONG_LEASE).await.unwrap());
    assert!(montreal
        .use_nonce("alice", &[8u8; 16], LONG_LEASE)
        .await
        .unwrap());
    assert!(paris.use_nonce("alice", &nonce, LONG_LEASE).await.unwrap());
    let short = [9u8; 16];
    assert!(montreal
        .use_nonce("carol", &short, Duration::from_millis(50))
        .await
        .unwrap());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        montreal
            .use_nonce("carol", &short, Duration::from_millis(50))
            .await
            .unwrap(),
        "forgotten after its ttl"
    );
    Boards::clean_up(&backend).await;
}

async fn far_rtts_are_kept_by_geo_and_expire(backend: impl Boards) {
    let paris = backend.open_board("paris").await;
    let rtt = |min_ms: f64| FarRtt {
        min_ms,
        median_ms: min_ms + 3.0,
        samples: 5,
        kernel: true,
        measured_unix_ms: 1_790_000_000_000,
    };
    assert!(paris.far_rtts("alice").await.unwrap().is_empty());
    paris
        .put_far_rtt("alice", "montreal", rtt(12.0), LONG_LEASE)
        .await
        .unwrap();
    paris
        .put_far_rtt("alice", "hongkong", rtt(180.0), LONG_LEASE)
        .await
        .unwrap();
    paris
        .put_far_rtt("alice", "montreal", rtt(11.0), LONG_LEASE)
        .await
        .unwrap();
    assert_eq!(
        paris.far_rtts("alice").await.unwrap(),
        vec![
            ("hongkong".to_string(), rtt(180.0)),
            ("montreal".to_string(), rtt(11.0))
        ]
    );
    assert!(paris.far_rtts("bob").await.unwrap().is_empty());
    paris
        .put_far_rtt("bob", "montreal", rtt(9.0), Duration::from_millis(50))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(paris.far_rtts("bob").await.unwrap().is_empty(), "expired");
    Boards::clean_up(&backend).await;
}

contract! {
    directory: [
        register_above_a_floor_goes_above_it,
        a_moved_session_registers_only_if_no_login_came_since,
        register_bumps_the_epoch_and_displaces,
        stale_epochs_renew_and_release_nothing,
        an_unrenewed_lease_expires,
        renew_extends_the_lease,
        epochs_never_repeat_across_expiry_and_release,
        concurrent_registers_get_distinct_epochs_and_the_last_wins,
        geos_are_isolated,
        the_master_record_keeps_the_latest_owner,
    ],
    players: [
        a_player_record_round_trips,
        save_replaces_the_whole_record,
        a_missing_player_is_none,
    ],
    boards: [
        a_hint_is_taken_once_and_expires,
        a_nonce_is_used_once_then_forgotten,
        far_rtts_are_kept_by_geo_and_expire,
    ],
}

#[tokio::test]
async fn a_mongo_record_written_before_geos_loads_with_defaults() {
    let backend = MongoBackend::new("a_mongo_record_written_before_geos");
    let client = ::mongodb::Client::with_uri_str(&backend.url).await.unwrap();
    client
        .database(&backend.database)
        .collection::<::mongodb::bson::Document>("players")
        .insert_one(::mongodb::bson::doc! {
            "_id": "alice",
            "last_position": [1.0, 2.0, 3.0],
            "home_geo": "eu",
            "updated_unix_ms": 1_790_000_000_000i64,
        })
        .await
        .unwrap();
    let players = Players::open(&backend).await;
    let r = players.load("alice").await.unwrap().unwrap();
    assert_eq!(r.home_geo, "eu");
    assert_eq!((r.gateway_geo.as_str(), r.session_epoch), ("", 0));
    assert_eq!(r.last_handover_unix_ms, None);
    Players::clean_up(&backend).await;
}

// ---------------------------------------------------------------------------------------------
// Connecting: no server, or one that never answers, fails fast with the URL in the error.

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A listener that completes TCP handshakes (the kernel's backlog) and never says a word.
fn silent_server() -> (TcpListener, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    (listener, port)
}

fn assert_unavailable<T>(result: Result<T, StoreError>, url: &str, started: Instant) {
    match result {
        Err(StoreError::Unavailable(why)) => assert!(why.contains(url), "{why:?} lacks {url}"),
        Err(other) => panic!("expected Unavailable, got {other}"),
        Ok(_) => panic!("connected to {url}"),
    }
    assert!(
        started.elapsed() < DEADLINE,
        "took {:?} to give up",
        started.elapsed()
    );
}

#[tokio::test]
async fn redis_without_a_server_is_unavailable() {
    let url = format!("redis://127.0.0.1:{}", closed_port());
    let started = Instant::now();
    assert_unavailable(RedisDirectory::connect(&url, "eu").await, &url, started);
}

#[tokio::test]
async fn redis_that_never_answers_is_unavailable() {
    let (_listener, port) = silent_server();
    let url = format!("redis://127.0.0.1:{port}");
    let started = Instant::now();
    assert_unavailable(RedisDirectory::connect(&url, "eu").await, &url, started);
}

#[tokio::test]
async fn redis_errors_hide_the_password() {
    let url = format!("redis://:hunter2@127.0.0.1:{}", closed_port());
    match RedisDirectory::connect(&url, "eu").await {
        Err(StoreError::Unavailable(why)) => assert!(!why.contains("hunter2"), "{why}"),
        other => panic!("expected Unavailable, got {:?}", other.err()),
    }
}

#[tokio::test]
async fn redis_epochs_stay_greater_when_the_counter_is_lost() {
    let backend = RedisBackend::new("lost_counter");
    let dir = backend.open("eu").await;
    let first = dir.register("alice", 1, LONG_LEASE).await.unwrap();
    let client = ::redis::Client::open(backend.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = ::redis::cmd("KEYS")
        .arg(format!("cellmesh:{}-eu:*", backend.prefix))
        .query_async(&mut conn)
        .await
        .unwrap();
    // Both keys of the account carry it as their hash tag: one slot on Redis Cluster.
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys.iter().all(|k| k.contains("{alice}:")), "{keys:?}");
    let epoch_key = keys.iter().find(|k| k.ends_with("session_epoch")).unwrap();
    let ttl: i64 = ::redis::cmd("PTTL")
        .arg(epoch_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        ttl > 0,
        "the last epoch is kept for a while, not forever: {ttl}"
    );
    // A failover to a replica that missed the last writes loses the counter (and the session).
    // Back to back, so two logins fall within one millisecond of the server's clock.
    let mut last = first;
    for node in 2..40 {
        let _: () = ::redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .unwrap();
        let next = dir.register("alice", node, LONG_LEASE).await.unwrap();
        assert!(
            next > last,
            "epoch {next} repeated or went back from {last}"
        );
        last = next;
    }
    Directories::clean_up(&backend).await;
}

#[tokio::test]
async fn redis_rejects_a_geo_name_that_could_reach_other_keys() {
    // Checked before connecting: no server needed.
    for geo in ["", "eu:session", "eu*"] {
        match RedisDirectory::connect("redis://127.0.0.1:1", geo).await {
            Err(StoreError::InvalidGeo(named)) => assert_eq!(named, geo),
            other => panic!("geo {geo:?}: expected InvalidGeo, got {:?}", other.err()),
        }
    }
}

#[tokio::test]
async fn mongo_without_a_server_is_unavailable() {
    let url = format!("mongodb://127.0.0.1:{}", closed_port());
    let started = Instant::now();
    assert_unavailable(MongoPlayers::connect(&url).await, &url, started);
}

#[tokio::test]
async fn mongo_that_never_answers_is_unavailable() {
    let (_listener, port) = silent_server();
    let url = format!("mongodb://127.0.0.1:{port}/cellmesh");
    let started = Instant::now();
    assert_unavailable(MongoPlayers::connect(&url).await, &url, started);
}

#[tokio::test]
async fn malformed_urls_are_refused_with_the_reason() {
    let refusal = |result: Result<(), StoreError>| match result {
        Err(e @ StoreError::BadUrl(_)) => e.to_string(),
        other => panic!("expected BadUrl, got {other:?}"),
    };
    let why = refusal(
        MongoPlayers::connect("mongodb://u:hunter2@h:notaport")
            .await
            .map(drop),
    );
    assert!(why.contains("mongodb://u:***@h:notaport: "), "{why}");
    assert!(!why.contains("hunter2"), "{why}");
    let why = refusal(
        RedisDirectory::connect("redis://h:notaport", "eu")
            .await
            .map(drop),
    );
    assert!(why.contains("redis://h:notaport: "), "{why}");
}

#[test]
fn test_database_replaces_the_url_path() {
    assert_eq!(with_database("mongodb://h:1", "x"), "mongodb://h:1/x");
    assert_eq!(with_database("mongodb://h:1/", "x"), "mongodb://h:1/x");
    assert_eq!(
        with_database("mongodb://u:p@h:1,g:2/old?w=1", "x"),
        "mongodb://u:p@h:1,g:2/x?w=1"
    );
}
