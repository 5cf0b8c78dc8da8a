//! Epoch-fenced handoff (docs/mesh.md#handoff): the real of an entity moves to the node that owns its
//! position, with nothing lost, nothing doubled and nothing seen by clients.
//!
//! Pure state machines; the node feeds them events with the time and performs the actions they
//! return:
//! - [`trigger`]: whether an owned entity must be handed over after this tick's moves;
//! - [`HandoffSource`]: Idle → Freezing → Offered ("in doubt") → done (acked) or thawed (refused);
//! - [`HandoffTarget`]: the checks an offer must pass, idempotent on a replayed offer;
//! - [`Fence`]: per-entity epochs; frames from an older epoch are dropped, from a newer one held
//!   until the epoch change is seen (BigWorld's `numTimesRealOffloaded`, `ghostSetNextReal`);
//! - [`freeze_cost`]: what a completed handoff cost in game ticks, and the sidecars' own share
//!   of its freeze.
//!
//! The one failure the mesh cannot absorb is two writers of one entity, so the source never
//! thaws on a timeout: an unanswered offer stays frozen until the target answers, the link comes
//! back and the offer is repeated, or the target's process dies and the restore of its world
//! settles the unit ([`HandoffSource::resolve`], or a refusal on the decider's word).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use bytes::Bytes;
use cellmesh_world::geometry::{ChunkPos, ChunkRect};
use cellmesh_world::partition::{NodeId, Partition};

use crate::model::subs::distance_to_area;

pub type EntityId = u64;
pub type Epoch = u64;

/// How far past the border (in whole chunks) an entity must be before it is handed over.
pub const DEFAULT_MARGIN_CHUNKS: i64 = 1;

/// Frames held per entity for an epoch not yet seen; beyond that the oldest are dropped.
pub const MAX_HELD_FRAMES: usize = 256;

/// Outcomes a target remembers per entity, so a replayed offer gets the same answer.
const OFFER_HISTORY: usize = 8;

/// The node an owned entity in `chunk` must be handed to, if any.
///
/// `distance_to_area` is 1 in the first chunk past the line, where the entity may be a
/// centimetre over it; requiring more than `margin_chunks` means at least `margin_chunks` whole
/// chunks past the line, so an entity pacing on the border is never handed over, and once handed
/// it needs the same margin on the other side to come back.
pub fn trigger(
    partition: &Partition,
    me: NodeId,
    own_area: &[ChunkRect],
    chunk: ChunkPos,
    margin_chunks: i64,
) -> Option<NodeId> {
    let owner = partition.owner_of_chunk(chunk);
    if owner == me {
        return None;
    }
    (distance_to_area(partition.shape(), own_area, chunk) > margin_chunks).then_some(owner)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoffError {
    #[error("entity {0} is already being handed off")]
    Busy(EntityId),
    #[error("entity {0} is not being handed off")]
    NotInHandoff(EntityId),
    #[error("entity {entity}: expected epoch {expected}, got {got}")]
    WrongEpoch {
        entity: EntityId,
        expected: Epoch,
        got: Epoch,
    },
    #[error("entity {entity}: the answer came from node {from}, the offer went to node {to}")]
    WrongNode {
        entity: EntityId,
        from: NodeId,
        to: NodeId,
    },
    #[error("entity {0}: the offer is not sent yet")]
    NotOffered(EntityId),
}

/// Tell the source game to stop writing these entities (the root first, then its attachments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Freeze {
    pub members: Vec<EntityId>,
    pub epoch: Epoch,
}

/// Send `HandoffOffer` to `to`, then the held inputs in order (with `epoch`).
#[derive(Debug, Clone, PartialEq)]
pub struct Offer<I> {
    pub to: NodeId,
    pub root: EntityId,
    /// The epoch the target will own the entity under.
    pub epoch: Epoch,
    /// Complete game snapshots, the root first.
    pub parts: Vec<(EntityId, Bytes)>,
    pub inputs: Vec<I>,
}

/// The target owns the unit now: evict it from the game (no vanish), keep render ghosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub to: NodeId,
    pub members: Vec<EntityId>,
    pub epoch: Epoch,
    pub freeze_ms: u64,
    /// When the source game answered the freeze (see [`HandoffSource::answered`]), if it was
    /// noted: with the target's adopt time, what [`freeze_cost`] needs.
    pub answered: Option<Answered>,
    /// Inputs routed behind the offer whose forward could not be sent (see
    /// [`HandoffSource::forward_failed`]): lost now that the target owns the unit.
    pub unforwarded: u64,
}

/// The offer was refused: thaw the unit in the game, then apply `inputs` locally, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Thawed<I> {
    pub members: Vec<EntityId>,
    pub inputs: Vec<I>,
    pub freeze_ms: u64,
    /// How many of `inputs` were also forwarded to the target (whose copies it drops).
    pub forwarded_copies: u64,
    /// Inputs held for the unit and left out of `inputs`: sent to a target that died, which
    /// may have applied them (see [`HandoffSource::returned`]).
    pub abandoned: u64,
}

/// What a despawn of frozen members leaves of their unit's handoff.
#[derive(Debug, Clone, PartialEq)]
pub enum AfterDespawn<I> {
    /// The members left all have their snapshot: send the offer.
    Offer(Offer<I>),
    /// The root went before the offer left: nothing is offered to `to`. Thaw the members left
    /// (`thawed.members`, without the root), then apply the held inputs locally.
    Abandoned {
        root: EntityId,
        to: NodeId,
        thawed: Thawed<I>,
    },
}

/// Where an input for an entity goes.
#[derive(Debug, Clone, PartialEq)]
pub enum InputRoute<I> {
    /// Not in a handoff: the local game.
    Local(I),
    /// Frozen before the offer left: held, sent behind the offer.
    Held,
    /// The offer is out (or done): forward to the new owner under `epoch`.
    Forward { to: NodeId, epoch: Epoch, input: I },
}

#[derive(Debug, Clone)]
enum Phase {
    Freezing { parts: HashMap<EntityId, Bytes> },
    Offered { parts: Vec<(EntityId, Bytes)> },
}

#[derive(Debug, Clone)]
struct Outgoing<I> {
    to: NodeId,
    members: Vec<EntityId>,
    offered: Epoch,
    since_ms: u64,
    answered: Option<Answered>,
    phase: Phase,
    /// Held before the offer, or copies of those forwarded since (given back on a refusal).
    inputs: Vec<I>,
    /// Inputs sent to the target with or behind the offer (a copy of each kept in `inputs`)...
    copies: u64,
    /// ...and the positions in `inputs` of those whose forward could not be sent.
    unsent: BTreeSet<usize>,
}

/// The source side of every handoff of this node.
#[derive(Debug, Clone)]
pub struct HandoffSource<I> {
    out: HashMap<EntityId, Outgoing<I>>,
    /// member -> root of the unit it is frozen with.
    root_of: HashMap<EntityId, EntityId>,
    /// Epochs a refused offer used: never offered again (the target remembers its refusal).
    burnt: HashMap<EntityId, Epoch>,
    /// Units handed away: late inputs follow them.
    departed: HashMap<EntityId, (NodeId, Epoch)>,
}

impl<I> Default for HandoffSource<I> {
    fn default() -> Self {
        Self {
            out: HashMap::default(),
            root_of: HashMap::default(),
            burnt: HashMap::default(),
            departed: HashMap::default(),
        }
    }
}

impl<I: Clone> HandoffSource<I> {
    /// Starts handing `root` (owned under `epoch`) and its attachments to `to`.
    pub fn begin(
        &mut self,
        root: EntityId,
        epoch: Epoch,
        attachments: &[EntityId],
        to: NodeId,
        now_ms: u64,
    ) -> Result<Freeze, HandoffError> {
        let mut members = vec![root];
        members.extend(attachments.iter().copied().filter(|a| *a != root));
        if let Some(busy) = members.iter().find(|m| self.root_of.contains_key(m)) {
            return Err(HandoffError::Busy(*busy));
        }
        for m in &members {
            self.root_of.insert(*m, root);
            self.departed.remove(m);
        }
        let offered = epoch.max(self.burnt.get(&root).copied().unwrap_or(0)) + 1;
        self.out.insert(
            root,
            Outgoing {
                to,
                members: members.clone(),
                offered,
                since_ms: now_ms,
                answered: None,
                phase: Phase::Freezing {
                    parts: HashMap::default(),
                },
                inputs: Vec::new(),
                copies: 0,
                unsent: BTreeSet::new(),
            },
        );
        Ok(Freeze { members, epoch })
    }

    /// The game's snapshot of `id`; once every member has one, the offer to send.
    pub fn snapshot(
        &mut self,
        id: EntityId,
        state: Bytes,
    ) -> Result<Option<Offer<I>>, HandoffError> {
        let root = *self
            .root_of
            .get(&id)
            .ok_or(HandoffError::NotInHandoff(id))?;
        // Internal: `root_of` and `out` change together (`begin`, `take`, `despawned`); what a
        // peer answers goes through `check_answer`, which errs on a unit not found.
        let o = self.out.get_mut(&root).expect("a member's unit exists");
        let Phase::Freezing { parts } = &mut o.phase else {
            // A second snapshot after the offer left changes nothing: the offer is immutable.
            return Ok(None);
        };
        parts.insert(id, state);
        Ok(self.offer_if_complete(root))
    }

    /// The game despawned `ids` (a despawn it sent before it saw the Freeze, or the game went
    /// away): no snapshot of them will ever come, so a unit still waiting for one would stay
    /// frozen, in flight, for good. A member goes from its unit; a unit whose root went is
    /// abandoned (its offer never left, so the rest may thaw). An offer already sent stands:
    /// the target may adopt from its snapshot.
    pub fn despawned(&mut self, ids: &[EntityId], now_ms: u64) -> Vec<AfterDespawn<I>> {
        let mut units = Vec::new();
        let mut roots_gone = HashSet::default();
        for &id in ids {
            let Some(&root) = self.root_of.get(&id) else {
                continue;
            };
            let o = self.out.get_mut(&root).expect("a member's unit exists");
            let Phase::Freezing { parts } = &mut o.phase else {
                continue;
            };
            if !units.contains(&root) {
                units.push(root);
            }
            if id == root {
                roots_gone.insert(root);
            } else {
                o.members.retain(|m| *m != id);
                parts.remove(&id);
                self.root_of.remove(&id);
            }
        }
        let mut out = Vec::new();
        for root in units {
            if roots_gone.contains(&root) {
                let to = self.out[&root].to;
                let mut thawed = self.thaw(root, now_ms);
                thawed.members.retain(|m| *m != root);
                out.push(AfterDespawn::Abandoned { root, to, thawed });
            } else if let Some(offer) = self.offer_if_complete(root) {
                out.push(AfterDespawn::Offer(offer));
            }
        }
        out
    }

    /// Every unit still waiting for snapshots, thawed (their game is gone, the entities kept):
    /// (root, target, what to thaw). Offers already sent stand.
    pub fn abandon_freezing(&mut self, now_ms: u64) -> Vec<(EntityId, NodeId, Thawed<I>)> {
        self.abandon_freezing_where(|_| true, now_ms)
    }

    /// Units towards `to` still waiting for snapshots, thawed: their target died, and their
    /// offer never left.
    pub fn abandon_freezing_towards(
        &mut self,
        to: NodeId,
        now_ms: u64,
    ) -> Vec<(EntityId, NodeId, Thawed<I>)> {
        self.abandon_freezing_where(|t| t == to, now_ms)
    }

    fn abandon_freezing_where(
        &mut self,
        towards: impl Fn(NodeId) -> bool,
        now_ms: u64,
    ) -> Vec<(EntityId, NodeId, Thawed<I>)> {
        let mut roots: Vec<(EntityId, NodeId)> = self
            .out
            .iter()
            .filter(|(_, o)| towards(o.to) && matches!(o.phase, Phase::Freezing { .. }))
            .map(|(r, o)| (*r, o.to))
            .collect();
        roots.sort_unstable();
        roots
            .into_iter()
            .map(|(root, to)| (root, to, self.thaw(root, now_ms)))
            .collect()
    }

    /// The target of an in-doubt offer died and the unit was settled without it: `owner` writes
    /// it under `epoch` now (restored from the offer's snapshot or from a newer checkpoint).
    pub fn resolve(
        &mut self,
        root: EntityId,
        owner: NodeId,
        epoch: Epoch,
        now_ms: u64,
    ) -> Result<Completed, HandoffError> {
        let o = self
            .out
            .get_mut(&root)
            .ok_or(HandoffError::NotInHandoff(root))?;
        if !matches!(o.phase, Phase::Offered { .. }) {
            return Err(HandoffError::NotOffered(root));
        }
        o.to = owner;
        o.offered = epoch;
        Ok(self.complete(root, now_ms))
    }

    /// A unit handed to a process that died was restored on `owner` under `epoch`: late
    /// inputs follow it there.
    pub fn redirect_departed(&mut self, id: EntityId, owner: NodeId, epoch: Epoch) {
        // A word repeated after the unit moved on again names an older epoch: it changes nothing.
        if let Some(d) = self.departed.get_mut(&id).filter(|d| epoch >= d.1) {
            *d = (owner, epoch);
        }
    }

    /// Once every member of a freezing unit has its snapshot: the offer, which is final.
    fn offer_if_complete(&mut self, root: EntityId) -> Option<Offer<I>> {
        let o = self.out.get_mut(&root)?;
        let Phase::Freezing { parts } = &mut o.phase else {
            return None;
        };
        if o.members.iter().any(|m| !parts.contains_key(m)) {
            return None;
        }
        let ordered: Vec<_> = o
            .members
            .iter()
            // Internal: members are distinct (`attachments_of` lists each once, the root apart).
            .map(|m| (*m, parts.remove(m).expect("checked above")))
            .collect();
        o.phase = Phase::Offered {
            parts: ordered.clone(),
        };
        // The inputs held so far go to the target right behind the offer: copies from now on.
        o.copies = o.inputs.len() as u64;
        Some(Offer {
            to: o.to,
            root,
            epoch: o.offered,
            parts: ordered,
            inputs: o.inputs.clone(),
        })
    }

    /// The source game's snapshots of `root`'s unit are all in and its offer left, at `at_ms`;
    /// the game's last `TickEnd` before the frame that carried them came at `last_tick_ms`. Only
    /// the first offer counts: a repeat after a lost link changes nothing.
    pub fn answered(&mut self, root: EntityId, at_ms: u64, last_tick_ms: u64) {
        if let Some(o) = self.out.get_mut(&root) {
            // The Freeze went at the end of a tick: no tick before that one is the last.
            let last_tick_ms = last_tick_ms.max(o.since_ms).min(at_ms);
            o.answered.get_or_insert(Answered {
                at_ms,
                last_tick_ms,
            });
        }
    }

    /// The offer could not even be queued (no link to the target): it never left, so the unit
    /// may thaw. Only for that certainty; a lost link after sending leaves the unit in doubt.
    pub fn unsent(&mut self, root: EntityId, now_ms: u64) -> Result<Thawed<I>, HandoffError> {
        let o = self
            .out
            .get_mut(&root)
            .ok_or(HandoffError::NotInHandoff(root))?;
        // Nothing followed an offer that never left.
        o.copies = 0;
        o.unsent.clear();
        Ok(self.thaw(root, now_ms))
    }

    /// `HandoffAck{root, epoch}` from `from`.
    pub fn acked(
        &mut self,
        root: EntityId,
        epoch: Epoch,
        from: NodeId,
        now_ms: u64,
    ) -> Result<Completed, HandoffError> {
        self.check_answer(root, epoch, from)?;
        Ok(self.complete(root, now_ms))
    }

    /// `HandoffRefused{root, epoch}` from `from`: the only way out of doubt back to the source.
    pub fn refused(
        &mut self,
        root: EntityId,
        epoch: Epoch,
        from: NodeId,
        now_ms: u64,
    ) -> Result<Thawed<I>, HandoffError> {
        self.check_answer(root, epoch, from)?;
        self.burnt.insert(root, epoch);
        Ok(self.thaw(root, now_ms))
    }

    /// The offer of `root` to `to` under `epoch` comes back: `to` died, and the restore of
    /// its world found the unit's position this node's and no checkpoint of it under the
    /// offered epoch. The unit thaws here. Of the inputs (those `is` picks) only the ones
    /// whose forward never left are given back: the dead target may have adopted and applied
    /// the others before its checkpoint was written, and an input is applied at most once
    /// (they are `abandoned`). What `is` does not pick (commands) all comes back.
    pub fn returned(
        &mut self,
        root: EntityId,
        epoch: Epoch,
        to: NodeId,
        now_ms: u64,
        is: impl Fn(&I) -> bool,
    ) -> Result<Thawed<I>, HandoffError> {
        self.check_answer(root, epoch, to)?;
        let o = self.take(root);
        let (mut inputs, mut abandoned) = (Vec::new(), 0);
        for (k, i) in o.inputs.into_iter().enumerate() {
            if is(&i) && !o.unsent.contains(&k) {
                abandoned += 1;
            } else {
                inputs.push(i);
            }
        }
        Ok(Thawed {
            members: o.members,
            inputs,
            freeze_ms: now_ms.saturating_sub(o.since_ms),
            // What comes back is unsent, or commands: no input's copy.
            forwarded_copies: 0,
            abandoned,
        })
    }

    /// A frame of `root` from `from` under `epoch`: if it is the target writing under the offered
    /// epoch (or later), the target adopted and the ack was lost.
    pub fn observed(
        &mut self,
        root: EntityId,
        epoch: Epoch,
        from: NodeId,
        now_ms: u64,
    ) -> Option<Completed> {
        let o = self.out.get(&root)?;
        let proves = matches!(o.phase, Phase::Offered { .. }) && from == o.to && epoch >= o.offered;
        proves.then(|| self.complete(root, now_ms))
    }

    /// The in-doubt offer again, unchanged (the link to the target is back). A target that
    /// already adopted answers with another ack.
    ///
    /// The inputs forwarded behind it are not repeated: the target may have applied them, and
    /// inputs carry no per-entity dedupe. Those lost with the old link are lost, as on any
    /// link (at most once); on a refusal they all come back to be applied here.
    pub fn repeat(&self, root: EntityId) -> Result<Offer<I>, HandoffError> {
        let o = self
            .out
            .get(&root)
            .ok_or(HandoffError::NotInHandoff(root))?;
        let Phase::Offered { parts } = &o.phase else {
            return Err(HandoffError::NotOffered(root));
        };
        Ok(Offer {
            to: o.to,
            root,
            epoch: o.offered,
            parts: parts.clone(),
            inputs: Vec::new(),
        })
    }

    pub fn route_input(&mut self, entity: EntityId, input: I) -> InputRoute<I> {
        if let Some(root) = self.root_of.get(&entity) {
            let o = self.out.get_mut(root).expect("a member's unit exists");
            return match o.phase {
                Phase::Freezing { .. } => {
                    o.inputs.push(input);
                    InputRoute::Held
                }
                Phase::Offered { .. } => {
                    o.inputs.push(input.clone());
                    o.copies += 1;
                    InputRoute::Forward {
                        to: o.to,
                        epoch: o.offered,
                        input,
                    }
                }
            };
        }
        match self.departed.get(&entity) {
            Some(&(to, epoch)) => InputRoute::Forward { to, epoch, input },
            None => InputRoute::Local(input),
        }
    }

    /// The forward of the input [`route_input`](Self::route_input) just routed behind the
    /// offer of `entity` could not be sent. Its copy is kept: applied here if the offer is
    /// refused or returned, counted as lost if it completes.
    pub fn forward_failed(&mut self, entity: EntityId) {
        if let Some(o) = self.root_of.get(&entity).and_then(|r| self.out.get_mut(r)) {
            if let Some(last) = o.inputs.len().checked_sub(1) {
                o.unsent.insert(last);
            }
        }
    }

    /// The `k`th input of the offer of `root` (held before it left, sent right behind it)
    /// could not be sent; see [`forward_failed`](Self::forward_failed).
    pub fn held_forward_failed(&mut self, root: EntityId, k: usize) {
        if let Some(o) = self.out.get_mut(&root).filter(|o| k < o.inputs.len()) {
            o.unsent.insert(k);
        }
    }

    /// Frozen (in any phase of a handoff): the game must not write it.
    pub fn is_frozen(&self, id: EntityId) -> bool {
        self.root_of.contains_key(&id)
    }

    /// The members of the unit `id` is handed over with (none outside a handoff).
    pub fn members(&self, id: EntityId) -> &[EntityId] {
        self.root_of
            .get(&id)
            .and_then(|r| self.out.get(r))
            .map_or(&[], |o| &o.members)
    }

    /// Inputs to go behind the offer of `id`'s unit ahead of those held so far: inputs its
    /// game got before it froze and did not apply. Handed back if the offer left already (or
    /// `id` is in no handoff).
    pub fn hold_first(&mut self, id: EntityId, inputs: Vec<I>) -> Result<(), Vec<I>> {
        let Some(o) = self.root_of.get(&id).and_then(|r| self.out.get_mut(r)) else {
            return Err(inputs);
        };
        if !matches!(o.phase, Phase::Freezing { .. }) {
            return Err(inputs);
        }
        o.inputs.splice(0..0, inputs);
        Ok(())
    }

    /// Whether a write of the game to `id` still counts: always outside a handoff, and while
    /// frozen only until its snapshot (writes sent before the game saw the Freeze).
    pub fn writable(&self, id: EntityId) -> bool {
        let Some(root) = self.root_of.get(&id) else {
            return true;
        };
        match &self.out[root].phase {
            Phase::Freezing { parts } => !parts.contains_key(&id),
            Phase::Offered { .. } => false,
        }
    }

    /// The node the unit `member` is frozen in is (being) offered to, and the epoch offered.
    pub fn target_of_member(&self, member: EntityId) -> Option<(NodeId, Epoch)> {
        self.root_of.get(&member).and_then(|r| self.target_of(*r))
    }

    /// The node the unit of `root` is (being) offered to, and the epoch offered.
    pub fn target_of(&self, root: EntityId) -> Option<(NodeId, Epoch)> {
        self.out.get(&root).map(|o| (o.to, o.offered))
    }

    /// Handoffs begun and not finished (frozen, whether offered or not).
    pub fn in_flight(&self) -> usize {
        self.out.len()
    }

    /// Inputs (those `is` picks) held for units whose offer has not left: no copy of them went
    /// anywhere.
    pub fn inputs_not_forwarded(&self, is: impl Fn(&I) -> bool) -> impl Iterator<Item = &I> {
        self.out
            .values()
            .filter(|o| matches!(o.phase, Phase::Freezing { .. }))
            .flat_map(|o| o.inputs.iter())
            .filter(move |i| is(i))
    }

    /// Inputs (those `is` picks) held for units offered to one of `dead`: their copies died
    /// with the target.
    pub fn inputs_offered_to(
        &self,
        dead: impl Fn(NodeId) -> bool,
        is: impl Fn(&I) -> bool,
    ) -> impl Iterator<Item = &I> {
        self.out
            .values()
            .filter(move |o| matches!(o.phase, Phase::Offered { .. }) && dead(o.to))
            .flat_map(|o| o.inputs.iter())
            .filter(move |i| is(i))
    }

    /// Inputs (those `is` picks) held for frozen entities (to apply on a thaw; the copies of
    /// some went on).
    pub fn held_inputs(&self, is: impl Fn(&I) -> bool) -> usize {
        self.out
            .values()
            .map(|o| o.inputs.iter().filter(|i| is(i)).count())
            .sum()
    }

    /// Offers sent and not answered.
    pub fn in_doubt(&self) -> impl Iterator<Item = (EntityId, NodeId, Epoch)> + '_ {
        self.out
            .iter()
            .filter(|(_, o)| matches!(o.phase, Phase::Offered { .. }))
            .map(|(r, o)| (*r, o.to, o.offered))
    }

    /// Roots in a handoff towards `to` (to repeat after its link comes back).
    pub fn towards(&self, to: NodeId) -> Vec<EntityId> {
        let mut roots: Vec<_> = self
            .out
            .iter()
            .filter(|(_, o)| o.to == to)
            .map(|(r, _)| *r)
            .collect();
        roots.sort_unstable();
        roots
    }

    /// Where a unit handed away from here went, and under which epoch.
    pub fn departed_to(&self, id: EntityId) -> Option<(NodeId, Epoch)> {
        self.departed.get(&id).copied()
    }

    /// Stops forwarding late inputs for an entity handed away (it left this node's view).
    pub fn forget(&mut self, id: EntityId) {
        self.departed.remove(&id);
    }

    /// An offer of `id` under `epoch` reached this node while its own offer of `id`'s unit,
    /// under an older epoch, is in doubt: that offer was taken (its target wrote the unit and
    /// handed it on), and its ack was lost with a link. It completes now, as an ack would
    /// complete it; a late ack of it finds nothing.
    pub fn taken(&mut self, id: EntityId, epoch: Epoch, now_ms: u64) -> Option<Completed> {
        let root = *self.root_of.get(&id)?;
        let o = self.out.get(&root)?;
        (matches!(o.phase, Phase::Offered { .. }) && o.offered < epoch)
            .then(|| self.complete(root, now_ms))
    }

    fn check_answer(&self, root: EntityId, epoch: Epoch, from: NodeId) -> Result<(), HandoffError> {
        let o = self
            .out
            .get(&root)
            .ok_or(HandoffError::NotInHandoff(root))?;
        if !matches!(o.phase, Phase::Offered { .. }) {
            return Err(HandoffError::NotOffered(root));
        }
        if from != o.to {
            return Err(HandoffError::WrongNode {
                entity: root,
                from,
                to: o.to,
            });
        }
        if epoch != o.offered {
            return Err(HandoffError::WrongEpoch {
                entity: root,
                expected: o.offered,
                got: epoch,
            });
        }
        Ok(())
    }

    /// Internal: every caller found `root` in `out` first (see `check_answer`).
    fn take(&mut self, root: EntityId) -> Outgoing<I> {
        let o = self.out.remove(&root).expect("checked by the caller");
        for m in &o.members {
            self.root_of.remove(m);
        }
        o
    }

    fn complete(&mut self, root: EntityId, now_ms: u64) -> Completed {
        let o = self.take(root);
        self.burnt.remove(&root);
        for m in &o.members {
            self.departed.insert(*m, (o.to, o.offered));
        }
        Completed {
            to: o.to,
            members: o.members,
            epoch: o.offered,
            freeze_ms: now_ms.saturating_sub(o.since_ms),
            answered: o.answered,
            unforwarded: o.unsent.len() as u64,
        }
    }

    fn thaw(&mut self, root: EntityId, now_ms: u64) -> Thawed<I> {
        let o = self.take(root);
        Thawed {
            members: o.members,
            inputs: o.inputs,
            freeze_ms: now_ms.saturating_sub(o.since_ms),
            forwarded_copies: o.copies.saturating_sub(o.unsent.len() as u64),
            abandoned: 0,
        }
    }
}

/// When the source game answered a freeze, on the source's clock (ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answered {
    /// The snapshot that completed the offer arrived (and the offer left).
    pub at_ms: u64,
    /// The game's last `TickEnd` before the frame that carried that snapshot: the end of the
    /// unit's last simulated tick at the source (a game freezes an entity on `Freeze` and
    /// answers in its next frame, so the tick that frame ends did not simulate it).
    pub last_tick_ms: u64,
}

/// What one completed handoff cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FreezeCost {
    /// From the end of the unit's last simulated tick at the source to the end of its first at
    /// the target (estimated: the two sidecars share no clock).
    pub gap_ms: f64,
    /// Ticks of the game in which nobody simulated the unit (none without a tick period).
    pub ticks_missed: Option<u64>,
    /// The freeze less the time the two games took to answer: what the sidecars and the link
    /// between them cost.
    pub sidecars_ms: u64,
}

/// What a handoff cost, worked out by its source when the ack arrives: `answered` and
/// `acked_ms` on the source's clock, `target_game_ms` the target game's time from `Adopt` to
/// `Adopted` as the ack reports it, `tick_ms` the game's tick period.
///
/// *Ticks missed* is the target's first simulated tick minus the source's last, minus one. With
/// no tick clock common to the two games it is taken from the time between the ends of those
/// two ticks: `max(0, round(gap / tick_ms) - 1)`. The source's last tick ended at
/// `answered.last_tick_ms`; the target's first is the tick whose `TickEnd` came in the frame
/// that carried `Adopted` (a game adopts on `Adopt` and simulates the entity in that tick), so
/// it ended as the target sent the ack, one link crossing before `acked_ms`. That crossing is
/// taken as half the offer-to-ack round trip less the target game's time:
///
/// `gap = (answered - last_tick) + target_game + sidecars / 2`
///
/// *The sidecars' share* is the freeze (`Freeze` sent to ack received) less the source game's
/// time (`Freeze` sent to the snapshot received) and the target game's: `acked - answered -
/// target_game`. It holds both link crossings and the work of both sidecars, to the
/// millisecond of their clocks. A game that sends `Adopted` outside its tick's batch is taken
/// as simulating the entity from then.
pub fn freeze_cost(
    answered: Answered,
    acked_ms: u64,
    target_game_ms: u64,
    tick_ms: Option<f64>,
) -> FreezeCost {
    let last_tick_ms = answered.last_tick_ms.min(answered.at_ms);
    let sidecars_ms = acked_ms
        .saturating_sub(answered.at_ms)
        .saturating_sub(target_game_ms);
    let gap_ms =
        (answered.at_ms - last_tick_ms) as f64 + target_game_ms as f64 + sidecars_ms as f64 / 2.0;
    let ticks_missed = tick_ms
        .filter(|t| *t > 0.0)
        .map(|t| ((gap_ms / t).round() - 1.0).max(0.0) as u64);
    FreezeCost {
        gap_ms,
        ticks_missed,
        sidecars_ms,
    }
}

/// What the target knows when an offer arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OfferChecks {
    /// The offered position is in this node's area...
    pub owns_position: bool,
    /// ...under a live lease...
    pub lease_live: bool,
    /// ...of the partition epoch the source offered under.
    pub partition_epoch_matches: bool,
    /// This node holds the entity as a ghost (it was watching the band).
    pub has_ghost: bool,
    pub draining: bool,
    pub game_connected: bool,
}

impl OfferChecks {
    /// Every check an offer can pass passes (a target that accepts).
    pub const PASSING: Self = Self {
        owns_position: true,
        lease_live: true,
        partition_epoch_matches: true,
        has_ghost: true,
        draining: false,
        game_connected: true,
    };
}

impl OfferChecks {
    fn refusal(&self) -> Option<Refusal> {
        if self.draining {
            Some(Refusal::Draining)
        } else if !self.game_connected {
            Some(Refusal::NoGame)
        } else if !self.lease_live {
            Some(Refusal::LeaseLapsed)
        } else if !self.partition_epoch_matches {
            Some(Refusal::PartitionEpoch)
        } else if !self.owns_position {
            Some(Refusal::NotOwner)
        } else if !self.has_ghost {
            Some(Refusal::NoGhost)
        } else {
            None
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    NotOwner,
    LeaseLapsed,
    PartitionEpoch,
    NoGhost,
    Draining,
    NoGame,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NotOwner => "the target does not own the position",
            Refusal::LeaseLapsed => "the target's lease lapsed",
            Refusal::PartitionEpoch => "the target is on another partition epoch",
            Refusal::NoGhost => "the target holds no ghost of the entity",
            Refusal::Draining => "the target is draining",
            Refusal::NoGame => "the target has no game connected",
        }
    }
}

/// The target's answer to one offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OfferDecision {
    /// Send `Adopt` to the game; answer when it says `Adopted`.
    Adopt,
    /// Already adopting this very offer: the answer follows `Adopted`.
    Pending,
    /// Already adopted: send `HandoffAck` again.
    Ack,
    /// Send `HandoffRefused`.
    Refuse(Refusal),
    /// An offer for an epoch this node has moved past, or another source's claim of an epoch
    /// already answered: dropped (counted).
    Stale,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Adopting,
    Adopted,
    Refused(Refusal),
}

/// The target side of every handoff of this node.
#[derive(Debug, Clone, Default)]
pub struct HandoffTarget {
    /// entity -> recent (epoch, source, outcome), newest last.
    history: HashMap<EntityId, VecDeque<(Epoch, NodeId, Outcome)>>,
    stale_offers: u64,
}

impl HandoffTarget {
    /// An offer of `root` under `epoch` from `from`; `known` is the epoch this node's fence
    /// holds for the entity (its ghost), if any.
    pub fn offer(
        &mut self,
        from: NodeId,
        root: EntityId,
        epoch: Epoch,
        known: Option<Epoch>,
        checks: OfferChecks,
    ) -> OfferDecision {
        let past = self.history.entry(root).or_default();
        if let Some(&(_, source, outcome)) = past.iter().find(|(e, _, _)| *e == epoch) {
            if source != from {
                self.stale_offers += 1;
                return OfferDecision::Stale;
            }
            return match outcome {
                Outcome::Adopting => OfferDecision::Pending,
                Outcome::Adopted => OfferDecision::Ack,
                Outcome::Refused(r) => OfferDecision::Refuse(r),
            };
        }
        let newest = past.iter().map(|(e, _, _)| *e).max();
        if known.into_iter().chain(newest).any(|k| epoch <= k) {
            self.stale_offers += 1;
            return OfferDecision::Stale;
        }
        let (outcome, decision) = match checks.refusal() {
            Some(r) => (Outcome::Refused(r), OfferDecision::Refuse(r)),
            None => (Outcome::Adopting, OfferDecision::Adopt),
        };
        if past.len() == OFFER_HISTORY {
            past.pop_front();
        }
        past.push_back((epoch, from, outcome));
        decision
    }

    /// The game's `Adopted{root, epoch}`: the source to ack, if this was an offer in flight.
    pub fn adopted(&mut self, root: EntityId, epoch: Epoch) -> Option<NodeId> {
        let past = self.history.get_mut(&root)?;
        let entry = past
            .iter_mut()
            .find(|(e, _, o)| *e == epoch && *o == Outcome::Adopting)?;
        entry.2 = Outcome::Adopted;
        Some(entry.1)
    }

    /// Offers in flight to the game.
    pub fn adopting(&self) -> usize {
        self.history
            .values()
            .flatten()
            .filter(|(_, _, o)| *o == Outcome::Adopting)
            .count()
    }

    /// The entity is gone from this node's world (despawned, far out of the band).
    pub fn forget(&mut self, id: EntityId) {
        self.history.remove(&id);
    }

    pub fn stale_offers(&self) -> u64 {
        self.stale_offers
    }
}

/// What the fence does with one frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit<F> {
    Accept(F),
    /// An epoch not seen yet: held until [`Fence::advance`] reaches it.
    Held,
    /// An older epoch, a burnt one, or a writer that is not the epoch's owner: counted, and
    /// handed back so the caller can say what it was.
    Dropped(F),
}

/// Where the fence keeps the epoch and owner (writer) it follows for each entity. The node's
/// entity table keeps them, most inside the ghosts they are about (the same epoch and origin);
/// a map does for a fence on its own.
pub trait FenceRecords {
    fn fenced(&self, id: EntityId) -> Option<(Epoch, NodeId)>;
    fn set_fenced(&mut self, id: EntityId, epoch: Epoch, owner: NodeId);
    fn forget_fenced(&mut self, id: EntityId);
}

impl FenceRecords for HashMap<EntityId, (Epoch, NodeId)> {
    fn fenced(&self, id: EntityId) -> Option<(Epoch, NodeId)> {
        self.get(&id).copied()
    }
    fn set_fenced(&mut self, id: EntityId, epoch: Epoch, owner: NodeId) {
        self.insert(id, (epoch, owner));
    }
    fn forget_fenced(&mut self, id: EntityId) {
        self.remove(&id);
    }
}

/// A frame held for a later epoch, with its writer (`None`: an input).
type Held<F> = (Option<NodeId>, F);

/// Per-entity epochs and owners, as this node has seen them: the records themselves are
/// passed in ([`FenceRecords`]); the fence keeps what waits on them.
#[derive(Debug, Clone)]
pub struct Fence<F> {
    /// Frames of epochs not yet seen, per entity and epoch, in arrival order.
    held: HashMap<EntityId, BTreeMap<Epoch, Vec<Held<F>>>>,
    /// Epochs of refused offers: nothing may be written under them.
    burnt: HashSet<(EntityId, Epoch)>,
    stale_drops: u64,
    /// Held frames dropped since the last [`Fence::take_discarded`] (stale, burnt, forgotten or
    /// over the bound), so the node can count what they were.
    discarded: Vec<F>,
}

impl<F> Default for Fence<F> {
    fn default() -> Self {
        Self {
            held: HashMap::default(),
            burnt: HashSet::default(),
            stale_drops: 0,
            discarded: Vec::new(),
        }
    }
}

impl<F> Fence<F> {
    /// The epoch and owner this node holds for `id`.
    pub fn current(&self, records: &impl FenceRecords, id: EntityId) -> Option<(Epoch, NodeId)> {
        records.fenced(id)
    }

    /// One frame about `id` under `epoch`. `from` is the writer for state frames; `None` for
    /// inputs, which anyone may forward to the owner.
    ///
    /// The first frame of an unknown entity establishes its epoch and owner.
    pub fn admit(
        &mut self,
        records: &mut impl FenceRecords,
        id: EntityId,
        epoch: Epoch,
        from: Option<NodeId>,
        frame: F,
    ) -> Admit<F> {
        if self.burnt.contains(&(id, epoch)) {
            self.stale_drops += 1;
            return Admit::Dropped(frame);
        }
        let Some((known, owner)) = records.fenced(id) else {
            match from {
                Some(owner) => {
                    records.set_fenced(id, epoch, owner);
                    return Admit::Accept(frame);
                }
                None => return self.hold(id, epoch, None, frame),
            }
        };
        if epoch < known {
            self.stale_drops += 1;
            return Admit::Dropped(frame);
        }
        if epoch > known {
            return self.hold(id, epoch, from, frame);
        }
        if from.is_some_and(|f| f != owner) {
            self.stale_drops += 1;
            return Admit::Dropped(frame);
        }
        Admit::Accept(frame)
    }

    /// The epoch change of `id` to `epoch` under `owner` is seen (an adopt here, or the old
    /// owner's word). Returns the held frames now due, in order; older held ones are dropped.
    pub fn advance(
        &mut self,
        records: &mut impl FenceRecords,
        id: EntityId,
        epoch: Epoch,
        owner: NodeId,
    ) -> Vec<F> {
        if records.fenced(id).is_some_and(|(known, _)| known > epoch) {
            self.stale_drops += 1;
            return Vec::new();
        }
        records.set_fenced(id, epoch, owner);
        // A refused offer's epoch burnt here was still given to another node: a later restore
        // decider, which cannot know of the refusal, mints the same epoch above the same
        // candidates. Its owner is the one writer under it now (the owner check keeps the rest
        // out), so this node follows it instead of dropping its every frame.
        self.burnt.remove(&(id, epoch));
        let Some(held) = self.held.get_mut(&id) else {
            return Vec::new();
        };
        let later = held.split_off(&(epoch + 1));
        let due = std::mem::replace(held, later);
        if held.is_empty() {
            self.held.remove(&id);
        }
        let mut out = Vec::new();
        for (e, frames) in due {
            for (from, f) in frames {
                if e == epoch && from.is_none_or(|f| f == owner) {
                    out.push(f);
                } else {
                    self.stale_drops += 1;
                    self.discarded.push(f);
                }
            }
        }
        out
    }

    /// A refused offer's epoch: frames under it (inputs forwarded behind the offer) are dropped.
    pub fn burn(&mut self, id: EntityId, epoch: Epoch) {
        self.burnt.insert((id, epoch));
        if let Some(held) = self.held.get_mut(&id) {
            if let Some(frames) = held.remove(&epoch) {
                self.stale_drops += frames.len() as u64;
                self.discarded.extend(frames.into_iter().map(|(_, f)| f));
            }
            if held.is_empty() {
                self.held.remove(&id);
            }
        }
    }

    /// The entity is gone from this node (despawned, out of the band).
    pub fn forget(&mut self, records: &mut impl FenceRecords, id: EntityId) {
        records.forget_fenced(id);
        if let Some(held) = self.held.remove(&id) {
            self.stale_drops += held.values().map(|v| v.len() as u64).sum::<u64>();
            self.discarded
                .extend(held.into_values().flatten().map(|(_, f)| f));
        }
        self.burnt.retain(|(e, _)| *e != id);
    }

    /// The newest epoch frames of `id` are held for, with their writer: once the old owner is
    /// gone (its link closed), the newer epoch is the only one left to follow.
    pub fn held_newest(&self, id: EntityId) -> Option<(Epoch, NodeId)> {
        let (epoch, frames) = self.held.get(&id)?.last_key_value()?;
        frames
            .iter()
            .find_map(|(from, _)| *from)
            .map(|f| (*epoch, f))
    }

    pub fn held(&self) -> usize {
        self.held
            .values()
            .flat_map(|m| m.values())
            .map(Vec::len)
            .sum()
    }

    /// Held frames that `is` picks.
    pub fn held_where(&self, is: impl Fn(&F) -> bool) -> impl Iterator<Item = &F> {
        self.held
            .values()
            .flat_map(|m| m.values())
            .flatten()
            .map(|(_, f)| f)
            .filter(move |f| is(f))
    }

    pub fn stale_drops(&self) -> u64 {
        self.stale_drops
    }

    /// What is held: (entity, epoch, frames), in entity order.
    pub fn held_by_epoch(&self) -> Vec<(EntityId, Epoch, usize)> {
        let mut v: Vec<(EntityId, Epoch, usize)> = self
            .held
            .iter()
            .flat_map(|(id, m)| m.iter().map(move |(e, f)| (*id, *e, f.len())))
            .collect();
        v.sort_unstable();
        v
    }

    /// Whether `epoch` of `id` was refused here (nothing may be written under it).
    pub fn is_burnt(&self, id: EntityId, epoch: Epoch) -> bool {
        self.burnt.contains(&(id, epoch))
    }

    /// The held frames dropped since the last call.
    pub fn take_discarded(&mut self) -> Vec<F> {
        std::mem::take(&mut self.discarded)
    }

    fn hold(&mut self, id: EntityId, epoch: Epoch, from: Option<NodeId>, frame: F) -> Admit<F> {
        let held = self.held.entry(id).or_default();
        held.entry(epoch).or_default().push((from, frame));
        let total: usize = held.values().map(Vec::len).sum();
        if total > MAX_HELD_FRAMES {
            // Drop the oldest frame of the oldest epoch: a bounded buffer, never a stalled node.
            let mut first = held.first_entry().expect("just pushed");
            let (_, oldest) = first.get_mut().remove(0);
            if first.get().is_empty() {
                first.remove();
            }
            self.stale_drops += 1;
            self.discarded.push(oldest);
        }
        Admit::Held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_world::geometry::WorldShape;
    use cellmesh_world::partition::{Grid, Layout};
    use proptest::prelude::*;

    /// The fence's records, in a map of their own.
    type Records = HashMap<EntityId, (Epoch, NodeId)>;

    const A: NodeId = 1;
    const B: NodeId = 2;
    const C: NodeId = 3;

    fn ok() -> OfferChecks {
        OfferChecks::PASSING
    }

    fn snap(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    /// 16 x 16 chunks split into two columns: A owns x 0..8, B owns x 8..16.
    fn halves() -> Partition {
        let shape = WorldShape {
            width: 512.0,
            height: 512.0,
            chunk_size: 32.0,
            region_size: 128.0,
        };
        let g = Grid::even(&shape, 2, 1, &[A, B]).unwrap();
        Partition::new(shape, 1, Layout::Grid(g)).unwrap()
    }

    #[test]
    fn pacing_on_the_border_never_triggers() {
        let p = halves();
        let area = p.area_of(A);
        // Own chunks, and the first chunk past either border (x 8, and x 15 over the wrap seam).
        for x in [0, 7, 8, 15] {
            assert_eq!(
                trigger(&p, A, &area, ChunkPos { x, y: 3 }, 1),
                None,
                "x {x}"
            );
        }
        // A whole chunk past the line, on both sides of A's area.
        assert_eq!(trigger(&p, A, &area, ChunkPos { x: 9, y: 3 }, 1), Some(B));
        assert_eq!(trigger(&p, A, &area, ChunkPos { x: 14, y: 3 }, 1), Some(B));
        // A wider margin waits longer.
        assert_eq!(trigger(&p, A, &area, ChunkPos { x: 9, y: 3 }, 2), None);
        assert_eq!(trigger(&p, A, &area, ChunkPos { x: 10, y: 3 }, 2), Some(B));
        // Once handed over, the way back needs the same margin.
        let area_b = p.area_of(B);
        assert_eq!(trigger(&p, B, &area_b, ChunkPos { x: 7, y: 3 }, 1), None);
        assert_eq!(trigger(&p, B, &area_b, ChunkPos { x: 6, y: 3 }, 1), Some(A));
    }

    /// geos seed 241: an offer whose ack a cut link lost stays in doubt; the unit came back
    /// under a later epoch while it was, and the repeat of the first offer, acked when the link
    /// returned, evicted the unit just adopted back. An offer of it under a later epoch settles
    /// the first: taken, completed, and its late ack finds nothing.
    #[test]
    fn an_offer_in_doubt_is_taken_when_its_unit_comes_back_under_a_later_epoch() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 1, &[11], B, 1_000).unwrap();
        // Frozen, not offered yet: nothing was taken.
        assert!(s.taken(10, 3, 1_010).is_none());
        s.snapshot(10, snap("a")).unwrap();
        s.snapshot(11, snap("b")).unwrap().unwrap();
        // An offer under the same epoch as ours, or an older one, proves nothing.
        assert!(s.taken(10, 2, 1_020).is_none());
        let done = s
            .taken(11, 3, 1_500)
            .expect("a later epoch settles the offer");
        assert_eq!((done.to, done.epoch, done.members), (B, 2, vec![10, 11]));
        assert!(!s.is_frozen(10) && !s.is_frozen(11));
        assert!(
            s.acked(10, 2, B, 1_600).is_err(),
            "the late ack completes nothing"
        );
    }

    #[test]
    fn a_unit_freezes_offers_and_completes_on_the_ack() {
        let mut s = HandoffSource::<u32>::default();
        let f = s.begin(10, 4, &[11, 12], B, 1_000).unwrap();
        assert_eq!(
            f,
            Freeze {
                members: vec![10, 11, 12],
                epoch: 4
            }
        );
        assert!(s.is_frozen(11));
        assert_eq!(s.begin(11, 4, &[], B, 1_000), Err(HandoffError::Busy(11)));
        assert_eq!(s.snapshot(12, snap("c")).unwrap(), None);
        assert_eq!(s.snapshot(10, snap("a")).unwrap(), None);
        assert_eq!(s.route_input(10, 1), InputRoute::Held);
        let offer = s.snapshot(11, snap("b")).unwrap().unwrap();
        assert_eq!(offer.to, B);
        assert_eq!(offer.epoch, 5);
        assert_eq!(
            offer.parts,
            vec![(10, snap("a")), (11, snap("b")), (12, snap("c"))]
        );
        assert_eq!(offer.inputs, vec![1]);
        assert_eq!(s.in_doubt().collect::<Vec<_>>(), vec![(10, B, 5)]);
        // The game's last tick before its answer ended as the Freeze went; a repeated offer
        // does not move when the game answered.
        s.answered(10, 1_050, 1_000);
        s.answered(10, 1_070, 1_050);
        // Meanwhile inputs follow the offer, in order, under the new epoch.
        assert_eq!(
            s.route_input(10, 2),
            InputRoute::Forward {
                to: B,
                epoch: 5,
                input: 2
            }
        );
        // Answers from the wrong node or epoch change nothing.
        assert!(matches!(
            s.acked(10, 5, C, 1_050),
            Err(HandoffError::WrongNode { .. })
        ));
        assert!(matches!(
            s.acked(10, 4, B, 1_050),
            Err(HandoffError::WrongEpoch { .. })
        ));
        assert!(s.is_frozen(10));
        let done = s.acked(10, 5, B, 1_080).unwrap();
        assert_eq!(
            done,
            Completed {
                to: B,
                members: vec![10, 11, 12],
                epoch: 5,
                freeze_ms: 80,
                answered: Some(Answered {
                    at_ms: 1_050,
                    last_tick_ms: 1_000
                }),
                unforwarded: 0,
            }
        );
        assert!(!s.is_frozen(10));
        assert_eq!(s.in_doubt().count(), 0);
        // Late inputs still reach the new owner; a second ack is an error, not a second evict.
        assert_eq!(
            s.route_input(12, 3),
            InputRoute::Forward {
                to: B,
                epoch: 5,
                input: 3
            }
        );
        assert_eq!(
            s.acked(10, 5, B, 1_090),
            Err(HandoffError::NotInHandoff(10))
        );
        s.forget(12);
        assert_eq!(s.route_input(12, 4), InputRoute::Local(4));
    }

    /// 20 Hz games. The source's tick ending at 1 000 triggers the Freeze; the game answers
    /// `source_late_ticks` ticks later than its next frame; the offer crosses to the target and
    /// the ack back in `link` ms each; the target's tick ends `target_tick_after_offer` ms after
    /// the offer came. The cost, and the true gap between the end of the unit's last tick at the
    /// source and of its first at the target (on the clock the test shares).
    fn handoff_at_20_hz(
        source_late_ticks: u64,
        target_tick_after_offer: u64,
        link: u64,
    ) -> (FreezeCost, u64) {
        const TICK: u64 = 50;
        let frozen: u64 = 1_000;
        // The game answers in the frame that ends its next tick (or later, for a late game):
        // the last tick it simulated the unit in is the one before.
        let answered_at = frozen + TICK * (1 + source_late_ticks);
        let answered = Answered {
            at_ms: answered_at,
            last_tick_ms: answered_at - TICK,
        };
        let adopt_sent = answered_at + link;
        // The target's first tick with the unit ends in the frame that carries `Adopted`.
        let first_tick_end = adopt_sent + target_tick_after_offer;
        let acked = first_tick_end + link;
        let cost = freeze_cost(
            answered,
            acked,
            first_tick_end - adopt_sent,
            Some(TICK as f64),
        );
        (cost, first_tick_end - answered.last_tick_ms)
    }

    #[test]
    fn ticks_missed_count_the_game_ticks_between_the_source_s_last_and_the_target_s_first() {
        // The target's tick ends 9 ms after the offer came: it simulates the unit in the tick
        // that follows the source's last, give or take the games' phases. Nothing missed.
        let (c, truth) = handoff_at_20_hz(0, 9, 1);
        assert_eq!(c.gap_ms, truth as f64);
        assert_eq!((c.ticks_missed, c.sidecars_ms), (Some(0), 2));
        // Its tick ends 39 ms after: nearer the slot of the tick after next. One missed.
        let (c, truth) = handoff_at_20_hz(0, 39, 1);
        assert_eq!(c.gap_ms, truth as f64);
        assert_eq!((c.ticks_missed, c.sidecars_ms), (Some(1), 2));
        // A slow link is the sidecars' share, and it is estimated out of the gap (symmetric).
        let (c, truth) = handoff_at_20_hz(0, 9, 20);
        assert_eq!(c.gap_ms, truth as f64);
        assert_eq!((c.ticks_missed, c.sidecars_ms), (Some(1), 40));
    }

    #[test]
    fn a_target_game_that_adopts_one_tick_late_costs_one_more_tick_not_sidecar_time() {
        let (prompt, _) = handoff_at_20_hz(0, 9, 1);
        let (late, truth) = handoff_at_20_hz(0, 59, 1);
        assert_eq!(late.gap_ms, truth as f64);
        assert_eq!(late.ticks_missed, prompt.ticks_missed.map(|t| t + 1));
        assert_eq!(late.sidecars_ms, prompt.sidecars_ms);
    }

    #[test]
    fn a_source_game_that_answers_one_tick_late_simulated_the_unit_in_that_tick() {
        // Its writes before the snapshot still count (`writable`), so its last simulated tick is
        // the one before the answer: the freeze is a tick longer, the cost in ticks the same.
        let (prompt, _) = handoff_at_20_hz(0, 9, 1);
        let (late, truth) = handoff_at_20_hz(1, 9, 1);
        assert_eq!(late.gap_ms, truth as f64);
        assert_eq!(
            (late.ticks_missed, late.sidecars_ms),
            (prompt.ticks_missed, prompt.sidecars_ms)
        );
    }

    #[test]
    fn an_answer_that_came_with_no_tick_in_between_counts_from_the_freeze() {
        // The game answered at once, outside its tick: its last simulated tick is the one whose
        // end triggered the Freeze.
        let answered = Answered {
            at_ms: 1_002,
            last_tick_ms: 1_000,
        };
        let c = freeze_cost(answered, 1_040, 30, Some(50.0));
        assert_eq!(
            (c.gap_ms, c.ticks_missed, c.sidecars_ms),
            (36.0, Some(0), 8)
        );
        // Clocks that disagree never make a negative share or gap.
        let c = freeze_cost(answered, 1_010, 30, Some(50.0));
        assert_eq!(
            (c.gap_ms, c.ticks_missed, c.sidecars_ms),
            (32.0, Some(0), 0)
        );
        // Without the game's tick rate there is nothing to count ticks in.
        assert_eq!(freeze_cost(answered, 1_040, 30, None).ticks_missed, None);
    }

    #[test]
    fn a_root_despawned_before_its_snapshot_abandons_the_handoff() {
        // The game despawned the avatar (a leave) before it saw the Freeze: no snapshot of it
        // will come, so waiting for one kept the unit in flight for good.
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 1, &[11], B, 1_000).unwrap();
        assert_eq!(s.route_input(10, 1), InputRoute::Held);
        assert_eq!(s.snapshot(11, snap("b")).unwrap(), None);
        assert_eq!(
            s.despawned(&[10], 1_020),
            vec![AfterDespawn::Abandoned {
                root: 10,
                to: B,
                thawed: Thawed {
                    members: vec![11],
                    inputs: vec![1],
                    freeze_ms: 20,
                    forwarded_copies: 0,
                    abandoned: 0,
                },
            }]
        );
        assert_eq!(s.in_flight(), 0);
        assert!(!s.is_frozen(11));
        assert_eq!(s.route_input(10, 2), InputRoute::Local(2));
        // The attachment left may be handed over on its own.
        assert!(s.begin(11, 1, &[], B, 1_030).is_ok());
    }

    #[test]
    fn a_member_despawned_before_its_snapshot_leaves_the_unit() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 1, &[11, 12], B, 0).unwrap();
        assert_eq!(s.snapshot(10, snap("a")).unwrap(), None);
        assert_eq!(s.snapshot(12, snap("c")).unwrap(), None);
        assert_eq!(s.route_input(10, 1), InputRoute::Held);
        // The one snapshot missing was the despawned member's: the offer goes without it.
        let after = s.despawned(&[11], 10);
        let [AfterDespawn::Offer(offer)] = after.as_slice() else {
            panic!("expected the offer: {after:?}");
        };
        assert_eq!(offer.parts, vec![(10, snap("a")), (12, snap("c"))]);
        assert_eq!((offer.to, offer.epoch, &offer.inputs), (B, 2, &vec![1]));
        assert!(!s.is_frozen(11));
        assert_eq!(s.in_doubt().collect::<Vec<_>>(), vec![(10, B, 2)]);
        // Once offered, the unit waits for the target's answer whatever goes locally (the
        // target may adopt from the snapshot).
        assert_eq!(s.despawned(&[10, 12], 20), vec![]);
        assert_eq!(s.in_doubt().count(), 1);
        assert!(s.acked(10, 2, B, 30).is_ok());
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_game_gone_while_freezing_abandons_the_whole_unit() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 1, &[11], B, 0).unwrap();
        assert_eq!(s.snapshot(10, snap("a")).unwrap(), None);
        // The attachment first: the root's snapshot alone must not be offered, the root is gone.
        let after = s.despawned(&[11, 10, 99], 5);
        assert!(
            matches!(
                after.as_slice(),
                [AfterDespawn::Abandoned { root: 10, thawed, .. }] if thawed.members.is_empty()
            ),
            "{after:?}"
        );
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.despawned(&[10], 6), vec![], "nothing in flight any more");
    }

    #[test]
    fn an_unanswered_offer_stays_frozen_and_only_a_refusal_thaws() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 0, &[], B, 0).unwrap();
        assert_eq!(s.route_input(10, 1), InputRoute::Held);
        s.snapshot(10, snap("a")).unwrap().unwrap();
        assert!(matches!(s.route_input(10, 2), InputRoute::Forward { .. }));
        // However long the silence, nothing but an answer moves it.
        assert!(s.is_frozen(10));
        assert_eq!(s.towards(B), vec![10]);
        let again = s.repeat(10).unwrap();
        assert_eq!((again.to, again.epoch), (B, 1));
        assert!(again.inputs.is_empty(), "the target may have applied them");
        let t = s.refused(10, 1, B, 500).unwrap();
        assert_eq!(
            t,
            Thawed {
                members: vec![10],
                inputs: vec![1, 2],
                freeze_ms: 500,
                // 1 was held and went right behind the offer, 2 was routed behind it: the
                // target has copies of both.
                forwarded_copies: 2,
                abandoned: 0,
            }
        );
        assert!(!s.is_frozen(10));
        assert_eq!(s.route_input(10, 3), InputRoute::Local(3));
        // The refused epoch is never offered again: the target remembers its refusal.
        s.begin(10, 0, &[], B, 600).unwrap();
        assert_eq!(s.snapshot(10, snap("a")).unwrap().unwrap().epoch, 2);
    }

    #[test]
    fn an_offer_returned_from_a_dead_target_gives_back_only_what_never_reached_it() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 0, &[], B, 0).unwrap();
        // 1 held, sent right behind the offer (the first of them could not be).
        assert_eq!(s.route_input(10, 1), InputRoute::Held);
        assert_eq!(s.route_input(10, 2), InputRoute::Held);
        s.snapshot(10, snap("a")).unwrap().unwrap();
        s.held_forward_failed(10, 0);
        // 3 forwarded, 4 not (the link went), 5 forwarded; 100 is a command.
        assert!(matches!(s.route_input(10, 3), InputRoute::Forward { .. }));
        assert!(matches!(s.route_input(10, 4), InputRoute::Forward { .. }));
        s.forward_failed(10);
        assert!(matches!(s.route_input(10, 100), InputRoute::Forward { .. }));
        assert!(matches!(s.route_input(10, 5), InputRoute::Forward { .. }));
        assert!(matches!(
            s.returned(10, 1, C, 900, |i| *i < 100),
            Err(HandoffError::WrongNode { .. })
        ));
        let t = s.returned(10, 1, B, 900, |i| *i < 100).unwrap();
        // 2, 3 and 5 reached the dead target, which may have applied them: never again here.
        assert_eq!(
            t,
            Thawed {
                members: vec![10],
                inputs: vec![1, 4, 100],
                freeze_ms: 900,
                forwarded_copies: 0,
                abandoned: 3,
            }
        );
        assert!(!s.is_frozen(10));
        assert_eq!(s.route_input(10, 6), InputRoute::Local(6));
    }

    #[test]
    fn an_offer_that_never_left_may_thaw() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 0, &[], B, 0).unwrap();
        s.route_input(10, 7);
        s.snapshot(10, snap("a")).unwrap().unwrap();
        let t = s.unsent(10, 20).unwrap();
        assert_eq!(t.inputs, vec![7]);
        // The held input never followed the offer: no copy of it is anywhere else.
        assert_eq!(t.forwarded_copies, 0);
        assert!(!s.is_frozen(10));
    }

    #[test]
    fn the_targets_own_frame_proves_the_lost_ack() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 3, &[], B, 0).unwrap();
        assert_eq!(s.observed(10, 4, B, 5), None, "not offered yet");
        s.snapshot(10, snap("a")).unwrap().unwrap();
        assert_eq!(s.observed(10, 3, B, 5), None, "an old frame proves nothing");
        assert_eq!(s.observed(10, 4, C, 5), None, "another node proves nothing");
        let done = s.observed(10, 4, B, 9).unwrap();
        assert_eq!((done.to, done.epoch), (B, 4));
    }

    #[test]
    fn a_dead_targets_unit_is_settled_by_its_restore() {
        let mut s = HandoffSource::<u32>::default();
        s.begin(10, 3, &[], B, 0).unwrap();
        s.begin(20, 3, &[], B, 0).unwrap();
        s.begin(30, 3, &[], C, 0).unwrap();
        assert_eq!(s.resolve(10, C, 1004, 1), Err(HandoffError::NotOffered(10)));
        s.snapshot(10, snap("a")).unwrap().unwrap();
        // What was still freezing towards the dead node thaws; the rest waits.
        let thawed = s.abandon_freezing_towards(B, 1);
        assert_eq!(thawed.iter().map(|t| t.0).collect::<Vec<_>>(), vec![20]);
        assert!(s.is_frozen(10) && s.is_frozen(30));
        // Restored on C under the restore's epoch: late inputs follow it there.
        let done = s.resolve(10, C, 1004, 2).unwrap();
        assert_eq!((done.to, done.epoch), (C, 1004));
        assert!(!s.is_frozen(10));
        assert_eq!(s.departed_to(10), Some((C, 1004)));
        // The dead target's ack no longer counts.
        assert!(s.acked(10, 4, B, 3).is_err());
        s.redirect_departed(10, 4, 2004);
        assert_eq!(s.departed_to(10), Some((4, 2004)));
    }

    #[test]
    fn the_target_checks_every_condition() {
        let cases = [
            (
                OfferChecks {
                    draining: true,
                    ..ok()
                },
                Refusal::Draining,
            ),
            (
                OfferChecks {
                    lease_live: false,
                    ..ok()
                },
                Refusal::LeaseLapsed,
            ),
            (
                OfferChecks {
                    partition_epoch_matches: false,
                    ..ok()
                },
                Refusal::PartitionEpoch,
            ),
            (
                OfferChecks {
                    owns_position: false,
                    ..ok()
                },
                Refusal::NotOwner,
            ),
            (
                OfferChecks {
                    has_ghost: false,
                    ..ok()
                },
                Refusal::NoGhost,
            ),
            (
                OfferChecks {
                    game_connected: false,
                    ..ok()
                },
                Refusal::NoGame,
            ),
        ];
        for (checks, why) in cases {
            let mut t = HandoffTarget::default();
            assert_eq!(
                t.offer(A, 10, 1, Some(0), checks),
                OfferDecision::Refuse(why)
            );
            // A replay gets the same refusal, even once the condition cleared.
            assert_eq!(t.offer(A, 10, 1, Some(0), ok()), OfferDecision::Refuse(why));
            assert_eq!(t.adopted(10, 1), None);
        }
    }

    #[test]
    fn a_replayed_offer_is_idempotent() {
        let mut t = HandoffTarget::default();
        assert_eq!(t.offer(A, 10, 1, Some(0), ok()), OfferDecision::Adopt);
        assert_eq!(t.offer(A, 10, 1, Some(0), ok()), OfferDecision::Pending);
        assert_eq!(t.adopting(), 1);
        assert_eq!(t.adopted(10, 1), Some(A));
        assert_eq!(t.adopted(10, 1), None, "one ack per adopt");
        assert_eq!(t.offer(A, 10, 1, Some(1), ok()), OfferDecision::Ack);
        // Another node offering the same epoch, or anyone an older one, is stale.
        assert_eq!(t.offer(C, 10, 1, Some(1), ok()), OfferDecision::Stale);
        assert_eq!(t.offer(A, 10, 0, Some(1), ok()), OfferDecision::Stale);
        // The entity later moved on (epoch 2 elsewhere): the old offer is still answered, since
        // the source may be in doubt about it.
        assert_eq!(t.offer(A, 10, 1, Some(2), ok()), OfferDecision::Ack);
        assert_eq!(t.stale_offers(), 2);
    }

    #[test]
    fn an_offer_behind_the_fence_is_stale() {
        let mut t = HandoffTarget::default();
        assert_eq!(t.offer(A, 10, 3, Some(3), ok()), OfferDecision::Stale);
        assert_eq!(t.offer(A, 10, 4, Some(3), ok()), OfferDecision::Adopt);
        assert_eq!(t.offer(A, 10, 2, None, ok()), OfferDecision::Stale);
    }

    #[test]
    fn the_fence_drops_old_epochs_and_holds_new_ones() {
        let (mut f, mut r) = (Fence::<&str>::default(), Records::default());
        assert_eq!(f.admit(&mut r, 10, 3, Some(A), "a3"), Admit::Accept("a3"));
        assert_eq!(f.current(&r, 10), Some((3, A)));
        assert_eq!(f.admit(&mut r, 10, 2, Some(A), "a2"), Admit::Dropped("a2"));
        assert_eq!(
            f.admit(&mut r, 10, 3, Some(B), "b3"),
            Admit::Dropped("b3"),
            "not the owner"
        );
        assert_eq!(f.admit(&mut r, 10, 4, Some(B), "b4-1"), Admit::Held);
        assert_eq!(f.admit(&mut r, 10, 4, None, "input4"), Admit::Held);
        assert_eq!(f.admit(&mut r, 10, 5, Some(C), "c5"), Admit::Held);
        assert_eq!(f.admit(&mut r, 10, 4, Some(B), "b4-2"), Admit::Held);
        assert_eq!(
            f.admit(&mut r, 10, 3, Some(A), "a3-last"),
            Admit::Accept("a3-last")
        );
        assert_eq!(f.stale_drops(), 2);
        assert_eq!(f.advance(&mut r, 10, 4, B), vec!["b4-1", "input4", "b4-2"]);
        assert_eq!(f.held(), 1);
        assert_eq!(
            f.admit(&mut r, 10, 4, Some(B), "b4-3"),
            Admit::Accept("b4-3")
        );
        // Jumping past an epoch drops what was held for it; going back is refused.
        assert_eq!(f.admit(&mut r, 10, 5, Some(B), "b5"), Admit::Held);
        assert_eq!(f.advance(&mut r, 10, 5, C), vec!["c5"]);
        assert_eq!(f.stale_drops(), 3);
        assert_eq!(f.advance(&mut r, 10, 4, B), Vec::<&str>::new());
        assert_eq!(f.current(&r, 10), Some((5, C)));
    }

    #[test]
    fn a_burnt_epoch_takes_nothing() {
        let (mut f, mut r) = (Fence::<u32>::default(), Records::default());
        f.admit(&mut r, 10, 0, Some(A), 0);
        assert_eq!(f.admit(&mut r, 10, 1, None, 1), Admit::Held);
        f.burn(10, 1);
        assert_eq!(f.held(), 0);
        assert_eq!(f.take_discarded(), [1], "what a burn drops is handed back");
        assert_eq!(f.admit(&mut r, 10, 1, None, 2), Admit::Dropped(2));
        assert_eq!(f.stale_drops(), 2);
    }

    #[test]
    fn a_burnt_epoch_given_to_another_owner_is_followed() {
        let (mut f, mut r) = (Fence::<u32>::default(), Records::default());
        f.admit(&mut r, 10, 0, Some(A), 0);
        // Refused here (offered by a restore decider under epoch 1)...
        f.burn(10, 1);
        assert_eq!(f.admit(&mut r, 10, 1, Some(B), 1), Admit::Dropped(1));
        // ...then adopted by C under the same epoch, offered by another decider.
        assert!(f.advance(&mut r, 10, 1, C).is_empty());
        assert_eq!(f.admit(&mut r, 10, 1, Some(C), 2), Admit::Accept(2));
        assert_eq!(
            f.admit(&mut r, 10, 1, Some(B), 3),
            Admit::Dropped(3),
            "only the epoch's owner writes under it"
        );
    }

    #[test]
    fn the_held_buffer_is_bounded() {
        let (mut f, mut r) = (Fence::<usize>::default(), Records::default());
        f.admit(&mut r, 10, 0, Some(A), 0);
        for i in 0..MAX_HELD_FRAMES + 10 {
            assert_eq!(f.admit(&mut r, 10, 1, Some(B), i), Admit::Held);
        }
        assert_eq!(f.held(), MAX_HELD_FRAMES);
        assert_eq!(f.stale_drops(), 10);
        assert_eq!(f.take_discarded(), (0..10).collect::<Vec<_>>());
        let due = f.advance(&mut r, 10, 1, B);
        assert_eq!(due.first(), Some(&10), "the oldest were dropped");
        assert_eq!(due.len(), MAX_HELD_FRAMES);
    }

    // --- Two nodes, one entity, an unreliable link: never two writers at one moment. ---

    const E: EntityId = 77;

    #[derive(Debug, Clone)]
    enum Msg {
        Offer { epoch: Epoch },
        Input { epoch: Epoch, seq: u32 },
        Ack { epoch: Epoch },
        Refuse { epoch: Epoch },
        Frame { epoch: Epoch },
    }

    #[derive(Debug, Clone)]
    enum Op {
        Start,
        DeliverToB,
        DeliverToA,
        LinkLoss,
        LinkBack,
        Replay(usize),
        Drain(bool),
        BGameAdopts,
        BWrites,
        Input,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => Just(Op::Start),
            4 => Just(Op::DeliverToB),
            4 => Just(Op::DeliverToA),
            1 => Just(Op::LinkLoss),
            2 => Just(Op::LinkBack),
            1 => (0usize..64).prop_map(Op::Replay),
            1 => any::<bool>().prop_map(Op::Drain),
            2 => Just(Op::BGameAdopts),
            2 => Just(Op::BWrites),
            3 => Just(Op::Input),
        ]
    }

    struct World {
        src: HandoffSource<u32>,
        /// The source owns E (false once acked).
        a_owns: bool,
        a_epoch: Epoch,
        tgt: HandoffTarget,
        fence_b: Fence<u32>,
        records_b: Records,
        b_adopting: Option<Epoch>,
        b_owns: Option<Epoch>,
        draining: bool,
        link_up: bool,
        to_b: VecDeque<Msg>,
        to_a: VecDeque<Msg>,
        sent_to_b: Vec<Msg>,
        /// Every (node, epoch) that ever wrote E.
        claims: Vec<(NodeId, Epoch)>,
        applied: Vec<u32>,
        next_seq: u32,
    }

    impl World {
        fn new() -> Self {
            let (mut fence_b, mut records_b) = (Fence::default(), Records::default());
            // B ghosts E, written by A under epoch 0.
            fence_b.admit(&mut records_b, E, 0, Some(A), 0);
            Self {
                src: HandoffSource::default(),
                a_owns: true,
                a_epoch: 0,
                tgt: HandoffTarget::default(),
                fence_b,
                records_b,
                b_adopting: None,
                b_owns: None,
                draining: false,
                link_up: true,
                to_b: VecDeque::new(),
                to_a: VecDeque::new(),
                sent_to_b: Vec::new(),
                claims: vec![(A, 0)],
                applied: Vec::new(),
                next_seq: 0,
            }
        }

        fn a_writes(&self) -> bool {
            self.a_owns && !self.src.is_frozen(E)
        }

        fn send_b(&mut self, m: Msg) {
            self.sent_to_b.push(m.clone());
            if self.link_up {
                self.to_b.push_back(m);
            }
        }

        fn send_a(&mut self, m: Msg) {
            if self.link_up {
                self.to_a.push_back(m);
            }
        }

        fn claim(&mut self, node: NodeId, epoch: Epoch) {
            assert!(
                !self.claims.iter().any(|(n, e)| *e == epoch && *n != node),
                "epoch {epoch} claimed by two nodes: {:?} and {node}",
                self.claims
            );
            self.claims.push((node, epoch));
        }

        fn send_offer(&mut self, o: Offer<u32>) {
            self.send_b(Msg::Offer { epoch: o.epoch });
            for seq in o.inputs {
                self.send_b(Msg::Input {
                    epoch: o.epoch,
                    seq,
                });
            }
        }

        fn step(&mut self, op: Op) {
            match op {
                Op::Start => {
                    if self.a_writes() {
                        self.src.begin(E, self.a_epoch, &[], B, 0).unwrap();
                        if let Some(o) = self.src.snapshot(E, snap("s")).unwrap() {
                            if self.link_up {
                                self.send_offer(o);
                            } else {
                                let t = self.src.unsent(E, 0).unwrap();
                                self.applied.extend(t.inputs);
                            }
                        }
                    }
                }
                Op::DeliverToB => {
                    if let Some(m) = self.to_b.pop_front() {
                        self.at_b(m)
                    }
                }
                Op::DeliverToA => {
                    if let Some(m) = self.to_a.pop_front() {
                        self.at_a(m)
                    }
                }
                Op::LinkLoss => {
                    self.link_up = false;
                    self.to_b.clear();
                    self.to_a.clear();
                }
                Op::LinkBack => {
                    if !self.link_up {
                        self.link_up = true;
                        for root in self.src.towards(B) {
                            if let Ok(o) = self.src.repeat(root) {
                                self.send_offer(o);
                            }
                        }
                    }
                }
                Op::Replay(i) => {
                    // An old offer arriving again (a late relay, a repeat after a flap). Inputs
                    // are not replayed: the link is ordered and the game dedupes by sequence.
                    let offers: Vec<_> = self
                        .sent_to_b
                        .iter()
                        .filter(|m| matches!(m, Msg::Offer { .. }))
                        .cloned()
                        .collect();
                    if self.link_up && !offers.is_empty() {
                        self.to_b.push_back(offers[i % offers.len()].clone());
                    }
                }
                Op::Drain(d) => self.draining = d,
                Op::BGameAdopts => {
                    if let Some(epoch) = self.b_adopting.take() {
                        self.b_owns = Some(epoch);
                        self.claim(B, epoch);
                        let due = self.fence_b.advance(&mut self.records_b, E, epoch, B);
                        self.applied.extend(due);
                        if let Some(to) = self.tgt.adopted(E, epoch) {
                            assert_eq!(to, A);
                            self.send_a(Msg::Ack { epoch });
                        }
                    }
                }
                Op::BWrites => {
                    if let Some(epoch) = self.b_owns {
                        self.send_a(Msg::Frame { epoch });
                    }
                }
                Op::Input => {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    if self.b_owns.is_some() && !self.a_owns {
                        // The gateway already routes to B; modelled as applied there.
                        self.applied.push(seq);
                        return;
                    }
                    match self.src.route_input(E, seq) {
                        InputRoute::Local(s) => self.applied.push(s),
                        InputRoute::Held => {}
                        InputRoute::Forward { epoch, input, .. } => {
                            self.send_b(Msg::Input { epoch, seq: input })
                        }
                    }
                }
            }
        }

        fn at_b(&mut self, m: Msg) {
            match m {
                Msg::Offer { epoch } => {
                    let checks = OfferChecks {
                        draining: self.draining,
                        ..ok()
                    };
                    let known = self.fence_b.current(&self.records_b, E).map(|(e, _)| e);
                    match self.tgt.offer(A, E, epoch, known, checks) {
                        OfferDecision::Adopt => self.b_adopting = Some(epoch),
                        OfferDecision::Ack => self.send_a(Msg::Ack { epoch }),
                        OfferDecision::Refuse(_) => {
                            self.fence_b.burn(E, epoch);
                            self.send_a(Msg::Refuse { epoch });
                        }
                        OfferDecision::Pending | OfferDecision::Stale => {}
                    }
                }
                Msg::Input { epoch, seq } => {
                    if let Admit::Accept(s) =
                        self.fence_b.admit(&mut self.records_b, E, epoch, None, seq)
                    {
                        assert_eq!(self.b_owns, Some(epoch), "B applies only what it owns");
                        self.applied.push(s);
                    }
                }
                _ => unreachable!("only offers and inputs go to B"),
            }
        }

        fn at_a(&mut self, m: Msg) {
            match m {
                Msg::Ack { epoch } => {
                    if let Ok(done) = self.src.acked(E, epoch, B, 0) {
                        self.a_owns = false;
                        assert_eq!(self.b_owns, Some(done.epoch), "acked only after adopting");
                    }
                }
                Msg::Refuse { epoch } => {
                    if let Ok(t) = self.src.refused(E, epoch, B, 0) {
                        self.applied.extend(t.inputs);
                        self.claim(A, self.a_epoch);
                    }
                }
                Msg::Frame { epoch } => {
                    if self.src.observed(E, epoch, B, 0).is_some() {
                        self.a_owns = false;
                    }
                }
                _ => unreachable!("only answers and frames go to A"),
            }
        }

        fn check(&self) {
            let writers = usize::from(self.a_writes()) + usize::from(self.b_owns.is_some());
            assert!(
                writers <= 1,
                "two writers: A {} B {:?}",
                self.a_writes(),
                self.b_owns
            );
            let mut seen = self.applied.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(
                seen.len(),
                self.applied.len(),
                "an input applied twice: {:?}",
                self.applied
            );
        }

        /// Heal: the link comes back and every message is delivered until quiet.
        fn settle(&mut self) {
            self.draining = false;
            self.step(Op::LinkBack);
            for _ in 0..64 {
                self.step(Op::BGameAdopts);
                while let Some(m) = self.to_b.pop_front() {
                    self.at_b(m);
                }
                self.step(Op::BGameAdopts);
                while let Some(m) = self.to_a.pop_front() {
                    self.at_a(m);
                }
                self.check();
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn link_loss_and_replay_never_make_two_owners(ops in proptest::collection::vec(op(), 1..80)) {
            let mut w = World::new();
            for op in ops {
                w.step(op);
                w.check();
            }
            w.settle();
            // After healing nobody is in doubt and exactly one node owns the entity.
            prop_assert_eq!(w.src.in_doubt().count(), 0);
            prop_assert!(!w.src.is_frozen(E));
            prop_assert_eq!(usize::from(w.a_owns) + usize::from(w.b_owns.is_some()), 1);
        }
    }
}
