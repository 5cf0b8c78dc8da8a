//! The node's side of handoff: drives the pure state machines of [`crate::model::handoff`] with the
//! game, the peers and the clock. Its handlers borrow the context and what they read of the other
//! parts (the table, the authority, the mesh) and say what came of an offer, an answer or a frame
//! (what is due, what thaws, what a completed unit leaves behind); the core keeps everything else
//! of the node (ghosts, replicas, sessions, routes, claims, commands) in step with that.
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
use cellmesh_world::geometry::Pos;
use cellmesh_world::partition::NodeId;

use super::claims::Claims;
use super::wire::*;
use super::*;
use crate::model::entities::{Entity, TickChanges};
use crate::model::handoff::{
    freeze_cost, Admit, AfterDespawn, Completed, Fence, HandoffSource, HandoffTarget, InputRoute,
    Offer, OfferChecks, OfferDecision, Thawed,
};
use crate::model::inputs::{InputOrder, Ordered, RecentInputs};
use crate::model::subs::{self};

/// The handoffs this node takes part in, as source and as target, and the epoch fence.
#[derive(Default)]
pub(crate) struct Handoffs {
    outgoing: HandoffSource<Routed>,
    inbound: HandoffTarget,
    fence: Fence<Fenced>,
    /// Offers being adopted by the game: root -> the offer.
    adopting: HashMap<u64, mesh::HandoffOffer>,
    /// When the `Adopt` of each offer in `adopting` went to the game (monotonic ms).
    adopt_sent_ms: HashMap<u64, u64>,
    /// Entities not offered again before this time (monotonic ms), after a refusal.
    retry: HashMap<u64, u64>,
    /// Entities to check for a handoff at the next tick even if they did not move.
    recheck: BTreeSet<u64>,
    /// Entities in chunks a new partition gave away: handed over with no margin.
    mass: HashSet<u64>,
    /// Masters handed away from here, by account, so late input finds them with no ghost left.
    departed_masters: HashMap<String, u64>,
    /// Players who left while their master was frozen for a handoff: the leave goes to the new
    /// owner once it acks (the game here drops it on Evict).
    leaving: HashMap<String, mesh::PeerPlayerLeave>,
    /// The order of each player's inputs handed to the game here.
    input_order: InputOrder<local::Input>,
    /// The inputs lately handed to the game (of a game that may release avatars): those after
    /// the last one it applied go on with a released avatar. Kept without their account (the
    /// key), so keeping one costs no allocation.
    recent_inputs: RecentInputs<local::Input>,
    /// Accounts whose avatar the game released in the tick under way -> the unit's root: their
    /// inputs wait for the tick's end with it (the game drops them).
    released_avatars: HashMap<String, u64>,
    /// Entities due for a handoff whose target does not hold their ghost yet, since when.
    ghost_wait: HashMap<u64, u64>,
    /// Entities the fence holds frames for, since when (monotonic ms).
    held_since: HashMap<u64, u64>,
    /// Entities the game was asked to release at its next tick's end (`Offload`), and until when
    /// (monotonic ms) its `Release` is waited for before a `Freeze` hands them over instead.
    offloading: HashMap<u64, u64>,
    /// Units the game released in the tick under way, by root: offered at its `TickEnd`.
    released: BTreeMap<u64, Released>,
    /// Every member of a unit in `released` -> its root (the game must not write them).
    released_by: HashMap<u64, u64>,
    /// Completed handoffs of the last second, for the live map.
    recent: crate::model::recent_handoffs::RecentHandoffs,
}

impl Handoffs {
    /// Whether `id` is frozen for a handoff of this node, or released by its game and waiting
    /// for the answer: nothing is applied to it until it thaws or moves on.
    pub(crate) fn frozen(&self, id: u64) -> bool {
        self.outgoing.is_frozen(id) || self.is_released(id)
    }

    /// Whether the game released `id` in the tick under way (its unit is offered at the tick's
    /// end).
    pub(crate) fn is_released(&self, id: u64) -> bool {
        self.released_by.contains_key(&id)
    }

    /// The handoffs this node makes as the source: what is frozen, offered, in doubt, departed.
    pub(crate) fn outgoing(&self) -> &HandoffSource<Routed> {
        &self.outgoing
    }

    /// The source side, for what a dead target's restore, a lapse and the routes of inputs and
    /// commands decide of its units.
    pub(crate) fn outgoing_mut(&mut self) -> &mut HandoffSource<Routed> {
        &mut self.outgoing
    }

    /// The epoch fence: the frames held for epochs of foreign entities not seen here yet.
    pub(crate) fn fence(&self) -> &Fence<Fenced> {
        &self.fence
    }

    /// A command under `epoch` of `id`, through the fence.
    pub(crate) fn fence_command(
        &mut self,
        table: &mut EntityTable,
        id: u64,
        epoch: u64,
        c: mesh::EntityCommand,
    ) -> Admit<Fenced> {
        self.fence
            .admit(table, id, epoch, None, Fenced::Command(Box::new(c)))
    }

    /// The order of each player's inputs handed to the game here.
    pub(crate) fn input_order(&self) -> &InputOrder<local::Input> {
        &self.input_order
    }

    /// How many offers the game is adopting.
    pub(crate) fn adopting_count(&self) -> usize {
        self.adopting.len()
    }

    /// The epoch this node is adopting `id` under (as the root or a member of an offer).
    pub(crate) fn adopting_epoch(&self, id: u64) -> Option<u64> {
        self.adopting
            .values()
            .find(|o| o.entity_id == id || o.attachments.iter().any(|a| a.entity_id == id))
            .map(|o| o.entity_epoch)
    }

    /// What this node writes, offered or adopts, as a restore asks it.
    pub(crate) fn holdings<'a>(&'a self, table: &'a EntityTable) -> super::restore::Holdings<'a> {
        super::restore::Holdings {
            table,
            outgoing: &self.outgoing,
            adopting: &self.adopting,
        }
    }

    /// The master of `account` this node handed away, while it remembers.
    pub(crate) fn departed_master(&self, account: &str) -> Option<u64> {
        self.departed_masters.get(account).copied()
    }

    /// Entities standing where a new partition gave the area away: handed over at the next
    /// tick, with no margin.
    pub(crate) fn given_away(&mut self, ids: BTreeSet<u64>) {
        self.mass.extend(ids.iter().copied());
        self.recheck.extend(ids);
    }

    /// The handoffs completed lately, for the live map.
    pub(crate) fn recent(&mut self, now_ms: u64) -> Vec<cellmesh_world::world_map::MapHandoff> {
        self.recent.shown(now_ms)
    }
}

/// A unit the game handed over itself (`Release`): its snapshots, taken as its tick ended.
#[derive(Debug, Clone)]
pub(crate) struct Released {
    pub epoch: u64,
    pub state: Bytes,
    pub attachments: Vec<local::Snapshot>,
    /// For a unit holding a player's avatar: the inputs the game did not apply.
    pub avatar: Option<ReleasedAvatar>,
}

/// The player of a released avatar, and its inputs the game did not apply: those handed to it
/// after the last one it applied, then those that came before the tick's end. They go behind
/// the unit's offer, or to the game again if the unit stays.
#[derive(Debug, Clone)]
pub(crate) struct ReleasedAvatar {
    pub account: String,
    pub session_epoch: u64,
    /// The last input the game applied (0: none of `session_epoch`).
    pub last_applied: u64,
    pub inputs: Vec<local::Input>,
}

/// Whether an owned entity is handed over now.
pub(crate) enum Due {
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

/// What the source reads of the other parts to tell whether an entity is handed over now:
/// where this node's area ends, and whether the target can take it.
pub(crate) struct TargetView<'a> {
    pub table: &'a EntityTable,
    pub authority: &'a Authority,
    pub replication: &'a Replication,
    pub mesh: &'a Mesh,
    pub restore: &'a super::restore::Restore,
}

impl Handoffs {
    // ------------------------------------------------------------------ source

    /// After the tick's moves: hands over every owned entity standing far enough in another
    /// node's area (and those a new partition gave away, or that wait for a retry). A game that
    /// takes `Offload` (`offload_wait_ms`: how long its `Release` is waited for) releases them
    /// at its next tick's end, missing no tick; otherwise, or if it does not in time, they are
    /// frozen.
    pub(crate) fn check(
        &mut self,
        cx: &mut Context,
        view: &TargetView,
        changes: &TickChanges,
        offload_wait_ms: Option<u64>,
    ) {
        let now = cx.now.mono_ms;
        let mut ids = std::mem::take(&mut self.recheck);
        ids.extend(
            changes
                .iter()
                .filter(|(_, c)| c.moved || c.spawned)
                .map(|(id, _)| *id),
        );
        let mut unanswered = Vec::new();
        self.offloading.retain(|id, until| {
            let waits = now < *until;
            if !waits {
                unanswered.push(*id);
            }
            waits
        });
        ids.extend(unanswered.iter().copied());
        for id in ids {
            if self.offloading.contains_key(&id) {
                // Asked: its Release comes at the game's next tick's end.
                continue;
            }
            let Due::Now(to) = self.due(cx, view, id) else {
                continue;
            };
            match offload_wait_ms {
                Some(wait) if !unanswered.contains(&id) => {
                    self.offload(cx, view.table, id, now + wait)
                }
                _ => self.begin(cx, view.table, id, to),
            }
        }
    }

    /// Asks the game to release `id` at its next tick's end.
    fn offload(&mut self, cx: &mut Context, table: &EntityTable, id: u64, until_ms: u64) {
        let Some(epoch) = table.get_local(id).map(|e| e.epoch) else {
            return;
        };
        self.offloading.insert(id, until_ms);
        cx.out.to_game.push(
            sidecar_message::Body::Offload(local::Offload {
                entity_id: id,
                entity_epoch: epoch,
            })
            .into(),
        );
    }

    /// Whether owned entity `id` is handed over now, keeping the bookkeeping of those that
    /// wait (a retry at the next tick, how long they waited for the target's ghost).
    pub(crate) fn due(&mut self, cx: &Context, view: &TargetView, id: u64) -> Due {
        let me = cx.config.node_id;
        let now = cx.now.mono_ms;
        let authority = view.authority;
        let Some(e) = view.table.get_local(id) else {
            self.mass.remove(&id);
            self.ghost_wait.remove(&id);
            return Due::No;
        };
        // Attachments move with their root.
        if e.parent_id != 0 && view.table.get_local(e.parent_id).is_some() {
            return Due::No;
        }
        if self.outgoing.is_frozen(id) {
            return Due::No;
        }
        let margin = if self.mass.contains(&id) {
            0
        } else {
            i64::from(cx.config.handoff_margin_chunks)
        };
        let Some(to) = crate::model::handoff::trigger(
            authority.partition(),
            me,
            authority.area(),
            e.chunk,
            margin,
        ) else {
            self.mass.remove(&id);
            self.ghost_wait.remove(&id);
            return Due::No;
        };
        // The target must hold the entity's ghost when the offer reaches it: this node has
        // sent it the full state on the same ordered link (or it stands beyond the reach the
        // target subscribes to, and the offer says so).
        let unseen = subs::distance_to_area(&cx.config.world, authority.area(), e.chunk)
            > cx.config.reach_chunks();
        let seen = unseen || view.replication.holds_ghost(view.table, id, to);
        // A target that never subscribes (no game to tick, say) is offered all the same after
        // a while, and answers for itself.
        let waited = *self.ghost_wait.entry(id).or_insert(now);
        let seen = seen || now >= waited + GHOST_WAIT_MS;
        let why = if !view.mesh.is_up(to) {
            Some("the node that owns its position is unreachable")
        } else if view.restore.is_lapsed(to) {
            // It cannot adopt before it takes its lease back, and may be fenced meanwhile:
            // the unit would only stay frozen here, with its inputs, for nothing.
            Some("the node that owns its position has let its lease lapse")
        } else if view.mesh.peer_partition(to) < authority.partition().epoch() {
            Some("the node that owns its position is behind on the partition")
        } else if !seen {
            Some("the node that owns its position holds no ghost of it yet")
        } else if self.retry.get(&id).is_some_and(|t| *t > now) {
            Some("the node that owns its position refused it lately")
        } else {
            None
        };
        if let Some(why) = why {
            self.recheck.insert(id);
            return Due::Later(why);
        }
        self.ghost_wait.remove(&id);
        Due::Now(to)
    }

    /// Freezes `root`'s unit in the game for a handoff to `to`.
    fn begin(&mut self, cx: &mut Context, table: &EntityTable, root: u64, to: NodeId) {
        let me = cx.config.node_id;
        let Some(epoch) = table.get_local(root).map(|e| e.epoch) else {
            return;
        };
        let attachments = attachments_of(table, root);
        match self
            .outgoing
            .begin(root, epoch, &attachments, to, cx.now.mono_ms)
        {
            Ok(freeze) => {
                cx.metrics.handoff(me, to, "started");
                for m in freeze.members {
                    freeze_in_game(cx, table, m);
                }
            }
            Err(e) => tracing::debug!(entity = root, error = %e, "handoff not begun"),
        }
    }
}

/// The account whose avatar is among `members`, if one is.
fn player_of(table: &EntityTable, members: &[u64]) -> Option<String> {
    members
        .iter()
        .filter_map(|m| table.get_local(*m))
        .find(|e| e.is_master && !e.owner_account.is_empty())
        .map(|e| e.owner_account.to_string())
}

/// Tells the game to stop writing `id` under its current epoch (it answers with its snapshot).
pub(crate) fn freeze_in_game(cx: &mut Context, table: &EntityTable, id: u64) {
    let Some(epoch) = table.get(id).map(|e| e.epoch) else {
        return;
    };
    cx.out.to_game.push(
        sidecar_message::Body::Freeze(local::Freeze {
            entity_id: id,
            entity_epoch: epoch,
        })
        .into(),
    );
}

/// The local entities attached (directly or not) to `root`.
pub(crate) fn attachments_of(table: &EntityTable, root: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut parents = vec![root];
    while let Some(p) = parents.pop() {
        for e in table.iter() {
            if e.origin().is_none() && e.parent_id == p && e.id != root && !out.contains(&e.id) {
                out.push(e.id);
                parents.push(e.id);
            }
        }
    }
    out
}

/// What a game's `Release` comes to before this node's write check.
pub(crate) enum ReleaseCheck {
    /// No such entity of this game.
    Unknown,
    /// Released under another epoch than the entity's: what the game is told.
    WrongEpoch(String),
    /// It crossed this node's `Freeze`: its snapshots answer it.
    Snapshots(Vec<local::Snapshot>),
    /// Released already in this tick: the first release is answered, this one is not.
    Twice,
    /// Whether the game may write it decides the rest ([`Handoffs::record_release`]).
    Writable(local::Release),
}

/// Why a released unit stays here: a mistake of the game's (which it is told), or not.
pub(crate) enum KeptBecause {
    Error(String),
    Reason(&'static str),
}

/// What comes of a unit the game released, at its tick's end.
pub(crate) enum ReleasedNext {
    /// It stays here, for this reason.
    Kept(Released, &'static str),
    /// Its handoff began: the checkpoints its release holds (entity, epoch, state), the offer
    /// if every member's snapshot is in, and the members whose snapshots are asked for if not.
    Begun {
        checkpoints: Vec<(u64, u64, Bytes)>,
        offer: Option<Offer<Routed>>,
        unsnapshotted: Vec<u64>,
    },
}

impl Handoffs {
    // ------------------------------------------------------------------ source: offers

    /// Whether `id` is frozen for a handoff of this node.
    pub(crate) fn is_frozen(&self, id: u64) -> bool {
        self.outgoing.is_frozen(id)
    }

    /// Why the game may not write `id` for a handoff, if it may not.
    pub(crate) fn unwritable(&self, id: u64) -> Option<String> {
        if let Some(root) = self.released_by.get(&id) {
            return Some(format!(
                "entity {id} was released for a handoff (with entity {root}): the game must not write it until Thaw or Evict"
            ));
        }
        if !self.outgoing.writable(id) {
            return Some(format!(
                "entity {id} is frozen for a handoff: the game must not write it until Thaw or Evict"
            ));
        }
        None
    }

    /// The game's `Release`, checked against what the table and the handoffs hold.
    pub(crate) fn check_release(&self, table: &EntityTable, r: local::Release) -> ReleaseCheck {
        let id = r.entity_id;
        let Some(e) = table.get_local(id) else {
            return ReleaseCheck::Unknown;
        };
        let epoch = e.epoch;
        if r.entity_epoch != epoch {
            return ReleaseCheck::WrongEpoch(format!(
                "Release of entity {id} under epoch {}, the entity is at epoch {epoch}",
                r.entity_epoch
            ));
        }
        if self.outgoing.is_frozen(id) {
            let root = local::Snapshot {
                entity_id: id,
                entity_epoch: epoch,
                state: r.state,
            };
            return ReleaseCheck::Snapshots(std::iter::once(root).chain(r.attachments).collect());
        }
        if self.released_by.contains_key(&id) {
            return ReleaseCheck::Twice;
        }
        ReleaseCheck::Writable(r)
    }

    /// A release the game may make: its unit is offered at the tick's end, unless it may not
    /// be released (it holds a player's avatar, or it is no unit's root).
    pub(crate) fn record_release(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        r: local::Release,
        releases_avatars: bool,
    ) -> Result<(), KeptBecause> {
        let id = r.entity_id;
        let Some(e) = table.get_local(id) else {
            return Err(KeptBecause::Reason(
                "the sidecar holds no such entity of this game",
            ));
        };
        let (epoch, parent) = (e.epoch, e.parent_id);
        let mut members = attachments_of(table, id);
        members.push(id);
        let master = player_of(table, &members);
        if master.is_some() && !releases_avatars {
            // Inputs already on their way to the game would reach an avatar frozen there, and
            // a game of this protocol does not say which it applied; a Freeze holds them here.
            return Err(KeptBecause::Reason(
                "a player's avatar is released by games of protocol 1.8 or later; it is handed over by Freeze",
            ));
        }
        if parent != 0 && table.get_local(parent).is_some() {
            return Err(KeptBecause::Error(format!(
                "entity {id} is attached to entity {parent}: release the root, whose unit it moves with"
            )));
        }
        let avatar = master.map(|account| {
            self.released_avatars.insert(account.clone(), id);
            self.released_avatar(cx, account, r.input_session_epoch, r.last_input_seq)
        });
        for m in members {
            self.released_by.insert(m, id);
            self.offloading.remove(&m);
        }
        self.released.insert(
            id,
            Released {
                epoch,
                state: r.state,
                attachments: r.attachments,
                avatar,
            },
        );
        Ok(())
    }

    /// `account`'s avatar was released by a game that applied its inputs of `session_epoch` up
    /// to `last`: the inputs handed to the game after that one, which it drops.
    fn released_avatar(
        &mut self,
        cx: &mut Context,
        account: String,
        session_epoch: u64,
        last: u64,
    ) -> ReleasedAvatar {
        let current = self.input_order.last_of(&account).map(|(epoch, _)| epoch);
        let handed = self.recent_inputs.hand_on(&account, session_epoch, last);
        // Each was counted as delivered when the game got it.
        cx.metrics
            .inputs_handed_on
            .inc_by(handed.inputs.len() as u64 + handed.missing);
        for _ in 0..handed.missing {
            // Handed to the game so long ago that no copy is kept, and not applied.
            cx.metrics.drop_input("input_released_unkept");
        }
        // The game applied nothing of a session newer than the one it names.
        let (session_epoch, last_applied) = match current {
            Some(epoch) if epoch > session_epoch => (epoch, 0),
            _ => (session_epoch, last),
        };
        // Kept without their account: given it back.
        let inputs = handed
            .inputs
            .into_iter()
            .map(|i| local::Input {
                account: account.clone(),
                ..i
            })
            .collect();
        ReleasedAvatar {
            account,
            session_epoch,
            last_applied,
            inputs,
        }
    }

    /// An input for the game of `account` whose avatar the game released in the tick under
    /// way: it waits with the unit for the tick's end (the game would drop it). Handed back if
    /// the avatar was not released.
    pub(crate) fn park_input(&mut self, i: local::Input) -> Option<local::Input> {
        let Some(root) = self.released_avatars.get(&i.account) else {
            return Some(i);
        };
        match self.released.get_mut(root).and_then(|r| r.avatar.as_mut()) {
            Some(a) => {
                a.inputs.push(i);
                None
            }
            None => Some(i),
        }
    }

    /// The game went away: the inputs handed to it are no longer kept (a game that comes back
    /// starts from its entities' checkpoints, and names no input of the gone one).
    pub(crate) fn game_gone(&mut self) {
        self.recent_inputs = RecentInputs::default();
    }

    /// An input handed to the game: kept a while, in case the game releases its avatar.
    pub(crate) fn delivered_input(&mut self, i: &local::Input) {
        let kept = local::Input {
            account: String::new(),
            session_epoch: i.session_epoch,
            seq: i.seq,
            payload: i.payload.clone(),
        };
        self.recent_inputs
            .delivered(&i.account, i.session_epoch, i.seq, kept);
    }

    /// The units the game released in the tick that ended, to offer now. The inputs of a
    /// released avatar's player are ordered from the last one its game applied again: those
    /// after it go behind the offer, or to the game again.
    pub(crate) fn take_released(&mut self) -> BTreeMap<u64, Released> {
        if self.released.is_empty() {
            return BTreeMap::new();
        }
        self.released_by.clear();
        self.released_avatars.clear();
        let released = std::mem::take(&mut self.released);
        for a in released.values().filter_map(|r| r.avatar.as_ref()) {
            self.input_order
                .rewind(&a.account, a.session_epoch, a.last_applied);
        }
        released
    }

    /// A `Release` of `root` crossed this node's `Freeze` of its unit: if the unit holds a
    /// player's avatar, the inputs its game got after the last one it applied (which it
    /// dropped) go behind the offer ahead of those held since the `Freeze`.
    pub(crate) fn release_crossed_freeze(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        root: u64,
        input_session_epoch: u64,
        last_input_seq: u64,
    ) {
        let Some(account) = player_of(table, self.outgoing.members(root)) else {
            return;
        };
        let unapplied = self.unapplied(cx, account, input_session_epoch, last_input_seq);
        let inputs = unapplied.into_iter().map(Routed::Input).collect();
        if let Err(inputs) = self.outgoing.hold_first(root, inputs) {
            // The offer left already (a repeated release): what it carries stands.
            for _ in inputs {
                cx.metrics.drop_input("input_release_after_offer");
            }
        }
    }

    /// A `Release` of `root` the sidecar did not take (it answers with a `Thaw`): if its unit
    /// holds a player's avatar, the inputs its game dropped since the one it applied last, to
    /// hand it again after the `Thaw`.
    pub(crate) fn release_not_taken(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        root: u64,
        input_session_epoch: u64,
        last_input_seq: u64,
    ) -> Vec<local::Input> {
        let mut members = attachments_of(table, root);
        members.push(root);
        let Some(account) = player_of(table, &members) else {
            return Vec::new();
        };
        self.unapplied(cx, account, input_session_epoch, last_input_seq)
    }

    /// `account`'s inputs its game dropped after the last one it applied, now: the player's
    /// input order is wound back to that one.
    fn unapplied(
        &mut self,
        cx: &mut Context,
        account: String,
        input_session_epoch: u64,
        last_input_seq: u64,
    ) -> Vec<local::Input> {
        let a = self.released_avatar(cx, account, input_session_epoch, last_input_seq);
        self.input_order
            .rewind(&a.account, a.session_epoch, a.last_applied);
        a.inputs
    }

    /// A released avatar stays here: the leave kept for its new owner is its game's again.
    pub(crate) fn released_avatar_kept(&mut self, account: &str) {
        self.leaving.remove(account);
    }

    /// A unit the game released: its handoff begins now if it is due and its target ready.
    pub(crate) fn offer_released(
        &mut self,
        cx: &mut Context,
        view: &TargetView,
        root: u64,
        r: Released,
    ) -> ReleasedNext {
        let me = cx.config.node_id;
        let to = match self.due(cx, view, root) {
            Due::Now(to) => to,
            Due::No => {
                return ReleasedNext::Kept(
                    r,
                    "it is inside this node's area or within the handoff margin of it",
                )
            }
            Due::Later(why) => return ReleasedNext::Kept(r, why),
        };
        let table = view.table;
        let attachments = attachments_of(table, root);
        let begun = self
            .outgoing
            .begin(root, r.epoch, &attachments, to, cx.now.mono_ms);
        if let Err(e) = begun {
            tracing::debug!(entity = root, error = %e, "released unit not offered");
            return ReleasedNext::Kept(r, "it is in another handoff");
        }
        cx.metrics.handoff(me, to, "released");
        // The inputs its game did not apply go right behind the offer, before any later one.
        if let Some(a) = r.avatar {
            let inputs = a.inputs.into_iter().map(Routed::Input).collect();
            if let Err(inputs) = self.outgoing.hold_first(root, inputs) {
                debug_assert!(false, "a unit just begun waits for its snapshots");
                for _ in inputs {
                    cx.metrics.drop_input("input_release_after_offer");
                }
            }
        }
        // What the game's release holds is the freshest checkpoint there is, as a snapshot.
        let mut parts: Vec<(u64, Bytes)> = vec![(root, r.state)];
        for a in r.attachments {
            let current = table.get_local(a.entity_id).map(|e| e.epoch);
            if attachments.contains(&a.entity_id) && current == Some(a.entity_epoch) {
                parts.push((a.entity_id, a.state));
            }
        }
        let mut offer = None;
        let mut checkpoints = Vec::with_capacity(parts.len());
        for (id, state) in parts {
            let epoch = table.get_local(id).map_or(r.epoch, |e| e.epoch);
            checkpoints.push((id, epoch, state.clone()));
            if let Ok(Some(o)) = self.outgoing.snapshot(id, state) {
                offer = Some(o);
            }
        }
        // Attachments the release did not carry: their snapshots are asked for.
        let unsnapshotted = attachments
            .into_iter()
            .filter(|m| !checkpoints.iter().any(|(id, _, _)| id == m))
            .collect();
        ReleasedNext::Begun {
            checkpoints,
            offer,
            unsnapshotted,
        }
    }

    /// Whether the game's `Snapshot` answers a `Freeze` of this node's: if not, what the game
    /// is told.
    pub(crate) fn check_snapshot(
        &self,
        table: &EntityTable,
        s: &local::Snapshot,
    ) -> Result<(), (ErrorCode, String)> {
        if !self.outgoing.is_frozen(s.entity_id) {
            return Err((
                ErrorCode::UnexpectedMessage,
                format!(
                    "Snapshot of entity {}, which is not frozen for a handoff",
                    s.entity_id
                ),
            ));
        }
        let epoch = table.get_local(s.entity_id).map(|e| e.epoch);
        if epoch != Some(s.entity_epoch) {
            return Err((
                ErrorCode::InvalidValue,
                format!(
                    "Snapshot of entity {} under epoch {}, the Freeze named epoch {:?}",
                    s.entity_id, s.entity_epoch, epoch
                ),
            ));
        }
        Ok(())
    }

    /// A member's snapshot: the unit's offer once every member's is in.
    pub(crate) fn snapshot(
        &mut self,
        id: u64,
        state: Bytes,
    ) -> Result<Option<Offer<Routed>>, String> {
        self.outgoing.snapshot(id, state).map_err(|e| e.to_string())
    }

    /// An offer of `e` under `epoch` with its game's `state`, as a target adopts it: where it
    /// stands, what it is, and for a player's master the `session` it routes to (gateway node,
    /// session epoch) and the last input its game was handed (a handoff's offer and a
    /// checkpoint in the store alike).
    pub(crate) fn offer_of(
        &self,
        cx: &Context,
        e: &Entity,
        epoch: u64,
        state: Bytes,
        session: Option<(NodeId, u64)>,
        claims: Vec<mesh::HeldClaim>,
    ) -> mesh::HandoffOffer {
        mesh::HandoffOffer {
            entity_id: e.id,
            entity_epoch: epoch,
            position: Some(vec3(e.position)),
            state,
            owner_account: e.owner_account.to_string(),
            is_master: e.is_master,
            components: owned_components(e),
            gateway_node: session.map_or(0, |s| s.0),
            session_epoch: session.map_or(0, |s| s.1),
            last_input_seq: session
                .and_then(|s| {
                    let (epoch, seq) = self.input_order.last_of(&e.owner_account)?;
                    (epoch == s.1).then_some(seq)
                })
                .unwrap_or(0),
            state_unix_ms: cx.now.unix_ms,
            claims,
            ..Default::default()
        }
    }

    /// The message of `offer` to its target, with what it carries of the other parts;
    /// `None` if its root left the table.
    pub(crate) fn offer_message(
        &self,
        cx: &Context,
        table: &EntityTable,
        authority: &Authority,
        offer: &Offer<Routed>,
        successor: bool,
        carried: Carried,
    ) -> Option<mesh::HandoffOffer> {
        let root = offer.root;
        let Some(e) = table.get_local(root) else {
            tracing::warn!(
                entity = root,
                "the frozen entity left the table; offer not sent"
            );
            return None;
        };
        let mut parts = offer.parts.iter();
        let state = parts.next().map(|p| p.1.clone()).unwrap_or_default();
        let attachments = parts
            .filter_map(|(id, state)| {
                let a = table.get_local(*id)?;
                Some(mesh::HandoffPart {
                    entity_id: a.id,
                    position: Some(vec3(a.position)),
                    state: state.clone(),
                    owner_account: a.owner_account.to_string(),
                    is_master: a.is_master,
                    parent_id: a.parent_id,
                    components: owned_components(a),
                })
            })
            .collect();
        Some(mesh::HandoffOffer {
            partition_epoch: authority.partition().epoch(),
            command_cursors: carried.command_cursors,
            claims: carried.claims,
            attachments,
            successor,
            unseen: subs::distance_to_area(&cx.config.world, authority.area(), e.chunk)
                > cx.config.reach_chunks(),
            ..self.offer_of(cx, e, offer.epoch, state, carried.session, vec![])
        })
    }

    /// An offer that never left (no link to its target): the unit to thaw, if it may.
    pub(crate) fn unsent(&mut self, cx: &Context, root: u64, to: NodeId) -> Option<Thawed<Routed>> {
        let thawed = self.outgoing.unsent(root, cx.now.mono_ms).ok()?;
        cx.metrics.handoff(cx.config.node_id, to, "unsent");
        Some(thawed)
    }

    /// The offer of `root` left: the game's part of the freeze is over (a repeated offer
    /// keeps the first answer).
    pub(crate) fn offer_sent(&mut self, cx: &Context, root: u64, last_tick_end_ms: u64) {
        self.outgoing
            .answered(root, cx.now.mono_ms, last_tick_end_ms);
    }

    /// The `k`th input the unit of `root` held, sent on behind its offer to `to`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_held(
        &mut self,
        cx: &mut Context,
        mesh: &Mesh,
        to: NodeId,
        root: u64,
        epoch: u64,
        k: usize,
        i: local::Input,
    ) {
        if !send_forward(cx, mesh, to, root, epoch, i, 0) {
            self.outgoing.held_forward_failed(root, k);
        }
    }
}

/// What an offer carries of the other parts: the order each command stream to its members
/// got to, the claims they hold, and the session of a player's master (gateway node, epoch).
pub(crate) struct Carried {
    pub command_cursors: Vec<mesh::CommandCursor>,
    pub claims: Vec<mesh::HeldClaim>,
    pub session: Option<(NodeId, u64)>,
}

impl Handoffs {
    // ------------------------------------------------------------------ source: answers

    /// A unit whose handoff is over while it stays here: its members thaw in the game (or,
    /// while the lease is lapsed, `while_lapsed` being then the authority, stay frozen with the
    /// lapse's rest), the claims its target was given meanwhile are lost, and what it held comes
    /// back, to be applied here.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn thaw(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        claims: &mut Claims,
        game: Option<ConnId>,
        mut while_lapsed: Option<&mut Authority>,
        thawed: Thawed<Routed>,
        reason: &str,
    ) -> Vec<Routed> {
        // A thawed master's game applies the leave it holds itself.
        for m in &thawed.members {
            if let Some(e) = table.get_local(*m).filter(|e| e.is_master) {
                self.leaving.remove(&*e.owner_account);
            }
        }
        cx.metrics.freeze_done(thawed.freeze_ms);
        for m in &thawed.members {
            claims.thawed(cx, *m, game);
            if let Some(authority) = while_lapsed.as_deref_mut() {
                // Stays frozen, with the rest, until the lease is back.
                authority.keep_frozen(*m);
                continue;
            }
            cx.out.to_game.push(
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
        cx.metrics
            .inputs_copies_applied
            .inc_by(thawed.forwarded_copies.saturating_sub(commands));
        thawed.inputs
    }

    /// After a thaw, once what the unit held is applied: `root` is offered again after a
    /// while, checked at the next tick.
    pub(crate) fn thawed(&mut self, cx: &Context, root: u64) {
        self.retry
            .insert(root, cx.now.mono_ms + cx.config.handoff_retry_ms);
        self.recheck.insert(root);
        self.count_in_doubt(cx);
    }

    /// The gauge of the offers in doubt.
    pub(crate) fn count_in_doubt(&self, cx: &Context) {
        cx.metrics
            .handoffs_in_doubt
            .set(self.outgoing.in_doubt().count() as i64);
    }

    /// `root` is not offered again sooner for its last refusal.
    pub(crate) fn forget_retry(&mut self, root: u64) {
        self.retry.remove(&root);
    }

    /// A `HandoffAck` from `from`: the handoff it completes, if any. `tick_ms`: how long a tick
    /// of this node's game lasts, for what the freeze cost.
    pub(crate) fn acked(
        &mut self,
        cx: &mut Context,
        from: NodeId,
        a: &mesh::HandoffAck,
        tick_ms: Option<f64>,
    ) -> Option<Completed> {
        match self
            .outgoing
            .acked(a.entity_id, a.entity_epoch, from, cx.now.mono_ms)
        {
            Ok(done) => {
                let by_partition = done.members.iter().any(|m| self.mass.contains(m));
                note_freeze_cost(cx, &done, a.adopt_timing, tick_ms, by_partition);
                Some(done)
            }
            // A repeated ack of a handoff already complete, or of an offer not made.
            Err(e) => {
                cx.metrics.drop_msg("handoff_ack_unexpected", 1);
                tracing::debug!(peer = from, error = %e, "handoff ack ignored");
                None
            }
        }
    }

    /// An offer of `id` under `epoch` came while this node's offer of it, under an older
    /// epoch, is in doubt: that one was taken (see `HandoffSource::taken`), and completes now.
    pub(crate) fn taken(&mut self, cx: &Context, id: u64, epoch: u64) -> Option<Completed> {
        let done = self.outgoing.taken(id, epoch, cx.now.mono_ms)?;
        tracing::info!(
            entity = id,
            epoch,
            taken = done.epoch,
            "an offer of an entity whose offer from here is in doubt: that one was taken"
        );
        Some(done)
    }

    /// A `HandoffRefused` from `from`: the unit to thaw, if the refusal answers an offer.
    pub(crate) fn refused(
        &mut self,
        cx: &mut Context,
        from: NodeId,
        r: &mesh::HandoffRefused,
    ) -> Option<Thawed<Routed>> {
        match self
            .outgoing
            .refused(r.entity_id, r.entity_epoch, from, cx.now.mono_ms)
        {
            Ok(thawed) => {
                cx.metrics.handoff(cx.config.node_id, from, "refused");
                cx.metrics.handoffs_refused.inc();
                tracing::debug!(entity = r.entity_id, peer = from, reason = %r.reason, "handoff refused");
                Some(thawed)
            }
            Err(e) => {
                cx.metrics.drop_msg("handoff_refusal_unexpected", 1);
                tracing::debug!(peer = from, error = %e, "handoff refusal ignored");
                None
            }
        }
    }

    /// Every unit still waiting for a snapshot, to thaw: its game went away (its entities kept
    /// for its return), so no snapshot will come. What it released is kept here too.
    pub(crate) fn abandon_freezing(&mut self, cx: &Context) -> Vec<(u64, Thawed<Routed>)> {
        self.released.clear();
        self.released_by.clear();
        let abandoned = self.outgoing.abandon_freezing(cx.now.mono_ms);
        abandoned
            .into_iter()
            .map(|(root, to, thawed)| {
                cx.metrics.handoff(cx.config.node_id, to, "abandoned");
                (root, thawed)
            })
            .collect()
    }

    /// The game despawned `gone` (or went away with them): a unit frozen for a handoff waits
    /// for no snapshot of them. What comes of each unit touched: an offer of the rest, or the
    /// rest to thaw if its root went.
    pub(crate) fn despawned(&mut self, cx: &Context, gone: &[Entity]) -> Vec<AfterDespawn<Routed>> {
        let ids: Vec<u64> = gone.iter().map(|e| e.id).collect();
        let after = self.outgoing.despawned(&ids, cx.now.mono_ms);
        for a in &after {
            if let AfterDespawn::Abandoned { root, to, thawed } = a {
                cx.metrics.handoff(cx.config.node_id, *to, "abandoned");
                // A leave kept for the new owner is moot: the avatar is gone.
                if let Some(e) = gone.iter().find(|e| e.id == *root && e.is_master) {
                    self.leaving.remove(&*e.owner_account);
                }
                // The attachments left are roots of their own now: checked at the next tick.
                self.recheck.extend(thawed.members.iter().copied());
            }
        }
        after
    }

    /// `account` left: if its master is frozen in a handoff, the leave is kept for the new owner.
    pub(crate) fn leave_follows(
        &mut self,
        table: &EntityTable,
        account: &str,
        epoch: u64,
        reason: &str,
    ) {
        let frozen = table.master_of(account).is_some_and(|e| {
            e.origin().is_none() && (self.outgoing.is_frozen(e.id) || self.is_released(e.id))
        });
        if frozen {
            self.leaving.insert(
                account.to_string(),
                mesh::PeerPlayerLeave {
                    account: account.to_string(),
                    session_epoch: epoch,
                    reason: reason.to_string(),
                },
            );
        }
    }

    /// The units offered to `node` and still in doubt.
    pub(crate) fn offered_to(&self, node: NodeId) -> Vec<u64> {
        self.outgoing.towards(node)
    }

    /// The offer of `root` again, as it was made.
    pub(crate) fn repeat(&mut self, root: u64) -> Option<Offer<Routed>> {
        self.outgoing.repeat(root).ok()
    }
}

/// What an acked handoff cost (see [`freeze_cost`]), when the ack says how long the target's
/// game took. An ack repeated after a lost link, or a handoff proved by the target's frames,
/// has no such word: its freeze is counted, its cost is not.
/// A handoff a new partition started (`by_partition`: its area was given away) also counts its
/// gap apart: what a bubble move or a failover costs the players in it.
fn note_freeze_cost(
    cx: &Context,
    done: &Completed,
    timing: Option<mesh::AdoptTiming>,
    tick_ms: Option<f64>,
    by_partition: bool,
) {
    let (Some(answered), Some(timing)) = (done.answered, timing) else {
        return;
    };
    let cost = freeze_cost(answered, cx.now.mono_ms, timing.game_ms, tick_ms);
    cx.metrics.freeze_cost(&cost);
    if by_partition {
        cx.metrics.partition_gap(cost.gap_ms);
    }
}

/// A unit the game released stays here: the game resumes it, or, while the lease is lapsed,
/// it stays frozen with the lapse's rest (`while_lapsed` is then the authority).
pub(crate) fn thaw_released(
    cx: &mut Context,
    while_lapsed: Option<&mut Authority>,
    id: u64,
    reason: &str,
) {
    cx.metrics.releases_kept.inc();
    if let Some(authority) = while_lapsed {
        // Stays frozen, with the rest, until the lease is back.
        authority.keep_frozen(id);
        return;
    }
    cx.out.to_game.push(
        sidecar_message::Body::Thaw(local::Thaw {
            entity_id: id,
            reason: format!("released, but kept: {reason}"),
        })
        .into(),
    );
}

impl Handoffs {
    // ------------------------------------------------------------------ source: completion

    /// The target of `done` owns its unit: counted.
    pub(crate) fn completed(&self, cx: &Context, done: &Completed) {
        cx.metrics.handoff(cx.config.node_id, done.to, "completed");
        for _ in 0..done.unforwarded {
            cx.metrics.drop_input("input_peer_down");
        }
        cx.metrics.handoffs_out.inc();
        cx.metrics.freeze_done(done.freeze_ms);
    }

    /// A member of a completed unit leaves this node's game: shown on the live map, evicted
    /// from the game, and no longer offered or retried.
    pub(crate) fn evict(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        done: &Completed,
        id: u64,
    ) {
        if let Some(e) = table.get(id) {
            let at = (e.position.x, e.position.y);
            self.recent
                .push(cx.now.mono_ms, id, at, cx.config.node_id, done.to);
        }
        cx.out
            .to_game
            .push(sidecar_message::Body::Evict(local::Evict { entity_id: id }).into());
    }

    /// A member of a completed unit is neither offered nor retried again from here.
    pub(crate) fn handed_away(&mut self, id: u64) {
        self.mass.remove(&id);
        self.retry.remove(&id);
    }

    /// `account`'s master `id` was handed away: late inputs follow it even when no ghost of it
    /// stays here. The inputs held here for a gap in their order (the new owner orders them from
    /// here on) and the leave kept for the new owner, to send on.
    pub(crate) fn master_departed(
        &mut self,
        account: &str,
        id: u64,
    ) -> (Vec<local::Input>, Option<mesh::PeerPlayerLeave>) {
        self.departed_masters.insert(account.to_string(), id);
        self.recent_inputs.forget(account);
        let held = self.input_order.forget(account);
        (held, self.leaving.remove(account))
    }
}

/// Tells the nodes that held a ghost of `id` (and its new owner, which learns who they are)
/// that the unit of `done` moved.
pub(crate) fn tell_holders(
    cx: &mut Context,
    mesh: &Mesh,
    done: &Completed,
    id: u64,
    holders: &BTreeSet<NodeId>,
    kept_here: bool,
) {
    tracing::debug!(
        me = cx.config.node_id,
        entity = id,
        to = done.to,
        epoch = done.epoch,
        ?holders,
        kept_here,
        "handoff complete; telling the holders"
    );
    // The new owner learns every holder, this node too when it keeps a ghost.
    let me = cx.config.node_id;
    let listed = || {
        holders
            .iter()
            .copied()
            .chain(kept_here.then_some(me))
            .filter(|n| *n != done.to)
    };
    for &node in holders {
        mesh.send(
            cx,
            node,
            mesh_message::Body::EntityMoved(mesh::EntityMoved {
                entity_id: id,
                entity_epoch: done.epoch,
                owner_node: done.to,
                holders: if node == done.to {
                    listed().collect()
                } else {
                    vec![]
                },
            }),
        );
    }
    if !holders.contains(&done.to) {
        mesh.send(
            cx,
            done.to,
            mesh_message::Body::EntityMoved(mesh::EntityMoved {
                entity_id: id,
                entity_epoch: done.epoch,
                owner_node: done.to,
                holders: listed().collect(),
            }),
        );
    }
}

/// An offer the game adopted: what the core carries out beyond the handoff's own state.
pub(crate) struct Adoption {
    pub offer: mesh::HandoffOffer,
    /// The node the offer came from (this node, for its own restore of a dead process's entity).
    pub source: NodeId,
    pub adopt_timing: Option<mesh::AdoptTiming>,
    /// The first checkpoint of each member installed, under the offer's epoch.
    pub checkpoints: Vec<(u64, Bytes)>,
}

impl Handoffs {
    // ------------------------------------------------------------------ target

    /// An offer from `from`, checked against this node's view: the game is told to adopt it, or
    /// the answer to send is returned. `from_dead`: the offer comes from a process that died
    /// (its world is restored from elsewhere).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_offer(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        authority: &Authority,
        replication: &mut Replication,
        game_connected: bool,
        from_dead: bool,
        from: NodeId,
        o: mesh::HandoffOffer,
    ) -> Option<mesh_message::Body> {
        let me = cx.config.node_id;
        let id = o.entity_id;
        if from_dead {
            cx.metrics.drop_msg("offer_from_dead", 1);
            return None;
        }
        if o.successor && table.get_local(id).is_some() {
            // A restore of what this node writes already (two rounds crossed): never adopted
            // twice.
            let refused = mesh::HandoffRefused {
                entity_id: id,
                entity_epoch: o.entity_epoch,
                reason: super::restore::ALREADY_WRITES.into(),
            };
            return Some(mesh_message::Body::HandoffRefused(refused));
        }
        let at = o.position.as_ref().map(|p| Pos { x: p.x, y: p.y });
        let owns = at.is_some_and(|p| authority.partition().owner_of(p).ok() == Some(me));
        let checks = OfferChecks {
            owns_position: owns,
            lease_live: authority.lease_live(),
            partition_epoch_matches: o.partition_epoch == authority.partition().epoch(),
            has_ghost: o.successor
                || o.unseen
                || table.get(id).is_some_and(|e| e.origin() == Some(from)),
            draining: authority.draining(),
            game_connected,
        };
        let known = self.fence.current(table, id).map(|(e, _)| e);
        match self.inbound.offer(from, id, o.entity_epoch, known, checks) {
            OfferDecision::Adopt => {
                let adopt = adopt_message(&o);
                for m in std::iter::once(id).chain(o.attachments.iter().map(|a| a.entity_id)) {
                    if replication.forget_sim_ghost(m) {
                        cx.out.to_game.push(
                            sidecar_message::Body::GhostLeave(local::GhostLeave { entity_id: m })
                                .into(),
                        );
                    }
                }
                cx.out
                    .to_game
                    .push(sidecar_message::Body::Adopt(adopt).into());
                self.adopting.insert(id, o);
                self.adopt_sent_ms.insert(id, cx.now.mono_ms);
                None
            }
            OfferDecision::Pending => None,
            OfferDecision::Ack => Some(mesh_message::Body::HandoffAck(mesh::HandoffAck {
                entity_id: id,
                entity_epoch: o.entity_epoch,
                adopt_timing: None,
            })),
            OfferDecision::Refuse(r) => {
                // Inputs held for the refused epoch are copies: the source keeps the originals
                // and applies them when it thaws.
                self.count_discards(cx);
                self.fence.burn(id, o.entity_epoch);
                // So are commands: their copies are applied there, and answered from there.
                let copies = self
                    .fence
                    .take_discarded()
                    .iter()
                    .filter(|f| matches!(f, Fenced::Input(_)))
                    .count() as u64;
                cx.metrics.copies_refused(copies);
                cx.metrics.handoff(from, me, "refused");
                Some(mesh_message::Body::HandoffRefused(mesh::HandoffRefused {
                    entity_id: id,
                    entity_epoch: o.entity_epoch,
                    reason: r.as_str().to_string(),
                }))
            }
            OfferDecision::Stale => {
                cx.metrics.stale_epoch_drops.inc();
                cx.metrics.drop_msg("stale_offer", 1);
                // A restore under an epoch this node saw already (its decider died and the
                // next one chose the same): refused, so it comes again above it instead of
                // being retried unanswered forever.
                o.successor.then(|| {
                    mesh_message::Body::HandoffRefused(mesh::HandoffRefused {
                        entity_id: id,
                        entity_epoch: o.entity_epoch,
                        reason: super::restore::STALE_RESTORE.into(),
                    })
                })
            }
        }
    }

    /// Held inputs and commands the fence let go of are counted, never lost silently.
    pub(crate) fn count_discards(&mut self, cx: &Context) {
        for f in self.fence.take_discarded() {
            match f {
                Fenced::Input(_) => cx.metrics.drop_input("input_held_dropped"),
                // Not answered: a copy of it may still be applied elsewhere; its origin times
                // it out.
                Fenced::Command(_) => cx.metrics.drop_command("fence"),
                _ => {}
            }
        }
    }

    /// The `Adopt`s the game has not answered, for a game that connects again.
    pub(crate) fn pending_adopts(&self) -> Vec<local::Adopt> {
        self.adopting.values().map(adopt_message).collect()
    }

    /// Whether this node's game is adopting entity `id`.
    pub(crate) fn adopting(&self, id: u64) -> bool {
        self.adopting.contains_key(&id)
    }

    /// The game's `Adopted`: the unit is this node's own from now on, installed in `table`
    /// under the offer's epoch, and the player's inputs follow its master here. `Err`: no such
    /// `Adopt` is pending (the game is told so).
    pub(crate) fn adopted(
        &mut self,
        cx: &Context,
        table: &mut EntityTable,
        a: &local::Adopted,
    ) -> Result<Adoption, String> {
        let offer = self
            .adopting
            .get(&a.entity_id)
            .filter(|o| o.entity_epoch == a.entity_epoch)
            .cloned();
        let source = offer
            .as_ref()
            .and_then(|_| self.inbound.adopted(a.entity_id, a.entity_epoch));
        let (Some(o), Some(source)) = (offer, source) else {
            return Err(format!(
                "Adopted of entity {} under epoch {}: no such Adopt is pending",
                a.entity_id, a.entity_epoch
            ));
        };
        self.adopting.remove(&a.entity_id);
        let now = cx.now.mono_ms;
        let adopt_timing = self
            .adopt_sent_ms
            .remove(&a.entity_id)
            .map(|sent| mesh::AdoptTiming {
                game_ms: now.saturating_sub(sent),
            });
        let mut checkpoints = Vec::new();
        for full in members_of(&o) {
            let id = full.id;
            if let Err(e) = table.to_local(full) {
                tracing::error!(entity = id, error = %e, "installing an adopted entity failed");
                continue;
            }
            self.outgoing.forget(id);
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
                checkpoints.push((id, state));
            }
        }
        // The player's inputs follow its master.
        if o.is_master && !o.owner_account.is_empty() {
            let until = now + REORDER_WINDOW_MS;
            self.input_order
                .resume(&o.owner_account, o.session_epoch, o.last_input_seq, until);
            self.departed_masters.remove(&o.owner_account);
        }
        Ok(Adoption {
            offer: o,
            source,
            adopt_timing,
            checkpoints,
        })
    }
}

/// What the game is told to adopt for offer `o`.
pub(crate) fn adopt_message(o: &mesh::HandoffOffer) -> local::Adopt {
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
                owner_account: a.owner_account.to_string(),
                is_master: a.is_master,
                attachments: vec![],
            })
            .collect(),
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

    /// The epoch and writer the fence follows for `id`, if any.
    pub(crate) fn fenced(&self, table: &EntityTable, id: u64) -> Option<(u64, NodeId)> {
        self.fence.current(table, id)
    }

    /// What a frame about a foreign entity needs before the fence admits it.
    pub(crate) fn state_ahead(
        &mut self,
        cx: &Context,
        table: &mut EntityTable,
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
            .current(table, id)
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
            due = self.fence.advance(table, id, epoch, node);
        }
        StateAhead::Admit(due, s)
    }

    /// A frame about a foreign entity, through the fence: the frame to apply now, if any (one
    /// of an epoch not seen yet is held, one of an older epoch dropped).
    pub(crate) fn admit_state(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        node: NodeId,
        s: mesh::EntityState,
    ) -> Option<Fenced> {
        let (id, epoch) = (s.entity_id, s.entity_epoch);
        match self
            .fence
            .admit(table, id, epoch, Some(node), Fenced::State(node, s))
        {
            Admit::Accept(f) => Some(f),
            Admit::Held => {
                tracing::debug!(me = cx.config.node_id, entity = id, epoch, peer = node, known = ?self.fence.current(table, id), ghost = ?table.get(id).map(|e| (e.origin(), e.epoch)), "frame held for a newer epoch");
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
        table: &mut EntityTable,
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
            .admit(table, id, epoch, Some(node), Fenced::Gone(node, g))
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
    pub(crate) fn advance(
        &mut self,
        table: &mut EntityTable,
        id: u64,
        epoch: u64,
        owner: NodeId,
    ) -> Vec<Fenced> {
        self.fence.advance(table, id, epoch, owner)
    }

    /// The epoch the fence follows for `id` is void (its writer died and its unit went back to
    /// the node that offered it): forgotten, and burnt, so the next frame of the unit's writer
    /// sets the epoch again and nothing more is taken under the void one.
    pub(crate) fn void_fenced(&mut self, table: &mut EntityTable, id: u64) {
        if let Some((epoch, _)) = self.fence.current(table, id) {
            self.fence.forget(table, id);
            self.fence.burn(id, epoch);
        }
    }

    /// `id` is not held here any more: the fence forgets it (what it held is counted).
    pub(crate) fn forget_fenced(&mut self, table: &mut EntityTable, id: u64) {
        self.fence.forget(table, id);
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
    pub(crate) fn follow_newest(
        &mut self,
        table: &mut EntityTable,
        id: u64,
    ) -> Option<(u64, NodeId, Vec<Fenced>)> {
        let (epoch, owner) = self.fence.held_newest(id)?;
        let due = self.fence.advance(table, id, epoch, owner);
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
        table: &mut EntityTable,
        i: mesh::ForwardInput,
    ) -> InputNext {
        let master = table
            .master_of(&i.account)
            .map(|e| (e.id, e.origin(), e.epoch));
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
                    self.hold_input(cx, table, id, i);
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
                    self.hold_input(cx, table, id, i);
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
                        self.hold_input(cx, table, id, i);
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
    fn hold_input(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        id: u64,
        i: mesh::ForwardInput,
    ) {
        let epoch = i.entity_epoch;
        match self.fence.admit(table, id, epoch, None, Fenced::Input(i)) {
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
