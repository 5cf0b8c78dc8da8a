//! The node's side of handoff: drives the pure state machines of [`crate::model::handoff`] with the
//! game, the peers and the clock, and keeps everything else of the node (ghosts, replicas,
//! sessions, routes) in step when the real of an entity moves.
//!
//! Source: trigger → `Freeze` → the game's `Snapshot`s → `HandoffOffer` (plus the inputs held
//! meanwhile) → `HandoffAck` → `Evict`, the entity stays as a render ghost and its holders hear
//! `EntityMoved`. Target: the offer's checks → `Adopt` → the game's `Adopted` → the ghost
//! becomes the node's own entity → `HandoffAck`. An offer with no answer stays frozen.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_proto::local::{self, sidecar_message, ErrorCode};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_stores::SessionEntry;
use cellmesh_world::geometry::Pos;
use cellmesh_world::partition::NodeId;

use super::wire::*;
use super::*;
use crate::model::entities::{Entity, EntityError, TickChanges};
use crate::model::handoff::{
    freeze_cost, Admit, AfterDespawn, Completed, Fence, HandoffSource, HandoffTarget, InputRoute,
    Offer, OfferChecks, OfferDecision, Thawed,
};
use crate::model::inputs::{InputOrder, Ordered};
use crate::model::subs::{self};

/// The handoffs this node takes part in, as source and as target, and the epoch fence.
#[derive(Default)]
pub(crate) struct Handoffs {
    pub outgoing: HandoffSource<Routed>,
    pub inbound: HandoffTarget,
    pub fence: Fence<Fenced>,
    /// Offers being adopted by the game: root -> the offer.
    pub adopting: HashMap<u64, mesh::HandoffOffer>,
    /// When the `Adopt` of each offer in `adopting` went to the game (monotonic ms).
    pub adopt_sent_ms: HashMap<u64, u64>,
    /// Entities not offered again before this time (monotonic ms), after a refusal.
    pub retry: HashMap<u64, u64>,
    /// Entities to check for a handoff at the next tick even if they did not move.
    pub recheck: BTreeSet<u64>,
    /// Entities in chunks a new partition gave away: handed over with no margin.
    pub mass: HashSet<u64>,
    /// Masters handed away from here, by account, so late input finds them with no ghost left.
    pub departed_masters: HashMap<String, u64>,
    /// Players who left while their master was frozen for a handoff: the leave goes to the new
    /// owner once it acks (the game here drops it on Evict).
    pub leaving: HashMap<String, mesh::PeerPlayerLeave>,
    /// The order of each player's inputs handed to the game here.
    pub input_order: InputOrder<local::Input>,
    /// Entities due for a handoff whose target does not hold their ghost yet, since when.
    pub ghost_wait: HashMap<u64, u64>,
    /// Entities the fence holds frames for, since when (monotonic ms).
    pub held_since: HashMap<u64, u64>,
    /// Units the game released in the tick under way, by root: offered at its `TickEnd`.
    pub released: BTreeMap<u64, Released>,
    /// Every member of a unit in `released` -> its root (the game must not write them).
    pub released_by: HashMap<u64, u64>,
    /// Completed handoffs of the last second, for the live map.
    pub recent: crate::model::recent_handoffs::RecentHandoffs,
}

impl Handoffs {
    /// Whether `id` is frozen for a handoff of this node, or released by its game and waiting
    /// for the answer: nothing is applied to it until it thaws or moves on.
    pub(crate) fn frozen(&self, id: u64) -> bool {
        self.outgoing.is_frozen(id) || self.released_by.contains_key(&id)
    }
}

/// A unit the game handed over itself (`Release`): its snapshots, taken as its tick ended.
#[derive(Debug, Clone)]
pub(crate) struct Released {
    pub epoch: u64,
    pub state: Bytes,
    pub attachments: Vec<local::Snapshot>,
}

/// Whether an owned entity is handed over now.
enum Due {
    /// It stays: not far enough past the border (or nowhere else to go).
    No,
    /// It is due, but not yet: the target is unreachable, behind on the partition, holds no
    /// ghost of it yet, or refused lately. Checked again at the next tick.
    Later(&'static str),
    Now(NodeId),
}

/// Frames of a newer epoch wait this long for the old owner's word (`EntityMoved`); then the
/// ghost follows the newer owner anyway (the word was lost with a link that came back, or this
/// node had left the old owner's holders).
const HELD_MAX_MS: u64 = 2_000;
/// How long an entity due for a handoff waits for its target to hold its ghost before it is
/// offered anyway (a target subscribes to its band within a few round trips of starting).
const GHOST_WAIT_MS: u64 = 1_000;
/// How long after adopting a master its inputs may arrive out of order (the old owner's
/// forwards against the gateway's direct sends): longer than the slowest round trip.
const REORDER_WINDOW_MS: u64 = 500;
/// Forwards of one input between owners before it counts as looping: a master handed on while
/// its input was in flight takes one or two.
const MAX_INPUT_HOPS: u32 = 4;

/// A frame the fence may hold until its entity's epoch change is seen.
#[derive(Debug, Clone)]
pub(crate) enum Fenced {
    State(NodeId, mesh::EntityState),
    Gone(NodeId, mesh::EntityGone),
    Input(mesh::ForwardInput),
    Command(Box<mesh::EntityCommand>),
}

/// What a frozen entity's handoff holds for it and sends on behind its offer: applied here if
/// the offer is refused, by the target if it is adopted, never by both.
#[derive(Debug, Clone)]
pub(crate) enum Routed {
    Input(local::Input),
    Command(Box<mesh::EntityCommand>),
}

impl Routed {
    pub(crate) fn is_input(&self) -> bool {
        matches!(self, Routed::Input(_))
    }
}

impl Core {
    // ------------------------------------------------------------------ source

    /// At the tick's end, before its state goes out: offers what the game released in it, so
    /// the offer leads the tick's traffic on the link and its target's game gets the `Adopt` as
    /// early as it can. (The target holds the ghost already: an offer waits for that.)
    pub(crate) fn offer_releases(&mut self) {
        if self.handoff.released.is_empty() {
            return;
        }
        let released = std::mem::take(&mut self.handoff.released);
        self.handoff.released_by.clear();
        let alone = if self.game.slot.is_none() {
            Some("the game went away")
        } else if !self.authority.lease_live {
            Some("this node's lease lapsed or was lost")
        } else if !self.mesh.clustered() {
            Some("this node is alone in the world")
        } else {
            None
        };
        for (root, r) in released {
            match alone {
                Some(reason) => self.keep_released(root, &r, reason),
                None => self.offer_released(root, r),
            }
        }
    }

    /// After the tick's moves: offers every owned entity standing far enough in another node's
    /// area (and those a new partition gave away, or that wait for a retry).
    pub(crate) fn check_handoffs(&mut self, changes: &TickChanges) {
        if self.game.slot.is_none() || !self.authority.lease_live || !self.mesh.clustered() {
            return;
        }
        let mut ids = std::mem::take(&mut self.handoff.recheck);
        ids.extend(
            changes
                .iter()
                .filter(|(_, c)| c.moved || c.spawned)
                .map(|(id, _)| *id),
        );
        for id in ids {
            if let Due::Now(to) = self.handoff_due(id) {
                self.begin_handoff(id, to);
            }
        }
    }

    /// Whether owned entity `id` is handed over now, keeping the bookkeeping of those that
    /// wait (a retry at the next tick, how long they waited for the target's ghost).
    fn handoff_due(&mut self, id: u64) -> Due {
        let me = self.cx.config.node_id;
        let now = self.cx.now.mono_ms;
        let Some(e) = self.table.get_local(id) else {
            self.handoff.mass.remove(&id);
            self.handoff.ghost_wait.remove(&id);
            return Due::No;
        };
        // Attachments move with their root.
        if e.parent_id != 0 && self.table.get_local(e.parent_id).is_some() {
            return Due::No;
        }
        if self.handoff.outgoing.is_frozen(id) {
            return Due::No;
        }
        let margin = if self.handoff.mass.contains(&id) {
            0
        } else {
            i64::from(self.cx.config.handoff_margin_chunks)
        };
        let Some(to) = crate::model::handoff::trigger(
            &self.authority.partition,
            me,
            &self.authority.area,
            e.chunk,
            margin,
        ) else {
            self.handoff.mass.remove(&id);
            self.handoff.ghost_wait.remove(&id);
            return Due::No;
        };
        // The target must hold the entity's ghost when the offer reaches it: this node has
        // sent it the full state on the same ordered link (or it stands beyond the reach the
        // target subscribes to, and the offer says so).
        let unseen = subs::distance_to_area(&self.cx.config.world, &self.authority.area, e.chunk)
            > self.cx.config.reach_chunks();
        let seen = unseen || self.replication.holds_ghost(id, to);
        // A target that never subscribes (no game to tick, say) is offered all the same after
        // a while, and answers for itself.
        let waited = *self.handoff.ghost_wait.entry(id).or_insert(now);
        let seen = seen || now >= waited + GHOST_WAIT_MS;
        let why = if !self.mesh.is_up(to) {
            Some("the node that owns its position is unreachable")
        } else if self.mesh.peer_partition(to) < self.authority.partition.epoch() {
            Some("the node that owns its position is behind on the partition")
        } else if !seen {
            Some("the node that owns its position holds no ghost of it yet")
        } else if self.handoff.retry.get(&id).is_some_and(|t| *t > now) {
            Some("the node that owns its position refused it lately")
        } else {
            None
        };
        if let Some(why) = why {
            self.handoff.recheck.insert(id);
            return Due::Later(why);
        }
        self.handoff.ghost_wait.remove(&id);
        Due::Now(to)
    }

    /// Freezes `root`'s unit in the game for a handoff to `to`.
    fn begin_handoff(&mut self, root: u64, to: NodeId) {
        let me = self.cx.config.node_id;
        let Some(epoch) = self.table.get_local(root).map(|e| e.epoch) else {
            return;
        };
        let attachments = self.attachments_of(root);
        match self
            .handoff
            .outgoing
            .begin(root, epoch, &attachments, to, self.cx.now.mono_ms)
        {
            Ok(freeze) => {
                self.cx.metrics.handoff(me, to, "started");
                for m in freeze.members {
                    self.freeze_in_game(m);
                }
            }
            Err(e) => tracing::debug!(entity = root, error = %e, "handoff not begun"),
        }
    }

    /// Tells the game to stop writing `id` under its current epoch (it answers with its
    /// snapshot).
    pub(crate) fn freeze_in_game(&mut self, id: u64) {
        let Some(epoch) = self.table.get(id).map(|e| e.epoch) else {
            return;
        };
        self.cx.out.to_game.push(
            sidecar_message::Body::Freeze(local::Freeze {
                entity_id: id,
                entity_epoch: epoch,
            })
            .into(),
        );
    }

    /// `Release` from the game: checked now, offered at the tick's end. Every release is answered
    /// by an `Evict` or a `Thaw` (after an `Error` if it was wrong), so the game never holds an
    /// entity frozen for nothing.
    pub(crate) fn on_release(&mut self, r: local::Release) {
        let id = r.entity_id;
        let Some(e) = self.table.get_local(id) else {
            self.entity_error(EntityError::Unknown(id));
            return self.thaw_released(id, "the sidecar holds no such entity of this game");
        };
        let (epoch, parent) = (e.epoch, e.parent_id);
        if r.entity_epoch != epoch {
            let detail = format!(
                "Release of entity {id} under epoch {}, the entity is at epoch {epoch}",
                r.entity_epoch
            );
            self.game_error(ErrorCode::InvalidValue, detail.clone(), id);
            return self.thaw_released(id, &detail);
        }
        if self.handoff.outgoing.is_frozen(id) {
            // It crossed our `Freeze`: its snapshots answer it.
            let root = local::Snapshot {
                entity_id: id,
                entity_epoch: epoch,
                state: r.state,
            };
            for s in std::iter::once(root).chain(r.attachments) {
                self.on_snapshot(s);
            }
            return;
        }
        if self.handoff.released_by.contains_key(&id) {
            // The first release is answered; this one is not.
            return self.game_error(
                ErrorCode::UnexpectedMessage,
                format!("entity {id} was released already in this tick"),
                id,
            );
        }
        if !self.may_write(id) {
            return self.thaw_released(id, "this node may not hand it over now");
        }
        let mut members = self.attachments_of(id);
        members.push(id);
        if members
            .iter()
            .any(|m| self.table.get_local(*m).is_some_and(|e| e.is_master))
        {
            // Inputs already on their way to the game would reach an avatar frozen there, with
            // nobody to apply them; a Freeze holds them here instead.
            return self.thaw_released(
                id,
                "a player's avatar is handed over by Freeze, so that no input on its way to the game is lost",
            );
        }
        if parent != 0 && self.table.get_local(parent).is_some() {
            let detail = format!(
                "entity {id} is attached to entity {parent}: release the root, whose unit it moves with"
            );
            self.game_error(ErrorCode::InvalidValue, detail.clone(), id);
            return self.thaw_released(id, &detail);
        }
        for m in members {
            self.handoff.released_by.insert(m, id);
        }
        self.handoff.released.insert(
            id,
            Released {
                epoch,
                state: r.state,
                attachments: r.attachments,
            },
        );
    }

    fn thaw_released(&mut self, id: u64, reason: &str) {
        self.cx.metrics.releases_kept.inc();
        if self.lease_lapsed() {
            // Stays frozen, with the rest, until the lease is back.
            self.authority.frozen_by_lapse.insert(id);
            return;
        }
        self.cx.out.to_game.push(
            sidecar_message::Body::Thaw(local::Thaw {
                entity_id: id,
                reason: format!("released, but kept: {reason}"),
            })
            .into(),
        );
    }

    /// A unit the game released: offered now if it is due and its target ready, else thawed.
    fn offer_released(&mut self, root: u64, r: Released) {
        let me = self.cx.config.node_id;
        let to = match self.handoff_due(root) {
            Due::Now(to) => to,
            Due::No => {
                return self.keep_released(
                    root,
                    &r,
                    "it is inside this node's area or within the handoff margin of it",
                )
            }
            Due::Later(why) => return self.keep_released(root, &r, why),
        };
        let attachments = self.attachments_of(root);
        let begun =
            self.handoff
                .outgoing
                .begin(root, r.epoch, &attachments, to, self.cx.now.mono_ms);
        if let Err(e) = begun {
            tracing::debug!(entity = root, error = %e, "released unit not offered");
            return self.keep_released(root, &r, "it is in another handoff");
        }
        self.cx.metrics.handoff(me, to, "released");
        let now = self.cx.now.mono_ms;
        // What the game's release holds is the freshest checkpoint there is, as a snapshot.
        let mut parts: Vec<(u64, Bytes)> = vec![(root, r.state)];
        for a in r.attachments {
            let current = self.table.get_local(a.entity_id).map(|e| e.epoch);
            if attachments.contains(&a.entity_id) && current == Some(a.entity_epoch) {
                parts.push((a.entity_id, a.state));
            }
        }
        let mut offer = None;
        let mut snapshotted = Vec::with_capacity(parts.len());
        for (id, state) in parts {
            let epoch = self.table.get_local(id).map_or(r.epoch, |e| e.epoch);
            self.game.checkpoints.taken(id, epoch, state.clone(), now);
            snapshotted.push(id);
            if let Ok(Some(o)) = self.handoff.outgoing.snapshot(id, state) {
                offer = Some(o);
            }
        }
        match offer {
            Some(offer) => self.send_offer(offer, false),
            // Attachments the release did not carry: their snapshots are asked for.
            None => {
                for m in attachments {
                    if !snapshotted.contains(&m) {
                        self.freeze_in_game(m);
                    }
                }
            }
        }
    }

    /// A released unit stays here: the game resumes it.
    fn keep_released(&mut self, root: u64, r: &Released, reason: &str) {
        tracing::debug!(entity = root, reason, "released entity kept");
        let members = std::iter::once(root).chain(r.attachments.iter().map(|a| a.entity_id));
        for id in members.collect::<Vec<_>>() {
            self.thaw_released(id, reason);
        }
    }

    /// The local entities attached (directly or not) to `root`.
    pub(crate) fn attachments_of(&self, root: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut parents = vec![root];
        while let Some(p) = parents.pop() {
            for e in self.table.iter() {
                if e.origin.is_none() && e.parent_id == p && e.id != root && !out.contains(&e.id) {
                    out.push(e.id);
                    parents.push(e.id);
                }
            }
        }
        out
    }

    /// Whether the game may write `id` now; if not, it is told why (and nothing changes).
    pub(crate) fn may_write(&mut self, id: u64) -> bool {
        if !self.authority.lease_live {
            self.game_error(
                ErrorCode::NotOwner,
                format!(
                    "entity {id}: this node's lease lapsed or was lost; everything it owns is frozen"
                ),
                id,
            );
            return false;
        }
        if let Some(root) = self.handoff.released_by.get(&id) {
            let root = *root;
            self.game_error(
                ErrorCode::NotOwner,
                format!(
                    "entity {id} was released for a handoff (with entity {root}): the game must not write it until Thaw or Evict"
                ),
                id,
            );
            return false;
        }
        if !self.handoff.outgoing.writable(id) {
            self.game_error(
                ErrorCode::NotOwner,
                format!(
                    "entity {id} is frozen for a handoff: the game must not write it until Thaw or Evict"
                ),
                id,
            );
            return false;
        }
        true
    }

    pub(crate) fn on_snapshot(&mut self, s: local::Snapshot) {
        if !self.authority.lease_live {
            // Frozen by a lapsed or lost lease: nothing is offered; the snapshot is not needed.
            self.authority.lapse_freeze_unanswered.remove(&s.entity_id);
            return;
        }
        if self.authority.snapshot_owed.remove(&s.entity_id)
            && !self.handoff.outgoing.is_frozen(s.entity_id)
        {
            // The answer to a lapse's Freeze, come after the lease was back and the Thaw sent.
            return;
        }
        if !self.handoff.outgoing.is_frozen(s.entity_id) {
            return self.game_error(
                ErrorCode::UnexpectedMessage,
                format!(
                    "Snapshot of entity {}, which is not frozen for a handoff",
                    s.entity_id
                ),
                s.entity_id,
            );
        }
        let epoch = self.table.get_local(s.entity_id).map(|e| e.epoch);
        if epoch != Some(s.entity_epoch) {
            return self.game_error(
                ErrorCode::InvalidValue,
                format!(
                    "Snapshot of entity {} under epoch {}, the Freeze named epoch {:?}",
                    s.entity_id, s.entity_epoch, epoch
                ),
                s.entity_id,
            );
        }
        // A handoff's snapshot is the freshest checkpoint there is (if it is refused, the entity
        // stays here with exactly this state).
        self.game.checkpoints.taken(
            s.entity_id,
            s.entity_epoch,
            s.state.clone(),
            self.cx.now.mono_ms,
        );
        match self.handoff.outgoing.snapshot(s.entity_id, s.state) {
            Ok(Some(offer)) => self.send_offer(offer, false),
            Ok(None) => {}
            Err(e) => self.game_error(ErrorCode::UnexpectedMessage, e.to_string(), s.entity_id),
        }
    }

    /// Where `account`'s session is: (gateway node, session epoch).
    pub(crate) fn session_of(&self, account: &str) -> Option<(NodeId, u64)> {
        if let Some(key) = self.gateway.clients.key_of(account) {
            if let Some(epoch) = self.gateway.sessions.get(key).and_then(|s| s.epoch) {
                return Some((self.cx.config.node_id, epoch));
            }
        }
        self.routing
            .remote_player(account)
            .map(|r| (r.gateway_node, r.session_epoch))
    }

    /// An offer of `e` under `epoch` with its game's `state`, as a target adopts it: where it
    /// stands, what it is, and for a player's master the session it routes to and the last
    /// input its game was handed (a handoff's offer and a checkpoint in the store alike).
    pub(crate) fn offer_of(&self, e: &Entity, epoch: u64, state: Bytes) -> mesh::HandoffOffer {
        let session = (e.is_master && !e.owner_account.is_empty())
            .then(|| self.session_of(&e.owner_account))
            .flatten();
        mesh::HandoffOffer {
            entity_id: e.id,
            entity_epoch: epoch,
            position: Some(vec3(e.position)),
            state,
            owner_account: e.owner_account.clone(),
            is_master: e.is_master,
            components: owned_components(e),
            gateway_node: session.map_or(0, |s| s.0),
            session_epoch: session.map_or(0, |s| s.1),
            last_input_seq: session
                .and_then(|s| {
                    let (epoch, seq) = self.handoff.input_order.last_of(&e.owner_account)?;
                    (epoch == s.1).then_some(seq)
                })
                .unwrap_or(0),
            state_unix_ms: self.cx.now.unix_ms,
            claims: self.claims.of([e.id]),
            ..Default::default()
        }
    }

    pub(crate) fn send_offer(&mut self, offer: Offer<Routed>, successor: bool) {
        let root = offer.root;
        let Some(e) = self.table.get_local(root) else {
            tracing::warn!(
                entity = root,
                "the frozen entity left the table; offer not sent"
            );
            return;
        };
        let mut parts = offer.parts.iter();
        let state = parts.next().map(|p| p.1.clone()).unwrap_or_default();
        let attachments = parts
            .filter_map(|(id, state)| {
                let a = self.table.get_local(*id)?;
                Some(mesh::HandoffPart {
                    entity_id: a.id,
                    position: Some(vec3(a.position)),
                    state: state.clone(),
                    owner_account: a.owner_account.clone(),
                    is_master: a.is_master,
                    parent_id: a.parent_id,
                    components: owned_components(a),
                })
            })
            .collect();
        let command_cursors = offer
            .parts
            .iter()
            .flat_map(|(id, _)| self.command_cursors(*id))
            .collect();
        let claims = self.claims.of(offer.parts.iter().map(|(id, _)| *id));
        let msg = mesh::HandoffOffer {
            partition_epoch: self.authority.partition.epoch(),
            command_cursors,
            claims,
            attachments,
            successor,
            unseen: subs::distance_to_area(&self.cx.config.world, &self.authority.area, e.chunk)
                > self.cx.config.reach_chunks(),
            ..self.offer_of(e, offer.epoch, state)
        };
        tracing::debug!(
            entity = root,
            to = offer.to,
            epoch = offer.epoch,
            successor,
            claims = ?msg.claims.iter().map(|c| &c.key).collect::<Vec<_>>(),
            "offer sent"
        );
        let (to, kept) = (offer.to, msg.clone());
        if !self.send_peer(offer.to, mesh_message::Body::HandoffOffer(msg)) {
            // It never left: the unit may thaw (a link lost after sending leaves it in doubt).
            if let Ok(thawed) = self.handoff.outgoing.unsent(root, self.cx.now.mono_ms) {
                self.cx
                    .metrics
                    .handoff(self.cx.config.node_id, offer.to, "unsent");
                self.thaw(root, thawed, "the target was unreachable");
            }
            return;
        }
        // The game's part of the freeze is over (a repeated offer keeps the first answer).
        let now = self.cx.now.mono_ms;
        let last_tick = self.game.last_tick_end_ms.unwrap_or(0);
        self.handoff.outgoing.answered(root, now, last_tick);
        // Kept until the target has surely checkpointed it (see `restore`).
        let to_lease = self.restore.live.get(&to).copied().unwrap_or(0);
        self.restore.sent.insert(
            root,
            super::restore::SentOffer {
                at_ms: now,
                to,
                to_lease,
                offer: kept,
            },
        );
        for held in offer.inputs {
            match held {
                Routed::Input(i) => {
                    if !send_forward(&mut self.cx, &self.mesh, offer.to, root, offer.epoch, i, 0) {
                        self.handoff.outgoing.forward_failed(root);
                    }
                }
                // A copy stays with the unit: applied here if the offer is refused.
                Routed::Command(c) => {
                    self.forward_command(offer.to, offer.epoch, *c, true);
                }
            }
        }
        self.cx
            .metrics
            .handoffs_in_doubt
            .set(self.handoff.outgoing.in_doubt().count() as i64);
    }

    /// The game despawned `ids` (or went away with them): a unit frozen for a handoff waits
    /// for no snapshot of them. The rest of the unit is offered, or thawed if its root went.
    pub(crate) fn despawned_while_frozen(&mut self, gone: &[Entity]) {
        let ids: Vec<u64> = gone.iter().map(|e| e.id).collect();
        for after in self.handoff.outgoing.despawned(&ids, self.cx.now.mono_ms) {
            match after {
                AfterDespawn::Offer(offer) => self.send_offer(offer, false),
                AfterDespawn::Abandoned { root, to, thawed } => {
                    self.cx
                        .metrics
                        .handoff(self.cx.config.node_id, to, "abandoned");
                    // A leave kept for the new owner is moot: the avatar is gone.
                    if let Some(e) = gone.iter().find(|e| e.id == root && e.is_master) {
                        self.handoff.leaving.remove(&e.owner_account);
                    }
                    // The attachments left are roots of their own now: checked at the next tick.
                    self.handoff.recheck.extend(thawed.members.iter().copied());
                    self.thaw(root, thawed, "the entity was despawned before its snapshot");
                    self.handoff.retry.remove(&root);
                }
            }
        }
    }

    /// Every unit still waiting for a snapshot is thawed: its game went away (its entities kept
    /// for its return), so no snapshot will come.
    pub(crate) fn abandon_freezing(&mut self, reason: &str) {
        // What it released is kept here too (its entities stay for its return).
        self.handoff.released.clear();
        self.handoff.released_by.clear();
        for (root, to, thawed) in self.handoff.outgoing.abandon_freezing(self.cx.now.mono_ms) {
            self.cx
                .metrics
                .handoff(self.cx.config.node_id, to, "abandoned");
            self.thaw(root, thawed, reason);
            self.handoff.retry.remove(&root);
        }
    }

    /// `account` left: if its master is frozen in a handoff, the leave is kept for the new owner.
    pub(crate) fn leave_follows_handoff(&mut self, account: &str, epoch: u64, reason: &str) {
        let frozen = self
            .table
            .master_of(account)
            .is_some_and(|e| e.origin.is_none() && self.handoff.outgoing.is_frozen(e.id));
        if frozen {
            self.handoff.leaving.insert(
                account.to_string(),
                mesh::PeerPlayerLeave {
                    account: account.to_string(),
                    session_epoch: epoch,
                    reason: reason.to_string(),
                },
            );
        }
    }

    pub(crate) fn thaw(&mut self, root: u64, thawed: Thawed<Routed>, reason: &str) {
        let now = self.cx.now.mono_ms;
        // A thawed master's game applies the leave it holds itself.
        for m in &thawed.members {
            if let Some(e) = self.table.get_local(*m).filter(|e| e.is_master) {
                let account = e.owner_account.clone();
                self.handoff.leaving.remove(&account);
            }
        }
        self.cx.metrics.freeze_done(thawed.freeze_ms);
        let lapsed = self.lease_lapsed();
        for m in &thawed.members {
            self.claims_thawed(*m);
            if lapsed {
                // Stays frozen, with the rest, until the lease is back.
                self.authority.frozen_by_lapse.insert(*m);
                continue;
            }
            self.cx.out.to_game.push(
                sidecar_message::Body::Thaw(local::Thaw {
                    entity_id: *m,
                    reason: reason.to_string(),
                })
                .into(),
            );
        }
        // Everything a unit held went behind its offer, or nothing did; the commands among
        // them are no input's copies.
        let commands = thawed.inputs.iter().filter(|r| !r.is_input()).count() as u64;
        self.cx
            .metrics
            .inputs_copies_applied
            .inc_by(thawed.forwarded_copies.saturating_sub(commands));
        for held in thawed.inputs {
            match held {
                Routed::Input(i) => self.input_to_game(i),
                Routed::Command(c) => self.route_command(*c),
            }
        }
        self.handoff
            .retry
            .insert(root, now + self.cx.config.handoff_retry_ms);
        self.handoff.recheck.insert(root);
        self.cx
            .metrics
            .handoffs_in_doubt
            .set(self.handoff.outgoing.in_doubt().count() as i64);
    }

    pub(crate) fn on_handoff_ack(&mut self, from: NodeId, a: mesh::HandoffAck) {
        if self.on_restore_answer(from, a.entity_id, a.entity_epoch, None) {
            return;
        }
        match self
            .handoff
            .outgoing
            .acked(a.entity_id, a.entity_epoch, from, self.cx.now.mono_ms)
        {
            Ok(done) => {
                self.note_freeze_cost(&done, a.adopt_timing);
                self.complete_handoff(done)
            }
            // A repeated ack of a handoff already complete, or of an offer not made.
            Err(e) => {
                self.cx.metrics.drop_msg("handoff_ack_unexpected", 1);
                tracing::debug!(peer = from, error = %e, "handoff ack ignored");
            }
        }
    }

    pub(crate) fn on_handoff_refused(&mut self, from: NodeId, r: mesh::HandoffRefused) {
        if self.on_restore_answer(from, r.entity_id, r.entity_epoch, Some(&r.reason)) {
            return;
        }
        match self
            .handoff
            .outgoing
            .refused(r.entity_id, r.entity_epoch, from, self.cx.now.mono_ms)
        {
            Ok(thawed) => {
                self.restore.sent.remove(&r.entity_id);
                self.cx
                    .metrics
                    .handoff(self.cx.config.node_id, from, "refused");
                self.cx.metrics.handoffs_refused.inc();
                tracing::debug!(entity = r.entity_id, peer = from, reason = %r.reason, "handoff refused");
                self.thaw(r.entity_id, thawed, &r.reason);
            }
            Err(e) => {
                self.cx.metrics.drop_msg("handoff_refusal_unexpected", 1);
                tracing::debug!(peer = from, error = %e, "handoff refusal ignored");
            }
        }
    }

    /// What an acked handoff cost (see [`freeze_cost`]), when the ack says how long the target's
    /// game took. An ack repeated after a lost link, or a handoff proved by the target's frames,
    /// has no such word: its freeze is counted, its cost is not.
    fn note_freeze_cost(&self, done: &Completed, timing: Option<mesh::AdoptTiming>) {
        let (Some(answered), Some(timing)) = (done.answered, timing) else {
            return;
        };
        let tick_ms = self
            .game
            .slot
            .as_ref()
            .map(|g| g.hello.tick_rate_hz)
            .filter(|hz| *hz > 0)
            .map(|hz| 1000.0 / f64::from(hz));
        let cost = freeze_cost(answered, self.cx.now.mono_ms, timing.game_ms, tick_ms);
        self.cx.metrics.freeze_cost(&cost);
    }

    /// The target owns the unit: the game evicts it, this node keeps it as a render ghost (no
    /// vanish), its holders learn the new owner, and so does the player's gateway.
    pub(crate) fn complete_handoff(&mut self, done: Completed) {
        let me = self.cx.config.node_id;
        self.cx.metrics.handoff(me, done.to, "completed");
        for _ in 0..done.unforwarded {
            self.cx.metrics.drop_input("input_peer_down");
        }
        self.cx.metrics.handoffs_out.inc();
        self.cx.metrics.freeze_done(done.freeze_ms);
        for &id in &done.members {
            if let Some(e) = self.table.get(id) {
                let at = (e.position.x, e.position.y);
                self.handoff
                    .recent
                    .push(self.cx.now.mono_ms, id, at, me, done.to);
            }
            self.cx
                .out
                .to_game
                .push(sidecar_message::Body::Evict(local::Evict { entity_id: id }).into());
            self.game.checkpoints.forget(id);
            self.handoff.mass.remove(&id);
            self.handoff.retry.remove(&id);
            let holders = self.replication.handed_away(id);
            tracing::debug!(
                me,
                entity = id,
                to = done.to,
                epoch = done.epoch,
                ?holders,
                "handoff complete; telling the holders"
            );
            for &node in &holders {
                self.send_peer(
                    node,
                    mesh_message::Body::EntityMoved(mesh::EntityMoved {
                        entity_id: id,
                        entity_epoch: done.epoch,
                        owner_node: done.to,
                        holders: if node == done.to {
                            holders.iter().copied().filter(|n| *n != done.to).collect()
                        } else {
                            vec![]
                        },
                    }),
                );
            }
            if !holders.contains(&done.to) {
                self.send_peer(
                    done.to,
                    mesh_message::Body::EntityMoved(mesh::EntityMoved {
                        entity_id: id,
                        entity_epoch: done.epoch,
                        owner_node: done.to,
                        holders: holders.iter().copied().collect(),
                    }),
                );
            }
            // Commands held here for a gap in their order follow it (its new writer orders them
            // from the cursors the offer carried).
            for c in self.commands.forget(id) {
                self.forward_command(done.to, done.epoch, c, false);
            }
            self.claims_handed_away(id);
            let Some(e) = self.table.get_local(id) else {
                continue;
            };
            let (chunk, pos, master) = (
                e.chunk,
                e.position,
                (e.is_master && !e.owner_account.is_empty()).then(|| e.owner_account.clone()),
            );
            // A chunk a client here views is followed at the new owner (subscribed now if it
            // was not yet): the entity stays as its ghost, with no vanish.
            if self.replication.subscribes(chunk, done.to) || self.follow(chunk, done.to) {
                self.table.to_ghost(id, done.to, done.epoch);
                for f in self.handoff.fence.advance(id, done.epoch, done.to) {
                    self.apply_fenced(f);
                }
            } else {
                // Nobody here looks there: no client can see it go, and nothing is fenced.
                let _ = self.table.despawn(id);
                self.handoff.fence.forget(id);
            }
            if let Some(account) = master {
                // Late inputs follow it even when no ghost of it stays here; so do those still
                // held here for a gap in their order (the new owner orders them from here on).
                self.handoff.departed_masters.insert(account.clone(), id);
                for i in self.handoff.input_order.forget(&account) {
                    self.forward_routed(id, done.to, done.epoch, i, 0);
                }
                if let Some(leave) = self.handoff.leaving.remove(&account) {
                    self.send_peer(done.to, mesh_message::Body::PlayerLeave(leave));
                }
                // A newer session joined while the offer was out: its join follows the avatar
                // (the offer carries the session it was made under).
                let offered = self
                    .restore
                    .sent
                    .get(&id)
                    .map_or(0, |s| s.offer.session_epoch);
                if let Some(r) = self.routing.remote_player(&account) {
                    if r.session_epoch > offered && r.gateway_node != done.to {
                        self.send_peer(
                            done.to,
                            mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
                                account: account.clone(),
                                session_epoch: r.session_epoch,
                                last_position: None,
                                gateway_node: r.gateway_node,
                            }),
                        );
                    }
                }
                self.routing.remove_remote_player(&account);
                if self.gateway.clients.key_of(&account).is_some() {
                    // This node is the player's gateway: its input goes to the new owner now.
                    // An anchor the new owner sent first (the ack was lost and a later frame
                    // proved it) says where the avatar is now; the frozen copy's place is old.
                    let anchored = self.gateway.master_owner.get(&account) == Some(&done.to)
                        && self
                            .gateway
                            .master_epoch
                            .get(&account)
                            .is_some_and(|e| *e >= done.epoch);
                    self.gateway.master_owner.insert(account.clone(), done.to);
                    if !anchored {
                        self.gateway
                            .master_epoch
                            .insert(account.clone(), done.epoch);
                        self.gateway
                            .clients
                            .set_remote_anchor(&account, Some(chunk));
                        self.gateway
                            .anchor_pos
                            .insert(account, [pos.x, pos.y, pos.z]);
                    }
                }
            }
        }
        self.cx
            .metrics
            .handoffs_in_doubt
            .set(self.handoff.outgoing.in_doubt().count() as i64);
    }

    /// The link to `node` is up again: offers in doubt towards it are repeated (a target that
    /// adopted answers with another ack), or re-made under a new epoch if a new process holds
    /// its id (it never saw the old offer; it adopts from the snapshot).
    pub(crate) fn resume_offers(&mut self, node: NodeId) {
        for root in self.handoff.outgoing.towards(node) {
            if self.restore.in_doubt_to_dead.contains_key(&root) {
                // Made to a process that died: the restore of its world settles it.
                continue;
            }
            if let Ok(offer) = self.handoff.outgoing.repeat(root) {
                self.send_offer(offer, false);
            }
        }
    }

    // ------------------------------------------------------------------ target

    pub(crate) fn on_handoff_offer(&mut self, from: NodeId, o: mesh::HandoffOffer) {
        let me = self.cx.config.node_id;
        let id = o.entity_id;
        if !self.restore.live.contains_key(&from) && from != me && self.restore.is_dead_node(from) {
            // From a process that died: its world is restored from elsewhere.
            return self.cx.metrics.drop_msg("offer_from_dead", 1);
        }
        if o.successor && self.table.get_local(id).is_some() {
            // A restore of what this node writes already (two rounds crossed): never adopted
            // twice.
            let refused = mesh::HandoffRefused {
                entity_id: id,
                entity_epoch: o.entity_epoch,
                reason: super::restore::ALREADY_WRITES.into(),
            };
            return self.answer_offer(from, mesh_message::Body::HandoffRefused(refused));
        }
        let at = o.position.as_ref().map(|p| Pos { x: p.x, y: p.y });
        let owns = at.is_some_and(|p| self.authority.partition.owner_of(p).ok() == Some(me));
        let checks = OfferChecks {
            owns_position: owns,
            lease_live: self.authority.lease_live,
            partition_epoch_matches: o.partition_epoch == self.authority.partition.epoch(),
            has_ghost: o.successor
                || o.unseen
                || self.table.get(id).is_some_and(|e| e.origin == Some(from)),
            draining: self.authority.draining.is_some(),
            game_connected: self.game.slot.is_some(),
        };
        let known = self.handoff.fence.current(id).map(|(e, _)| e);
        match self
            .handoff
            .inbound
            .offer(from, id, o.entity_epoch, known, checks)
        {
            OfferDecision::Adopt => {
                let adopt = self.adopt_message(&o);
                for m in std::iter::once(id).chain(o.attachments.iter().map(|a| a.entity_id)) {
                    if self.replication.forget_sim_ghost(m) {
                        self.cx.out.to_game.push(
                            sidecar_message::Body::GhostLeave(local::GhostLeave { entity_id: m })
                                .into(),
                        );
                    }
                }
                self.cx
                    .out
                    .to_game
                    .push(sidecar_message::Body::Adopt(adopt).into());
                self.handoff.adopting.insert(id, o);
                self.handoff.adopt_sent_ms.insert(id, self.cx.now.mono_ms);
            }
            OfferDecision::Pending => {}
            OfferDecision::Ack => {
                self.answer_offer(
                    from,
                    mesh_message::Body::HandoffAck(mesh::HandoffAck {
                        entity_id: id,
                        entity_epoch: o.entity_epoch,
                        adopt_timing: None,
                    }),
                );
            }
            OfferDecision::Refuse(r) => {
                // Inputs held for the refused epoch are copies: the source keeps the originals
                // and applies them when it thaws.
                self.count_fence_discards();
                self.handoff.fence.burn(id, o.entity_epoch);
                // So are commands: their copies are applied there, and answered from there.
                let copies = self
                    .handoff
                    .fence
                    .take_discarded()
                    .iter()
                    .filter(|f| matches!(f, Fenced::Input(_)))
                    .count() as u64;
                self.cx.metrics.copies_refused(copies);
                self.cx.metrics.handoff(from, me, "refused");
                self.answer_offer(
                    from,
                    mesh_message::Body::HandoffRefused(mesh::HandoffRefused {
                        entity_id: id,
                        entity_epoch: o.entity_epoch,
                        reason: r.as_str().to_string(),
                    }),
                );
            }
            OfferDecision::Stale => {
                self.cx.metrics.stale_epoch_drops.inc();
                self.cx.metrics.drop_msg("stale_offer", 1);
                if o.successor {
                    // A restore under an epoch this node saw already (its decider died and the
                    // next one chose the same): refused, so it comes again above it instead of
                    // being retried unanswered forever.
                    let refused = mesh::HandoffRefused {
                        entity_id: id,
                        entity_epoch: o.entity_epoch,
                        reason: super::restore::STALE_RESTORE.into(),
                    };
                    self.answer_offer(from, mesh_message::Body::HandoffRefused(refused));
                }
            }
        }
    }

    pub(crate) fn adopt_message(&self, o: &mesh::HandoffOffer) -> local::Adopt {
        local::Adopt {
            entity_id: o.entity_id,
            entity_epoch: o.entity_epoch,
            position: o.position.as_ref().map(local_vec3),
            state: o.state.clone(),
            owner_account: o.owner_account.clone(),
            is_master: o.is_master,
            attachments: o
                .attachments
                .iter()
                .map(|a| local::Adopt {
                    entity_id: a.entity_id,
                    entity_epoch: o.entity_epoch,
                    position: a.position.as_ref().map(local_vec3),
                    state: a.state.clone(),
                    owner_account: a.owner_account.clone(),
                    is_master: a.is_master,
                    attachments: vec![],
                })
                .collect(),
        }
    }

    pub(crate) fn on_adopted(&mut self, a: local::Adopted) {
        let restored = self
            .table
            .get_local(a.entity_id)
            .is_some_and(|e| e.epoch == a.entity_epoch);
        if restored && self.game.restoring.remove(&a.entity_id) {
            // A returning game took back what it wrote: it writes it again from here on.
            self.cx.metrics.restored.inc();
            self.game
                .checkpoints
                .touched(a.entity_id, self.cx.now.mono_ms);
            return;
        }
        let offer = self
            .handoff
            .adopting
            .get(&a.entity_id)
            .filter(|o| o.entity_epoch == a.entity_epoch)
            .cloned();
        let source = offer
            .as_ref()
            .and_then(|_| self.handoff.inbound.adopted(a.entity_id, a.entity_epoch));
        let (Some(o), Some(source)) = (offer, source) else {
            return self.game_error(
                ErrorCode::UnexpectedMessage,
                format!(
                    "Adopted of entity {} under epoch {}: no such Adopt is pending",
                    a.entity_id, a.entity_epoch
                ),
                a.entity_id,
            );
        };
        self.handoff.adopting.remove(&a.entity_id);
        let adopt_timing =
            self.handoff
                .adopt_sent_ms
                .remove(&a.entity_id)
                .map(|sent| mesh::AdoptTiming {
                    game_ms: self.cx.now.mono_ms.saturating_sub(sent),
                });
        let me = self.cx.config.node_id;
        let epoch = o.entity_epoch;
        for full in members_of(&o) {
            let id = full.id;
            if let Err(e) = self.table.to_local(full) {
                tracing::error!(entity = id, error = %e, "installing an adopted entity failed");
                continue;
            }
            self.handoff.outgoing.forget(id);
            // The offer's snapshot is the first checkpoint of it here, under its new epoch.
            let state = if id == o.entity_id {
                Some(o.state.clone())
            } else {
                o.attachments
                    .iter()
                    .find(|a| a.entity_id == id)
                    .map(|a| a.state.clone())
            };
            if let Some(state) = state {
                self.game
                    .checkpoints
                    .taken(id, epoch, state, self.cx.now.mono_ms);
            }
        }
        // The player's inputs and routes follow its master.
        if o.is_master && !o.owner_account.is_empty() {
            let account = o.owner_account.clone();
            let until = self.cx.now.mono_ms + REORDER_WINDOW_MS;
            self.handoff
                .input_order
                .resume(&account, o.session_epoch, o.last_input_seq, until);
            self.handoff.departed_masters.remove(&account);
            // The session the avatar serves: the one the offer carries, or a newer one that
            // logged in meanwhile (on any gateway, after the old one died, say) and waits for
            // this avatar instead of spawning another.
            let local = self.session_epoch(&account).map(|(_, e)| e);
            let newer_remote = self
                .routing
                .route(&account)
                .filter(|r| r.gateway_node != me && r.session_epoch > o.session_epoch)
                .filter(|r| local.is_none_or(|l| r.session_epoch > l));
            if let Some(entry) = newer_remote {
                self.join_session(&account, entry);
            } else if o.gateway_node == me && local.is_none() {
                // The session was this node id's, but of a process that died: nothing here
                // routes for it, and a later login must not take the avatar for this node's.
            } else if o.gateway_node == me || local.is_some_and(|l| l > o.session_epoch) {
                // Gateway side only: the epoch its inputs are stamped with.
                self.gateway.master_epoch.insert(account.clone(), epoch);
                self.gateway.master_owner.insert(account.clone(), me);
                self.gateway.clients.set_remote_anchor(&account, None);
                self.gateway.anchor_pos.remove(&account);
                if let Some(l) = local.filter(|l| *l > o.session_epoch) {
                    self.join_here(&account, l, None);
                }
            } else if o.gateway_node != 0 {
                let entry = SessionEntry {
                    gateway_node: o.gateway_node,
                    session_epoch: o.session_epoch,
                };
                self.routing.serve(&account, entry);
                self.send_anchor(o.gateway_node, &account, o.session_epoch);
            }
        }
        self.resume_command_cursors(&o.command_cursors);
        self.claims_adopted(&o.claims);
        for m in std::iter::once(o.entity_id).chain(o.attachments.iter().map(|a| a.entity_id)) {
            for f in self.handoff.fence.advance(m, epoch, me) {
                self.apply_fenced(f);
            }
        }
        self.cx.metrics.handoff(source, me, "adopted");
        self.answer_offer(
            source,
            mesh_message::Body::HandoffAck(mesh::HandoffAck {
                entity_id: o.entity_id,
                entity_epoch: epoch,
                adopt_timing,
            }),
        );
    }

    /// The answer to an offer: to its source, or to this node's own restore of a dead
    /// process's entity.
    fn answer_offer(&mut self, source: NodeId, body: mesh_message::Body) {
        if source != self.cx.config.node_id {
            self.send_peer(source, body);
            return;
        }
        match body {
            mesh_message::Body::HandoffAck(a) => self.on_handoff_ack(source, a),
            mesh_message::Body::HandoffRefused(r) => self.on_handoff_refused(source, r),
            _ => {}
        }
    }
}

/// What the fence makes of a peer's `EntityState` before admitting it.
pub(crate) enum StateAhead {
    /// A change to an entity held nowhere here: for replication as it is, not fenced.
    Unheld(mesh::EntityState),
    /// A change to a stale ghost whose owner changed unseen: the chunk it stands in (if known)
    /// is asked of the sender afresh, and the change is let go.
    Resync(Option<ChunkPos>),
    /// Admitted next ([`Handoffs::admit_state`]), after the frames held for older epochs that
    /// a newer epoch's full state let go.
    Admit(Vec<Fenced>, mesh::EntityState),
}

impl Handoffs {
    // ------------------------------------------------------------------ observers

    /// A frame of `node` under the epoch this node offered `s`'s entity to it under: the target
    /// writes it, so it adopted (and the ack was lost). The handoff it completes, if any.
    pub(crate) fn observed(
        &mut self,
        cx: &Context,
        node: NodeId,
        s: &mesh::EntityState,
    ) -> Option<Completed> {
        self.outgoing
            .observed(s.entity_id, s.entity_epoch, node, cx.now.mono_ms)
    }

    /// What a frame about a foreign entity needs before the fence admits it.
    pub(crate) fn state_ahead(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        replication: &Replication,
        node: NodeId,
        s: mesh::EntityState,
    ) -> StateAhead {
        let (id, epoch) = (s.entity_id, s.entity_epoch);
        if !s.full && table.get(id).is_none() {
            // A change to an entity held nowhere here: nothing to keep in order, and holding it
            // for an epoch change this node may never hear of would keep it forever. The
            // observer side asks the owner for the whole state instead.
            return StateAhead::Unheld(s);
        }
        let newer = self
            .fence
            .current(id)
            .is_some_and(|(known, _)| epoch > known);
        if !s.full && newer && replication.is_stale(id) {
            // A stale ghost's owner changed while the old owner's link was down: its word
            // (`EntityMoved`) was lost with the link. The new owner sends the whole state again.
            let chunk = table.get(id).map(|e| e.chunk);
            let at = s
                .position
                .as_ref()
                .map(|p| cx.config.world.chunk_of(Pos { x: p.x, y: p.y }))
                .or(chunk);
            return StateAhead::Resync(at);
        }
        let mut due = Vec::new();
        if s.full && (table.get(id).is_none() || replication.is_stale(id)) && newer {
            // Nothing held here to keep in order, or only a stale ghost whose old owner's word
            // (`EntityMoved`) was lost with its link or will never come (this node is no longer
            // among its holders): a newer epoch's full state is the truth (only that epoch's
            // owner writes under it); frames held for older epochs go.
            due = self.fence.advance(id, epoch, node);
        }
        StateAhead::Admit(due, s)
    }

    /// A frame about a foreign entity, through the fence: the frame to apply now, if any (one
    /// of an epoch not seen yet is held, one of an older epoch dropped).
    pub(crate) fn admit_state(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        node: NodeId,
        s: mesh::EntityState,
    ) -> Option<Fenced> {
        let (id, epoch) = (s.entity_id, s.entity_epoch);
        match self
            .fence
            .admit(id, epoch, Some(node), Fenced::State(node, s))
        {
            Admit::Accept(f) => Some(f),
            Admit::Held => {
                tracing::debug!(me = cx.config.node_id, entity = id, epoch, peer = node, known = ?self.fence.current(id), ghost = ?table.get(id).map(|e| (e.origin, e.epoch)), "frame held for a newer epoch");
                None
            }
            Admit::Dropped(_) => {
                cx.metrics.stale_epoch_drops.inc();
                None
            }
        }
    }

    /// `EntityGone` from its owner, through the fence: the frame to apply now, if any. It is
    /// ordered with the owner's frames (a gone sent by a new owner must not pass the
    /// `EntityMoved` that makes it the owner here). Epoch 0: the entity was despawned; it goes
    /// whatever the epoch.
    pub(crate) fn admit_gone(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        node: NodeId,
        g: mesh::EntityGone,
    ) -> Option<Fenced> {
        if g.entity_epoch == 0 {
            return Some(Fenced::Gone(node, g));
        }
        let (id, epoch) = (g.entity_id, g.entity_epoch);
        // Gone from a view this node does not hold it in: moot.
        table.get(id)?;
        match self
            .fence
            .admit(id, epoch, Some(node), Fenced::Gone(node, g))
        {
            Admit::Accept(f) => Some(f),
            Admit::Held => None,
            Admit::Dropped(_) => {
                cx.metrics.stale_epoch_drops.inc();
                None
            }
        }
    }

    /// The fence follows `owner` for `id` from `epoch` on: the frames held for it are due.
    pub(crate) fn advance(&mut self, id: u64, epoch: u64, owner: NodeId) -> Vec<Fenced> {
        self.fence.advance(id, epoch, owner)
    }

    /// `id` is not held here any more: the fence forgets it (what it held is counted).
    pub(crate) fn forget_fenced(&mut self, id: u64) {
        self.fence.forget(id);
    }

    /// The gauge of the frames the fence holds.
    pub(crate) fn count_held(&self, cx: &Context) {
        cx.metrics.held_frames.set(self.fence.held() as i64);
    }

    /// Entities whose newer owner's frames waited too long for the old owner's word: their
    /// ghosts follow the newer owner. What waits for this node's own adoption waits for its
    /// game, however slow.
    pub(crate) fn overdue_frames(&mut self, cx: &Context) -> Vec<u64> {
        let now = cx.now.mono_ms;
        let held: BTreeSet<u64> = self
            .fence
            .held_by_epoch()
            .into_iter()
            .map(|(id, _, _)| id)
            .collect();
        self.held_since.retain(|id, _| held.contains(id));
        let mut overdue = Vec::new();
        for id in held {
            let since = *self.held_since.entry(id).or_insert(now);
            let adopting = self.adopting.contains_key(&id);
            if !adopting && now >= since + HELD_MAX_MS {
                self.held_since.remove(&id);
                tracing::debug!(
                    entity = id,
                    "held frames overdue: following the newer owner"
                );
                overdue.push(id);
            }
        }
        overdue
    }

    /// A ghost whose writer is gone: the newest owner the fence holds frames of, which it
    /// follows from now on (epoch, owner), and the frames due; `None` if it holds none.
    pub(crate) fn follow_newest(&mut self, id: u64) -> Option<(u64, NodeId, Vec<Fenced>)> {
        let (epoch, owner) = self.fence.held_newest(id)?;
        let due = self.fence.advance(id, epoch, owner);
        Some((epoch, owner, due))
    }
}

/// Where an input for a player's master goes next, as the fence and the handoff machine see it.
pub(crate) enum InputNext {
    /// Held by the fence, or dropped (and counted).
    Done,
    /// The handoff machine's route for the input of entity `id`; `owner` is the writer of the
    /// ghost this node holds, if it holds one.
    Route {
        id: u64,
        route: InputRoute<Routed>,
        hops: u32,
        owner: Option<(NodeId, u64)>,
    },
    /// For this node's game (its session is checked there).
    ToGame(local::Input),
}

impl Handoffs {
    // ------------------------------------------------------------------ inputs

    /// An input for `i.account`'s master, from its gateway (this node or a peer) or from the
    /// previous owner: to the game if this node writes the master, held while it is adopting
    /// it, forwarded if it was handed away.
    pub(crate) fn input_for_master(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        i: mesh::ForwardInput,
    ) -> InputNext {
        let master = table
            .master_of(&i.account)
            .map(|e| (e.id, e.origin, e.epoch));
        let input = local::Input {
            account: i.account.clone(),
            session_epoch: i.session_epoch,
            seq: i.seq,
            payload: i.payload.clone(),
        };
        let hops = i.hops + 1;
        if i.entity_id != 0 && self.fence.is_burnt(i.entity_id, i.entity_epoch) {
            // A copy forwarded behind an offer this node refused: its source applies the original.
            cx.metrics.copies_refused(1);
            return InputNext::Done;
        }
        match master {
            Some((id, None, epoch)) => {
                if i.entity_epoch != 0 && i.entity_epoch < epoch {
                    cx.metrics.stale_epoch_drops.inc();
                    cx.metrics.drop_input("stale_epoch_input");
                    return InputNext::Done;
                }
                if i.entity_epoch > epoch {
                    self.hold_input(cx, id, i);
                    return InputNext::Done;
                }
                let route = self.outgoing.route_input(id, Routed::Input(input));
                InputNext::Route {
                    id,
                    route,
                    hops,
                    owner: None,
                }
            }
            Some((id, Some(owner), epoch)) => {
                if i.entity_epoch > epoch {
                    // Forwarded behind an offer: due once this node adopted (or learns who
                    // did); a copy behind an offer it refused is dropped.
                    self.hold_input(cx, id, i);
                    return InputNext::Done;
                }
                let route = self.outgoing.route_input(id, Routed::Input(input));
                InputNext::Route {
                    id,
                    route,
                    hops,
                    owner: Some((owner, epoch)),
                }
            }
            None => {
                // Adopting the master from a snapshot (no ghost here): held until `Adopted`.
                let adopting = self
                    .adopting
                    .values()
                    .find(|o| o.is_master && o.owner_account == i.account)
                    .map(|o| (o.entity_id, o.entity_epoch));
                let departed = self.departed_masters.get(&i.account).copied();
                match (adopting, departed) {
                    (Some((id, epoch)), _) if i.entity_epoch >= epoch => {
                        self.hold_input(cx, id, i);
                        InputNext::Done
                    }
                    // Handed away, and no ghost of it stayed here: forwarded all the same.
                    (_, Some(id)) => {
                        let route = self.outgoing.route_input(id, Routed::Input(input));
                        InputNext::Route {
                            id,
                            route,
                            hops,
                            owner: None,
                        }
                    }
                    // Stamped for a master this process never held: it died with a process
                    // whose node id this one holds now (the restore re-anchors the gateway).
                    _ if i.entity_id != 0 => {
                        cx.metrics.drop_input("input_master_gone");
                        InputNext::Done
                    }
                    _ => InputNext::ToGame(input),
                }
            }
        }
    }

    /// An input stamped with an epoch of its master not seen here yet: held by the fence until
    /// the epoch change is (or counted if the fence refuses it).
    fn hold_input(&mut self, cx: &mut Context, id: u64, i: mesh::ForwardInput) {
        let epoch = i.entity_epoch;
        match self.fence.admit(id, epoch, None, Fenced::Input(i)) {
            Admit::Held => {}
            // The fence already follows that epoch while the table does not: handing it on
            // could loop, so it is counted instead.
            Admit::Accept(_) => cx.metrics.drop_input("input_epoch_conflict"),
            Admit::Dropped(_) if self.fence.is_burnt(id, epoch) => {
                // A copy forwarded behind a refused offer: its source applies the original.
                cx.metrics.copies_refused(1);
            }
            Admit::Dropped(_) => {
                cx.metrics.stale_epoch_drops.inc();
                cx.metrics.drop_input("stale_epoch_input");
            }
        }
    }

    /// An input the handoff machine routed for `id`: behind an offer in flight it keeps a copy
    /// (applied here on a refusal), so a forward that cannot be sent is only lost if the offer
    /// completes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_routed(
        &mut self,
        cx: &mut Context,
        mesh: &Mesh,
        id: u64,
        to: NodeId,
        epoch: u64,
        i: local::Input,
        hops: u32,
    ) {
        if !self.outgoing.is_frozen(id) {
            return forward_input(cx, mesh, to, id, epoch, i, hops);
        }
        if !send_forward(cx, mesh, to, id, epoch, i, hops) {
            self.outgoing.forward_failed(id);
        }
    }

    /// An input for the game of a session current here, in its session's order: those it
    /// lets through now (none while a gap before it is open; dropped, and counted, if late).
    pub(crate) fn order_input(&mut self, cx: &mut Context, i: local::Input) -> Vec<local::Input> {
        let (account, epoch, seq) = (i.account.clone(), i.session_epoch, i.seq);
        let due = match self
            .input_order
            .offer(cx.now.mono_ms, &account, epoch, seq, i)
        {
            Ordered::Deliver(inputs) => inputs,
            Ordered::Held => vec![],
            Ordered::Late(_) => {
                cx.metrics.drop_input("input_late");
                vec![]
            }
        };
        for _ in self.input_order.take_superseded() {
            cx.metrics.drop_input("input_stale_session");
        }
        due
    }

    /// Inputs held for a gap that did not fill in time, in order: due now.
    pub(crate) fn due_inputs(&mut self, now_ms: u64) -> Vec<local::Input> {
        self.input_order.due(now_ms)
    }
}

/// Sends an input on to the node that writes its master; `hops` counts the forwards between
/// owners so far. An input that cannot be sent is counted as dropped.
pub(crate) fn forward_input(
    cx: &mut Context,
    mesh: &Mesh,
    to: NodeId,
    entity: u64,
    epoch: u64,
    i: local::Input,
    hops: u32,
) {
    if !send_forward(cx, mesh, to, entity, epoch, i, hops) {
        cx.metrics.drop_input("input_peer_down");
    }
}

/// Queues a `ForwardInput`; false when the node is unreachable (the caller counts it).
fn send_forward(
    cx: &mut Context,
    mesh: &Mesh,
    to: NodeId,
    entity: u64,
    epoch: u64,
    i: local::Input,
    hops: u32,
) -> bool {
    if hops > MAX_INPUT_HOPS {
        tracing::warn!(account = %i.account, seq = i.seq, to, "input forwarded in a loop; dropped");
        cx.metrics.drop_input("input_forward_loop");
        return true;
    }
    let forward = mesh_message::Body::ForwardInput(mesh::ForwardInput {
        account: i.account,
        session_epoch: i.session_epoch,
        seq: i.seq,
        payload: i.payload,
        entity_epoch: epoch,
        hops,
        entity_id: entity,
    });
    let sent = mesh.try_send(cx, to, forward);
    if sent {
        cx.metrics.inputs_forwarded.inc();
    }
    sent
}
