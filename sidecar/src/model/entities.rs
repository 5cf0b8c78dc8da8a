//! The node's entity table: every entity its game simulates, indexed by chunk, with what changed
//! since the last tick end. Pure: the game connection feeds it, the fold reads it.

use std::collections::BTreeMap;
use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::{FxBuildHasher, FxHashMap as HashMap, FxHashSet as HashSet};

use bytes::Bytes;
use cellmesh_world::geometry::{ChunkPos, Pos, WorldShape};
use cellmesh_world::partition::NodeId;
use litemap::LiteMap;

use crate::model::audience::Audience;
use crate::model::component_store::InlineStore;
use crate::model::handoff::{Epoch, FenceRecords};
use crate::model::node_set::NodeSet;

/// A position in metres; x and y normalised onto the torus, z carried along.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Position {
    pub x: f64,
    pub y: f64,
    pub z: f64,
}

impl Position {
    pub fn new(x: f64, y: f64, z: f64) -> Self {
        Self { x, y, z }
    }
    fn is_finite(&self) -> bool {
        self.x.is_finite() && self.y.is_finite() && self.z.is_finite()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Component {
    pub audience: Audience,
    pub payload: Bytes,
}

/// Payloads up to this size are copied out of the frame they arrived in when they are kept.
pub const DETACH_UP_TO: usize = 4096;

/// `b`, in an allocation of its own when it is small. A slice of a decoded frame keeps the
/// whole frame (up to the frame limit) allocated for as long as it is held, and an entity that
/// stops changing holds its last state for good: a world of idle entities would keep one frame
/// per entity. A copy costs one small allocation when the state changes; larger payloads keep
/// their frame's share small and stay slices.
pub fn detached(b: Bytes) -> Bytes {
    if b.len() <= DETACH_UP_TO {
        Bytes::copy_from_slice(&b)
    } else {
        b
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Entity {
    pub id: u64,
    pub position: Position,
    pub chunk: ChunkPos,
    /// Empty for entities nobody owns (NPCs). A boxed string: no spare capacity to carry.
    pub owner_account: Box<str>,
    /// The player's own avatar: the anchor of the owner's view.
    pub is_master: bool,
    pub parent_id: u64,
    /// Sorted by type, the first inside the entity: a ghost has one or two components, and a
    /// tree's nodes would cost it hundreds of bytes.
    pub components: Components,
    pub(crate) role: Role,
    /// Bumped by every handoff: the fencing token of whoever writes the entity.
    pub epoch: u64,
}

/// What this node is to an entity, with what it keeps of it in that part. One field for both:
/// a local entity has no origin and a ghost no holders, and apart they would make every entity
/// a larger allocation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Role {
    /// This node's own entity, with the nodes holding its render ghost (the replication's
    /// record, kept here so that it costs no table slot of its own).
    Local { holders: NodeSet },
    /// A render ghost (a replica of a foreign entity: public components only, written only by
    /// frames from its owner) of `origin`'s entity. `fenced`: the epoch fence follows this
    /// ghost's own epoch and origin, so its record is the ghost's (nearly always: it is kept
    /// apart only while the two differ).
    Ghost { origin: NodeId, fenced: bool },
}

impl Role {
    /// A local entity's (no holders yet) for `None`, else a ghost's of `origin`.
    pub(crate) fn of(origin: Option<NodeId>) -> Self {
        match origin {
            None => Role::Local {
                holders: NodeSet::new(),
            },
            Some(origin) => Role::Ghost {
                origin,
                fenced: false,
            },
        }
    }
}

impl Entity {
    /// `None` for this node's own entities; the owning node for a render ghost.
    pub fn origin(&self) -> Option<NodeId> {
        match self.role {
            Role::Local { .. } => None,
            Role::Ghost { origin, .. } => Some(origin),
        }
    }

    pub fn is_ghost(&self) -> bool {
        matches!(self.role, Role::Ghost { .. })
    }
}

/// An entity's components by type.
pub type Components = LiteMap<u32, Component, InlineStore<u32, Component>>;

/// The components of a new entity, in a store of exactly their count: collecting one by one
/// would grow it to four at least, and most entities keep the one or two they spawned with.
/// A type given twice keeps its last value, as inserting one by one would.
fn components_of(mut v: Vec<(u32, Component)>) -> Components {
    v.reverse();
    v.sort_by_key(|(t, _)| *t); // stable: of a type given twice, the last given comes first
    v.dedup_by_key(|(t, _)| *t);
    // Exactly their count, so that one component moves inline and the vector is freed.
    v.shrink_to_fit();
    LiteMap::from_sorted_store_unchecked(InlineStore::from_sorted(v))
}

/// A spawn as the game asked for it.
#[derive(Debug, Clone, Default)]
pub struct NewEntity {
    pub id: u64,
    pub position: Position,
    pub owner_account: String,
    pub is_master: bool,
    pub parent_id: u64,
    pub components: Vec<(u32, Component)>,
    pub origin: Option<u32>,
    pub epoch: u64,
}

/// An update as the game asked for it: only what changed.
#[derive(Debug, Clone, Default)]
pub struct EntityUpdate {
    pub id: u64,
    pub position: Option<Position>,
    pub changed: Vec<(u32, Component)>,
    pub removed: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EntityError {
    #[error("entity id 0 is reserved; ids come from ReserveIds")]
    ZeroId,
    #[error("entity {0} is already spawned; the original is kept unchanged")]
    Duplicate(u64),
    #[error("entity {0} is not spawned on this node")]
    Unknown(u64),
    #[error("entity {id}: position ({x}, {y}, {z}) is not finite")]
    NonFinite { id: u64, x: f64, y: f64, z: f64 },
}

impl EntityError {
    pub fn entity_id(&self) -> u64 {
        match self {
            EntityError::ZeroId => 0,
            EntityError::Duplicate(id) | EntityError::Unknown(id) => *id,
            EntityError::NonFinite { id, .. } => *id,
        }
    }
}

/// What happened to one entity since the last tick end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EntityChange {
    /// The entity present at the tick start is gone (despawned, perhaps spawned again).
    pub despawned: bool,
    /// A new entity with this id exists now; clients get its full state.
    pub spawned: bool,
    pub moved: bool,
    /// Component types set or removed during the tick, with the audience each had at the tick
    /// start (`None`: it did not exist). Whether it exists now is in the table.
    pub components: LiteMap<u32, Option<Audience>>,
}

/// Everything that changed in one tick, by entity id (ordered, so batches are deterministic).
pub type TickChanges = BTreeMap<u64, EntityChange>;

/// Folds `later` (changes recorded after `earlier` was taken) into `earlier`, as if both had
/// been recorded as one: what the table would have recorded had nothing been taken in between.
pub fn merge_changes(earlier: &mut TickChanges, later: &TickChanges) {
    for (&id, b) in later {
        let Some(a) = earlier.get_mut(&id) else {
            earlier.insert(id, b.clone());
            continue;
        };
        if b.despawned || b.spawned {
            // The entity present at the start is gone if `a` despawned it, or if `b` despawned
            // the one `a` ended with and that one was it (`a` spawned none).
            *a = EntityChange {
                despawned: a.despawned || (!a.spawned && b.despawned),
                spawned: b.spawned,
                ..Default::default()
            };
        } else if !a.spawned {
            a.moved |= b.moved;
            for (&t, before) in &b.components {
                a.components.entry(t).or_insert_with(|| before.clone());
            }
        }
        if *a == EntityChange::default() {
            earlier.remove(&id);
        }
    }
}

#[derive(Debug, Clone)]
pub struct EntityTable {
    world: WorldShape,
    /// Boxed: a hash table keeps a quarter to a half of its slots empty, and an empty slot of
    /// a boxed entity costs 8 bytes where one of an entity would cost its whole size. Keyed by
    /// the entity's own id (see [`slot_hash`]): a slot is the box alone, not the id again.
    entities: HashTable<Box<Entity>>,
    /// The epoch fence's records ([`FenceRecords`]) of entities it follows that are not held
    /// here, or are held under another epoch or writer than it follows, or are local. The
    /// record of a ghost the fence follows as it is is the ghost's own epoch and origin.
    fenced_apart: HashMap<u64, (Epoch, NodeId)>,
    /// The holders of render ghosts of entities no longer local here (despawned, or now a
    /// ghost themselves), until replication tells them or forgets them; a local entity keeps
    /// its own.
    holders_apart: HashMap<u64, NodeSet>,
    residents: HashMap<ChunkPos, HashSet<u64>>,
    masters: HashMap<Box<str>, u64>,
    /// Bumped whenever an avatar is spawned, adopted, handed away or despawned here.
    masters_version: u64,
    changes: TickChanges,
    /// Render ghosts despawned since the changes were last taken: a despawn's change no longer
    /// has the entity to say it was a ghost.
    ghosts_gone: HashSet<u64>,
    /// How many entities are render ghosts, kept as they change (read after every peer frame).
    ghosts: usize,
}

impl EntityTable {
    pub fn new(world: WorldShape) -> Self {
        Self {
            world,
            entities: HashTable::new(),
            fenced_apart: HashMap::default(),
            holders_apart: HashMap::default(),
            residents: HashMap::default(),
            masters: HashMap::default(),
            masters_version: 0,
            changes: TickChanges::new(),
            ghosts_gone: HashSet::default(),
            ghosts: 0,
        }
    }

    pub fn world(&self) -> &WorldShape {
        &self.world
    }

    pub fn len(&self) -> usize {
        self.entities.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entities.is_empty()
    }

    pub fn get(&self, id: u64) -> Option<&Entity> {
        self.entities
            .find(slot_hash(id), |e| e.id == id)
            .map(|e| &**e)
    }

    fn contains(&self, id: u64) -> bool {
        self.get(id).is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Entity> {
        self.entities.iter().map(|e| &**e)
    }

    /// Ids of the entities in `chunk`.
    pub fn residents(&self, chunk: ChunkPos) -> impl Iterator<Item = u64> + '_ {
        self.residents.get(&chunk).into_iter().flatten().copied()
    }

    /// The avatar of `account`, if its game spawned one (the most recent, if several).
    pub fn master_of(&self, account: &str) -> Option<&Entity> {
        self.masters.get(account).and_then(|id| self.get(*id))
    }

    /// Changes whenever [`Self::masters`] or one of their epochs may have changed.
    pub fn masters_version(&self) -> u64 {
        self.masters_version
    }

    /// Every account with an avatar here (real or ghost), and its entity.
    pub fn masters(&self) -> impl Iterator<Item = (&str, u64)> {
        self.masters.iter().map(|(a, id)| (&**a, *id))
    }

    fn place(&self, p: Position) -> (Position, ChunkPos) {
        let n = self.world.normalise(Pos { x: p.x, y: p.y });
        (
            Position {
                x: n.x,
                y: n.y,
                z: p.z,
            },
            self.world.chunk_of(n),
        )
    }

    pub fn spawn(&mut self, e: NewEntity) -> Result<(), EntityError> {
        if e.id == 0 {
            return Err(EntityError::ZeroId);
        }
        if self.contains(e.id) {
            return Err(EntityError::Duplicate(e.id));
        }
        check_finite(e.id, &e.position)?;
        let (position, chunk) = self.place(e.position);
        let entity = Entity {
            id: e.id,
            position,
            chunk,
            owner_account: e.owner_account.into_boxed_str(),
            is_master: e.is_master,
            parent_id: e.parent_id,
            components: components_of(e.components),
            role: Role::of(e.origin),
            epoch: e.epoch,
        };
        self.residents.entry(chunk).or_default().insert(e.id);
        if entity.is_master && !entity.owner_account.is_empty() {
            self.masters.insert(entity.owner_account.clone(), e.id);
            self.masters_version += 1;
        }
        self.ghosts += usize::from(entity.is_ghost());
        self.entities
            .insert_unique(slot_hash(e.id), Box::new(entity), |e| slot_hash(e.id));
        self.settle_records(e.id);
        // A respawn within the tick keeps `despawned`: clients that saw the old one lose it first.
        let change = self.changes.entry(e.id).or_default();
        *change = EntityChange {
            despawned: change.despawned,
            spawned: true,
            ..Default::default()
        };
        Ok(())
    }

    /// Applies an update; checks everything first, so a rejected update changes nothing.
    pub fn update(&mut self, u: EntityUpdate) -> Result<(), EntityError> {
        if !self.contains(u.id) {
            return Err(EntityError::Unknown(u.id));
        }
        if let Some(p) = &u.position {
            check_finite(u.id, p)?;
        }
        let placed = u.position.map(|p| self.place(p));
        // Internal: checked at the top; nothing between removes an entity.
        let entity = self
            .entities
            .find_mut(slot_hash(u.id), |e| e.id == u.id)
            .expect("checked above");
        let change = self.changes.entry(u.id).or_default();
        if let Some((position, chunk)) = placed {
            if position != entity.position {
                change.moved = true;
                entity.position = position;
            }
            if chunk != entity.chunk {
                if let Some(set) = self.residents.get_mut(&entity.chunk) {
                    set.remove(&u.id);
                    if set.is_empty() {
                        self.residents.remove(&entity.chunk);
                    }
                }
                self.residents.entry(chunk).or_default().insert(u.id);
                entity.chunk = chunk;
            }
        }
        for t in u.removed {
            if let Some(old) = entity.components.remove(&t) {
                change.components.entry(t).or_insert(Some(old.audience));
            }
        }
        for (t, c) in u.changed {
            let before = entity.components.get(&t).map(|old| old.audience.clone());
            change.components.entry(t).or_insert(before);
            entity.components.insert(t, c);
        }
        if change.spawned {
            // Clients get a new entity's full state anyway; nothing to track per field.
            change.moved = false;
            change.components.clear();
        }
        if *change == EntityChange::default() {
            self.changes.remove(&u.id);
        }
        Ok(())
    }

    pub fn despawn(&mut self, id: u64) -> Result<Entity, EntityError> {
        // What the fence and the replication keep of it outlives it.
        self.unsettle_records(id);
        let (entity, _) = self
            .entities
            .find_entry(slot_hash(id), |e| e.id == id)
            .map_err(|_| EntityError::Unknown(id))?
            .remove();
        if let Some(set) = self.residents.get_mut(&entity.chunk) {
            set.remove(&id);
            if set.is_empty() {
                self.residents.remove(&entity.chunk);
            }
        }
        if self.masters.get(&entity.owner_account) == Some(&id) {
            self.masters.remove(&entity.owner_account);
            self.masters_version += 1;
        }
        if entity.is_ghost() {
            self.ghosts -= 1;
            self.ghosts_gone.insert(id);
        }
        let change = self.changes.entry(id).or_default();
        if change.spawned && !change.despawned {
            // Born and gone within one tick: no client ever saw it.
            self.changes.remove(&id);
        } else {
            *change = EntityChange {
                despawned: true,
                ..Default::default()
            };
        }
        Ok(*entity)
    }

    /// Despawns the node's own entities, keeping ghosts (the game went away).
    pub fn clear_local(&mut self) -> Vec<Entity> {
        let ids: Vec<u64> = self
            .iter()
            .filter(|e| !e.is_ghost())
            .map(|e| e.id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.despawn(id).ok())
            .collect()
    }

    /// Despawns everything (the game went away); returns the removed entities.
    pub fn clear(&mut self) -> Vec<Entity> {
        let ids: Vec<u64> = self.iter().map(|e| e.id).collect();
        ids.into_iter()
            .filter_map(|id| self.despawn(id).ok())
            .collect()
    }

    /// The changes since the last call; starts the next tick.
    pub fn take_changes(&mut self) -> TickChanges {
        self.ghosts_gone.clear();
        std::mem::take(&mut self.changes)
    }

    /// Takes the changes of render ghosts only (those that are ghosts now, and ghosts despawned),
    /// so they can reach clients before the tick ends; the node's own entities' changes stay for
    /// the tick. [`merge_changes`] puts the two back together for what needs the whole tick.
    pub fn take_ghost_changes(&mut self) -> TickChanges {
        let entities = &self.entities;
        let gone = &mut self.ghosts_gone;
        let mut taken = TickChanges::new();
        self.changes.retain(|id, change| {
            let ghost = match entities.find(slot_hash(*id), |e| e.id == *id) {
                Some(e) => e.is_ghost(),
                None => gone.remove(id),
            };
            if ghost {
                taken.insert(*id, std::mem::take(change));
            }
            !ghost
        });
        taken
    }

    pub fn pending_changes(&self) -> &TickChanges {
        &self.changes
    }
}

impl EntityTable {
    /// This node's own entity `id` (not a ghost), for what the game asks.
    pub fn get_local(&self, id: u64) -> Option<&Entity> {
        self.get(id).filter(|e| !e.is_ghost())
    }

    /// Sets a render ghost to the full state its owner sent: spawned if new, otherwise changed
    /// in place (components missing from `full` are removed), so clients see an update rather
    /// than a vanish and a new appear. A local entity of the same id is left alone.
    pub fn set_ghost(&mut self, full: NewEntity) -> Result<(), EntityError> {
        let Some(existing) = self.get(full.id) else {
            return self.spawn(full);
        };
        if !existing.is_ghost() {
            return Err(EntityError::Duplicate(full.id));
        }
        let removed: Vec<u32> = existing
            .components
            .keys()
            .filter(|t| !full.components.iter().any(|(c, _)| c == *t))
            .copied()
            .collect();
        let (owner, master, epoch) = (full.owner_account.clone(), full.is_master, full.epoch);
        self.update(EntityUpdate {
            id: full.id,
            position: Some(full.position),
            changed: full.components,
            removed,
        })?;
        self.unsettle_records(full.id);
        let e = self
            .entities
            .find_mut(slot_hash(full.id), |e| e.id == full.id)
            .expect("updated above");
        e.role = Role::of(full.origin);
        e.epoch = epoch;
        if *e.owner_account != *owner || e.is_master != master {
            if self.masters.get(&e.owner_account) == Some(&e.id) {
                self.masters.remove(&e.owner_account);
                self.masters_version += 1;
            }
            e.owner_account = owner.into_boxed_str();
            e.is_master = master;
            if e.is_master && !e.owner_account.is_empty() {
                self.masters.insert(e.owner_account.clone(), e.id);
                self.masters_version += 1;
            }
        }
        self.settle_records(full.id);
        Ok(())
    }

    /// A local entity handed to `owner` becomes its render ghost under `epoch`, silently: clients
    /// keep seeing it (no vanish). Non-public components go; the new owner routes them now.
    pub fn to_ghost(&mut self, id: u64, owner: u32, epoch: u64) -> bool {
        if self.get_local(id).is_none() {
            return false;
        }
        self.unsettle_records(id);
        let e = self
            .entities
            .find_mut(slot_hash(id), |e| e.id == id)
            .expect("checked above");
        e.role = Role::of(Some(owner));
        e.epoch = epoch;
        self.ghosts += 1;
        if e.is_master {
            self.masters_version += 1;
        }
        e.components.retain(|_, c| c.audience.is_public());
        // Changes of this tick were the old owner's to send; they are stale now.
        self.changes.remove(&id);
        self.settle_records(id);
        true
    }

    /// This node adopted `full.id`: its ghost (if any) becomes the local entity with every
    /// component, without a vanish or a fresh appear; a move since the ghost's last frame is
    /// recorded as one. With no ghost (a successor adopting from the snapshot) it is spawned.
    pub fn to_local(&mut self, full: NewEntity) -> Result<(), EntityError> {
        let Some(e) = self.get(full.id) else {
            return self.spawn(full);
        };
        if !e.is_ghost() {
            return Err(EntityError::Duplicate(full.id));
        }
        check_finite(full.id, &full.position)?;
        self.unsettle_records(full.id);
        let e = self
            .entities
            .find_mut(slot_hash(full.id), |e| e.id == full.id)
            .expect("checked above");
        e.role = Role::of(None);
        self.ghosts -= 1;
        e.epoch = full.epoch;
        if e.is_master {
            self.masters_version += 1;
        }
        e.parent_id = full.parent_id;
        e.components = full.components.into_iter().collect();
        if *e.owner_account != *full.owner_account || e.is_master != full.is_master {
            if self.masters.get(&e.owner_account) == Some(&e.id) {
                self.masters.remove(&e.owner_account);
                self.masters_version += 1;
            }
            e.owner_account = full.owner_account.into_boxed_str();
            e.is_master = full.is_master;
            if e.is_master && !e.owner_account.is_empty() {
                self.masters.insert(e.owner_account.clone(), e.id);
                self.masters_version += 1;
            }
        }
        // Always a recorded move (a spawn already says everything): the new owner's first frame
        // to its subscribers is a full one.
        let id = full.id;
        self.update(EntityUpdate {
            id,
            position: Some(full.position),
            ..Default::default()
        })?;
        let change = self.changes.entry(id).or_default();
        change.moved |= !change.spawned;
        self.settle_records(id);
        Ok(())
    }

    /// Sets the epoch of a ghost (its owner changed hands).
    pub fn set_origin(&mut self, id: u64, owner: u32, epoch: u64) {
        if !self.get(id).is_some_and(Entity::is_ghost) {
            return;
        }
        self.unsettle_records(id);
        if let Some(e) = self.entities.find_mut(slot_hash(id), |e| e.id == id) {
            e.role = Role::of(Some(owner));
            e.epoch = epoch;
        }
        self.settle_records(id);
    }

    /// Ids of the render ghosts whose owner is `node`.
    pub fn ghosts_of(&self, node: u32) -> Vec<u64> {
        self.iter()
            .filter(|e| e.origin() == Some(node))
            .map(|e| e.id)
            .collect()
    }

    /// Render ghosts held.
    pub fn ghost_count(&self) -> usize {
        self.ghosts
    }

    /// Before `id`'s epoch, role or presence changes: what the fence and the replication keep
    /// of it inside it moves apart, so the change cannot change their records.
    fn unsettle_records(&mut self, id: u64) {
        let Some(e) = self.entities.find_mut(slot_hash(id), |e| e.id == id) else {
            return;
        };
        match &mut e.role {
            Role::Ghost { origin, fenced } => {
                if std::mem::take(fenced) {
                    self.fenced_apart.insert(id, (e.epoch, *origin));
                }
            }
            Role::Local { holders } => {
                if !holders.is_empty() {
                    self.holders_apart.insert(id, std::mem::take(holders));
                }
            }
        }
    }

    /// After `id` changed or appeared: the records kept apart move inside it where it can
    /// hold them (the fence's record of a ghost it follows as it is, a local entity's holders).
    fn settle_records(&mut self, id: u64) {
        let Some(e) = self.entities.find_mut(slot_hash(id), |e| e.id == id) else {
            return;
        };
        match &mut e.role {
            Role::Ghost { origin, fenced } => {
                if self.fenced_apart.get(&id) == Some(&(e.epoch, *origin)) {
                    self.fenced_apart.remove(&id);
                    *fenced = true;
                }
            }
            Role::Local { holders } => {
                if let Some(apart) = self.holders_apart.remove(&id) {
                    *holders = apart;
                }
            }
        }
    }

    // ------------------------------------------------------------------ replication's record

    /// The nodes holding the render ghost of `id` (a local entity, or one that was), as far
    /// as this node knows; empty when none does.
    pub fn holders(&self, id: u64) -> &NodeSet {
        static NONE: NodeSet = NodeSet::EMPTY;
        if let Some(apart) = self.holders_apart.get(&id) {
            return apart;
        }
        match self.get(id).map(|e| &e.role) {
            Some(Role::Local { holders }) => holders,
            _ => &NONE,
        }
    }

    /// The record of the holders of `id`, to change in place (an empty set is no record).
    fn holders_mut(&mut self, id: u64) -> &mut NodeSet {
        if !self.holders_apart.contains_key(&id) {
            if let Some(e) = self.entities.find_mut(slot_hash(id), |e| e.id == id) {
                if let Role::Local { holders } = &mut e.role {
                    return holders;
                }
            }
        }
        self.holders_apart.entry(id).or_default()
    }

    /// Drops a record left empty apart.
    fn drop_empty_holders(&mut self, id: u64) {
        if self.holders_apart.get(&id).is_some_and(NodeSet::is_empty) {
            self.holders_apart.remove(&id);
        }
    }

    /// `node` holds the render ghost of `id` now; false if it did already.
    pub fn add_holder(&mut self, id: u64, node: NodeId) -> bool {
        let added = self.holders_mut(id).insert(node);
        self.drop_empty_holders(id);
        added
    }

    /// `node` no longer holds the render ghost of `id`.
    pub fn remove_holder(&mut self, id: u64, node: NodeId) {
        self.holders_mut(id).remove(&node);
        self.drop_empty_holders(id);
    }

    /// The holders of `id`, forgotten here.
    pub fn take_holders(&mut self, id: u64) -> NodeSet {
        let taken = std::mem::take(self.holders_mut(id));
        self.holders_apart.remove(&id);
        taken
    }

    /// `holders` hold the render ghost of `id` from now on, and no other node does.
    pub fn set_holders(&mut self, id: u64, holders: NodeSet) {
        *self.holders_mut(id) = holders;
        self.drop_empty_holders(id);
    }

    /// `node` holds no render ghost of this node's any more (its link went down).
    pub fn forget_holder(&mut self, node: NodeId) {
        for e in self.entities.iter_mut() {
            if let Role::Local { holders } = &mut e.role {
                holders.remove(&node);
            }
        }
        self.holders_apart.retain(|_, holders| {
            holders.remove(&node);
            !holders.is_empty()
        });
    }
}

/// The epoch fence's record of an entity is the ghost's own epoch and origin when it follows
/// the ghost as it is, which is nearly always: a record of its own would cost each ghost a
/// table slot.
impl FenceRecords for EntityTable {
    fn fenced(&self, id: u64) -> Option<(Epoch, NodeId)> {
        if let Some(apart) = self.fenced_apart.get(&id) {
            return Some(*apart);
        }
        match self.get(id) {
            Some(Entity {
                role:
                    Role::Ghost {
                        origin,
                        fenced: true,
                    },
                epoch,
                ..
            }) => Some((*epoch, *origin)),
            _ => None,
        }
    }

    fn set_fenced(&mut self, id: u64, epoch: Epoch, owner: NodeId) {
        self.forget_fenced(id);
        self.fenced_apart.insert(id, (epoch, owner));
        self.settle_records(id);
    }

    fn forget_fenced(&mut self, id: u64) {
        self.fenced_apart.remove(&id);
        if let Some(e) = self.entities.find_mut(slot_hash(id), |e| e.id == id) {
            if let Role::Ghost { fenced, .. } = &mut e.role {
                *fenced = false;
            }
        }
    }
}

/// Where entity `id` hashes in the table.
fn slot_hash(id: u64) -> u64 {
    FxBuildHasher.hash_one(id)
}

fn check_finite(id: u64, p: &Position) -> Result<(), EntityError> {
    if p.is_finite() {
        Ok(())
    } else {
        Err(EntityError::NonFinite {
            id,
            x: p.x,
            y: p.y,
            z: p.z,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::handoff::FenceRecords;

    #[test]
    fn small_payloads_are_detached_from_their_frame_and_large_ones_are_not() {
        let frame = Bytes::from(vec![7u8; 65_536]);
        let range = frame.as_ptr() as usize..frame.as_ptr() as usize + frame.len();
        let small = detached(frame.slice(100..164));
        assert_eq!(small.as_ref(), &[7u8; 64][..]);
        assert!(
            !range.contains(&(small.as_ptr() as usize)),
            "a copy of its own"
        );
        let large = detached(frame.slice(0..DETACH_UP_TO + 1));
        assert!(
            range.contains(&(large.as_ptr() as usize)),
            "still the frame's"
        );
    }

    fn table() -> EntityTable {
        EntityTable::new(WorldShape {
            width: 1024.0,
            height: 1024.0,
            chunk_size: 32.0,
            region_size: 512.0,
        })
    }

    fn public(payload: &'static str) -> Component {
        Component {
            audience: Audience::PublicInRange,
            payload: Bytes::from_static(payload.as_bytes()),
        }
    }

    fn npc(id: u64, x: f64, y: f64) -> NewEntity {
        NewEntity {
            id,
            position: Position::new(x, y, 0.0),
            components: vec![(1, public("a"))],
            ..Default::default()
        }
    }

    #[test]
    fn spawn_indexes_by_chunk_and_normalises() {
        let mut t = table();
        t.spawn(npc(1, -16.0, 40.0)).unwrap();
        let e = t.get(1).unwrap();
        assert_eq!(e.position, Position::new(1008.0, 40.0, 0.0));
        assert_eq!(e.chunk, ChunkPos { x: 31, y: 1 });
        assert_eq!(
            t.residents(ChunkPos { x: 31, y: 1 }).collect::<Vec<_>>(),
            [1]
        );
        let ch = t.take_changes();
        assert!(ch[&1].spawned && !ch[&1].despawned);
        assert!(t.take_changes().is_empty());
    }

    #[test]
    fn an_entity_with_one_component_is_one_allocation_of_at_most_168_bytes() {
        // The allocator rounds a request up to 8 bytes past it, in steps of 16: 168 bytes are
        // a 176-byte block, 8 more would be 192. Every render ghost pays this, so a field added
        // here should take another's place. It holds the fence's record of a ghost and a local
        // entity's holders (`Role`), and a single component inline in 64 bytes.
        assert_eq!(std::mem::size_of::<Role>(), 16);
        assert_eq!(std::mem::size_of::<Components>(), 64);
        assert!(std::mem::size_of::<Entity>() <= 168);
        let mut t = table();
        t.spawn(npc(1, 40.0, 40.0)).unwrap();
        let e = t.get(1).unwrap();
        let at = e as *const Entity as usize;
        let (ty, _) = e.components.iter().next().unwrap();
        let component = ty as *const u32 as usize;
        assert!(
            (at..at + std::mem::size_of::<Entity>()).contains(&component),
            "the one component is kept inside the entity"
        );
    }
    #[test]
    fn the_fences_record_of_a_ghost_it_follows_as_it_is_costs_no_slot_of_its_own() {
        let mut t = table();
        // The first frame of a ghost establishes the fence's record before the ghost is set.
        t.set_fenced(9, 3, 2);
        t.set_ghost(NewEntity {
            origin: Some(2),
            epoch: 3,
            ..npc(9, 1.0, 1.0)
        })
        .unwrap();
        assert!(t.fenced_apart.is_empty(), "kept inside the ghost");
        assert_eq!(t.fenced(9), Some((3, 2)));
        // The ghost moving on to another writer leaves the fence's record as it was.
        t.set_origin(9, 4, 5);
        assert_eq!(t.fenced(9), Some((3, 2)));
        t.set_fenced(9, 5, 4);
        assert!(t.fenced_apart.is_empty());
        // It outlives the ghost, until the fence forgets it.
        t.despawn(9).unwrap();
        assert_eq!(t.fenced(9), Some((5, 4)));
        t.forget_fenced(9);
        assert_eq!(t.fenced(9), None);
    }

    #[test]
    fn a_local_entitys_holders_live_inside_it_and_outlive_it() {
        let mut t = table();
        t.spawn(npc(1, 1.0, 1.0)).unwrap();
        assert!(t.add_holder(1, 3) && !t.add_holder(1, 3));
        assert!(t.holders_apart.is_empty(), "kept inside the entity");
        // Despawned: replication still tells the holders it is gone.
        t.despawn(1).unwrap();
        assert_eq!(t.holders(1).iter().collect::<Vec<_>>(), [3]);
        // A respawn within the tick inherits them, as the old record did.
        t.spawn(npc(1, 1.0, 1.0)).unwrap();
        assert!(t.holders_apart.is_empty());
        assert_eq!(t.take_holders(1).iter().collect::<Vec<_>>(), [3]);
        assert!(t.holders(1).is_empty());
        // A ghost never holds any: what is recorded for its id is kept apart.
        t.add_holder(1, 2);
        t.to_ghost(1, 2, 1);
        assert_eq!(t.holders_apart.len(), 1);
        t.forget_holder(2);
        assert!(t.holders_apart.is_empty() && t.holders(1).is_empty());
    }

    #[test]
    fn a_spawn_keeps_its_components_by_type_and_the_last_of_a_type_given_twice() {
        let mut t = table();
        let mut e = npc(1, 1.0, 1.0);
        e.components = vec![(9, public("x")), (2, public("b")), (9, public("y"))];
        t.spawn(e).unwrap();
        let held: Vec<(u32, &[u8])> = t
            .get(1)
            .unwrap()
            .components
            .iter()
            .map(|(k, c)| (*k, &c.payload[..]))
            .collect();
        assert_eq!(held, [(2, &b"b"[..]), (9, &b"y"[..])]);
    }

    #[test]
    fn validation_errors_change_nothing() {
        let mut t = table();
        assert_eq!(t.spawn(npc(0, 1.0, 1.0)), Err(EntityError::ZeroId));
        t.spawn(npc(7, 1.0, 1.0)).unwrap();
        t.take_changes();
        let mut dup = npc(7, 500.0, 500.0);
        dup.components = vec![];
        assert_eq!(t.spawn(dup), Err(EntityError::Duplicate(7)));
        assert_eq!(t.get(7).unwrap().position, Position::new(1.0, 1.0, 0.0));
        assert_eq!(t.get(7).unwrap().components.len(), 1);
        assert_eq!(
            t.update(EntityUpdate {
                id: 8,
                ..Default::default()
            }),
            Err(EntityError::Unknown(8))
        );
        assert_eq!(t.despawn(8), Err(EntityError::Unknown(8)));
        let nan = EntityUpdate {
            id: 7,
            position: Some(Position::new(f64::NAN, 0.0, 0.0)),
            changed: vec![(2, public("b"))],
            ..Default::default()
        };
        assert!(matches!(
            t.update(nan),
            Err(EntityError::NonFinite { id: 7, .. })
        ));
        assert!(
            !t.get(7).unwrap().components.contains_key(&2),
            "a rejected update applies nothing"
        );
        let inf = npc(9, f64::INFINITY, 0.0);
        assert!(matches!(
            t.spawn(inf),
            Err(EntityError::NonFinite { id: 9, .. })
        ));
        assert!(t.take_changes().is_empty());
    }

    #[test]
    fn update_tracks_moves_and_component_history() {
        let mut t = table();
        t.spawn(npc(1, 1.0, 1.0)).unwrap();
        t.take_changes();
        let owner_only = Component {
            audience: Audience::OwnerOnly,
            payload: Bytes::new(),
        };
        t.update(EntityUpdate {
            id: 1,
            position: Some(Position::new(40.0, 1.0, 2.0)),
            changed: vec![(1, owner_only.clone()), (2, public("new"))],
            removed: vec![],
        })
        .unwrap();
        t.update(EntityUpdate {
            id: 1,
            changed: vec![(1, public("again"))],
            ..Default::default()
        })
        .unwrap();
        t.update(EntityUpdate {
            id: 1,
            removed: vec![2, 99],
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            t.residents(ChunkPos { x: 1, y: 0 }).collect::<Vec<_>>(),
            [1]
        );
        assert_eq!(t.residents(ChunkPos { x: 0, y: 0 }).count(), 0);
        let ch = t.take_changes().remove(&1).unwrap();
        assert!(ch.moved && !ch.spawned && !ch.despawned);
        // Type 1 remembers its audience at the tick start, type 2 that it did not exist; 99 never did.
        assert_eq!(
            ch.components,
            litemap::LiteMap::from_iter([(1, Some(Audience::PublicInRange)), (2, None)])
        );
    }

    #[test]
    fn an_update_to_the_same_place_is_not_a_move() {
        let mut t = table();
        t.spawn(npc(1, 1.0, 1.0)).unwrap();
        t.take_changes();
        t.update(EntityUpdate {
            id: 1,
            position: Some(Position::new(1.0, 1.0, 0.0)),
            ..Default::default()
        })
        .unwrap();
        assert!(t.take_changes().is_empty());
    }

    #[test]
    fn spawn_and_despawn_within_a_tick() {
        let mut t = table();
        t.spawn(npc(1, 1.0, 1.0)).unwrap();
        t.despawn(1).unwrap();
        assert!(t.take_changes().is_empty(), "never seen, nothing to tell");
        t.spawn(npc(2, 1.0, 1.0)).unwrap();
        t.take_changes();
        t.despawn(2).unwrap();
        t.spawn(npc(2, 90.0, 1.0)).unwrap();
        let ch = t.take_changes().remove(&2).unwrap();
        assert!(
            ch.despawned && ch.spawned,
            "old incarnation vanishes, new one appears"
        );
        t.despawn(2).unwrap();
        let ch = t.take_changes().remove(&2).unwrap();
        assert!(ch.despawned && !ch.spawned);
    }

    #[test]
    fn a_ghost_set_twice_changes_in_place() {
        let mut t = table();
        let ghost = |x: f64, comps: Vec<(u32, Component)>| NewEntity {
            id: 9,
            position: Position::new(x, 1.0, 0.0),
            components: comps,
            origin: Some(2),
            ..Default::default()
        };
        t.set_ghost(ghost(1.0, vec![(1, public("a")), (2, public("b"))]))
            .unwrap();
        t.take_changes();
        t.set_ghost(ghost(40.0, vec![(1, public("a2"))])).unwrap();
        let ch = t.take_changes().remove(&9).unwrap();
        assert!(!ch.spawned && !ch.despawned && ch.moved);
        assert_eq!(ch.components.keys().copied().collect::<Vec<_>>(), [1, 2]);
        assert_eq!(t.get(9).unwrap().components.len(), 1);
        assert!(t.get_local(9).is_none() && t.ghosts_of(2) == [9]);
        // A ghost never overwrites one of the node's own entities.
        t.spawn(npc(10, 1.0, 1.0)).unwrap();
        let mut other = ghost(1.0, vec![]);
        other.id = 10;
        assert_eq!(t.set_ghost(other), Err(EntityError::Duplicate(10)));
        assert_eq!(t.get(10).unwrap().origin(), None);
    }

    #[test]
    fn masters_index_follows_spawn_and_despawn() {
        let mut t = table();
        let avatar = NewEntity {
            id: 5,
            owner_account: "alice".into(),
            is_master: true,
            ..Default::default()
        };
        t.spawn(avatar).unwrap();
        t.spawn(NewEntity {
            id: 6,
            owner_account: "alice".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(t.master_of("alice").map(|e| e.id), Some(5));
        assert_eq!(t.clear().len(), 2);
        assert!(t.master_of("alice").is_none() && t.is_empty());
        assert_eq!(t.residents(ChunkPos { x: 0, y: 0 }).count(), 0);
    }

    /// One operation of a random history on a few ids, ghosts among them.
    #[derive(Debug, Clone)]
    enum Op {
        Spawn { id: u64, ghost: bool },
        Move { id: u64, x: f64 },
        Set { id: u64, t: u32 },
        Remove { id: u64, t: u32 },
        Despawn { id: u64 },
        ToGhost { id: u64 },
        ToLocal { id: u64 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let id = 1u64..4;
        prop_oneof![
            (id.clone(), any::<bool>()).prop_map(|(id, ghost)| Op::Spawn { id, ghost }),
            (id.clone(), 0.0..1000.0f64).prop_map(|(id, x)| Op::Move { id, x }),
            (id.clone(), 1u32..3).prop_map(|(id, t)| Op::Set { id, t }),
            (id.clone(), 1u32..3).prop_map(|(id, t)| Op::Remove { id, t }),
            id.clone().prop_map(|id| Op::Despawn { id }),
            id.clone().prop_map(|id| Op::ToGhost { id }),
            id.prop_map(|id| Op::ToLocal { id }),
        ]
    }

    fn apply(t: &mut EntityTable, op: &Op) {
        // Refused operations (a duplicate spawn, an unknown id) change nothing: ignored.
        let _ = match *op {
            Op::Spawn { id, ghost } => t.spawn(NewEntity {
                origin: ghost.then_some(9),
                ..npc(id, 1.0, 1.0)
            }),
            Op::Move { id, x } => t.update(EntityUpdate {
                id,
                position: Some(Position::new(x, 5.0, 0.0)),
                ..Default::default()
            }),
            Op::Set { id, t: ty } => t.update(EntityUpdate {
                id,
                changed: vec![(ty, public("s"))],
                ..Default::default()
            }),
            Op::Remove { id, t: ty } => t.update(EntityUpdate {
                id,
                removed: vec![ty],
                ..Default::default()
            }),
            Op::Despawn { id } => t.despawn(id).map(|_| ()),
            Op::ToGhost { id } => t
                .to_ghost(id, 9, 2)
                .then_some(())
                .ok_or(EntityError::Unknown(id)),
            Op::ToLocal { id } => t.to_local(npc(id, 2.0, 2.0)),
        };
        let ghosts = t.iter().filter(|e| e.is_ghost()).count();
        assert_eq!(t.ghost_count(), ghosts, "after {op:?}");
    }

    proptest::proptest! {
        /// Ghosts' changes taken part-way through a tick (any number of times, as peer frames
        /// arrive) and merged back with the rest at its end are what the tick records whole.
        #[test]
        fn changes_taken_in_parts_merge_to_the_whole_tick(
            start in proptest::collection::vec(op(), 0..8),
            tick in proptest::collection::vec((op(), proptest::bool::ANY), 0..24),
        ) {
            let (mut whole, mut parts) = (table(), table());
            for o in &start {
                apply(&mut whole, o);
                apply(&mut parts, o);
            }
            whole.take_changes();
            parts.take_changes();
            let mut merged = TickChanges::new();
            // A local entity handed away drops its tick's changes (the new owner sends them):
            // a history with one has nothing to compare after a take.
            for (o, take) in tick.iter().filter(|(o, _)| !matches!(o, Op::ToGhost { .. })) {
                apply(&mut whole, o);
                apply(&mut parts, o);
                if *take {
                    merge_changes(&mut merged, &parts.take_ghost_changes());
                }
            }
            merge_changes(&mut merged, &parts.take_changes());
            proptest::prop_assert_eq!(merged, whole.take_changes());
        }
    }

    #[test]
    fn ghost_changes_are_taken_apart_from_the_nodes_own() {
        let mut t = table();
        t.spawn(npc(1, 1.0, 1.0)).unwrap();
        for id in [2, 3] {
            t.spawn(NewEntity {
                origin: Some(9),
                ..npc(id, 1.0, 1.0)
            })
            .unwrap();
        }
        t.take_changes();
        for id in [1, 2] {
            t.update(EntityUpdate {
                id,
                position: Some(Position::new(40.0, 1.0, 0.0)),
                ..Default::default()
            })
            .unwrap();
        }
        t.despawn(3).unwrap();
        let ghosts = t.take_ghost_changes();
        assert_eq!(ghosts.keys().copied().collect::<Vec<_>>(), [2, 3]);
        assert!(ghosts[&2].moved && ghosts[&3].despawned);
        assert!(t.take_ghost_changes().is_empty());
        assert_eq!(t.take_changes().keys().copied().collect::<Vec<_>>(), [1]);
    }
}
