//! The cellmesh sidecar: the data plane beside one game server (DESIGN §6-§9).
//!
//! - `game`: the local-protocol server the game connects to;
//! - `mesh`: links from proxies, carrying client sessions;
//! - `node`: the one task that owns the node's state, fed by both;
//! - pure logic, no I/O: [`entities`] (the entity table), [`ids`] (snowflake ids), [`interest`]
//!   (views with hysteresis), [`audience`] (who sees what), [`fold`] (one batch per client per
//!   tick);
//! - [`metrics`] and the admin endpoints (`/live`, `/ready`, `/metrics`, `/state`).
//!
//! Many nodes serve one world ([`start_in`]): peer links between sidecars (`cluster`), node-level
//! chunk subscriptions ([`subs`]), render and simulation ghosts ([`ghosts`]) and routing by
//! account ([`route`]), wired together in `peer`. Entities move between nodes by epoch-fenced
//! handoff: the pure state machines and fence in [`handoff`], driven by `handoff_node`.

pub mod audience;
mod cluster;
pub mod config;
pub mod entities;
pub mod fold;
mod game;
mod gateway;
pub mod ghosts;
pub mod handoff;
mod handoff_node;
pub mod ids;
pub mod interest;
mod mesh;
pub mod metrics;
mod node;
mod peer;
pub mod route;
pub mod subs;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use cellmesh_admin::prometheus_client::registry::Registry;
use cellmesh_admin::Admin;
use cellmesh_geo_router::partition::{Grid, Layout, Partition};
use cellmesh_geo_router::store::Stores;
use cellmesh_geo_router::topology::{Lease, NodeRecord, TopologyStore};
use serde::Serialize;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::SidecarConfig;

use crate::config::LocalListen;
use crate::game::{GameCtx, GameListener};
use crate::mesh::MeshCtx;
use crate::metrics::Metrics;
use crate::node::{Node, NodeEvent};

/// Events queued for the node before connection tasks wait (back-pressure on the sockets).
const NODE_INBOX: usize = 1024;

/// A running sidecar.
pub struct SidecarHandle {
    /// The local-protocol address actually bound: `127.0.0.1:PORT` or `unix:/path`.
    pub local_addr: String,
    pub mesh_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub admin: Arc<Admin>,
    metrics: Metrics,
    node: JoinHandle<()>,
    tasks: TaskTracker,
    inbox: mpsc::WeakSender<NodeEvent>,
    census: Arc<Mutex<Vec<crate::Real>>>,
}

/// An entity a node writes, as a census sees it: frozen ones are in a handoff and write nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Real {
    pub id: u64,
    pub epoch: u64,
    pub frozen: bool,
}

/// Counters for tests and the CLI status line.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SidecarStats {
    pub game_connected: bool,
    pub sessions: u64,
    pub entities: u64,
    pub inputs_delivered: u64,
    pub batches_sent: u64,
    pub deltas_sent: u64,
    pub errors: u64,
    pub frames_in: u64,
    pub frames_out: u64,
    pub peers_up: u64,
    pub ghosts_render: u64,
    pub ghosts_sim: u64,
    pub subscriptions: u64,
    /// (chunk, node) subscriptions other nodes hold on this node's chunks.
    pub subscribers: u64,
    pub routed_messages: u64,
    pub cross_node_updates: u64,
    pub dropped_unknown_account: u64,
    pub inputs_forwarded: u64,
    /// Handoffs this node completed as the source.
    pub handoffs: u64,
    pub handoffs_refused: u64,
    pub in_doubt_now: u64,
    pub stale_epoch_drops: u64,
    pub held_frames: u64,
}

impl SidecarHandle {
    pub fn stats(&self) -> SidecarStats {
        let m = &self.metrics;
        SidecarStats {
            game_connected: m.game_connected.get() > 0,
            sessions: m.sessions.get().max(0) as u64,
            entities: m.entities.get().max(0) as u64,
            inputs_delivered: m.inputs_delivered.get(),
            batches_sent: m.batches_sent.get(),
            deltas_sent: m.deltas_sent.get(),
            errors: m.errors_total(),
            frames_in: m.frames_in_total(),
            frames_out: m.frames_out_total(),
            peers_up: m.peers_up.get().max(0) as u64,
            ghosts_render: m.ghosts_render.get().max(0) as u64,
            ghosts_sim: m.ghosts_sim.get().max(0) as u64,
            subscriptions: m.subscriptions.get().max(0) as u64,
            subscribers: m.subscribers.get().max(0) as u64,
            routed_messages: m.routed_messages.get(),
            cross_node_updates: m.cross_node_updates.get(),
            dropped_unknown_account: m.dropped_unknown_account.get(),
            inputs_forwarded: m.inputs_forwarded.get(),
            handoffs: m.handoffs_out.get(),
            handoffs_refused: m.handoffs_refused.get(),
            in_doubt_now: m.handoffs_in_doubt.get().max(0) as u64,
            stale_epoch_drops: m.stale_epoch_drops.get(),
            held_frames: m.held_frames.get().max(0) as u64,
        }
    }

    /// Freeze durations of this node's handoffs (milliseconds), for percentiles.
    pub fn freeze_ms(&self) -> hdrhistogram::Histogram<u64> {
        self.metrics
            .freeze_ms
            .lock()
            .expect("freeze histogram lock poisoned")
            .clone()
    }

    /// Every entity this node writes (its reals) with its epoch, as of the last published state
    /// (at most 100 ms old), for a census.
    pub fn reals(&self) -> Vec<Real> {
        self.census.lock().expect("census lock poisoned").clone()
    }

    /// Starts a graceful drain (what SIGTERM does): `/ready` goes false, handoffs are refused,
    /// what the partition gives to other nodes is handed to them, then the sidecar shuts down.
    pub fn drain(&self) {
        if let Some(inbox) = self.inbox.upgrade() {
            let _ = inbox.try_send(NodeEvent::Drain);
        }
    }

    /// Waits until the sidecar has shut down (after its `shutdown` token was cancelled) and
    /// every connection has written what was queued for it.
    pub async fn wait(self) {
        if let Err(e) = self.node.await {
            tracing::error!(error = %e, "sidecar node task failed");
        }
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Binds the listeners and starts a lone sidecar that owns the whole world; it runs until
/// `shutdown` is cancelled.
pub async fn start(
    cfg: SidecarConfig,
    stores: Stores,
    shutdown: CancellationToken,
) -> anyhow::Result<SidecarHandle> {
    cfg.validate().context("invalid sidecar configuration")?;
    // One region covering the world, so the game is told one rectangle.
    let whole = Grid::new(&cfg.world, 1, 1, vec![cfg.node_id]).context("the world")?;
    let partition = Partition::new(cfg.world, 0, Layout::Grid(whole)).context("the world")?;
    launch(cfg, stores, partition, None, shutdown).await
}

/// Starts a sidecar as one node of a cluster: it serves the area the committed partition in
/// `topology` gives its node id, under that id's lease, and links to every other live node.
pub async fn start_in(
    cfg: SidecarConfig,
    stores: Stores,
    topology: Arc<dyn TopologyStore>,
    shutdown: CancellationToken,
) -> anyhow::Result<SidecarHandle> {
    cfg.validate().context("invalid sidecar configuration")?;
    let (partition, lease) = cluster::join(topology.as_ref(), &cfg).await?;
    launch(cfg, stores, partition, Some((topology, lease)), shutdown).await
}

async fn launch(
    cfg: SidecarConfig,
    stores: Stores,
    partition: Partition,
    membership: Option<(Arc<dyn TopologyStore>, Lease)>,
    shutdown: CancellationToken,
) -> anyhow::Result<SidecarHandle> {
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

    let (local, local_addr) = bind_local(&cfg).await?;
    let mesh = TcpListener::bind(&cfg.mesh_listen)
        .await
        .with_context(|| format!("binding mesh_listen {}", cfg.mesh_listen))?;
    let mesh_addr = mesh.local_addr()?;
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
        partition_epoch: partition.epoch(),
        next_link: Arc::new(AtomicU64::new(1)),
        shutdown: shutdown.clone(),
        tasks: tasks.clone(),
    };
    let census: Arc<Mutex<Vec<crate::Real>>> = Arc::default();
    let mut node = Node::new(
        cfg.clone(),
        stores,
        metrics.clone(),
        admin.clone(),
        published,
        inbox.clone(),
        tasks.clone(),
        Arc::new(partition),
        membership.is_some().then(|| mesh_ctx.clone()),
    );
    node.census = census.clone();
    if let Some((topology, lease)) = membership {
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
        tasks.spawn(cluster::membership(
            topology,
            lease,
            record,
            Duration::from_millis(cfg.node_lease_ms),
            node.partition.epoch(),
            inbox.clone(),
            shutdown.clone(),
        ));
    }
    node.publish_state();
    let shutdown_node = shutdown.clone();
    // Should the node task ever end (or panic), everything else stops with it.
    let stop_all = shutdown.clone().drop_guard();
    let node = tokio::spawn(async move {
        let _stop_all = stop_all;
        node.run(events, shutdown_node).await
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
    tasks.spawn(mesh::accept_loop(mesh, mesh_ctx));
    tracing::info!(node = cfg.node_id, local = %local_addr, mesh = %mesh_addr, admin = %admin_addr, "sidecar started");
    Ok(SidecarHandle {
        local_addr,
        mesh_addr,
        admin_addr,
        admin,
        metrics,
        node,
        tasks,
        inbox: weak,
        census,
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
