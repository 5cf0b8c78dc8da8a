//! The cluster of a run, started and linked: the stores, the partition committed to the
//! topology, the run's admin port and token, the nodes, the director (`--balance`, or the
//! geo-aware one of `--bubbles`) and the proxies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use cellmesh_arena::{ArenaConfig, Census};
use cellmesh_proxy::ProxyHandle;
use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::TopologyStore;
use cellmesh_stores::Stores;
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Bsp, Grid, Layout, Partition};
use tokio_util::sync::CancellationToken;

use super::chaos::CHAOS_NODE_LEASE_MS;
use super::crowd::{Crowd, ARENA_SPREAD, MEETING_POINT};
use super::edge_outage::{EDGE_DARK_FOR, EDGE_QUIET_AT_END};
use super::geo_layout::GeoLayout;
use super::node::{node_runtime, start_node, NodeEnv, NodeRun};
use super::proxies::start_proxies;
use super::run_dir::{RunCa, RunDir, RunToken};
use super::UpOptions;
use cellmesh_director::DirectorHandle;

/// A run's cluster, up: every node linked to its peers and its game, every proxy ready.
pub(super) struct Cluster {
    /// What every node is started with, and what the run shares: the geos, the topology, the
    /// games' census, the halt, the stop.
    pub(super) env: NodeEnv,
    pub(super) nodes: Vec<NodeRun>,
    pub(super) proxies: Vec<ProxyHandle>,
    pub(super) director: Option<DirectorHandle>,
    /// Stopped when the bots leave: the census reads a world whose layout holds still.
    pub(super) director_stop: CancellationToken,
    /// A secret of this run only: nobody outside it can sign a login.
    pub(super) secret: String,
    /// Kept for the whole run: its file goes with it.
    admin_token: RunToken,
    admin: Arc<cellmesh_admin::Admin>,
}

impl Cluster {
    /// Starts the cluster, waits until it is ready, and prints where it is.
    pub(super) async fn start(opts: &UpOptions) -> anyhow::Result<Self> {
        let stop = CancellationToken::new();
        anyhow::ensure!(opts.nodes >= 1, "--nodes must be at least 1");
        check_edge_outage(opts)?;
        let geos = Arc::new(GeoLayout::new(&opts.geos, opts.nodes, &opts.geo_delay_ms)?);
        let stores = stores_per_geo(&geos);
        anyhow::ensure!(
            opts.nodes as u32 <= cellmesh_stores::topology::MAX_NODE_ID,
            "--nodes {} is more than node ids allow",
            opts.nodes
        );
        let world = WorldShape::default();
        let ids: Vec<u32> = (1..=opts.nodes as u32).collect();
        let topology = commit_partition(opts, world, &ids).await?;
        let (admin, admin_token, admin_addr) = serve_admin(opts, &topology, &stop).await?;
        let env = node_env(
            opts,
            world,
            stores,
            geos,
            topology,
            stop,
            &admin_token.token,
        )?;
        let nodes = start_nodes(opts, &env, &ids).await?;
        let director_stop = env.stop.child_token();
        let director = start_director(
            opts,
            &env.topology,
            &env.geos,
            &admin_token.token,
            &director_stop,
        )
        .await?;
        let secret = format!("{:032x}", rand::random::<u128>());
        let proxies = start_proxies(&env, &nodes, opts.bots, &secret).await?;
        let cluster = Self {
            env,
            nodes,
            proxies,
            director,
            director_stop,
            secret,
            admin_token,
            admin,
        };
        cluster.wait_until_ready(opts.nodes).await?;
        cluster.announce(opts, admin_addr);
        Ok(cluster)
    }

    async fn wait_until_ready(&self, nodes: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(15);
        let linked = |s: &cellmesh_sidecar::SidecarHandle| {
            let st = s.stats();
            st.game_connected && st.peers_up as usize == nodes - 1
        };
        while !(self.nodes.iter().all(|n| linked(&n.sidecar))
            && self.proxies.iter().all(|p| p.admin.is_ready()))
        {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the cluster did not become ready within 15 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Marks the run's admin port ready, and prints every address of the run.
    fn announce(&self, opts: &UpOptions, admin_addr: std::net::SocketAddr) {
        let geos = &self.env.geos;
        let admins: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("http://{}", n.sidecar.admin_addr))
            .collect();
        let edges: Vec<String> = self
            .proxies
            .iter()
            .zip(&geos.names)
            .map(|(p, g)| {
                if geos.several() {
                    format!(
                        "{g}: clients {} admin http://{}",
                        p.client_addr, p.admin_addr
                    )
                } else {
                    format!("clients {} admin http://{}", p.client_addr, p.admin_addr)
                }
            })
            .collect();
        let layout = if opts.bsp {
            "bsp".to_string()
        } else {
            let (cols, rows) = grid_shape(opts.nodes);
            format!("{cols}×{rows}")
        };
        let director_admin = self
            .director
            .as_ref()
            .map(|d| format!(" · director admin http://{}", d.admin_addr))
            .unwrap_or_default();
        self.admin.set_ready(true);
        println!(
            "cellmesh up: {} nodes ({layout}), sidecar admin {} · proxy {}{director_admin} · {} bots",
            opts.nodes,
            admins.join(" "),
            edges.join(" · "),
            opts.bots
        );
        // The token's file, not the token: a terminal's scrollback and a CI log are read by many.
        println!(
            "cellmesh up: admin token in {}: send \"Authorization: Bearer $(cat {0})\" (all but /live, /ready, /metrics); the live map asks for it once",
            self.admin_token.file.display()
        );
        println!("cellmesh up: live map http://{admin_addr}/map");
    }
}

/// `--edge-outage` darkens a geo other than the core, and the geo returns with time to settle
/// before the run ends.
fn check_edge_outage(opts: &UpOptions) -> anyhow::Result<()> {
    let Some(at) = opts.edge_outage else {
        return Ok(());
    };
    anyhow::ensure!(
        opts.geos.len() > 1,
        "--edge-outage darkens a geo other than the core: it needs --geos 2 or more"
    );
    if let Some(d) = opts.duration {
        let needed = at + EDGE_DARK_FOR + EDGE_QUIET_AT_END;
        anyhow::ensure!(
            needed <= d,
            "--edge-outage {}: the geo is dark {} s and the world settles {} s after it returns: \
             --duration must be at least {} s",
            at.as_secs_f64(),
            EDGE_DARK_FOR.as_secs(),
            EDGE_QUIET_AT_END.as_secs(),
            needed.as_secs_f64().ceil()
        );
    }
    Ok(())
}

/// `cols × rows` for `n` nodes: the most square factorisation.
pub fn grid_shape(n: usize) -> (u32, u32) {
    let rows = (1..=n)
        .filter(|r| n.is_multiple_of(*r) && r * r <= n)
        .max()
        .unwrap_or(1);
    ((n / rows) as u32, rows as u32)
}

/// One claim store and checkpoint store per geo, as a Redis per geo would hold them, and the
/// core geo's copies of the others' checkpoints; the directory of accounts (homed in the core
/// geo, the first) and the player records shared.
fn stores_per_geo(geos: &GeoLayout) -> Vec<Stores> {
    let shared = Stores::in_memory();
    let mut stores: Vec<Stores> = (0..geos.names.len())
        .map(|g| {
            if g == 0 {
                return shared.clone();
            }
            // A geo's claims and checkpoints are its own; a copy of its checkpoints is kept in
            // the core geo's store.
            let copy: Arc<dyn cellmesh_stores::CheckpointStore> =
                Arc::new(cellmesh_stores::memory::MemoryCheckpoints::default());
            Stores {
                claims: Arc::new(cellmesh_stores::claims::MemoryClaims::default()),
                checkpoints: Arc::new(cellmesh_stores::memory::MemoryCheckpoints::default()),
                core_copy: Some(copy),
                ..shared.clone()
            }
        })
        .collect();
    let copies = stores
        .iter()
        .enumerate()
        .skip(1)
        .filter_map(|(g, s)| Some((geos.names[g].clone(), s.core_copy.clone()?)))
        .collect();
    stores[0].copies = copies;
    stores
}

/// Lays the world out for nodes `ids` (a grid, or a BSP), and commits it to a topology of the
/// run's own.
async fn commit_partition(
    opts: &UpOptions,
    world: WorldShape,
    ids: &[u32],
) -> anyhow::Result<Arc<dyn TopologyStore>> {
    let (rx, ry) = (world.regions_x() as u32, world.regions_y() as u32);
    anyhow::ensure!(
        !opts.bubbles || (!opts.bsp && opts.geos.len() > 1),
        "--bubbles moves grid regions between geos: it needs --geos 2 or more, on the grid"
    );
    anyhow::ensure!(
        opts.bsp || !opts.balance,
        "--balance needs a BSP partition (--partition bsp): the director moves the lines of a BSP"
    );
    let layout = if opts.bsp {
        // Halved and halved again, as even as the number allows; the director moves the lines.
        Layout::Bsp(Bsp::even(&world, ids).context("laying out the BSP")?)
    } else {
        // The fixed grid of regions, shared out in compact blocks (2 × 2 quadrants for 4 nodes).
        Layout::Grid(Grid::even(&world, rx, ry, ids).context("laying out the grid")?)
    };
    let partition = Partition::new(world, 1, layout).context("the partition")?;
    let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
    topology
        .commit_partition(0, &partition)
        .await
        .context("committing the partition")?;
    Ok(topology)
}

/// Serves the run's own admin port: the live map draws the same store the nodes and the
/// director share. Ready once the cluster is. Returns it, the run's admin token, and its
/// address.
async fn serve_admin(
    opts: &UpOptions,
    topology: &Arc<dyn TopologyStore>,
    stop: &CancellationToken,
) -> anyhow::Result<(Arc<cellmesh_admin::Admin>, RunToken, std::net::SocketAddr)> {
    let up_admin = cellmesh_admin::Admin::new(prometheus_client::registry::Registry::default(), {
        let nodes = opts.nodes;
        let geos = opts.geos.clone();
        move || serde_json::json!({"nodes": nodes, "geos": geos})
    });
    // One admin token for every admin port of the run, its own included.
    let admin_token = RunToken::create().context("making the run's admin token")?;
    up_admin.set_token(&admin_token.token);
    cellmesh_director::live_map::serve(&up_admin, topology.clone(), &admin_token.token);
    let up_admin_addr = cellmesh_admin::spawn(&opts.admin_listen, up_admin.clone(), stop.clone())
        .await
        .with_context(|| format!("binding the admin port --admin {}", opts.admin_listen))?;
    Ok((up_admin, admin_token, up_admin_addr))
}

/// What every node of the run is started with: what the run shares, and what its options make
/// of a node.
fn node_env(
    opts: &UpOptions,
    world: WorldShape,
    stores: Vec<Stores>,
    geos: Arc<GeoLayout>,
    topology: Arc<dyn TopologyStore>,
    stop: CancellationToken,
    admin_token: &str,
) -> anyhow::Result<NodeEnv> {
    Ok(NodeEnv {
        attest_key: format!("run:{:032x}", rand::random::<u128>()),
        world,
        stores,
        geos,
        topology,
        games: Arc::new(Census::default()),
        halt: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        stop,
        seed: opts.seed,
        // A killed node's world is restored once its lease lapses: short leases for kills.
        node_lease_ms: (opts.chaos.is_some() || opts.edge_outage.is_some())
            .then_some(CHAOS_NODE_LEASE_MS),
        own_runtime: opts.chaos.is_some() || opts.edge_outage.is_some(),
        state_dir: if opts.chaos_in_place {
            Some(Arc::new(RunDir::create()?))
        } else {
            None
        },
        mesh_ca: if opts.mesh_plaintext {
            None
        } else {
            Some(Arc::new(RunCa::create()?))
        },
        admin_token: admin_token.into(),
        arena_center: if opts.bsp {
            Crowd::middle(&world)
        } else {
            MEETING_POINT
        },
        arena_spread: if opts.bsp {
            Crowd::ARENA_SPREAD_M
        } else {
            ARENA_SPREAD
        },
        player_speed: if opts.bsp {
            Crowd::PLAYER_SPEED
        } else {
            ArenaConfig::default().player_speed
        },
        entity_cost_ms: if opts.bsp { Crowd::ENTITY_COST_MS } else { 0.0 },
        zero_tick_handoffs: opts.zero_tick_handoffs,
    })
}

/// Starts nodes `ids`, sharing the NPCs out among their arenas.
async fn start_nodes(opts: &UpOptions, env: &NodeEnv, ids: &[u32]) -> anyhow::Result<Vec<NodeRun>> {
    let mut nodes: Vec<NodeRun> = Vec::with_capacity(opts.nodes);
    let per_arena = opts.npcs.div_ceil(opts.nodes as u32);
    for (i, &node_id) in ids.iter().enumerate() {
        let runtime = env.own_runtime.then(|| node_runtime(node_id)).transpose()?;
        let npcs = per_arena.min(opts.npcs.saturating_sub(per_arena * i as u32));
        let (_, node) = start_node(env, node_id, "127.0.0.1:0".into(), npcs, runtime).await;
        nodes.push(node?);
    }
    Ok(nodes)
}

/// With `--balance`, a director in this process, balancing the BSP until `stop`.
async fn start_director(
    opts: &UpOptions,
    topology: &Arc<dyn TopologyStore>,
    geos: &GeoLayout,
    admin_token: &str,
    stop: &CancellationToken,
) -> anyhow::Result<Option<DirectorHandle>> {
    if opts.bubbles {
        let cfg = cellmesh_director::DirectorConfig {
            topology_url: "memory".into(),
            admin_listen: "127.0.0.1:0".into(),
            admin_token: admin_token.to_string(),
            name: "up-director".into(),
            bubbles: Some(cellmesh_director::config::BubbleConfig {
                sites: geos.names.clone(),
                params: bubble_params(),
            }),
            ..cellmesh_director::DirectorConfig::default()
        };
        cfg.validate().context("the geo-aware director")?;
        return Ok(Some(
            cellmesh_director::start_with(cfg, topology.clone(), stop.clone())
                .await
                .context("starting the geo-aware director")?,
        ));
    }
    if !opts.balance {
        return Ok(None);
    }
    let cfg = cellmesh_director::DirectorConfig {
        topology_url: "memory".into(),
        admin_listen: "127.0.0.1:0".into(),
        admin_token: admin_token.to_string(),
        name: "up-director".into(),
        balance: cellmesh_world::balance::LoadConfig {
            // The world starts with the NPCs alone while the bots log in: with the default
            // bound a cell would start to retire in the first second, only to be called off.
            lower_bound: 0.1,
            ..Default::default()
        },
        ..cellmesh_director::DirectorConfig::default()
    };
    Ok(Some(
        cellmesh_director::start_with(cfg, topology.clone(), stop.clone())
            .await
            .context("starting the director")?,
    ))
}

/// The placement's parameters for a run of minutes: the policy's own, but evaluated every two
/// seconds and sustained twenty, so that a bubble moves within the first minute; and a fairness
/// cap above the longest bridge between the default geos (Montreal–Hong Kong, 240 ms), so that
/// the move is the policy's gain and not a cap forced at the first evaluation, and click to
/// screen is seen on both sides of it.
pub(super) fn bubble_params() -> cellmesh_world::bubbles::Params {
    cellmesh_world::bubbles::Params {
        evaluate_every_ms: 2_000,
        sustain_ms: 20_000,
        dwell_ms: 60_000,
        fairness_cap_ms: 300.0,
        ..cellmesh_world::bubbles::Params::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_are_as_square_as_the_count_allows() {
        assert_eq!(grid_shape(1), (1, 1));
        assert_eq!(grid_shape(2), (2, 1));
        assert_eq!(grid_shape(4), (2, 2));
        assert_eq!(grid_shape(6), (3, 2));
        assert_eq!(grid_shape(7), (7, 1));
    }
}
