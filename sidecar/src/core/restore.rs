//! Restoring a dead process's world on the live nodes (docs/mesh.md#membership-and-partition).
//!
//! Every owner writes the checkpoints it keeps to the store under its own incarnation (node id
//! and lease epoch). When an incarnation dies (its lease lapsed, or a new process holds its
//! id), every node stops taking anything from it, and the decider, the lowest live node of
//! the dead node's geo (whose store holds its checkpoints), runs one round for it:
//!
//! 1. if the dead node still owns cells and no new process holds its id, it commits a partition
//!    without it (the store's compare-and-set lets one such commit win);
//! 2. it asks every live peer what it writes or adopts, and which offers it made to the dead
//!    node (their snapshots may be newer than its checkpoints); a peer that answered takes
//!    nothing from the dead process any more;
//! 3. with every answer, the checkpoints, and every peer on its partition, it decides (see
//!    [`crate::model::restore`]) and offers each entity nobody writes to the owner of its
//!    position as a successor handoff under an epoch above every candidate's;
//! 4. each ack moves the entity's ghosts to its new owner and settles the offers made of it to
//!    the dead node; with every restore answered, `RestoreDone` lets the peers drop the dead
//!    process's ghosts that nobody took over.

use std::collections::{BTreeMap, BTreeSet};

use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::geometry::Pos;
use cellmesh_world::partition::NodeId;

use prost::Message;

use super::*;
use crate::model::restore::{self as model, Restoration};

/// A process of the cluster: its node id and the lease epoch it held.
pub type Incarnation = (NodeId, u64);

/// How often the changed checkpoints are written to the store.
pub(crate) const FLUSH_EVERY_MS: u64 = 250;
/// How long a game may take to answer a checkpoint request (a couple of ticks).
const ANSWER_MS: u64 = 100;

/// How often each entity's checkpoint is asked of the game, so that the one in the store is at
/// most `interval_ms` old: the interval less a flush and the game's answer (at most a quarter
/// of it).
pub(crate) fn checkpoint_ask_every_ms(interval_ms: u64) -> u64 {
    interval_ms - (FLUSH_EVERY_MS + ANSWER_MS).min(interval_ms / 4)
}
/// How often the decider lists the processes with checkpoints in the store (a dead one whose
/// death it did not see, as a new process, is found there).
const LIST_EVERY_MS: u64 = 2_000;
/// A restore offer with no answer is made again after this long.
const RESTORE_RETRY_MS: u64 = 1_000;
/// How long the decider keeps its words to a reporter, to send again when the link returns.
const RESOLUTION_KEPT_MS: u64 = 60_000;
/// The refusal of a restore offer by a node that writes the entity already.
pub(crate) const ALREADY_WRITES: &str = "the target writes the entity already";
/// The refusal of a restore offer under an epoch the target has seen already.
pub(crate) const STALE_RESTORE: &str = "the target saw this epoch of the entity already";
/// Reals listed per report message (a report can be long: it is sent in parts).
const HELD_PER_MESSAGE: usize = 4_096;

/// One round this node decides.
#[derive(Default)]
pub(crate) struct Round {
    /// Peers asked, over which link: asked again over a new link (the question may have gone
    /// to a process of theirs that died, or been lost with the link).
    asked: BTreeMap<NodeId, LinkId>,
    /// Peers whose report is complete, and what they said.
    reported: BTreeSet<NodeId>,
    /// entity -> (owner, epoch, the owner's lease epoch).
    held: BTreeMap<u64, (NodeId, u64, u64)>,
    offered: Vec<(NodeId, mesh::HandoffOffer, bool)>,
    checkpoints: Option<Vec<mesh::HandoffOffer>>,
    loading: bool,
    decided: bool,
}

/// An offer this node made.
#[derive(Debug, Clone)]
pub(crate) struct SentOffer {
    pub at_ms: u64,
    pub to: NodeId,
    /// The lease epoch of the target's process then (0: not known).
    pub to_lease: u64,
    pub offer: mesh::HandoffOffer,
}

/// A restore offer out from this node.
#[derive(Debug, Clone)]
pub(crate) struct Offering {
    dead: Incarnation,
    target: NodeId,
    offer: mesh::HandoffOffer,
    reporters: Vec<NodeId>,
    /// Made again (to the owner of its position then) from this time if not answered.
    retry_at_ms: u64,
}

/// Restores kept for the driver to publish between two publishes, at most.
const RESTORE_LOG_MAX: usize = 100_000;

/// One entity of a dead process restored on a live node, as its decider saw the ack.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Restored {
    pub entity_id: u64,
    pub dead_node: NodeId,
    pub dead_lease_epoch: u64,
    /// The node that writes it now.
    pub owner: NodeId,
    /// When the state it was restored from was taken, and when it was restored (wall-clock ms).
    pub state_unix_ms: u64,
    pub restored_unix_ms: u64,
}

#[derive(Default)]
pub(crate) struct Restore {
    /// This process's lease epoch (0: no lease, nothing is checkpointed to the store).
    pub incarnation: u64,
    /// The live peers and their lease epochs, as the store last said.
    pub live: BTreeMap<NodeId, u64>,
    /// Whether the store said yet: a process that has just started knows no peer, and must
    /// not take itself for the lowest live node.
    pub leases_heard: bool,
    /// Dead processes whose world is not restored yet, each with the ghosts of it held here
    /// when it died and their epochs then (they stay until a restored owner takes them over,
    /// under a newer epoch, or the round ends).
    pub dead: BTreeMap<Incarnation, BTreeMap<u64, u64>>,
    /// Every dead process this node heard of: nothing is taken from them.
    pub fenced: BTreeSet<Incarnation>,
    /// Every process the store said was alive while this one ran: only those can have written
    /// the ghosts held here (a process that started after its node id's previous one died holds
    /// ghosts of the new one only).
    pub known: BTreeSet<Incarnation>,
    /// Offers this node made, kept while in doubt and for a while after the ack: the target
    /// may die before it checkpoints what it adopted, and a round must know what moved between
    /// live nodes while it asked them. root -> the offer.
    pub sent: BTreeMap<u64, SentOffer>,
    /// In-doubt offers to a process that died: frozen until the decider settles them.
    pub in_doubt_to_dead: BTreeMap<u64, Incarnation>,
    pub rounds: BTreeMap<Incarnation, Round>,
    pub offering: BTreeMap<u64, Offering>,
    /// The partition epoch a re-plan was asked from (once per epoch).
    pub replan_from: Option<u64>,
    pub next_flush_ms: u64,
    /// Nodes whose process died with no new one holding their id: the partition gives them
    /// nothing while they stay so.
    pub departed: BTreeSet<NodeId>,
    /// When the decider next lists the processes with checkpoints, and whether it is listing.
    pub next_list_ms: u64,
    pub listing: bool,
    /// Processes with checkpoints and no lease in this node's view, since when (monotonic ms).
    pub suspects: BTreeMap<Incarnation, u64>,
    /// Restores this node decided and saw acked, since the driver last took them.
    pub log: Vec<Restored>,
    /// The decider's word sent to each reporter lately, with when: sent again whenever the
    /// link to that reporter comes back, since a word lost with a cut link would leave the
    /// reporter's unit frozen for good.
    pub resolved_for: BTreeMap<NodeId, Vec<(u64, mesh::RestoreResolved)>>,
    /// The geo of every node whose record this node read: a dead node's checkpoints are in its
    /// geo's store, so that geo's lowest live node restores it.
    pub geo_of: BTreeMap<NodeId, String>,
    /// Peers' leases lapsed in the store and not replaced by another grant, by the store's
    /// last word: their holders may take them back (see `TopologyStore::reclaim_lease`).
    pub lapsed: BTreeMap<NodeId, u64>,
    /// Incarnations whose lease lapsed, not replaced yet, since when (monotonic ms). Not dead
    /// yet: a store that stopped answering (an election, a pause) lapses every lease at once,
    /// and every holder takes its own back when it answers again. Their geo's decider fences
    /// those still lapsed after [`lapse_grace_ms`]; then they are dead. Meanwhile no round is
    /// decided: what they hold must be known first.
    pub lapsed_since: BTreeMap<Incarnation, u64>,
    /// Fences asked of the store, and when.
    pub fencing: BTreeMap<Incarnation, u64>,
}

/// How long a lapsed lease is left to be taken back before its geo's decider fences it: a
/// quarter of a lease, and at least two renewal rounds. The decider also waits this long after
/// its own lease came back, so that after a store outage everyone has had the time to take
/// theirs back.
pub(crate) fn lapse_grace_ms(lease_ms: u64) -> u64 {
    (lease_ms / 4).max(2 * cellmesh_stores::topology::renew_every_ms(lease_ms))
}

/// A fence with no answer is asked again after this long.
const FENCE_RETRY_MS: u64 = 1_000;

impl Restore {
    /// Whether `node`'s ghosts may belong to a dead process whose world is being restored.
    pub fn is_dead_node(&self, node: NodeId) -> bool {
        self.dead.keys().any(|(n, _)| *n == node)
    }

    /// Whether an offer in doubt towards `node` went to a process that died.
    pub fn in_doubt_to_dead_node(&self, node: NodeId) -> bool {
        self.in_doubt_to_dead.values().any(|(n, _)| *n == node)
    }

    fn dead_ghost(&self, id: u64, epoch: u64) -> bool {
        self.dead.values().any(|g| g.get(&id) == Some(&epoch))
    }
}

impl Core {
    // ------------------------------------------------------------------ every node

    /// The store's word on who is alive. A process whose lease another grant replaced (a new
    /// process holds its id, or a restore fenced it) is dead. One whose lease only lapsed may
    /// take it back: it is left alone until it does, or its geo's decider fences it.
    pub(crate) fn note_leases(&mut self, live: &[(NodeId, u64)], lapsed: &[(NodeId, u64)]) {
        self.restore.leases_heard = true;
        self.restore.known.extend(live.iter().copied());
        let mono = self.cx.now.mono_ms;
        let now: BTreeMap<NodeId, u64> = live.iter().copied().collect();
        let lapsed: BTreeMap<NodeId, u64> = lapsed.iter().copied().collect();
        let mut gone = Vec::new();
        for (&n, &e) in &self.restore.live {
            if now.get(&n) == Some(&e) {
                continue;
            }
            if lapsed.get(&n) == Some(&e) {
                tracing::warn!(
                    peer = n,
                    lease_epoch = e,
                    "a peer's lease lapsed: waiting for it to take it back"
                );
                self.restore.lapsed_since.entry((n, e)).or_insert(mono);
            } else {
                gone.push((n, e));
            }
        }
        // Back (live again under the same epoch), still lapsed, or replaced: dead.
        let mut back = Vec::new();
        self.restore.lapsed_since.retain(|&(n, e), _| {
            if now.get(&n) == Some(&e) {
                back.push(n);
                false
            } else if lapsed.get(&n) == Some(&e) {
                true
            } else {
                gone.push((n, e));
                false
            }
        });
        for n in back {
            tracing::info!(peer = n, "a peer took its lapsed lease back");
        }
        self.restore.live = now;
        self.restore.lapsed = lapsed;
        let back: Vec<NodeId> = self.restore.live.keys().copied().collect();
        for n in back {
            self.restore.departed.remove(&n);
        }
        for inc in gone {
            self.mark_dead(inc);
        }
    }

    /// The decider fences the lapsed leases of its geo that were not taken back in time: only
    /// then may their world be restored, since a fenced holder can never write again.
    fn fence_lapsed(&mut self) {
        let now = self.cx.now.mono_ms;
        let grace = lapse_grace_ms(self.cx.config.node_lease_ms);
        if now < self.authority.live_since_ms() + grace {
            return;
        }
        let due: Vec<Incarnation> = self
            .restore
            .lapsed_since
            .iter()
            .filter(|&(inc, &since)| {
                now >= since + grace
                    && self.decides_for(inc.0)
                    && self
                        .restore
                        .fencing
                        .get(inc)
                        .is_none_or(|&at| now >= at + FENCE_RETRY_MS)
            })
            .map(|(inc, _)| *inc)
            .collect();
        for (node, epoch) in due {
            self.restore.fencing.insert((node, epoch), now);
            self.cx.store(StoreRequest::FenceLease { node, epoch });
        }
    }

    /// The store's answer to a fence: a fenced (or replaced) lease's process is dead; one taken
    /// back is alive.
    pub(crate) fn on_lease_fenced(
        &mut self,
        node: NodeId,
        epoch: u64,
        result: Result<cellmesh_stores::topology::Fence, String>,
    ) {
        use cellmesh_stores::topology::Fence;
        let inc = (node, epoch);
        match result {
            Ok(Fence::Fenced | Fence::Moved) => {
                if result == Ok(Fence::Fenced) {
                    self.cx.metrics.leases_fenced.inc();
                    tracing::warn!(
                        peer = node,
                        lease_epoch = epoch,
                        "fenced a peer's lapsed lease: its world is restored from its checkpoints"
                    );
                }
                self.restore.fencing.remove(&inc);
                self.restore.lapsed_since.remove(&inc);
                if self.restore.lapsed.get(&node) == Some(&epoch) {
                    self.restore.lapsed.remove(&node);
                }
                self.mark_dead(inc);
            }
            Ok(Fence::Live) => {
                self.restore.fencing.remove(&inc);
            }
            Err(e) => {
                self.cx.metrics.error("store");
                tracing::warn!(peer = node, error = %e, "fencing a lapsed lease failed; retrying");
            }
        }
    }

    /// Nothing more is taken from `inc`: handoffs towards it that never left thaw, those in
    /// doubt wait for the decider, and its ghosts stay until its world is restored.
    pub(crate) fn mark_dead(&mut self, inc: Incarnation) {
        if !self.restore.fenced.insert(inc) {
            return;
        }
        let (node, lease_epoch) = inc;
        tracing::warn!(
            peer = node,
            lease_epoch,
            "a peer's process is dead: its world will be restored from its checkpoints"
        );
        self.cx.metrics.error("peer_dead");
        // The ghosts of its node id, unless this process never saw it alive: then they are a
        // newer process's, and stay when its world is restored.
        let ghosts: BTreeMap<u64, u64> = if self.restore.known.contains(&inc) {
            self.table
                .ghosts_of(node)
                .into_iter()
                .filter_map(|id| Some((id, self.table.get(id)?.epoch)))
                .collect()
        } else {
            BTreeMap::new()
        };
        self.restore.dead.insert(inc, ghosts);
        if !self.restore.live.contains_key(&node) {
            self.restore.departed.insert(node);
            if let Some(link) = self.mesh.peer_link(node) {
                self.close_link(link, "its process is dead");
            }
        }
        for (root, _, thawed) in self
            .handoff
            .outgoing
            .abandon_freezing_towards(node, self.cx.now.mono_ms)
        {
            self.cx
                .metrics
                .handoff(self.cx.config.node_id, node, "abandoned");
            self.thaw(root, thawed, "the target died before the offer left");
            self.handoff.retry.remove(&root);
        }
        for (root, to, _) in self.handoff.outgoing.in_doubt().collect::<Vec<_>>() {
            if to == node {
                self.restore.in_doubt_to_dead.insert(root, inc);
            }
        }
    }

    /// The decider asks what this node holds of the dead process's world.
    pub(crate) fn on_restore_query(&mut self, from: NodeId, q: mesh::RestoreQuery) {
        let inc = (q.node, q.lease_epoch);
        self.mark_dead(inc);
        let (held, offered, in_doubt) = self.report_of(inc);
        let mut parts: Vec<mesh::RestoreReport> = held
            .chunks(HELD_PER_MESSAGE)
            .map(|c| mesh::RestoreReport {
                node: q.node,
                lease_epoch: q.lease_epoch,
                held: c.to_vec(),
                ..Default::default()
            })
            .collect();
        parts.extend(offered.into_iter().map(|o| mesh::RestoreReport {
            node: q.node,
            lease_epoch: q.lease_epoch,
            offered: vec![o],
            ..Default::default()
        }));
        parts.push(mesh::RestoreReport {
            node: q.node,
            lease_epoch: q.lease_epoch,
            last: true,
            in_doubt,
            ..Default::default()
        });
        for p in parts {
            self.send_peer(from, mesh_message::Body::RestoreReport(p));
        }
    }

    /// Every real this node writes or adopts, every offer it made to `dead_node` that it still
    /// keeps, and which of those are in doubt (their units frozen here).
    fn report_of(
        &self,
        (dead_node, dead_lease): Incarnation,
    ) -> (Vec<mesh::RealHeld>, Vec<mesh::HandoffOffer>, Vec<u64>) {
        // A unit frozen in an offer to the dead node is a candidate, not a holding: the offer
        // may have been adopted there.
        let out = &self.handoff.outgoing;
        let mut held: Vec<mesh::RealHeld> = self
            .table
            .iter()
            .filter(|e| e.origin.is_none())
            .filter(|e| {
                out.target_of_member(e.id)
                    .is_none_or(|(to, _)| to != dead_node)
            })
            .map(|e| mesh::RealHeld {
                entity_id: e.id,
                entity_epoch: e.epoch,
                owner_node: 0,
                owner_lease: self.restore.incarnation,
            })
            .collect();
        for o in self.handoff.adopting.values() {
            held.push(mesh::RealHeld {
                entity_id: o.entity_id,
                entity_epoch: o.entity_epoch,
                owner_node: 0,
                owner_lease: self.restore.incarnation,
            });
            held.extend(o.attachments.iter().map(|a| mesh::RealHeld {
                entity_id: a.entity_id,
                entity_epoch: o.entity_epoch,
                owner_node: 0,
                owner_lease: self.restore.incarnation,
            }));
        }
        let to_dead =
            |s: &SentOffer| s.to == dead_node && (s.to_lease == dead_lease || s.to_lease == 0);
        // Handed to a live process lately: it writes them (or is adopting them) now, even if
        // its own report went before it adopted.
        let live = &self.restore.live;
        for s in self
            .restore
            .sent
            .values()
            .filter(|s| live.get(&s.to) == Some(&s.to_lease))
        {
            held.push(mesh::RealHeld {
                entity_id: s.offer.entity_id,
                entity_epoch: s.offer.entity_epoch,
                owner_node: s.to,
                owner_lease: s.to_lease,
            });
        }
        let offered: Vec<mesh::HandoffOffer> = self
            .restore
            .sent
            .values()
            .filter(|s| to_dead(s))
            .map(|s| s.offer.clone())
            .collect();
        let in_doubt = offered
            .iter()
            .map(|o| o.entity_id)
            .filter(|id| self.handoff.outgoing.target_of(*id).is_some())
            .collect();
        (held, offered, in_doubt)
    }

    /// The decider's word on an offer this node made to a dead process.
    pub(crate) fn on_restore_resolved(&mut self, r: mesh::RestoreResolved) {
        let id = r.entity_id;
        if r.owner_node == self.cx.config.node_id {
            // Back to this node, which still holds it frozen: the offer counts as refused.
            let Some((dead, _)) = self.restore.in_doubt_to_dead.remove(&id) else {
                // A repeat of a word acted on already.
                return;
            };
            self.restore.sent.remove(&id);
            let Some((to, offered)) = self.handoff.outgoing.target_of(id) else {
                return;
            };
            if let Ok(thawed) = self
                .handoff
                .outgoing
                .refused(id, offered, to, self.cx.now.mono_ms)
            {
                self.cx
                    .metrics
                    .handoff(self.cx.config.node_id, dead, "returned");
                self.thaw(
                    id,
                    thawed,
                    "its target died; this node owns its position now",
                );
            }
            return;
        }
        // Not an offer made since (a repeated word names an older epoch).
        if self
            .restore
            .sent
            .get(&id)
            .is_some_and(|s| s.offer.entity_epoch <= r.entity_epoch)
        {
            self.restore.sent.remove(&id);
        }
        if self.restore.in_doubt_to_dead.remove(&id).is_some() {
            match self.handoff.outgoing.resolve(
                id,
                r.owner_node,
                r.entity_epoch,
                self.cx.now.mono_ms,
            ) {
                Ok(done) => self.complete_handoff(done),
                Err(e) => tracing::debug!(entity = id, error = %e, "restore word on no offer"),
            }
        } else {
            self.handoff
                .outgoing
                .redirect_departed(id, r.owner_node, r.entity_epoch);
        }
    }

    /// The dead process's world is restored: its ghosts nobody took over are gone.
    pub(crate) fn on_restore_done(&mut self, d: mesh::RestoreDone) {
        let inc = (d.node, d.lease_epoch);
        self.restore.fenced.insert(inc);
        self.avatars_restored(inc);
        let Some(ghosts) = self.restore.dead.remove(&inc) else {
            return;
        };
        for (id, epoch) in ghosts {
            // Not taken over: still the dead process's, under the epoch it wrote (a new process
            // under the same node id that restored it writes a newer one).
            let still = self.table.get(id).is_some_and(|e| {
                e.origin == Some(d.node) && e.epoch == epoch && !self.restore.dead_ghost(id, epoch)
            });
            if still && !self.ghost_orphaned(id) {
                tracing::debug!(
                    me = self.cx.config.node_id,
                    entity = id,
                    "ghost of a dead process dropped: not restored"
                );
                self.replication.forget_stale(id);
                let _ = self.table.despawn(id);
                self.handoff.fence.forget(id);
            }
        }
    }

    /// Whether `id` is a ghost of a dead process waiting for its restore (not swept as stale).
    pub(crate) fn awaits_restore(&self, id: u64) -> bool {
        self.table
            .get(id)
            .is_some_and(|e| e.origin.is_some() && self.restore.dead_ghost(id, e.epoch))
    }

    // ------------------------------------------------------------------ checkpoints to the store

    /// Writes the checkpoints taken (and forgets those let go) since the last flush: every
    /// `FLUSH_EVERY_MS`, and at once for an entity the store has no checkpoint of yet (until it
    /// does, nothing could restore it).
    pub(crate) fn flush_checkpoints(&mut self) {
        let now = self.cx.now.mono_ms;
        if self.restore.incarnation == 0 || !self.mesh.clustered() {
            return;
        }
        if now < self.restore.next_flush_ms && !self.game.checkpoints.fresh() {
            return;
        }
        self.restore.next_flush_ms = now + FLUSH_EVERY_MS;
        let (taken, forgotten) = self.game.checkpoints.take_changes();
        let put: Vec<mesh::HandoffOffer> = taken
            .into_iter()
            .filter_map(|id| self.checkpoint_record(id))
            .collect();
        if put.is_empty() && forgotten.is_empty() {
            return;
        }
        let ids: Vec<u64> = put.iter().map(|c| c.entity_id).collect();
        self.game.checkpoints.written(&ids, &forgotten);
        self.cx.metrics.checkpoint_writes.inc();
        self.cx.metrics.checkpoints_stored.inc_by(put.len() as u64);
        self.cx
            .metrics
            .checkpoint_stored_bytes
            .inc_by(put.iter().map(|c| c.encoded_len() as u64).sum());
        self.cx
            .metrics
            .checkpoints_removed
            .inc_by(forgotten.len() as u64);
        self.cx.store(StoreRequest::PutCheckpoints {
            node: self.cx.config.node_id,
            lease_epoch: self.restore.incarnation,
            put,
            remove: forgotten,
        });
    }

    /// A checkpoint write the store refused: what it carried is written again at the next flush
    /// (what changed since goes with it), so the store never keeps less than it was sent.
    pub(crate) fn on_checkpoints_not_written(
        &mut self,
        lease_epoch: u64,
        put: Vec<u64>,
        remove: Vec<u64>,
    ) {
        if lease_epoch != self.restore.incarnation {
            return;
        }
        for id in put.into_iter().chain(remove) {
            self.game.checkpoints.unflushed(id);
        }
    }

    /// The checkpoint of `id` as the store keeps it: an offer a successor could adopt.
    fn checkpoint_record(&self, id: u64) -> Option<mesh::HandoffOffer> {
        let e = self.table.get_local(id)?;
        let kept = self.game.checkpoints.latest(id)?;
        let age = self.cx.now.mono_ms.saturating_sub(kept.at_ms);
        Some(mesh::HandoffOffer {
            successor: true,
            state_unix_ms: self.cx.now.unix_ms.saturating_sub(age),
            ..self.offer_of(e, kept.epoch, kept.state.clone())
        })
    }

    /// Forgets offers settled long enough ago that their targets have checkpointed them.
    pub(crate) fn prune_sent_offers(&mut self) {
        let now = self.cx.now.mono_ms;
        let keep_ms = self.cx.config.node_lease_ms * 2 + FLUSH_EVERY_MS * 4;
        let out = &self.handoff.outgoing;
        self.restore
            .sent
            .retain(|root, s| out.is_frozen(*root) || now < s.at_ms + keep_ms);
    }

    // ------------------------------------------------------------------ the decider

    /// Whether this node may decide restores at all: it writes, and knows who is alive.
    fn may_decide(&self) -> bool {
        self.authority.lease_live() && self.mesh.clustered() && self.restore.leases_heard
    }

    /// Whether this node decides the restore of `node`'s dead processes. Each geo keeps its
    /// checkpoints in its own store, so the lowest live node of the dead node's geo decides.
    /// A node of another geo none of whose nodes is live is decided by nobody: its checkpoints
    /// are in a store no live node reads, and a geo cut off from the rest (its leases lapse
    /// together) is whole again when the cut heals, if nobody fenced it meanwhile. Only a node
    /// whose geo is not known is decided by the lowest live node of all.
    fn decides_for(&self, node: NodeId) -> bool {
        let me = self.cx.config.node_id;
        let geo = |n: &NodeId| self.restore.geo_of.get(n).map(String::as_str);
        match geo(&node) {
            Some(g) => {
                g == self.cx.config.geo
                    && self
                        .restore
                        .live
                        .keys()
                        .all(|n| *n >= me || geo(n) != Some(g))
            }
            None => self.restore.live.keys().all(|n| *n >= me),
        }
    }

    /// Moves every round this node decides one step on.
    pub(crate) fn restore_step(&mut self) {
        if !self.may_decide() {
            return;
        }
        // First a partition that gives no cell to a dead node (whether its world is restored
        // yet or not: a later re-plan may have given it cells again); rounds wait for it.
        let me = self.cx.config.node_id;
        let gone: Vec<NodeId> = self
            .restore
            .departed
            .iter()
            .copied()
            .filter(|n| {
                *n != me && self.authority.partition().chunks_of(*n) > 0 && self.decides_for(*n)
            })
            .collect();
        if !gone.is_empty() {
            return self.ask_replan(&gone);
        }
        self.fence_lapsed();
        let now = self.cx.now.mono_ms;
        // This geo's store is listed by this geo's decider.
        if now >= self.restore.next_list_ms && !self.restore.listing && self.decides_for(me) {
            self.restore.next_list_ms = now + LIST_EVERY_MS;
            self.restore.listing = true;
            self.cx.store(StoreRequest::ListCheckpointed);
        }
        // Every dead process's round asks its questions; they are decided together, once
        // the restores of the last decision are all answered: a process restored by one round
        // and dead again by the next has its older checkpoints weighed against its newer ones.
        let pending: Vec<Incarnation> = self
            .restore
            .dead
            .keys()
            .copied()
            .filter(|(n, _)| self.decides_for(*n))
            .collect();
        let mut ready = true;
        for &inc in &pending {
            ready &= self.prepare_round(inc);
        }
        self.retry_restores();
        if !self.restore.offering.is_empty() {
            return;
        }
        let (decided, undecided): (Vec<Incarnation>, Vec<Incarnation>) = pending
            .into_iter()
            .filter(|inc| self.restore.rounds.contains_key(inc))
            .partition(|inc| self.restore.rounds[inc].decided);
        for inc in decided {
            self.finish_round(inc);
        }
        let epoch = self.authority.partition().epoch();
        let on_partition = self
            .restore
            .live
            .keys()
            .filter(|n| **n != me)
            .all(|n| self.mesh.peer_partition(*n) >= epoch);
        // A lapsed peer may hold what the dead left: decided once it is back or fenced.
        let limbo = !self.restore.lapsed_since.is_empty();
        if ready && on_partition && !limbo && !undecided.is_empty() {
            self.decide_rounds(&undecided);
        }
    }

    /// The processes with checkpoints in the store: one that is surely dead and was not seen
    /// to die (this process started after it, or it died while another decided) gets a round.
    /// Surely dead: a newer process holds its node id (this one included), its node was seen to
    /// die with nobody holding the id since, or it held no lease in this node's view for two
    /// listings in a row (a process that just started is in the view within one membership
    /// read, well inside that).
    pub(crate) fn on_checkpointed(&mut self, result: Result<Vec<(NodeId, u64)>, String>) {
        self.restore.listing = false;
        let all = match result {
            Ok(all) => all,
            Err(e) => {
                self.cx.metrics.error("store");
                return tracing::warn!(error = %e, "listing checkpointed processes failed");
            }
        };
        let me = (self.cx.config.node_id, self.restore.incarnation);
        let now = self.cx.now.mono_ms;
        let unleased: BTreeSet<Incarnation> = all
            .iter()
            .copied()
            .filter(|&(n, l)| (n, l) != me && self.restore.live.get(&n) != Some(&l))
            .collect();
        self.restore
            .suspects
            .retain(|inc, _| unleased.contains(inc));
        for (node, lease_epoch) in all {
            let inc = (node, lease_epoch);
            // A store shared by geos lists processes of another geo: theirs to restore.
            if node != me.0 && !self.decides_for(node) {
                continue;
            }
            // Lapsed, not replaced: its holder may take it back. Dead once fenced.
            if node != me.0 && self.restore.lapsed.get(&node) == Some(&lease_epoch) {
                self.restore.lapsed_since.entry(inc).or_insert(now);
                continue;
            }
            if self.restore.fenced.contains(&inc) && !self.restore.dead.contains_key(&inc) {
                // Restored already (here or by another decider): the listing predates the
                // drop of its checkpoints, or the drop failed. A second round would take the
                // ghosts of a new process under the same id for the dead one's.
                self.cx
                    .store(StoreRequest::DropCheckpoints { node, lease_epoch });
                continue;
            }
            let long_unleased = unleased.contains(&(node, lease_epoch))
                && *self
                    .restore
                    .suspects
                    .entry((node, lease_epoch))
                    .or_insert(now)
                    + LIST_EVERY_MS
                    <= now;
            let newer = if node == me.0 {
                lease_epoch < me.1
            } else {
                self.restore
                    .live
                    .get(&node)
                    .is_some_and(|live| lease_epoch < *live)
            };
            let gone = !self.restore.live.contains_key(&node)
                && node != me.0
                && self.restore.departed.contains(&node);
            if (newer || gone || long_unleased)
                && !self.restore.dead.contains_key(&(node, lease_epoch))
            {
                self.restore.fenced.remove(&(node, lease_epoch));
                self.mark_dead((node, lease_epoch));
            }
        }
    }

    /// Asks what a round still needs; whether it has it all (or was decided already).
    fn prepare_round(&mut self, inc: Incarnation) -> bool {
        let (node, lease_epoch) = inc;
        let me = self.cx.config.node_id;
        let peers: Vec<NodeId> = self
            .restore
            .live
            .keys()
            .copied()
            .filter(|n| *n != me)
            .collect();
        let linked: BTreeMap<NodeId, LinkId> = self.mesh.peer_links();
        let round = self.restore.rounds.entry(inc).or_default();
        round
            .asked
            .retain(|n, l| linked.get(n) == Some(l) || round.reported.contains(n));
        let ask: Vec<NodeId> = peers
            .iter()
            .copied()
            .filter(|n| linked.contains_key(n) && !round.asked.contains_key(n))
            .collect();
        round.asked.extend(ask.iter().map(|n| (*n, linked[n])));
        let load = round.checkpoints.is_none() && !round.loading && !round.decided;
        round.loading |= load;
        let decided = round.decided;
        let ready = peers.iter().all(|n| round.reported.contains(n)) && round.checkpoints.is_some();
        for n in ask {
            self.send_peer(
                n,
                mesh_message::Body::RestoreQuery(mesh::RestoreQuery { node, lease_epoch }),
            );
        }
        if load {
            self.cx
                .store(StoreRequest::LoadCheckpoints { node, lease_epoch });
        }
        decided || ready
    }

    /// Commits the partition without the `dead` (once per partition epoch; a losing commit
    /// learns the winner's partition like any other).
    fn ask_replan(&mut self, dead: &[NodeId]) {
        let from = self.authority.partition().epoch();
        if self.restore.replan_from == Some(from) {
            return;
        }
        let mut live: Vec<NodeId> = self.restore.live.keys().copied().collect();
        live.push(self.cx.config.node_id);
        match self.authority.partition().without(dead, &live) {
            Ok(Some(p)) => {
                tracing::warn!(
                    ?dead,
                    epoch = p.epoch(),
                    "committing a partition without dead nodes"
                );
                self.restore.replan_from = Some(from);
                self.cx.store(StoreRequest::CommitPartition {
                    partition: Box::new(p),
                });
            }
            Ok(None) => {}
            Err(e) => tracing::error!(?dead, error = %e, "no partition without the dead nodes"),
        }
    }

    pub(crate) fn on_partition_committed(&mut self, epoch: u64, result: Result<(), String>) {
        if let Err(e) = result {
            // Another commit won (its partition arrives as any other), or the store failed:
            // asked again at the next step.
            tracing::info!(epoch, error = %e, "re-plan without a dead node not committed");
            if self.restore.replan_from == Some(epoch.saturating_sub(1)) {
                self.restore.replan_from = None;
            }
        }
    }

    pub(crate) fn on_restore_report(&mut self, from: NodeId, r: mesh::RestoreReport) {
        let Some(round) = self.restore.rounds.get_mut(&(r.node, r.lease_epoch)) else {
            return;
        };
        if round.reported.contains(&from) || round.decided {
            return;
        }
        for h in r.held {
            let owner = if h.owner_node == 0 {
                from
            } else {
                h.owner_node
            };
            hold(
                &mut round.held,
                h.entity_id,
                (owner, h.entity_epoch, h.owner_lease),
            );
        }
        round
            .offered
            .extend(r.offered.into_iter().map(|o| (from, o, false)));
        if r.last {
            // The last part says which of this reporter's offers are still in doubt.
            for (n, o, in_doubt) in round.offered.iter_mut() {
                if *n == from && r.in_doubt.contains(&o.entity_id) {
                    *in_doubt = true;
                }
            }
            round.reported.insert(from);
        }
    }

    pub(crate) fn on_checkpoints_loaded(
        &mut self,
        node: NodeId,
        lease_epoch: u64,
        result: Result<Vec<mesh::HandoffOffer>, String>,
    ) {
        let Some(round) = self.restore.rounds.get_mut(&(node, lease_epoch)) else {
            return;
        };
        round.loading = false;
        match result {
            Ok(c) => round.checkpoints = Some(c),
            Err(e) => {
                self.cx.metrics.error("store");
                tracing::warn!(node, error = %e, "loading a dead node's checkpoints failed; retrying");
            }
        }
    }

    /// Decides the rounds of `incs` together: one entity, one restore, from the newest of what
    /// every dead process left and every offer made to them.
    fn decide_rounds(&mut self, incs: &[Incarnation]) {
        let me = self.cx.config.node_id;
        let mut held = BTreeMap::new();
        let mut offered = Vec::new();
        let mut checkpoints = Vec::new();
        for &inc in incs {
            let (own_held, own_offered, own_in_doubt) = self.report_of(inc);
            // Internal: a timer step; the caller kept only incarnations with a round.
            let round = self.restore.rounds.get_mut(&inc).expect("prepared above");
            round.decided = true;
            for (id, h) in std::mem::take(&mut round.held) {
                hold(&mut held, id, h);
            }
            for h in own_held {
                let owner = if h.owner_node == 0 { me } else { h.owner_node };
                hold(
                    &mut held,
                    h.entity_id,
                    (owner, h.entity_epoch, h.owner_lease),
                );
            }
            offered.extend(std::mem::take(&mut round.offered));
            offered.extend(own_offered.into_iter().map(|o| {
                let in_doubt = own_in_doubt.contains(&o.entity_id);
                (me, o, in_doubt)
            }));
            checkpoints.extend(round.checkpoints.take().unwrap_or_default());
        }
        let inc = incs[0];
        let partition = self.authority.partition().clone();
        let mut live: BTreeSet<NodeId> = self.restore.live.keys().copied().collect();
        live.insert(me);
        // Only a live process holds anything: not one that died since it was reported (a node
        // id a new process holds now included).
        let incarnation = self.restore.incarnation;
        let leases = &self.restore.live;
        let held: BTreeMap<u64, (NodeId, u64)> = held
            .into_iter()
            .filter(|(_, (owner, _, lease))| {
                if *owner == me {
                    *lease == incarnation
                } else {
                    leases.get(owner) == Some(lease)
                }
            })
            .map(|(id, (owner, epoch, _))| (id, (owner, epoch)))
            .collect();
        let d = model::decide(&checkpoints, &held, &offered, |o| {
            let p = o.position.as_ref()?;
            let owner = partition.owner_of(Pos { x: p.x, y: p.y }).ok()?;
            live.contains(&owner).then_some(owner)
        });
        tracing::info!(
            me = self.cx.config.node_id,
            dead = ?incs,
            checkpoints = checkpoints.len(),
            restores = d.restore.len(),
            settled = d.settled.len(),
            homeless = d.homeless.len(),
            "restoring a dead process's world"
        );
        for (reporter, id, epoch, owner) in d.settled {
            self.resolve_for(reporter, id, epoch, owner);
        }
        for (reporter, id) in d.returned {
            self.resolve_for(reporter, id, 0, reporter);
        }
        for r in d.restore {
            self.offer_restore(inc, r);
        }
        for r in d.homeless {
            // Offered once a live node owns the position (see `retry_restores`).
            self.restore.offering.insert(
                r.offer.entity_id,
                Offering {
                    dead: inc,
                    target: 0,
                    offer: r.offer,
                    reporters: r.reporters,
                    retry_at_ms: self.cx.now.mono_ms,
                },
            );
        }
    }

    fn offer_restore(&mut self, dead: Incarnation, r: Restoration) {
        let Restoration {
            target,
            mut offer,
            reporters,
        } = r;
        offer.partition_epoch = self.authority.partition().epoch();
        let id = offer.entity_id;
        self.restore.offering.insert(
            id,
            Offering {
                dead,
                target,
                offer: offer.clone(),
                reporters,
                retry_at_ms: self.cx.now.mono_ms + RESTORE_RETRY_MS,
            },
        );
        if target == self.cx.config.node_id {
            self.on_handoff_offer(target, offer);
        } else {
            self.send_peer(target, mesh_message::Body::HandoffOffer(offer));
        }
    }

    /// Restore offers with no answer, or refused, are made again to whoever owns the position
    /// now, above the epoch they were refused under.
    fn retry_restores(&mut self) {
        let now = self.cx.now.mono_ms;
        let due: Vec<u64> = self
            .restore
            .offering
            .iter()
            .filter(|(_, o)| now >= o.retry_at_ms)
            .map(|(id, _)| *id)
            .collect();
        let me = self.cx.config.node_id;
        for id in due {
            let Some(mut o) = self.restore.offering.remove(&id) else {
                continue;
            };
            let owner = o
                .offer
                .position
                .as_ref()
                .and_then(|p| {
                    self.authority
                        .partition()
                        .owner_of(Pos { x: p.x, y: p.y })
                        .ok()
                })
                .filter(|n| *n == me || self.restore.live.contains_key(n));
            let Some(owner) = owner else {
                // Nobody owns its position yet: asked again later.
                o.retry_at_ms = now + RESTORE_RETRY_MS;
                self.restore.offering.insert(id, o);
                continue;
            };
            if owner != o.target && o.target != 0 {
                o.offer.entity_epoch += 1;
            }
            let r = Restoration {
                target: owner,
                offer: o.offer,
                reporters: o.reporters,
            };
            self.offer_restore(o.dead, r);
        }
    }

    /// A target's answer to a restore offer; false when it answers no restore of this node.
    pub(crate) fn on_restore_answer(
        &mut self,
        from: NodeId,
        id: u64,
        epoch: u64,
        refused: Option<&str>,
    ) -> bool {
        let Some(o) = self.restore.offering.get(&id) else {
            return false;
        };
        if o.target != from || o.offer.entity_epoch != epoch {
            return false;
        }
        // Internal: looked up just above, nothing removed it since.
        let o = self.restore.offering.remove(&id).expect("checked above");
        if refused == Some(ALREADY_WRITES) {
            // A live node writes it after all (it moved between live nodes while the round
            // asked them): nothing to restore; offers made of it to the dead node settle there.
            for &r in &o.reporters {
                self.resolve_for(r, id, epoch, from);
            }
            return true;
        }
        if let Some(reason) = refused {
            tracing::debug!(entity = id, target = from, %reason, "restore refused; trying again");
            self.restore.offering.insert(
                id,
                Offering {
                    offer: mesh::HandoffOffer {
                        entity_epoch: epoch + 1,
                        ..o.offer
                    },
                    retry_at_ms: self.cx.now.mono_ms + RESTORE_RETRY_MS / 4,
                    ..o
                },
            );
            return true;
        }
        self.cx.metrics.handoff(o.dead.0, from, "restored");
        let me = self.cx.config.node_id;
        let mut members = vec![id];
        members.extend(o.offer.attachments.iter().map(|a| a.entity_id));
        for &m in &members {
            if self.restore.log.len() < RESTORE_LOG_MAX {
                self.restore.log.push(Restored {
                    entity_id: m,
                    dead_node: o.dead.0,
                    dead_lease_epoch: o.dead.1,
                    owner: from,
                    state_unix_ms: o.offer.state_unix_ms,
                    restored_unix_ms: self.cx.now.unix_ms,
                });
            }
        }
        for m in members {
            for &r in &o.reporters {
                self.resolve_for(r, m, epoch, from);
            }
            let moved = mesh::EntityMoved {
                entity_id: m,
                entity_epoch: epoch,
                owner_node: from,
                holders: vec![],
            };
            for n in self.up_peers() {
                if n != from {
                    self.send_peer(n, mesh_message::Body::EntityMoved(moved.clone()));
                }
            }
            if from != me {
                self.on_entity_moved(o.dead.0, moved);
            }
        }
        true
    }

    fn resolve_for(&mut self, reporter: NodeId, id: u64, epoch: u64, owner: NodeId) {
        let r = mesh::RestoreResolved {
            entity_id: id,
            entity_epoch: epoch,
            owner_node: owner,
        };
        if reporter == self.cx.config.node_id {
            self.on_restore_resolved(r);
        } else {
            self.restore
                .resolved_for
                .entry(reporter)
                .or_default()
                .push((self.cx.now.mono_ms, r));
            self.send_peer(reporter, mesh_message::Body::RestoreResolved(r));
        }
    }

    /// The link to `node` is back: the decider's recent words to it go again (a repeat
    /// settles nothing twice: the reporter acts on the first and forgets the unit).
    pub(crate) fn resend_resolutions(&mut self, node: NodeId) {
        let now = self.cx.now.mono_ms;
        self.restore.resolved_for.retain(|_, v| {
            v.retain(|(at, _)| now.saturating_sub(*at) < RESOLUTION_KEPT_MS);
            !v.is_empty()
        });
        let again: Vec<mesh::RestoreResolved> = self
            .restore
            .resolved_for
            .get(&node)
            .map(|v| v.iter().map(|(_, r)| *r).collect())
            .unwrap_or_default();
        for r in again {
            self.send_peer(node, mesh_message::Body::RestoreResolved(r));
        }
    }

    fn finish_round(&mut self, inc: Incarnation) {
        let (node, lease_epoch) = inc;
        self.restore.rounds.remove(&inc);
        let done = mesh::RestoreDone { node, lease_epoch };
        self.broadcast(mesh_message::Body::RestoreDone(done));
        self.on_restore_done(done);
        self.cx
            .store(StoreRequest::DropCheckpoints { node, lease_epoch });
    }
}

/// Notes that `(owner, epoch, owner's lease)` writes `id`, unless a newer epoch is known.
fn hold(held: &mut BTreeMap<u64, (NodeId, u64, u64)>, id: u64, h: (NodeId, u64, u64)) {
    match held.get(&id) {
        Some((_, e, _)) if *e >= h.1 => {}
        _ => {
            held.insert(id, h);
        }
    }
}
