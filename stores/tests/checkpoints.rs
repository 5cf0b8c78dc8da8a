//! The checkpoint store's contract, against the in-memory store and the real Redis named by
//! `CELLMESH_TEST_REDIS_URL` (`./scripts/test.sh` starts it; without it the Redis tests fail,
//! they never pass by skipping). Each test works under its own geo name.

use std::sync::Arc;

use cellmesh_stores::memory::MemoryCheckpoints;
use cellmesh_stores::redis::RedisDirectory;
use cellmesh_stores::CheckpointStore;
use cellmesh_test_support::{required, unique_name as unique};

async fn redis(geo: &str) -> Arc<dyn CheckpointStore> {
    let url = required("CELLMESH_TEST_REDIS_URL");
    Arc::new(RedisDirectory::connect(&url, geo).await.unwrap())
}

fn memory() -> Arc<dyn CheckpointStore> {
    Arc::new(MemoryCheckpoints::default())
}

fn c(id: u64, body: &str) -> (u64, Vec<u8>) {
    (id, body.as_bytes().to_vec())
}

async fn writes_replace_remove_and_load_in_entity_order(store: Arc<dyn CheckpointStore>) {
    store
        .write(3, 7, vec![c(20, "b"), c(10, "a")], vec![])
        .await
        .unwrap();
    // A newer checkpoint replaces the older; a removal and a write go together.
    store
        .write(3, 7, vec![c(10, "a2"), c(30, "c")], vec![20])
        .await
        .unwrap();
    let all = store.load(3, 7).await.unwrap();
    assert_eq!(all, vec![c(10, "a2"), c(30, "c")]);
    // Binary checkpoints survive as they are.
    store
        .write(3, 7, vec![(40, vec![0, 255, 10, 13, 0])], vec![])
        .await
        .unwrap();
    assert_eq!(
        store.load(3, 7).await.unwrap().last(),
        Some(&(40, vec![0, 255, 10, 13, 0]))
    );
}

async fn each_process_has_its_own_and_a_drop_forgets_only_its_own(store: Arc<dyn CheckpointStore>) {
    store.write(3, 7, vec![c(1, "old")], vec![]).await.unwrap();
    // The same node id under a new lease is another process.
    store.write(3, 8, vec![c(2, "new")], vec![]).await.unwrap();
    store
        .write(4, 7, vec![c(3, "other")], vec![])
        .await
        .unwrap();
    assert_eq!(store.load(3, 7).await.unwrap(), vec![c(1, "old")]);
    assert_eq!(store.load(3, 8).await.unwrap(), vec![c(2, "new")]);
    store.drop_all(3, 7).await.unwrap();
    assert!(store.load(3, 7).await.unwrap().is_empty());
    assert_eq!(store.load(3, 8).await.unwrap(), vec![c(2, "new")]);
    assert_eq!(store.load(4, 7).await.unwrap(), vec![c(3, "other")]);
    // Nothing written: nothing loaded, and no error.
    assert!(store.load(9, 1).await.unwrap().is_empty());
    // The processes with checkpoints left: the dropped one is not among them.
    assert_eq!(store.processes().await.unwrap(), vec![(3, 8), (4, 7)]);
}

#[tokio::test]
async fn memory_writes_replace_remove_and_load_in_entity_order() {
    writes_replace_remove_and_load_in_entity_order(memory()).await;
}

#[tokio::test]
async fn memory_each_process_has_its_own_and_a_drop_forgets_only_its_own() {
    each_process_has_its_own_and_a_drop_forgets_only_its_own(memory()).await;
}

#[tokio::test]
async fn redis_writes_replace_remove_and_load_in_entity_order() {
    let store = redis(&unique("ckpt_write")).await;
    writes_replace_remove_and_load_in_entity_order(store).await;
}

#[tokio::test]
async fn redis_each_process_has_its_own_and_a_drop_forgets_only_its_own() {
    let store = redis(&unique("ckpt_drop")).await;
    each_process_has_its_own_and_a_drop_forgets_only_its_own(store).await;
}

#[tokio::test]
async fn redis_geos_do_not_see_each_others_checkpoints() {
    let geo = unique("ckpt_geo");
    let (a, b) = (
        redis(&format!("{geo}-a")).await,
        redis(&format!("{geo}-b")).await,
    );
    a.write(1, 1, vec![c(5, "a")], vec![]).await.unwrap();
    assert!(b.load(1, 1).await.unwrap().is_empty());
    assert_eq!(a.load(1, 1).await.unwrap(), vec![c(5, "a")]);
}

#[tokio::test]
async fn redis_keys_expire_and_share_one_slot_per_process() {
    let url = required("CELLMESH_TEST_REDIS_URL");
    let geo = unique("ckpt_ttl");
    let store = RedisDirectory::connect(&url, &geo).await.unwrap();
    store.write(2, 9, vec![c(1, "x")], vec![]).await.unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("cellmesh:{geo}:{{node-2-9}}:checkpoints");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    // Kept a day past the last write, then gone by itself.
    assert!(
        ttl > 23 * 3600 * 1000 && ttl <= 24 * 3600 * 1000,
        "ttl {ttl}"
    );
}

/// A node outside the core geo copies its checkpoints to the core's Redis; a core node reads
/// them there as that geo's copy, apart from the core's own and from the geo's own store. The
/// directory of accounts is the core's for both: a session registered at the edge is the one a
/// core gateway finds, and its epochs count on from the core's.
#[tokio::test]
async fn redis_core_geo_keeps_the_copies_and_homes_the_directory() {
    use cellmesh_stores::Stores;
    let url = required("CELLMESH_TEST_REDIS_URL");
    let run = unique("ckpt_core");
    let (core, edge) = (format!("{run}-core"), format!("{run}-edge"));
    let geos = vec![core.clone(), edge.clone()];
    // Both geos' directories in one server here: each keeps its own keyspace.
    let open = |geo: String| {
        let (url, geos, core) = (url.clone(), geos.clone(), core.clone());
        async move {
            Stores::open(&url, "memory", &geo)
                .await
                .unwrap()
                .with_core_geo(&geo, &geos, &core, &url, &url)
                .await
                .unwrap()
        }
    };
    let (at_core, at_edge) = (open(core.clone()).await, open(edge.clone()).await);
    assert!(at_core.core_copy.is_none(), "a core node copies nowhere");
    assert_eq!(at_core.copies.keys().collect::<Vec<_>>(), [&edge]);
    let copy = at_edge.core_copy.expect("an edge node copies to the core");
    copy.write(3, 7, vec![c(1, "a")], vec![]).await.unwrap();
    assert_eq!(
        at_core.copies[&edge].load(3, 7).await.unwrap(),
        vec![c(1, "a")]
    );
    assert_eq!(
        at_core.copies[&edge].processes().await.unwrap(),
        vec![(3, 7)]
    );
    assert!(at_core.checkpoints.load(3, 7).await.unwrap().is_empty());
    assert!(at_edge.checkpoints.load(3, 7).await.unwrap().is_empty());
    let lease = std::time::Duration::from_secs(30);
    let at_core_epoch = at_core.directory.register("ada", 1, lease).await.unwrap();
    let at_edge_epoch = at_edge.directory.register("ada", 4, lease).await.unwrap();
    assert!(at_edge_epoch > at_core_epoch, "one count of epochs");
    let found = at_core.directory.lookup("ada").await.unwrap().unwrap();
    assert_eq!(
        (found.gateway_node, found.session_epoch),
        (4, at_edge_epoch)
    );
    let master = cellmesh_stores::MasterEntry {
        node: 4,
        lease_epoch: 9,
        entity_id: 77,
        entity_epoch: 1,
    };
    at_edge.directory.set_master("ada", master).await.unwrap();
    assert_eq!(at_core.directory.master("ada").await.unwrap(), Some(master));
    // Without a core geo, nothing is copied.
    let plain = Stores::open(&url, "memory", &edge)
        .await
        .unwrap()
        .with_core_geo(&edge, &geos, "", &url, &url)
        .await
        .unwrap();
    assert!(plain.core_copy.is_none() && plain.copies.is_empty());
    // A core URL that names no Redis is refused, not taken for "no copy".
    let typo = Stores::open(&url, "memory", &edge)
        .await
        .unwrap()
        .with_core_geo(&edge, &geos, &core, &url, "redis//eu-redis:6379")
        .await;
    assert!(typo.is_err(), "a malformed core URL must be refused");
    // Outside the core, a Redis directory with no core URL would be a second home of accounts.
    let homeless = Stores::open(&url, "memory", &edge)
        .await
        .unwrap()
        .with_core_geo(&edge, &geos, &core, &url, "")
        .await;
    assert!(
        matches!(
            homeless,
            Err(cellmesh_stores::StoreError::NoCoreDirectory(ref g)) if *g == core
        ),
        "an edge node without the core's Redis must be refused"
    );
}
