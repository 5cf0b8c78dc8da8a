//! The node's own lot: its lease, the partition it serves under, and draining.

use std::collections::BTreeSet;
use std::sync::Arc;

use cellmesh_proto::local::{self, sidecar_message};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::geometry::ChunkRect;
use cellmesh_world::partition::Partition;
use cellmesh_world::world_map::NodeMap;

use super::*;
use crate::config::{SidecarConfig, WhenRetired};
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
    pub partition: Arc<Partition>,
    /// The partitions before the last changes, and when the last change came (monotonic ms),
    /// while their owners may still write entities that the mass handoffs have not moved yet
    /// (views subscribe to them too). Two changes in quick succession keep both.
    pub prev_partitions: Vec<Arc<Partition>>,
    pub changed_at_ms: u64,
    /// The chunks this node owns.
    pub area: Vec<ChunkRect>,
    /// False while the node may not write: its lease lapsed (everything it owns is frozen until
    /// it takes the lease back) or was lost for good.
    pub lease_live: bool,
    /// The lease was lost for good (another grant replaced it): the process exits.
    pub lost: bool,
    /// Entities frozen because the lease lapsed: thawed when it is taken back.
    pub frozen_by_lapse: BTreeSet<u64>,
    /// Frozen by the lapse's own `Freeze`, whose `Snapshot` the game has not answered yet.
    pub lapse_freeze_unanswered: BTreeSet<u64>,
    /// Thawed by the lease's return before the game's answer to the lapse's Freeze came: that
    /// `Snapshot` is expected, and dropped.
    pub snapshot_owed: BTreeSet<u64>,
    /// Inputs for the game held while the lease is lapsed, in arrival order.
    pub held_inputs: Vec<local::Input>,
    /// When the lease last became writable (monotonic ms): a decider waits a while after its
    /// own lease came back before it takes a peer's lapse for a death.
    pub live_since_ms: u64,
    /// The node stops writing at this time (monotonic ms) unless a renewal lands first: the
    /// store's expiry passes no earlier, whatever the wall clocks say. None: no lease (alone).
    pub lease_until_ms: Option<u64>,
    /// While draining: the time (monotonic ms) the node exits at the latest.
    pub draining: Option<u64>,
}

impl Authority {
    pub fn new(cfg: &SidecarConfig, partition: Arc<Partition>) -> Self {
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
            lease_until_ms: None,
            draining: None,
        }
    }
}

/// The previous partition is forgotten no sooner than this after a change.
const SETTLE_MIN_MS: u64 = 1_000;
/// Inputs held for the game while the lease is lapsed, at most; later ones are dropped
/// (counted as `lease_lapsed`).
const HELD_INPUTS_MAX: usize = 65_536;

impl Core {
    // ------------------------------------------------------------------ the node's own lot

    /// A renewal landed: minting and writing go on until its terms. After a lapse it is the
    /// lease taken back, still under its epoch (nobody was granted the id meanwhile): what the
    /// lapse froze thaws, and the inputs held meanwhile reach the game.
    pub(crate) fn on_lease_renewed(&mut self, terms: LeaseTerms) {
        if self.authority.lost {
            // Lost is lost: the world may already have moved on without this node.
            return;
        }
        let lapsed = !self.authority.lease_live;
        self.authority.lease_until_ms = Some(if lapsed {
            terms.until_ms
        } else {
            self.authority
                .lease_until_ms
                .map_or(terms.until_ms, |u| u.max(terms.until_ms))
        });
        // A lease of another node id would be a driver bug; minting then stays bounded.
        let _ = self.game.ids.renewed(&terms.lease);
        if lapsed
            && self
                .authority
                .lease_until_ms
                .is_some_and(|u| self.cx.now.mono_ms < u)
        {
            self.resume_after_lapse();
        }
    }

    /// No renewal landed before the lease's deadline: stop writing now, before the store could
    /// grant the id to anyone else.
    pub(crate) fn check_lease_deadline(&mut self) {
        if self.authority.lease_live
            && self
                .authority
                .lease_until_ms
                .is_some_and(|u| self.cx.now.mono_ms >= u)
        {
            self.on_lease_lapsed();
        }
    }

    /// Whether this process may still write at `mono_ms` of its own clock: its lease is neither
    /// lapsed, lost nor past its deadline. (The simulator checks it whenever the store grants
    /// this node's id to another process.)
    pub fn writes_at(&self, mono_ms: u64) -> bool {
        self.authority.lease_live && self.authority.lease_until_ms.is_none_or(|u| mono_ms < u)
    }

    /// The lease was lost for good: this process writes nothing ever again and should exit, so
    /// that its supervisor starts it afresh.
    pub fn lease_lost(&self) -> bool {
        self.authority.lost
    }

    /// The lease lapsed: the store did not answer in time (a MongoDB election, a paused or
    /// unreachable store). Everything this node owns is frozen and nothing is written, as if
    /// the lease were lost, but the process stays: the driver keeps asking for the lease under
    /// its epoch, and gets it back unless a restore fenced it meanwhile (then it is lost).
    pub(crate) fn on_lease_lapsed(&mut self) {
        if !self.authority.lease_live {
            return;
        }
        self.cx.metrics.error("lease_lapsed");
        self.authority.lease_live = false;
        self.cx.dirty = true;
        self.cx.set_ready(false);
        // Released this tick and not offered yet: frozen already (the game released them).
        let released = std::mem::take(&mut self.handoff.released);
        self.handoff.released_by.clear();
        for (root, r) in released {
            self.authority.frozen_by_lapse.insert(root);
            self.authority
                .frozen_by_lapse
                .extend(r.attachments.iter().map(|a| a.entity_id));
        }
        // Frozen for a handoff whose offer has not left: its snapshot would be offered under
        // a lease that may be gone, so the handoff is given up (the entities stay frozen, by
        // the lapse now, and are offered again once the lease is back). Offers that left stand.
        for (root, to, thawed) in self.handoff.outgoing.abandon_freezing(self.cx.now.mono_ms) {
            self.cx
                .metrics
                .handoff(self.cx.config.node_id, to, "abandoned");
            self.thaw(root, thawed, "the node lease lapsed before the snapshot");
        }
        let owned = self.owned_reals();
        tracing::error!(
            entities = owned.len(),
            "no renewal of the node lease landed before its deadline: freezing everything this \
             node owns until the store answers"
        );
        for id in owned {
            // Frozen for a handoff in doubt (its offer stands), or frozen already above.
            if self.handoff.outgoing.is_frozen(id) || !self.authority.frozen_by_lapse.insert(id) {
                continue;
            }
            self.authority.lapse_freeze_unanswered.insert(id);
            self.freeze_in_game(id);
        }
    }

    /// The lease is back under its epoch: the lapse's freezes thaw, the held inputs go to the
    /// game, and the node serves again.
    fn resume_after_lapse(&mut self) {
        self.authority.lease_live = true;
        self.cx.dirty = true;
        self.authority.live_since_ms = self.cx.now.mono_ms;
        let frozen = std::mem::take(&mut self.authority.frozen_by_lapse);
        tracing::warn!(
            entities = frozen.len(),
            "the node lease is back: thawing what its lapse froze"
        );
        self.cx.metrics.leases_reclaimed.inc();
        let unanswered = std::mem::take(&mut self.authority.lapse_freeze_unanswered);
        self.authority.snapshot_owed = unanswered;
        for id in frozen {
            if self.table.get_local(id).is_none() {
                continue;
            }
            self.cx.out.to_game.push(
                sidecar_message::Body::Thaw(local::Thaw {
                    entity_id: id,
                    reason: "the node lease is back".to_string(),
                })
                .into(),
            );
        }
        for i in std::mem::take(&mut self.authority.held_inputs) {
            self.deliver_input(i);
        }
        self.cx
            .set_ready(self.game.slot.is_some() && self.authority.draining.is_none());
    }

    /// Every entity this node writes.
    fn owned_reals(&self) -> Vec<u64> {
        self.table
            .iter()
            .filter(|e| e.origin.is_none())
            .map(|e| e.id)
            .collect()
    }

    /// Whether the lease is lapsed (not lost): what would thaw stays frozen until it is back.
    pub(crate) fn lease_lapsed(&self) -> bool {
        !self.authority.lease_live && !self.authority.lost
    }

    /// An input for the game while the lease is lapsed: held until it is back.
    pub(crate) fn hold_input_during_lapse(&mut self, i: local::Input) {
        if self.authority.held_inputs.len() >= HELD_INPUTS_MAX {
            return self.cx.metrics.drop_input("lease_lapsed");
        }
        self.authority.held_inputs.push(i);
    }

    /// Another grant replaced this node's lease (a new process, or a restore's fence): this
    /// process never writes again, and exits.
    pub(crate) fn on_lease_lost(&mut self) {
        self.cx.metrics.error("lease_lost");
        self.cx.set_ready(false);
        if self.authority.lost {
            return;
        }
        self.authority.lost = true;
        for _ in std::mem::take(&mut self.authority.held_inputs) {
            self.cx.metrics.drop_input("lease_lost");
        }
        let was_live = std::mem::replace(&mut self.authority.lease_live, false);
        let owned = self.owned_reals();
        tracing::error!(
            entities = owned.len(),
            "the node lease was lost: freezing everything this node owns, then exiting"
        );
        self.cx.out.exit = Some(
            "the node lease was lost: another process may hold this node id now; everything \
             this process wrote is frozen and restored elsewhere from its checkpoints"
                .into(),
        );
        for id in owned {
            // Frozen by the lapse already.
            if !was_live && self.authority.frozen_by_lapse.contains(&id) {
                continue;
            }
            self.freeze_in_game(id);
        }
    }

    /// A newer partition: the game learns its area, peers learn this node applied it, and every
    /// entity standing where the partition gave the area to another node is handed over.
    pub(crate) fn apply_partition(&mut self, p: Partition) {
        if p.epoch() <= self.authority.partition.epoch() {
            return;
        }
        let me = self.cx.config.node_id;
        tracing::info!(epoch = p.epoch(), "applying a new partition");
        self.authority.area = subs::merge_rects(p.area_of(me));
        self.replication.partition_changed(&self.cx.config, &p);
        // Retired: the director deleted this node's cell (it held nothing by then).
        let retired =
            !p.members().contains(&me) && self.authority.partition.members().contains(&me);
        let prev = std::mem::replace(&mut self.authority.partition, std::sync::Arc::new(p));
        self.authority.prev_partitions.push(prev);
        self.authority.changed_at_ms = self.cx.now.mono_ms;
        let owned_area = self.owned_rects();
        if self.game.slot.is_some() {
            self.cx.out.to_game.push(
                sidecar_message::Body::PartitionChanged(local::PartitionChanged {
                    partition_epoch: self.authority.partition.epoch(),
                    owned_area,
                })
                .into(),
            );
        }
        let ack = mesh_message::Body::PartitionAck(mesh::PartitionAck {
            partition_epoch: self.authority.partition.epoch(),
        });
        self.broadcast(ack);
        let gone: BTreeSet<u64> = self
            .table
            .iter()
            .filter(|e| {
                e.origin.is_none() && self.authority.partition.owner_of_chunk(e.chunk) != me
            })
            .map(|e| e.id)
            .collect();
        self.handoff.mass.extend(gone.iter().copied());
        self.handoff.recheck.extend(gone);
        self.spawners
            .replanned(&mut self.cx, &self.authority.partition);
        if retired {
            match self.cx.config.when_retired {
                WhenRetired::Spare => {
                    tracing::info!("this node's cell was retired: staying up as a spare")
                }
                WhenRetired::Exit => {
                    tracing::info!("this node's cell was retired: draining, then exiting");
                    self.begin_drain();
                }
            }
        }
    }

    /// SIGTERM: not ready, no more handoffs accepted. Entities keep being handed to whoever the
    /// partition gives their chunks (re-plan it to move this node's area away); the node exits
    /// once it writes nothing, or when the drain timeout passes.
    pub(crate) fn begin_drain(&mut self) {
        if self.authority.draining.is_some() {
            return;
        }
        tracing::info!(
            "draining: refusing handoffs; waiting for the partition to give this node's area away"
        );
        self.cx.set_ready(false);
        self.authority.draining = Some(self.cx.now.mono_ms + self.cx.config.drain_timeout_ms);
    }

    /// Whether a drain is over: nothing left that another node could take (no real here and no
    /// handoff in flight; a lone node or one without a game has nothing to hand), or out of time.
    pub(crate) fn drained(&self) -> bool {
        let Some(deadline) = self.authority.draining else {
            return false;
        };
        let reals = self.table.len() - self.table.ghost_count();
        if self.game.slot.is_none() || !self.mesh.clustered() {
            return true;
        }
        if reals == 0 && self.handoff.outgoing.in_flight() == 0 {
            return true;
        }
        if self.cx.now.mono_ms >= deadline {
            tracing::warn!(left = reals, "drain timed out with entities still here");
            return true;
        }
        false
    }

    /// Forgets the previous partitions once every peer says it runs the current one, every
    /// ghost here is written by a node the current partition puts near it (the mass handoffs
    /// settled), and at least a second after the last change.
    pub(crate) fn settle_partition(&mut self) {
        if self.authority.prev_partitions.is_empty()
            || self.cx.now.mono_ms < self.authority.changed_at_ms + SETTLE_MIN_MS
        {
            return;
        }
        let epoch = self.authority.partition.epoch();
        let peers_caught_up = self.mesh.linked_peers_at(epoch);
        let reach = self.cx.config.reach_chunks();
        let settled = peers_caught_up
            && self.table.iter().all(|e| match e.origin {
                None => true,
                Some(n) => {
                    subs::owners_near(&self.authority.partition, e.chunk, reach).contains(&n)
                }
            });
        if settled {
            self.authority.prev_partitions.clear();
            self.replication.partitions_settled();
        }
    }

    /// This node's part of the live map: its reals (every k-th past `max`, by id) and its
    /// handoffs of the last second.
    pub fn node_map(&mut self, max: usize) -> NodeMap {
        use cellmesh_world::world_map::{sample_evenly, EntityKind, MapEntity};
        let mut reals: Vec<MapEntity> = self
            .table
            .iter()
            .filter(|e| e.origin.is_none())
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
                node: self.cx.config.node_id,
            })
            .collect();
        reals.sort_unstable_by_key(|e| e.id);
        NodeMap {
            node: self.cx.config.node_id,
            geo: self.cx.config.geo.clone(),
            partition_epoch: self.authority.partition.epoch(),
            entities_total: reals.len() as u64,
            entities: sample_evenly(reals, max),
            handoffs: self.handoff.recent.shown(self.cx.now.mono_ms),
        }
    }

    /// Every real of this node, for a census.
    pub fn reals(&self) -> Vec<Real> {
        let mut v: Vec<Real> = self
            .table
            .iter()
            .filter(|e| e.origin.is_none())
            .map(|e| Real {
                id: e.id,
                epoch: e.epoch,
                frozen: self.handoff.outgoing.is_frozen(e.id) || !self.authority.lease_live,
            })
            .collect();
        v.sort_unstable_by_key(|r| r.id);
        v
    }
}
