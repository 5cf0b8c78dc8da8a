//! The node's own lot: its lease, the partition it serves under, and draining.
//!
//! This part keeps whether the lease is live, lapsed or lost and until when it holds, what a
//! lapse froze and the inputs it held for the game, the partition with the ones before it that
//! still count, and the drain. The freezes, thaws, offers and deliveries those come to, which
//! touch the game and the handoffs, the core carries out.

use std::collections::BTreeSet;
use std::sync::Arc;

use cellmesh_proto::local::{self, sidecar_message};
use cellmesh_world::geometry::ChunkRect;
use cellmesh_world::partition::Partition;
use cellmesh_world::world_map::{MapHandoff, NodeMap};

use super::context::Context;
use super::peers::Mesh;
use crate::config::{SidecarConfig, WhenRetired};
use crate::model::entities::EntityTable;
use crate::model::subs::{self};

/// An entity a node writes, as a census sees it: frozen ones are in a handoff and write nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Real {
    pub id: u64,
    pub epoch: u64,
    pub frozen: bool,
}

/// What this node may write, and under which partition.
pub(crate) struct Authority {
    partition: Arc<Partition>,
    /// The partitions before the last changes, and when the last change came (monotonic ms),
    /// while their owners may still write entities that the mass handoffs have not moved yet
    /// (views subscribe to them too). Two changes in quick succession keep both.
    prev_partitions: Vec<Arc<Partition>>,
    changed_at_ms: u64,
    /// The chunks this node owns.
    area: Vec<ChunkRect>,
    /// False while the node may not write: its lease lapsed (everything it owns is frozen until
    /// it takes the lease back) or was lost for good.
    lease_live: bool,
    /// The lease was lost for good (another grant replaced it): the process exits.
    lost: bool,
    /// Entities frozen because the lease lapsed: thawed when it is taken back.
    frozen_by_lapse: BTreeSet<u64>,
    /// Frozen by the lapse's own `Freeze`, whose `Snapshot` the game has not answered yet.
    lapse_freeze_unanswered: BTreeSet<u64>,
    /// Thawed by the lease's return before the game's answer to the lapse's Freeze came: that
    /// `Snapshot` is expected, and dropped.
    snapshot_owed: BTreeSet<u64>,
    /// Inputs for the game held while the lease is lapsed, in arrival order.
    held_inputs: Vec<local::Input>,
    /// When the lease last became writable (monotonic ms): a decider waits a while after its
    /// own lease came back before it takes a peer's lapse for a death.
    live_since_ms: u64,
    /// The node stops writing at this time (monotonic ms) unless a renewal lands first: the
    /// store's expiry passes no earlier, whatever the wall clocks say. None: no lease (alone).
    lease_until_ms: Option<u64>,
    /// While draining: the time (monotonic ms) the node exits at the latest.
    draining: Option<u64>,
}

/// What a renewal of the lease came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// The lease was lost already: lost is lost, the world may have moved on without this node.
    Ignored,
    /// Writing goes on until the renewal's terms (or stays stopped: it came too late).
    Extended,
    /// The lapsed lease is taken back, still under its epoch: what the lapse froze thaws.
    TakenBack,
}

/// A newer partition this node applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Applied {
    /// The partition retired this node's cell.
    pub retired: bool,
}

/// The previous partition is forgotten no sooner than this after a change.
const SETTLE_MIN_MS: u64 = 1_000;
/// Inputs held for the game while the lease is lapsed, at most; later ones are dropped
/// (counted as `lease_lapsed`).
const HELD_INPUTS_MAX: usize = 65_536;

impl Authority {
    /// Serving `partition`, writing until `lease_until_ms` (`None`: no lease, alone).
    pub fn new(
        cfg: &SidecarConfig,
        partition: Arc<Partition>,
        lease_until_ms: Option<u64>,
    ) -> Self {
        Self {
            area: subs::merge_rects(partition.area_of(cfg.node_id)),
            partition,
            prev_partitions: Vec::new(),
            changed_at_ms: 0,
            lease_live: true,
            lost: false,
            frozen_by_lapse: BTreeSet::new(),
            lapse_freeze_unanswered: BTreeSet::new(),
            snapshot_owed: BTreeSet::new(),
            held_inputs: Vec::new(),
            live_since_ms: 0,
            lease_until_ms,
            draining: None,
        }
    }

    // ------------------------------------------------------------------ what others read

    /// The partition this node serves under.
    pub(crate) fn partition(&self) -> &Arc<Partition> {
        &self.partition
    }

    /// The partitions before the last changes that still count (see [`Authority::settle`]).
    pub(crate) fn previous_partitions(&self) -> &[Arc<Partition>] {
        &self.prev_partitions
    }

    /// The chunks this node owns.
    pub(crate) fn area(&self) -> &[ChunkRect] {
        &self.area
    }

    /// Whether the node may write: its lease is neither lapsed nor lost.
    pub(crate) fn lease_live(&self) -> bool {
        self.lease_live
    }

    /// Whether the lease was lost for good.
    pub(crate) fn lost(&self) -> bool {
        self.lost
    }

    /// Whether the lease is lapsed (not lost): what would thaw stays frozen until it is back.
    pub(crate) fn lapsed(&self) -> bool {
        !self.lease_live && !self.lost
    }

    /// Whether the node is draining.
    pub(crate) fn draining(&self) -> bool {
        self.draining.is_some()
    }

    /// When the lease last became writable (monotonic ms).
    pub(crate) fn live_since_ms(&self) -> u64 {
        self.live_since_ms
    }

    /// When the node stops writing unless a renewal lands first, while it writes.
    pub(crate) fn deadline(&self) -> Option<u64> {
        self.lease_until_ms.filter(|_| self.lease_live)
    }

    /// Inputs held for the game while the lease is lapsed.
    pub(crate) fn held_inputs(&self) -> &[local::Input] {
        &self.held_inputs
    }

    /// Whether this process may still write at `mono_ms` of its own clock: its lease is neither
    /// lapsed, lost nor past its deadline.
    pub(crate) fn writes_at(&self, mono_ms: u64) -> bool {
        self.lease_live && self.lease_until_ms.is_none_or(|u| mono_ms < u)
    }

    // ------------------------------------------------------------------ the lease

    /// A renewal until `until_ms` landed: minting and writing go on until then. After a lapse
    /// it is the lease taken back if it is still ahead (nobody was granted the id meanwhile).
    pub(crate) fn on_lease_renewed(&mut self, cx: &Context, until_ms: u64) -> Renewal {
        if self.lost {
            return Renewal::Ignored;
        }
        let lapsed = !self.lease_live;
        self.lease_until_ms = Some(if lapsed {
            until_ms
        } else {
            self.lease_until_ms.map_or(until_ms, |u| u.max(until_ms))
        });
        if lapsed && cx.now.mono_ms < until_ms {
            Renewal::TakenBack
        } else {
            Renewal::Extended
        }
    }

    /// Whether no renewal landed before the lease's deadline: the node must stop writing now,
    /// before the store could grant the id to anyone else.
    pub(crate) fn deadline_passed(&self, cx: &Context) -> bool {
        self.lease_live && self.lease_until_ms.is_some_and(|u| cx.now.mono_ms >= u)
    }

    /// The lease lapsed: nothing is written until it is back. False if it was not live.
    pub(crate) fn lapse(&mut self, cx: &mut Context) -> bool {
        if !self.lease_live {
            return false;
        }
        cx.metrics.error("lease_lapsed");
        self.lease_live = false;
        cx.dirty = true;
        cx.set_ready(false);
        true
    }

    /// The lapse freezes every entity this node writes: those the game must be told to freeze,
    /// leaving out the ones frozen for a handoff (`in_handoff`: its offer stands) or already.
    pub(crate) fn freeze_owned(
        &mut self,
        table: &EntityTable,
        in_handoff: impl Fn(u64) -> bool,
    ) -> Vec<u64> {
        let owned = owned_reals(table);
        tracing::error!(
            entities = owned.len(),
            "no renewal of the node lease landed before its deadline: freezing everything this \
             node owns until the store answers"
        );
        owned
            .into_iter()
            .filter(|&id| {
                if in_handoff(id) || !self.frozen_by_lapse.insert(id) {
                    return false;
                }
                self.lapse_freeze_unanswered.insert(id);
                true
            })
            .collect()
    }

    /// `id` stays frozen, with the rest, until the lease is back.
    pub(crate) fn keep_frozen(&mut self, id: u64) {
        self.frozen_by_lapse.insert(id);
    }

    /// `id` was born while the lease is lapsed: frozen with the rest by a `Freeze` of its own,
    /// whose snapshot nobody needs.
    pub(crate) fn freeze_newborn(&mut self, id: u64) {
        self.frozen_by_lapse.insert(id);
        self.lapse_freeze_unanswered.insert(id);
    }

    /// The game's snapshot of `id` came while the lease is not live: nothing is offered.
    pub(crate) fn snapshot_while_not_live(&mut self, id: u64) {
        self.lapse_freeze_unanswered.remove(&id);
    }

    /// Whether the snapshot of `id` answers a lapse's `Freeze` the lease's return thawed
    /// already (it is dropped, unless the entity is frozen for a handoff since).
    pub(crate) fn take_owed_snapshot(&mut self, id: u64) -> bool {
        self.snapshot_owed.remove(&id)
    }

    /// The lease is back under its epoch: the lapse's freezes thaw and the node writes again.
    /// Returns the inputs held meanwhile, for the game, in order.
    pub(crate) fn resume(&mut self, cx: &mut Context, table: &EntityTable) -> Vec<local::Input> {
        self.lease_live = true;
        cx.dirty = true;
        self.live_since_ms = cx.now.mono_ms;
        let frozen = std::mem::take(&mut self.frozen_by_lapse);
        tracing::warn!(
            entities = frozen.len(),
            "the node lease is back: thawing what its lapse froze"
        );
        cx.metrics.leases_reclaimed.inc();
        self.snapshot_owed = std::mem::take(&mut self.lapse_freeze_unanswered);
        for id in frozen {
            if table.get_local(id).is_none() {
                continue;
            }
            cx.out.to_game.push(
                sidecar_message::Body::Thaw(local::Thaw {
                    entity_id: id,
                    reason: "the node lease is back".to_string(),
                })
                .into(),
            );
        }
        std::mem::take(&mut self.held_inputs)
    }

    /// An input for the game while the lease is lapsed: held until it is back.
    pub(crate) fn hold_input(&mut self, cx: &Context, i: local::Input) {
        if self.held_inputs.len() >= HELD_INPUTS_MAX {
            return cx.metrics.drop_input("lease_lapsed");
        }
        self.held_inputs.push(i);
    }

    /// Another grant replaced this node's lease: this process never writes again, and exits.
    /// Returns what the game must be told to freeze (nothing if it was lost already).
    pub(crate) fn on_lease_lost(&mut self, cx: &mut Context, table: &EntityTable) -> Vec<u64> {
        cx.metrics.error("lease_lost");
        cx.set_ready(false);
        if self.lost {
            return Vec::new();
        }
        self.lost = true;
        for _ in std::mem::take(&mut self.held_inputs) {
            cx.metrics.drop_input("lease_lost");
        }
        let was_live = std::mem::replace(&mut self.lease_live, false);
        let owned = owned_reals(table);
        tracing::error!(
            entities = owned.len(),
            "the node lease was lost: freezing everything this node owns, then exiting"
        );
        cx.out.exit = Some(
            "the node lease was lost: another process may hold this node id now; everything \
             this process wrote is frozen and restored elsewhere from its checkpoints"
                .into(),
        );
        // Those frozen by the lapse are frozen already.
        owned
            .into_iter()
            .filter(|id| was_live || !self.frozen_by_lapse.contains(id))
            .collect()
    }

    // ------------------------------------------------------------------ the partition

    /// A newer partition: this node's area follows it, and the one before it is kept until
    /// the change settles. `None` for one no newer than the current.
    pub(crate) fn apply_partition(&mut self, cx: &Context, p: Partition) -> Option<Applied> {
        if p.epoch() <= self.partition.epoch() {
            return None;
        }
        let me = cx.config.node_id;
        tracing::info!(epoch = p.epoch(), "applying a new partition");
        self.area = subs::merge_rects(p.area_of(me));
        // Retired: the director deleted this node's cell (it held nothing by then).
        let retired = !p.members().contains(&me) && self.partition.members().contains(&me);
        let prev = std::mem::replace(&mut self.partition, Arc::new(p));
        self.prev_partitions.push(prev);
        self.changed_at_ms = cx.now.mono_ms;
        Some(Applied { retired })
    }

    /// The entities this node writes standing where the partition gave the area to another
    /// node: each is handed over.
    pub(crate) fn given_away(&self, cx: &Context, table: &EntityTable) -> BTreeSet<u64> {
        let me = cx.config.node_id;
        table
            .iter()
            .filter(|e| e.origin().is_none() && self.partition.owner_of_chunk(e.chunk) != me)
            .map(|e| e.id)
            .collect()
    }

    /// This node's cell was retired: it stays up as a spare, or drains and exits.
    pub(crate) fn retired(&mut self, cx: &mut Context) {
        match cx.config.when_retired {
            WhenRetired::Spare => {
                tracing::info!("this node's cell was retired: staying up as a spare")
            }
            WhenRetired::Exit => {
                tracing::info!("this node's cell was retired: draining, then exiting");
                self.begin_drain(cx);
            }
        }
    }

    /// Forgets the previous partitions once every peer says it runs the current one, every
    /// ghost here is written by a node the current partition puts near it (the mass handoffs
    /// settled), and at least a second after the last change. Whether they were forgotten now.
    pub(crate) fn settle(&mut self, cx: &Context, table: &EntityTable, mesh: &Mesh) -> bool {
        if self.prev_partitions.is_empty() || cx.now.mono_ms < self.changed_at_ms + SETTLE_MIN_MS {
            return false;
        }
        let epoch = self.partition.epoch();
        let peers_caught_up = mesh.linked_peers_at(epoch);
        let reach = cx.config.reach_chunks();
        let settled = peers_caught_up
            && table.iter().all(|e| match e.origin() {
                None => true,
                Some(n) => subs::owners_near(&self.partition, e.chunk, reach).contains(&n),
            });
        if settled {
            self.prev_partitions.clear();
        }
        settled
    }

    // ------------------------------------------------------------------ draining

    /// SIGTERM: not ready, no more handoffs accepted. Entities keep being handed to whoever the
    /// partition gives their chunks (re-plan it to move this node's area away); the node exits
    /// once it writes nothing, or when the drain timeout passes.
    pub(crate) fn begin_drain(&mut self, cx: &mut Context) {
        if self.draining.is_some() {
            return;
        }
        tracing::info!(
            "draining: refusing handoffs; waiting for the partition to give this node's area away"
        );
        cx.set_ready(false);
        self.draining = Some(cx.now.mono_ms + cx.config.drain_timeout_ms);
    }

    /// Whether a drain is over: nothing left that another node could take (no real here and no
    /// handoff in flight, `in_flight`; a lone node or one without a game has nothing to hand),
    /// or out of time.
    pub(crate) fn drained(
        &self,
        cx: &Context,
        table: &EntityTable,
        game_connected: bool,
        mesh: &Mesh,
        in_flight: usize,
    ) -> bool {
        let Some(deadline) = self.draining else {
            return false;
        };
        let reals = table.len() - table.ghost_count();
        if !game_connected || !mesh.clustered() {
            return true;
        }
        if reals == 0 && in_flight == 0 {
            return true;
        }
        if cx.now.mono_ms >= deadline {
            tracing::warn!(left = reals, "drain timed out with entities still here");
            return true;
        }
        false
    }

    // ------------------------------------------------------------------ views

    /// This node's part of the live map: its reals (every k-th past `max`, by id) and its
    /// recent `handoffs`.
    pub(crate) fn node_map(
        &self,
        cx: &Context,
        table: &EntityTable,
        max: usize,
        handoffs: Vec<MapHandoff>,
    ) -> NodeMap {
        use cellmesh_world::world_map::{sample_evenly, EntityKind, MapEntity};
        let mut reals: Vec<MapEntity> = table
            .iter()
            .filter(|e| e.origin().is_none())
            .map(|e| MapEntity {
                id: e.id,
                x: e.position.x,
                y: e.position.y,
                kind: if e.is_master {
                    EntityKind::Avatar
                } else if e.owner_account.is_empty() {
                    EntityKind::Npc
                } else {
                    EntityKind::Owned
                },
                node: cx.config.node_id,
            })
            .collect();
        reals.sort_unstable_by_key(|e| e.id);
        NodeMap {
            node: cx.config.node_id,
            geo: cx.config.geo.clone(),
            partition_epoch: self.partition.epoch(),
            entities_total: reals.len() as u64,
            entities: sample_evenly(reals, max),
            handoffs,
        }
    }

    /// Every real of this node, for a census: frozen while `in_handoff` or the lease is not
    /// live.
    pub(crate) fn reals(&self, table: &EntityTable, in_handoff: impl Fn(u64) -> bool) -> Vec<Real> {
        let mut v: Vec<Real> = table
            .iter()
            .filter(|e| e.origin().is_none())
            .map(|e| Real {
                id: e.id,
                epoch: e.epoch,
                frozen: in_handoff(e.id) || !self.lease_live,
            })
            .collect();
        v.sort_unstable_by_key(|r| r.id);
        v
    }
}

/// Every entity this node writes.
fn owned_reals(table: &EntityTable) -> Vec<u64> {
    table
        .iter()
        .filter(|e| e.origin().is_none())
        .map(|e| e.id)
        .collect()
}
