//! The live map on an admin port (the director's and `cellmesh up`'s): `GET /map` is a page that
//! draws the world from `GET /api/world`, which this module puts together from the topology
//! store (the committed partition, the nodes' records and load reports) and each live node's
//! `/api/node-map` (its entities and its handoffs of the last second), at most once a second
//! however many ask. `/map` is open (it holds no data); `/api/world` asks for the admin token.
//!
//! The composition itself is pure ([`cellmesh_world::world_map`]); this is its driver.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh_admin::{Admin, Reply, SingleFlight};
use cellmesh_stores::topology::{NodeRecord, TopologyStore};
use cellmesh_world::world_map::{MapParts, NodeMap, WorldMap, WORLD_SAMPLE_MAX};

/// The page; it fetches `api/world` relative to itself.
pub const PAGE: &str = include_str!("live_map.html");
/// How long a node's sample may take; a node that does not answer in time is drawn without
/// its entities (its cells still show, with its reported load).
const NODE_SAMPLE_TIMEOUT: Duration = Duration::from_millis(800);
/// The most of a node's sample read: its `WORLD_SAMPLE_MAX` entities take a fraction of this, and
/// a node that sends more is drawn without its entities rather than buffered.
const NODE_MAP_MAX_BYTES: u64 = 4 << 20;
/// How long one composition of `/api/world` answers every caller: the page polls it, and each
/// composition costs three majority reads of the store and a request to every node.
pub const WORLD_FRESH_FOR: Duration = Duration::from_secs(1);

/// Serves `/map` and `/api/world` on `admin` from `topology`, asking the nodes' admin ports
/// with `node_token` (the cluster's admin token; empty: none sent).
pub fn serve(admin: &Admin, topology: Arc<dyn TopologyStore>, node_token: &str) {
    // The page holds no data: it asks for /api/world with the token the operator gives it.
    admin.route_open("/map", || async {
        Reply::ok("text/html; charset=utf-8", PAGE)
    });
    let node_token: Arc<str> = node_token.into();
    // Callers within a second of a composition, or while one runs, share it.
    let cache = Arc::new(SingleFlight::<Reply>::new(WORLD_FRESH_FOR));
    admin.route("/api/world", move || {
        let (topology, node_token, cache) = (topology.clone(), node_token.clone(), cache.clone());
        async move {
            cache
                .get(|| async {
                    match world(&*topology, &node_token).await {
                        Ok(map) => Reply::json(&map),
                        Err(e) => Reply {
                            status: 503,
                            content_type: "text/plain",
                            body: format!("{e:#}\n").into(),
                        },
                    }
                })
                .await
        }
    });
}

/// The world as the store and the live nodes show it now.
pub async fn world(topology: &dyn TopologyStore, node_token: &str) -> anyhow::Result<WorldMap> {
    let partition = topology
        .partition()
        .await
        .context("reading the partition")?
        .context("no partition is committed yet")?;
    let loads = topology.loads().await.context("reading the load reports")?;
    let nodes = topology.nodes().await.context("reading the node records")?;
    let records: Vec<NodeRecord> = nodes
        .into_iter()
        .filter(|n| n.live)
        .filter_map(|n| n.record)
        .collect();
    let geos: BTreeMap<_, _> = records.iter().map(|r| (r.node, r.geo.clone())).collect();
    // Asked all at once, each bounded by its timeout: the page waits for the slowest node only.
    let samples = futures::future::join_all(records.iter().map(|r| node_map(r, node_token))).await;
    Ok(WorldMap::compose(MapParts {
        partition: &partition,
        loads: &loads,
        geos: &geos,
        samples: samples.into_iter().flatten().collect(),
        core_geo: None,
        max_entities: WORLD_SAMPLE_MAX,
    }))
}

/// One node's sample, or `None` (logged) when it cannot be had in time.
async fn node_map(record: &NodeRecord, token: &str) -> Option<NodeMap> {
    let target = admin_target(record);
    let got = tokio::time::timeout(
        NODE_SAMPLE_TIMEOUT,
        cellmesh_admin::http_get_token_bounded(
            target.as_str(),
            "/api/node-map",
            token,
            NODE_MAP_MAX_BYTES,
        ),
    )
    .await;
    let body = match got {
        Ok(Ok((200, body))) => body,
        Ok(Ok((status, body))) => {
            tracing::debug!(node = record.node, status, body, "node map refused");
            return None;
        }
        Ok(Err(e)) => {
            tracing::debug!(node = record.node, %target, error = %e, "node map unreachable");
            return None;
        }
        Err(_) => {
            tracing::debug!(node = record.node, %target, "node map timed out");
            return None;
        }
    };
    match serde_json::from_str(&body) {
        Ok(map) => Some(map),
        Err(e) => {
            tracing::debug!(node = record.node, error = %e, "node map unreadable");
            None
        }
    }
}

/// Where a node's admin port is reached: its published admin address, or, when that is a
/// wildcard (`0.0.0.0:9100`, a container listening on every interface), the host of its
/// advertised mesh address with the admin port.
fn admin_target(record: &NodeRecord) -> String {
    match record.admin_addr.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => {
            let host = record
                .mesh_addr
                .rsplit_once(':')
                .map(|(h, _)| h)
                .unwrap_or(&record.mesh_addr);
            format!("{host}:{}", a.port())
        }
        _ => record.admin_addr.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(admin: &str, mesh: &str) -> NodeRecord {
        NodeRecord {
            node: 1,
            geo: "local".into(),
            mesh_addr: mesh.into(),
            admin_addr: admin.into(),
        }
    }

    #[test]
    fn a_wildcard_admin_address_is_reached_on_the_mesh_host() {
        assert_eq!(
            admin_target(&record("0.0.0.0:9100", "node1:7200")),
            "node1:9100"
        );
        assert_eq!(
            admin_target(&record("[::]:9100", "[fd00::1]:7200")),
            "[fd00::1]:9100"
        );
        assert_eq!(
            admin_target(&record("10.0.0.5:9100", "node1:7200")),
            "10.0.0.5:9100"
        );
    }

    /// `/api/world` on a real admin port over a store with no partition yet (a 503), then one
    /// committed: callers within the second get the composition they share, a caller after it a
    /// new one; the token guards it and not the page.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_world_is_composed_once_a_second_however_many_ask() {
        use cellmesh_stores::topology::memory::MemoryTopology;
        use cellmesh_world::geometry::WorldShape;
        use cellmesh_world::partition::{Grid, Layout, Partition};

        let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
        let admin = Admin::new(Default::default(), || serde_json::Value::Null);
        admin.set_token("t");
        serve(&admin, topology.clone(), "t");
        let stop = tokio_util::sync::CancellationToken::new();
        let addr = cellmesh_admin::spawn("127.0.0.1:0", admin, stop.clone())
            .await
            .unwrap();
        let get = || cellmesh_admin::http_get_token(addr, "/api/world", "t");
        assert_eq!(
            cellmesh_admin::http_get(addr, "/api/world")
                .await
                .unwrap()
                .0,
            401
        );
        assert_eq!(cellmesh_admin::http_get(addr, "/map").await.unwrap().0, 200);
        let (status, body) = get().await.unwrap();
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("no partition"), "{body}");

        let world = WorldShape::default();
        let grid = Grid::even(&world, 2, 2, &[1, 2]).unwrap();
        let partition = Partition::new(world, 1, Layout::Grid(grid)).unwrap();
        topology.commit_partition(0, &partition).await.unwrap();
        // Within the second: the composition made before the commit, to every caller.
        let calls: Vec<_> = (0..8).map(|_| tokio::spawn(get())).collect();
        for c in calls {
            assert_eq!(c.await.unwrap().unwrap().0, 503);
        }
        tokio::time::sleep(WORLD_FRESH_FOR + Duration::from_millis(100)).await;
        let (status, body) = get().await.unwrap();
        assert_eq!(status, 200, "{body}");
        stop.cancel();
    }

    #[test]
    fn the_page_draws_from_the_world_endpoint() {
        assert!(PAGE.contains("fetch(\"api/world\""));
        for class in [
            "\"cell\"",
            "`entity ${e.kind}`",
            "\"handoff\"",
            "\"bubble\"",
        ] {
            assert!(PAGE.contains(class), "{class}");
        }
    }
}
