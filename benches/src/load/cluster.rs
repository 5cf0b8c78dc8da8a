//! A cluster for the load generator: sidecars sharing the world in vertical strips, and one
//! proxy, each on a runtime of its own (one worker thread, as a process of its own would have),
//! with the embedded in-memory stores. Games and clients are the scenario's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use cellmesh_proxy::{ProxyConfig, ProxyHandle};
use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::TopologyStore;
use cellmesh_stores::Stores;
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Grid, Layout, Partition};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub nodes: u32,
    /// The nodes the proxy attaches sessions to (every node when empty).
    pub gateways: Vec<u32>,
    /// Sessions the proxy must admit from loopback.
    pub clients: usize,
    /// Mutual TLS on every mesh link (a CA of the cluster's own certifies each component), as a
    /// deployment runs; plaintext otherwise, to measure what TLS costs.
    pub tls: bool,
}

pub struct Cluster {
    pub world: WorldShape,
    pub partition: Partition,
    /// Node `i + 1` at index `i`.
    pub sidecars: Vec<SidecarHandle>,
    pub proxy: ProxyHandle,
    secret: String,
    stop: CancellationToken,
    /// Held for its drop, after the stop above.
    _runtimes: Runtimes,
    /// The certificates of a TLS cluster, removed with it.
    _certs: Option<tempfile::TempDir>,
}

/// Issues `who`'s certificate from the CA in `dir/ca` into `dir/label`.
fn certify(
    dir: &std::path::Path,
    label: &str,
    who: cellmesh_trust::Identity,
) -> anyhow::Result<cellmesh_trust::MeshTlsConfig> {
    let out = dir.join(label);
    cellmesh_trust::certs::issue(&dir.join("ca"), &who, &out, 1)?;
    Ok(cellmesh_trust::MeshTlsConfig::in_dir(&out))
}

/// The components' runtimes, shut down in the background when dropped: a runtime dropped the
/// ordinary way inside an async context panics, even on the way out of a failed start.
#[derive(Default)]
struct Runtimes(Vec<Runtime>);

impl Drop for Runtimes {
    fn drop(&mut self) {
        for rt in self.0.drain(..) {
            rt.shutdown_background();
        }
    }
}

/// A runtime of one worker thread: one component's share of the machine.
pub fn component_runtime(name: &str) -> anyhow::Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .with_context(|| format!("a runtime for {name}"))
}

/// The world cut into `nodes` vertical strips of whole regions, node 1 westmost.
pub fn strips(world: WorldShape, nodes: u32) -> anyhow::Result<Partition> {
    let (cols, rows) = (world.regions_x() as u32, world.regions_y() as u32);
    anyhow::ensure!(
        (1..=cols).contains(&nodes),
        "{nodes} nodes for {cols} columns of regions"
    );
    let table = (0..rows)
        .flat_map(|_| (0..cols).map(move |x| x * nodes / cols + 1))
        .collect();
    let grid = Grid::new(&world, cols, rows, table).context("the strips grid")?;
    Partition::new(world, 1, Layout::Grid(grid)).context("the strips partition")
}

/// The x of the border between node `n` and node `n + 1` of [`strips`].
pub fn border_x(world: &WorldShape, nodes: u32, n: u32) -> f64 {
    let cols = world.regions_x() as u32;
    // The first column of node n + 1: the least x with x * nodes / cols >= n.
    let col = (n * cols).div_ceil(nodes);
    f64::from(col) * world.region_size
}

impl Cluster {
    pub async fn start(spec: ClusterSpec) -> anyhow::Result<Self> {
        Self::start_with(spec, |_| {}).await
    }

    /// Like [`Cluster::start`], with every sidecar's configuration passed through `configure`
    /// first (its addresses, node id and world are the cluster's: leave them be).
    pub async fn start_with(
        spec: ClusterSpec,
        configure: impl Fn(&mut SidecarConfig),
    ) -> anyhow::Result<Self> {
        let world = WorldShape::default();
        let partition = strips(world, spec.nodes)?;
        let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
        topology
            .commit_partition(0, &partition)
            .await
            .context("committing the partition")?;
        let stores = Stores::in_memory();
        let stop = CancellationToken::new();
        let certs = if spec.tls {
            let dir = tempfile::tempdir().context("a directory for the certificates")?;
            cellmesh_trust::certs::init(&dir.path().join("ca"), "bench")?;
            Some(dir)
        } else {
            None
        };
        let mut runtimes = Runtimes::default();
        let mut sidecars = Vec::new();
        for id in 1..=spec.nodes {
            let rt = component_runtime(&format!("sidecar-{id}"))?;
            let mut cfg = SidecarConfig {
                node_id: id,
                world,
                local_listen: "127.0.0.1:0".into(),
                mesh_listen: "127.0.0.1:0".into(),
                admin_listen: "127.0.0.1:0".into(),
                // No state dir: clusters started one after another in this process would
                // find the last one's node locks still held, and none belongs in the working directory.
                state_dir: String::new(),
                ..SidecarConfig::default()
            };
            if let Some(dir) = &certs {
                let who = cellmesh_trust::Identity::new(
                    cellmesh_trust::Role::Sidecar,
                    Some(id),
                    Some(&cfg.geo),
                )
                .map_err(anyhow::Error::msg)?;
                cfg.mesh_tls = certify(dir.path(), &format!("node-{id}"), who)?;
            }
            configure(&mut cfg);
            let handle = rt
                .spawn(cellmesh_sidecar::start_in(
                    cfg,
                    stores.clone(),
                    topology.clone(),
                    stop.child_token(),
                ))
                .await
                .context("the sidecar task")?
                .with_context(|| format!("starting sidecar {id}"))?;
            sidecars.push(handle);
            runtimes.0.push(rt);
        }
        let gateways: Vec<u32> = if spec.gateways.is_empty() {
            (1..=spec.nodes).collect()
        } else {
            spec.gateways.clone()
        };
        let secret = format!("{:032x}", rand::random::<u128>());
        let mut cfg = ProxyConfig {
            client_listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            gateways: gateways
                .iter()
                .map(|&g| sidecars[g as usize - 1].mesh_addr.to_string())
                .collect(),
            token_secret: secret.clone(),
            drain_grace_ms: 0,
            drain_spread_ms: 0,
            ..ProxyConfig::default()
        };
        if let Some(dir) = &certs {
            let who =
                cellmesh_trust::Identity::new(cellmesh_trust::Role::Proxy, None, Some(&cfg.geo))
                    .map_err(anyhow::Error::msg)?;
            cfg.mesh_tls = certify(dir.path(), "proxy", who)?;
        }
        // Every bench client connects from 127.0.0.1.
        let clients = spec.clients.max(1) * 2;
        cfg.rate.address_accounts = cfg.rate.address_accounts.max(clients as u32);
        cfg.max_connections_per_address = cfg.max_connections_per_address.max(clients);
        cfg.max_connections = cfg.max_connections.max(clients);
        let rt = component_runtime("proxy")?;
        let proxy = rt
            .spawn(cellmesh_proxy::start(cfg, stop.child_token()))
            .await
            .context("the proxy task")?
            .context("starting the proxy")?;
        runtimes.0.push(rt);
        let cluster = Self {
            world,
            partition,
            sidecars,
            proxy,
            secret,
            stop,
            _runtimes: runtimes,
            _certs: certs,
        };
        cluster
            .wait_until("the sidecars linked", |c| {
                c.sidecars
                    .iter()
                    .all(|s| s.stats().peers_up + 1 == u64::from(spec.nodes))
                    && c.proxy.admin.is_ready()
            })
            .await?;
        Ok(cluster)
    }

    /// Waits (up to 20 s) until `ready` holds.
    pub async fn wait_until(
        &self,
        what: &str,
        ready: impl Fn(&Self) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready(self) {
            anyhow::ensure!(Instant::now() < deadline, "{what}: not within 20 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// The local-protocol address of node `id`'s sidecar.
    pub fn local_addr(&self, id: u32) -> String {
        self.sidecars[id as usize - 1].local_addr.clone()
    }

    pub fn proxy_addr(&self) -> String {
        self.proxy.client_addr.to_string()
    }

    /// The secret the proxy checks logins against, for clients that sign their own.
    pub fn token_secret(&self) -> &str {
        &self.secret
    }

    /// A login for `account`, valid for an hour.
    pub fn token(&self, account: &str) -> String {
        hour_token(&self.secret, account)
    }
}

/// A login for `account` signed with `secret`, valid for an hour.
pub fn hour_token(secret: &str, account: &str) -> String {
    let expiry = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
        + 3600;
    cellmesh_proto::token::sign(secret.as_bytes(), account, expiry)
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Then the runtimes go.
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_world::geometry::Pos;

    #[test]
    fn strips_run_west_to_east_and_the_border_lies_between_them() {
        let world = WorldShape::default();
        for nodes in [1, 2, 3, 4] {
            let p = strips(world, nodes).unwrap();
            for n in 1..nodes {
                let x = border_x(&world, nodes, n);
                let at = |x: f64| p.owner_of(Pos { x, y: 1000.0 }).unwrap();
                assert_eq!(at(x - 1.0), n, "{nodes} nodes, border {n} at {x}");
                assert_eq!(at(x + 1.0), n + 1, "{nodes} nodes, border {n} at {x}");
            }
        }
    }
}
