//! The only tokio code of the sidecar: it binds the sockets, runs the connection tasks, and
//! drives the [`Core`](crate::core::Core) with what they receive and the clock.
//!
//! - [`driver`]: the loop that feeds the core events and the time, and carries out its outputs;
//! - [`game`]: the local-protocol server the game connects to;
//! - [`mesh`]: links from proxies (and peer sidecars) to this node's mesh listener;
//! - [`dial`]: links this node keeps to peers with a higher node id;
//! - [`membership`]: the node lease, the node record, the partition and the live peers;
//! - [`state_dir`]: the lock and last lease grant that let a process restarted in place take
//!   its node id back at once;
//! - [`store`]: the store executor; [`codec`]: the metered frame codec;
//! - [`agones`]: under Agones, the calls of its SDK server on the game's behalf.

pub(crate) mod agones;
pub(crate) mod codec;
pub(crate) mod dial;
pub(crate) mod driver;
pub(crate) mod game;
pub(crate) mod membership;
pub(crate) mod mesh;
pub(crate) mod spans;
pub(crate) mod state_dir;
pub(crate) mod store;

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use cellmesh_admin::prometheus_client::registry::Registry;
use cellmesh_admin::{Admin, Reply};
use cellmesh_proto::local::{self, GameMessage, SidecarFrame};
use cellmesh_proto::mesh::{LinkHello, MeshFrame, MeshMessage};
use cellmesh_stores::topology::{NodeRecord, TopologyStore};
use cellmesh_stores::Stores;
use cellmesh_world::partition::Partition;
use cellmesh_world::world_map::NodeMap;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{LocalListen, SidecarConfig};
use crate::core::{ConnId, Core, Input, LeaseTerms, LinkId};
use crate::metrics::Metrics;
use crate::SidecarHandle;
use driver::Driver;
use game::{GameCtx, GameListener};
use mesh::MeshCtx;

/// Events queued for the driver before connection tasks wait (back-pressure on the sockets).
const NODE_INBOX: usize = 1024;
/// A game must say `Hello` this soon after connecting; a link, its `LinkHello`.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Wall-clock milliseconds since the Unix epoch (the io side's one reading of it).
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the connection, store and membership tasks tell the driver.
pub(crate) enum Event {
    /// A game said a valid `Hello`: the driver keeps its handle, the core gets the rest.
    GameHello {
        conn: ConnId,
        hello: local::Hello,
        rest: Vec<GameMessage>,
        handle: GameHandle,
    },
    /// A link completed its handshake (the reply `LinkHello` is already written).
    LinkUp {
        link: LinkId,
        hello: LinkHello,
        remote: String,
        handle: LinkHandle,
        rest: Vec<MeshMessage>,
    },
    /// The node lease was renewed: the driver turns the deadline into the core's clock.
    LeaseRenewed {
        lease: cellmesh_stores::topology::Lease,
        deadline: tokio::time::Instant,
    },
    /// Anything else, for the core as it is.
    Core(Input),
}

/// What the driver queues for a game connection.
pub(crate) enum GameOut {
    Frame(SidecarFrame),
    /// Write this error, then close.
    Fatal(local::Error),
}

/// The driver's end of a game connection. Dropping it closes the connection after its queue.
pub(crate) struct GameHandle {
    pub outbox: mpsc::Sender<GameOut>,
    /// Close at once, dropping the queue (the game stopped reading).
    pub kill: CancellationToken,
}

/// The driver's end of a mesh link. Dropping it closes the link after its queue.
pub(crate) struct LinkHandle {
    pub outbox: mpsc::Sender<MeshFrame>,
    pub kill: CancellationToken,
    /// When the core was last told this outbox's backlog (monotonic ms).
    pub backlog_reported_ms: Option<u64>,
}

/// How often the mesh TLS files are looked at for a change (SIGHUP reads them at once).
const TLS_RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Reads `mesh_tls`, if set, and checks that the certificate is this node's: a sidecar's role,
/// its node id (unless the certificate names none) and its geo (unless it names none).
fn mesh_tls(cfg: &SidecarConfig) -> anyhow::Result<Option<Arc<cellmesh_trust::MeshTls>>> {
    if !cfg.mesh_tls.enabled()? {
        return Ok(None);
    }
    let tls = cellmesh_trust::MeshTls::load(&cfg.mesh_tls)?;
    tls.own()
        .check_claim(cellmesh_trust::Role::Sidecar, Some(cfg.node_id), &cfg.geo)
        .map_err(|e| {
            anyhow::anyhow!(
                "mesh_tls.cert {} is not this node's (node {} of geo {:?}): {e}",
                cfg.mesh_tls.cert,
                cfg.node_id,
                cfg.geo
            )
        })?;
    Ok(Some(tls))
}

/// Binds the listeners, starts the connection tasks, the membership task (for a cluster node)
/// and the driver. The state dir's lock is held until both the driver and the lease task have
/// ended (or their runtime is dropped, as a crash drops everything).
pub(crate) async fn launch(
    cfg: SidecarConfig,
    stores: Stores,
    partition: Partition,
    membership: Option<(Arc<dyn TopologyStore>, membership::Held)>,
    state: Option<state_dir::StateDir>,
    shutdown: CancellationToken,
) -> anyhow::Result<SidecarHandle> {
    let state = state.map(Arc::new);
    let cfg = Arc::new(cfg);
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let published = Arc::new(Mutex::new(
        serde_json::json!({ "node_id": cfg.node_id, "starting": true }),
    ));
    let view = published.clone();
    let admin = Admin::new(registry, move || {
        view.lock().expect("state lock poisoned").clone()
    });
    admin.set_token(&cfg.admin_token);

    let tls = mesh_tls(&cfg)?;
    let (local, local_addr) = bind_local(&cfg).await?;
    let mesh_listener = TcpListener::bind(&cfg.mesh_listen)
        .await
        .with_context(|| format!("binding mesh_listen {}", cfg.mesh_listen))?;
    let mesh_addr = mesh_listener.local_addr()?;
    let admin_addr = cellmesh_admin::spawn(&cfg.admin_listen, admin.clone(), shutdown.clone())
        .await
        .with_context(|| format!("binding admin_listen {}", cfg.admin_listen))?;

    let tasks = TaskTracker::new();
    let (inbox, events) = mpsc::channel(NODE_INBOX);
    let mesh_ctx = MeshCtx {
        node: inbox.clone(),
        metrics: metrics.clone(),
        max_frame: cfg.max_frame_bytes,
        outbox_frames: cfg.link_outbox_frames,
        node_id: cfg.node_id,
        geo: cfg.geo.clone(),
        world_geos: cfg.geos.clone(),
        partition_epoch: partition.epoch(),
        lease_epoch: membership.as_ref().map_or(0, |(_, held)| held.lease.epoch),
        next_link: Arc::new(AtomicU64::new(1)),
        shutdown: shutdown.clone(),
        tasks: tasks.clone(),
        shaping: cfg.shaping.clone(),
        handshakes: mesh::Handshakes::new(),
        tls: tls.clone(),
    };
    if let Some(tls) = &tls {
        tasks.spawn(tls.spawn_reloader(TLS_RELOAD_EVERY, shutdown.clone()));
    }
    let census = Arc::default();
    let restored = Arc::default();
    let (load_reports, load_report) = watch::channel(None);
    let (player_samples, players) = watch::channel(None);
    // Whether a game is connected, the node ready, or stopped: for the Agones task, if any.
    let (agones_status, agones_node) = watch::channel(Default::default());
    if let Some(port) = cfg.agones.port() {
        tasks.spawn(agones::run(
            agones::Target {
                port,
                node_id: cfg.node_id,
                geo: cfg.geo.clone(),
                health_every_ms: cfg.agones.health_every_ms,
            },
            agones_node,
            metrics.clone(),
        ));
    }
    let clustered = membership.is_some();
    let held = membership.as_ref().map(|(_, h)| h.clone());
    let topology = membership.as_ref().map(|(t, _)| t.clone());
    if let Some((topology, held)) = membership {
        let advertise = match cfg.mesh_advertise.trim() {
            "" => mesh_addr.to_string(),
            a => a.to_string(),
        };
        let record = NodeRecord {
            node: cfg.node_id,
            geo: cfg.geo.clone(),
            mesh_addr: advertise,
            admin_addr: admin_addr.to_string(),
        };
        let (renewed, lease) = watch::channel(held.lease.clone());
        let keep = membership::keep_lease(
            topology.clone(),
            held,
            Duration::from_millis(cfg.node_lease_ms),
            inbox.clone(),
            renewed,
            shutdown.clone(),
        );
        // Locked until the lease is given up: a successor started meanwhile must not take over
        // a lease this process may still renew.
        let locked = state.clone();
        tasks.spawn(async move {
            keep.await;
            drop(locked);
        });
        tasks.spawn(membership::membership(
            topology,
            lease,
            record,
            membership::Reports {
                load: load_report,
                players,
            },
            partition.epoch(),
            inbox.clone(),
            shutdown.clone(),
        ));
    }
    let start = tokio::time::Instant::now();
    let core = Core::new(
        cfg.clone(),
        metrics.clone(),
        Arc::new(partition),
        clustered,
        held.map(|h| LeaseTerms {
            until_ms: driver::mono_ms(start, h.deadline),
            lease: h.lease,
        }),
        driver::now(start),
    );
    published
        .lock()
        .expect("state lock poisoned")
        .clone_from(&core.state());
    let failure = Arc::new(Mutex::new(None));
    let node_map = Arc::new(Mutex::new(NodeMap::default()));
    let sample = node_map.clone();
    admin.route("/api/node-map", move || {
        let map = sample.lock().expect("node map lock poisoned").clone();
        async move { Reply::json(&map) }
    });
    let driver = Driver {
        core,
        start,
        games: Default::default(),
        links: Default::default(),
        dialers: Default::default(),
        stores,
        topology,
        inbox: inbox.clone(),
        tasks: tasks.clone(),
        admin: admin.clone(),
        published,
        census: Arc::clone(&census),
        node_map,
        restored: Arc::clone(&restored),
        mesh_ctx: mesh_ctx.clone(),
        metrics: metrics.clone(),
        shutdown: shutdown.clone(),
        failure: Arc::clone(&failure),
        load_reports,
        player_samples,
        agones: agones_status,
        spans: spans::Spans::new(cfg.node_id, cfg.command_timeout_ms),
    };
    // Should the driver ever end (or panic), everything else stops with it.
    let stop_all = shutdown.clone().drop_guard();
    let node = tokio::spawn(async move {
        let _stop_all = stop_all;
        // Locked while the node may write.
        let _state = state;
        driver.run(events).await
    });
    tasks.spawn(game::accept_loop(
        local,
        GameCtx {
            node: inbox.clone(),
            metrics: metrics.clone(),
            max_frame: cfg.max_frame_bytes,
            outbox_frames: cfg.game_outbox_frames,
            shutdown: shutdown.clone(),
            tasks: tasks.clone(),
        },
    ));
    let weak = inbox.downgrade();
    drop(inbox);
    tasks.spawn(mesh::accept_loop(mesh_listener, mesh_ctx));
    tracing::info!(node = cfg.node_id, local = %local_addr, mesh = %mesh_addr, admin = %admin_addr, "sidecar started");
    Ok(SidecarHandle {
        node_id: cfg.node_id,
        local_addr,
        mesh_addr,
        admin_addr,
        admin,
        metrics,
        node,
        tasks,
        inbox: weak,
        failure,
        census,
        restored,
    })
}

async fn bind_local(cfg: &SidecarConfig) -> anyhow::Result<(GameListener, String)> {
    match cfg.local() {
        LocalListen::Tcp(addr) => {
            let l = TcpListener::bind(&addr)
                .await
                .with_context(|| format!("binding local_listen {addr}"))?;
            let bound = l.local_addr()?.to_string();
            Ok((GameListener::Tcp(l), bound))
        }
        LocalListen::Unix(path) => {
            clear_stale_socket(&path).await?;
            let l = UnixListener::bind(&path)
                .with_context(|| format!("binding local_listen unix:{}", path.display()))?;
            Ok((
                GameListener::Unix(l, path.clone()),
                format!("unix:{}", path.display()),
            ))
        }
    }
}

/// A socket file left by a sidecar that died is removed; one that still answers is not stolen.
async fn clear_stale_socket(path: &Path) -> anyhow::Result<()> {
    if !path.exists() {
        return Ok(());
    }
    if tokio::net::UnixStream::connect(path).await.is_ok() {
        anyhow::bail!(
            "local_listen unix:{} is in use by another process",
            path.display()
        );
    }
    std::fs::remove_file(path)
        .with_context(|| format!("removing the stale socket {}", path.display()))
}
