//! Folding a tick into one batch per client (docs/mesh.md#sessions-the-gateway-role).
//!
//! At `TickEnd` every client session gets, in one edge `Batch`, what changed for it (render
//! ghosts' changes are folded the same way as each peer frame brings them, between ticks):
//!
//! - `APPEAR`: an entity entered its view, with its full visible state;
//! - `UPDATE`: a seen entity moved or changed a component the client may see, or removed one it
//!   could see; an entity out of view whose non-public components name the client's account gets
//!   those as an `UPDATE` too (they reach their accounts wherever the entity is);
//! - `VANISH`: a seen entity left the view or was despawned;
//!
//! then the tick's events and account messages. Each distinct piece is encoded once and shared:
//! thirty clients watching one NPC walk share one encoded delta; only pieces whose contents differ
//! (an owner seeing its own inventory) are encoded per client.
//!
//! Pure: takes the entity table and the tick's changes, returns encoded frames per client.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::Arc;

use bytes::Bytes;
use cellmesh_proto::batch::{encode_delta, encode_event, encode_message, BatchWriter, Encoded};
use cellmesh_proto::edge::{
    self, AccountMessage, ComponentData, DeltaKind, EntityDelta, EventData,
};
use cellmesh_world::geometry::{ChunkPos, WorldShape};
use smallvec::SmallVec;

use crate::model::audience::Audience;
use crate::model::entities::{Entity, EntityChange, EntityTable, TickChanges};
use crate::model::interest::{InterestShape, View};

/// A node-local handle of one client session.
pub type ClientKey = u64;

/// A transient event of this tick, resolved against the entity when the game sent it.
#[derive(Debug, Clone)]
pub struct TickEvent {
    pub entity_id: u64,
    pub chunk: ChunkPos,
    pub owner_account: String,
    pub audience: Audience,
    pub r#type: u32,
    pub payload: Bytes,
}

/// A payload for accounts, wherever they are.
#[derive(Debug, Clone)]
pub struct TickSend {
    pub accounts: Vec<String>,
    pub r#type: u32,
    pub payload: Bytes,
}

#[derive(Debug, Default)]
pub struct FoldOutput {
    /// Encoded edge `ServerFrame` bodies, in client order; more than one for a client only when
    /// its batch would not fit one frame.
    pub frames: Vec<(ClientKey, Bytes)>,
    pub deltas: u64,
    pub events: u64,
    pub messages: u64,
    /// Deltas actually encoded (the rest were shared).
    pub deltas_encoded: u64,
    /// Updates held back for a later fold by the per-client budget.
    pub held_back: u64,
    /// `Send` recipients with no session on this node.
    pub unknown_accounts: u64,
}

#[derive(Debug)]
struct Client {
    account: Arc<str>,
    view: View,
    /// Entities this client was shown (APPEAR) and still holds.
    appeared: HashSet<u64>,
    /// Entities out of view of which it holds only non-public components.
    partial: HashSet<u64>,
    /// Shown entities whose updates were held back by the budget: id -> the tick since when.
    held_back: HashMap<u64, u64>,
    /// The tick the budget counts for, and the updates it spent in it.
    spent: (u64, u32),
}

/// Every client session of this node, with its view and what it was shown.
#[derive(Debug)]
pub struct Clients {
    world: WorldShape,
    shape: InterestShape,
    clients: BTreeMap<ClientKey, Client>,
    by_account: HashMap<String, ClientKey>,
    /// chunk -> clients whose view holds it.
    viewers: HashMap<ChunkPos, HashSet<ClientKey>>,
    /// entity -> clients holding some of its state.
    known_by: HashMap<u64, HashSet<ClientKey>>,
    /// Anchors of accounts whose avatar another node simulates (that node tells where it is).
    remote_anchors: HashMap<String, ChunkPos>,
    /// Pieces routed here by other nodes, for the next batch of each client.
    injected: BTreeMap<ClientKey, Vec<(Part, Encoded)>>,
    /// Chunks that came into some view or left the last one since
    /// [`Clients::take_flipped_chunks`]: only their subscriptions may need to change.
    flipped: HashSet<ChunkPos>,
    /// Updates of other entities each client is sent per tick at most (`None`: no bound).
    update_budget: Option<u32>,
}

impl Clients {
    pub fn new(world: WorldShape, shape: InterestShape) -> Self {
        Self {
            world,
            shape,
            clients: BTreeMap::new(),
            by_account: HashMap::default(),
            viewers: HashMap::default(),
            known_by: HashMap::default(),
            remote_anchors: HashMap::default(),
            injected: BTreeMap::new(),
            flipped: HashSet::default(),
            update_budget: None,
        }
    }

    /// Bounds the updates of other entities each client is sent per tick (0: no bound). Past
    /// it, the nearest go first and the rest wait (see [`hold_back`]).
    pub fn with_update_budget(mut self, per_tick: u32) -> Self {
        self.update_budget = (per_tick > 0).then_some(per_tick);
        self
    }

    /// The session of `account` on this node, if any.
    pub fn key_of(&self, account: &str) -> Option<ClientKey> {
        self.by_account.get(account).copied()
    }

    /// Where the avatar of `account` is when another node simulates it (`None`: forget it).
    pub fn set_remote_anchor(&mut self, account: &str, chunk: Option<ChunkPos>) {
        match chunk {
            Some(c) => self.remote_anchors.insert(account.to_string(), c),
            None => self.remote_anchors.remove(account),
        };
    }

    /// Queues an already-encoded piece for `key`'s next batch.
    pub fn inject(&mut self, key: ClientKey, part: Part, encoded: Encoded) {
        if self.clients.contains_key(&key) {
            self.injected.entry(key).or_default().push((part, encoded));
        }
    }

    /// Every chunk in some client's view.
    pub fn viewed_chunks(&self) -> impl Iterator<Item = ChunkPos> + '_ {
        self.viewers.keys().copied()
    }

    /// Whether some client's view holds `chunk`.
    pub fn is_viewed(&self, chunk: ChunkPos) -> bool {
        self.viewers.contains_key(&chunk)
    }

    /// The chunks that came into some view or left the last one since the last call (some
    /// may be back as they were).
    pub fn take_flipped_chunks(&mut self) -> HashSet<ChunkPos> {
        std::mem::take(&mut self.flipped)
    }

    /// Adds a session of `account`; it is shown its surroundings at the next fold.
    pub fn add(&mut self, key: ClientKey, account: &str) {
        self.remove(key);
        self.by_account.insert(account.to_string(), key);
        self.clients.insert(
            key,
            Client {
                account: account.into(),
                view: View::default(),
                appeared: HashSet::default(),
                partial: HashSet::default(),
                held_back: HashMap::default(),
                spent: (0, 0),
            },
        );
    }

    pub fn remove(&mut self, key: ClientKey) {
        let Some(c) = self.clients.remove(&key) else {
            return;
        };
        for chunk in c.view.chunks() {
            unview(&mut self.viewers, &mut self.flipped, chunk, key);
        }
        for id in c.appeared.iter().chain(c.partial.iter()) {
            unindex(&mut self.known_by, id, key);
        }
        if self.by_account.get(&*c.account) == Some(&key) {
            self.by_account.remove(&*c.account);
        }
        self.injected.remove(&key);
    }

    pub fn len(&self) -> usize {
        self.clients.len()
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// Chunks in the view of `key` (for the state page).
    pub fn view_len(&self, key: ClientKey) -> usize {
        self.clients.get(&key).map_or(0, |c| c.view.len())
    }

    /// Entities `key` was shown and still holds (for tests and the state page).
    pub fn shown(&self, key: ClientKey) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .clients
            .get(&key)
            .map(|c| c.appeared.iter().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// Folds one tick. `max_frame_bytes` bounds each returned frame (a batch that does not fit is
    /// split into several, in order).
    pub fn fold(
        &mut self,
        tick: u64,
        table: &EntityTable,
        changes: &TickChanges,
        events: &[TickEvent],
        sends: &[TickSend],
        max_frame_bytes: usize,
    ) -> FoldOutput {
        let Clients {
            world,
            shape,
            clients,
            by_account,
            viewers,
            known_by,
            remote_anchors,
            injected,
            flipped,
            update_budget,
        } = self;
        let (world, shape) = (*world, *shape);
        // (client, entity) pairs to decide, sorted and deduplicated below: far cheaper than a
        // set per client, with thousands of pairs a tick.
        let mut work: Vec<(ClientKey, u64)> = Vec::new();

        // Views follow their anchors first, so this tick's deltas use this tick's views.
        for (&key, c) in clients.iter_mut() {
            // The node's own avatar first, then what its simulating node said, then a ghost.
            let master = table.master_of(&c.account);
            let anchor = match master {
                Some(e) if e.origin().is_none() => Some(e.chunk),
                _ => remote_anchors
                    .get(&*c.account)
                    .copied()
                    .or(master.map(|e| e.chunk)),
            };
            let Some(anchor) = anchor else {
                continue;
            };
            let before = c.view.anchor();
            let change = c.view.move_anchor(&world, shape, anchor);
            if before == Some(anchor) {
                continue;
            }
            for chunk in &change.left {
                unview(viewers, flipped, *chunk, key);
            }
            for chunk in &change.entered {
                let viewing = viewers.entry(*chunk).or_insert_with(|| {
                    flipped.insert(*chunk);
                    HashSet::default()
                });
                viewing.insert(key);
                work.extend(table.residents(*chunk).map(|id| (key, id)));
            }
            // The anchor moved: whatever was shown may now be out of range.
            work.extend(c.appeared.iter().map(|&id| (key, id)));
            // The avatar the view now centres on comes with it: a new one (a spawn that has not
            // reached the tick's fold yet) may stand in chunks the view held already.
            if let Some(e) = master {
                work.push((key, e.id));
            }
        }

        // Then every changed entity, for each client it may concern.
        for (&id, ch) in changes {
            let mut concerned: Vec<ClientKey> = Vec::new();
            let entity = table.get(id);
            // A change of non-public components alone concerns only the accounts they name (now
            // or before): with no spawn, move or public piece, what anyone in range sees stays.
            let seen_in_range = entity.is_none_or(|e| seen_in_range(ch, e));
            if seen_in_range {
                if let Some(known) = known_by.get(&id) {
                    concerned.extend(known);
                }
            }
            if let Some(e) = entity {
                if let Some(v) = viewers.get(&e.chunk).filter(|_| seen_in_range) {
                    concerned.extend(v);
                }
                let mut named = |a: &Audience| {
                    for account in a.named_accounts(&e.owner_account) {
                        if let Some(&k) = by_account.get(account) {
                            concerned.push(k);
                        }
                    }
                };
                if ch.spawned {
                    e.components.values().for_each(|c| named(&c.audience));
                } else {
                    for (t, before) in &ch.components {
                        if let Some(c) = e.components.get(t) {
                            named(&c.audience);
                        }
                        if let Some(a) = before {
                            named(a);
                        }
                    }
                }
            }
            work.extend(concerned.into_iter().map(|k| (k, id)));
        }
        // Held-back updates are due at every fold until sent.
        for (&key, c) in clients.iter() {
            work.extend(c.held_back.keys().map(|&id| (key, id)));
        }
        work.sort_unstable();
        work.dedup();

        let mut out = FoldOutput::default();
        let mut cache: HashMap<DeltaKey, Encoded> = HashMap::default();
        let mut batches: BTreeMap<ClientKey, Outgoing> = BTreeMap::new();
        let budget = max_frame_bytes;
        let mut pieces = Vec::new();
        for pairs in work.chunk_by(|a, b| a.0 == b.0) {
            let key = pairs[0].0;
            let Some(client) = clients.get_mut(&key) else {
                continue;
            };
            // In id order, as `pairs` is sorted.
            let ids = pairs.iter().map(|&(_, id)| id);
            // The client's own avatar first: a client judges the rest of the batch (what left
            // a re-centred view) from where its avatar is.
            let own = table
                .master_of(&client.account)
                .map(|e| e.id)
                .filter(|id| pairs.binary_search(&(key, *id)).is_ok());
            let rest = ids.filter(|id| Some(*id) != own);
            for id in own.into_iter().chain(rest) {
                if !changes.contains_key(&id)
                    && table
                        .pending_changes()
                        .get(&id)
                        .is_some_and(|c| c.despawned)
                {
                    // A despawn (and respawn) still pending in the table, which this fold does
                    // not carry (a mid-tick fold of render ghosts' changes), is left to the fold
                    // that does: shown the entity now, the client would get it again there,
                    // after a vanish.
                    continue;
                }
                decide(
                    &world,
                    shape,
                    key,
                    client,
                    id,
                    changes.get(&id),
                    table,
                    known_by,
                    &mut pieces,
                );
            }
            if let Some(budget) = *update_budget {
                out.held_back += hold_back(&world, tick, budget, client, own, table, &mut pieces);
            }
            if pieces.is_empty() {
                continue;
            }
            let batch = batches
                .entry(key)
                .or_insert_with(|| Outgoing::new(tick, budget));
            for d in pieces.drain(..) {
                let encoded = cache.entry(d).or_insert_with_key(|d| {
                    out.deltas_encoded += 1;
                    encode_delta(&d.build(table))
                });
                batch.push(Part::Delta, encoded.clone());
                out.deltas += 1;
            }
        }

        for ev in events {
            let encoded = encode_event(&EventData {
                entity_id: ev.entity_id,
                r#type: ev.r#type,
                payload: ev.payload.clone(),
            });
            let mut to: BTreeSet<ClientKey> = BTreeSet::new();
            if ev.audience.is_public() {
                let near = viewers.get(&ev.chunk).into_iter().flatten();
                let knowing = known_by.get(&ev.entity_id).into_iter().flatten();
                for &k in near.chain(knowing) {
                    let c = &clients[&k];
                    if c.appeared.contains(&ev.entity_id) || c.view.holds(ev.chunk) {
                        to.insert(k);
                    }
                }
            } else {
                for account in ev.audience.named_accounts(&ev.owner_account) {
                    if let Some(&k) = by_account.get(account) {
                        to.insert(k);
                    }
                }
            }
            for k in to {
                batches
                    .entry(k)
                    .or_insert_with(|| Outgoing::new(tick, budget))
                    .push(Part::Event, encoded.clone());
                out.events += 1;
            }
        }

        for send in sends {
            let encoded = encode_message(&AccountMessage {
                r#type: send.r#type,
                payload: send.payload.clone(),
            });
            let mut to: BTreeSet<ClientKey> = BTreeSet::new();
            for account in &send.accounts {
                match by_account.get(account) {
                    Some(&k) => {
                        to.insert(k);
                    }
                    None => out.unknown_accounts += 1,
                }
            }
            for k in to {
                batches
                    .entry(k)
                    .or_insert_with(|| Outgoing::new(tick, budget))
                    .push(Part::Message, encoded.clone());
                out.messages += 1;
            }
        }

        for (key, pieces) in std::mem::take(injected) {
            if !clients.contains_key(&key) {
                continue;
            }
            let batch = batches
                .entry(key)
                .or_insert_with(|| Outgoing::new(tick, budget));
            for (part, encoded) in pieces {
                match part {
                    Part::Delta => out.deltas += 1,
                    Part::Event => out.events += 1,
                    Part::Message => out.messages += 1,
                }
                batch.push(part, encoded);
            }
        }

        for (key, batch) in batches {
            for w in batch.writers {
                out.frames.push((key, w.finish()));
            }
        }
        out
    }
}

/// Whether `ch` changes what a client in range of `e` sees whoever it is: a spawn, despawn or
/// move, or a component public now or before.
fn seen_in_range(ch: &EntityChange, e: &Entity) -> bool {
    ch.spawned
        || ch.despawned
        || ch.moved
        || ch.components.iter().any(|(t, before)| {
            before.as_ref().is_some_and(Audience::is_public)
                || e.components.get(t).is_some_and(|c| c.audience.is_public())
        })
}

/// `key`'s view left `chunk`; `flipped` notes it if no view holds it any more.
fn unview(
    viewers: &mut HashMap<ChunkPos, HashSet<ClientKey>>,
    flipped: &mut HashSet<ChunkPos>,
    chunk: ChunkPos,
    key: ClientKey,
) {
    unindex(viewers, &chunk, key);
    if !viewers.contains_key(&chunk) {
        flipped.insert(chunk);
    }
}

fn unindex<K: std::hash::Hash + Eq>(
    index: &mut HashMap<K, HashSet<ClientKey>>,
    k: &K,
    key: ClientKey,
) {
    if let Some(set) = index.get_mut(k) {
        set.remove(&key);
        if set.is_empty() {
            index.remove(k);
        }
    }
}

/// The content of one delta. Two clients with equal keys get byte-identical deltas, so the key
/// decides what is encoded once and shared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct DeltaKey {
    id: u64,
    kind: DeltaKind,
    position: bool,
    components: Types,
    removed: Types,
}

/// Component types of one delta: one or two nearly always, so kept inline.
type Types = SmallVec<[u32; 2]>;

impl DeltaKey {
    fn vanish(id: u64) -> Self {
        Self {
            id,
            kind: DeltaKind::Vanish,
            position: false,
            components: Types::new(),
            removed: Types::new(),
        }
    }

    fn build(&self, table: &EntityTable) -> EntityDelta {
        let mut d = EntityDelta {
            entity_id: self.id,
            kind: self.kind as i32,
            ..Default::default()
        };
        if self.kind == DeltaKind::Vanish {
            return d;
        }
        // Internal: `decide` makes such keys only for entities in `table`, which the fold does
        // not change.
        let e = table
            .get(self.id)
            .expect("deltas other than VANISH are built from live entities");
        if self.position {
            d.position = Some(edge::Vec3 {
                x: e.position.x,
                y: e.position.y,
                z: e.position.z,
            });
        }
        d.components = self
            .components
            .iter()
            .filter_map(|t| {
                e.components.get(t).map(|c| ComponentData {
                    r#type: *t,
                    payload: c.payload.clone(),
                })
            })
            .collect();
        d.removed_types = self.removed.to_vec();
        if self.kind == DeltaKind::Appear {
            d.owner_account = e.owner_account.to_string();
        }
        d
    }
}

/// Decides what `client` gets about entity `id` this tick, and updates what it holds.
#[allow(clippy::too_many_arguments)]
fn decide(
    world: &WorldShape,
    shape: InterestShape,
    key: ClientKey,
    client: &mut Client,
    id: u64,
    change: Option<&EntityChange>,
    table: &EntityTable,
    known_by: &mut HashMap<u64, HashSet<ClientKey>>,
    out: &mut Vec<DeltaKey>,
) {
    let mut forget = |client: &mut Client, out: &mut Vec<DeltaKey>| {
        if client.appeared.remove(&id) | client.partial.remove(&id) {
            unindex(known_by, &id, key);
            out.push(DeltaKey::vanish(id));
        }
    };
    if change.is_some_and(|c| c.despawned) {
        forget(client, out);
    }
    let Some(e) = table.get(id) else {
        forget(client, out);
        return;
    };
    let account = client.account.clone();
    let account = &*account;
    if client.appeared.contains(&id) {
        if client.view.keeps(world, shape, e.chunk) {
            if let Some(ch) = change {
                let (components, removed) = diff(ch, e, account, true);
                if ch.moved || !components.is_empty() || !removed.is_empty() {
                    out.push(DeltaKey {
                        id,
                        kind: DeltaKind::Update,
                        position: ch.moved,
                        components,
                        removed,
                    });
                }
            }
            return;
        }
        forget(client, out);
    } else if client.view.holds(e.chunk) {
        let components = visible(e, account, true);
        out.push(DeltaKey {
            id,
            kind: DeltaKind::Appear,
            position: true,
            components,
            removed: Types::new(),
        });
        client.partial.remove(&id);
        client.appeared.insert(id);
        known_by.entry(id).or_default().insert(key);
        return;
    }
    // Out of view: only what names this account.
    if client.partial.contains(&id) {
        if let Some(ch) = change {
            let (components, removed) = diff(ch, e, account, false);
            if !components.is_empty() || !removed.is_empty() {
                out.push(DeltaKey {
                    id,
                    kind: DeltaKind::Update,
                    position: false,
                    components,
                    removed,
                });
            }
        }
    } else {
        let components = visible(e, account, false);
        if !components.is_empty() {
            out.push(DeltaKey {
                id,
                kind: DeltaKind::Update,
                position: false,
                components,
                removed: Types::new(),
            });
            client.partial.insert(id);
            known_by.entry(id).or_default().insert(key);
        }
    }
}

/// Component types of `e` that `account` may see.
fn visible(e: &Entity, account: &str, in_range: bool) -> Types {
    e.components
        .iter()
        .filter(|(_, c)| c.audience.admits(account, &e.owner_account, in_range))
        .map(|(t, _)| *t)
        .collect()
}

/// Keeps `client`'s updates of other entities within `budget` per tick; returns how many it
/// held back. Appears, vanishes, the client's own avatar and removals always go. The rest, with
/// the entities held back before that are still shown, go nearest first (Chebyshev chunks from
/// the view's anchor), each tick an update waits counting as a chunk nearer, so a far entity is
/// late but never starved. An entity held back before is sent whole (position and every
/// component the client may see), which carries every change it missed: nothing is lost, only
/// late. Pure, like the rest of the fold.
fn hold_back(
    world: &WorldShape,
    tick: u64,
    budget: u32,
    client: &mut Client,
    own: Option<u64>,
    table: &EntityTable,
    pieces: &mut Vec<DeltaKey>,
) -> u64 {
    if client.spent.0 != tick {
        client.spent = (tick, 0);
    }
    let room = budget.saturating_sub(client.spent.1) as usize;
    let may_wait = |d: &DeltaKey, client: &Client| {
        d.kind == DeltaKind::Update
            && d.removed.is_empty()
            && Some(d.id) != own
            && client.appeared.contains(&d.id)
    };
    let waiting = pieces.iter().filter(|d| may_wait(d, client)).count();
    if client.held_back.is_empty() && waiting <= room {
        client.spent.1 += waiting as u32;
        return 0;
    }
    // (priority, id, the fresh delta if the entity was not held back before, since when)
    let mut candidates: Vec<(i64, u64, Option<DeltaKey>, u64)> = Vec::new();
    let mut kept = Vec::with_capacity(pieces.len());
    for d in pieces.drain(..) {
        if may_wait(&d, client) {
            let (id, since) = (d.id, client.held_back.remove(&d.id));
            candidates.push((0, id, since.is_none().then_some(d), since.unwrap_or(tick)));
            continue;
        }
        if let Some(_since) = client.held_back.remove(&d.id) {
            if d.kind == DeltaKind::Update {
                // A removal (or the avatar) goes now, with the whole state it missed.
                let e = table.get(d.id).expect("updates are of live entities");
                kept.push(DeltaKey {
                    position: true,
                    components: visible(e, &client.account, true),
                    ..d
                });
                continue;
            }
        }
        kept.push(d);
    }
    for (id, since) in std::mem::take(&mut client.held_back) {
        if client.appeared.contains(&id) && table.get(id).is_some() {
            candidates.push((0, id, None, since));
        }
    }
    let anchor = client.view.anchor();
    for c in &mut candidates {
        let chunk = table.get(c.1).map(|e| e.chunk);
        let distance = match (anchor, chunk) {
            (Some(a), Some(b)) => world.chunk_distance(a, b),
            _ => 0,
        };
        c.0 = distance - tick.saturating_sub(c.3) as i64;
    }
    candidates.sort_unstable_by_key(|c| (c.0, c.1));
    let mut held = 0;
    for (i, (_, id, fresh, since)) in candidates.into_iter().enumerate() {
        if i >= room {
            client.held_back.insert(id, since);
            held += 1;
            continue;
        }
        client.spent.1 += 1;
        kept.push(fresh.unwrap_or_else(|| {
            let e = table.get(id).expect("candidates are live entities");
            DeltaKey {
                id,
                kind: DeltaKind::Update,
                position: true,
                components: visible(e, &client.account, true),
                removed: Types::new(),
            }
        }));
    }
    *pieces = kept;
    held
}

/// This tick's component changes as `account` sees them: types to send, and types to remove
/// (gone, or no longer visible, but visible before).
fn diff(ch: &EntityChange, e: &Entity, account: &str, in_range: bool) -> (Types, Types) {
    let mut send = Types::new();
    let mut removed = Types::new();
    for (t, before) in &ch.components {
        match e.components.get(t) {
            Some(c) if c.audience.admits(account, &e.owner_account, in_range) => send.push(*t),
            _ => {
                if before
                    .as_ref()
                    .is_some_and(|a| a.admits(account, &e.owner_account, in_range))
                {
                    removed.push(*t);
                }
            }
        }
    }
    (send, removed)
}

/// The three kinds of piece in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Delta,
    Event,
    Message,
}

/// One client's batch for the tick, split into several writers only if it outgrows a frame.
struct Outgoing {
    tick: u64,
    budget: usize,
    writers: Vec<BatchWriter>,
    size: usize,
}

/// Frame, message and batch headers plus the tick, at their largest.
const BATCH_OVERHEAD: usize = 32;
/// A field key and its length varint, at their largest.
const PART_OVERHEAD: usize = 11;

impl Outgoing {
    fn new(tick: u64, budget: usize) -> Self {
        Self {
            tick,
            budget,
            writers: vec![BatchWriter::new(tick)],
            size: BATCH_OVERHEAD,
        }
    }

    fn push(&mut self, part: Part, bytes: Encoded) {
        let cost = bytes.0.len() + PART_OVERHEAD;
        let current = self.writers.last().expect("never empty");
        if !current.is_empty() && self.size + cost > self.budget {
            self.writers.push(BatchWriter::new(self.tick));
            self.size = BATCH_OVERHEAD;
        }
        self.size += cost;
        let w = self.writers.last_mut().expect("never empty");
        match part {
            Part::Delta => w.delta(bytes),
            Part::Event => w.event(bytes),
            Part::Message => w.message(bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::entities::{Component, EntityUpdate, NewEntity, Position};
    use cellmesh_proto::edge::{server_message, Batch, ServerFrame};
    use proptest::prelude::*;
    use prost::Message;

    const CS: f64 = 32.0;

    fn world() -> WorldShape {
        WorldShape {
            width: 2048.0,
            height: 2048.0,
            chunk_size: CS,
            region_size: 1024.0,
        }
    }

    struct Fixture {
        table: EntityTable,
        clients: Clients,
        tick: u64,
    }

    fn fixture() -> Fixture {
        Fixture {
            table: EntityTable::new(world()),
            clients: Clients::new(world(), InterestShape::new(5, 1)),
            tick: 0,
        }
    }

    /// Centre of chunk (cx, cy).
    fn at(cx: f64, cy: f64) -> Position {
        Position::new(cx * CS + CS / 2.0, cy * CS + CS / 2.0, 0.0)
    }

    fn comp(aud: Audience, payload: &str) -> Component {
        Component {
            audience: aud,
            payload: Bytes::from(payload.to_string()),
        }
    }

    fn party(a: &[&str]) -> std::sync::Arc<[String]> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn avatar(id: u64, account: &str, pos: Position) -> NewEntity {
        NewEntity {
            id,
            position: pos,
            owner_account: account.into(),
            is_master: true,
            components: vec![
                (1, comp(Audience::PublicInRange, account)),
                (2, comp(Audience::OwnerOnly, "inv")),
            ],
            ..Default::default()
        }
    }

    fn npc(id: u64, pos: Position) -> NewEntity {
        NewEntity {
            id,
            position: pos,
            components: vec![(1, comp(Audience::PublicInRange, "npc"))],
            ..Default::default()
        }
    }

    impl Fixture {
        fn run(&mut self) -> (BTreeMap<ClientKey, Vec<Batch>>, FoldOutput) {
            self.run_with(&[], &[])
        }

        fn run_with(
            &mut self,
            events: &[TickEvent],
            sends: &[TickSend],
        ) -> (BTreeMap<ClientKey, Vec<Batch>>, FoldOutput) {
            self.tick += 1;
            let changes = self.table.take_changes();
            let out = self
                .clients
                .fold(self.tick, &self.table, &changes, events, sends, 1 << 20);
            let mut by: BTreeMap<ClientKey, Vec<Batch>> = BTreeMap::new();
            for (k, bytes) in &out.frames {
                let frame = ServerFrame::decode(bytes.clone()).unwrap();
                let Some(server_message::Body::Batch(b)) = frame.messages[0].body.clone() else {
                    panic!()
                };
                assert_eq!(b.tick, self.tick);
                by.entry(*k).or_default().push(b);
            }
            (by, out)
        }
    }

    fn kinds(b: &Batch) -> Vec<(u64, DeltaKind)> {
        b.deltas.iter().map(|d| (d.entity_id, d.kind())).collect()
    }

    fn types(d: &EntityDelta) -> Vec<u32> {
        d.components.iter().map(|c| c.r#type).collect()
    }

    /// Every NPC of `ids` steps one metre east with a fresh public payload naming the step.
    fn step_all(f: &mut Fixture, ids: &[u64], step: u32) {
        for &id in ids {
            let p = f.table.get(id).unwrap().position;
            f.table
                .update(EntityUpdate {
                    id,
                    position: Some(Position::new(p.x + 1.0, p.y, 0.0)),
                    changed: vec![(1, comp(Audience::PublicInRange, &format!("s{step}")))],
                    removed: vec![],
                })
                .unwrap();
        }
    }

    #[test]
    fn past_the_budget_the_nearest_go_first_and_the_rest_come_whole_later() {
        let mut f = fixture();
        f.clients = Clients::new(world(), InterestShape::new(5, 1)).with_update_budget(4);
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        // Ten NPCs, the n-th n chunks east of the avatar's (n = 0..=4, two each).
        let ids: Vec<u64> = (0..10).map(|i| 200 + i).collect();
        for (i, &id) in ids.iter().enumerate() {
            f.table
                .spawn(npc(id, at(10.0 + (i / 2) as f64, 11.0)))
                .unwrap();
        }
        let (b, _) = f.run();
        assert_eq!(b[&1][0].deltas.len(), 11, "appears are never held back");

        // Everyone moves, the avatar too: its own update and four others go, nearest first.
        step_all(&mut f, &ids, 1);
        step_all(&mut f, &[100], 1);
        let (b, out) = f.run();
        let sent: Vec<u64> = b[&1][0].deltas.iter().map(|d| d.entity_id).collect();
        assert_eq!(sent, vec![100, 200, 201, 202, 203]);
        assert_eq!(out.held_back, 6);

        // Nothing moves: the waiting go, four a tick, each whole with its last state.
        let mut got: BTreeMap<u64, EntityDelta> = BTreeMap::new();
        for _ in 0..2 {
            let (b, _) = f.run();
            let deltas = &b[&1][0].deltas;
            assert!(deltas.len() <= 4, "{} deltas", deltas.len());
            for d in deltas {
                got.insert(d.entity_id, d.clone());
            }
        }
        assert_eq!(got.keys().copied().collect::<Vec<_>>(), ids[4..].to_vec());
        for d in got.values() {
            assert_eq!(d.kind(), DeltaKind::Update);
            let p = f.table.get(d.entity_id).unwrap().position;
            assert_eq!(
                d.position.as_ref().map(|v| v.x),
                Some(p.x),
                "the latest position"
            );
            assert_eq!(d.components[0].payload, Bytes::from("s1"));
        }
        let (b, out) = f.run();
        assert!(!b.contains_key(&1), "nothing left to send");
        assert_eq!(out.held_back, 0);
    }

    #[test]
    fn a_far_entity_held_back_is_late_but_never_starved() {
        let mut f = fixture();
        f.clients = Clients::new(world(), InterestShape::new(5, 1)).with_update_budget(2);
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        // Two NPCs by the avatar move every tick; one four chunks away too.
        let ids = [200, 201, 202];
        f.table.spawn(npc(200, at(10.0, 11.0))).unwrap();
        f.table.spawn(npc(201, at(11.0, 10.0))).unwrap();
        f.table.spawn(npc(202, at(14.0, 10.0))).unwrap();
        f.run();
        let mut far_sent = 0;
        for step in 1..=12 {
            step_all(&mut f, &ids, step);
            let (b, _) = f.run();
            let deltas = &b[&1][0].deltas;
            assert_eq!(deltas.len(), 2);
            far_sent += deltas.iter().filter(|d| d.entity_id == 202).count();
        }
        assert!(
            far_sent >= 2,
            "the far NPC was sent {far_sent} times in 12 ticks"
        );
    }

    #[test]
    fn a_held_back_entity_that_leaves_or_goes_is_not_sent_again() {
        let mut f = fixture();
        f.clients = Clients::new(world(), InterestShape::new(5, 1)).with_update_budget(1);
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        f.table.spawn(npc(200, at(11.0, 10.0))).unwrap();
        f.table.spawn(npc(201, at(13.0, 10.0))).unwrap();
        f.table.spawn(npc(202, at(14.0, 10.0))).unwrap();
        f.run();
        step_all(&mut f, &[200, 201, 202], 1);
        let (_, out) = f.run();
        assert_eq!(out.held_back, 2);
        // 201 is despawned and 202 walks out of sight: each vanishes once, and no held-back
        // update follows.
        f.table.despawn(201).unwrap();
        f.table
            .update(EntityUpdate {
                id: 202,
                position: Some(at(30.0, 10.0)),
                changed: vec![],
                removed: vec![],
            })
            .unwrap();
        let (b, _) = f.run();
        let k = kinds(&b[&1][0]);
        assert!(
            k.contains(&(201, DeltaKind::Vanish)) && k.contains(&(202, DeltaKind::Vanish)),
            "{k:?}"
        );
        for _ in 0..3 {
            let (b, _) = f.run();
            assert!(b.get(&1).is_none_or(|bs| bs
                .iter()
                .all(|b| b.deltas.iter().all(|d| d.entity_id == 200))));
        }
        assert!(f.clients.clients[&1].held_back.is_empty());
    }

    #[test]
    fn appear_update_vanish_in_one_batch_per_tick() {
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        f.table.spawn(npc(200, at(15.0, 10.0))).unwrap();
        f.table.spawn(npc(201, at(17.0, 10.0))).unwrap();
        let (b, _) = f.run();
        assert_eq!(b[&1].len(), 1);
        assert_eq!(
            kinds(&b[&1][0]),
            [(100, DeltaKind::Appear), (200, DeltaKind::Appear)]
        );
        let me = &b[&1][0].deltas[0];
        assert_eq!(types(me), [1, 2], "the owner sees its own inventory");
        assert_eq!(me.owner_account, "alice");
        assert!(me.position.is_some());

        // Nothing changed: no batch at all.
        assert!(f.run().0.is_empty());

        // 200 moves to 6 chunks away: it stays (hysteresis); 201 moves into range and appears.
        f.table
            .update(EntityUpdate {
                id: 200,
                position: Some(at(16.0, 10.0)),
                ..Default::default()
            })
            .unwrap();
        f.table
            .update(EntityUpdate {
                id: 201,
                position: Some(at(14.0, 12.0)),
                ..Default::default()
            })
            .unwrap();
        let (b, _) = f.run();
        assert_eq!(
            kinds(&b[&1][0]),
            [(200, DeltaKind::Update), (201, DeltaKind::Appear)]
        );
        assert!(b[&1][0].deltas[0].position.is_some() && b[&1][0].deltas[0].components.is_empty());

        // 7 away: vanishes. 201 despawned: vanishes.
        f.table
            .update(EntityUpdate {
                id: 200,
                position: Some(at(17.0, 10.0)),
                ..Default::default()
            })
            .unwrap();
        f.table.despawn(201).unwrap();
        let (b, _) = f.run();
        assert_eq!(
            kinds(&b[&1][0]),
            [(200, DeltaKind::Vanish), (201, DeltaKind::Vanish)]
        );
        assert_eq!(f.clients.shown(1), [100]);
    }

    #[test]
    fn a_view_recentred_on_a_new_avatar_brings_it_first() {
        // The session's old avatar is a ghost of a dead writer; a new one is spawned here, in
        // chunks the view holds already, and a ghost's change is folded before the tick ends.
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.table
            .spawn(NewEntity {
                origin: Some(2),
                ..avatar(300, "alice", at(10.0, 10.0))
            })
            .unwrap();
        f.table
            .spawn(NewEntity {
                origin: Some(2),
                ..npc(200, at(6.0, 10.0))
            })
            .unwrap();
        f.run();
        f.table.spawn(avatar(400, "alice", at(14.0, 10.0))).unwrap();
        f.table
            .update(EntityUpdate {
                id: 200,
                position: Some(at(5.0, 10.0)),
                ..Default::default()
            })
            .unwrap();
        let changes = f.table.take_ghost_changes();
        let out = f
            .clients
            .fold(f.tick + 1, &f.table, &changes, &[], &[], 1 << 20);
        let frame = ServerFrame::decode(out.frames[0].1.clone()).unwrap();
        let Some(server_message::Body::Batch(b)) = frame.messages[0].body.clone() else {
            panic!()
        };
        // The view moved four chunks east: the ghost 200 nine chunks west of the new avatar
        // leaves it, and the new avatar comes first, with its owner named.
        assert_eq!(
            kinds(&b),
            [(400, DeltaKind::Appear), (200, DeltaKind::Vanish)]
        );
        assert_eq!(b.deltas[0].owner_account, "alice");
    }

    #[test]
    fn the_view_follows_the_anchor_across_the_seam() {
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(1.0, 0.0))).unwrap();
        f.table.spawn(npc(200, at(60.0, 63.0))).unwrap(); // 5 west and 1 south across both seams
        f.table.spawn(npc(201, at(6.0, 0.0))).unwrap();
        let (b, _) = f.run();
        assert_eq!(
            kinds(&b[&1][0]),
            [
                (100, DeltaKind::Appear),
                (200, DeltaKind::Appear),
                (201, DeltaKind::Appear)
            ]
        );
        // Walk west across the seam: 201 is 6 then 7 away.
        f.table
            .update(EntityUpdate {
                id: 100,
                position: Some(at(0.0, 0.0)),
                ..Default::default()
            })
            .unwrap();
        let (b, _) = f.run();
        assert_eq!(kinds(&b[&1][0]), [(100, DeltaKind::Update)]);
        f.table
            .update(EntityUpdate {
                id: 100,
                position: Some(at(-1.0, 0.0)),
                ..Default::default()
            })
            .unwrap();
        let (b, _) = f.run();
        assert_eq!(
            kinds(&b[&1][0]),
            [(100, DeltaKind::Update), (201, DeltaKind::Vanish)]
        );
        assert_eq!(
            b[&1][0].deltas[0].position.as_ref().unwrap().x,
            63.0 * CS + CS / 2.0
        );
    }

    #[test]
    fn audiences_pick_their_clients() {
        let mut f = fixture();
        for (k, a) in [(1, "alice"), (2, "bob"), (3, "carol"), (4, "dave")] {
            f.clients.add(k, a);
        }
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        f.table.spawn(avatar(101, "bob", at(12.0, 10.0))).unwrap();
        f.table.spawn(avatar(102, "carol", at(40.0, 40.0))).unwrap(); // far from everyone
        f.table.spawn(avatar(103, "dave", at(11.0, 11.0))).unwrap();
        f.run();
        // Alice gets a party health bar (bob in party) and a letter for carol only.
        f.table
            .update(EntityUpdate {
                id: 100,
                changed: vec![
                    (3, comp(Audience::OwnerAndParty(party(&["bob"])), "hp")),
                    (4, comp(Audience::Accounts(party(&["carol"])), "letter")),
                ],
                ..Default::default()
            })
            .unwrap();
        let (b, _) = f.run();
        let delta = |k: ClientKey| {
            b.get(&k)
                .map(|v| (v[0].deltas[0].kind(), types(&v[0].deltas[0])))
        };
        assert_eq!(delta(1), Some((DeltaKind::Update, vec![3])), "owner");
        assert_eq!(
            delta(2),
            Some((DeltaKind::Update, vec![3])),
            "party member in view"
        );
        assert_eq!(
            delta(3),
            Some((DeltaKind::Update, vec![4])),
            "listed account, out of view"
        );
        assert_eq!(delta(4), None, "a stranger in view sees none of it");

        // Owner-only inventory change: only alice.
        f.table
            .update(EntityUpdate {
                id: 100,
                changed: vec![(2, comp(Audience::OwnerOnly, "inv2"))],
                ..Default::default()
            })
            .unwrap();
        let (b, _) = f.run();
        assert_eq!(b.keys().copied().collect::<Vec<_>>(), [1]);

        // Turning the public name owner-only removes it from the strangers' view.
        f.table
            .update(EntityUpdate {
                id: 100,
                changed: vec![(1, comp(Audience::OwnerOnly, "x"))],
                ..Default::default()
            })
            .unwrap();
        let (b, _) = f.run();
        assert_eq!(types(&b[&1][0].deltas[0]), [1]);
        assert_eq!(b[&2][0].deltas[0].removed_types, [1]);
        assert_eq!(b[&4][0].deltas[0].removed_types, [1]);
        assert!(!b.contains_key(&3), "carol never saw it");
    }

    #[test]
    fn out_of_view_partial_state_then_appear() {
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        let mut pet = npc(300, at(30.0, 10.0));
        pet.components
            .push((5, comp(Audience::Accounts(party(&["alice"])), "pet-hp")));
        f.table.spawn(pet).unwrap();
        let (b, _) = f.run();
        let d = &b[&1][0].deltas[1];
        assert_eq!(
            (d.entity_id, d.kind(), types(d)),
            (300, DeltaKind::Update, vec![5])
        );
        assert!(d.position.is_none(), "out of view: no position");
        // It walks into view: full appear, public part included.
        f.table
            .update(EntityUpdate {
                id: 300,
                position: Some(at(14.0, 10.0)),
                ..Default::default()
            })
            .unwrap();
        let (b, _) = f.run();
        let d = &b[&1][0].deltas[0];
        assert_eq!((d.kind(), types(d)), (DeltaKind::Appear, vec![1, 5]));
        // Despawned: vanishes.
        f.table.despawn(300).unwrap();
        let (b, _) = f.run();
        assert_eq!(kinds(&b[&1][0]), [(300, DeltaKind::Vanish)]);
    }

    #[test]
    fn shared_deltas_are_encoded_once() {
        let mut f = fixture();
        for k in 0..30u64 {
            f.clients.add(k, &format!("p{k}"));
            f.table
                .spawn(avatar(1000 + k, &format!("p{k}"), at(10.0, 10.0)))
                .unwrap();
        }
        f.table.spawn(npc(1, at(12.0, 12.0))).unwrap();
        f.run();
        f.table
            .update(EntityUpdate {
                id: 1,
                position: Some(at(12.5, 12.0)),
                ..Default::default()
            })
            .unwrap();
        let (b, out) = f.run();
        assert_eq!(b.len(), 30);
        assert_eq!((out.deltas, out.deltas_encoded), (30, 1));
        // Each avatar's appear: its owner sees the inventory (per-client), the 29 others share one.
        f.table.spawn(avatar(2000, "late", at(10.0, 10.0))).unwrap();
        let (_, out) = f.run();
        assert_eq!(
            (out.deltas, out.deltas_encoded),
            (30, 1),
            "nobody is `late`'s client"
        );
    }

    #[test]
    fn respawn_within_a_tick_vanishes_then_appears() {
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        f.table.spawn(npc(200, at(11.0, 10.0))).unwrap();
        f.run();
        f.table.despawn(200).unwrap();
        f.table.spawn(npc(200, at(12.0, 10.0))).unwrap();
        let (b, _) = f.run();
        assert_eq!(
            kinds(&b[&1][0]),
            [(200, DeltaKind::Vanish), (200, DeltaKind::Appear)]
        );
    }

    /// geos seed 146: a ghost dropped (gone from its owner's view of this node's subscriptions)
    /// and adopted here from its snapshot in the same tick is a respawn the tick's end carries.
    /// A client whose first view a mid-tick fold of ghosts' changes showed it was then sent a
    /// vanish and a new appear of the entity it had just been shown.
    #[test]
    fn a_respawn_pending_in_the_table_is_shown_once_by_the_fold_that_carries_it() {
        let mut f = fixture();
        f.table
            .spawn(NewEntity {
                origin: Some(2),
                ..npc(200, at(11.0, 10.0))
            })
            .unwrap();
        f.run();
        f.table.despawn(200).unwrap();
        f.table.spawn(npc(200, at(11.0, 10.0))).unwrap();
        f.clients.add(1, "alice");
        f.clients
            .set_remote_anchor("alice", Some(ChunkPos { x: 10, y: 10 }));
        let ghosts = f.table.take_ghost_changes();
        let mid = f.clients.fold(f.tick, &f.table, &ghosts, &[], &[], 1 << 20);
        let (end, _) = f.run();
        let mut shown = Vec::new();
        for (_, bytes) in &mid.frames {
            let frame = ServerFrame::decode(bytes.clone()).unwrap();
            for m in frame.messages {
                if let Some(server_message::Body::Batch(b)) = m.body {
                    shown.extend(kinds(&b));
                }
            }
        }
        shown.extend(end.get(&1).into_iter().flatten().flat_map(kinds));
        assert_eq!(shown, [(200, DeltaKind::Appear)]);
    }

    #[test]
    fn events_and_sends() {
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.clients.add(2, "bob");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        f.table.spawn(avatar(101, "bob", at(40.0, 40.0))).unwrap();
        f.table.spawn(npc(200, at(11.0, 10.0))).unwrap();
        f.run();
        let ev = |aud: Audience| TickEvent {
            entity_id: 200,
            chunk: ChunkPos { x: 11, y: 10 },
            owner_account: String::new(),
            audience: aud,
            r#type: 9,
            payload: Bytes::from_static(b"boom"),
        };
        let sends = [TickSend {
            accounts: vec!["bob".into(), "zed".into(), "bob".into()],
            r#type: 4,
            payload: Bytes::from_static(b"hi"),
        }];
        let (b, out) = f.run_with(
            &[
                ev(Audience::PublicInRange),
                ev(Audience::Accounts(party(&["bob"]))),
            ],
            &sends,
        );
        assert_eq!(b[&1][0].events.len(), 1);
        assert!(b[&1][0].messages.is_empty());
        assert_eq!(b[&2][0].events.len(), 1, "named account, far away");
        assert_eq!(b[&2][0].messages.len(), 1, "once, though named twice");
        assert_eq!(out.unknown_accounts, 1);
    }

    #[test]
    fn a_batch_too_big_for_one_frame_is_split_in_order() {
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        for i in 0..50u64 {
            let mut n = npc(200 + i, at(10.0, 11.0));
            n.components = vec![(1, comp(Audience::PublicInRange, &"x".repeat(1000)))];
            f.table.spawn(n).unwrap();
        }
        let changes = f.table.take_changes();
        let out = f.clients.fold(1, &f.table, &changes, &[], &[], 8 * 1024);
        assert!(out.frames.len() >= 7, "{} frames", out.frames.len());
        let mut ids = Vec::new();
        for (_, bytes) in &out.frames {
            assert!(bytes.len() <= 8 * 1024);
            let frame = ServerFrame::decode(bytes.clone()).unwrap();
            let Some(server_message::Body::Batch(b)) = frame.messages[0].body.clone() else {
                panic!()
            };
            ids.extend(b.deltas.iter().map(|d| d.entity_id));
        }
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(ids, sorted);
        assert_eq!(ids.len(), 51);
    }

    #[test]
    fn removing_a_client_drops_its_indexes() {
        let mut f = fixture();
        f.clients.add(1, "alice");
        f.table.spawn(avatar(100, "alice", at(10.0, 10.0))).unwrap();
        f.run();
        f.clients.remove(1);
        assert!(
            f.clients.viewers.is_empty()
                && f.clients.known_by.is_empty()
                && f.clients.by_account.is_empty()
        );
        // A new session of the same account is shown everything again.
        f.clients.add(2, "alice");
        let (b, _) = f.run();
        assert_eq!(kinds(&b[&2][0]), [(100, DeltaKind::Appear)]);
    }

    /// (shown in view?, position, components) of one entity, as a client holds it.
    type Held = (bool, Option<(f64, f64)>, BTreeMap<u32, Bytes>);

    /// What a client rebuilds from its batches.
    #[derive(Debug, Default)]
    struct Mirror(BTreeMap<u64, Held>);

    impl Mirror {
        fn apply(&mut self, b: &Batch) {
            for d in &b.deltas {
                let pos = d.position.as_ref().map(|p| (p.x, p.y));
                match d.kind() {
                    DeltaKind::Appear => {
                        let comps = d
                            .components
                            .iter()
                            .map(|c| (c.r#type, c.payload.clone()))
                            .collect();
                        self.0.insert(d.entity_id, (true, pos, comps));
                    }
                    DeltaKind::Update => {
                        let e = self.0.entry(d.entity_id).or_default();
                        if pos.is_some() {
                            e.1 = pos;
                        }
                        for c in &d.components {
                            e.2.insert(c.r#type, c.payload.clone());
                        }
                        for t in &d.removed_types {
                            e.2.remove(t);
                        }
                    }
                    DeltaKind::Vanish => {
                        self.0.remove(&d.entity_id);
                    }
                }
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Walk(i64, i64),
        Move(u64, i64, i64),
        Toggle(u64, i64, i64),
        Public(u64, u8),
        Letter(u64, bool),
        Hide(u64, bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        let id = 2u64..10;
        prop_oneof![
            (-2i64..=2, -2i64..=2).prop_map(|(x, y)| Op::Walk(x, y)),
            (id.clone(), -4i64..=4, -4i64..=4).prop_map(|(i, x, y)| Op::Move(i, x, y)),
            (id.clone(), -9i64..=9, -9i64..=9).prop_map(|(i, x, y)| Op::Toggle(i, x, y)),
            (id.clone(), any::<u8>()).prop_map(|(i, p)| Op::Public(i, p)),
            (id.clone(), any::<bool>()).prop_map(|(i, b)| Op::Letter(i, b)),
            (id, any::<bool>()).prop_map(|(i, b)| Op::Hide(i, b)),
        ]
    }

    /// Runs `ticks` of game operations against a client with `budget` updates a tick (0: no
    /// bound) and checks its mirror after each (after the quiet ticks that send what waits).
    fn mirror_run(ticks: Vec<Vec<Op>>, budget: u32) -> Result<(), TestCaseError> {
        let mut f = fixture();
        f.clients = Clients::new(world(), InterestShape::new(5, 1)).with_update_budget(budget);
        let shape = InterestShape::new(5, 1);
        f.clients.add(1, "alice");
        f.table.spawn(avatar(1, "alice", at(20.0, 20.0))).unwrap();
        let mut mirror = Mirror::default();
        let mut shown_before: BTreeSet<u64> = BTreeSet::new();
        let shift = |p: Position, dx: i64, dy: i64| {
            Position::new(p.x + dx as f64 * CS, p.y + dy as f64 * CS, 0.0)
        };
        for ops in ticks {
            // A despawned entity is a new incarnation if spawned again: no hysteresis owed.
            let mut toggled: BTreeSet<u64> = BTreeSet::new();
            for op in ops {
                let t = &mut f.table;
                let pos = |t: &EntityTable, id: u64| t.get(id).map(|e| e.position);
                match op {
                    Op::Walk(x, y) => {
                        let p = pos(t, 1).unwrap();
                        t.update(EntityUpdate {
                            id: 1,
                            position: Some(shift(p, x, y)),
                            ..Default::default()
                        })
                        .unwrap();
                    }
                    Op::Move(i, x, y) => {
                        if let Some(p) = pos(t, i) {
                            t.update(EntityUpdate {
                                id: i,
                                position: Some(shift(p, x, y)),
                                ..Default::default()
                            })
                            .unwrap();
                        }
                    }
                    Op::Toggle(i, x, y) => {
                        toggled.insert(i);
                        if t.get(i).is_some() {
                            t.despawn(i).unwrap();
                        } else {
                            let p = shift(pos(t, 1).unwrap(), x, y);
                            t.spawn(npc(i, p)).unwrap();
                        }
                    }
                    Op::Public(i, v) => {
                        let _ = t.update(EntityUpdate {
                            id: i,
                            changed: vec![(1, comp(Audience::PublicInRange, &v.to_string()))],
                            ..Default::default()
                        });
                    }
                    Op::Letter(i, on) => {
                        let u = if on {
                            EntityUpdate {
                                id: i,
                                changed: vec![(
                                    5,
                                    comp(Audience::Accounts(party(&["alice"])), "letter"),
                                )],
                                ..Default::default()
                            }
                        } else {
                            EntityUpdate {
                                id: i,
                                removed: vec![5],
                                ..Default::default()
                            }
                        };
                        let _ = t.update(u);
                    }
                    Op::Hide(i, hidden) => {
                        let aud = if hidden {
                            Audience::OwnerOnly
                        } else {
                            Audience::PublicInRange
                        };
                        let _ = t.update(EntityUpdate {
                            id: i,
                            changed: vec![(3, comp(aud, "cloak"))],
                            ..Default::default()
                        });
                    }
                }
            }
            let (b, mut out) = f.run();
            for batch in b.get(&1).into_iter().flatten() {
                mirror.apply(batch);
            }
            // Quiet ticks until nothing waits: every held-back update arrives, whole.
            let mut quiet = 0;
            while out.held_back > 0 {
                quiet += 1;
                prop_assert!(quiet <= 20, "updates still held back after 20 quiet ticks");
                let b;
                (b, out) = f.run();
                for batch in b.get(&1).into_iter().flatten() {
                    mirror.apply(batch);
                }
            }
            let anchor = f.table.get(1).unwrap().chunk;
            for e in f.table.iter() {
                let d = world().chunk_distance(anchor, e.chunk);
                let want = |in_range: bool| -> BTreeMap<u32, Bytes> {
                    e.components
                        .iter()
                        .filter(|(_, c)| c.audience.admits("alice", &e.owner_account, in_range))
                        .map(|(t, c)| (*t, c.payload.clone()))
                        .collect()
                };
                match mirror.0.get(&e.id) {
                    Some((true, p, comps)) => {
                        prop_assert!(
                            d <= shape.release(),
                            "entity {} shown {} chunks away",
                            e.id,
                            d
                        );
                        prop_assert_eq!(*p, Some((e.position.x, e.position.y)));
                        prop_assert_eq!(comps, &want(true));
                    }
                    Some((false, p, comps)) => {
                        prop_assert!(
                            d > shape.radius,
                            "entity {} within range but not shown",
                            e.id
                        );
                        prop_assert!(p.is_none());
                        prop_assert_eq!(comps, &want(false));
                    }
                    None => {
                        prop_assert!(d > shape.radius, "entity {} within range but unknown", e.id);
                        prop_assert!(
                            want(false).is_empty(),
                            "entity {} names alice but she has nothing",
                            e.id
                        );
                    }
                }
            }
            for id in mirror.0.keys() {
                prop_assert!(
                    f.table.get(*id).is_some(),
                    "entity {} is gone but still held",
                    id
                );
            }
            // Hysteresis: once shown, an entity stays shown until past the release distance.
            let shown: BTreeSet<u64> = mirror
                .0
                .iter()
                .filter(|(_, e)| e.0)
                .map(|(id, _)| *id)
                .collect();
            for id in shown_before.difference(&toggled) {
                if let Some(e) = f.table.get(*id) {
                    if world().chunk_distance(anchor, e.chunk) <= shape.release() {
                        prop_assert!(
                            shown.contains(id),
                            "entity {} dropped within the release distance",
                            id
                        );
                    }
                }
            }
            shown_before = shown;
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Whatever the game does, a client that applies its batches holds exactly what it may
        /// see: everything within the radius with its current state, nothing past the release
        /// distance but what names its account, and no entity that is gone.
        #[test]
        fn a_client_mirror_matches_what_it_may_see(ticks in proptest::collection::vec(proptest::collection::vec(op(), 0..6), 1..25)) {
            mirror_run(ticks, 0)?;
        }

        /// With a budget of one update a tick, the same holds once what waits was sent.
        #[test]
        fn a_budgeted_client_mirror_matches_once_the_held_back_arrive(ticks in proptest::collection::vec(proptest::collection::vec(op(), 0..6), 1..25)) {
            mirror_run(ticks, 1)?;
        }
    }
}
