//! The cellmesh sidecar: the data plane beside one game server (docs/mesh.md).
//!
//! The node decides and the driver acts (the sans-IO shape of quinn-proto):
//!
//! - [`model`]: the pure pieces (entity table, fold, interest, audiences, routing, chunk
//!   subscriptions, ghosts, the handoff state machines and fence, ids);
//! - [`core`]: the node's state and decisions, split by concern, with `handle(now, Input)`,
//!   `poll_output()` and `poll_timeout()`; no tokio, no sockets, no clock;
//! - `io`: the only tokio code: the driver loop, the game and mesh connections, dialling,
//!   membership, the store executor;
//! - [`metrics`] and the admin endpoints (`/live`, `/ready`, `/metrics`, `/state`).
//!
//! Imports run one way: `io` → `core` → `model`. [`start`] runs a lone node that owns the whole
//! world; [`start_in`] runs one node of a cluster described by a topology store.

pub mod config;
pub mod core;
mod io;
pub mod metrics;
pub mod model;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use cellmesh_admin::Admin;
use cellmesh_stores::topology::TopologyStore;
use cellmesh_stores::Stores;
use cellmesh_world::partition::{Grid, Layout, Partition};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use crate::core::authority::Real;
pub use config::SidecarConfig;
pub use model::ids;

use crate::core::Input;
use crate::io::Event;
use crate::metrics::Metrics;

/// A running sidecar.
pub struct SidecarHandle {
    /// The node id it runs as: `node_id`, or the one taken from the topology store.
    pub node_id: u32,
    /// The local-protocol address actually bound: `127.0.0.1:PORT` or `unix:/path`.
    pub local_addr: String,
    pub mesh_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub admin: Arc<Admin>,
    metrics: Metrics,
    node: JoinHandle<()>,
    tasks: TaskTracker,
    inbox: mpsc::WeakSender<Event>,
    failure: Arc<Mutex<Option<String>>>,
    census: Arc<Mutex<Vec<Real>>>,
    restored: Arc<Mutex<Vec<core::Restored>>>,
}

/// Counters for tests and the CLI status line.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SidecarStats {
    pub game_connected: bool,
    pub sessions: u64,
    pub entities: u64,
    pub inputs_delivered: u64,
    /// Of those, inputs a game dropped after releasing the avatar, handed on to be delivered
    /// again.
    pub inputs_handed_on: u64,
    /// Client inputs dropped before reaching the game, under a named reason.
    pub inputs_dropped: u64,
    /// The same by reason ([`metrics::INPUT_DROP_REASONS`]); reasons with none left out.
    pub inputs_dropped_by_reason: std::collections::BTreeMap<&'static str, u64>,
    pub batches_sent: u64,
    pub deltas_sent: u64,
    pub errors: u64,
    /// The same by kind (the `kind` label of `cellmesh_sidecar_errors_total`).
    pub errors_by_kind: std::collections::BTreeMap<&'static str, u64>,
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
    pub inputs_from_proxies: u64,
    pub inputs_from_peers: u64,
    /// Forwarded inputs a peer link never wrote.
    pub inputs_lost_in_links: u64,
    /// Forwarded inputs written to peer links that ended since (at most what they lost).
    pub inputs_on_ended_links: u64,
    /// Inputs applied after a refusal whose copies went to the target, and copies a target
    /// dropped behind a refusal: both count one input twice, so a ledger takes them back out.
    pub inputs_copies_applied: u64,
    pub inputs_copies_refused: u64,
    /// Entity commands handed to this node's game, and those sent on following their target
    /// through a handoff.
    pub commands_delivered: u64,
    pub commands_forwarded_on_handoff: u64,
    /// Results handed to this node's game: ok, and every other.
    pub command_results_ok: u64,
    pub command_results_failed: u64,
    /// Claims granted to this node's game, and refused because another entity held the key.
    pub claims_granted: u64,
    pub claims_refused: u64,
    /// Handoffs this node completed as the source.
    pub handoffs: u64,
    pub handoffs_refused: u64,
    pub in_doubt_now: u64,
    pub stale_epoch_drops: u64,
    pub held_frames: u64,
    /// Client inputs held now (for frozen entities, unseen epochs, or order after an adoption).
    pub inputs_held: u64,
    /// Writes of checkpoints to the geo's store, the checkpoints and bytes they carried.
    pub checkpoint_writes: u64,
    /// Player records read at login (a handover hint saves the read).
    pub login_record_reads: u64,
    pub checkpoints_stored: u64,
    pub checkpoint_stored_bytes: u64,
    /// Whether the node admits new sessions now, and how often it stopped (any reason).
    pub admission_open: bool,
    pub admission_closings: u64,
}

impl SidecarHandle {
    pub fn stats(&self) -> SidecarStats {
        let m = &self.metrics;
        SidecarStats {
            game_connected: m.game_connected.get() > 0,
            sessions: m.sessions.get().max(0) as u64,
            entities: m.entities.get().max(0) as u64,
            inputs_delivered: m.inputs_delivered.get(),
            inputs_handed_on: m.inputs_handed_on.get(),
            inputs_dropped: m.inputs_dropped_total(),
            inputs_dropped_by_reason: metrics::INPUT_DROP_REASONS
                .iter()
                .map(|r| (*r, m.inputs_dropped_for(r)))
                .filter(|(_, n)| *n > 0)
                .collect(),
            batches_sent: m.batches_sent.get(),
            deltas_sent: m.deltas_sent.get(),
            errors: m.errors_total(),
            errors_by_kind: m.errors_by_kind(),
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
            inputs_from_proxies: m.inputs_from_proxies.get(),
            inputs_from_peers: m.inputs_from_peers.get(),
            inputs_lost_in_links: m.inputs_lost_in_links.get(),
            inputs_on_ended_links: m.inputs_on_ended_links.get(),
            inputs_copies_applied: m.inputs_copies_applied.get(),
            inputs_copies_refused: m.inputs_copies_refused.get(),
            commands_delivered: m.commands_delivered.get(),
            commands_forwarded_on_handoff: m.command_forwarded_count("handoff"),
            command_results_ok: m.command_results_for("ok"),
            command_results_failed: ["refused", "entity_gone", "timeout", "not_delivered"]
                .iter()
                .map(|r| m.command_results_for(r))
                .sum(),
            claims_granted: m.claims_for("granted"),
            claims_refused: m.claims_for("held"),
            handoffs: m.handoffs_out.get(),
            handoffs_refused: m.handoffs_refused.get(),
            in_doubt_now: m.handoffs_in_doubt.get().max(0) as u64,
            stale_epoch_drops: m.stale_epoch_drops.get(),
            held_frames: m.held_frames.get().max(0) as u64,
            inputs_held: m.inputs_held.get().max(0) as u64,
            checkpoint_writes: m.checkpoint_writes.get(),
            login_record_reads: m.login_record_reads.get(),
            checkpoints_stored: m.checkpoints_stored.get(),
            checkpoint_stored_bytes: m.checkpoint_stored_bytes.get(),
            admission_open: m.admission_open.get() > 0,
            admission_closings: crate::model::admission::Reason::ALL
                .iter()
                .map(|r| {
                    m.admission_closings
                        .get_or_create(&metrics::ReasonLabel { reason: r.as_str() })
                        .get()
                })
                .sum(),
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

    /// Of the handoffs a new partition started from here (a bubble move's), how long nobody
    /// simulated the entity, from its last tick here to its first at the target (milliseconds).
    pub fn partition_gap_ms(&self) -> hdrhistogram::Histogram<u64> {
        self.metrics
            .gap_partition_ms
            .lock()
            .expect("gap histogram lock poisoned")
            .clone()
    }

    /// Per handoff this node completed as the source: game ticks in which nobody simulated the
    /// entity (see [`model::handoff::freeze_cost`]).
    pub fn ticks_missed(&self) -> hdrhistogram::Histogram<u64> {
        self.metrics
            .ticks_missed
            .lock()
            .expect("ticks missed histogram lock poisoned")
            .clone()
    }

    /// Per handoff this node completed as the source: the sidecars' own share of the freeze
    /// (milliseconds), the freeze less the time the two games took to answer.
    pub fn freeze_sidecars_ms(&self) -> hdrhistogram::Histogram<u64> {
        self.metrics
            .freeze_sidecars_ms
            .lock()
            .expect("freeze share histogram lock poisoned")
            .clone()
    }

    /// Every entity this node writes (its reals) with its epoch, as of the last published state
    /// (at most 100 ms old), for a census.
    pub fn reals(&self) -> Vec<Real> {
        self.census.lock().expect("census lock poisoned").clone()
    }

    /// The entities of dead processes whose restore this node decided and saw acked, since
    /// the last call.
    pub fn take_restored(&self) -> Vec<core::Restored> {
        std::mem::take(&mut *self.restored.lock().expect("restore log lock poisoned"))
    }

    /// Why the sidecar stopped by itself, when it could not go on (its node lease was lost):
    /// the process should exit with this error.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().expect("failure lock poisoned").clone()
    }

    /// Starts a graceful drain (what SIGTERM does): `/ready` goes false, handoffs are refused,
    /// what the partition gives to other nodes is handed to them, then the sidecar shuts down.
    pub fn drain(&self) {
        if let Some(inbox) = self.inbox.upgrade() {
            let _ = inbox.try_send(Event::Core(Input::Drain));
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
    io::launch(cfg, stores, partition, None, None, shutdown).await
}

/// Starts a sidecar as one node of a cluster: it serves the area the committed partition in
/// `topology` gives its node id, under that id's lease, and links to every other live node.
/// With `node_id_auto`, the node id is the one taken from the store ([`SidecarHandle::node_id`]);
/// an id the partition does not name holds no area and stays up as a spare.
pub async fn start_in(
    mut cfg: SidecarConfig,
    stores: Stores,
    topology: Arc<dyn TopologyStore>,
    shutdown: CancellationToken,
) -> anyhow::Result<SidecarHandle> {
    cfg.validate().context("invalid sidecar configuration")?;
    let (partition, lease, state) = io::membership::join(topology.as_ref(), &cfg).await?;
    // The id taken (the configured one, unless `node_id_auto`): everything runs as it.
    cfg.node_id = lease.lease.node;
    io::launch(
        cfg,
        stores,
        partition,
        Some((topology, lease)),
        state,
        shutdown,
    )
    .await
}
