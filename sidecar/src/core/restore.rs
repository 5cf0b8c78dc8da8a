//! Restoring a dead process's world on the live nodes (docs/mesh.md#membership-and-partition).
//!
//! Every owner writes the checkpoints it keeps to the store under its own incarnation (node id
//! and lease epoch). When an incarnation dies (its lease lapsed, or a new process holds its
//! id), every node stops taking anything from it, and the decider runs one round for it: the
//! lowest live node of the core geo, which reads other geos' checkpoints from the copies they
//! write to its store, or, with no core geo live, the lowest live node of the dead node's geo
//! (whose store holds its checkpoints):
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
//!    process's ghosts that nobody took over, and the process is marked restored in the
//!    topology store for good (its checkpoints found anywhere later are only dropped).
//!
//! This part keeps who is alive and who died, the offers this node made, the rounds it decides
//! and the restore offers out. What a death or a decision comes to for the handoffs, the links
//! and the ghosts, the core carries out, in the order the part gives it ([`Act`]).

use std::collections::{BTreeMap, BTreeSet};

use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::geometry::Pos;
use cellmesh_world::partition::{NodeId, Partition};
use prost::Message;
use rustc_hash::FxHashMap as HashMap;

use super::authority::Authority;
use super::context::Context;
use super::handoff::Routed;
use super::peers::Mesh;
use super::{LinkId, StoreRequest};
use crate::model::entities::EntityTable;
use crate::model::handoff::HandoffSource;
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
/// The refusal of a restore offer of a player's avatar by a node whose account has a newer
/// avatar: of two avatars the older goes, so there is nothing to restore.
pub(crate) const SUPERSEDED: &str = "the player has a newer avatar";
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
    incarnation: u64,
    /// The live peers and their lease epochs, as the store last said.
    live: BTreeMap<NodeId, u64>,
    /// Whether the store said yet: a process that has just started knows no peer, and must
    /// not take itself for the lowest live node.
    leases_heard: bool,
    /// Dead processes whose world is not restored yet, each with the ghosts of it held here
    /// when it died and their epochs then (they stay until a restored owner takes them over,
    /// under a newer epoch, or the round ends).
    dead: BTreeMap<Incarnation, BTreeMap<u64, u64>>,
    /// Every dead process this node heard of: nothing is taken from them.
    fenced: BTreeSet<Incarnation>,
    /// Every process the store said was alive while this one ran: only those can have written
    /// the ghosts held here (a process that started after its node id's previous one died holds
    /// ghosts of the new one only).
    known: BTreeSet<Incarnation>,
    /// Offers this node made, kept while in doubt and for a while after the ack: the target
    /// may die before it checkpoints what it adopted, and a round must know what moved between
    /// live nodes while it asked them. root -> the offer.
    sent: BTreeMap<u64, SentOffer>,
    /// In-doubt offers to a process that died: frozen until the decider settles them.
    in_doubt_to_dead: BTreeMap<u64, Incarnation>,
    rounds: BTreeMap<Incarnation, Round>,
    offering: BTreeMap<u64, Offering>,
    /// The partition epoch a re-plan was asked from (once per epoch).
    replan_from: Option<u64>,
    next_flush_ms: u64,
    /// Nodes whose process died with no new one holding their id: the partition gives them
    /// nothing while they stay so.
    departed: BTreeSet<NodeId>,
    /// When the decider next lists the processes with checkpoints, and how many listings (of
    /// its store, and, at the core's decider, of every other geo's copy) are under way.
    next_list_ms: u64,
    listing: usize,
    /// Processes with checkpoints and no lease in this node's view, since when (monotonic ms).
    suspects: BTreeMap<Incarnation, u64>,
    /// Restores this node decided and saw acked, since the driver last took them.
    log: Vec<Restored>,
    /// The decider's word sent to each reporter lately, with when: sent again whenever the
    /// link to that reporter comes back, since a word lost with a cut link would leave the
    /// reporter's unit frozen for good.
    resolved_for: BTreeMap<NodeId, Vec<(u64, mesh::RestoreResolved)>>,
    /// The geo of every node whose record this node read: a dead node's checkpoints are in its
    /// geo's store (and in the core's copy of it), which says who restores it and from where.
    geo_of: BTreeMap<NodeId, String>,
    /// Peers' leases lapsed in the store and not replaced by another grant, by the store's
    /// last word: their holders may take them back (see `TopologyStore::reclaim_lease`).
    lapsed: BTreeMap<NodeId, u64>,
    /// Incarnations whose lease lapsed, not replaced yet, since when (monotonic ms). Not dead
    /// yet: a store that stopped answering (an election, a pause) lapses every lease at once,
    /// and every holder takes its own back when it answers again. Their geo's decider fences
    /// those still lapsed after [`lapse_grace_ms`]; then they are dead. Meanwhile no round is
    /// decided: what they hold must be known first.
    lapsed_since: BTreeMap<Incarnation, u64>,
    /// Fences asked of the store, and when.
    fencing: BTreeMap<Incarnation, u64>,
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

/// What a death or a decision of this part comes to, for the core to carry out in this order.
#[derive(Debug)]
pub(crate) enum Act {
    /// A message to a peer.
    Send(NodeId, mesh_message::Body),
    /// A store call.
    Store(StoreRequest),
    /// A process this node now takes for dead: nothing more is taken from it.
    Died(Dead),
    /// A restore offer whose target is this node.
    OfferHere(mesh::HandoffOffer),
    /// The decider's word on an offer this node made to a dead process.
    ResolvedHere(mesh::RestoreResolved),
    /// An entity of the dead node `from` restored on a peer: its ghost here follows it.
    MovedHere(NodeId, mesh::EntityMoved),
}

/// A process this node has just taken for dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dead {
    pub inc: Incarnation,
    /// No process holds its node id now: its link goes.
    pub departed: bool,
}

/// What the decider's word on an offer this node made to a dead process means for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// A repeat of a word acted on already.
    Repeat,
    /// Back to this node, which still holds it frozen: the offer counts as refused by `dead`.
    Returned { dead: NodeId },
    /// The offer in doubt is settled: the word's owner writes the entity.
    Settle,
    /// Not in doubt here: a departed entity's owner is the word's.
    Redirect,
}

/// What this node writes or adopts, read for its own report of a dead process's world.
pub(crate) struct Holdings<'a> {
    pub table: &'a EntityTable,
    pub outgoing: &'a HandoffSource<Routed>,
    pub adopting: &'a HashMap<u64, mesh::HandoffOffer>,
}

/// The rounds a step of the decider found, once their questions were asked.
pub(crate) struct Prepared {
    /// The dead processes whose rounds this node decides.
    pending: Vec<Incarnation>,
    /// Whether every round has all it asked for (or was decided already).
    ready: bool,
}

impl Restore {
    /// Process `incarnation` of this node (0: no lease, nothing is checkpointed).
    pub(crate) fn new(incarnation: u64) -> Self {
        Self {
            incarnation,
            ..Default::default()
        }
    }

    // ------------------------------------------------------------------ what others read

    /// This process's lease epoch (0: no lease).
    pub(crate) fn incarnation(&self) -> u64 {
        self.incarnation
    }

    pub(crate) fn set_incarnation(&mut self, lease_epoch: u64) {
        self.incarnation = lease_epoch;
    }

    /// Dead processes whose world this node has not seen restored yet.
    pub(crate) fn pending(&self) -> usize {
        self.dead.len()
    }

    /// The restores this node decided and saw acked since the last call.
    pub(crate) fn take_log(&mut self) -> Vec<Restored> {
        std::mem::take(&mut self.log)
    }

    /// The lease epoch of `node`'s live process, as the store last said.
    pub(crate) fn lease_of(&self, node: NodeId) -> Option<u64> {
        self.live.get(&node).copied()
    }

    /// Whether the store last said `node` has a live process.
    pub(crate) fn is_live(&self, node: NodeId) -> bool {
        self.live.contains_key(&node)
    }

    /// Whether the store named no live peer (or has not said yet).
    pub(crate) fn knows_no_live_peer(&self) -> bool {
        self.live.is_empty()
    }

    /// Whether `node`'s lease lapsed, not replaced by another grant, by the store's last word.
    pub(crate) fn is_lapsed(&self, node: NodeId) -> bool {
        self.lapsed.contains_key(&node)
    }

    /// Whether this node heard that `inc` died.
    pub(crate) fn is_fenced(&self, inc: Incarnation) -> bool {
        self.fenced.contains(&inc)
    }

    /// Whether `inc` died and its world is restored.
    pub(crate) fn is_restored(&self, inc: Incarnation) -> bool {
        self.fenced.contains(&inc) && !self.dead.contains_key(&inc)
    }

    /// The geo of `node`, if this node read its record.
    pub(crate) fn geo_of(&self, node: NodeId) -> Option<&str> {
        self.geo_of.get(&node).map(String::as_str)
    }

    /// Kept after the peer dies: its geo's decider restores it.
    pub(crate) fn note_geo(&mut self, node: NodeId, geo: String) {
        self.geo_of.insert(node, geo);
    }

    /// Whether `node`'s ghosts may belong to a dead process whose world is being restored.
    pub fn is_dead_node(&self, node: NodeId) -> bool {
        self.dead.keys().any(|(n, _)| *n == node)
    }

    /// Whether an offer in doubt towards `node` went to a process that died.
    pub fn in_doubt_to_dead_node(&self, node: NodeId) -> bool {
        self.in_doubt_to_dead.values().any(|(n, _)| *n == node)
    }

    /// Whether the offer of `root` in doubt went to a process that died: the restore of its
    /// world settles it.
    pub(crate) fn offered_to_dead(&self, root: u64) -> bool {
        self.in_doubt_to_dead.contains_key(&root)
    }

    /// An offer this node made of `root`: kept until the target has surely checkpointed it.
    pub(crate) fn offer_sent(&mut self, root: u64, sent: SentOffer) {
        self.sent.insert(root, sent);
    }

    /// The offer this node made of `root`, while it keeps it.
    pub(crate) fn sent_offer(&self, root: u64) -> Option<&SentOffer> {
        self.sent.get(&root)
    }

    /// The offer of `root` was refused: nothing of it is kept.
    pub(crate) fn forget_sent(&mut self, root: u64) {
        self.sent.remove(&root);
    }

    fn dead_ghost(&self, id: u64, epoch: u64) -> bool {
        self.dead.values().any(|g| g.get(&id) == Some(&epoch))
    }

    /// Whether `id` is a ghost of a dead process waiting for its restore (not swept as stale).
    pub(crate) fn awaits_restore(&self, table: &EntityTable, id: u64) -> bool {
        table
            .get(id)
            .is_some_and(|e| e.origin().is_some() && self.dead_ghost(id, e.epoch))
    }

    // ------------------------------------------------------------------ every node

    /// The store's word on who is alive. A process whose lease another grant replaced (a new
    /// process holds its id, or a restore fenced it) is dead. One whose lease only lapsed may
    /// take it back: it is left alone until it does, or its geo's decider fences it. Returns
    /// the processes found dead.
    pub(crate) fn note_leases(
        &mut self,
        cx: &Context,
        live: &[(NodeId, u64)],
        lapsed: &[(NodeId, u64)],
    ) -> Vec<Incarnation> {
        self.leases_heard = true;
        self.known.extend(live.iter().copied());
        let mono = cx.now.mono_ms;
        let now: BTreeMap<NodeId, u64> = live.iter().copied().collect();
        let lapsed: BTreeMap<NodeId, u64> = lapsed.iter().copied().collect();
        let mut gone = Vec::new();
        for (&n, &e) in &self.live {
            if now.get(&n) == Some(&e) {
                continue;
            }
            if lapsed.get(&n) == Some(&e) {
                tracing::warn!(
                    peer = n,
                    lease_epoch = e,
                    "a peer's lease lapsed: waiting for it to take it back"
                );
                self.lapsed_since.entry((n, e)).or_insert(mono);
            } else {
                gone.push((n, e));
            }
        }
        // Back (live again under the same epoch), still lapsed, or replaced: dead.
        let mut back = Vec::new();
        self.lapsed_since.retain(|&(n, e), _| {
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
        self.live = now;
        self.lapsed = lapsed;
        let back: Vec<NodeId> = self.live.keys().copied().collect();
        for n in back {
            self.departed.remove(&n);
        }
        gone
    }

    /// The decider fences the lapsed leases of its geo that were not taken back in time: only
    /// then may their world be restored, since a fenced holder can never write again.
    fn fence_lapsed(&mut self, cx: &mut Context, live_since_ms: u64) {
        let now = cx.now.mono_ms;
        let grace = lapse_grace_ms(cx.config.node_lease_ms);
        if now < live_since_ms + grace {
            return;
        }
        let due: Vec<Incarnation> = self
            .lapsed_since
            .iter()
            .filter(|&(inc, &since)| {
                now >= since + grace
                    && self.decides_for(cx, inc.0)
                    && self
                        .fencing
                        .get(inc)
                        .is_none_or(|&at| now >= at + FENCE_RETRY_MS)
            })
            .map(|(inc, _)| *inc)
            .collect();
        for (node, epoch) in due {
            self.fencing.insert((node, epoch), now);
            cx.store(StoreRequest::FenceLease { node, epoch });
        }
    }

    /// The store's answer to a fence: a fenced (or replaced) lease's process is dead (returned);
    /// one taken back is alive.
    pub(crate) fn on_lease_fenced(
        &mut self,
        cx: &Context,
        node: NodeId,
        epoch: u64,
        result: Result<cellmesh_stores::topology::Fence, String>,
    ) -> Option<Incarnation> {
        use cellmesh_stores::topology::Fence;
        let inc = (node, epoch);
        match result {
            Ok(Fence::Fenced | Fence::Moved) => {
                if result == Ok(Fence::Fenced) {
                    cx.metrics.leases_fenced.inc();
                    tracing::warn!(
                        peer = node,
                        lease_epoch = epoch,
                        "fenced a peer's lapsed lease: its world is restored from its checkpoints"
                    );
                }
                self.fencing.remove(&inc);
                self.lapsed_since.remove(&inc);
                if self.lapsed.get(&node) == Some(&epoch) {
                    self.lapsed.remove(&node);
                }
                Some(inc)
            }
            Ok(Fence::Live) => {
                self.fencing.remove(&inc);
                None
            }
            Err(e) => {
                cx.metrics.error("store");
                tracing::warn!(peer = node, error = %e, "fencing a lapsed lease failed; retrying");
                None
            }
        }
    }

    /// Nothing more is taken from `inc`: its ghosts here stay until its world is restored.
    /// `None` if it was known dead already; otherwise what the core does about it (handoffs
    /// towards it that never left thaw, those in doubt wait for the decider).
    pub(crate) fn mark_dead(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        inc: Incarnation,
    ) -> Option<Dead> {
        if !self.fenced.insert(inc) {
            return None;
        }
        let (node, lease_epoch) = inc;
        tracing::warn!(
            peer = node,
            lease_epoch,
            "a peer's process is dead: its world will be restored from its checkpoints"
        );
        cx.metrics.error("peer_dead");
        // The ghosts of its node id, unless this process never saw it alive: then they are a
        // newer process's, and stay when its world is restored.
        let ghosts: BTreeMap<u64, u64> = if self.known.contains(&inc) {
            table
                .ghosts_of(node)
                .into_iter()
                .filter_map(|id| Some((id, table.get(id)?.epoch)))
                .collect()
        } else {
            BTreeMap::new()
        };
        self.dead.insert(inc, ghosts);
        let departed = !self.live.contains_key(&node);
        if departed {
            self.departed.insert(node);
        }
        Some(Dead { inc, departed })
    }

    /// Offers this node made of `roots`, in doubt towards `dead`: frozen until the decider
    /// settles them.
    pub(crate) fn in_doubt_to(&mut self, dead: Incarnation, roots: Vec<u64>) {
        for root in roots {
            self.in_doubt_to_dead.insert(root, dead);
        }
    }

    /// The decider asks what this node holds of the dead process's world: the answer goes in
    /// parts.
    pub(crate) fn report(
        &self,
        cx: &mut Context,
        mesh: &Mesh,
        holdings: &Holdings,
        from: NodeId,
        q: mesh::RestoreQuery,
    ) {
        let inc = (q.node, q.lease_epoch);
        let (held, offered, in_doubt) = self.report_of(holdings, inc);
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
            mesh.send(cx, from, mesh_message::Body::RestoreReport(p));
        }
    }

    /// Every real this node writes or adopts, every offer it made to `dead_node` that it still
    /// keeps, and which of those are in doubt (their units frozen here).
    fn report_of(
        &self,
        holdings: &Holdings,
        (dead_node, dead_lease): Incarnation,
    ) -> (Vec<mesh::RealHeld>, Vec<mesh::HandoffOffer>, Vec<u64>) {
        // A unit frozen in an offer to the dead node is a candidate, not a holding: the offer
        // may have been adopted there.
        let out = holdings.outgoing;
        let mut held: Vec<mesh::RealHeld> = holdings
            .table
            .iter()
            .filter(|e| e.origin().is_none())
            .filter(|e| {
                out.target_of_member(e.id)
                    .is_none_or(|(to, _)| to != dead_node)
            })
            .map(|e| mesh::RealHeld {
                entity_id: e.id,
                entity_epoch: e.epoch,
                owner_node: 0,
                owner_lease: self.incarnation,
            })
            .collect();
        for o in holdings.adopting.values() {
            held.push(mesh::RealHeld {
                entity_id: o.entity_id,
                entity_epoch: o.entity_epoch,
                owner_node: 0,
                owner_lease: self.incarnation,
            });
            held.extend(o.attachments.iter().map(|a| mesh::RealHeld {
                entity_id: a.entity_id,
                entity_epoch: o.entity_epoch,
                owner_node: 0,
                owner_lease: self.incarnation,
            }));
        }
        let to_dead =
            |s: &SentOffer| s.to == dead_node && (s.to_lease == dead_lease || s.to_lease == 0);
        // Handed to a live process lately: it writes them (or is adopting them) now, even if
        // its own report went before it adopted.
        let live = &self.live;
        for s in self
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
            .sent
            .values()
            .filter(|s| to_dead(s))
            .map(|s| s.offer.clone())
            .collect();
        let in_doubt = offered
            .iter()
            .map(|o| o.entity_id)
            .filter(|id| out.target_of(*id).is_some())
            .collect();
        (held, offered, in_doubt)
    }

    /// The decider's word on an offer this node made to a dead process.
    pub(crate) fn on_resolved(&mut self, cx: &Context, r: &mesh::RestoreResolved) -> Resolution {
        let id = r.entity_id;
        if r.owner_node == cx.config.node_id {
            let Some((dead, _)) = self.in_doubt_to_dead.remove(&id) else {
                return Resolution::Repeat;
            };
            self.sent.remove(&id);
            return Resolution::Returned { dead };
        }
        // Not an offer made since (a repeated word names an older epoch).
        if self
            .sent
            .get(&id)
            .is_some_and(|s| s.offer.entity_epoch <= r.entity_epoch)
        {
            self.sent.remove(&id);
        }
        if self.in_doubt_to_dead.remove(&id).is_some() {
            Resolution::Settle
        } else {
            Resolution::Redirect
        }
    }

    /// The dead process's world is restored: the ghosts of it this node held then, each with
    /// its epoch then.
    pub(crate) fn on_done(&mut self, inc: Incarnation) -> BTreeMap<u64, u64> {
        self.fenced.insert(inc);
        self.rounds.remove(&inc);
        self.dead.remove(&inc).unwrap_or_default()
    }

    /// Whether the ghost `id` of the dead `node` was taken over by nobody: still the dead
    /// process's, under the epoch it wrote (a new process under the same node id that
    /// restored it writes a newer one).
    pub(crate) fn left_over(&self, table: &EntityTable, node: NodeId, id: u64, epoch: u64) -> bool {
        table.get(id).is_some_and(|e| {
            e.origin() == Some(node) && e.epoch == epoch && !self.dead_ghost(id, epoch)
        })
    }

    // ------------------------------------------------------------------ checkpoints to the store

    /// Whether the checkpoints are written now: every `FLUSH_EVERY_MS`, and at once when the
    /// store has no checkpoint of an entity yet (`fresh`: until it does, nothing could restore
    /// it). Only a process with a lease, in a cluster, writes any.
    pub(crate) fn flush_due(&mut self, cx: &Context, clustered: bool, fresh: bool) -> bool {
        let now = cx.now.mono_ms;
        if self.incarnation == 0 || !clustered {
            return false;
        }
        if now < self.next_flush_ms && !fresh {
            return false;
        }
        self.next_flush_ms = now + FLUSH_EVERY_MS;
        true
    }

    /// Writes checkpoints (`put`) of this process and removes those let go (`removed`).
    pub(crate) fn write_checkpoints(
        &self,
        cx: &mut Context,
        put: Vec<mesh::HandoffOffer>,
        removed: Vec<u64>,
    ) {
        cx.metrics.checkpoint_writes.inc();
        cx.metrics.checkpoints_stored.inc_by(put.len() as u64);
        cx.metrics
            .checkpoint_stored_bytes
            .inc_by(put.iter().map(|c| c.encoded_len() as u64).sum());
        cx.metrics.checkpoints_removed.inc_by(removed.len() as u64);
        cx.store(StoreRequest::PutCheckpoints {
            node: cx.config.node_id,
            lease_epoch: self.incarnation,
            put,
            remove: removed,
        });
    }

    /// Forgets offers settled long enough ago that their targets have checkpointed them (those
    /// still frozen, `in_handoff`, stay).
    pub(crate) fn prune_sent(&mut self, cx: &Context, in_handoff: impl Fn(u64) -> bool) {
        let now = cx.now.mono_ms;
        let keep_ms = cx.config.node_lease_ms * 2 + FLUSH_EVERY_MS * 4;
        self.sent
            .retain(|root, s| in_handoff(*root) || now < s.at_ms + keep_ms);
    }

    // ------------------------------------------------------------------ the decider

    /// Whether this node may decide restores at all: it writes, and knows who is alive.
    fn may_decide(&self, authority: &Authority, mesh: &Mesh) -> bool {
        authority.lease_live() && mesh.clustered() && self.leases_heard
    }

    /// Whether this node decides the restore of `node`'s dead processes.
    ///
    /// While the core geo has a live node, its lowest live node decides every geo's: it reads a
    /// dead node of another geo's checkpoints from the copy that geo writes to the core's store.
    /// One decider for the world decides the processes that died together in two geos in one
    /// round, as within one geo: two deciders each restoring what its own dead process last
    /// wrote would restore an entity handed between them twice. Without a core geo (or with
    /// none of its nodes live) each geo's lowest live node decides its own geo's, from its
    /// store; a node whose geo is not known is decided by the lowest live node of all.
    fn decides_for(&self, cx: &Context, node: NodeId) -> bool {
        if let Some(core) = self.live_core(cx) {
            return cx.config.geo == core && self.lowest_live_of(cx, core);
        }
        let me = cx.config.node_id;
        if node == me {
            return self.lowest_live_of(cx, &cx.config.geo);
        }
        match self.geo_of.get(&node) {
            Some(g) => *g == cx.config.geo && self.lowest_live_of(cx, g),
            None => self.live.keys().all(|n| *n >= me),
        }
    }

    /// The core geo, if there is one and a node of it lives (this one, or a peer the store
    /// says holds a live lease).
    fn live_core<'a>(&self, cx: &'a Context) -> Option<&'a str> {
        let core = cx.config.core_geo.as_str();
        let alive = cx.config.geo == core
            || self
                .live
                .keys()
                .any(|n| self.geo_of.get(n).map(String::as_str) == Some(core));
        (!core.is_empty() && alive).then_some(core)
    }

    /// Whether no live node of `geo` is below this one.
    fn lowest_live_of(&self, cx: &Context, geo: &str) -> bool {
        let me = cx.config.node_id;
        self.live
            .keys()
            .all(|n| *n >= me || self.geo_of.get(n).map(String::as_str) != Some(geo))
    }

    /// Where `node`'s checkpoints are read from here: this geo's store (`None`), or the copy of
    /// its geo's kept in this (the core) geo's store.
    pub(crate) fn copy_of(&self, cx: &Context, node: NodeId) -> Option<String> {
        self.geo_of
            .get(&node)
            .filter(|g| **g != cx.config.geo)
            .cloned()
    }

    /// The first part of a step of every round this node decides: a partition without the
    /// dead first, the lapsed leases fenced, the store listed, each round's questions asked,
    /// and the restore offers with no answer made again (what those come to is returned).
    /// `None`: nothing more to do in this step.
    pub(crate) fn prepare_step(
        &mut self,
        cx: &mut Context,
        mesh: &Mesh,
        authority: &Authority,
    ) -> Option<(Prepared, Vec<Act>)> {
        if !self.may_decide(authority, mesh) {
            return None;
        }
        // First a partition that gives no cell to a dead node (whether its world is restored
        // yet or not: a later re-plan may have given it cells again); rounds wait for it.
        let me = cx.config.node_id;
        let partition = authority.partition();
        let gone: Vec<NodeId> = self
            .departed
            .iter()
            .copied()
            .filter(|n| *n != me && partition.chunks_of(*n) > 0 && self.decides_for(cx, *n))
            .collect();
        if !gone.is_empty() {
            self.ask_replan(cx, partition, &gone);
            return None;
        }
        self.fence_lapsed(cx, authority.live_since_ms());
        let now = cx.now.mono_ms;
        // This geo's store is listed by this geo's lowest live node (to drop what was restored
        // from a copy, if it decides nothing), and by the core's decider the copies of every
        // other geo's.
        if now >= self.next_list_ms && self.listing == 0 {
            let mut lists: Vec<Option<String>> = Vec::new();
            if self.lowest_live_of(cx, &cx.config.geo) {
                lists.push(None);
            }
            if self.decides_for(cx, me) && self.live_core(cx) == Some(cx.config.geo.as_str()) {
                lists.extend(
                    cx.config
                        .world_geos()
                        .into_iter()
                        .filter(|g| *g != cx.config.geo)
                        .map(Some),
                );
            }
            self.next_list_ms = now + LIST_EVERY_MS;
            self.listing = lists.len();
            for copy_of in lists {
                cx.store(StoreRequest::ListCheckpointed { copy_of });
            }
        }
        // Every dead process's round asks its questions; they are decided together, once
        // the restores of the last decision are all answered: a process restored by one round
        // and dead again by the next has its older checkpoints weighed against its newer ones.
        let pending: Vec<Incarnation> = self
            .dead
            .keys()
            .copied()
            .filter(|(n, _)| self.decides_for(cx, *n))
            .collect();
        let mut ready = true;
        for &inc in &pending {
            ready &= self.prepare_round(cx, mesh, inc);
        }
        let mut acts = Vec::new();
        self.retry_restores(cx, partition, &mut acts);
        Some((Prepared { pending, ready }, acts))
    }

    /// The rounds of a step once the restores it made again are carried out: those decided
    /// (to finish) and those not yet. `None` while restore offers wait for their answers.
    pub(crate) fn rounds_of(
        &self,
        prepared: &Prepared,
    ) -> Option<(Vec<Incarnation>, Vec<Incarnation>)> {
        if !self.offering.is_empty() {
            return None;
        }
        Some(
            prepared
                .pending
                .iter()
                .copied()
                .filter(|inc| self.rounds.contains_key(inc))
                .partition(|inc| self.rounds[inc].decided),
        )
    }

    /// Whether the `undecided` rounds are decided now: every round has all it asked for,
    /// every live peer runs this node's partition, and no lapsed peer (which may hold what the
    /// dead left) is waited for.
    pub(crate) fn decides_now(
        &self,
        cx: &Context,
        mesh: &Mesh,
        partition: &Partition,
        prepared: &Prepared,
        undecided: &[Incarnation],
    ) -> bool {
        let me = cx.config.node_id;
        let epoch = partition.epoch();
        let on_partition = self
            .live
            .keys()
            .filter(|n| **n != me)
            .all(|n| mesh.peer_partition(*n) >= epoch);
        // A lapsed peer may hold what the dead left: decided once it is back or fenced.
        let limbo = !self.lapsed_since.is_empty();
        prepared.ready && on_partition && !limbo && !undecided.is_empty()
    }

    /// The processes with checkpoints in the store: one that is surely dead and was not seen
    /// to die (this process started after it, or it died while another decided) gets a round.
    /// Surely dead: a newer process holds its node id (this one included), its node was seen to
    /// die with nobody holding the id since, or it held no lease in this node's view for two
    /// listings in a row (a process that just started is in the view within one membership
    /// read, well inside that).
    /// `copy_of`: the listing is of the copy of that geo's checkpoints, and every process in
    /// it ran in that geo. `restored`: those of them marked restored already (by whichever
    /// geo restored them), whose checkpoints are only dropped.
    pub(crate) fn on_checkpointed(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        copy_of: Option<String>,
        result: Result<Vec<(NodeId, u64)>, String>,
        restored: &[Incarnation],
    ) -> Vec<Act> {
        self.listing = self.listing.saturating_sub(1);
        let all = match result {
            Ok(all) => all,
            Err(e) => {
                cx.metrics.error("store");
                tracing::warn!(error = %e, copy_of = ?copy_of, "listing checkpointed processes failed");
                return Vec::new();
            }
        };
        if let Some(g) = &copy_of {
            for &(node, _) in &all {
                self.geo_of.entry(node).or_insert_with(|| g.clone());
            }
        }
        let restored: BTreeSet<Incarnation> = restored.iter().copied().collect();
        let me = (cx.config.node_id, self.incarnation);
        let now = cx.now.mono_ms;
        let unleased: BTreeSet<Incarnation> = all
            .iter()
            .copied()
            .filter(|&(n, l)| (n, l) != me && self.live.get(&n) != Some(&l))
            .collect();
        // Suspects of this listing's store that it no longer lists are not suspects any more.
        let cleared: Vec<Incarnation> = self
            .suspects
            .keys()
            .copied()
            .filter(|inc| !unleased.contains(inc) && self.copy_of(cx, inc.0) == copy_of)
            .collect();
        for inc in cleared {
            self.suspects.remove(&inc);
        }
        let mut acts = Vec::new();
        for (node, lease_epoch) in all {
            let inc = (node, lease_epoch);
            if restored.contains(&inc) && !self.dead.contains_key(&inc) {
                // Restored (by the core from the copy, or by another decider): never again.
                self.fenced.insert(inc);
                acts.push(Act::Store(StoreRequest::DropCheckpoints {
                    node,
                    lease_epoch,
                    copy_of: copy_of.clone(),
                }));
                continue;
            }
            // Another node decides it: the core's decider (this geo's store is listed to drop
            // what it restored), or another geo's (a store shared by geos).
            if !self.decides_for(cx, node) {
                continue;
            }
            // Lapsed, not replaced: its holder may take it back. Dead once fenced.
            if node != me.0 && self.lapsed.get(&node) == Some(&lease_epoch) {
                self.lapsed_since.entry(inc).or_insert(now);
                continue;
            }
            if self.fenced.contains(&inc) && !self.dead.contains_key(&inc) {
                // Restored already (here or by another decider): the listing predates the
                // drop of its checkpoints, or the drop failed. A second round would take the
                // ghosts of a new process under the same id for the dead one's.
                acts.push(Act::Store(StoreRequest::DropCheckpoints {
                    node,
                    lease_epoch,
                    copy_of: copy_of.clone(),
                }));
                continue;
            }
            let long_unleased = unleased.contains(&(node, lease_epoch))
                && *self.suspects.entry((node, lease_epoch)).or_insert(now) + LIST_EVERY_MS <= now;
            let newer = if node == me.0 {
                lease_epoch < me.1
            } else {
                self.live.get(&node).is_some_and(|live| lease_epoch < *live)
            };
            let gone =
                !self.live.contains_key(&node) && node != me.0 && self.departed.contains(&node);
            if (newer || gone || long_unleased) && !self.dead.contains_key(&(node, lease_epoch)) {
                self.fenced.remove(&(node, lease_epoch));
                acts.extend(
                    self.mark_dead(cx, table, (node, lease_epoch))
                        .map(Act::Died),
                );
            }
        }
        acts
    }

    /// Asks what a round still needs; whether it has it all (or was decided already).
    fn prepare_round(&mut self, cx: &mut Context, mesh: &Mesh, inc: Incarnation) -> bool {
        let (node, lease_epoch) = inc;
        let me = cx.config.node_id;
        let peers: Vec<NodeId> = self.live.keys().copied().filter(|n| *n != me).collect();
        let linked: BTreeMap<NodeId, LinkId> = mesh.peer_links();
        let round = self.rounds.entry(inc).or_default();
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
            mesh.send(
                cx,
                n,
                mesh_message::Body::RestoreQuery(mesh::RestoreQuery { node, lease_epoch }),
            );
        }
        if load {
            let copy_of = self.copy_of(cx, node);
            cx.store(StoreRequest::LoadCheckpoints {
                node,
                lease_epoch,
                copy_of,
            });
        }
        decided || ready
    }

    /// Commits the partition without the `dead` (once per partition epoch; a losing commit
    /// learns the winner's partition like any other).
    fn ask_replan(&mut self, cx: &mut Context, partition: &Partition, dead: &[NodeId]) {
        let from = partition.epoch();
        if self.replan_from == Some(from) {
            return;
        }
        let mut live: Vec<NodeId> = self.live.keys().copied().collect();
        live.push(cx.config.node_id);
        match partition.without(dead, &live) {
            Ok(Some(p)) => {
                tracing::warn!(
                    ?dead,
                    epoch = p.epoch(),
                    "committing a partition without dead nodes"
                );
                self.replan_from = Some(from);
                cx.store(StoreRequest::CommitPartition {
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
            if self.replan_from == Some(epoch.saturating_sub(1)) {
                self.replan_from = None;
            }
        }
    }

    pub(crate) fn on_report(&mut self, from: NodeId, r: mesh::RestoreReport) {
        let Some(round) = self.rounds.get_mut(&(r.node, r.lease_epoch)) else {
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
        cx: &Context,
        node: NodeId,
        lease_epoch: u64,
        result: Result<Vec<mesh::HandoffOffer>, String>,
    ) {
        let Some(round) = self.rounds.get_mut(&(node, lease_epoch)) else {
            return;
        };
        round.loading = false;
        match result {
            Ok(c) => round.checkpoints = Some(c),
            Err(e) => {
                cx.metrics.error("store");
                tracing::warn!(node, error = %e, "loading a dead node's checkpoints failed; retrying");
            }
        }
    }

    /// Decides the rounds of `incs` together: one entity, one restore, from the newest of what
    /// every dead process left and every offer made to them (this node's own report read from
    /// `holdings`).
    pub(crate) fn decide_rounds(
        &mut self,
        cx: &Context,
        holdings: &Holdings,
        partition: &Partition,
        incs: &[Incarnation],
    ) -> Vec<Act> {
        let me = cx.config.node_id;
        let mut held = BTreeMap::new();
        let mut offered = Vec::new();
        let mut checkpoints = Vec::new();
        for &inc in incs {
            let (own_held, own_offered, own_in_doubt) = self.report_of(holdings, inc);
            // Internal: a timer step; the caller kept only incarnations with a round.
            let round = self.rounds.get_mut(&inc).expect("prepared above");
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
        let mut live: BTreeSet<NodeId> = self.live.keys().copied().collect();
        live.insert(me);
        // Only a live process holds anything: not one that died since it was reported (a node
        // id a new process holds now included).
        let incarnation = self.incarnation;
        let leases = &self.live;
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
            me,
            dead = ?incs,
            checkpoints = checkpoints.len(),
            restores = d.restore.len(),
            settled = d.settled.len(),
            homeless = d.homeless.len(),
            "restoring a dead process's world"
        );
        let mut acts = Vec::new();
        for (reporter, id, epoch, owner) in d.settled {
            self.resolve_for(cx, reporter, id, epoch, owner, &mut acts);
        }
        for (reporter, id) in d.returned {
            self.resolve_for(cx, reporter, id, 0, reporter, &mut acts);
            // Every other live node hears it too: a ghost there that followed the dead
            // target's writes goes back to the reporter, which writes the unit under the epoch
            // it had (the target's is void). Before the round's end, which would drop it.
            let attachments = offered
                .iter()
                .filter(|(r, o, _)| *r == reporter && o.entity_id == id)
                .flat_map(|(_, o, _)| o.attachments.iter().map(|a| a.entity_id));
            for m in std::iter::once(id).chain(attachments) {
                let word = mesh::RestoreResolved {
                    entity_id: m,
                    entity_epoch: 0,
                    owner_node: reporter,
                };
                for &n in live.iter().filter(|n| **n != reporter) {
                    if n == me {
                        acts.push(Act::ResolvedHere(word));
                    } else {
                        acts.push(Act::Send(n, mesh_message::Body::RestoreResolved(word)));
                    }
                }
            }
        }
        for r in d.restore {
            self.offer_restore(cx, partition.epoch(), inc, r, &mut acts);
        }
        for r in d.homeless {
            // Offered once a live node owns the position (see `retry_restores`).
            self.offering.insert(
                r.offer.entity_id,
                Offering {
                    dead: inc,
                    target: 0,
                    offer: r.offer,
                    reporters: r.reporters,
                    retry_at_ms: cx.now.mono_ms,
                },
            );
        }
        acts
    }

    fn offer_restore(
        &mut self,
        cx: &Context,
        partition_epoch: u64,
        dead: Incarnation,
        r: Restoration,
        acts: &mut Vec<Act>,
    ) {
        let Restoration {
            target,
            mut offer,
            reporters,
        } = r;
        offer.partition_epoch = partition_epoch;
        let id = offer.entity_id;
        self.offering.insert(
            id,
            Offering {
                dead,
                target,
                offer: offer.clone(),
                reporters,
                retry_at_ms: cx.now.mono_ms + RESTORE_RETRY_MS,
            },
        );
        if target == cx.config.node_id {
            acts.push(Act::OfferHere(offer));
        } else {
            acts.push(Act::Send(target, mesh_message::Body::HandoffOffer(offer)));
        }
    }

    /// Restore offers with no answer, or refused, are made again to whoever owns the position
    /// now, above the epoch they were refused under.
    fn retry_restores(&mut self, cx: &Context, partition: &Partition, acts: &mut Vec<Act>) {
        let now = cx.now.mono_ms;
        let due: Vec<u64> = self
            .offering
            .iter()
            .filter(|(_, o)| now >= o.retry_at_ms)
            .map(|(id, _)| *id)
            .collect();
        let me = cx.config.node_id;
        for id in due {
            let Some(mut o) = self.offering.remove(&id) else {
                continue;
            };
            let owner = o
                .offer
                .position
                .as_ref()
                .and_then(|p| partition.owner_of(Pos { x: p.x, y: p.y }).ok())
                .filter(|n| *n == me || self.live.contains_key(n));
            let Some(owner) = owner else {
                // Nobody owns its position yet: asked again later.
                o.retry_at_ms = now + RESTORE_RETRY_MS;
                self.offering.insert(id, o);
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
            self.offer_restore(cx, partition.epoch(), o.dead, r, acts);
        }
    }

    /// A target's answer to a restore offer: what it comes to, or `None` when it answers no
    /// restore of this node.
    pub(crate) fn on_answer(
        &mut self,
        cx: &Context,
        mesh: &Mesh,
        from: NodeId,
        id: u64,
        epoch: u64,
        refused: Option<&str>,
    ) -> Option<Vec<Act>> {
        let o = self.offering.get(&id)?;
        if o.target != from || o.offer.entity_epoch != epoch {
            return None;
        }
        // Internal: looked up just above, nothing removed it since.
        let o = self.offering.remove(&id).expect("checked above");
        let mut acts = Vec::new();
        if refused == Some(ALREADY_WRITES) || refused == Some(SUPERSEDED) {
            // A live node writes it after all (it moved between live nodes while the round
            // asked them), or its player has a newer avatar: nothing to restore; offers made of
            // it to the dead node settle there.
            for &r in &o.reporters {
                self.resolve_for(cx, r, id, epoch, from, &mut acts);
            }
            return Some(acts);
        }
        if let Some(reason) = refused {
            tracing::debug!(entity = id, target = from, %reason, "restore refused; trying again");
            self.offering.insert(
                id,
                Offering {
                    offer: mesh::HandoffOffer {
                        entity_epoch: epoch + 1,
                        ..o.offer
                    },
                    retry_at_ms: cx.now.mono_ms + RESTORE_RETRY_MS / 4,
                    ..o
                },
            );
            return Some(acts);
        }
        cx.metrics.handoff(o.dead.0, from, "restored");
        let me = cx.config.node_id;
        let mut members = vec![id];
        members.extend(o.offer.attachments.iter().map(|a| a.entity_id));
        for &m in &members {
            if self.log.len() < RESTORE_LOG_MAX {
                self.log.push(Restored {
                    entity_id: m,
                    dead_node: o.dead.0,
                    dead_lease_epoch: o.dead.1,
                    owner: from,
                    state_unix_ms: o.offer.state_unix_ms,
                    restored_unix_ms: cx.now.unix_ms,
                });
            }
        }
        for m in members {
            for &r in &o.reporters {
                self.resolve_for(cx, r, m, epoch, from, &mut acts);
            }
            let moved = mesh::EntityMoved {
                entity_id: m,
                entity_epoch: epoch,
                owner_node: from,
                holders: vec![],
            };
            for n in mesh.up_peers() {
                if n != from {
                    acts.push(Act::Send(n, mesh_message::Body::EntityMoved(moved.clone())));
                }
            }
            if from != me {
                acts.push(Act::MovedHere(o.dead.0, moved));
            }
        }
        Some(acts)
    }

    fn resolve_for(
        &mut self,
        cx: &Context,
        reporter: NodeId,
        id: u64,
        epoch: u64,
        owner: NodeId,
        acts: &mut Vec<Act>,
    ) {
        let r = mesh::RestoreResolved {
            entity_id: id,
            entity_epoch: epoch,
            owner_node: owner,
        };
        if reporter == cx.config.node_id {
            acts.push(Act::ResolvedHere(r));
        } else {
            self.resolved_for
                .entry(reporter)
                .or_default()
                .push((cx.now.mono_ms, r));
            acts.push(Act::Send(reporter, mesh_message::Body::RestoreResolved(r)));
        }
    }

    /// The link to `node` is back: the decider's recent words to it go again (a repeat
    /// settles nothing twice: the reporter acts on the first and forgets the unit).
    pub(crate) fn resend_resolutions(&mut self, cx: &mut Context, mesh: &Mesh, node: NodeId) {
        let now = cx.now.mono_ms;
        self.resolved_for.retain(|_, v| {
            v.retain(|(at, _)| now.saturating_sub(*at) < RESOLUTION_KEPT_MS);
            !v.is_empty()
        });
        let again: Vec<mesh::RestoreResolved> = self
            .resolved_for
            .get(&node)
            .map(|v| v.iter().map(|(_, r)| *r).collect())
            .unwrap_or_default();
        for r in again {
            mesh.send(cx, node, mesh_message::Body::RestoreResolved(r));
        }
    }

    /// The round of `inc` is over: what every peer is told.
    pub(crate) fn finish_round(&mut self, inc: Incarnation) -> mesh::RestoreDone {
        let (node, lease_epoch) = inc;
        self.rounds.remove(&inc);
        mesh::RestoreDone { node, lease_epoch }
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
