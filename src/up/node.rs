//! One node of the run: a sidecar and its arena, on a runtime of its own under `--chaos`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh_arena::{ArenaConfig, ArenaStats, Census};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_sidecar::SidecarConfig;
use cellmesh_stores::topology::TopologyStore;
use cellmesh_stores::Stores;
use cellmesh_world::geometry::WorldShape;
use tokio_util::sync::CancellationToken;

use super::geo_layout::GeoLayout;
use super::run_dir::{RunCa, RunDir};

/// One node of the run: its sidecar and its arena, on the runtime they were started on (one of
/// their own under `--chaos`, so that a kill drops every task and socket at once).
pub(super) struct NodeRun {
    pub(super) id: u32,
    pub(super) sidecar: cellmesh_sidecar::SidecarHandle,
    pub(super) arena: tokio::task::JoinHandle<anyhow::Result<ArenaStats>>,
    pub(super) runtime: Option<tokio::runtime::Runtime>,
}

/// What every node of the run is started with.
#[derive(Clone)]
pub(super) struct NodeEnv {
    pub(super) world: WorldShape,
    /// The stores of each geo (index: [`GeoLayout`]'s): claims and checkpoints of its own, the
    /// directory of accounts and the records shared.
    pub(super) stores: Vec<Stores>,
    pub(super) geos: Arc<GeoLayout>,
    pub(super) topology: Arc<dyn TopologyStore>,
    pub(super) games: Arc<Census>,
    pub(super) halt: Arc<std::sync::atomic::AtomicBool>,
    pub(super) stop: CancellationToken,
    pub(super) seed: u64,
    /// Short leases under `--chaos`, so a killed node's world is restored within seconds.
    pub(super) node_lease_ms: Option<u64>,
    pub(super) own_runtime: bool,
    /// The nodes' state dir, of this run only (so are the in-memory topology and its leases);
    /// none unless killed nodes restart in place.
    pub(super) state_dir: Option<Arc<RunDir>>,
    /// The CA of this run, which issues each node's mesh certificate as it starts; none with
    /// `--mesh-plaintext`.
    pub(super) mesh_ca: Option<Arc<RunCa>>,
    /// The admin token of this run: every admin port of it asks for it.
    pub(super) admin_token: Arc<str>,
    /// Where the arenas' NPCs and new players appear (see [`Crowd`](super::crowd::Crowd) for a
    /// BSP).
    pub(super) arena_center: (f64, f64),
    pub(super) arena_spread: f64,
    pub(super) player_speed: f64,
    pub(super) entity_cost_ms: f32,
    /// Avatars released by the arenas, and `Offload` asked by the sidecars (`--zero-tick-handoffs`).
    pub(super) zero_tick_handoffs: bool,
    /// The attest key of this run (`kid:secret`), shared by its proxies and sidecars: nobody
    /// outside it can attach a session.
    pub(super) attest_key: String,
}

/// Starts node `id`'s sidecar (its mesh listener on `mesh_listen`) and its arena with `npcs`.
pub(super) async fn start_node(
    env: &NodeEnv,
    id: u32,
    mesh_listen: String,
    npcs: u32,
    runtime: Option<tokio::runtime::Runtime>,
) -> (Option<tokio::runtime::Runtime>, anyhow::Result<NodeRun>) {
    let handle = runtime
        .as_ref()
        .map_or_else(tokio::runtime::Handle::current, |r| r.handle().clone());
    let geo = env.geos.geo_of(id);
    let mut cfg = SidecarConfig {
        node_id: id,
        geo: env.geos.names[geo].clone(),
        // Every claim key has one home among the run's geos, whose store alone grants it.
        geos: env.geos.names.clone(),
        // The first geo is the core: its decider restores every geo's dead nodes, from the
        // copies of their checkpoints each geo writes to its store.
        core_geo: if env.geos.several() {
            env.geos.names[0].clone()
        } else {
            String::new()
        },
        world: env.world,
        local_listen: "127.0.0.1:0".into(),
        mesh_listen,
        admin_listen: "127.0.0.1:0".into(),
        admin_token: env.admin_token.to_string(),
        state_dir: env
            .state_dir
            .as_ref()
            .map(|d| d.0.to_string_lossy().into_owned())
            .unwrap_or_default(),
        attest_keys: vec![env.attest_key.clone()],
        handoff_offload: env.zero_tick_handoffs,
        ..SidecarConfig::default()
    };
    if let Some(ms) = env.node_lease_ms {
        cfg.node_lease_ms = ms;
    }
    if let Some(ca) = &env.mesh_ca {
        let who =
            cellmesh_trust::Identity::new(cellmesh_trust::Role::Sidecar, Some(id), Some(&cfg.geo))
                .map_err(anyhow::Error::msg);
        match who.and_then(|who| ca.issue(&format!("node-{id}"), &who)) {
            Ok(tls) => cfg.mesh_tls = tls,
            Err(e) => return (runtime, Err(e.context(format!("certifying node {id}")))),
        }
    }
    for (g, name) in env.geos.names.iter().enumerate() {
        if g != geo {
            cfg.shaping.to_geos.insert(
                name.clone(),
                cellmesh_proto::shaping::OneWay::ms(env.geos.one_way_ms[geo][g], 2),
            );
        }
    }
    let started = handle.spawn(cellmesh_sidecar::start_in(
        cfg,
        env.stores[geo].clone(),
        env.topology.clone(),
        env.stop.child_token(),
    ));
    let sidecar = match started.await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return (
                runtime,
                Err(e.context(format!("starting the sidecar of node {id}"))),
            )
        }
        Err(e) => return (runtime, Err(anyhow::anyhow!("starting node {id}: {e}"))),
    };
    let arena_cfg = ArenaConfig {
        sidecar: SidecarAddr::Tcp(sidecar.local_addr.clone()),
        npcs,
        seed: env.seed.wrapping_add(u64::from(id)),
        center: env.arena_center,
        spread: env.arena_spread,
        player_speed: env.player_speed,
        entity_cost_ms: env.entity_cost_ms,
        census: Some(env.games.clone()),
        halt: Some(env.halt.clone()),
        release_avatars: env.zero_tick_handoffs,
        ..ArenaConfig::default()
    };
    let arena_stop = env.stop.child_token();
    let arena = handle.spawn(async move {
        cellmesh_arena::run(arena_cfg, async move { arena_stop.cancelled().await }).await
    });
    (
        None,
        Ok(NodeRun {
            id,
            sidecar,
            arena,
            runtime,
        }),
    )
}

pub(super) fn node_runtime(id: u32) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("node-{id}"))
        .enable_all()
        .build()
        .with_context(|| format!("a runtime for node {id}"))
}

/// Drops a node's runtime the way a crash ends a process: every task and socket at once.
pub(super) async fn crash(runtime: tokio::runtime::Runtime) {
    let _ =
        tokio::task::spawn_blocking(move || runtime.shutdown_timeout(Duration::from_secs(2))).await;
}
